"""Host time of repeated eager public-API calls on the cuda backend (device machine): gemm_w4a8
(4096x14336 Q4_0, bf16 [1, 14336] activation) and quantize_4bit (4096x4096 bf16, NF4 with double
quantization), each back to back (per-call time after 20 warm-up calls), then cProfile's top
functions by own time. Run from the repository root: PYTHONPATH=. python3 tools/dev/host_profile.py"""

import cProfile
import pstats
import time

import torch

from quantcore import api

M, K = 4096, 14336
wq = torch.randint(0, 256, (M, K // 32, 18), dtype=torch.uint8, device="cuda")
scales = torch.full((M, K // 32), 0.01, device="cuda").half()
wq[..., 0:2] = scales.view(torch.uint8).view(M, K // 32, 2)
a = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)


def w4a8():
    return api.gemm_w4a8(wq, a, M, 1, K, backend="cuda")


def quantize():
    return api.quantize_4bit(x, 64, "nf4", True, backend="cuda")


for name, fn, calls in (("gemm_w4a8", w4a8, 2000), ("quantize_4bit", quantize, 500)):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t) / calls * 1e6:.1f} us per call back to back")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
