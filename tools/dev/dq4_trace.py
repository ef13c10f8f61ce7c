"""double_quantize version 4 (one cooperative launch, QUANTCORE_CUDA_TUNE=dq_v=4) on the bench's
4 M absmax values: checked bit-exact against the numpy reference, timed (CUDA events behind a sleep
kernel, median of 40; version 3 beside it), and traced:
the kernel's global-timer stamps per CTA at its phase boundaries (start, values in shared memory,
leaf sums out, offset known, codes out, end), printed as the median and the slowest CTA's
duration of each phase, and the span from the first start to the last end.

Run on the GPU machine: python3 tools/dev/dq4_trace.py
"""

import os
import statistics

import numpy as np
import torch
from bnb4_time import timed as bnb4_timed  # this directory (scripts run as files)
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt

import quantcore as qc
from quantcore.formats import bnb

TUNE = "QUANTCORE_CUDA_TUNE"
be = qc.get_backend("cuda")


def timed(fn, reps=40) -> float:
    """Median GPU time (us) of ``fn`` behind a sleep kernel: bnb4_time.timed's samples."""
    return statistics.median(bnb4_timed(fn, reps))


nb = (16384 * 16384) // 64
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn((16384, 16384), device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
packed = torch.empty((x.numel() // 2, 1), dtype=torch.uint8, device="cuda")
absmax = torch.empty((nb,), dtype=torch.float32, device="cuda")
be.quantize_4bit(x, packed, absmax, blocksize=64, quant_type="nf4")
q = torch.empty((nb,), dtype=torch.uint8, device="cuda")
a2 = torch.empty((bnb.nblocks(nb, 256),), dtype=torch.float32, device="cuda")
off = torch.empty((1,), dtype=torch.float32, device="cuda")
rq, ra2, roff = bnb.double_quantize(absmax.cpu().numpy())
trace = torch.zeros((4096, 8), dtype=torch.int64, device="cuda")
size = 1 << (nb - 1).bit_length()
names = ["in", "leaves", "offset", "codes", "end"]
for cfg in ["dq_v=3", "dq_v=4"]:
    os.environ[TUNE] = cfg
    q.fill_(0x5A)
    a2.fill_(float("nan"))
    be.double_quantize(absmax, q, a2, off)
    torch.cuda.synchronize()
    exact = (np.array_equal(q.cpu().numpy(), rq) and np.array_equal(a2.cpu().numpy().view(np.uint32), ra2.view(np.uint32))
             and off.cpu().numpy().view(np.uint32)[0] == np.float32(roff).view(np.uint32))
    t = timed(lambda: be.double_quantize(absmax, q, a2, off))
    line = f"{cfg:22s} bit-exact {exact}  {t:6.1f} us"
    if cfg != "dq_v=3":
        trace.zero_()
        ok = cuda.CudaBackend._double_quantize_v4(rt.Launcher(absmax), absmax, q, a2, off, nb, size,
                                                  trace=trace.data_ptr())
        torch.cuda.synchronize()
        tr = trace.cpu().numpy()
        tr = tr[tr[:, 0] != 0][:, :6].astype(np.float64)
        t0 = tr[:, 0].min()
        d = np.diff(tr, axis=1)
        phases = "  ".join(f"{n} {np.median(d[:, i]) / 1e3:.2f}/{d[:, i].max() / 1e3:.2f}" for i, n in enumerate(names))
        starts = (tr[:, 0] - t0) / 1e3
        line += (f"  [{len(tr)} CTAs, launched {ok}] span {(tr[:, 5].max() - t0) / 1e3:.2f} us; starts spread "
                 f"{starts.max():.2f}; offset known at {(tr[:, 3] - t0).min() / 1e3:.2f}-{(tr[:, 3] - t0).max() / 1e3:.2f};"
                 f" phases median/max us: {phases}")
    print(line, flush=True)
os.environ[TUNE] = ""
