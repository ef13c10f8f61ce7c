"""Host-side profile of eager public-API calls on the cuda backend (device machine): where the
~100 us per gemv_4bit call goes. Prints the per-call time and the top functions by own time."""

import cProfile
import pstats
import time

import torch

import quantcore as qc

w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
p, s = qc.quantize_4bit(w, 64, "nf4", True, backend="cuda")
a = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
lin = torch.nn.functional.linear
for _ in range(200):
    qc.gemv_4bit(a, p, s, backend="cuda")
    lin(a, w)
torch.cuda.synchronize()
for name, fn in (("quantcore gemv_4bit", lambda: qc.gemv_4bit(a, p, s, backend="cuda")),
                 ("torch linear bf16", lambda: lin(a, w))):
    t = time.perf_counter()
    for _ in range(2000):
        fn()
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t) / 2000 * 1e6:.1f} us per eager call")
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    qc.gemv_4bit(a, p, s, backend="cuda")
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
