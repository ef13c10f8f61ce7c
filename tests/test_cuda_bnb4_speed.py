"""quantize_4bit / dequantize_4bit kernels of the cuda backend at the kernel-level op: bit-exact
against quantcore.formats.bnb on unaligned pointers (the element paths), odd n, zero, tiny
(1/absmax = inf), NaN and -inf blocks, and tensors large enough that every CTA of the persistent
grids walks several tiles (quantize_4bit: version 3 for blocksizes up to 512, version 2 above).
(The kernel versions these tests first compared were removed; their measurements are in docs/performance.md.)

GPU tests: skipped with the reason where the cuda backend is unavailable.
"""

from __future__ import annotations

import numpy as np
import pytest

import quantcore as qc
from quantcore.backend import Nested
from quantcore.formats import bnb

from .conftest import FLOAT_DTYPES, same_bits
from .cuda_arrays import CUDA, filled, needs_cuda, to_cuda, to_host

pytestmark = needs_cuda
torch = pytest.importorskip("torch") if CUDA else None


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
    if dtype == "bfloat16":  # quantize_4bit version 3: ~8 tiles of 4096 per CTA, every pipeline slot reused
        cases.append((64, (1 << 24) + 7, 0, 0))
    for bs, n, xoff, poff in cases:
        x = _data(rng, n, dtype, bs)
        rp, ra = bnb.quantize_4bit(x, bs, qt)
        packed = filled((n + 1) // 2, torch.uint8, poff, byte=0x55)
        absmax = filled(bnb.nblocks(n, bs), torch.float32)
        be.quantize_4bit(to_cuda(x, xoff), packed, absmax, blocksize=bs, quant_type=qt)
        torch.cuda.synchronize()
        assert np.array_equal(to_host(packed), rp.reshape(-1)), (bs, n, xoff, poff)
        assert same_bits(to_host(absmax), ra), (bs, n, xoff, poff)


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
            absmax_in = to_cuda(q)
            nest = Nested(to_cuda(a2), to_cuda(code2), to_cuda(off))
        else:
            eff = (rng.uniform(0.5, 2.0, nb) * np.exp2(rng.integers(-40, 40, nb))).astype(np.float32)
            absmax_in, nest = to_cuda(eff), None
        ref = bnb.dequantize_4bit(packed, eff, n, bs, qt, FLOAT_DTYPES[dtype])
        tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        out = filled(n, tdt, ooff)
        be.dequantize_4bit(to_cuda(packed, poff), absmax_in, out, blocksize=bs, quant_type=qt, nested=nest)
        torch.cuda.synchronize()
        assert same_bits(to_host(out), ref), (bs, n, poff, ooff)
