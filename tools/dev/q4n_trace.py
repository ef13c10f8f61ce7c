"""quantize_4bit with double quantization in one cooperative launch (quantize_4bit_nested_kernel)
on the bench's input (16384 x 16384 bf16, NF4, blocksize 64): timed (CUDA events behind a sleep
kernel, median of 40; opt-in: QUANTCORE_CUDA_TUNE=q4_nested=1) against the plain quantize_4bit
kernel and the two ops (the default), for units of
256 * 2^U blocks (QUANTCORE_CUDA_TUNE=q4n_ub=U), and traced: the kernel's global-timer stamps per
CTA at its phase boundaries (start, quantized, leaf sums out, offset known, codes out, end),
printed as the median and the slowest CTA's duration of each phase, the spread of the CTAs'
starts and of their quantize phases' ends, and the span from the first start to the last end.
Each traced run is checked bit for bit against the two ops.

Run on the GPU machine: python3 tools/dev/q4n_trace.py
"""

import os
import statistics

import numpy as np
import torch
from bnb4_time import timed as bnb4_timed  # this directory (scripts run as files)
from quantcore.backends import cuda
from quantcore.backends.cuda.runtime import ENV_TUNE as TUNE

import quantcore as qc
from quantcore.formats import bnb

be = qc.get_backend("cuda")


def timed(fn, reps=40) -> float:
    """Median GPU time (us) of ``fn`` behind a sleep kernel: bnb4_time.timed's samples."""
    return statistics.median(bnb4_timed(fn, reps))


n, bs = 16384 * 16384, 64
nb = n // bs
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn((16384, 16384), device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)


def outs():
    return (torch.empty((n // 2, 1), dtype=torch.uint8, device="cuda"), torch.empty((nb,), dtype=torch.uint8, device="cuda"),
            torch.empty((bnb.nblocks(nb, 256),), dtype=torch.float32, device="cuda"),
            torch.empty((1,), dtype=torch.float32, device="cuda"))


ref, got = outs(), outs()
absmax = torch.empty((nb,), dtype=torch.float32, device="cuda")
os.environ[TUNE] = "q4_nested=0"
be.quantize_4bit_nested(x, *ref, blocksize=bs, quant_type="nf4")
t_two = timed(lambda: be.quantize_4bit_nested(x, *ref, blocksize=bs, quant_type="nf4"))
t_q4 = timed(lambda: be.quantize_4bit(x, ref[0], absmax, blocksize=bs, quant_type="nf4"))
print(f"quantize_4bit kernel alone {t_q4:6.1f} us; the two ops {t_two:6.1f} us", flush=True)
trace = torch.zeros((4096, 8), dtype=torch.int64, device="cuda")
names = ["quantize", "leaves", "offset", "codes", "end"]
for cfg in ("q4_nested=1,q4n_ub=0", "q4_nested=1,q4n_ub=1", "q4_nested=1,q4n_ub=2"):
    os.environ[TUNE] = cfg
    t = timed(lambda: be.quantize_4bit_nested(x, *got, blocksize=bs, quant_type="nf4"))
    trace.zero_()
    for o in got:
        o.fill_(0x5A if o.dtype == torch.uint8 else float("nan"))
    ok = cuda.CudaBackend._quantize_4bit_fused(x, *got, blocksize=bs, quant_type="nf4", trace=trace.data_ptr())
    torch.cuda.synchronize()
    exact = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, got))
    tr = trace.cpu().numpy()
    tr = tr[tr[:, 0] != 0][:, :6].astype(np.float64)
    t0 = tr[:, 0].min()
    d = np.diff(tr, axis=1)
    phases = "  ".join(f"{m} {np.median(d[:, i]) / 1e3:.2f}/{d[:, i].max() / 1e3:.2f}" for i, m in enumerate(names))
    q_end = (tr[:, 1] - t0) / 1e3
    print(f"{cfg}: {t:6.1f} us, bit-exact {exact} [{len(tr)} CTAs, launched {ok}] span "
          f"{(tr[:, 5].max() - t0) / 1e3:.2f} us; starts spread {(tr[:, 0].max() - t0) / 1e3:.2f}; quantize ends "
          f"{q_end.min():.2f}-{q_end.max():.2f} (median {np.median(q_end):.2f}); offset known "
          f"{(tr[:, 3] - t0).min() / 1e3:.2f}-{(tr[:, 3] - t0).max() / 1e3:.2f}; phases median/max us: {phases}",
          flush=True)
os.environ[TUNE] = ""
