"""The numpy reference works in chunks: bounded temporaries, and the same bits as one whole pass.

quantcore/formats/bnb.py and ggml.py run their per-block math over chunks of whole blocks
(``bnb.CHUNK_ELEMS``, ``ggml.CHUNK_BLOCKS``) and the ``reference`` backend (the cpu backend's
numpy path) writes straight into the outputs
the core allocated; gemv_4bit dequantizes the weight a panel of rows at a time. Before this, the
peak was about 5.5x the input (22 bytes per fp32 element) in quantize_4bit.

Peak memory is measured with tracemalloc (numpy reports its buffers to it): the allocations made
during one call, outputs included, must stay within the outputs plus a fixed 64 MB, which keeps
the whole process (input, outputs, temporaries) within 2x the input plus 64 MB.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import quantcore as qc
from quantcore.arrays import BF16
from quantcore.formats import bnb, ggml

MB = 1 << 20
FIXED = 64 * MB  #: the fixed allowance for temporaries, whatever the tensor's size
BIG = 1 << 24  #: elements of the tracemalloc tensors (64 MB of fp32)
ONE_CHUNK = 1 << 40  #: a chunk size no tensor here reaches: one pass over everything, as before


def _traced(fn):
    """``(result, peak bytes allocated during fn())``; what existed before is not counted."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        res = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return res, peak


def _nbytes(*arrays) -> int:
    return sum(np.asarray(a).nbytes for a in arrays)


def _check_peak(peak: int, outputs: int, tensor_bytes: int, inputs: int) -> None:
    """Temporaries (peak less outputs) within FIXED; input + outputs + temporaries <= 2x + FIXED."""
    assert peak - outputs <= FIXED, f"temporaries peaked at {(peak - outputs) / MB:.0f} MB"
    assert inputs + peak <= 2 * tensor_bytes + FIXED, f"peak {(inputs + peak) / tensor_bytes:.2f}x"


@pytest.fixture(scope="module")
def big():
    return np.random.default_rng(2201).standard_normal(BIG, dtype=np.float32)


@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_quantize_4bit_peak_memory(big, nested):
    (packed, st), peak = _traced(lambda: qc.quantize_4bit(big, 64, "nf4", nested, backend="reference"))
    outs = [packed, st.absmax] + ([st.offset, st.state2.absmax] if nested else [])
    _check_peak(peak, _nbytes(*outs), big.nbytes, big.nbytes)
    ref_p, ref_a = bnb.quantize_4bit(big[: 64 * 4096], 64, "nf4")  # spot check of the first blocks
    assert np.array_equal(packed.reshape(-1)[: ref_p.size], ref_p.reshape(-1))
    if not nested:
        assert np.array_equal(st.absmax[:4096], ref_a)


def test_dequantize_4bit_peak_memory(big):
    packed, st = qc.quantize_4bit(big, 64, "fp4", True, backend="reference")
    out, peak = _traced(lambda: qc.dequantize_4bit(packed, st, backend="reference"))
    _check_peak(peak, out.nbytes, big.nbytes, _nbytes(packed, st.absmax))
    assert np.abs(out - big).max() <= 0.25 * np.abs(big).max()


def test_gemv_4bit_peak_memory(big):
    n, k = 4096, BIG // 4096
    packed, st = qc.quantize_4bit(big.reshape(n, k), 64, "nf4", True, backend="reference")
    a = np.random.default_rng(2202).standard_normal((3, k), dtype=np.float32)
    y, peak = _traced(lambda: qc.gemv_4bit(a, packed, st, backend="reference"))
    # No full dequantized weight (that alone would be 64 MB): only a panel of rows at a time.
    assert peak - y.nbytes <= FIXED // 2, f"gemv temporaries peaked at {(peak - y.nbytes) / MB:.0f} MB"
    w = qc.dequantize_4bit(packed, st, backend="reference")
    ref = a @ w.T  # one pass over the whole weight, as before
    assert np.all(np.abs(y - ref) <= 4 * k * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(w).T))


def test_blockwise_peak_memory(big):
    (codes, st), peak = _traced(lambda: qc.quantize_blockwise(big, 4096, backend="reference"))
    _check_peak(peak, _nbytes(codes, st.absmax), big.nbytes, big.nbytes)
    out, peak = _traced(lambda: qc.dequantize_blockwise(codes, st, backend="reference"))
    _check_peak(peak, out.nbytes, big.nbytes, _nbytes(codes, st.absmax))


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q8_1"])
def test_ggml_peak_memory(big, fmt):
    w = big.reshape(-1, 4096)
    q, peak = _traced(lambda: getattr(qc, f"quantize_{fmt}")(w, backend="reference"))
    _check_peak(peak, q.nbytes, big.nbytes, big.nbytes)
    if fmt == "q8_1":
        return
    out, peak = _traced(lambda: getattr(qc, f"dequantize_{fmt}")(q, backend="reference"))
    _check_peak(peak, out.nbytes, big.nbytes, q.nbytes)


def test_ggml_gemm_peak_memory():
    """The fp64 reference gemm's M x N x K/32 partial sums go tile by tile."""
    rng = np.random.default_rng(2209)
    w = rng.standard_normal((512, 4096), dtype=np.float32)
    a = rng.standard_normal((128, 4096), dtype=np.float32)
    wq, aq = qc.quantize_q4_0(w, backend="reference"), qc.quantize_q8_1(a, backend="reference")
    out, peak = _traced(lambda: qc.gemm_q4_0_q8_1(wq, aq, 512, 128, 4096, backend="reference"))
    assert peak - out.nbytes <= FIXED, f"gemm temporaries peaked at {(peak - out.nbytes) / MB:.0f} MB"
    out2, peak = _traced(lambda: qc.gemm_w4a8(wq, a, 512, 128, 4096, backend="reference"))
    assert peak - out2.nbytes <= FIXED and np.array_equal(out, out2)


# -- chunking changes no bit ----------------------------------------------------------------------
def _awkward(rng: np.random.Generator, n: int, dtype) -> np.ndarray:
    """Values over many scales, with NaN, +-Inf, +-0, subnormals and all-zero stretches."""
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-42, 30, size=n // 100 + 1).repeat(100)[:n]
    x = x.astype(np.float32)
    idx = rng.integers(0, n, size=n // 40)
    x[idx] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -3e-39], np.float32), idx.size)
    x[n // 3 : n // 3 + 700] = 0.0
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def _with_chunks(monkeypatch, elems: int, fn):
    monkeypatch.setattr(bnb, "CHUNK_ELEMS", elems)
    monkeypatch.setattr(ggml, "CHUNK_BLOCKS", max(1, elems // ggml.QK))
    return fn()


def _flat_bytes(*arrays) -> list[bytes]:
    out = []
    for a in arrays:
        if isinstance(a, qc.QuantState):
            out += _flat_bytes(a.absmax, a.offset if a.offset is not None else np.zeros(0),
                               a.state2.absmax if a.state2 is not None else np.zeros(0))
        else:
            a = np.asarray(a)
            out.append((a.shape, str(a.dtype), a.tobytes()))
    return out


#: Chunk sizes: one chunk (the whole tensor, as before chunking), odd numbers of blocks, one block.
CHUNKS = [ONE_CHUNK, 3 * 4096 + 64, 1000, 1]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_bnb_chunking_is_bit_exact(monkeypatch, dtype):
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(2203)
    cases = []
    for n in (1, 63, 64 * 256 * 3 + 33, 40_001):
        x = _awkward(rng, n, dt)
        for bs, qt, nested in ((64, "nf4", True), (32, "fp4", False), (4096, "nf4", True), (128, "fp4", True)):
            cases.append((x, bs, qt, nested))

    def run():
        res = []
        with np.errstate(all="ignore"):
            for x, bs, qt, nested in cases:
                p, st = qc.quantize_4bit(x, bs, qt, nested, backend="reference")
                res += _flat_bytes(p, st, qc.dequantize_4bit(p, st, backend="reference"),
                                   qc.dequantize_4bit(p, st, "float32", backend="reference"))
                if bs >= 64:
                    c, s8 = qc.quantize_blockwise(x, bs, backend="reference")
                    res += _flat_bytes(c, s8, qc.dequantize_blockwise(c, s8, backend="reference"))
        return res

    whole = _with_chunks(monkeypatch, ONE_CHUNK, run)
    for elems in CHUNKS[1:]:
        assert _with_chunks(monkeypatch, elems, run) == whole, f"chunks of {elems} elements differ"


def test_double_quantize_chunking_is_bit_exact(monkeypatch):
    """The offset is the mean of ALL absmax (one pairwise tree, summed chunk by chunk here)."""
    rng = np.random.default_rng(2204)
    absmax = [np.abs(rng.standard_normal(n)).astype(np.float32) * 3 for n in (1, 255, 5000, 70_003)]
    absmax[2][:7] = np.nan
    absmax.append(-np.zeros(4099, np.float32))

    def run():
        with np.errstate(all="ignore"):
            return [_flat_bytes(*bnb.double_quantize(a)) for a in absmax] + \
                   [np.float64(bnb.pairwise_sum_f64(a)).tobytes() for a in absmax]

    whole = _with_chunks(monkeypatch, ONE_CHUNK, run)
    for elems in (1 << 10, 1000, 256, 1):
        assert _with_chunks(monkeypatch, elems, run) == whole


def test_ggml_chunking_is_bit_exact(monkeypatch):
    rng = np.random.default_rng(2205)
    xs = [_awkward(rng, 7 * 4096, np.float32).reshape(7, 4096), _awkward(rng, 96, np.float16).reshape(1, 96),
          _awkward(rng, 3 * 2 * 160, BF16).reshape(6, 160)]

    def run():
        res = []
        with np.errstate(all="ignore"):
            for x in xs:
                for fmt in ("q4_0", "q8_0", "q8_1"):
                    q = getattr(qc, f"quantize_{fmt}")(x, backend="reference")
                    res += _flat_bytes(q, getattr(qc, f"dequantize_{fmt}")(q, backend="reference"),
                                       getattr(qc, f"dequantize_{fmt}")(q, "float16", backend="reference"))
                # the reference functions themselves, on [..., K] of any rank
                x3 = x.reshape(x.shape[0], 1, -1)
                res += _flat_bytes(ggml.quantize_q4_0(x3), ggml.quantize_q8_0(x3), ggml.quantize_q8_1(x3),
                                   ggml.dequantize_q4_0(ggml.quantize_q4_0(x3)),
                                   ggml.dequantize_q8(ggml.quantize_q8_1(x3), "q8_1"))
        return res

    whole = _with_chunks(monkeypatch, ONE_CHUNK, run)
    for elems in (32 * 1001, 32 * 7, 32):
        assert _with_chunks(monkeypatch, elems, run) == whole


@pytest.mark.parametrize("shape", [(300, 512), (5, 8192), (1, 4160)])
def test_gemv_panels_match_one_pass(monkeypatch, shape):
    """Row panels (and, for a row longer than a chunk, K pieces summed in fp32) against one pass."""
    n, k = shape
    rng = np.random.default_rng(2206)
    w = rng.standard_normal(shape).astype(np.float32)
    packed, st = qc.quantize_4bit(w, 64, "nf4", True, backend="reference")
    a = rng.standard_normal((4, k)).astype(np.float32)
    whole = _with_chunks(monkeypatch, ONE_CHUNK, lambda: qc.gemv_4bit(a, packed, st, backend="reference"))
    wd = qc.dequantize_4bit(packed, st, backend="reference")
    assert np.array_equal(whole, a @ wd.T)  # one pass is today's reference exactly
    scale = np.abs(a) @ np.abs(wd).T
    for elems in (4096, 1000, 64):
        got = _with_chunks(monkeypatch, elems, lambda: qc.gemv_4bit(a, packed, st, backend="reference"))
        assert got.dtype == np.float32 and got.shape == whole.shape
        assert np.all(np.abs(got - whole) <= 4 * k * np.finfo(np.float32).eps * scale), elems


@pytest.mark.parametrize("mnk", [(37, 5, 1024), (64, 24, 2048), (3, 100, 256)])
def test_gemm_tiles_match_one_pass(monkeypatch, mnk):
    m, n, k = mnk
    rng = np.random.default_rng(2210)
    wq = qc.quantize_q4_0(rng.standard_normal((m, k), dtype=np.float32), backend="reference")
    a = rng.standard_normal((n, k), dtype=np.float32)
    aq = qc.quantize_q8_1(a, backend="reference")
    whole = _with_chunks(monkeypatch, ONE_CHUNK, lambda: qc.gemm_q4_0_q8_1(wq, aq, m, n, k, backend="reference"))
    assert np.array_equal(whole, ggml.gemm_q4_0_q8_1(wq, aq).astype(np.float32))
    for elems in (k // 32 * 7, k // 32 * 3) + ((1,) if m * n < 200 else ()):
        got = _with_chunks(monkeypatch, elems, lambda: qc.gemm_q4_0_q8_1(wq, aq, m, n, k, backend="reference"))
        # the same fp64 sum per output, so the same bits (tolerance as a fallback on other numpys)
        np.testing.assert_allclose(got, whole, rtol=1e-6, atol=0)
        got = _with_chunks(monkeypatch, elems, lambda: qc.gemm_w4a8(wq, a, m, n, k, backend="reference"))
        np.testing.assert_allclose(got, whole, rtol=1e-6, atol=0)


# -- 2^31 + 64 elements on a 24 GB machine ---------------------------------------------------------
HUGE = (1 << 31) + 64
GEN_CHUNK = 1 << 24
SPAN = 64 * bnb.NESTED_BLOCKSIZE  #: elements under one nested block: 256 blocks of 64


def _gen(i: int) -> np.ndarray:
    """Generation chunk i of the huge tensor (reproducible alone, so the input can be dropped)."""
    size = min(GEN_CHUNK, HUGE - i * GEN_CHUNK)
    scale = np.float32(2.0 ** ((i % 9) - 4))
    return np.random.default_rng([2207, i]).standard_normal(size, dtype=np.float32) * scale


def _huge_round_trip() -> None:
    """Run in a fresh interpreter (so ru_maxrss is this work's peak); prints a JSON summary."""
    t0 = time.perf_counter()
    x = np.empty(HUGE, dtype=np.float32)
    absmax_ref = np.empty(bnb.nblocks(HUGE, 64), dtype=np.float32)
    for i in range(-(-HUGE // GEN_CHUNK)):
        c = _gen(i)
        x[i * GEN_CHUNK : i * GEN_CHUNK + c.size] = c
        absmax_ref[i * GEN_CHUNK // 64 : (i * GEN_CHUNK + c.size) // 64] = \
            np.fmax.reduce(np.abs(c).reshape(-1, 64), axis=1)
    t_gen = time.perf_counter()
    packed, st = qc.quantize_4bit(x, 64, "nf4", True, backend="reference")
    t_q = time.perf_counter()

    # The double quantization of all 2^25 + 1 absmax values, bit for bit.
    q_ref, a2_ref, off_ref = bnb.double_quantize(absmax_ref)
    assert np.array_equal(st.absmax, q_ref) and np.array_equal(st.state2.absmax, a2_ref)
    assert st.offset.tobytes() == np.float32(off_ref).tobytes()
    del q_ref, a2_ref
    nspans = -(-HUGE // SPAN)
    rng = np.random.default_rng(2208)
    spans = sorted({0, 1, 1023, nspans // 2, nspans - 2, nspans - 1, *rng.integers(0, nspans, 6).tolist()})
    expected = {}
    for j in spans:  # codes of sampled spans against a direct quantization of the span alone
        a, b = j * SPAN, min(HUGE, (j + 1) * SPAN)
        p_ref, am_ref = bnb.quantize_4bit(x[a:b], 64, "nf4")
        assert np.array_equal(packed.reshape(-1)[a // 2 : b // 2], p_ref.reshape(-1)), j
        assert np.array_equal(am_ref, absmax_ref[a // 64 : b // 64]), j
        am = bnb.dequantize_absmax(st.absmax[a // 64 : b // 64], st.state2.absmax[j : j + 1], st.offset[0])
        expected[j] = (bnb.dequantize_4bit(p_ref, am, b - a, 64, "nf4", np.float32), am)
    del x  # the dequantization below regenerates what it compares with
    t_check = time.perf_counter()
    y = qc.dequantize_4bit(packed, st, backend="reference")
    t_dq = time.perf_counter()
    assert y.shape == (HUGE,) and y.dtype == np.float32
    for j in spans:
        a, b = j * SPAN, min(HUGE, (j + 1) * SPAN)
        want, am = expected[j]
        assert np.array_equal(y[a:b], want), j
        i = a // GEN_CHUNK
        xs = _gen(i)[a - i * GEN_CHUNK : b - i * GEN_CHUNK]
        # the round trip: NF4's widest half-gap (between -1 and -0.696) of the true absmax, plus
        # the error of the double-quantized absmax
        blk, blk_q = np.repeat(absmax_ref[a // 64 : b // 64], 64), np.repeat(am, 64)
        assert np.all(np.abs(y[a:b] - xs) <= 0.153 * blk + np.abs(blk_q - blk) + 1e-6 * blk), j
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"elements": HUGE, "input_bytes": HUGE * 4, "peak_rss": rss,
                      "generate_s": round(t_gen - t0, 1), "quantize_s": round(t_q - t_gen, 1),
                      "check_s": round(t_check - t_q, 1), "dequantize_s": round(t_dq - t_check, 1),
                      "total_s": round(time.perf_counter() - t0, 1)}))


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads peak RSS as Linux reports it (KiB)")
@pytest.mark.skipif(_ram_bytes() < 24 * 10**9,
                    reason="needs a machine with at least 24 GB of RAM (an 8 GB input, 8 GB output)")
def test_quantize_dequantize_2_31_plus_64_elements():
    """nf4 with double quantization of a 2^31 + 64 element fp32 tensor, and back, on the cpu
    backend: sampled spans bit for bit, the whole absmax double quantization bit for bit, and the
    process's peak RSS under 2x the input + 2 GB."""
    root = Path(__file__).resolve().parents[1]
    code = "from tests.test_cpu_memory import _huge_round_trip; _huge_round_trip()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    limit = 2 * res["input_bytes"] + 2 * 2**30
    assert res["peak_rss"] <= limit, f"peak RSS {res['peak_rss'] / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB"
