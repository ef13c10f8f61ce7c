"""The memory system's rate for streams of a given read : write mix (issue 20 item 3: is 85% of copy
reachable for MX dequantize, whose stream is ~1 byte read for 3.6-3.8 written at FP4 and ~1 for 2 at
MXFP8, against the copy's 1 : 1?). A grid-stride kernel reads R and writes W 16-byte units per step,
each from / to its own plane so that every warp-wide load and store covers 512 consecutive bytes (as
mx_dequantize's do; plain or evict-first `.cs` stores), over 512 MiB of writes; GB/s of all bytes moved and % of the copy
kernel (1 : 1) in the same process. CUDA events, median of 20 after a warm-up.

    python3 tools/dev/bw_mix.py [--mib 512]
"""

import argparse

import cupy as cp

SRC = r"""
extern "C" __global__ void mix(const uint4* __restrict__ src, uint4* __restrict__ dst, long long steps) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long s = (long long)blockIdx.x * blockDim.x + threadIdx.x; s < steps; s += stride) {
        uint4 acc = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            uint4 v = __ldg(src + (long long)r * steps + s);
            acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
        }
#pragma unroll
        for (int w = 0; w < W; ++w) {
            uint4 v = make_uint4(acc.x + w, acc.y, acc.z, acc.w + (unsigned)s);
            uint4* p = dst + (long long)w * steps + s;
#if CS
            asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                         "r"(v.w) : "memory");
#else
            *p = v;
#endif
        }
    }
}
"""


def rate(r: int, w: int, cs: bool, write_bytes: int, sms: int) -> float:
    """GB/s of read + written bytes for an R : W mix."""
    k = cp.RawKernel(SRC, "mix", options=(f"-DR={r}", f"-DW={w}", f"-DCS={int(cs)}"))
    steps = write_bytes // (16 * w)
    src = cp.zeros(max(1, steps * r) * 16 // 4, dtype=cp.uint32)
    dst = cp.empty(steps * w * 16 // 4, dtype=cp.uint32)
    grid, block = sms * 8, 256
    args = (src, dst, cp.int64(steps))
    for _ in range(3):
        k((grid,), (block,), args)
    times = []
    for _ in range(20):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        k((grid,), (block,), args)
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    times.sort()
    return steps * 16 * (r + w) / times[len(times) // 2] / 1e9


def memcpy_rate() -> float:
    """GB/s (read + written) of a 2 GiB device-to-device cudaMemcpy, median of 10."""
    src = cp.zeros(2**31 // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    times = []
    for i in range(12):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                    cp.cuda.get_current_stream().ptr)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    times.sort()
    return 2 * src.nbytes / times[len(times) // 2] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="MiB written per run")
    a = ap.parse_args()
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    print(cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(), f"{sms} SMs")
    nbytes = a.mib << 20
    copy = rate(1, 1, False, nbytes, sms)
    mc = memcpy_rate()
    print(
        f"copy 1:1 kernel {copy:.0f} GB/s; 2 GiB device-to-device memcpy {mc:.0f} GB/s "
        "(the copy ceiling docs/performance.md quotes)"
    )
    for r, w, what in (
        (1, 4, "~FP4 dequantize to 16-bit"),
        (1, 2, "~MXFP8 dequantize to 16-bit"),
        (1, 3, ""),
        (1, 8, "~FP4 dequantize to fp32"),
        (0, 1, "writes only"),
        (1, 1, "copy"),
    ):
        for cs in (False, True):
            g = rate(r, w, cs, nbytes, sms)
            print(
                f"{r}:{w} {'cs' if cs else '  '} {g:6.0f} GB/s  {100 * g / copy:5.1f}% of the copy kernel  "
                f"{100 * g / mc:5.1f}% of memcpy  {what}"
            )


if __name__ == "__main__":
    main()
