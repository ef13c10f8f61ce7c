"""gemv_4bit launches at the bench's batch-1 shapes, for Nsight Compute (one launch each of the
kernel the backend picks; QUANTCORE_CUDA_TUNE=gemv_kernel=1 selects the register-fed one).
Arguments: N K pairs (default 16384 16384 14336 4096)."""

import sys

import torch

import quantcore as qc
from quantcore.backend import Nested

be = qc.get_backend("cuda")
dims = [int(v) for v in sys.argv[1:]] or [16384, 16384, 14336, 4096]
for n, k in zip(dims[::2], dims[1::2]):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    p, s = qc.quantize_4bit(w, 64, "nf4", True, backend=be)
    nest = Nested(absmax2=s.state2.absmax, code2=s.state2.code, offset=s.offset)
    a = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    be.gemv_4bit(a, p, s.absmax, y, n=n, k=k, blocksize=64, quant_type="nf4", nested=nest)
torch.cuda.synchronize()
print("profiled launches done")
