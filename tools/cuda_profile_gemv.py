"""gemv_4bit launches at the bench's batch-1 shapes, for Nsight Compute (one launch each of the
kernel the backend picks; QUANTCORE_CUDA_TUNE=gemv_kernel=1 selects the register-fed one).
Arguments: [--fmt nf4|mxfp4|nvfp4] [--reps R] N K pairs (default 16384 16384 14336 4096).
--fmt mxfp4 / nvfp4 times linear_mx on that format instead (the same decode kernel); --reps R
launches each shape R times (tools/dev/gemv_ncu.sh profiles the fourth of five)."""

import sys

import torch

import quantcore as qc
from quantcore.backend import Nested

be = qc.get_backend("cuda")
args = sys.argv[1:]
fmt, reps = "nf4", 1
while args and args[0].startswith("--"):
    opt, val, args = args[0], args[1], args[2:]
    if opt == "--fmt":
        fmt = val
    elif opt == "--reps":
        reps = int(val)
    else:
        raise SystemExit(f"unknown option {opt}")
dims = [int(v) for v in args] or [16384, 16384, 14336, 4096]
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
