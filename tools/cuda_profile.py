"""Run each performance-critical kernel of the cuda backend once, at the bench's shapes, for
Nsight Compute (tools/cuda_device_run.sh's ncu step filters these launches by kernel name)."""

import torch

import quantcore as qc
from quantcore.backend import Nested

be = qc.get_backend("cuda")


def nested(s):
    return Nested(absmax2=s.state2.absmax, code2=s.state2.code, offset=s.offset)


x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
p, s = qc.quantize_4bit(x, 64, "nf4", True, backend=be)  # quantize_4bit_kernel (profiled)
out = torch.empty_like(x)
be.dequantize_4bit(p, s.absmax, out, blocksize=64, quant_type="nf4", nested=nested(s))
a = torch.randn(1, 16384, device="cuda", dtype=torch.bfloat16)
y = torch.empty(1, 16384, device="cuda", dtype=torch.bfloat16)
be.gemv_4bit(a, p, s.absmax, y, n=16384, k=16384, blocksize=64, quant_type="nf4", nested=nested(s))
w = torch.randn(4096, 14336, device="cuda", dtype=torch.float32)
wq = qc.quantize_q4_0(w, backend=be)
for nn in (1, 8):
    act = torch.randn(nn, 14336, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(4096, nn, device="cuda", dtype=torch.float32)
    be.gemm_w4a8(wq, act, o)
torch.cuda.synchronize()
print("profiled launches done")
