"""Experiment (branch gwpw): the wgmma NF4 GEMM with its stages loaded by TMA on a full / empty mbarrier
ring (QUANTCORE_CUDA_TUNE=gw_pw=1, bnb_gemm.cu gemm_4bit_wgmma_pw_kernel; its two tensor maps built here
and passed through backends/cuda/bnb.PW_TMAPS) against the default kernel, one process: outputs compared
bit for bit (every weight, several calls), kernel time (CUDA events behind a sleep kernel, 3 rotating
weights), torch bf16 beside them.

    python3 tools/dev/gwpw_time.py [--shapes 14336x4096,4096x14336] [--rows 512,2048] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import ctypes
import os

import torch
from quantcore.backends.cuda import bnb as cbnb
from quantcore.backends.cuda import plans as cuda_plans
from quantcore.backends.cuda import runtime as rt
from quantcore.backends.cuda.common import TYPE_TAG

import quantcore as qc
from quantcore.bench import CudaTimer

_lib = ctypes.CDLL("libcuda.so.1")
_enc = _lib.cuTensorMapEncodeTiled
_enc.restype = ctypes.c_int
_enc.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]


def _map(dtype: int, ptr: int, inner: int, outer: int, row_bytes: int, box: tuple[int, int], swizzle: int) -> bytes:
    """One CUtensorMap (128 bytes) of a row-major 2-D tensor: ``outer`` rows of ``inner`` elements."""
    buf = (ctypes.c_uint8 * 192)()
    addr = (ctypes.addressof(buf) + 63) & ~63
    dims = (ctypes.c_uint64 * 2)(inner, outer)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    boxd = (ctypes.c_uint32 * 2)(*box)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    # interleave none, L2 promotion 256 B (3), out-of-bounds elements read as zeros (0)
    res = _enc(addr, dtype, 2, ptr, dims, strides, boxd, estr, 0, swizzle, 3, 0)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled: CUresult {res}")
    return bytes((ctypes.c_uint8 * 128).from_address(addr))


def tensor_maps(x: torch.Tensor, packed: torch.Tensor, n: int, nb: int) -> torch.Tensor:
    """The input's map (UINT16 [rows, K], box 64 x nb, 128-byte swizzle) and the codes' (UINT8 [n, K / 2],
    box 32 x 128, 32-byte swizzle), 256 bytes on the device."""
    rows, k = x.shape
    raw = _map(1, x.data_ptr(), k, rows, 2 * k, (64, nb), 3) + _map(0, packed.data_ptr(), k // 2, n, k // 2, (32, 128), 1)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to("cuda")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="14336x4096,4096x14336")
    p.add_argument("--rows", default="512,2048")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pw-stages", default="", help="also time these forced ring depths (gw_pw_s), e.g. 4")
    args = p.parse_args()
    be = qc.get_backend("cuda")
    tm = CudaTimer(torch)
    dev = torch.cuda.current_device()
    dt = getattr(torch, args.dtype)
    inst = set()
    for nb in (128, 256):
        for cl in (1, 2):
            inst.add(("bnb_gemm.cu", cbnb._gemm4wg_pw(TYPE_TAG[args.dtype], "nf4", True, nb, cl)))
            for s in (args.pw_stages or "").split(","):
                if s:
                    os.environ[rt.ENV_TUNE] = f"gw_pw_s={s}"
                    inst.add(("bnb_gemm.cu", cbnb._gemm4wg_pw(TYPE_TAG[args.dtype], "nf4", True, nb, cl)))
                    os.environ.pop(rt.ENV_TUNE)
        inst.add(("bnb_gemm.cu", cbnb._gemm4wg(TYPE_TAG[args.dtype], "nf4", True, nb, 1, 0)))
        inst.add(("bnb_gemm.cu", cbnb._gemm4wg(TYPE_TAG[args.dtype], "nf4", True, nb, 2, 0)))
    print(f"precompiled {rt.precompile(sorted(inst), dev, workers=8)}", flush=True)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        ws = [torch.randn(n, k, device="cuda", dtype=dt) * 0.05 for _ in range(3)]
        qs = [qc.quantize_4bit(w, 64, "nf4", True, backend=be) for w in ws]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=dt)
            outs = [torch.empty(rows, n, device="cuda", dtype=dt) for _ in range(2)]
            nb, cl = cbnb._gw_shape(rows, n, k, rt.sm_count(dev))
            maps = [tensor_maps(x, p_, n, nb) for p_, _ in qs]

            def call(i, tune, out):
                os.environ[rt.ENV_TUNE] = tune
                cbnb.PW_TMAPS = maps[i].data_ptr()
                p_, s_ = qs[i]
                be.gemv_4bit(x, p_, s_.absmax, out, n=n, k=k, blocksize=64, quant_type="nf4",
                             nested=cuda_plans._state_nested(s_))

            pw = "gw_pw=1"
            same = True
            for rep in range(3):
                for i in range(3):
                    call(i, "", outs[0])
                    call(i, pw, outs[1])
                    torch.cuda.synchronize()
                    if not torch.equal(outs[0], outs[1]):
                        same = False
                        d = (outs[0].float() - outs[1].float()).abs()
                        print(f"  MISMATCH weight {i} call {rep}: max |diff| {d.max().item():.3g}, rows differing "
                              f"{(d.amax(1) > 0).sum().item()} of {rows}", flush=True)
            for st in (args.pw_stages or "").split(","):
                for i in range(3) if st else ():
                    call(i, "", outs[0])
                    call(i, f"{pw},gw_pw_s={st}", outs[1])
                    torch.cuda.synchronize()
                    if not torch.equal(outs[0], outs[1]):
                        same = False
                        print(f"  MISMATCH weight {i} with {st} stages", flush=True)
            res = {}
            runs = [("default", ""), ("pw", pw), ("default2", ""), ("pw2", pw)]
            runs += [(f"pw_s{s}", f"{pw},gw_pw_s={s}") for s in (args.pw_stages or "").split(",") if s]
            for tag, tune in runs:
                res[tag] = tm.kernel([lambda i=i, tune=tune: call(i, tune, outs[1]) for i in range(3)], 20, warmup=3)
            os.environ.pop(rt.ENV_TUNE, None)
            t_torch = tm.kernel([lambda w=w: torch.nn.functional.linear(x, w) for w in ws], 20, warmup=3)
            print(f"{shape} rows {rows} (tile {nb}, clusters {cl}): " + " | ".join(f"{a} {t:.1f}" for a, t in res.items())
                  + f" | torch {t_torch:.1f} us | bits equal {same}", flush=True)


if __name__ == "__main__":
    main()
