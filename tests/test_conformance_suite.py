"""The conformance suite itself: the cpu backend passes it, and it catches wrong kernels.

Each toy backend below is the cpu backend with one deliberate bug (or one legitimate variation),
registered at run time exactly as a vendor would register theirs. A suite that lets any of the
bugs through, or blames the wrong op or tier, proves nothing; one that fails a legitimate variant
is too strict.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
from quantcore.backends.cpu import CpuBackend

import quantcore
from quantcore.backend import Capability
from quantcore.conformance import harness, run
from quantcore.conformance.runner import NOT_SUPPORTED, PASSED, main
from quantcore.formats import bnb, ggml
from quantcore.ops import ALL_CAPABILITIES

from .conftest import needs_install

REPO = Path(__file__).resolve().parents[1]


# -- toy backends ------------------------------------------------------------------------------------
def _root_buffer(a: np.ndarray) -> np.ndarray:
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root


class OffByOneBlock(CpuBackend):
    """dequantize_4bit scales element i by absmax[(i + 1) // blocksize]: the last element of every
    block takes the next block's scale."""

    name = "toy-off-by-one-block"

    def dequantize_4bit(self, packed, absmax, out, *, blocksize, quant_type, nested):
        n = out.size
        am = self._absmax(absmax, nested)
        q = bnb.unpack_4bit_bnb(packed, n)
        block = np.minimum((np.arange(n) + 1) // blocksize, am.size - 1)
        out.reshape(-1)[...] = (bnb.code_4bit(quant_type)[q] * am[block]).astype(np.float32).astype(out.dtype)


class OutOfBoundsWrite(CpuBackend):
    """dequantize_blockwise writes two bytes past the end of its output (only where there is
    memory to write, so the toy cannot corrupt the process)."""

    name = "toy-out-of-bounds"

    def dequantize_blockwise(self, codes, absmax, code, out, *, blocksize):
        super().dequantize_blockwise(codes, absmax, code, out, blocksize=blocksize)
        root = _root_buffer(out)
        end = out.ctypes.data - root.ctypes.data + out.nbytes
        if root.dtype == np.uint8 and root.ndim == 1 and end + 2 <= root.nbytes:
            root[end: end + 2] = 0


class SwappedNibbles(CpuBackend):
    """quantize_4bit packs element 2i in the LOW nibble (ggml / MX order, not bitsandbytes')."""

    name = "toy-swapped-nibbles"

    def quantize_4bit(self, x, packed, absmax, *, blocksize, quant_type):
        super().quantize_4bit(x, packed, absmax, blocksize=blocksize, quant_type=quant_type)
        p = packed.reshape(-1)
        p[...] = ((p >> 4) | (p << 4)).astype(np.uint8)


class UnwrittenTail(CpuBackend):
    """dequantize_ggml never writes the last 7 elements of its output."""

    name = "toy-unwritten-tail"

    def dequantize_ggml(self, q, out, *, fmt):
        tmp = np.empty(out.shape, out.dtype)
        super().dequantize_ggml(q, tmp, fmt=fmt)
        n = out.size
        out.reshape(-1)[: max(0, n - 7)] = tmp.reshape(-1)[: max(0, n - 7)]


class FusedQ4(CpuBackend):
    """quantize_q4_0 contracts ``x*id + 8.5`` into one fused multiply-add."""

    name = "toy-fma-q4_0"

    def quantize_q4_0(self, w, out):
        b = w.reshape(-1, w.shape[-1]).astype(np.float32).reshape(-1, w.shape[-1] // 32, 32)
        mag = np.where(np.isnan(b), np.float32(-1), np.abs(b))
        mx = np.take_along_axis(b, np.argmax(mag, axis=-1)[..., None], axis=-1)[..., 0]
        mx = np.where(np.isnan(mx), np.float32(0), mx).astype(np.float32)
        d = (mx / np.float32(-8)).astype(np.float32)
        with np.errstate(divide="ignore"):
            inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0))
        fused = (b.astype(np.float64) * inv.astype(np.float64)[..., None] + 8.5).astype(np.float32)
        t = np.trunc(np.nan_to_num(fused.astype(np.float64), nan=0.0, posinf=127, neginf=-128))
        q = np.minimum(15, np.clip(t, -128, 127)).astype(np.int32).astype(np.uint8)
        res = np.empty(b.shape[:-1] + (18,), np.uint8)
        res[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
        res[..., 2:] = (q[..., :16] & 0x0F) | (q[..., 16:] << 4)
        out.reshape(-1)[...] = res.reshape(-1)


class ApproximateReciprocal(CpuBackend):
    """quantize_blockwise scales by a reciprocal one ulp above the correctly rounded ``1/absmax``
    (what a fast-math reciprocal gives for some mantissas)."""

    name = "toy-approximate-reciprocal"

    def quantize_blockwise(self, x, thresholds, codes, absmax, *, blocksize):
        blocks = bnb._blocks_f32(x, blocksize)
        am = np.fmax.reduce(np.abs(blocks), axis=1).astype(np.float32)
        with np.errstate(all="ignore"):
            r = np.nextafter(np.float32(1) / am, np.float32(np.inf))
            scaled = (blocks * r[:, None]).astype(np.float32).reshape(-1)[: x.size]
        q = np.searchsorted(thresholds, scaled, side="left").astype(np.uint8)
        q[np.isnan(scaled)] = 0
        codes.reshape(-1)[...] = q
        absmax[...] = am


class HalfPrecisionAccumulation(CpuBackend):
    """gemv_4bit accumulates in the activation's dtype (fp16 / bf16) instead of fp32."""

    name = "toy-half-accumulation"

    def gemv_4bit(self, a, packed, absmax, out, *, n, k, blocksize, quant_type, nested):
        T = a.dtype
        w = bnb.dequantize_4bit(packed, self._absmax(absmax, nested), n * k, blocksize, quant_type,
                                np.float32).reshape(n, k)
        a2 = a.reshape(-1, k).astype(np.float32)
        acc = np.zeros((a2.shape[0], n), dtype=T)
        for j in range(k):
            acc = (acc.astype(np.float32) + (a2[:, j: j + 1] * w[:, j][None, :])).astype(T)
        out.reshape(-1)[...] = acc.reshape(-1)


class BnbStyleGemv(CpuBackend):
    """A LEGITIMATE variant: bitsandbytes' arithmetic. ``B = T(code) * T(absmax)`` and ``a * B`` in
    the activation's dtype T, fp32 accumulation in reverse order. Must pass the tolerance tier."""

    name = "toy-bnb-style-gemv"

    def gemv_4bit(self, a, packed, absmax, out, *, n, k, blocksize, quant_type, nested):
        T = a.dtype
        am = self._absmax(absmax, nested)
        q = bnb.unpack_4bit_bnb(packed, n * k)
        code_t = bnb.code_4bit(quant_type).astype(T)
        scale_t = np.repeat(am.astype(T), blocksize)[: n * k]
        w_t = (code_t[q] * scale_t).astype(T).reshape(n, k)
        prod = (a.reshape(-1, k)[:, None, :] * w_t[None, :, :]).astype(T)
        acc = np.cumsum(prod[..., ::-1].astype(np.float32), axis=-1, dtype=np.float32)[..., -1]
        out.reshape(-1)[...] = acc.astype(T).reshape(-1)

    def gemm_q4_0_q8_1(self, wq, aq, out):
        # another association and order: (d4*d8)*sumi - (d4*8)*s8 per block, blocks added backwards
        d4, q4 = ggml.unpack_q4_0(wq)
        d8, q8, s8 = ggml.unpack_q8(aq, "q8_1")
        sumi = np.einsum("mbj,nbj->mnb", q4.astype(np.int32), q8.astype(np.int32)).astype(np.float32)
        dd = (d4[:, None, :] * d8[None]).astype(np.float32)
        t = ((dd * sumi).astype(np.float32) - ((d4 * np.float32(8))[:, None, :] * s8[None]).astype(np.float32))
        acc = np.cumsum(t[..., ::-1].astype(np.float32), axis=-1, dtype=np.float32)[..., -1]
        out[...] = acc


class OnlineSumQ8(CpuBackend):
    """gemm_w4a8 quantizes the activation ggml-CUDA style: ``s = fp16(sum(x))`` instead of the
    reference ``fp16(d * sum(q))``."""

    name = "toy-online-sum-q8"

    def gemm_w4a8(self, wq, a, out):
        a2 = a.reshape(-1, a.shape[-1])
        aq = ggml.quantize_q8_1(a2)
        s = a2.astype(np.float32).reshape(a2.shape[0], -1, 32).sum(axis=-1).astype(np.float16)
        aq[..., 2:4] = s[..., None].view(np.uint8)
        out[...] = ggml.gemm_q4_0_q8_1(wq, aq).astype(np.float32)


class RaisingKernel(CpuBackend):
    """quantize_q8_0 is declared but its launch fails."""

    name = "toy-raising-kernel"

    def quantize_q8_0(self, a, out):
        raise RuntimeError("kernel launch failed: invalid configuration argument")


class DeclaresNothing(CpuBackend):
    name = "toy-declares-nothing"

    def capabilities(self):
        return frozenset()


PARTIAL = frozenset(
    [Capability(op, "nf4", "float16", bs) for op in ("quantize_4bit", "dequantize_4bit")
     for bs in (64, 128, 256, 1024)]
    + [Capability("quantize_q4_0", "q4_0", "bfloat16", 32)]
)


class PartialBackend(CpuBackend):
    """Declares a handful of capabilities; everything else must show as not supported."""

    name = "toy-partial"

    def capabilities(self):
        return PARTIAL


@pytest.fixture
def register():
    names = []

    def _register(cls):
        quantcore.register_backend(cls.name, cls, replace=True)
        names.append(cls.name)
        return cls.name

    yield _register
    for name in names:
        quantcore.unregister_backend(name)


def _failures(report):
    """{case id: set of failed tiers}."""
    return {r.case.id: r.verdict.tiers for r in report.failures}


def _check_caught(report, op: str, tiers: set[str], allowed_extra: str | None = None, dtypes=None):
    """Every failure is ``op`` failing exactly ``tiers`` (or a case matching ``allowed_extra``, an
    end-to-end API case that also calls the broken op); ``op`` fails in at least one case of every
    dtype in ``dtypes``."""
    fails = _failures(report)
    assert fails, "the suite let the broken kernel through"
    for cid, t in fails.items():
        if allowed_extra and re.search(allowed_extra, cid):
            continue
        assert f"/{op}/" in cid, f"{cid} failed ({t}) but only {op} is broken"
        if "/api" not in cid:
            assert t == tiers, f"{cid} failed tiers {t}, expected {tiers}"
    for dt in dtypes or ():
        assert any(f"/{op}/" in c and f"/{dt}/" in c for c in fails), f"{op} {dt} not caught"
    assert not report.ok


# -- the cpu backend ---------------------------------------------------------------------------------
def test_cpu_passes_quick():
    report = run("cpu", "quick")
    assert not report.failures, "\n".join(f"{r.case.id}: {r.verdict.detail()}" for r in report.failures)
    assert report.ok, report.reasons
    assert all(row.status == PASSED for row in report.coverage), report.table()
    assert report.declared == len(ALL_CAPABILITIES)
    assert {r.case.tier for r in report.results} == set(harness.TIERS)


# -- broken kernels fail the right op and tier ----------------------------------------------------
def test_off_by_one_block_fails_bit_exact(register):
    report = run(register(OffByOneBlock), "quick", select=["bnb/"])
    _check_caught(report, "dequantize_4bit", {harness.BIT_EXACT},
                  allowed_extra=r"^bnb/quantize_4bit/.*/api-roundtrip$",
                  dtypes=("float32", "float16", "bfloat16"))


def test_out_of_bounds_write_fails_safety(register):
    report = run(register(OutOfBoundsWrite), "quick", select=["bnb/"])
    _check_caught(report, "dequantize_blockwise", {harness.SAFETY}, dtypes=("float32", "float16", "bfloat16"))
    detail = next(iter(report.failures)).verdict.detail()
    assert "out-of-bounds write after output 'out'" in detail


def test_swapped_nibbles_fail_bit_exact(register):
    report = run(register(SwappedNibbles), "quick", select=["bnb/"])
    _check_caught(report, "quantize_4bit", {harness.BIT_EXACT}, dtypes=("float32", "float16", "bfloat16"))


def test_unwritten_tail_fails_safety(register):
    report = run(register(UnwrittenTail), "quick", select=["ggml/"])
    _check_caught(report, "dequantize_ggml", {harness.SAFETY},
                  allowed_extra=r"^ggml/quantize_q\d_\d/.*/api-roundtrip$",
                  dtypes=("float32", "float16", "bfloat16"))
    detail = _failures(report)
    one = next(r for r in report.failures if r.case.id.endswith("/random-bytes"))
    assert "7 of 384 elements of output 'out' were never written" in one.verdict.detail(), detail


def test_fused_multiply_add_fails_bit_exact(register):
    report = run(register(FusedQ4), "quick", select=["ggml/quantize_q4_0/"])
    _check_caught(report, "quantize_q4_0", {harness.BIT_EXACT}, allowed_extra=r"/api-roundtrip$",
                  dtypes=("float32",))
    assert "ggml/quantize_q4_0/q4_0/float32/bs32/sensitive" in _failures(report)


def test_approximate_reciprocal_fails_bit_exact(register):
    report = run(register(ApproximateReciprocal), "quick", select=["bnb/quantize_blockwise/"])
    _check_caught(report, "quantize_blockwise", {harness.BIT_EXACT}, allowed_extra=r"/api-roundtrip$",
                  dtypes=("float32", "float16", "bfloat16"))
    assert any(c.endswith("/thresholds") for c in _failures(report))


def test_half_precision_accumulation_fails_tolerance(register):
    report = run(register(HalfPrecisionAccumulation), "quick", select=["bnb/gemv_4bit/nf4/"])
    _check_caught(report, "gemv_4bit", {harness.TOLERANCE}, dtypes=("float16", "bfloat16"))
    assert not any("/float32/" in c for c in _failures(report))


def test_online_activation_sum_fails_tolerance(register):
    report = run(register(OnlineSumQ8), "quick", select=["ggml/gemm_w4a8/"])
    _check_caught(report, "gemm_w4a8", {harness.TOLERANCE}, dtypes=("float32", "float16", "bfloat16"))


def test_raising_kernel_is_a_failure_not_a_crash(register):
    report = run(register(RaisingKernel), "quick", select=["ggml/quantize_q8_0/", "ggml/dequantize"])
    _check_caught(report, "quantize_q8_0", {harness.BIT_EXACT}, dtypes=("float32", "float16", "bfloat16"))
    assert "RuntimeError: kernel launch failed" in report.failures[0].verdict.detail()


def test_bitsandbytes_arithmetic_passes_tolerance(register):
    """The bounds are not tighter than the arithmetic they allow: bitsandbytes-style T-precision
    products and other summation orders pass (quick and the full level's shapes)."""
    name = register(BnbStyleGemv)
    full_subset = ["bnb/gemv_4bit/nf4/bfloat16/bs64/", "bnb/gemv_4bit/fp4/float16/bs32/",
                   "float16/bs4096/B8-N16-K16384", "bfloat16/bs4096/B1-N64-K16384", "ggml/gemm_q4_0_q8_1/"]
    for level, select in (("quick", ["bnb/gemv_4bit/", "ggml/gemm_q4_0_q8_1/"]), ("full", full_subset)):
        report = run(name, level, select=select)
        assert report.results and not report.failures, "\n".join(
            f"{r.case.id}: {r.verdict.detail()}" for r in report.failures)


def test_declaring_nothing_is_not_passing(register):
    name = register(DeclaresNothing)
    report = run(name)
    assert not report.results
    assert not report.ok
    assert any("declares no capability" in r for r in report.reasons)
    assert all(row.status == NOT_SUPPORTED for row in report.coverage)
    assert main(["--backend", name]) == 1


def test_partial_declaration(register):
    """Only declared capabilities run; every other group is "not supported"; quick picks among
    the declared blocksizes."""
    report = run(register(PartialBackend), "quick")
    assert report.ok, report.reasons
    assert {r.case.capability for r in report.results if "/api" not in r.case.id} <= PARTIAL
    rows = {(r.op, r.fmt, r.dtype): r for r in report.coverage}
    row = rows[("quantize_4bit", "nf4", "float16")]
    assert row.status == PASSED and row.blocksizes_declared == [64, 128, 256, 1024]
    assert row.blocksizes_tested == [64, 1024]
    assert rows[("quantize_q4_0", "q4_0", "bfloat16")].status == PASSED
    assert rows[("dequantize_4bit", "nf4", "float32")].status == NOT_SUPPORTED
    assert sum(r.status == PASSED for r in report.coverage) == 3


# -- the harness's own checks --------------------------------------------------------------------
def test_poison_detects_unwritten_elements_whatever_their_value():
    """A written element equal to one poison word is still seen as written (two runs)."""
    be = CpuBackend()
    poison0 = np.array([harness._poison_word(np.dtype(np.float32), 0)], np.uint32).view(np.float32)

    def call(i, o):
        o["out"][...] = poison0[0]  # writes run 0's poison pattern everywhere
        o["out"][0, 0] = np.float32(1.0)

    v = harness.Verdict()
    r = harness.run_op(be, call, {}, [harness.Out("out", (2, 3), np.dtype(np.float32))], v, harness.BIT_EXACT)
    assert v.ok and not r.unwritten["out"].any()


def test_nan_comparison_rule():
    v = harness.Verdict()
    ref = np.array([np.nan, 1.0, -0.0], np.float32)
    other_nan = np.array([0x7FFFFFFF], np.uint32).view(np.float32)[0]  # a GPU's canonical NaN
    got = np.array([other_nan, 1.0, -0.0], np.float32)
    harness.compare_bits("x", [{"x": got}], ref, None, v)
    assert v.ok
    harness.compare_bits("x", [{"x": np.array([np.nan, 1.0, 0.0], np.float32)}], ref, None, v)
    assert v.tiers == {harness.BIT_EXACT}  # +0.0 where the reference has -0.0


def test_case_seed_independent_of_selection():
    a = run("cpu", select=["ggml/quantize_q8_1/q8_1/float32/bs32/random"])
    b = run("cpu", select=["ggml/quantize_q8_1/q8_1/float32/"])
    seed_a = {r.case.id: r.seed for r in a.results}
    seed_b = {r.case.id: r.seed for r in b.results}
    assert seed_a and all(seed_b[k] == s for k, s in seed_a.items())


# -- command line and pytest entry points ------------------------------------------------------------
def test_cli_exit_status_and_reproduce_line(register, capsys):
    assert main(["--backend", "cpu", "-k", "ggml/quantize_q8_0/q8_0/float16/"]) == 0
    name = register(SwappedNibbles)
    assert main(["--backend", name, "-k", "bnb/quantize_4bit/nf4/float32/bs64/random"]) == 1
    out = capsys.readouterr().out
    assert f"quantcore check --backend {name} --seed 0 -k 'bnb/quantize_4bit/nf4/float32/bs64/random" in out
    assert "| quantize_4bit | nf4 | float32 | failed |" in out
    assert main(["--backend", "no-such-backend"]) == 2


def _pytest(args, env_extra=None, cwd=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, env=env, cwd=cwd or REPO, timeout=600)


@needs_install
def test_pytest_entry_point_passes_cpu(tmp_path):
    path = tmp_path / "report.json"
    res = _pytest(["--pyargs", "quantcore.conformance", "--backend", "cpu", "-q", "-k",
                   "ggml/quantize_q4_0/ or coverage", "--conformance-json", str(path)], cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "quantcore conformance: cpu" in res.stdout
    assert json.loads(path.read_text())["verdict"] == "pass"


@needs_install
def test_pytest_entry_point_catches_a_broken_backend(tmp_path):
    (tmp_path / "toy_plugin.py").write_text(textwrap.dedent('''
        import numpy as np
        import quantcore
        from quantcore.backends.cpu import CpuBackend

        class SwappedNibbles(CpuBackend):
            name = "toy-swapped-nibbles"

            def quantize_4bit(self, x, packed, absmax, *, blocksize, quant_type):
                super().quantize_4bit(x, packed, absmax, blocksize=blocksize, quant_type=quant_type)
                p = packed.reshape(-1)
                p[...] = ((p >> 4) | (p << 4)).astype(np.uint8)

        quantcore.register_backend("toy-swapped-nibbles", SwappedNibbles)
    '''))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    res = _pytest(["-p", "toy_plugin", "--pyargs", "quantcore.conformance", "--backend",
                   "toy-swapped-nibbles", "-q", "-k", "bnb/quantize_4bit/nf4/float32/bs64"], env, tmp_path)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[bit-exact] bnb/quantize_4bit/nf4/float32/bs64/random" in res.stdout
    assert "reproduce: pytest --pyargs quantcore.conformance --backend toy-swapped-nibbles" in res.stdout


def test_plugin_does_not_disturb_other_runs(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_ok():\n    assert True\n")
    res = _pytest([str(tmp_path / "test_plain.py"), "-q"], cwd=tmp_path)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout + res.stderr
    assert "quantcore conformance" not in res.stdout


# -- packaging -------------------------------------------------------------------------------------------
def test_suite_is_part_of_the_package():
    """The suite ships in quantcore (a wheel install can run it) and depends on nothing in tests/."""
    import importlib.resources

    root = importlib.resources.files("quantcore.conformance")
    names = {p.name for p in root.iterdir()}
    assert {"__init__.py", "runner.py", "harness.py", "plugin.py", "test_conformance.py"} <= names
    assert (root / "families" / "bnb.py").is_file() and (root / "families" / "ggml.py").is_file()
    for path in Path(str(root)).rglob("*.py"):
        assert "from tests" not in path.read_text() and "import tests" not in path.read_text(), path


@pytest.mark.skipif(not (REPO / "pyproject.toml").is_file(), reason="needs the source tree")
def test_wheel_contains_every_suite_module(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    wheel = next(tmp_path.glob("quantcore-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    src = REPO / "quantcore" / "conformance"
    for path in src.rglob("*.py"):
        rel = "quantcore/conformance/" + path.relative_to(src).as_posix()
        assert rel in names, f"{rel} is missing from the wheel (pyproject.toml [tool.setuptools] packages)"


def test_broken_family_module_fails_the_verdict(monkeypatch):
    import types

    from quantcore.conformance import families

    bad = types.ModuleType("quantcore.conformance.families.broken")

    def cases(level, declared):
        raise ImportError("needs the vendor SDK")

    bad.cases = cases
    real = families.modules
    monkeypatch.setattr(families, "modules", lambda: real() + [bad])
    report = run("cpu", select=["ggml/dequantize_ggml/q8_0/float32/bs32/one-block"])
    assert report.results and not report.failures
    assert not report.ok
    assert any("family module quantcore.conformance.families.broken is broken" in r for r in report.reasons)


# -- the guide ---------------------------------------------------------------------------------------------
def test_adding_a_backend_guide(tmp_path):
    """Follow docs/adding-a-backend.md: write its module, register it through the entry point it
    shows (as an installed package's metadata) and run every command it gives."""
    import shutil

    doc = (REPO / "docs" / "adding-a-backend.md").read_text()
    files = re.findall(r"<!-- file: (\S+) -->\n```python\n(.*?)```", doc, re.S)
    assert files, "the guide has no code block to follow"
    for name, code in files:
        (tmp_path / name).write_text(code)
    toml = re.search(r'```toml\n\[project\.entry-points\."quantcore\.backends"\]\n(.*?)```', doc, re.S)
    ep_name, ep_value = (part.strip().strip('"') for part in toml.group(1).strip().split("=", 1))
    dist = tmp_path / "acme_quantcore-1.0.dist-info"  # what `pip install` of the package writes
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-quantcore\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[quantcore.backends]\n{ep_name} = {ep_value}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    commands = re.findall(r"^\$ (.+)$", doc, re.M)
    assert len(commands) == 3, commands
    cli = shutil.which("quantcore")
    for cmd in commands:
        if cmd.startswith("quantcore ") and cli is None:
            cmd = f"{sys.executable} -m quantcore.conformance " + cmd.split(" ", 2)[2]
        elif cmd.startswith("python "):
            cmd = f"{sys.executable} " + cmd.split(" ", 1)[1]
        res = subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, f"{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        assert "PASS: backend 'acme'" in res.stdout, res.stdout[-3000:]
        assert "| dequantize_4bit | nf4 | bfloat16 | passed |" in res.stdout
        assert "| gemv_4bit | nf4 | float32 | not supported |" in res.stdout
