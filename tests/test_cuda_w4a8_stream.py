"""gemm_w4a8 N <= 8 on sm_90: the stream kernel's two ring fillers, at the kernel-level op.

QUANTCORE_CUDA_TUNE=w4s_load=0 (the default) fills the shared-memory weight ring by 1-D bulk
copies from a producer warp (version 13), w4s_load=1 by 16-byte cp.async from every consumer warp
with cp.async.mbarrier.arrive (W-14, which also loads the activation one block ahead in its
prologue; slower on the H200, kept selectable). The consumer code and its accumulation order are
the same, so the two must give the same bits; these tests check that, and the conformance bounds,
where the cp.async filler can go wrong:
ring wrap-around (2 and 3 stages, short rows), a short last chunk (K / 32 not a multiple of kc),
rows past M in the last tile, empty K slices of a cluster, clusters of 1 / 2 / 4, every N, every
activation dtype, and an activation that is not 16-byte aligned (the element-load prologue).
Every output element is checked written (outputs start as NaN).

CPU part: the launcher's instance list holds both fillers for every cluster size and N (the nvcc
compile test of tests/test_cuda.py compiles them). GPU part: skipped with the reason where the
cuda backend is unavailable; timing: tools/dev/w4a8_device.sh.
"""

from __future__ import annotations

import numpy as np
import pytest
from quantcore.backends import cuda
from quantcore.backends.cuda import common as cuda_common
from quantcore.backends.cuda import ggml as cuda_ggml

import quantcore as qc
from quantcore.formats import ggml

from .conftest import FLOAT_DTYPES, bits
from .cuda_arrays import CUDA, TUNE, needs_cuda
from .test_cuda import _gemm_check, _n, _randn, _t


def test_stream_cluster_rule():
    """The cluster choice measured in docs/performance.md W-16 (H200): one activation block per
    consumer thread up to K = 14336, K slices of >= 112 blocks, the old 2048-block rule above."""
    pick = cuda_ggml.w4_stream_cluster
    # (N x K): cluster at N = 1, 2, 4, 8
    expect = {(4096, 14336): (1, 2, 4, 4), (14336, 4096): (1, 1, 1, 1), (8192, 8192): (1, 1, 2, 2),
              (1024, 8192): (1, 1, 2, 2), (8192, 28672): (1, 1, 2, 4)}
    for (_, k), cls in expect.items():
        assert tuple(pick(nb, k // 32) for nb in (1, 2, 4, 8)) == cls, k
    for nbk in (8, 64, 128, 224, 448, 449, 896, 4096):
        for nb in (1, 2, 4, 8):
            cl = pick(nb, nbk)
            assert cl in (1, 2, 4)
            assert cl == 1 or -(-nbk // cl) >= 112  # no K slice shorter than 112 blocks


def test_both_ring_fillers_are_instantiated():
    insts = {expr for f, expr in cuda.kernel_instances() if f == "ggml.cu"}
    for tag in cuda_common.TYPE_TAG.values():
        for nb in (1, 2, 4, 8):
            for cl in (1, 2, 4):
                for ld in (0, 1):
                    assert f"qc::gemm_w4a8_stream_kernel<{tag}, {nb}, {cl}, {ld}>" in insts


gpu = needs_cuda
torch = pytest.importorskip("torch") if CUDA else None


@pytest.fixture(scope="module")
def be():
    b = qc.get_backend("cuda")
    import quantcore.backends.cuda.runtime as rt  # noqa: PLC0415

    if rt.device_arch(0) < 90:
        pytest.skip("the stream kernel is sm_90 only (this device is older)")
    return b


def _run(be, wq_t, a_t, m, n, tune, monkeypatch):
    monkeypatch.setenv(TUNE, tune)
    out = torch.full((m, n), float("nan"), dtype=torch.float32, device="cuda")
    be.gemm_w4a8(wq_t, a_t, out)
    torch.cuda.synchronize()
    return _n(out)


# (m, n, k, extra tune): geometry forced where the default would not reach the case
_CASES = [
    (1, 1, 256, ""),                        # one row, one chunk
    (37, 3, 1024, "w4s_kc=8,w4s_stages=2"),  # 2-stage ring (1 ahead), 4 chunks, rows past M
    (130, 5, 4096 + 256, "w4s_kc=128,w4s_stages=3"),  # short last chunk (136 = 128 + 8 blocks)
    (301, 6, 2048, "w4s_kc=16,w4s_stages=3"),  # many ring turns, partial last tile
    (1000, 8, 14336, ""),                   # default geometry (cluster 2 at N = 8)
    (261, 7, 16384, ""),                    # cluster 4
    (50, 4, 16384 + 256, "w4s_cl=4"),       # slices past 128 blocks
    (20, 2, 256, "w4s_cl=4"),               # empty K slices (8 blocks, 4 CTAs)
    (4099, 1, 4096, "w4s_cl=2"),            # many tiles per CTA
    (513, 8, 4096, "w4s_cl=1,w4s_fly=1000"),  # kc halved to the depth cap (32 blocks)
]


@gpu
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_cp_async_filler_bit_equal_to_bulk_filler(be, rng, dtype, monkeypatch):
    for m, n, k, tune in _CASES:
        w = _randn(rng, (m, k), "float32", scale_groups=32)
        a = _randn(rng, (n, k), dtype, scale_groups=32)
        wq = ggml.quantize_q4_0(w)
        wq_t, a_t = _t(wq), _t(a)
        sep = "," if tune else ""
        new = _run(be, wq_t, a_t, m, n, f"w4s_load=1{sep}{tune}", monkeypatch)
        old = _run(be, wq_t, a_t, m, n, f"w4s_load=0{sep}{tune}", monkeypatch)
        _gemm_check(wq, ggml.quantize_q8_1(a), new)
        assert np.array_equal(bits(new), bits(old)), (m, n, k, tune)
        again = _run(be, wq_t, a_t, m, n, f"w4s_load=1{sep}{tune}", monkeypatch)
        assert np.array_equal(bits(again), bits(new)), (m, n, k, tune)


@gpu
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_cp_async_filler_unaligned_activation(be, rng, dtype, monkeypatch):
    """An activation starting one element into its buffer: the prologue's element loads."""
    for m, n, k in ((77, 3, 2048), (300, 8, 4096)):
        w = _randn(rng, (m, k), "float32", scale_groups=32)
        a = _randn(rng, (n, k), dtype, scale_groups=32)
        wq = ggml.quantize_q4_0(w)
        flat = _t(a.reshape(-1))
        buf = torch.empty(flat.numel() + 1, dtype=flat.dtype, device="cuda")
        buf[1:].copy_(flat)
        a_t = buf[1:].view(n, k)
        assert a_t.data_ptr() % 16 != 0
        new = _run(be, _t(wq), a_t, m, n, "w4s_load=1", monkeypatch)
        old = _run(be, _t(wq), _t(a), m, n, "w4s_load=0", monkeypatch)
        _gemm_check(wq, ggml.quantize_q8_1(a), new)
        assert np.array_equal(bits(new), bits(old)), (m, n, k)


@gpu
def test_repeated_calls_launch_from_the_cache(be, rng, monkeypatch):
    """A second call with the same geometry, activation dtype and alignment and tuning launches
    from cuda_ggml._W4_LAUNCHES with the new arrays' pointers in its slots: the same bits as the full
    launch; another N, alignment or tuning gets its own entry."""
    monkeypatch.delenv(TUNE, raising=False)
    monkeypatch.setattr(cuda_ggml, "_W4_LAUNCHES", {})
    m, k = 300, 2048
    wq = ggml.quantize_q4_0(_randn(rng, (m, k), "float32", scale_groups=32))
    calls = []

    class Counting:
        def __init__(self, launch):
            self.launch = launch

        def __call__(self, *args):
            calls.append(args)
            self.launch(*args)

    def place(a, unaligned):  # a fresh device copy of a, one element into its buffer if unaligned
        flat = _t(a.reshape(-1))
        buf = torch.empty(flat.numel() + 1, dtype=flat.dtype, device="cuda")
        buf[int(unaligned):int(unaligned) + flat.numel()].copy_(flat)
        out = buf[int(unaligned):int(unaligned) + flat.numel()].view(a.shape)
        assert (out.data_ptr() % 16 != 0) == unaligned
        return out

    seen = set()
    for n, tune, unaligned in ((1, "", False), (5, "", False), (5, "", True), (5, "w4s_kc=64", False)):
        a = _randn(rng, (n, k), "bfloat16", scale_groups=32)
        first = _run(be, _t(wq), place(a, unaligned), m, n, tune, monkeypatch)
        new = set(cuda_ggml._W4_LAUNCHES) - seen
        assert len(new) == 1, (n, tune, unaligned)  # the full launch kept one entry
        key = new.pop()
        seen.add(key)
        entry = cuda_ggml._W4_LAUNCHES[key]
        entry.gemm = Counting(entry.gemm)
        before = len(calls)
        wq2, a2 = _t(wq), place(a, unaligned)  # other buffers, same geometry and alignment
        again = _run(be, wq2, a2, m, n, tune, monkeypatch)
        assert len(calls) == before + 1 and calls[-1][1:] == (wq2.data_ptr(), a2.data_ptr(), calls[-1][3])
        _gemm_check(wq, ggml.quantize_q8_1(a), again)
        assert np.array_equal(bits(again), bits(first)), (n, tune, unaligned)
    assert len(cuda_ggml._W4_LAUNCHES) == 4


@gpu
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_linear_launch_writes_y_bitwise_as_the_fp32_launch(be, rng, dtype, monkeypatch):
    """The kept launch's linear form (the kernel's yt = 1, what LinearQ4_0's bound forward runs with
    the weight's pointer written into its buffer)
    writes y [N, M] in the activation's dtype: the bits of the fp32 [M, N] launch transposed and
    converted by torch (one rounding of the same sums; overflow to inf in fp16 included), every
    element written (y starts as NaN), for both ring fillers and every geometry of _CASES."""
    monkeypatch.setattr(cuda_ggml, "_W4_LAUNCHES", {})
    import quantcore.backends.cuda.runtime as rt  # noqa: PLC0415

    stream = rt.raw_stream_getter()
    for ld in (0, 1):
        for m, n, k, tune in _CASES:
            w = _randn(rng, (m, k), "float32", scale_groups=32)
            a = _randn(rng, (n, k), dtype, scale_groups=32)
            wq_t, a_t = _t(ggml.quantize_q4_0(w)), _t(a)
            sep = "," if tune else ""
            old = torch.from_numpy(_run(be, wq_t, a_t, m, n, f"w4s_load={ld}{sep}{tune}", monkeypatch))
            entry = cuda_ggml.w4_launch(0, wq_t, a_t, n, k)  # kept by that call
            assert entry is not None, (ld, m, n, k, tune)
            y = torch.full((n, m), float("nan"), dtype=a_t.dtype, device="cuda")
            entry.planned(0, 1)(stream(0), wq_t.data_ptr(), a_t.data_ptr(), y.data_ptr())
            want = old.cuda().t().to(a_t.dtype).contiguous()
            iv = torch.int16 if a_t.dtype.itemsize == 2 else torch.int32
            assert torch.equal(y.view(iv), want.view(iv)), (ld, m, n, k, tune)
