"""double_quantize and quantize_blockwise of the cuda backend at the kernel-level op: bit-exact
against quantcore.formats.bnb.

quantize_blockwise rounds by a cell table (built at compile time when the thresholds passed are the
dynamic map's bit for bit, else at run time); double_quantize above one chunk sum (8192 values)
reduces the offset's chunk sums inside the quantize launch, with the sums in qabsmax's first bytes
and the CTA counter in the offset's 4 bytes; below, tree levels and the kernel that subtracts the
offset read from device memory. These tests aim at what that can get wrong: every cell edge and threshold neighbour of the rounding, NaN / inf / -0.0 / constant blocks
(1/absmax2 = inf), thresholds the cell table cannot hold (the round8 fallback), unaligned pointers
(element paths, the sums' 8-byte alignment inside qabsmax), one chunk more than the minimum, and
the largest tree the quantize launch reduces (4096 chunk sums, 65 deferred blocks), thresholds one
ulp off the dynamic map's, repeated calls on the same buffers (the counter is re-zeroed).

GPU tests: skipped with the reason where the cuda backend is unavailable.
"""

from __future__ import annotations

import numpy as np
import pytest

import quantcore as qc
from quantcore.formats import bnb

from .conftest import FLOAT_DTYPES, bits, same_bits
from .cuda_arrays import CUDA, filled, needs_cuda, to_cuda, to_host

pytestmark = needs_cuda
torch = pytest.importorskip("torch") if CUDA else None


@pytest.fixture(scope="module")
def be():
    return qc.get_backend("cuda")


def _check_dq(be, absmax: np.ndarray, a_off: int = 0, q_off: int = 0) -> None:
    nb = absmax.size
    q, a2, off = filled(nb, np.uint8, q_off), filled(bnb.nblocks(nb, 256), np.float32), filled(1, np.float32)
    be.double_quantize(to_cuda(absmax, a_off), q, a2, off)
    torch.cuda.synchronize()
    rq, ra2, roff = bnb.double_quantize(absmax)
    assert same_bits(to_host(off), np.array([roff], np.float32)), (nb, to_host(off), roff)
    got = to_host(q)
    bad = np.flatnonzero(got != rq)
    assert bad.size == 0, (nb, bad[:10], got[bad[:10]], rq[bad[:10]])
    assert same_bits(to_host(a2), ra2), nb


@pytest.mark.parametrize("nb", [8192, 8193, 3 * 8192 + 1, 100_003, 1 << 22, (1 << 22) + 5])
def test_double_quantize_sizes(be, rng, nb):
    absmax = np.exp2(rng.uniform(-8, 4, nb)).astype(np.float32)
    _check_dq(be, absmax)


def test_double_quantize_largest_tree(be, rng):
    """2^24 + 1 values: a tree of 2^25 leaves, 4096 chunk sums (16 per thread of the top)."""
    absmax = rng.uniform(0.5, 4.0, (1 << 24) + 1).astype(np.float32)
    _check_dq(be, absmax)


@pytest.mark.parametrize("a_off,q_off", [(1, 0), (0, 1), (3, 5), (2, 7)])
def test_double_quantize_unaligned(be, rng, a_off, q_off):
    absmax = np.exp2(rng.uniform(-3, 3, 200_001)).astype(np.float32)
    _check_dq(be, absmax, a_off, q_off)


def test_double_quantize_special_blocks(be, rng):
    nb = 256 * 400 + 77
    absmax = rng.uniform(1.0, 3.0, nb).astype(np.float32)
    absmax[:256 * 2] = 0.0  # the blocks over the chunk sums, and a zero chunk start
    absmax[256 * 5: 256 * 6] = np.float32(2.0)
    absmax[256 * 7: 256 * 8] = -0.0
    absmax[-5:] = 1e-30
    _check_dq(be, absmax)
    # a block equal to the offset: centered zeros, absmax2 = 0, 1/0 = inf and 0 * inf = NaN -> 0
    _check_dq(be, np.full(nb, np.float32(1.5), np.float32))
    # a NaN or an infinity makes the offset NaN or inf: every block's absmax2 NaN, codes 0
    for bad in (np.nan, np.inf):
        one = absmax.copy()
        one[256 * 9 + 3] = bad
        _check_dq(be, one)


def _cell_edge_values(rng) -> np.ndarray:
    """Every cell edge (|s| bits k * 2^17 and one below) on both sides, each dynamic
    threshold and its fp32 neighbours, signed zeros, infinities, NaN, random fp32 in [-1, 1]."""
    k = np.arange(104 * 64, 128 * 64 + 2, dtype=np.uint32)
    edges = np.concatenate([k << 17, (k << 17) - 1]).view(np.float32)
    t = bnb.DYNAMIC_THRESHOLDS.astype(np.float32)
    near = np.concatenate([t, np.nextafter(t, np.float32(np.inf)), np.nextafter(t, np.float32(-np.inf))])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 2.0, -2.0, 1e-38, -1e-45],
                       np.float32)
    rand = rng.uniform(-1, 1, 20000).astype(np.float32)
    tiny = (rng.uniform(-1, 1, 4000) * np.exp2(rng.uniform(-40, 0, 4000))).astype(np.float32)
    return np.concatenate([edges, -edges, near, special, rand, tiny])


def test_blockwise_rounding_every_cell_edge(be, rng):
    """Blocks of 64 whose first element is 1.0 (absmax 1, 1/absmax = 1): s is the value itself."""
    vals = _cell_edge_values(rng)
    vals = vals[(np.abs(vals) <= 1) | np.isnan(vals)]  # absmax stays 1.0 (NaN is ignored)
    blocks = -(-vals.size // 63)
    body = np.zeros(blocks * 63, np.float32)
    body[: vals.size] = vals
    x = np.concatenate([np.ones((blocks, 1), np.float32), body.reshape(blocks, 63)], axis=1).reshape(-1)
    for bs in (64, 256):
        codes, absmax = filled(x.size, np.uint8), filled(bnb.nblocks(x.size, bs), np.float32)
        thr = to_cuda(bnb.DYNAMIC_THRESHOLDS.astype(np.float32))
        be.quantize_blockwise(to_cuda(x), thr, codes, absmax, blocksize=bs)
        rc, ra = bnb.quantize_blockwise(x, bs)
        got = to_host(codes)
        bad = np.flatnonzero(got != rc)
        assert bad.size == 0, (bs, x[bad[:8]], got[bad[:8]], rc[bad[:8]])
        assert np.array_equal(bits(to_host(absmax)), bits(ra))


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_blockwise_dtypes_blocksizes(be, rng, dtype):
    for bs in bnb.BLOCKSIZES_8BIT:
        n = 7 * bs + 13 if bs < 4096 else 3 * bs + 5
        x = (rng.standard_normal(n) * np.exp2(rng.uniform(-6, 6, n))).astype(FLOAT_DTYPES[dtype])
        x[rng.integers(0, n, 5)] = 0
        x[3] = np.nan
        for off in (0, 1):
            codes, absmax = filled(n, np.uint8, off), filled(bnb.nblocks(n, bs), np.float32)
            be.quantize_blockwise(to_cuda(x, off), to_cuda(bnb.DYNAMIC_THRESHOLDS.astype(np.float32)), codes, absmax,
                                  blocksize=bs)
            rc, ra = bnb.quantize_blockwise(x, bs)
            assert np.array_equal(to_host(codes), rc), (bs, off)
            assert np.array_equal(bits(to_host(absmax)), bits(ra)), (bs, off)


def test_blockwise_large_persistent(be, rng):
    """More elements than the persistent grid covers in one pass (several chunks per thread)."""
    n = (1 << 23) + 1000
    x = rng.standard_normal(n).astype(np.float32)
    codes, absmax = filled(n, np.uint8), filled(bnb.nblocks(n, 256), np.float32)
    be.quantize_blockwise(to_cuda(x), to_cuda(bnb.DYNAMIC_THRESHOLDS.astype(np.float32)), codes, absmax, blocksize=256)
    rc, ra = bnb.quantize_blockwise(x, 256)
    assert np.array_equal(to_host(codes), rc)
    assert np.array_equal(bits(to_host(absmax)), bits(ra))


@pytest.mark.parametrize("kind", ["dense", "uniform"])
def test_blockwise_other_thresholds(be, rng, kind):
    """Thresholds two to a cell (dense near 0: the round8 fallback) or one per cell (a uniform
    map): both exact."""
    if kind == "dense":
        code = np.sort(np.concatenate([np.linspace(-1e-3, 1e-3, 255), [1.0]])).astype(np.float32)
    else:
        code = np.linspace(-1, 1, 256).astype(np.float32)
    thr = bnb.code_thresholds(code)
    n = 64 * 500
    x = (rng.standard_normal(n) * (1e-3 if kind == "dense" else 1.0)).astype(np.float32)
    x[::64] = 1.0 if kind == "uniform" else 1e-3
    codes, absmax = filled(n, np.uint8), filled(bnb.nblocks(n, 64), np.float32)
    be.quantize_blockwise(to_cuda(x), to_cuda(thr), codes, absmax, blocksize=64)
    rc, ra = bnb.quantize_blockwise(x, 64, thr)
    assert np.array_equal(to_host(codes), rc)
    assert np.array_equal(bits(to_host(absmax)), bits(ra))


def test_double_quantize_repeated_same_buffers(be, rng):
    """The same outputs twice (the counter lives in them), then other values into the same buffers."""
    nb = 5 * 8192 + 3
    q, a2, off = filled(nb, np.uint8), filled(bnb.nblocks(nb, 256), np.float32), filled(1, np.float32)
    for scale in (1.0, 1.0, 3.0):
        absmax = (np.exp2(rng.uniform(-4, 2, nb)) * scale).astype(np.float32)
        be.double_quantize(to_cuda(absmax), q, a2, off)
        torch.cuda.synchronize()
        rq, ra2, roff = bnb.double_quantize(absmax)
        assert same_bits(to_host(off), np.array([roff], np.float32))
        assert np.array_equal(to_host(q), rq)
        assert same_bits(to_host(a2), ra2)


def test_blockwise_thresholds_one_ulp_off(be, rng):
    """The dynamic map's thresholds with one of them one ulp up: not the compile-time table's
    (the kernel builds its own), and values at that threshold round by the thresholds passed."""
    thr = bnb.DYNAMIC_THRESHOLDS.astype(np.float32).copy()
    j = 200
    thr[j] = np.nextafter(thr[j], np.float32(np.inf))
    n = 64 * 300
    x = rng.uniform(-1, 1, n).astype(np.float32)
    x[::64] = 1.0
    x[1:64 * 50:64] = bnb.DYNAMIC_THRESHOLDS[j]  # between the old and the new threshold
    x[2:64 * 50:64] = thr[j]
    for bs in (64, 4096):
        codes, absmax = filled(n, np.uint8), filled(bnb.nblocks(n, bs), np.float32)
        be.quantize_blockwise(to_cuda(x), to_cuda(thr), codes, absmax, blocksize=bs)
        rc, ra = bnb.quantize_blockwise(x, bs, thr)
        assert np.array_equal(to_host(codes), rc), bs
        assert np.array_equal(bits(to_host(absmax)), bits(ra)), bs
