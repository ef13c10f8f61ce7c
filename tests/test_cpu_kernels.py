"""The cpu backend's compiled host kernels: the compiled path is the one taken, it equals the numpy
reference, it is cached, it falls back to numpy without a compiler, threads are settable, and the
hot ops allocate nothing beyond their outputs.

The conformance of the cpu backend (bit-exact, tolerance and safety tiers against the reference)
runs in tests/test_conformance_suite.py; the full level by hand (``quantcore check --backend cpu
--full``, docs/cpu.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from quantcore.backends import cpu as cpu_mod
from quantcore.backends.cpu import COMPILED_OPS, CpuBackend, build
from quantcore.backends.reference import ReferenceBackend

import quantcore as qc
from quantcore.arrays import BF16
from quantcore.errors import ParameterError

from .conftest import same_bits

CPU = qc.get_backend("cpu")
needs_compiler = pytest.mark.skipif(
    CPU.library() is None, reason=f"no compiled cpu kernels here: {CPU.availability().mode}")

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}


@pytest.fixture
def no_numpy_path(monkeypatch):
    """Make the numpy path of every compiled op raise when the cpu backend reaches it."""
    for op in COMPILED_OPS:
        orig = getattr(ReferenceBackend, op)

        def guard(self, *args, _op=op, _orig=orig, **kwargs):
            if isinstance(self, CpuBackend):
                raise AssertionError(f"cpu backend fell back to numpy for {_op}")
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(ReferenceBackend, op, guard)


def _data(rng, n, dtype, specials=True):
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-4, 4, n))).astype(np.float32)
    if specials:
        idx = rng.integers(0, n, size=max(1, n // 50))
        x[idx] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 7e4], np.float32), idx.size)
    with np.errstate(over="ignore"):
        return x.astype(DTYPES[dtype])


@needs_compiler
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("qt", ["nf4", "fp4"])
def test_bnb_ops_compiled_and_exact(rng, no_numpy_path, dtype, qt):
    """quantize (with and without double quantization; odd sizes, partial blocks, NaN / Inf)
    and dequantize: bit for bit the reference, through the compiled path only."""
    for n, bs in ((64 * 37 + 5, 64), (4096 * 3, 4096), (33, 32), (1000, 128)):
        x = _data(rng, n, dtype)
        for nested in (False, True):
            p, st = qc.quantize_4bit(x, bs, qt, nested, backend="cpu")
            rp, rst = qc.quantize_4bit(x, bs, qt, nested, backend="reference")
            assert np.array_equal(p, rp)
            assert same_bits(st.absmax, rst.absmax)
            if nested:
                assert same_bits(st.state2.absmax, rst.state2.absmax) and same_bits(st.offset, rst.offset)
            assert same_bits(qc.dequantize_4bit(p, st, backend="cpu"),
                             qc.dequantize_4bit(rp, rst, backend="reference"))
        codes, st8 = qc.quantize_blockwise(x, 256, backend="cpu")
        rcodes, rst8 = qc.quantize_blockwise(x, 256, backend="reference")
        assert np.array_equal(codes, rcodes) and same_bits(st8.absmax, rst8.absmax)
        assert same_bits(qc.dequantize_blockwise(codes, st8, backend="cpu"),
                         qc.dequantize_blockwise(rcodes, rst8, backend="reference"))


@needs_compiler
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("qt", ["nf4", "fp4"])
def test_dequantize_4bit_extreme_scales_exact(rng, no_numpy_path, dtype, qt):
    """dequantize_4bit bit for bit the reference where the block scale makes fp32-subnormal
    products (the bf16 vector conversion reads subnormals as zero), around the smallest scale with
    normal products, and NaN (payloads that carry in a bits-rounding) / Inf scales; plain and
    double-quantized absmax, several block sizes, through the compiled path."""
    from quantcore.backend import Nested
    from quantcore.formats import bnb

    T = DTYPES[dtype]
    f32 = np.float32
    nan_bits = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFFC00000], np.uint32).view(f32)
    for bs in (32, 64, 128):
        n = 96 * bs + bs // 2 + 3
        nb = bnb.nblocks(n, bs)
        packed = rng.integers(0, 256, (n + 1) // 2, dtype=np.uint8)
        sign = rng.choice(np.array([-1, 1], f32), nb)
        plain = np.exp2(rng.uniform(-149, -96, nb)).astype(f32) * sign  # subnormal to normal products
        plain[:8] = np.exp2(np.arange(-120, -112, dtype=f32))  # around the smallest all-normal scale
        plain[8:12] = nan_bits
        plain[12:18] = np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, 3.4028235e38], f32)
        q = rng.integers(0, 256, nb, dtype=np.uint8)
        a2 = np.exp2(rng.uniform(-140, -100, bnb.nblocks(nb, bnb.NESTED_BLOCKSIZE))).astype(f32)
        a2[0] = nan_bits[0]
        for absmax, nested in ((plain, None), (q, Nested(a2, bnb.DYNAMIC_MAP, np.zeros(1, f32)))):
            eff = plain if nested is None else bnb.dequantize_absmax(q, a2, f32(0), bnb.DYNAMIC_MAP)
            with np.errstate(invalid="ignore", over="ignore"):
                ref = bnb.dequantize_4bit(packed, eff, n, bs, qt, T)
            got = np.empty(n, T)
            CPU.dequantize_4bit(packed, absmax, got, blocksize=bs, quant_type=qt, nested=nested)
            assert same_bits(got, ref), (bs, nested is not None)


@needs_compiler
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference on NaN / Inf blocks
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ggml_ops_compiled_and_exact(rng, no_numpy_path, dtype):
    x = _data(rng, 7 * 128, dtype).reshape(7, 128)
    for fmt in ("q4_0", "q8_0", "q8_1"):
        q = getattr(qc, f"quantize_{fmt}")(x, backend="cpu")
        assert np.array_equal(q, getattr(qc, f"quantize_{fmt}")(x, backend="reference")), fmt
        assert same_bits(getattr(qc, f"dequantize_{fmt}")(q, DTYPES[dtype], backend="cpu"),
                         getattr(qc, f"dequantize_{fmt}")(q, DTYPES[dtype], backend="reference")), fmt


@needs_compiler
@pytest.mark.parametrize("n_act", [1, 3, 8, 11])
def test_gemm_and_gemv_compiled_close(rng, no_numpy_path, n_act):
    """The tolerance-tier ops through the compiled path, against the reference (fp32 relative)."""
    m, k = 67, 512
    w = (rng.standard_normal((m, k)) * 0.05).astype(np.float32)
    a = rng.standard_normal((n_act, k)).astype(np.float32)
    wq = qc.quantize_q4_0(w, backend="cpu")
    got = qc.gemm_w4a8(wq, a, m, n_act, k, backend="cpu")
    ref = qc.gemm_w4a8(wq, a, m, n_act, k, backend="reference")
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    for dtype in DTYPES:
        for bs, nested in ((64, True), (128, False), (32, True), (256, False)):
            p, st = qc.quantize_4bit(w, bs, "nf4", nested, backend="cpu")
            ad = a.astype(DTYPES[dtype])
            g = np.asarray(qc.gemv_4bit(ad, p, st, backend="cpu"), np.float32)
            r = np.asarray(qc.gemv_4bit(ad, p, st, backend="reference"), np.float32)
            tol = 1e-4 if dtype == "float32" else 2e-2
            np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max())


@needs_compiler
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4"])
def test_mx_dequantize_and_swizzle_compiled_and_exact(rng, no_numpy_path, fmt):
    """mx_dequantize (both scale layouts, every output dtype) and the scale layout ops through
    the compiled path; quantize_mx (numpy) makes the inputs, scale bytes 0 and 0xFF included."""
    from quantcore import api_mx

    rows, cols = 130, 96
    x = _data(rng, rows * cols, "float32").reshape(rows, cols)
    kw = {"global_scale": 2688.0 / 50.0} if fmt == "nvfp4" else {}
    for swz in (True, False):
        codes, scales = api_mx.quantize_mx(x, fmt, swizzle=swz, backend="reference", **kw)
        if fmt != "nvfp4":  # E8M0 extremes: the denormal 2^-127 and NaN
            flat = scales.reshape(-1)
            flat[:3] = (0, 0xFF, 1)
        for dtype in DTYPES:
            got = api_mx.dequantize_mx(codes, scales, fmt, DTYPES[dtype], swizzled=swz, backend="cpu", **kw)
            ref = api_mx.dequantize_mx(codes, scales, fmt, DTYPES[dtype], swizzled=swz, backend="reference",
                                       **kw)
            assert same_bits(got, ref), (fmt, swz, dtype)
    s8 = rng.integers(0, 256, size=(rows, 5), dtype=np.uint8)
    swz = api_mx.swizzle_scales(s8, backend="cpu")
    assert np.array_equal(swz, api_mx.swizzle_scales(s8, backend="reference"))
    assert np.array_equal(api_mx.unswizzle_scales(swz, rows, 5, backend="cpu"), s8)


@needs_compiler
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the reference on NaN / Inf blocks
@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4"])
def test_mx_quantize_and_scaled_fp4_mm_compiled(rng, no_numpy_path, fmt):
    """mx_quantize bit for bit (every input dtype, both scale modes, both scale layouts, NaN / Inf
    / denormal inputs) and scaled_fp4_mm against the reference, through the compiled path."""
    from quantcore import api_mx

    rows, cols = 130, 192
    x32 = _data(rng, rows * cols, "float32").reshape(rows, cols)
    x32[3, :32] = np.float32(1e-42)  # an fp32-denormal block: scale byte 0 (MX)
    kw = {"global_scale": 2688.0 / 50.0} if fmt == "nvfp4" else {}
    modes = (None,) if fmt == "nvfp4" else ("floor", "rceil")
    for dtype in DTYPES:
        with np.errstate(over="ignore"):
            x = x32.astype(DTYPES[dtype])
        for swz in (True, False):
            for mode in modes:
                mkw = {} if mode is None else {"scale_mode": mode}
                got = api_mx.quantize_mx(x, fmt, swizzle=swz, backend="cpu", **kw, **mkw)
                ref = api_mx.quantize_mx(x, fmt, swizzle=swz, backend="reference", **kw, **mkw)
                assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1]), (dtype, swz, mode)
    if fmt == "mxfp8":
        return
    m, n, k = 33, 20, 256
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(np.float32)
    qa = api_mx.quantize_mx(a, fmt, backend="reference", **kw)
    qb = api_mx.quantize_mx(b, fmt, backend="reference", **kw)
    bias = rng.standard_normal(n).astype(BF16)
    for bb in (None, bias):
        got = api_mx.scaled_fp4_mm(qa[0], qb[0], qa[1], qb[1], 0.75, bb, fmt=fmt, backend="cpu")
        ref = api_mx.scaled_fp4_mm(qa[0], qb[0], qa[1], qb[1], 0.75, bb, fmt=fmt, backend="reference")
        g, r = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        np.testing.assert_allclose(g, r, rtol=2.0**-7, atol=1e-6 * np.abs(r).max())  # one bf16 ulp


@needs_compiler
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_linear_mx_compiled_within_bound(rng, no_numpy_path, fmt):
    """linear_mx through the compiled kernel (batch 1, 5 and 16; both scale layouts; every input
    dtype) within the conformance bound against the fp64 product of the exact weight values."""
    from quantcore import api_mx
    from quantcore.conformance import bounds
    from quantcore.formats import mx

    n, k = 70, 32 * 7
    w = (rng.standard_normal((n, k)) * np.exp2(rng.uniform(-4, 4, (n, 1)))).astype(np.float32)
    g = mx.nvfp4_global_scale(float(np.abs(w).max())) if fmt == "nvfp4" else None
    codes, scales = mx.quantize(w, fmt, global_scale=g)
    wv = mx.dequantize(codes, scales, fmt, global_scale=g).astype(np.float64)
    for dtype in DTYPES:
        for batch in (1, 5, 16):
            x = (rng.standard_normal((batch, k)) / 4).astype(DTYPES[dtype])
            ref, bound = bounds.linear_mx(x.astype(np.float64), wv, dtype)
            for swizzled, s in ((False, scales), (True, mx.swizzle(scales))):
                got = api_mx.linear_mx(x, codes, s, fmt, global_scale=g, swizzled=swizzled, backend="cpu")
                err = np.abs(np.asarray(got, np.float64) - ref)
                assert (err <= bound.max_abs).all(), (dtype, batch, swizzled, float(np.max(err / bound.max_abs)))


@needs_compiler
def test_gemv_rows_not_aligned_to_blocks(rng, no_numpy_path):
    """K not a multiple of the block size (blocks span rows) and an odd K: the element-wise path."""
    for n, k in ((5, 96), (3, 33)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        p, st = qc.quantize_4bit(w, 64, "fp4", True, backend="cpu")
        a = rng.standard_normal((2, k)).astype(np.float32)
        np.testing.assert_allclose(qc.gemv_4bit(a, p, st, backend="cpu"),
                                   qc.gemv_4bit(a, p, st, backend="reference"), rtol=1e-5, atol=1e-5)


@needs_compiler
def test_threads_settable_and_results_unchanged(rng):
    be = CpuBackend()
    x = _data(rng, 1 << 17, "float32", specials=False)
    w = x.reshape(256, 512)
    a = rng.standard_normal((1, 512)).astype(np.float32)
    results = []
    for n in (1, 2, 3):
        be.set_num_threads(n)
        assert be.num_threads() == n
        p, st = qc.quantize_4bit(x, 64, "nf4", True, backend=be)
        p2, st2 = qc.quantize_4bit(w, 64, "nf4", False, backend=be)
        results.append((p.tobytes(), st.absmax.tobytes(), qc.dequantize_4bit(p, st, backend=be).tobytes(),
                        qc.gemv_4bit(a, p2, st2, backend=be).tobytes()))
    assert results[0] == results[1] == results[2]
    be.set_num_threads(0)
    assert be.num_threads() >= 1
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ParameterError):
            be.set_num_threads(bad)


def test_thread_env_variable(monkeypatch):
    monkeypatch.setenv(cpu_mod.ENV_THREADS, "3")
    assert CpuBackend()._threads == 3
    monkeypatch.setenv(cpu_mod.ENV_THREADS, "many")
    with pytest.raises(ParameterError, match="QUANTCORE_NUM_THREADS"):
        CpuBackend()


@needs_compiler
def test_hot_ops_allocate_only_outputs(rng):
    """quantize / dequantize / gemv (fp32, nested) and gemm_w4a8: what one call allocates is its
    outputs (plus a few KB of Python objects), whatever the size."""
    n, k = 2048, 2048
    w = rng.standard_normal((n, k)).astype(np.float32)
    p, st = qc.quantize_4bit(w, 64, "nf4", True, backend="cpu")
    a = rng.standard_normal((1, k)).astype(np.float32)
    wq = qc.quantize_q4_0(w, backend="cpu")
    qc.gemm_w4a8(wq, a, n, 1, k, backend="cpu")  # the Q8_1 scratch of this thread, kept

    def peak(fn):
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            res = fn()
            return res, tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()

    slack = 64 << 10
    (p2, st2), pk = peak(lambda: qc.quantize_4bit(w, 64, "nf4", True, backend="cpu"))
    outputs = p2.nbytes + st2.absmax.nbytes + st2.state2.absmax.nbytes + st2.offset.nbytes + 4 * st2.absmax.size
    assert pk <= outputs + slack, (pk, outputs)  # (the fp32 absmax of the two-op nested default)
    out, pk = peak(lambda: qc.dequantize_4bit(p, st, backend="cpu"))
    assert pk <= out.nbytes + slack
    y, pk = peak(lambda: qc.gemv_4bit(a, p, st, backend="cpu"))
    assert pk <= y.nbytes + slack
    y, pk = peak(lambda: qc.gemm_w4a8(wq, a, n, 1, k, backend="cpu"))
    assert pk <= y.nbytes + slack


# -- build, cache, fallback --------------------------------------------------------------------------
@needs_compiler
def test_build_is_cached_and_keyed(monkeypatch):
    path = build.build()
    assert path.exists() and path.parent.name == "cpu"
    assert CPU.library() is not None and str(path) == CPU._path

    def no_compile(*a, **k):
        raise AssertionError("a cached, verified library must not be rebuilt")

    real_run = build.subprocess.run
    monkeypatch.setattr(build.subprocess, "run",
                        lambda cmd, *a, **k: real_run(cmd, *a, **k) if "--version" in cmd else no_compile())
    assert build.build() == path
    cxx = build.compiler()
    version = build.compiler_version(cxx)
    key = build.artifact_key(cxx, version)
    assert build.artifact_key(cxx, version + " patched") != key
    monkeypatch.setattr(build, "cpu_identity", lambda: "x86_64|another cpu|avx2")
    assert build.artifact_key(cxx, version) != key
    monkeypatch.setattr(build, "build_flags", lambda: build.BASE_FLAGS)
    assert build.artifact_key(cxx, version) != key


def test_fallback_without_compiler(monkeypatch, tmp_path, rng):
    """A compiler that does not exist: the cpu backend runs the numpy reference and says so."""
    monkeypatch.setenv(build.ENV_CXX, str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("QUANTCORE_CACHE_DIR", str(tmp_path / "cache"))
    be = CpuBackend()
    avail = be.availability()
    assert avail.ok and be.library() is None
    assert "numpy fallback" in avail.mode and "no-such-c++" in avail.mode
    x = _data(rng, 1000, "float32")
    p, st = qc.quantize_4bit(x, 64, "nf4", True, backend=be)
    rp, rst = qc.quantize_4bit(x, 64, "nf4", True, backend="reference")
    assert np.array_equal(p, rp) and same_bits(st.absmax, rst.absmax)


def test_fallback_when_the_build_fails(monkeypatch, tmp_path):
    """A 'compiler' that fails: the fallback, with the failure in the mode."""
    fake = tmp_path / "bad-c++"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo bad 1.0; exit 0; fi\n"
                    "echo 'cannot compile' >&2; exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv(build.ENV_CXX, str(fake))
    monkeypatch.setenv("QUANTCORE_CACHE_DIR", str(tmp_path / "cache"))
    be = CpuBackend()
    assert be.library() is None
    assert "building the cpu kernels failed" in be.availability().mode


def test_info_reports_the_fallback(tmp_path):
    env = dict(os.environ, QUANTCORE_CPU_CXX=str(tmp_path / "missing"),
               QUANTCORE_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "quantcore.cli", "info"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("cpu "))
    assert "numpy fallback" in line and "no C++ compiler found" in line
    assert any(ln.startswith("reference ") and "available" in ln for ln in r.stdout.splitlines())


def test_reference_backend_passes_quick():
    """The numpy reference is the semantics: the suite certifies it too (its quick level)."""
    from quantcore.conformance import run

    report = run("reference", "quick")
    assert report.ok and not report.failures, report.reasons
    assert report.backend == "reference"


@needs_compiler
def test_bench_cpu_has_ceilings_and_peers(capsys, monkeypatch):
    """``quantcore bench --backend cpu`` (tiny shapes): the stream ceilings, quantcore's rows, and
    the host peers that are installed, with speedups."""
    from quantcore import bench

    monkeypatch.setattr(bench, "HOST_STREAM_BYTES", 16 << 20)
    monkeypatch.setattr(bench, "HOST_ROTATE_BYTES", 1 << 20)
    sizes = {"gemv_4bit": [(1, 256, 512)], "gemm_w4a8": [(1, 256, 512)], "dequantize_4bit": [(256, 512)]}
    rep = bench.run("cpu", ops=list(sizes), sizes=sizes, reps=3, verbose=True, png_path=None)
    out = capsys.readouterr().out
    impls = {(r["op"], r["impl"]) for r in rep["rows"]}
    assert {("stream read", "C++ OpenMP"), ("stream copy", "C++ OpenMP")} <= impls
    assert rep["read_gbps"] > 0 and rep["copy_gbps"] > 0
    assert {("gemv_4bit", "quantcore"), ("gemm_w4a8", "quantcore"), ("dequantize_4bit", "quantcore")} <= impls
    assert "% read" in out and "best us" in out and "  gemv_4bit" in out  # table and progress lines
    qc_gemv = next(r for r in rep["rows"] if r["op"] == "gemv_4bit" and r["impl"] == "quantcore")
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    assert {("gemv_4bit", "torch-fp32"), ("gemv_4bit", "torch-bf16"), ("gemm_w4a8", "torch-bf16")} <= impls
    assert {"torch-fp32", "torch-bf16"} <= set(qc_gemv["speedup"])
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return
    assert ("gemv_4bit", "bnb") in impls and "bnb" in qc_gemv["speedup"]
