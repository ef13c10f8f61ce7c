"""The bandwidth ceiling of dequantize_4bit's access mix on this device, measured directly.

dequantize_4bit 16384^2 -> bf16 reads 1 byte per 4 it writes (128 MiB of codes, 512 MiB out); the
copy rate that PERFORMANCE.md's goal uses is a 1:1 mix. This times, with CUDA events behind a sleep
kernel (median of 30), kernels that only stream: write-only, and read R + write 4R (4-byte reads),
with plain / .cs / .wt 16-byte stores, grid-stride with 8 accesses in flight per thread, against
torch's 2 GiB copy.
Run on the GPU machine: python3 tools/dev/write_ceiling.py
"""

import statistics

import cupy as cp
import torch
from bnb4_time import timed as bnb4_timed  # this directory (scripts run as files)

SRC = r"""
typedef unsigned int u32;
template <int ST>
__device__ __forceinline__ void st16(void* p, uint4 v) {
    if (ST == 0) asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    if (ST == 1) asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    if (ST == 2) asm volatile("st.global.wt.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
// out: n16 16-byte units; in: n16 / 4 4-byte words (1:4 when READ)
template <int ST, int READ>
__global__ void __launch_bounds__(256) stream_kernel(const u32* __restrict__ in, uint4* out, long long n16) {
    const long long stride = (long long)gridDim.x * 256;
    for (long long i0 = (long long)blockIdx.x * 256 * 8 + threadIdx.x; i0 < n16; i0 += stride * 8) {
        u32 w[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const long long i = i0 + j * 256;
            w[j] = 0;
            if (READ && i < n16) w[j] = __ldg(in + i);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const long long i = i0 + j * 256;
            if (i < n16) st16<ST>(out + i, make_uint4(w[j], w[j] ^ 1u, w[j] ^ 2u, w[j] + (u32)i));
        }
    }
}
"""
names = [f"stream_kernel<{st},{rd}>" for st in (0, 1, 2) for rd in (0, 1)]
mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)


def timed(fn, reps=30) -> float:
    """Median GPU time (us) of ``fn`` behind a sleep kernel: bnb4_time.timed's samples."""
    return statistics.median(bnb4_timed(fn, reps))


n_out = 1 << 29  # 512 MiB written, as dequantize 16384^2 -> bf16
out = torch.empty(n_out, dtype=torch.uint8, device="cuda")
inp = torch.randint(0, 255, (n_out // 4,), dtype=torch.uint8, device="cuda")
n16 = n_out // 16
sms = torch.cuda.get_device_properties(0).multi_processor_count
big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
big2 = torch.empty_like(big)
copy_us = min(timed(lambda: big2.copy_(big)) for _ in range(2))
copy = 2 * (1 << 30) / copy_us / 1e3
print(f"device {torch.cuda.get_device_name()}: copy 2 GiB {copy_us:.1f} us = {copy:.0f} GB/s")
print(f"torch fill_ 512 MiB: {timed(lambda: out.fill_(7)):.1f} us")
stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
for name in names:
    fn = mod.get_function(name)
    rd = name.endswith(",1>")
    for ctas_per_sm in (4, 8):
        grid = (sms * ctas_per_sm,)
        args = (cp.uint64(inp.data_ptr()), cp.uint64(out.data_ptr()), cp.int64(n16))
        t = timed(lambda fn=fn, grid=grid, args=args: fn(grid, (256,), args, stream=stream))
        nbytes = n_out + (n_out // 4 if rd else 0)
        gbs = nbytes / t / 1e3
        kind = ["plain", ".cs", ".wt"][int(name.split("<")[1][0])]
        print(f"{'read 1 : write 4' if rd else 'write only':17s} stores {kind:5s} {ctas_per_sm} CTAs/SM: "
              f"{t:7.1f} us {gbs:6.0f} GB/s = {100 * gbs / copy:5.1f}% of copy")
