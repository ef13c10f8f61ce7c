"""MXFP4 scaled_fp4_mm on the wgmma kernel: the fp16 decode (CTAs whose scale bytes all lie in
110..141) against the bf16 decode (QUANTCORE_CUDA_TUNE=mx_gemm_f16=0), on the GPU machine. First
the two outputs compared bit for bit on shapes off the tile edges, with bias, and with scales that
send some CTAs (or all) back to bf16 (a NaN scale, bytes 100 and 150 in a few rows), and the fp16
one checked against the fp64 reference bound of the conformance family (the failure criterion:
the two decodes give the tensor cores the same exact values, but the fp16 and bf16 MMAs do not
always round their sums alike, so equality is reported, not required); then the time of each at
8192^3 next to torch bf16 matmul, alternated three times. Usage: python3 tools/dev/mxgemm_f16.py"""

import os
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tools/: cuda_mx_bench
from cuda_mx_bench import timed  # noqa: E402  (median ms behind a sleep kernel)
from mxgemm_time import operands, torch_matmul_ms  # noqa: E402
from quantcore.backends.cuda import mx as cmx
from quantcore.backends.cuda import runtime as rt

from quantcore.formats import mx

SHAPES = ((8192, 8192, 8192), (300, 200, 512), (257, 129, 4096), (1000, 520, 1056), (64, 384, 2080))


def run(ops, out, m, n, k, f16, bias=None):
    os.environ[rt.ENV_TUNE] = f"mx_gemm_f16={int(f16)}"
    cmx.scaled_fp4_mm(None, *ops, bias, out, m=m, n=n, k=k, fmt="mxfp4", mode="wgmma")


def reference_ok(ops, out, m, n, k, bias) -> str:
    """Within the fp64 bound of quantcore/conformance/families/mx.py (mm_bound; small shapes only)."""
    if m * n * k > 2 ** 31:
        return "not checked (size)"
    from quantcore.conformance.families.mx import mm_bound
    ac, bc, sa, sb, alpha = (t.cpu().numpy() for t in ops)
    A, B = mx.fp4_operand(ac, sa, "mxfp4"), mx.fp4_operand(bc, sb, "mxfp4")
    ref, bound = mm_bound(A, B, float(alpha[0]), None if bias is None else bias.float().cpu().numpy().astype(np.float64))
    got = out.float().cpu().numpy().astype(np.float64)
    fin = np.isfinite(ref)
    ok = bool(np.all(np.abs(got[fin] - ref[fin]) <= np.broadcast_to(bound.max_abs, ref.shape)[fin]))
    ok = ok and np.array_equal(np.isnan(got), np.isnan(ref))
    return "within the bound" if ok else "OUT OF BOUND"


def main() -> None:
    dev = torch.device("cuda")
    bad = 0
    for m, n, k in SHAPES:
        ops = operands("mxfp4", dev, m, n, k)
        cases = {"in range": ops}
        sa = ops[2].clone()
        sa.view(-1)[:: 997] = 150  # a few A scale bytes above 141 (some CTAs fall back)
        cases["bytes 150"] = (ops[0], ops[1], sa, ops[3], ops[4])
        sb = ops[3].clone()
        sb.view(-1)[:: 1009] = 100
        cases["bytes 100"] = (ops[0], ops[1], ops[2], sb, ops[4])
        sn = ops[2].clone()
        sn.view(-1)[5] = 255  # a NaN scale
        cases["NaN scale"] = (ops[0], ops[1], sn, ops[3], ops[4])
        bias = torch.randn(n, device=dev).to(torch.bfloat16)
        for name, o in cases.items():
            for b in (None, bias) if name == "in range" else (None,):
                outs = {}
                for f16 in (True, False):
                    outs[f16] = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
                    run(o, outs[f16], m, n, k, f16, b)
                same = torch.equal(outs[True].view(torch.int16), outs[False].view(torch.int16))
                ref = reference_ok(o, outs[True], m, n, k, b)
                bad += ref == "OUT OF BOUND"  # bit equality is reported, not required (see below)
                print(f"{m}x{n}x{k} {name} bias={b is not None}: fp16 == bf16 bit for bit: {same}; fp16 {ref}")
    m = n = k = 8192
    flops = 2.0 * m * n * k
    tt = torch_matmul_ms(dev, m, n, k)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
    ops = operands("mxfp4", dev)
    for rnd in range(3):
        for f16 in (True, False):
            t = timed(lambda f16=f16: run(ops, out, m, n, k, f16), 15)
            print(f"mxfp4 {'fp16' if f16 else 'bf16'} round {rnd}: {t:.4f} ms {flops / t / 1e9:.0f} TFLOPS "
                  f"{tt / t:.3f}x torch")
    os.environ.pop(rt.ENV_TUNE, None)
    print("problems:", bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
