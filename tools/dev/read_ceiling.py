"""How fast a kernel can read N bytes on this device, launch included: the ceiling of gemv_4bit and
gemm_w4a8 at their goal shapes, whose weights (30-140 MB) are far smaller than the 2 GiB copy that
PERFORMANCE.md's percentages use.

A read-only streaming kernel (16-byte loads, 4 in flight per thread, grid-stride, one word per
thread written so the loads stay), timed with CUDA events behind a sleep kernel (median of 30) as
the bench times quantcore's kernels, over 4 buffers in rotation (more than L2 holds), at 2 / 4 / 8
CTAs of 256 per multiprocessor; torch's device-to-device copy of the same bytes alongside.
Run on the GPU machine: cd tools/dev && python3 read_ceiling.py
"""

import statistics

import cupy as cp
import torch
from bnb4_time import timed as bnb4_timed  # this directory (scripts run as files)

SRC = r"""
extern "C" __global__ void __launch_bounds__(256) read_kernel(const uint4* __restrict__ in, long long n16, unsigned* sink) {
    const long long stride = (long long)gridDim.x * 256;
    unsigned acc = 0;
    for (long long i0 = (long long)blockIdx.x * 256 * 4 + threadIdx.x; i0 < n16; i0 += stride * 4) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const long long i = i0 + j * 256;
            v[j] = i < n16 ? __ldg(in + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    sink[(long long)blockIdx.x * 256 + threadIdx.x] = acc;
}
"""
mod = cp.RawModule(code=SRC, options=("-std=c++17",))
read_kernel = mod.get_function("read_kernel")


def timed(fn, reps=30) -> float:
    """Median GPU time (us) of ``fn`` behind a sleep kernel: bnb4_time.timed's samples."""
    return statistics.median(bnb4_timed(fn, reps))


# (label, bytes): gemv_4bit 14336x4096 and 16384^2 (packed + nested statistics), gemm_w4a8's Q4_0
# weights at 4096x14336, and 1 GiB
SIZES = [("gemv 14336x4096", 30_300_000), ("w4a8 4096x14336", 33_030_144), ("gemv 16384^2", 138_500_000),
         ("1 GiB", 1 << 30)]


def copy_rate() -> float:
    """GB/s of torch's 2 GiB device-to-device copy (bytes read + written), the best of two."""
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    copy_us = min(timed(lambda: big2.copy_(big)) for _ in range(2))
    print(f"device {torch.cuda.get_device_name()}: copy 2 GiB {copy_us:.1f} us = {2 * (1 << 30) / copy_us / 1e3:.0f} GB/s")
    return 2 * (1 << 30) / copy_us / 1e3


def one_size(label: str, nbytes: int, copy: float, sms: int, stream, sink: torch.Tensor) -> None:
    n16 = nbytes // 16
    bufs = [torch.empty(n16 * 16, dtype=torch.uint8, device="cuda").fill_(i + 1) for i in range(4)]
    outs = [torch.empty_like(b) for b in bufs]
    res = []
    for per_sm in (2, 4, 8):
        calls = iter(range(1 << 30))

        def run(grid=(sms * per_sm,), calls=calls):
            b = bufs[next(calls) % 4]
            read_kernel(grid, (256,), (cp.uint64(b.data_ptr()), cp.int64(n16), cp.uint64(sink.data_ptr())),
                        stream=stream)

        t = timed(run)
        gbs = nbytes / t / 1e3
        res.append(f"{per_sm}/SM {t:6.1f} us {gbs:5.0f} GB/s ({100 * gbs / copy:5.1f}%)")
    copies = iter(range(1 << 30))

    def tcopy():
        i = next(copies) % 4
        outs[i].copy_(bufs[i])

    tc = timed(tcopy)
    gbs = 2 * nbytes / tc / 1e3
    print(f"read {label:16s} {nbytes / 1e6:7.1f} MB: " + " | ".join(res)
          + f" | torch copy {tc:6.1f} us = {gbs:5.0f} GB/s ({100 * gbs / copy:5.1f}%)")


def main() -> None:
    copy = copy_rate()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    sink = torch.empty(sms * 8 * 256, dtype=torch.int32, device="cuda")
    for label, nbytes in SIZES:
        one_size(label, nbytes, copy, sms, stream, sink)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
