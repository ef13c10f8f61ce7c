"""gemv_4bit launches at the bench's batch-1 shapes, for Nsight Compute (one launch each of the
kernel the backend picks; QUANTCORE_CUDA_TUNE=gemv_kernel=1 selects the register-fed one).
Arguments: [--fmt nf4|mxfp4|nvfp4] [--reps R] N K pairs (default 16384 16384 14336 4096).
--fmt mxfp4 / nvfp4 times linear_mx on that format instead (the same decode kernel); --reps R
launches each shape R times (tools/dev/gemv_ncu.sh profiles the fourth of five)."""

import argparse

import torch

import quantcore as qc
from quantcore.backend import Nested

ap = argparse.ArgumentParser()
ap.add_argument("--fmt", default="nf4", choices=("nf4", "mxfp4", "nvfp4"))
ap.add_argument("--reps", type=int, default=1)
ap.add_argument("dims", nargs="*", type=int)
args = ap.parse_args()
fmt, reps = args.fmt, args.reps
dims = args.dims or [16384, 16384, 14336, 4096]
be = qc.get_backend("cuda")
for n, k in zip(dims[::2], dims[1::2]):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    if fmt == "nf4":
        p, s = qc.quantize_4bit(w, 64, "nf4", True, backend=be)
        nest = Nested(absmax2=s.state2.absmax, code2=s.state2.code, offset=s.offset)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(reps):
            be.gemv_4bit(a, p, s.absmax, y, n=n, k=k, blocksize=64, quant_type="nf4", nested=nest)
    else:
        g = torch.tensor([0.37], dtype=torch.float32, device="cuda") if fmt == "nvfp4" else None
        codes, scales = qc.quantize_mx(w * 0.05, fmt, global_scale=g, backend=be)
        for _ in range(reps):
            qc.linear_mx(a, codes, scales, fmt, global_scale=g, backend=be)
torch.cuda.synchronize()
print("profiled launches done")
