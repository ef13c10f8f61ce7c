"""SM clock and power while scaled_fp4_mm's wgmma kernel (and its timing variants) runs at 8192^3,
against torch bf16 matmul: each case runs back to back for about 3 s while `nvidia-smi` samples
clocks.sm, power.draw and the throttle reasons every 50 ms; prints the median of the samples taken
in the middle second, and the kernel's median time over the loop. Question it answers: does the
kernel run at a lower clock than the MMAs alone (power), or at the same clock (a shared resource
inside the SM)? Usage: python3 tools/dev/mxgemm_clocks.py."""

import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from mxgemm_time import operands  # noqa: E402
from quantcore.backends.cuda import mx as cmx
from quantcore.backends.cuda import runtime as rt

M = N = K = 8192
FIELDS = "clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"


def sampled(fn, seconds: float = 3.0):
    """Runs fn back to back for `seconds`; returns (median ms per call, samples of the middle)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    stamps = []
    times = []
    while time.time() - t0 < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 10)
        stamps.append(time.time() - t0)
    smi.terminate()
    lines = [ln.split(",") for ln in smi.communicate()[0].strip().splitlines() if ln.count(",") == 3]
    mid = lines[len(lines) // 3: 2 * len(lines) // 3] or lines
    return statistics.median(times), mid


def main() -> None:
    dev = torch.device("cuda")
    flops = 2.0 * M * N * K
    a16 = torch.randn((M, K), device=dev, dtype=torch.bfloat16)
    b16 = torch.randn((N, K), device=dev, dtype=torch.bfloat16)
    out = torch.empty((M, N), dtype=torch.bfloat16, device=dev)
    cases = [("torch bf16", lambda: torch.matmul(a16, b16.t()))]
    for fmt in ("nvfp4", "mxfp4"):
        ops = operands(fmt, dev)
        for var in ("", "_nodq", "_nomma", "_alu", "_smem") if fmt == "nvfp4" else ("",):
            def mm(fmt=fmt, var=var, ops=ops):
                cmx.scaled_fp4_mm(None, *ops, None, out, m=M, n=N, k=K, fmt=fmt, mode="wgmma", variant=var)
            cases.append((f"{fmt} wgmma{var}", mm))
    os.environ.pop(rt.ENV_TUNE, None)
    for name, fn in cases:
        t, mid = sampled(fn)
        sm = statistics.median(float(x[0]) for x in mid)
        mem = statistics.median(float(x[1]) for x in mid)
        pw = statistics.median(float(x[2]) for x in mid)
        reasons = sorted({x[3].strip() for x in mid})
        print(f"{name:22s} {t:.4f} ms {flops / t / 1e9:5.0f} TFLOPS  sm {sm:.0f} MHz  mem {mem:.0f} MHz  "
              f"power {pw:.0f} W  throttle {reasons}  ({len(mid)} samples)")


if __name__ == "__main__":
    main()
