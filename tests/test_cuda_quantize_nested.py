"""quantize_4bit with double quantization in one cooperative launch (the cuda backend's
``quantize_4bit_nested``, quantize_4bit_nested_kernel in kernels_cuda/bnb_4bit.cu): bit-exact
against quantcore.formats.bnb (quantize_4bit, then double_quantize of its absmax).

What the one launch can get wrong, and the tests aimed at it: the units each CTA quantizes (every
G-th; a unit's first and last blocks, a partial last unit whose tree leaves are zero-padded, the
partial last block of the input); the leaf sums in qabsmax's first bytes (unaligned qabsmax: the
8-byte alignment inside it, and the byte-wise code stores); the grid barrier in absmax2's last
word (the last block's absmax2 written over it at the end; repeated calls on the same buffers; a CUDA-graph
replay, where the host's memset of the word is a captured node); units of 2^log2ub nested blocks
(log2ub > 0 from 2^20 blocks on); the shared-memory capacity edge (the largest input a resident
grid holds takes the launch, one unit more falls back to the two ops). Inputs too big for the numpy
reference in a test are compared with the two-op path (the default, QUANTCORE_CUDA_TUNE=q4_nested=0:
quantize_4bit and double_quantize version 3, both certified bit-exact by the conformance suite). The
one launch is opt-in (q4_nested=1): measured slower on the H200 (docs/performance.md, Q4N rows).

GPU tests: skipped with the reason where the cuda backend is unavailable.
"""

from __future__ import annotations

import numpy as np
import pytest

import quantcore as qc
from quantcore.formats import bnb

from .conftest import FLOAT_DTYPES, same_bits
from .cuda_arrays import CUDA, TUNE, filled, needs_cuda, to_cuda, to_host

pytestmark = needs_cuda
torch = pytest.importorskip("torch") if CUDA else None


@pytest.fixture(scope="module")
def be():
    return qc.get_backend("cuda")


@pytest.fixture(autouse=True)
def opt_in(monkeypatch):
    """The one launch is opt-in (QUANTCORE_CUDA_TUNE=q4_nested=1): measured slower than the two ops."""
    monkeypatch.setenv(TUNE, "q4_nested=1")


@pytest.fixture
def taken(monkeypatch):
    """The fused launch's eligibility results, in call order (True: one launch)."""
    from quantcore.backends import cuda as cuda_backend

    got: list[bool] = []
    real = cuda_backend.CudaBackend._quantize_4bit_fused

    def spy(*args, **kwargs):
        ok = real(*args, **kwargs)
        got.append(ok)
        return ok

    monkeypatch.setattr(cuda_backend.CudaBackend, "_quantize_4bit_fused", staticmethod(spy))
    return got


def _outs(n: int, bs: int, q_off: int = 0):
    nb = bnb.nblocks(n, bs)
    packed = filled((n + 1) // 2, np.uint8).view(-1, 1)
    return packed, filled(nb, np.uint8, q_off), filled(bnb.nblocks(nb, bnb.NESTED_BLOCKSIZE), np.float32), \
        filled(1, np.float32)


def _run(be, xt, n, bs, qt, q_off=0):
    outs = _outs(n, bs, q_off)
    be.quantize_4bit_nested(xt, *outs, blocksize=bs, quant_type=qt)
    torch.cuda.synchronize()
    return [to_host(o) for o in outs]


def _check_ref(be, x: np.ndarray, bs: int, qt: str, x_off: int = 0, q_off: int = 0) -> None:
    _expect(_run(be, to_cuda(x, x_off), x.size, bs, qt, q_off), x, bs, qt)


def _expect(got: list, x: np.ndarray, bs: int, qt: str) -> None:
    """The four outputs (host copies) against the reference: quantize_4bit, then double_quantize."""
    packed, absmax = bnb.quantize_4bit(x, bs, qt)
    q, a2, off = bnb.double_quantize(absmax)
    assert np.array_equal(got[0], packed), "packed"
    bad = np.flatnonzero(got[1] != q)
    assert bad.size == 0, ("qabsmax", bad[:10], got[1][bad[:10]], q[bad[:10]])
    assert same_bits(got[2], a2), "absmax2"
    assert same_bits(got[3], np.array([off], np.float32)), ("offset", got[3], off)


def _check_two_ops(be, xt, n: int, bs: int, qt: str, monkeypatch) -> None:
    fused = _run(be, xt, n, bs, qt)
    monkeypatch.setenv(TUNE, "q4_nested=0")
    plain = _run(be, xt, n, bs, qt)
    monkeypatch.setenv(TUNE, "q4_nested=1")
    assert np.array_equal(fused[0], plain[0]), "packed"
    assert np.array_equal(fused[1], plain[1]), "qabsmax"
    assert same_bits(fused[2], plain[2]) and same_bits(fused[3], plain[3]), "absmax2 / offset"


def _normal(rng, n: int, bs: int, dtype: str) -> np.ndarray:
    nb = bnb.nblocks(n, bs)
    scale = np.repeat(np.exp2(rng.uniform(-8, 8, nb)), bs)[:n]
    return (rng.standard_normal(n) * scale).astype(FLOAT_DTYPES[dtype])


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
@pytest.mark.parametrize("qt", bnb.QUANT_TYPES)
@pytest.mark.parametrize("bs", bnb.BLOCKSIZES_4BIT)
def test_fused_matches_reference(be, rng, taken, dtype, qt, bs):
    """Every dtype x format x blocksize: 5 units of 256 blocks plus a partial block (5 CTAs)."""
    n = (5 * 256 * bs) - bs // 2 + 1 if bs <= 1024 else 300 * bs + 7
    _check_ref(be, _normal(rng, n, bs, dtype), bs, qt)
    assert taken == [True]


@pytest.mark.parametrize("nb", [1, 7, 8, 9, 255, 256, 257, 511, 513, 4099, 65536, 65537, 300_001])
def test_fused_sizes(be, rng, taken, nb):
    """Block counts around the tree's and the units' edges (below 8 blocks the leaf sum does not
    fit in qabsmax's bytes: the two ops run)."""
    bs = 64
    n = nb * bs - 13
    _check_ref(be, _normal(rng, n, bs, "bfloat16"), bs, "nf4")
    from quantcore.backends import cuda as cuda_backend

    unit = 256 << cuda_backend._nest_units(nb)[0]
    expect = 8 * -(-nb // unit) <= nb  # the leaves fit in qabsmax (a torch buffer: 8-aligned)
    assert taken == [expect], (nb, taken)


@pytest.mark.parametrize("x_off,q_off", [(1, 0), (0, 1), (0, 3), (3, 5)])
def test_fused_unaligned(be, rng, taken, x_off, q_off):
    """x off 16 bytes (element loads), qabsmax off 8 bytes (the leaves' alignment, byte stores)."""
    bs = 64
    n = 700 * bs + 5
    _check_ref(be, _normal(rng, n, bs, "float16"), bs, "fp4", x_off, q_off)
    assert taken == [True]


def test_fused_special_values(be, rng, taken):
    """Zero blocks, a lone NaN, -0.0, subnormal-only and huge blocks in the bulk (finite offset)."""
    bs = 128
    x = _normal(rng, 600 * bs + 3, bs, "float32")
    x[5 * bs: 6 * bs] = 0.0
    x[7 * bs: 8 * bs] = -0.0
    x[9 * bs + 4] = np.nan
    x[11 * bs: 12 * bs] = np.float32(1e-42)
    x[13 * bs: 14 * bs] = np.float32(3e38)
    _check_ref(be, x, bs, "nf4")
    assert taken == [True]


def test_fused_nan_block(be, rng, taken):
    """An all-NaN block: NaN absmax, NaN offset; every code follows it."""
    bs = 64
    x = _normal(rng, 500 * bs, bs, "bfloat16")
    x[3 * bs: 4 * bs] = np.nan
    _check_ref(be, x, bs, "fp4")
    assert taken == [True]


def test_fused_repeated_same_buffers(be, rng, taken):
    """The same outputs three times (the barrier word lives in absmax2), other values each time."""
    bs, n = 64, 2000 * 64 + 9
    outs = _outs(n, bs)
    for scale in (1.0, 1.0, 5.0):
        x = (_normal(rng, n, bs, "float16").astype(np.float32) * scale).astype(np.float16)
        be.quantize_4bit_nested(to_cuda(x), *outs, blocksize=bs, quant_type="nf4")
        torch.cuda.synchronize()
        _expect([to_host(o) for o in outs], x, bs, "nf4")
    assert taken == [True] * 3


def test_fused_in_a_cuda_graph(be, rng, taken):
    """Captured once (the barrier word's memset and the cooperative launch), replayed on new data."""
    bs, n = 64, 4096 * 64 + 3
    src = to_cuda(_normal(rng, n, bs, "bfloat16"))
    outs = _outs(n, bs)
    be.quantize_4bit_nested(src, *outs, blocksize=bs, quant_type="nf4")  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        be.quantize_4bit_nested(src, *outs, blocksize=bs, quant_type="nf4")
    for _ in range(2):
        x = _normal(rng, n, bs, "bfloat16")
        src.copy_(to_cuda(x))
        g.replay()
        torch.cuda.synchronize()
        _expect([to_host(o) for o in outs], x, bs, "nf4")
    assert taken[:2] == [True, True]


@pytest.mark.parametrize("nb,tune,units", [((1 << 21) + 3, "q4_nested=1,q4n_ub=0", (0, 1 << 14)),
                                           ((1 << 22) + 1, "q4_nested=1", (2, 1 << 13))])
def test_fused_larger_units(be, taken, monkeypatch, nb, tune, units):
    """The largest tree top (16384 leaves, 32 per thread: units of 256 blocks) and the default units
    of 1024 blocks (log2ub = 2) at 2^22 + 1 blocks: against the two ops."""
    from quantcore.backends import cuda as cuda_backend

    monkeypatch.setenv(TUNE, tune)
    assert cuda_backend._nest_units(nb) == units
    bs = 64
    n = nb * bs - 1
    xt = torch.randn(n, device="cuda", dtype=torch.float16)
    _check_two_ops(be, xt, n, bs, "nf4", monkeypatch)
    assert taken[0] is True


@pytest.mark.parametrize("edge", ["largest", "one_more"])
def test_fused_capacity_edge(be, taken, monkeypatch, edge):
    """The largest input whose absmax the resident grid keeps in shared memory (kNestMaxAbsmax per
    CTA) takes the one launch; one unit more falls back to the two ops."""
    from quantcore.backends import cuda as cuda_backend
    from quantcore.backends.cuda import runtime as rt

    launch = rt.Launcher(torch.empty(1, device="cuda", dtype=torch.float16))
    expr = cuda_backend._q4("qc::F16", "nf4", nested=True)
    per_sm = cuda_backend._coop_ctas_per_sm(launch, cuda_backend._F4, expr, cuda_backend._Q4N_THREADS,
                                            cuda_backend._Q4N_MAX_ABSMAX * 4)
    ctas = per_sm * rt.sm_count(launch.device)
    cap = cuda_backend._Q4N_MAX_ABSMAX * ctas
    unit = 256 << cuda_backend._nest_units(cap)[0]
    nb = cap - 5 if edge == "largest" else cap + unit - 5
    if 256 << cuda_backend._nest_units(nb)[0] != unit:
        pytest.skip(f"this device holds {ctas} CTAs: the unit size changes at the edge")
    bs = 64
    n = nb * bs
    xt = torch.randn(n, device="cuda", dtype=torch.float16)
    _check_two_ops(be, xt, n, bs, "fp4", monkeypatch)
    assert taken[0] is (edge == "largest"), (nb, ctas, taken)
    del xt
    torch.cuda.empty_cache()


def test_two_ops_by_default(be, rng, taken, monkeypatch):
    """QUANTCORE_CUDA_TUNE=q4_nested=0 (the default): the two ops (same bits)."""
    monkeypatch.setenv(TUNE, "q4_nested=0")
    bs = 256
    _check_ref(be, _normal(rng, 900 * bs + 1, bs, "bfloat16"), bs, "nf4")
    assert taken == []
