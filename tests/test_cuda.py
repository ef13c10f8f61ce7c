"""The cuda backend: kernels_cuda/*.cu, their NVRTC glue, and the CUDA-specific guarantees.

CPU-safe part (runs in CI): every kernel instantiation the backend can launch compiles with this
machine's nvcc for sm_80 and sm_90 (the same flags NVRTC gets); importing quantcore imports no
cupy or torch; availability says why the backend cannot run.

GPU part (skipped with the reason where the backend is unavailable; runs on the GPU machine with
the same pytest command): 4-bit quantize / dequantize through the public API up to 2^20 elements, the
double-quantization tree's launch levels, gemv / gemm within the conformance bounds on the kernels'
own selection shapes, torch-in/torch-out and
CuPy-in/CuPy-out zero-copy, launches on the caller's current stream, capture of every op in a
CUDA graph, a tensor of more than 2^31 elements, and DeviceError for host arrays. The
conformance suite itself runs on cuda from tests/test_conformance_backends.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
from quantcore.backends import cuda
from quantcore.backends.cuda import bnb as _bnb
from quantcore.backends.cuda import common as cuda_common
from quantcore.backends.cuda import runtime as rt

import quantcore as qc
from quantcore.arrays import BF16
from quantcore.conformance import bounds
from quantcore.errors import DeviceError
from quantcore.formats import bnb, ggml, kernel_defines

from .conftest import FLOAT_DTYPES, bits

NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


# -- CPU-safe: the sources compile -------------------------------------------------------------------
def _instances_by_file() -> dict[str, list[str]]:
    by: dict[str, list[str]] = defaultdict(list)
    for filename, expr in cuda.kernel_instances():
        by[filename].append(expr)
    return by


def test_gemm_4bit_rows_by_device(monkeypatch):
    """linear_4bit's gemv_4bit rows per device and weight: the wgmma GEMM's crossover on compute
    capability 9.0 for weights of LINEAR_WGMMA_MIN_WEIGHT elements or more (the mma.sync GEMM's below,
    for no weight given, and with gemm4wg=0; the wgmma GEMM's for smaller weights in an eager call unless
    gw_eager=0), and above it, through 2048 rows, the calls whose rows fill the wgmma GEMM's waves to 0.8
    (on 132 SMs: 1024 and 2048 rows of 4096 x 14336, 8192 x 28672, 28672 x 8192 (fill 0.97), 14336 x 4096
    at 1024 and 896 rows of 4096 x 14336 (0.85) yes; 1280 / 1536 rows of 4096 x 14336 (0.61 / 0.73) and
    3072 rows no); the mma.sync GEMM's on other sm_80+ devices with an
    H100's 227 KiB per CTA, 0 on an A100 (163 KiB); the device's rule is worked out once."""
    import types

    props = {0: {"sharedMemPerBlockOptin": 232448, "major": 9, "minor": 0},
             1: {"sharedMemPerBlockOptin": 166912, "major": 8, "minor": 0},
             2: {"sharedMemPerBlockOptin": 232448, "major": 12, "minor": 0}}
    monkeypatch.setattr(rt, "device_props", lambda d: props[d])
    monkeypatch.setattr(rt, "device_arch", lambda d: 10 * props[d]["major"] + props[d]["minor"])
    monkeypatch.setattr(rt, "sm_count", lambda d: 132)
    monkeypatch.setattr(cuda.CudaBackend, "_GEMM4_RULE", {})
    be = cuda.CudaBackend()
    rows = _bnb.LINEAR_GEMM_ROWS
    assert be.gemm_4bit_rows(0, 14336, 4096) == be.gemm_4bit_rows(0, 4096, 4096) == rows["wgmma"] == 512
    # smaller weights: the mma.sync GEMM's rows when captured, the wgmma GEMM's in an eager call
    assert be.gemm_4bit_rows(0, 1024, 4096, 512) == 128 and be.gemm_4bit_rows(0, 1024, 4096, 512, True) == 512
    assert be.gemm_4bit_rows(0, 1024, 4096, 1024, True) == 512 and be.gemm_4bit_rows(0, 4096, 4096, 1024) == 1024
    for n, k in ((4096, 14336), (8192, 28672), (28672, 8192)):
        assert be.gemm_4bit_rows(0, n, k, 1024) == 1024 and be.gemm_4bit_rows(0, n, k, 2048) == 2048, (n, k)
        assert be.gemm_4bit_rows(0, n, k, 3072) == 512, (n, k)
    assert be.gemm_4bit_rows(0, 14336, 4096, 1024) == 1024 and be.gemm_4bit_rows(0, 1024, 4096, 1024) == 128
    assert be.gemm_4bit_rows(0, 4096, 14336, 896) == 896
    assert be.gemm_4bit_rows(0, 4096, 14336, 1280) == be.gemm_4bit_rows(0, 4096, 14336, 1536) == 512
    assert be.gemm_4bit_rows(0, 1024, 4096) == be.gemm_4bit_rows(0) == rows["mma"] == 128
    assert be.gemm_4bit_rows(types.SimpleNamespace(type="cuda", index=1), 14336, 4096) == 0
    assert be.gemm_4bit_rows(2, 14336, 4096) == rows["mma"]
    props[1]["sharedMemPerBlockOptin"] = 232448  # cached: not asked again
    assert be.gemm_4bit_rows(1) == 0
    assert be.gemm_4bit_rows(2, 1024, 4096, 512, True) == rows["mma"]  # no wgmma GEMM: one rule
    monkeypatch.setenv(rt.ENV_TUNE, "gemm4wg=0")
    assert _bnb.gemm4_linear_rows(_bnb.gemm4_linear_rule(0), 4096, 14336, 1024) == rows["mma"]
    monkeypatch.setenv(rt.ENV_TUNE, "gw_eager=0")
    assert _bnb.gemm4_linear_rows(_bnb.gemm4_linear_rule(0), 1024, 4096, 512, True) == rows["mma"]


def test_wgmma_gemm_launch_rules(monkeypatch):
    """The wgmma GEMM's share of gemv_4bit (compute capability 9.0): from 65 rows, from 33 where the
    128-row weight tiles fill 3/4 of the SMs; its tile (256 input rows unless 128 takes fewer waves x
    work) and K split (clusters of 2 where the grid is below the SMs and K keeps 8 stages per CTA) for
    the measured shapes; rings of 4 / 8 stages; the mma.sync GEMM elsewhere."""
    monkeypatch.setattr(rt, "device_arch", lambda d: 90)
    monkeypatch.setattr(rt, "sm_count", lambda d: 132)
    monkeypatch.delenv(rt.ENV_TUNE, raising=False)
    takes = _bnb._gemm4wg_takes
    assert not takes(0, 32, 14336) and takes(0, 33, 14336) and not takes(0, 64, 4096) and takes(0, 65, 4096)
    shape = _bnb._gw_shape
    assert shape(128, 14336, 4096, 132) == (128, 1) and shape(512, 14336, 4096, 132) == (256, 1)
    assert shape(512, 4096, 14336, 132) == (256, 2) and shape(128, 4096, 14336, 132) == (128, 2)
    assert shape(2048, 4096, 14336, 132) == (256, 1)
    assert (_bnb._gwt_stages(256), _bnb._gwt_stages(128)) == (4, 7)
    monkeypatch.setattr(rt, "device_arch", lambda d: 80)
    assert not takes(0, 4096, 14336)


def test_every_launchable_kernel_has_its_source():
    files = {f for f in os.listdir(rt.kernel_dir()) if f.endswith(".cu")}
    assert {"bnb_4bit.cu", "bnb_8bit.cu", "ggml.cu"} <= set(_instances_by_file()) <= files


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA sources are compile-checked with nvcc")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("filename", sorted(_instances_by_file()))
def test_kernels_compile_with_nvcc(filename, arch, tmp_path):
    """Every template instantiation of the file (taking its address instantiates it), compiled
    with the options NVRTC gets at run time."""
    kernel_defines.write_header(tmp_path)
    exprs = _instances_by_file()[filename]
    src = tmp_path / f"inst_{filename}"
    src.write_text(f'#include "{filename}"\nvoid* qc_instances[] = {{\n'
                   + ",\n".join(f"    (void*)&{e}" for e in exprs) + "\n};\n")
    cmd = [NVCC, f"-arch={arch}", *rt.COMPILE_OPTIONS, f"-I{tmp_path}", f"-I{rt.kernel_dir()}",
           "-Xptxas", "-warn-spills", "-c", str(src), "-o", str(tmp_path / "out.o")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stderr[-6000:]}"
    assert "spill" not in res.stderr.lower(), res.stderr[-3000:]


def test_ggml_format_codes_are_the_generated_ones():
    """The launcher's template arguments and ggml.cu's kFmt* constants both come from
    kernel_defines.GGML_FORMAT_CODE (QC_FMT_* in the generated header): no hand-written copy."""
    import re

    assert cuda_common.GGML_FMT is kernel_defines.GGML_FORMAT_CODE
    header = kernel_defines.constants_header()
    for fmt, code in kernel_defines.GGML_FORMAT_CODE.items():
        assert f"#define QC_FMT_{fmt.upper()} {code}\n" in header
    src = open(os.path.join(rt.kernel_dir(), "ggml.cu")).read()
    consts = dict(re.findall(r"(kFmtQ\d_\d) = (\w+)", src))
    assert consts == {"kFmtQ4_0": "QC_FMT_Q4_0", "kFmtQ8_0": "QC_FMT_Q8_0", "kFmtQ8_1": "QC_FMT_Q8_1"}


def test_import_quantcore_imports_no_gpu_package():
    code = "import sys, quantcore; print('cupy' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_availability_states_a_reason():
    avail = qc.available_backends()["cuda"]
    if not avail:
        assert avail.reason and ("cupy" in avail.reason or "CUDA device" in avail.reason
                                 or "NVRTC" in avail.reason)


def test_capabilities_cover_the_bnb_and_ggml_catalogue():
    from quantcore import ops

    # the MX family (backends/cuda/mx.py) adds its own entries on top
    assert cuda.create().capabilities() >= frozenset(ops.bnb_capabilities() + ops.ggml_capabilities())


# -- GPU part ------------------------------------------------------------------------------------------
_avail = qc.available_backends()["cuda"]
gpu = pytest.mark.skipif(not _avail, reason=f"cuda backend unavailable: {_avail.reason}")
torch = None
if _avail:
    try:
        import torch
    except ImportError:  # pragma: no cover - the GPU machine has torch
        torch = None
needs_torch = pytest.mark.skipif(bool(_avail) and torch is None, reason="torch with CUDA is needed for this test")

TORCH_DT = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


@pytest.fixture(scope="module")
def be():
    return qc.get_backend("cuda")


def _t(a: np.ndarray):
    """numpy -> torch CUDA tensor (bf16 through int16)."""
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a).copy()).cuda()


def _n(t) -> np.ndarray:
    return cuda.create().to_numpy(t)


def _randn(rng, shape, dtype: str, scale_groups: int = 64, spread: float = 6.0) -> np.ndarray:
    n = int(np.prod(shape))
    scales = np.exp2(rng.uniform(-spread, spread, -(-n // scale_groups)))
    x = rng.standard_normal(n) * np.repeat(scales, scale_groups)[:n]
    return x.astype(FLOAT_DTYPES[dtype]).reshape(shape)


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
@pytest.mark.parametrize("qt", ["nf4", "fp4"])
def test_quantize_dequantize_4bit_bit_exact(be, rng, dtype, qt):
    for bs, n in ((32, 1), (64, 64 * 37 + 13), (128, 4097), (4096, 3 * 4096 + 5), (64, 1 << 20)):
        x = _randn(rng, (n,), dtype)
        x[rng.integers(0, n, max(1, n // 1000))] = 0
        packed, state = qc.quantize_4bit(_t(x), blocksize=bs, quant_type=qt, compress_statistics=True,
                                         backend="cuda")
        rp, ra = bnb.quantize_4bit(x, bs, qt)
        rq, ra2, roff = bnb.double_quantize(ra)
        assert np.array_equal(_n(packed).reshape(-1), rp.reshape(-1)), (bs, n)
        assert np.array_equal(bits(_n(state.absmax)), bits(rq)), (bs, n)
        assert np.array_equal(bits(_n(state.state2.absmax)), bits(ra2)), (bs, n)
        assert bits(_n(state.offset))[0] == bits(np.array([roff], np.float32))[0], (bs, n)
        for out in ("float32", "float16", "bfloat16"):
            got = _n(qc.dequantize_4bit(packed, state, out_dtype=out, backend="cuda"))
            eff = bnb.dequantize_absmax(rq, ra2, roff)
            ref = bnb.dequantize_4bit(rp, eff, n, bs, qt, FLOAT_DTYPES[out])
            assert np.array_equal(bits(got.reshape(-1)), bits(ref.reshape(-1))), (bs, n, out)


@gpu
@needs_torch
@pytest.mark.parametrize("nb", [1, 255, 2048, 2049, 5000, 2048 * 2048 + 5])
def test_double_quantize_tree_levels(be, rng, nb):
    """1, 2 and 3 launches of the tree sum (nb <= 2048, <= 2048^2, beyond)."""
    absmax = np.exp2(rng.uniform(-20, 10, nb)).astype(np.float32)
    q = be.empty((nb,), np.uint8, like=_t(absmax))
    a2 = be.empty((bnb.nblocks(nb, 256),), np.float32, like=q)
    off = be.empty((1,), np.float32, like=q)
    be.double_quantize(_t(absmax), q, a2, off)
    rq, ra2, roff = bnb.double_quantize(absmax)
    assert bits(_n(off))[0] == bits(np.array([roff], np.float32))[0]
    assert np.array_equal(_n(q), rq)
    assert np.array_equal(bits(_n(a2)), bits(ra2))


def _gemv_case(rng, n, k, bs, qt, dtype, batch, nested):
    w = _randn(rng, (n, k), "float32", spread=2.0)  # outputs stay well inside fp16's range
    packed, absmax = bnb.quantize_4bit(w, bs, qt)
    a = rng.standard_normal((batch, k)).astype(FLOAT_DTYPES[dtype])
    st = dict(absmax=absmax)
    if nested:
        q, a2, off = bnb.double_quantize(absmax)
        st = dict(q=q, a2=a2, off=off)
        absmax = bnb.dequantize_absmax(q, a2, off)
    w_eff = bnb.dequantize_4bit(packed, absmax, n * k, bs, qt, np.float32).reshape(n, k)
    return packed, st, a, w_eff


def _gemv_state(st, n, k, bs, qt, dtype, nested):
    """The QuantState (torch arrays) of a _gemv_case's statistics."""
    code = _t(bnb.NF4_CODE if qt == "nf4" else bnb.FP4_CODE)
    if nested:
        return qc.QuantState(absmax=_t(st["q"]), shape=(n, k), code=code, blocksize=bs, quant_type=qt, dtype=dtype,
                             offset=_t(np.array([st["off"]], np.float32)),
                             state2=qc.QuantState(absmax=_t(st["a2"]), code=_t(bnb.DYNAMIC_MAP), blocksize=256,
                                                  dtype="float32"))
    return qc.QuantState(absmax=_t(st["absmax"]), shape=(n, k), code=code, blocksize=bs, quant_type=qt, dtype=dtype)


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
@pytest.mark.parametrize("nested", [False, True])
def test_gemv_4bit_within_bounds(be, rng, dtype, nested):
    shapes = [(1, 4096, 4096, 64), (1, 33, 3 * 64, 64), (3, 100, 512, 128), (8, 257, 1024, 32),
              (5, 17, 2 * 64 + 7, 64), (17, 64, 640, 64), (2, 3000, 96, 32)]
    for batch, n, k, bs in shapes:
        packed, st, a, w_eff = _gemv_case(rng, n, k, bs, "nf4", dtype, batch, nested)
        state = _gemv_state(st, n, k, bs, "nf4", dtype, nested)
        out = _n(qc.gemv_4bit(_t(a), _t(packed), state, backend="cuda"))
        ref, bound = bounds.gemv_4bit(a.astype(np.float64), w_eff, dtype)
        got = out.astype(np.float64).reshape(ref.shape)
        assert np.isfinite(got).all()
        err = np.abs(got - ref)
        assert (err <= bound.max_abs).all(), (batch, n, k, bs, float((err / bound.max_abs).max()))
        nmse = float((err ** 2).sum() / max((ref ** 2).sum(), 1e-300))
        assert nmse <= bound.nmse, (batch, n, k, bs, nmse, bound.nmse)


@gpu
@needs_torch
@pytest.mark.parametrize("kernel_tune", ["", "pdl=0", "gemv_short=0", "gemv_short=1", "gemv_kernel=1",
                                         "gemv_kernel=1,gemv_ksplit=2", "gemv_kernel=1,gemv_ksplit=8"])
def test_gemv_4bit_kernels_and_k_splits(be, rng, monkeypatch, kernel_tune):
    """The decode kernel (sm_90; launched as a programmatic dependent or not; each of its two ring
    geometries forced) and the register-fed mma kernel (gemv_kernel=1) at several K splits: uneven
    slices (37 chunks), partial stages, rows off the 16-row tiles, batches over 8 and 16 (more input
    row blocks), 4-byte lanes (blocksize 32, the mma kernel)."""
    monkeypatch.setenv(rt.ENV_TUNE, kernel_tune)
    for batch, n, k, bs, dtype in [(1, 1000, 64 * 37, 64, "bfloat16"), (3, 257, 4096 + 64, 32, "float16"),
                                   (11, 70, 512 * 3 + 128, 128, "bfloat16"), (8, 16, 64 * 9, 64, "float16"),
                                   (37, 300, 64 * 5, 256, "bfloat16")]:
        packed, st, a, w_eff = _gemv_case(rng, n, k, bs, "nf4", dtype, batch, False)
        state = qc.QuantState(absmax=_t(st["absmax"]), shape=(n, k), code=_t(bnb.NF4_CODE), blocksize=bs,
                              quant_type="nf4", dtype=dtype)
        out = _n(qc.gemv_4bit(_t(a), _t(packed), state, backend="cuda"))
        ref, bound = bounds.gemv_4bit(a.astype(np.float64), w_eff, dtype)
        err = np.abs(out.astype(np.float64).reshape(ref.shape) - ref)
        assert (err <= bound.max_abs).all(), (kernel_tune, batch, n, k, bs, float((err / bound.max_abs).max()))


@gpu
@needs_torch
def test_gemv_4bit_rings_sum_alike(be, rng, monkeypatch):
    """The decode kernel's two ring geometries (4-chunk and 8-chunk stages) add the same products in
    the same order: bitwise equal outputs (nested and not, the input in shared memory (XS) or not)."""
    cases = [(1, 4096, 4096, False), (5, 1000, 64 * 37, True), (16, 300, 8192 * 3, True), (2, 48, 64 * 300, False)]
    for batch, n, k, nested in cases:
        packed, st, a, _ = _gemv_case(rng, n, k, 64, "nf4", "bfloat16", batch, nested)
        state = _gemv_state(st, n, k, 64, "nf4", "bfloat16", nested)
        outs = []
        for short in (0, 1):
            monkeypatch.setenv(rt.ENV_TUNE, f"gemv_short={short}")
            outs.append(_n(qc.gemv_4bit(_t(a), _t(packed), state, backend="cuda")).view(np.uint16))
        assert np.array_equal(outs[0], outs[1]), (batch, n, k, nested)


@gpu
@needs_torch
@pytest.mark.parametrize("tile", [f"gm_cfg={i}" for i in range(1, 6)] + ["gm_cfg=5,gm_cl=2", "gm_cfg=5,gm_cl=4"]
                         + [f"wg:gw_min_rows=1,gw_nb={nb},gw_cl={cl}" for nb in (128, 256) for cl in (1, 2, 4)])
def test_gemv_4bit_many_rows_every_tile(be, rng, monkeypatch, tile):
    """The many-row GEMMs (bnb_gemm.cu): the mma.sync GEMM with each CTA shape (warps along weight
    rows, input rows and K) and the clusters of 2 and 4 CTAs splitting K further (sm_90); the wgmma
    GEMM ("wg:", sm_90a) with 128 and 256 input rows per CTA and K split over clusters of 1, 2 and 4
    (a cluster's CTA with no stage at K = 64). Rows and N off the tiles, K of 1 and several chunks, K
    slices past the last chunk (7 and 5 chunks over 2 or 4 slices), blocks larger than a row (bs 256 at
    K 192), NF4 / FP4, nested or not, fp16 / bf16, a large N with nested statistics over many absmax2
    blocks; within the gemv_4bit bound."""
    if tile.startswith("wg:"):
        if rt.device_arch(0) != 90:
            pytest.skip("the wgmma GEMM runs on compute capability 9.0 only")
        tile = tile[3:]
    else:
        tile = "gemm4wg=0," + tile  # the mma.sync GEMM, whatever the rows
    monkeypatch.setenv(rt.ENV_TUNE, tile)
    for batch, n, k, bs, qt, dtype, nested in [(100, 201, 192, 256, "nf4", "bfloat16", True),
                                               (17, 130, 64 * 7, 64, "fp4", "float16", False),
                                               (150, 45, 64, 128, "nf4", "float16", True),
                                               (33, 300, 1024, 64, "fp4", "bfloat16", True),
                                               (70, 1100, 64 * 5, 64, "nf4", "bfloat16", True)]:
        packed, st, a, w_eff = _gemv_case(rng, n, k, bs, qt, dtype, batch, nested)
        state = _gemv_state(st, n, k, bs, qt, dtype, nested)
        out = _n(qc.gemv_4bit(_t(a), _t(packed), state, backend="cuda"))
        ref, bound = bounds.gemv_4bit(a.astype(np.float64), w_eff, dtype)
        got = out.astype(np.float64).reshape(ref.shape)
        assert np.isfinite(got).all(), (tile, batch, n, k)
        err = np.abs(got - ref)
        assert (err <= bound.max_abs).all(), (tile, batch, n, k, bs, float((err / bound.max_abs).max()))
        assert float((err ** 2).sum() / max((ref ** 2).sum(), 1e-300)) <= bound.nmse, (tile, batch, n, k)


@gpu
@needs_torch
def test_gemv_4bit_wgmma_ring_depths_sum_alike(be, rng, monkeypatch):
    """The wgmma GEMM's TMA ring at its default depth and at 3 stages (an odd count, the ring wrapping
    at another stage), a persistent grid (the default: one CTA per multiprocessor; gw_persist=7 / 3: 7 /
    3 CTAs, each taking many tiles, its ring running on across them) or one CTA per tile (gw_persist=0;
    clusters keep one tile a CTA)
    multiplies the same operands in the same order: the same bits, per tile and cluster, input rows and
    weight rows off the tiles, more tiles than multiprocessors; all within the gemv_4bit bound."""
    if rt.device_arch(0) != 90:
        pytest.skip("the wgmma GEMM runs on compute capability 9.0 only")
    for batch, n, k, nb, cl, qt, dtype in [(300, 520, 1024, 256, 1, "nf4", "bfloat16"),
                                           (200, 260, 2048, 128, 1, "fp4", "float16"),
                                           (257, 130, 64 * 9, 256, 2, "nf4", "bfloat16"),
                                           (777, 400, 64 * 65, 256, 1, "nf4", "float16"),
                                           (129, 1000, 64 * 7, 128, 4, "nf4", "bfloat16"),
                                           (1100, 4200, 64 * 5, 256, 1, "nf4", "bfloat16"),
                                           (300, 2000, 64, 128, 1, "fp4", "bfloat16")]:
        packed, st, a, w_eff = _gemv_case(rng, n, k, 64, qt, dtype, batch, True)
        state = _gemv_state(st, n, k, 64, qt, dtype, True)
        ref, bound = bounds.gemv_4bit(a.astype(np.float64), w_eff, dtype)
        outs = []
        for depth in ("", ",gw_tma_s=3", ",gw_persist=0", ",gw_persist=7", ",gw_persist=3,gw_tma_s=3"):
            monkeypatch.setenv(rt.ENV_TUNE, f"gw_min_rows=1,gw_nb={nb},gw_cl={cl}{depth}")
            out = _n(qc.gemv_4bit(_t(a), _t(packed), state, backend="cuda"))
            err = np.abs(out.astype(np.float64).reshape(ref.shape) - ref)
            assert (err <= bound.max_abs).all(), (batch, n, k, nb, cl, depth, float((err / bound.max_abs).max()))
            outs.append(out.view(np.uint16))
        for i, o in enumerate(outs[1:]):
            assert np.array_equal(outs[0], o), (batch, n, k, nb, cl, i)


def _gemm_check(wq, aq, got):
    d4, q4 = ggml.unpack_q4_0(wq)
    d8, q8, s8 = ggml.unpack_q8(aq, "q8_1")
    ref, bound = bounds.gemm_q4_0_q8_1(d4, q4, d8, q8, s8)
    err = np.abs(got.astype(np.float64) - ref)
    assert np.isfinite(got).all()
    assert (err <= bound.max_abs).all(), float((err / bound.max_abs).max())
    assert float((err ** 2).sum() / max((ref ** 2).sum(), 1e-300)) <= bound.nmse


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_gemm_w4a8_and_q4_0_q8_1_within_bounds(be, rng, dtype):
    for m, n, k in ((1, 1, 32), (4096, 1, 4096), (33, 3, 96), (300, 8, 1024), (17, 9, 4096 + 64),
                    (2000, 17, 256), (64, 40, 64 * 32)):
        w = _randn(rng, (m, k), "float32", scale_groups=32)
        a = _randn(rng, (n, k), dtype, scale_groups=32)
        wq = ggml.quantize_q4_0(w)
        aq = ggml.quantize_q8_1(a)
        got = _n(qc.gemm_w4a8(_t(wq), _t(a), m, n, k, backend="cuda"))
        _gemm_check(wq, aq, got)
        if dtype == "float32":
            _gemm_check(wq, aq, _n(qc.gemm_q4_0_q8_1(_t(wq), _t(aq), m, n, k, backend="cuda")))


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_gemm_w4a8_tensor_core_tiles(be, rng, dtype):
    """The tensor-core GEMM (N > 8, and every N of gemm_q4_0_q8_1): each tile shape forced through
    QUANTCORE_CUDA_TUNE=w4t_tile, partial tiles in M and N, K a multiple of 256 (cp.async weights)
    or not (byte loads), odd N (scalar stores), an output at a 4-byte offset; every element written
    (the output starts as NaN), tiles and repeated calls within the bounds, repeats bit-equal."""
    cases = ((130, 16, 288), (257, 100, 1024), (64, 17, 4096), (300, 512, 512), (33, 9, 2080))
    old = os.environ.get(rt.ENV_TUNE)
    try:
        for m, n, k in cases:
            w = _randn(rng, (m, k), "float32", scale_groups=32)
            a = _randn(rng, (n, k), dtype, scale_groups=32)
            wq, aq = ggml.quantize_q4_0(w), ggml.quantize_q8_1(a)
            wq_t, a_t, aq_t = _t(wq), _t(a), _t(aq)
            for tile in range(4):
                os.environ[rt.ENV_TUNE] = f"w4t_tile={tile}"
                buf = torch.full((m * n + 1,), float("nan"), dtype=torch.float32, device="cuda")
                out = buf[1:].view(m, n)  # 4-byte aligned only
                be.gemm_w4a8(wq_t, a_t, out)
                got = _n(out)
                _gemm_check(wq, aq, got)
                be.gemm_w4a8(wq_t, a_t, out)
                assert np.array_equal(bits(_n(out)), bits(got)), (m, n, k, tile)
                if dtype == "float32":
                    out2 = torch.full((m, n), float("nan"), dtype=torch.float32, device="cuda")
                    be.gemm_q4_0_q8_1(wq_t, aq_t, out2)
                    _gemm_check(wq, aq, _n(out2))
    finally:
        if old is None:
            os.environ.pop(rt.ENV_TUNE, None)
        else:
            os.environ[rt.ENV_TUNE] = old


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
def test_gemm_w4a8_small_n_streaming_kernel(be, rng, dtype):
    """N = 1..8 with K % 256 == 0 takes the streaming kernel on sm_90: every N, slices that are empty
    (K = 256: one CTA of the cluster has all of K), rows not a multiple of 4, a partial last row
    group, K = 16384 and K = 16640 (slices past 256 blocks); every output
    element written (the output starts as NaN), repeated calls bit-equal (fixed reduction order)."""
    for m, n, k in ((1, 1, 256), (5, 2, 256), (37, 3, 1024), (130, 5, 4096 + 256), (301, 6, 2048),
                    (4099, 7, 4096), (261, 8, 16384), (50, 4, 16384 + 256), (1000, 8, 14336)):
        w = _randn(rng, (m, k), "float32", scale_groups=32)
        a = _randn(rng, (n, k), dtype, scale_groups=32)
        wq = ggml.quantize_q4_0(w)
        out = torch.full((m, n), float("nan"), dtype=torch.float32, device="cuda")
        wq_t, a_t = _t(wq), _t(a)
        be.gemm_w4a8(wq_t, a_t, out)
        got = _n(out)
        _gemm_check(wq, ggml.quantize_q8_1(a), got)
        be.gemm_w4a8(wq_t, a_t, out)
        assert np.array_equal(bits(_n(out)), bits(got)), (m, n, k)


# -- shared memory sized by the launcher, checked by the kernel ----------------------------------------
_SMEM_SHORT = r"""
import sys, numpy as np, torch, quantcore as qc
from quantcore.backends.cuda import runtime as rt
case, short = sys.argv[1], int(sys.argv[2])
seen = []
run, init = rt.Launcher.run, rt.PlannedLaunch.__init__
def short_run(self, fn, what, grid, block, args, shared_mem=0):
    if shared_mem:
        seen.append(what.split("<")[0])
        shared_mem -= short
    run(self, fn, what, grid, block, args, shared_mem)
def short_init(self, *a, **kw):
    init(self, *a, **kw)
    if self.shared_mem:
        seen.append(self.expr.split("<")[0])
        self.shared_mem -= short
g = torch.Generator().manual_seed(0)
dev = lambda *s, dt=torch.float16: torch.randn(*s, generator=g).to(dt).cuda()
try:
    # inputs made before the launches are shortened (quantize_4bit itself is a case below)
    if case.startswith("gemm_w4a8"):  # N > 8: the tensor-core GEMM; N <= 8 on sm_90: the streaming one
        n = 64 if case == "gemm_w4a8_tc" else 4
        wq, a = qc.quantize_q4_0(dev(256, 1024, dt=torch.float32), backend="cuda"), dev(n, 1024, dt=torch.float32)
        call = lambda: qc.gemm_w4a8(wq, a, 256, n, 1024, backend="cuda")
    elif case == "gemm_4bit":       # more than 16 rows: the many-row GEMM
        packed, state = qc.quantize_4bit(dev(256, 1024), quant_type="nf4", backend="cuda")
        a = dev(32, 1024)
        call = lambda: qc.gemv_4bit(a, packed, state, backend="cuda")
    elif case == "quantize_4bit":   # the shared-memory ring
        x = dev(1 << 16)
        call = lambda: qc.quantize_4bit(x, blocksize=64, quant_type="nf4", backend="cuda")
    torch.cuda.synchronize()
    rt.Launcher.run, rt.PlannedLaunch.__init__ = short_run, short_init
    call()
    torch.cuda.synchronize()
    print("RAN", *sorted(set(seen)))
except Exception as exc:
    print("FAILED", *sorted(set(seen)), "|", type(exc).__name__, exc)
"""


@gpu
@needs_torch
@pytest.mark.parametrize("case, kernel", [("gemm_w4a8_tc", "qc::gemm_w4a8_tc_kernel"),
                                          ("gemm_w4a8_stream", "qc::gemm_w4a8_stream_kernel"),
                                          ("gemm_4bit", "qc::gemm_4bit_kernel"),
                                          ("quantize_4bit", "qc::quantize_4bit_v3_kernel")])
def test_kernels_refuse_less_shared_memory_than_their_layout(case, kernel):
    """Each kernel whose launcher computes its dynamic shared memory checks the size against its own
    layout (require_dynamic_smem): given the launcher's bytes the call runs; given 16 bytes fewer the
    kernel stops the launch instead of writing past the allocation. One process per run (a trap
    ends the CUDA context)."""
    if kernel == "qc::gemm_w4a8_stream_kernel" and rt.device_arch(0) < 90:
        pytest.skip("the streaming W4A8 kernel runs on sm_90 and later")

    def child(short: int) -> str:
        res = subprocess.run([sys.executable, "-c", _SMEM_SHORT, case, str(short)], capture_output=True,
                             text=True, timeout=300)
        return res.stdout + res.stderr

    ok, short = child(0), child(16)
    assert "RAN " in ok and kernel in ok.split("RAN", 1)[1], ok[-3000:]
    assert "FAILED" in short and kernel in short.split("FAILED", 1)[1].split("|")[0], short[-3000:]
    assert "illegal instruction" in short.lower() or "launch failure" in short.lower(), short[-3000:]


# -- array kinds, streams, graphs -------------------------------------------------------------------
@gpu
@needs_torch
def test_torch_in_torch_out_zero_copy(be, rng):
    x = _t(_randn(rng, (64, 256), "bfloat16"))
    assert be.prepare(x) is x  # contiguous CUDA tensor: used as is
    packed, state = qc.quantize_4bit(x, backend="cuda")
    out = qc.dequantize_4bit(packed, state, backend="cuda")
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.bfloat16
    assert tuple(out.shape) == (64, 256)


@gpu
def test_cupy_in_cupy_out_zero_copy(rng):
    cp = rt.cupy()
    be = qc.get_backend("cuda")
    x = cp.asarray(_randn(rng, (16, 512), "float16"))
    assert be.prepare(x) is x
    packed, state = qc.quantize_4bit(x, blocksize=128, quant_type="fp4", backend="cuda")
    assert isinstance(packed, cp.ndarray) and isinstance(state.absmax, cp.ndarray)
    out = qc.dequantize_4bit(packed, state, backend="cuda")
    assert isinstance(out, cp.ndarray) and out.dtype == np.float16
    rp, ra = bnb.quantize_4bit(cp.asnumpy(x), 128, "fp4")
    assert np.array_equal(cp.asnumpy(packed).reshape(-1), rp.reshape(-1))
    wq = qc.quantize_q4_0(cp.asarray(_randn(rng, (8, 64), "float32")), backend="cuda")
    assert isinstance(wq, cp.ndarray)


@gpu
def test_host_arrays_raise_device_error():
    packed, state = qc.quantize_4bit(np.ones(128, np.float32), backend="cpu")
    with pytest.raises(DeviceError):
        qc.dequantize_4bit(packed, state, backend="cuda")
    with pytest.raises(DeviceError):
        qc.quantize_q8_1(np.ones((1, 32), np.float32), backend="cuda")


@gpu
@needs_torch
def test_launches_on_the_current_stream(be, rng):
    """The input is written on a side stream after a long sleep; only a launch on that stream sees it."""
    n = 1 << 22
    x = _randn(rng, (n,), "float32")
    src = _t(x)
    dst = torch.zeros_like(src)
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device="cuda")
    absmax = torch.empty((n // 64,), dtype=torch.float32, device="cuda")
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        dst.copy_(src)
        be.quantize_4bit(dst, packed, absmax, blocksize=64, quant_type="nf4")
    s.synchronize()
    rp, ra = bnb.quantize_4bit(x, 64, "nf4")
    assert np.array_equal(_n(packed), rp) and np.array_equal(bits(_n(absmax)), bits(ra))


def _graph_ops(be, rng):
    """(name, inputs to refresh, op call, reference from the inputs) for every kernel-level op."""
    n, k, m = 64 * 1000 + 3, 256, 96
    x = _t(_randn(rng, (n,), "bfloat16"))
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device="cuda")
    nb = bnb.nblocks(n, 64)
    absmax = torch.empty((nb,), dtype=torch.float32, device="cuda")
    qab = torch.empty((nb,), dtype=torch.uint8, device="cuda")
    ab2 = torch.empty((bnb.nblocks(nb, 256),), dtype=torch.float32, device="cuda")
    off = torch.empty((1,), dtype=torch.float32, device="cuda")
    deq = torch.empty((n,), dtype=torch.float16, device="cuda")
    code2 = _t(bnb.DYNAMIC_MAP)
    thr = _t(bnb.DYNAMIC_THRESHOLDS)
    codes8 = torch.empty((n,), dtype=torch.uint8, device="cuda")
    absmax8 = torch.empty((bnb.nblocks(n, 256),), dtype=torch.float32, device="cuda")
    deq8 = torch.empty((n,), dtype=torch.float32, device="cuda")
    a = _t(_randn(rng, (4, k), "bfloat16"))
    gout = torch.empty((4, m), dtype=torch.bfloat16, device="cuda")
    w = _t(_randn(rng, (m, k), "float32"))
    wq = torch.empty((m, k // 32, 18), dtype=torch.uint8, device="cuda")
    aq = torch.empty((4, k // 32, 36), dtype=torch.uint8, device="cuda")
    a8 = torch.empty((4, k // 32, 34), dtype=torch.uint8, device="cuda")
    wdq = torch.empty((m, k), dtype=torch.float32, device="cuda")
    mm1 = torch.empty((m, 4), dtype=torch.float32, device="cuda")
    mm2 = torch.empty((m, 4), dtype=torch.float32, device="cuda")
    nested = qc.Nested(absmax2=ab2, code2=code2, offset=off)
    calls = [
        lambda: be.quantize_4bit(x, packed, absmax, blocksize=64, quant_type="nf4"),
        lambda: be.double_quantize(absmax, qab, ab2, off),
        lambda: be.dequantize_4bit(packed, qab, deq, blocksize=64, quant_type="nf4", nested=nested),
        lambda: be.quantize_blockwise(x, thr, codes8, absmax8, blocksize=256),
        lambda: be.dequantize_blockwise(codes8, absmax8, code2, deq8, blocksize=256),
        lambda: be.gemv_4bit(a, packed[: m * k // 2], qab[: m * k // 64], gout, n=m, k=k, blocksize=64,
                             quant_type="nf4", nested=nested),
        lambda: be.quantize_q4_0(w, wq),
        lambda: be.quantize_q8_1(a, aq),
        lambda: be.quantize_q8_0(a, a8),
        lambda: be.dequantize_ggml(wq, wdq, fmt="q4_0"),
        lambda: be.gemm_q4_0_q8_1(wq, aq, mm1),
        lambda: be.gemm_w4a8(wq, a, mm2),
    ]
    outs = [packed, absmax, qab, ab2, off, deq, codes8, absmax8, deq8, gout, wq, aq, a8, wdq, mm1, mm2]
    return (x, a, w), calls, outs


@gpu
@needs_torch
def test_every_op_captures_in_a_cuda_graph(be, rng):
    """Capture all ops (warmed up first, as CUDA graphs require), replay on new input data and
    compare with eager runs on the same data."""
    inputs, calls, outs = _graph_ops(be, rng)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for inp in inputs:
        inp.copy_(torch.randn_like(inp.float()).to(inp.dtype))
    g.replay()
    torch.cuda.synchronize()
    replayed = [o.clone() for o in outs]
    for c in calls:
        c()
    torch.cuda.synchronize()
    for i, (r, o) in enumerate(zip(replayed, outs)):
        assert torch.equal(r.view(torch.uint8), o.view(torch.uint8)), f"output {i} differs after replay"


def _capture_and_compare(calls, inputs):
    """Warm up, capture ``calls`` (public API: outputs allocated inside the capture), refresh the
    inputs, replay, and compare each captured output with an eager call on the new inputs."""
    for _ in range(2):
        for c in calls:
            c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [c() for c in calls]
    for inp in inputs:
        inp.copy_(torch.randn_like(inp.float()).to(inp.dtype))
    g.replay()
    torch.cuda.synchronize()
    for c, o in zip(calls, outs):
        assert torch.equal(o, c())


@gpu
@needs_torch
def test_public_api_captures_in_a_cuda_graph(be, rng):
    """The ggml API calls (no state object) capture with their output allocations."""
    w = _t(_randn(rng, (256, 512), "float32"))
    wq = qc.quantize_q4_0(w, backend="cuda")
    a = _t(_randn(rng, (2, 512), "bfloat16"))
    _capture_and_compare([lambda: qc.quantize_q4_0(w, backend="cuda"),
                          lambda: qc.quantize_q8_1(a, backend="cuda"),
                          lambda: qc.dequantize_q4_0(wq, backend="cuda"),
                          lambda: qc.gemm_w4a8(wq, a, 256, 2, 512, backend="cuda")], [w, a])


@gpu
@needs_torch
def test_public_state_api_captures_in_a_cuda_graph(be, rng):
    packed, state = qc.quantize_4bit(_t(_randn(rng, (256, 512), "bfloat16")), backend="cuda")
    a = _t(_randn(rng, (1, 512), "bfloat16"))
    _capture_and_compare([lambda: qc.gemv_4bit(a, packed, state, backend="cuda"),
                          lambda: qc.dequantize_4bit(packed, state, backend="cuda")], [a])


@gpu
@needs_torch
def test_more_than_2_31_elements(be, rng):
    """dequantize_4bit to fp16 of 2^31 + 1024 elements (1 GiB packed, 4 GiB out): 64-bit indexing."""
    n = (1 << 31) + 1024
    free, _ = torch.cuda.mem_get_info()
    if free < 7 * (1 << 30):
        pytest.skip(f"needs 7 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    bs = 4096
    nb = bnb.nblocks(n, bs)
    packed = torch.randint(0, 256, ((n + 1) // 2, 1), dtype=torch.uint8, device="cuda")
    absmax = torch.rand((nb,), dtype=torch.float32, device="cuda") + 0.5
    out = torch.empty((n,), dtype=torch.float16, device="cuda")
    be.dequantize_4bit(packed, absmax, out, blocksize=bs, quant_type="nf4", nested=None)
    torch.cuda.synchronize()
    ab = absmax.cpu().numpy()
    for start in (0, (1 << 31) - 4096, (1 << 31) - 8, n - 4096 - 1024, n - 1024):
        cnt = min(8192, n - start)
        first_byte = start // 2
        p = packed[first_byte: first_byte + cnt // 2 + 1].cpu().numpy().reshape(-1)
        q = bnb.unpack_4bit_bnb(p, cnt + 1)[start % 2: start % 2 + cnt]
        scale = ab[np.arange(start, start + cnt) // bs]
        ref = (bnb.NF4_CODE[q] * scale).astype(np.float32).astype(np.float16)
        got = out[start: start + cnt].cpu().numpy()
        assert np.array_equal(bits(got), bits(ref)), start
    del out, packed
    torch.cuda.empty_cache()


@gpu
@needs_torch
@pytest.mark.parametrize("bs,nested", [(64, True), (256, False), (32, True)])
def test_gemv_4bit_more_than_2_31_elements(be, rng, bs, nested):
    """gemv_4bit over a [2^17 + 64, 16384] weight (2^31 + 2^20 elements, 1 GiB packed): the rows
    on both sides of element 2^31 against the reference of those rows (64-bit and block indexing,
    the nested second-level index past 2^23)."""
    n, k, batch = (1 << 17) + 64, 16384, 2
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * (1 << 30):
        pytest.skip(f"needs 3 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    nb = n * k // bs
    packed = torch.randint(0, 256, (n * k // 2, 1), dtype=torch.uint8, device="cuda")
    if nested:
        qab = torch.randint(0, 256, (nb,), dtype=torch.uint8, device="cuda")
        ab2 = torch.rand((bnb.nblocks(nb, bnb.NESTED_BLOCKSIZE),), dtype=torch.float32, device="cuda") + 0.5
        off = torch.tensor([0.25], dtype=torch.float32, device="cuda")
        nest = qc.Nested(absmax2=ab2, code2=_t(bnb.DYNAMIC_MAP), offset=off)
        absmax = qab
    else:
        absmax = torch.rand((nb,), dtype=torch.float32, device="cuda") + 0.5
        nest = None
    a = _randn(rng, (batch, k), "bfloat16")
    out = torch.empty((batch, n), dtype=torch.bfloat16, device="cuda")
    be.gemv_4bit(_t(a), packed, absmax, out, n=n, k=k, blocksize=bs, quant_type="nf4", nested=nest)
    got = _n(out).astype(np.float64)
    rows = np.r_[0:16, (1 << 17) - 48:n]  # row 2^17 starts at element 2^31
    per_row = k // bs
    for r0 in (rows[:16], rows[16:]):
        p = packed[r0[0] * k // 2: (r0[-1] + 1) * k // 2].cpu().numpy()
        blocks = slice(r0[0] * per_row, (r0[-1] + 1) * per_row)  # starts on a nested block
        if nested:
            nest2 = slice(blocks.start // bnb.NESTED_BLOCKSIZE, bnb.nblocks(blocks.stop, bnb.NESTED_BLOCKSIZE))
            scale = bnb.dequantize_absmax(qab[blocks].cpu().numpy(), ab2[nest2].cpu().numpy(), np.float32(0.25))
        else:
            scale = absmax[blocks].cpu().numpy()
        w_eff = bnb.dequantize_4bit(p, scale, len(r0) * k, bs, "nf4", np.float32).reshape(len(r0), k)
        ref, bound = bounds.gemv_4bit(a.astype(np.float64), w_eff, "bfloat16")
        err = np.abs(got[:, r0] - ref)
        assert (err <= bound.max_abs).all(), (bs, nested, int(r0[0]), float((err / bound.max_abs).max()))
    del packed, absmax, out
    torch.cuda.empty_cache()


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "uint8"])
def test_from_numpy_uploads_large_arrays_through_pinned_pieces(be, dtype, tmp_path):
    """from_numpy of an array of STAGE_BYTES or more goes through the thread's two pinned buffers
    piece by piece (a conversion's upload of a memory-mapped tensor): the device copy equals the
    source for a read-only memory map, sizes below, at and across piece boundaries, and the buffers
    are reused by the next call while a copy may still be in flight."""
    stage = cuda_common.STAGE_BYTES
    item = np.dtype(np.uint16 if dtype == "bfloat16" else dtype).itemsize
    rng = np.random.default_rng(7)
    for nbytes in (stage // 2, stage, 2 * stage + 4 * item, 5 * stage - 2 * item):
        raw = rng.integers(0, 256, nbytes, dtype=np.uint8)
        path = tmp_path / f"a{nbytes}.bin"
        raw.tofile(path)
        src = np.memmap(path, dtype=np.uint8, mode="r").view(BF16 if dtype == "bfloat16" else dtype)
        src = src.reshape(-1, 4) if src.size % 4 == 0 else src
        dev = be.from_numpy(src)
        assert tuple(dev.shape) == src.shape and str(dev.dtype) == f"torch.{dtype}"
        back = be.to_numpy(dev)
        assert np.array_equal(back.view(np.uint8).reshape(-1), raw), nbytes
