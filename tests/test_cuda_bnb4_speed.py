"""quantize_4bit / dequantize_4bit kernels of the cuda backend at the kernel-level op: bit-exact
against quantcore.formats.bnb on unaligned pointers (the element paths), odd n, zero, tiny
(1/absmax = inf), NaN and -inf blocks, and tensors large enough that every CTA of the persistent
grids walks several tiles. (The version comparison these tests first ran: tools/dev/bnb4_time.py.)

GPU tests: skipped with the reason where the cuda backend is unavailable.
"""

from __future__ import annotations

import numpy as np
import pytest

import quantcore as qc
from quantcore.backend import Nested
from quantcore.formats import bnb

from .conftest import FLOAT_DTYPES, bits

_avail = qc.available_backends()["cuda"]
pytestmark = pytest.mark.skipif(not _avail, reason=f"cuda backend unavailable: {_avail.reason}")
torch = pytest.importorskip("torch") if _avail else None


def _t(a: np.ndarray, offset: int = 0):
    """numpy -> torch CUDA tensor whose data starts ``offset`` elements into a larger buffer."""
    flat = np.ascontiguousarray(a).reshape(-1)
    base = torch.from_numpy(flat.view(np.uint8 if flat.dtype.itemsize == 1 else
                                      {2: np.int16, 4: np.int32}[flat.dtype.itemsize]).copy())
    if flat.dtype.itemsize == 2 and flat.dtype != np.float16:
        base = base.view(torch.bfloat16)
    elif flat.dtype == np.float16:
        base = base.view(torch.float16)
    elif flat.dtype == np.float32:
        base = base.view(torch.float32)
    buf = torch.empty(flat.size + offset, dtype=base.dtype, device="cuda")
    buf[offset:].copy_(base.cuda())
    return buf[offset:]


def _n(t) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(FLOAT_DTYPES["bfloat16"])
    return t.cpu().numpy()


def _empty(n: int, dtype, offset: int = 0):
    return torch.full((n + offset,), 0x55, dtype=torch.uint8, device="cuda").view(torch.uint8)[offset:] \
        if dtype == torch.uint8 else torch.full((n + offset,), float("nan"), dtype=dtype, device="cuda")[offset:]


def _same(got: np.ndarray, ref: np.ndarray) -> bool:
    got, ref = np.asarray(got).reshape(-1), np.asarray(ref).reshape(-1)
    rnan = np.isnan(ref.astype(np.float32))
    gnan = np.isnan(got.astype(np.float32))
    return bool(np.array_equal(rnan, gnan) and np.array_equal(bits(got)[~rnan], bits(ref)[~rnan]))


def _data(rng, n: int, dtype: str, bs: int) -> np.ndarray:
    scales = np.exp2(rng.uniform(-8, 8, -(-n // bs)))
    x = rng.standard_normal(n) * np.repeat(scales, bs)[:n]
    x[rng.integers(0, n, max(1, n // 997))] = 0.0
    x[rng.integers(0, n, max(1, n // 4999))] = np.nan
    x[rng.integers(0, n, max(1, n // 7001))] = -np.inf
    if n > 4 * bs:
        x[bs: 2 * bs] = 0.0                     # a zero block: 1/0 = inf, codes of NaN
        x[2 * bs: 3 * bs] *= 2.0 ** -140        # a tiny block: 1/absmax overflows to inf
    return x.astype(FLOAT_DTYPES[dtype])


@pytest.mark.parametrize("qt", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_quantize_4bit_bit_exact_edge_cases(rng, qt, dtype):
    be = qc.get_backend("cuda")
    cases = [(32, 1, 0, 0), (32, 33, 0, 0), (64, 64 * 37 + 13, 0, 0), (64, 64 * 37 + 13, 1, 3),
             (128, 4097, 3, 1), (1024, 3 * 1024 + 5, 0, 0), (4096, 2 * 4096 + 17, 1, 0)]
    if dtype == "bfloat16":
        cases.append((64, (1 << 22) + 7, 0, 0))
    for bs, n, xoff, poff in cases:
        x = _data(rng, n, dtype, bs)
        rp, ra = bnb.quantize_4bit(x, bs, qt)
        packed = _empty((n + 1) // 2, torch.uint8, poff)
        absmax = _empty(bnb.nblocks(n, bs), torch.float32)
        be.quantize_4bit(_t(x, xoff), packed, absmax, blocksize=bs, quant_type=qt)
        torch.cuda.synchronize()
        assert np.array_equal(_n(packed), rp.reshape(-1)), (bs, n, xoff, poff)
        assert _same(_n(absmax), ra), (bs, n, xoff, poff)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_dequantize_4bit_bit_exact_edge_cases(rng, nested, dtype):
    be = qc.get_backend("cuda")
    cases = [(32, 1, 0, 0), (64, 64 * 37 + 13, 0, 0), (64, 64 * 37 + 13, 1, 1), (128, 4097, 0, 3),
             (4096, 2 * 4096 + 17, 0, 0)]
    if dtype == "bfloat16":  # 2^25 elements: several tiles per CTA on a 132-SM device
        cases.append((64, (1 << 25) + 9, 0, 0))
    for bs, n, poff, ooff in cases:
        qt = "nf4" if n % 2 else "fp4"
        packed = rng.integers(0, 256, (n + 1) // 2, dtype=np.uint8)
        nb = bnb.nblocks(n, bs)
        if nested:
            q = rng.integers(0, 256, nb, dtype=np.uint8)
            a2 = (rng.uniform(0.5, 4.0, bnb.nblocks(nb, 256)) * 2.0 ** rng.integers(-20, 20)).astype(np.float32)
            off = np.array([rng.uniform(0.1, 2.0)], np.float32)
            code2 = bnb.DYNAMIC_MAP.astype(np.float32)
            eff = bnb.dequantize_absmax(q, a2, off[0], code2)
            absmax_in = _t(q)
            nest = Nested(_t(a2), _t(code2), _t(off))
        else:
            eff = (rng.uniform(0.5, 2.0, nb) * np.exp2(rng.integers(-40, 40, nb))).astype(np.float32)
            absmax_in, nest = _t(eff), None
        ref = bnb.dequantize_4bit(packed, eff, n, bs, qt, FLOAT_DTYPES[dtype])
        tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        out = _empty(n, tdt, ooff)
        be.dequantize_4bit(_t(packed, poff), absmax_in, out, blocksize=bs, quant_type=qt, nested=nest)
        torch.cuda.synchronize()
        assert _same(_n(out), ref), (bs, n, poff, ooff)
