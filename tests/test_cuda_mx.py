"""CUDA kernels of the MX family: kernels_cuda/mx_quant.cu, kernels_cuda/mx_gemm.cu and their
launchers in quantcore/backends/cuda/mx.py.

CPU-safe part (CI): both sources compile with nvcc for sm_80 and sm_90, and the GEMM for sm_90a
(wgmma), without local-memory spills; the launcher's shared-memory size matches the kernel's.

GPU part (skipped with the reason where no CUDA GPU, torch CUDA or CuPy is present; run on the
GPU machine with the same pytest command): quantize of a large tensor with signed NaNs, dequantize /
swizzle / unswizzle bit for bit with garbage scale padding, scaled_fp4_mm within the fp64 bound on
both MMA back ends, NaN propagation, CUDA graph capture. The conformance suite's cases (the MX
family's quantize on its adversarial inputs included) run on cuda from
tests/test_conformance_backends.py.
"""

from __future__ import annotations

import importlib.resources
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from quantcore.backends.cuda import bnb as cbnb
from quantcore.backends.cuda import mx as cmx

from quantcore.arrays import BF16, as_dtype
from quantcore.formats import kernel_defines, mx
from tests.cuda_arrays import TUNE

NVCC = shutil.which("nvcc") or (shutil.which("/usr/local/cuda/bin/nvcc"))
KDIR = Path(str(importlib.resources.files("quantcore.kernels_cuda")))
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA sources are compile-checked "
                                                     "with nvcc where it is installed")

FMTS = ("mxfp4", "mxfp8", "nvfp4")
DTYPES = ("float32", "float16", "bfloat16")


# -- CPU-safe: the sources build ------------------------------------------------------------------
def _gencode(arch: str) -> list[str]:
    num = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{num},code={arch}"]


def _nvcc(tmp_path: Path, source: str, arch: str, *defines: str) -> str:
    kernel_defines.write_header(tmp_path)
    cmd = [NVCC, "-std=c++17", "-cubin", *_gencode(arch), "-ftz=false", "--fmad=false", "-prec-div=true",
           f"-I{tmp_path}", *defines, "-Xptxas", "-v",
           str(KDIR / source), "-o", str(tmp_path / "k.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


def _entries(log: str) -> dict[str, str]:
    """ptxas -v output split per entry function."""
    parts = re.split(r"Compiling entry function '([^']+)'", log)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_quant_source_compiles(tmp_path, arch):
    ents = _entries(_nvcc(tmp_path, cmx.QUANT_SOURCE, arch))
    for fmt in FMTS:
        for dt in DTYPES:
            assert f"qc_mx_quantize_{fmt}_{dt}" in ents
            assert f"qc_mx_dequantize_{fmt}_{dt}" in ents
    assert "qc_mx_swizzle" in ents and "qc_mx_unswizzle" in ents
    for name, text in ents.items():
        assert "0 bytes spill stores" in text, (name, text)


@needs_nvcc
@pytest.mark.parametrize("arch,timing", [("sm_80", False), ("sm_90", False), ("sm_90a", False), ("sm_90a", True)])
def test_gemm_source_compiles(tmp_path, arch, timing):
    """The GEMM builds for each target; with -DQCMX_TIMING_VARIANTS (the module the timing tools
    load) its experiment entry points too, and only then."""
    log = _nvcc(tmp_path, cmx.GEMM_SOURCE, arch, *(["-DQCMX_TIMING_VARIANTS"] if timing else []))
    ents = _entries(log)
    wg = arch == "sm_90a"
    for fmt in mx.FP4_FORMATS:
        for cpw in (16, 4):
            assert cmx.gemm_kernel_name(fmt, False, cpw) in ents
            assert (cmx.gemm_kernel_name(fmt, True, cpw) in ents) == wg
    for var in cmx.GEMM_TIMING_VARIANTS["wgmma"]:
        assert (cmx.gemm_kernel_name("nvfp4", True, 16) + var in ents) == (wg and timing), var
    for name, text in ents.items():
        # registers sit near the 255 limit: a spill would mean local-memory traffic in the main
        # loop. The sm_80 build of the mma.sync path (bf16x2 multiplies as fma) may spill a few
        # bytes; the Hopper builds may not.
        spill = int(re.search(r"(\d+) bytes spill stores", text).group(1))
        assert spill <= (16 if arch == "sm_80" else 0), (name, text)
    # ptxas says so when it cannot keep the wgmma pipeline asynchronous
    assert "serialized" not in log, log


def test_smem_constant_is_the_kernels():
    # the GEMM's dynamic shared memory, computed once in kernel_defines, generated into the kernels'
    # header and checked against kSmemBytes by a static_assert at every build (NVRTC, the nvcc tests)
    assert cmx.GEMM_SMEM_BYTES == 161792
    assert "static_assert(kSmemBytes == QC_MXG_SMEM_BYTES" in (KDIR / cmx.GEMM_SOURCE).read_text()


# -- GPU ------------------------------------------------------------------------------------------
def _gpu_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        import cupy  # noqa: F401
        from cupy_backends.cuda.libs import nvrtc  # noqa: F401
    except ImportError as exc:
        return f"CuPy (the NVRTC loader of the cuda backend) is missing: {exc}"
    return None


GPU_REASON = _gpu_reason()
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"needs an NVIDIA GPU: {GPU_REASON}")


def _torch():
    import torch

    return torch


_TORCH_DT = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "uint8": "uint8",
             "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64", "float64": "float64",
             "bool": "bool"}


def to_dev(a: np.ndarray):
    torch = _torch()
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    if a.dtype.itemsize == 1 and a.dtype != np.uint8 and a.dtype != np.int8 and a.dtype != np.bool_:
        a = a.view(np.uint8)
    return torch.from_numpy(a).cuda()


def to_host(t) -> np.ndarray:
    torch = _torch()
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def torch_dtype(dtype):
    torch = _torch()
    d = as_dtype(dtype)
    return torch.bfloat16 if d == BF16 else getattr(torch, _TORCH_DT.get(d.name, "uint8"))


def empty_dev(shape, dtype, poison: int = 0xA5):
    """Device buffer filled with a poison byte pattern (so unwritten elements show)."""
    torch = _torch()
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = torch.full((nbytes,), poison, dtype=torch.uint8, device="cuda")
    return buf.view(torch_dtype(dtype)).reshape(tuple(shape))


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_bits(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Bit-exact, except that a NaN matches a NaN of any sign and payload (the conformance rule)."""
    ref = np.asarray(ref, dtype=got.dtype)
    g, r = bits(got).reshape(-1), bits(ref).reshape(-1)
    diff = g != r
    if got.dtype.kind == "f" or got.dtype == BF16:
        rnan = np.isnan(ref.astype(np.float32)).reshape(-1)
        diff = np.where(rnan, ~np.isnan(got.astype(np.float32)).reshape(-1), diff)
    bad = np.flatnonzero(diff)
    assert bad.size == 0, (f"{what}: {bad.size} of {g.size} differ; first at {bad[0]}: got 0x{int(g[bad[0]]):x}, "
                           f"expected 0x{int(r[bad[0]]):x}")


def _quantize_dev(x: np.ndarray, fmt: str, mode: str | None, swizzled: bool, g):
    rows, k = x.shape
    blk = mx.block_size(fmt)
    codes = empty_dev((rows, mx.codes_cols(fmt, k)), np.uint8)
    sshape = mx.swizzled_shape(rows, k // blk) if swizzled else (rows, k // blk)
    scales = empty_dev(sshape, np.uint8)
    gd = to_dev(np.array([g], np.float32)) if fmt == "nvfp4" else None
    cmx.mx_quantize(None, to_dev(x), codes, scales, rows=rows, cols=k, fmt=fmt, scale_mode=mode,
                    swizzled=swizzled, global_scale=gd)
    return to_host(codes), to_host(scales)


def _quantize_ref(x: np.ndarray, fmt: str, mode: str | None, swizzled: bool, g):
    c, s = mx.quantize(x, fmt, scale_mode=mode or "floor", global_scale=g)
    return c, (mx.swizzle(s) if swizzled else s)


@needs_gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_large_and_negative_nan(fmt, rng):
    # a large random tensor, plus NaNs with the sign bit set (the reference gives code 0x7 / 0x7F
    # whatever the NaN's sign) and -0.0 / tiny negatives (sign kept)
    rows, k = 515, 4096
    x = (rng.standard_normal((rows, k)) * np.exp2(rng.uniform(-20, 20, (rows, 1)))).astype(np.float32)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, 64, replace=False)
    flat[idx[:16]] = np.array([0xFFC00000], np.uint32).view(np.float32)[0]
    flat[idx[16:32]] = np.array([0x7FC00001], np.uint32).view(np.float32)[0]
    flat[idx[32:48]] = -0.0
    flat[idx[48:]] = -1e-40
    g = mx.nvfp4_global_scale(np.nanmax(np.abs(x))) if fmt == "nvfp4" else None
    for swz in (False, True):
        got = _quantize_dev(x, fmt, "rceil" if fmt != "nvfp4" else None, swz, g)
        ref = _quantize_ref(x, fmt, "rceil" if fmt != "nvfp4" else None, swz, g)
        _assert_bits(got[0], ref[0], f"codes swizzled={swz}")
        _assert_bits(got[1], ref[1], f"scales swizzled={swz}")


@needs_gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_bit_exact(fmt, dtype, rng):
    from quantcore.conformance.families.mx import _random_scale_bytes

    T = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}[dtype]
    blk = mx.block_size(fmt)
    for rows, nbk in ((5, 8), (130, 6), (1, 1), (257, 33)):
        k = nbk * blk
        codes = rng.integers(0, 256, (rows, mx.codes_cols(fmt, k)), dtype=np.uint8)
        scales = _random_scale_bytes(fmt, rng, (rows, nbk))
        if fmt == "nvfp4":
            specials = np.array([0x00, 0x01, 0x07, 0x08, 0x7E, 0x7F, 0x80, 0xFE, 0xFF], np.uint8)
            scales.reshape(-1)[: specials.size] = specials[: min(specials.size, scales.size)]
        else:
            specials = np.array([0, 1, 127, 253, 254, 255], np.uint8)
            scales.reshape(-1)[: min(specials.size, scales.size)] = specials[: min(specials.size, scales.size)]
        for g in ((np.float32(1.0), np.float32(2688.0 / 3.0), np.float32(1e-30)) if fmt == "nvfp4" else (None,)):
            ref = mx.dequantize(codes, scales, fmt, global_scale=g, out_dtype=T)
            for swz in (False, True):
                s_in = _swizzled_with_garbage(scales, rng) if swz else scales  # garbage in the padding
                out = empty_dev((rows, k), T)
                gd = to_dev(np.array([g], np.float32)) if g is not None else None
                cmx.mx_dequantize(None, to_dev(codes), to_dev(s_in), out, rows=rows, cols=k, fmt=fmt,
                                  swizzled=swz, global_scale=gd)
                _assert_bits(to_host(out), ref, f"{fmt} {dtype} rows={rows} swizzled={swz} g={g}")


@needs_gpu
@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (130, 5), (257, 9), (64, 12), (33, 3), (1000, 257)])
def test_swizzle_unswizzle_bit_exact(shape, rng):
    rows, cols = shape
    s = rng.integers(0, 256, shape, dtype=np.uint8)
    ref = mx.swizzle(s)
    out = empty_dev(ref.shape, np.uint8)
    cmx.swizzle_scales(None, to_dev(s), out, rows=rows, cols=cols)
    _assert_bits(to_host(out), ref, "swizzle")
    swz = ref.copy().reshape(-1)
    pad = np.ones(swz.size, bool)
    pad[mx.swizzle_offsets(rows, cols).reshape(-1)] = False
    swz[pad] = rng.integers(0, 256, int(pad.sum())).astype(np.uint8)
    back = empty_dev(shape, np.uint8)
    cmx.unswizzle_scales(None, to_dev(swz.reshape(ref.shape)), back, rows=rows, cols=cols)
    _assert_bits(to_host(back), s, "unswizzle")


# -- GEMM -------------------------------------------------------------------------------------------
def _gemm_modes() -> list[str]:
    if GPU_REASON is not None:
        return ["mma"]
    major, minor = cmx.compute_capability(_torch().cuda.current_device())
    return ["wgmma", "mma", "panel"] if (major, minor) == (9, 0) else ["mma", "panel"]


GEMM_SHAPES = {
    "nvfp4": [(1, 1, 64), (33, 17, 128), (130, 70, 192), (300, 136, 96), (257, 129, 1040), (7, 300, 16),
              (512, 384, 2048)],
    "mxfp4": [(1, 1, 64), (33, 17, 128), (130, 70, 192), (300, 136, 96), (257, 129, 1056), (7, 300, 32),
              (512, 384, 2048)],
}


def _operand(fmt, rng, rows, k, random_codes):
    x = rng.standard_normal((rows, k)) * np.exp2(rng.uniform(-3, 3, (rows, 1)))
    g = mx.nvfp4_global_scale(np.abs(x).max()) if fmt == "nvfp4" else None
    codes, scales = mx.quantize(x.astype(np.float32), fmt, global_scale=g)
    if random_codes:
        codes = rng.integers(0, 256, codes.shape, dtype=np.uint8)
    return codes, mx.swizzle(scales), g


def _assert_within_bound(got, ref, bound, what):
    """Every element within the fp64 bound's max_abs; returns |got - ref|."""
    err = np.abs(got - ref)
    worst = float(np.max(err / np.maximum(bound.max_abs, 1e-300)))
    assert worst <= 1.0, f"{what}: error {worst:.3g} x the bound"
    return err


def _swizzled_with_garbage(scales, rng):
    """Row-major scales [rows, cols] in the swizzled layout, random bytes in its padding (an op must
    read only the real scales)."""
    rows, cols = scales.shape
    swz = mx.swizzle(scales).reshape(-1)
    pad = np.ones(swz.size, bool)
    pad[mx.swizzle_offsets(rows, cols).reshape(-1)] = False
    swz[pad] = rng.integers(0, 256, int(pad.sum())).astype(np.uint8)
    return swz.reshape(mx.swizzled_shape(rows, cols))


def _run_mm(fmt, a, b, sa, sb, alpha, bias, mode):
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    out = empty_dev((m, n), BF16)
    cmx.scaled_fp4_mm(None, to_dev(a), to_dev(b), to_dev(sa), to_dev(sb), to_dev(np.array([alpha], np.float32)),
                      None if bias is None else to_dev(bias), out, m=m, n=n, k=k, fmt=fmt, mode=mode)
    return to_host(out).astype(np.float64)


@needs_gpu
@pytest.mark.parametrize("fmt", mx.FP4_FORMATS)
@pytest.mark.parametrize("mode", _gemm_modes())
def test_scaled_fp4_mm_within_bound(fmt, mode, rng):
    from quantcore.conformance.families.mx import mm_bound

    for (m, n, k) in GEMM_SHAPES[fmt]:
        for with_bias, random_codes in ((False, False), (True, True)):
            a, sa, ga = _operand(fmt, rng, m, k, random_codes)
            b, sb, gb = _operand(fmt, rng, n, k, random_codes)
            alpha = np.float32(1.0) / (ga * gb) if fmt == "nvfp4" else np.float32(rng.uniform(0.5, 2))
            bias = rng.standard_normal(n).astype(BF16) if with_bias else None
            A, B = mx.fp4_operand(a, sa, fmt), mx.fp4_operand(b, sb, fmt)
            ref, bound = mm_bound(A, B, float(alpha), None if bias is None else bias.astype(np.float64))
            got = _run_mm(fmt, a, b, sa, sb, alpha, bias, mode)
            what = f"{fmt} {mode} m={m} n={n} k={k} bias={with_bias} random_codes={random_codes}"
            assert np.isfinite(got).all(), what
            err = _assert_within_bound(got, ref, bound, what)
            nmse = float(np.sum(err**2) / max(np.sum(ref**2), 1e-300))
            assert nmse <= bound.nmse, f"{what}: NMSE {nmse:.3g} > {bound.nmse:.3g}"


@needs_gpu
@pytest.mark.parametrize("f16", [1, 0])
def test_scaled_fp4_mm_mxfp4_scale_ranges(f16, rng, monkeypatch):
    """MXFP4 on the wgmma kernel decodes to fp16 only in the CTAs whose scale bytes all lie in
    110..141 (mx_gemm.cu, kE8F16Lo): row tiles whose scales sit far below or above that range, next
    to ones inside it, and B rows likewise, stay within the bound with the fp16 decode allowed
    (mx_gemm_f16=1, the default) and with it off."""
    if "wgmma" not in _gemm_modes():
        pytest.skip("the fp16 MXFP4 decode is the wgmma back end's (compute capability 9.0)")
    from quantcore.conformance.families.mx import mm_bound

    monkeypatch.setenv(TUNE, f"mx_gemm_f16={f16}")
    m, n, k = 700, 300, 1024
    xa = rng.standard_normal((m, k))
    xa[:256] *= 2.0 ** -30  # the first row tile: scale bytes ~97, below the range
    xa[512:600] *= 2.0 ** 25  # part of the third: bytes ~152, above it
    xb = rng.standard_normal((n, k))
    xb[128:256] *= 2.0 ** -20  # the second column tile: bytes ~107
    a, sa_ = mx.quantize(xa.astype(np.float32), "mxfp4")
    b, sb_ = mx.quantize(xb.astype(np.float32), "mxfp4")
    sa, sb = mx.swizzle(sa_), mx.swizzle(sb_)
    A, B = mx.fp4_operand(a, sa, "mxfp4"), mx.fp4_operand(b, sb, "mxfp4")
    ref, bound = mm_bound(A, B, 1.0, None)
    got = _run_mm("mxfp4", a, b, sa, sb, np.float32(1.0), None, "wgmma")
    assert np.isfinite(got).all()
    _assert_within_bound(got, ref, bound, f"mxfp4 wgmma mx_gemm_f16={f16}")


@needs_gpu
@pytest.mark.parametrize("fmt", mx.FP4_FORMATS)
@pytest.mark.parametrize("mode", _gemm_modes())
def test_scaled_fp4_mm_nan_scale_and_garbage_padding(fmt, mode, rng):
    m, n, k = 200, 150, 16 * 37 if fmt == "nvfp4" else 32 * 37  # 37 blocks: 3 padding columns
    a, sa, ga = _operand(fmt, rng, m, k, False)
    b, sb, gb = _operand(fmt, rng, n, k, False)
    nkb = k // mx.block_size(fmt)
    alpha = np.float32(1.0) if fmt == "mxfp4" else np.float32(1.0) / (ga * gb)
    for s_, rows in ((sa, m), (sb, n)):  # NaN bytes in every padding position
        flat = s_.reshape(-1)
        pad = np.ones(flat.size, bool)
        pad[mx.swizzle_offsets(rows, nkb).reshape(-1)] = False
        flat[pad] = 0xFF
    A, B = mx.fp4_operand(a, sa, fmt), mx.fp4_operand(b, sb, fmt)
    ref = float(alpha) * (A @ B.T)
    got = _run_mm(fmt, a, b, sa, sb, alpha, None, mode)
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - ref)) <= 0.02 * np.max(np.abs(ref))
    # a NaN scale inside row 5 of A makes row 5 NaN, and only row 5
    sa2 = sa.copy()
    sa2.reshape(-1)[mx.swizzle_offsets(m, nkb)[5, 3]] = 0x7F if fmt == "nvfp4" else 0xFF
    got2 = _run_mm(fmt, a, b, sa2, sb, alpha, None, mode)
    assert np.isnan(got2[5]).all()
    assert np.isfinite(np.delete(got2, 5, axis=0)).all()


@needs_gpu
def test_graph_capture_quantize_and_mm(rng):
    """quantize (nvfp4, bf16, swizzled) + scaled_fp4_mm captured in one CUDA graph and replayed on
    new data: same bits as eager calls (no allocation, no host synchronization, current stream)."""
    torch = _torch()
    m, n, k = 192, 160, 512
    x = torch.empty((m, k), dtype=torch.bfloat16, device="cuda")
    w = to_dev(rng.standard_normal((n, k)).astype(np.float32))
    gx = torch.tensor([mx.nvfp4_global_scale(8.0)], dtype=torch.float32, device="cuda")
    gw = mx.nvfp4_global_scale(float(w.abs().max()))
    wc = torch.empty((n, k // 2), dtype=torch.uint8, device="cuda")
    ws = torch.empty(mx.swizzled_shape(n, k // 16), dtype=torch.uint8, device="cuda")
    cmx.mx_quantize(None, w, wc, ws, rows=n, cols=k, fmt="nvfp4", scale_mode=None, swizzled=True,
                    global_scale=torch.tensor([gw], dtype=torch.float32, device="cuda"))
    xc = torch.empty((m, k // 2), dtype=torch.uint8, device="cuda")
    xs = torch.empty(mx.swizzled_shape(m, k // 16), dtype=torch.uint8, device="cuda")
    alpha = torch.tensor([1.0 / (float(gx) * float(gw))], dtype=torch.float32, device="cuda")
    out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")

    def step():
        cmx.mx_quantize(None, x, xc, xs, rows=m, cols=k, fmt="nvfp4", scale_mode=None, swizzled=True,
                        global_scale=gx)
        cmx.scaled_fp4_mm(None, xc, wc, xs, ws, alpha, None, out, m=m, n=n, k=k, fmt="nvfp4")

    x.copy_(torch.randn((m, k), device="cuda"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: builds and loads the modules outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        x.copy_(torch.randn((m, k), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed.view(torch.int16), out.view(torch.int16))
        # and the eager result is right
        xq = mx.quantize(to_host(x).astype(np.float32), "nvfp4", global_scale=to_host(gx)[0])
        _assert_bits(to_host(xc), xq[0], "graph quantize codes")


# -- the conformance suite's MX cases ----------------------------------------------------------------


# -- linear_mx: kernels_cuda/mx_gemv.cu -------------------------------------------------------------
@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_gemv_source_compiles(tmp_path, arch):
    ents = _entries(_nvcc(tmp_path, cmx.GEMV_SOURCE, arch))
    for fmt in mx.FP4_FORMATS:
        for dt in DTYPES:
            for nb in cmx.GEMV_BATCHES:
                assert cmx.gemv_kernel_name(fmt, dt, nb) in ents
        for dt in cmx.GEMV_TC_DTYPES:
            for h in (1, 2):
                assert cmx.gemv_tc_kernel_name(fmt, dt, h) in ents
    for name, text in ents.items():
        assert "0 bytes spill stores" in text, (name, text)


def _linear_case(fmt, rng, n, k, dtype):
    from quantcore.conformance.families.mx import _linear_values

    w = (rng.standard_normal((n, k)) * np.exp2(rng.uniform(-4, 4, (n, 1)))).astype(np.float32)
    g = mx.nvfp4_global_scale(float(np.abs(w).max())) if fmt == "nvfp4" else None
    codes, scales = mx.quantize(w, fmt, global_scale=g)
    return codes, scales, g, _linear_values(codes, scales, fmt, g)


@needs_gpu
@pytest.mark.parametrize("fmt", mx.FP4_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_linear_mx_within_bound(fmt, dtype, rows, rng):
    """Every batch instance (1..16 per launch; 17 and 40 rows take two and three launches), K with an
    odd number of 16-element blocks (NVFP4: the half unit), a codes view at a 4-byte but not 16-byte
    offset (the u32 loads) and swizzled scales with garbage padding, against the fp64 bound."""
    from quantcore.conformance import bounds

    T = as_dtype(dtype)
    for n, k, offset in ((300, 1024, 0), (33, 16 * 37 if fmt == "nvfp4" else 32 * 19, 0), (70, 512, 4)):
        codes, scales, g, wv = _linear_case(fmt, rng, n, k, dtype)
        x = (rng.standard_normal((rows, k)) / 4).astype(T)
        ref, bound = bounds.linear_mx(x.astype(np.float64), wv, dtype)
        swz = _swizzled_with_garbage(scales, rng)
        buf = to_dev(np.concatenate([np.zeros(offset, np.uint8), codes.reshape(-1)]))
        cd = buf[offset:].view(n, k // 2)
        gd = to_dev(np.array([g], np.float32)) if g is not None else None
        for swizzled, s in ((False, scales), (True, swz)):
            out = empty_dev((rows, n), T)
            cmx.linear_mx(None, to_dev(x), cd, to_dev(s), out, n=n, k=k, fmt=fmt, swizzled=swizzled,
                          global_scale=gd)
            got = to_host(out).astype(np.float64)
            what = f"{fmt} {dtype} rows={rows} n={n} k={k} offset={offset} swizzled={swizzled}"
            assert np.isfinite(got).all(), what
            err = _assert_within_bound(got, ref, bound, what)
            nmse = float(np.sum(err**2) / max(np.sum(ref**2), 1e-300))
            assert nmse <= bound.nmse, f"{what}: NMSE {nmse:.3g} > {bound.nmse:.3g}"


#: the two tensor-core kernels of linear_mx, as (kernel, fmt, dtype): "tc" mx_gemv.cu's (the decode
#: gemv turned off, from one row on), "decode" bnb_gemv.cu's with MX scales (the default where it runs)
_MMA_KERNELS = [("tc", f, d) for f in mx.FP4_FORMATS for d in cmx.GEMV_TC_DTYPES] + [
    ("decode", f, d) for f, dts in cbnb.DECODE_MX_DTYPES.items() for d in dts]


def _mma_kernel(kernel, monkeypatch):
    """Select ``kernel`` of _MMA_KERNELS; returns the launcher's rule that must hold for it to run."""
    if kernel == "tc":
        monkeypatch.setenv(TUNE, "mx_gemv_tc_rows=1,mx_gemv_dec=0")
        return lambda dt, fmt, n, k, xd, cd, sd, rows: cmx.gemv_tc_takes(
            0, dt, fmt, n, k, cmx.ptr(xd), cmx.ptr(cd), cmx.ptr(sd), min(rows, 16))
    monkeypatch.setenv(TUNE, "mx_gemv_dec_b1_min=0")  # one row too, whatever the weight's size
    return lambda dt, fmt, n, k, xd, cd, sd, rows: cbnb.decode_gemv_mx_takes(
        0, dt, fmt, n, k, cmx.ptr(xd), cmx.ptr(cd), cmx.ptr(sd), rows)


@needs_gpu
@pytest.mark.parametrize("kernel,fmt,dtype", _MMA_KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 20])
def test_linear_mx_tensor_core_within_bound(kernel, fmt, dtype, rows, rng, monkeypatch):
    """The tensor-core gemvs (each asserted to be the kernel the launcher picks; B 1 too, where the
    tc kernel does not run by default): B 1..16 per launch (20: two launches of the tc kernel, two
    row blocks of the decode one), partial tiles (N % 16 != 0), K not a multiple of the ring stage (5
    and 37 chunks), more tiles than multiprocessors (CTAs with several tiles, tiles split between
    warps) and a single chunk (most warps idle), plain and swizzled scales with garbage padding,
    NVFP4's global scale as a device array; against the fp64 bound, and the same bits on a second run."""
    from quantcore.conformance import bounds

    takes = _mma_kernel(kernel, monkeypatch)
    T = as_dtype(dtype)
    shapes = ((300, 1024), (40, 320), (1000, 64 * 37), (16, 64), (4100, 512)) if rows in (1, 9, 16) else \
        ((300, 1024), (40, 320), (4100, 512))
    for n, k in shapes:
        codes, scales, g, wv = _linear_case(fmt, rng, n, k, dtype)
        x = (rng.standard_normal((rows, k)) / 4).astype(T)
        ref, bound = bounds.linear_mx(x.astype(np.float64), wv, dtype)
        swz = _swizzled_with_garbage(scales, rng)
        cd, xd = to_dev(codes), to_dev(x)
        gd = to_dev(np.array([g], np.float32)) if g is not None else None
        for swizzled, s in ((False, scales), (True, swz)):
            sd = to_dev(s)
            assert takes(dtype, fmt, n, k, xd, cd, sd, rows)
            outs = []
            for _ in range(2):
                out = empty_dev((rows, n), T)
                cmx.linear_mx(None, xd, cd, sd, out, n=n, k=k, fmt=fmt, swizzled=swizzled, global_scale=gd)
                outs.append(to_host(out))
            what = f"{fmt} {dtype} rows={rows} n={n} k={k} swizzled={swizzled}"
            assert np.array_equal(bits(outs[0]), bits(outs[1])), f"{what}: not the same bits run to run"
            got = outs[0].astype(np.float64)
            assert np.isfinite(got).all(), what
            err = _assert_within_bound(got, ref, bound, what)
            nmse = float(np.sum(err**2) / max(np.sum(ref**2), 1e-300))
            assert nmse <= bound.nmse, f"{what}: NMSE {nmse:.3g} > {bound.nmse:.3g}"


@needs_gpu
@pytest.mark.parametrize("kernel,fmt,dtype", _MMA_KERNELS)
def test_linear_mx_tensor_core_scale_extremes(kernel, fmt, dtype, rng, monkeypatch):
    """Every E2M1 code and scale bytes over their whole range (E8M0 0..254 and the NaN byte 255;
    E4M3 subnormals, 448, the NaN byte) through each tensor-core gemv: NaN exactly where the
    reference has one, inf where it overflows, the rest within the bound."""
    from quantcore.conformance import bounds
    from quantcore.conformance.families.mx import _linear_values

    n, k = 48, 512
    nbk = k // mx.block_size(fmt)
    codes = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    if fmt == "mxfp4":
        scales = rng.integers(100, 150, (n, nbk)).astype(np.uint8)
        scales[0, :] = np.arange(nbk) % 255  # 0 .. 254 in row 0 (tiny and huge scales)
        scales[1, 3] = 255
    else:
        scales = rng.integers(0x08, 0x7E, (n, nbk)).astype(np.uint8)
        scales[0, :] = np.arange(nbk) % 0x7F  # subnormals .. 448
        scales[1, 3] = 0x7F
    g = np.float32(3.5) if fmt == "nvfp4" else None
    wv = _linear_values(codes, scales, fmt, g)
    takes = _mma_kernel(kernel, monkeypatch)
    T = as_dtype(dtype)
    x = (rng.standard_normal((3, k)) / 4).astype(T)
    xr = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        ref, bound = bounds.linear_mx(xr, np.nan_to_num(wv, nan=0.0), dtype)
    nan_rows = np.isnan(wv).any(axis=1)
    xd, cd, sd = to_dev(x), to_dev(codes), to_dev(scales)
    gd = to_dev(np.array([g], np.float32)) if g is not None else None
    assert takes(dtype, fmt, n, k, xd, cd, sd, 3)
    out = empty_dev((3, n), T)
    cmx.linear_mx(None, xd, cd, sd, out, n=n, k=k, fmt=fmt, swizzled=False, global_scale=gd)
    got = to_host(out).astype(np.float64)
    assert np.isnan(got[:, nan_rows]).all(), f"{kernel} {fmt} {dtype}: NaN scale lost"
    ok = ~nan_rows
    tmax = 65504.0 if dtype == "float16" else 3.3895313892515355e38
    big = np.abs(ref[:, ok]) > tmax  # the reference overflows T: inf expected
    err = np.abs(got[:, ok] - ref[:, ok])
    assert ((err <= bound.max_abs[:, ok]) | big).all(), f"{kernel} {fmt} {dtype}: outside the bound"


def test_linear_mx_kernel_choice(monkeypatch):
    """Which gemv runs (no GPU: the launcher's rule, on a device reported as compute capability 9.0):
    the tensor-core kernel for fp16 / bf16 from GEMV_TC_MIN_ROWS rows, K % 64 == 0 and aligned
    operands; the CUDA-core kernel for one row, fp32, K % 64 != 0, misaligned pointers, or with
    QUANTCORE_CUDA_TUNE=mx_gemv_tc=0."""
    monkeypatch.setattr(cmx, "compute_capability", lambda dev: (9, 0))
    monkeypatch.delenv(TUNE, raising=False)
    take = cmx.gemv_tc_takes
    assert cmx.GEMV_TC_MIN_ROWS == 2
    for fmt in mx.FP4_FORMATS:
        for dt in cmx.GEMV_TC_DTYPES:
            assert take(0, dt, fmt, 4096, 14336, 0, 0, 0, 2) and take(0, dt, fmt, 4096, 14336, 0, 0, 0, 16)
            assert not take(0, dt, fmt, 4096, 14336, 0, 0, 0, 1)
            assert not take(0, dt, fmt, 4096, 14336 + 32, 0, 0, 0, 8)  # K % 64 != 0
            assert not take(0, dt, fmt, 4096, 14336, 8, 0, 0, 8)  # x not 16-byte aligned
            assert not take(0, dt, fmt, 4096, 14336, 0, 4, 0, 8)  # codes not 16-byte aligned
        assert not take(0, "float32", fmt, 4096, 14336, 0, 0, 0, 8)
    assert take(0, "bfloat16", "mxfp4", 64, 64, 0, 0, 2, 8) and not take(0, "bfloat16", "nvfp4", 64, 64, 0, 0, 2, 8)
    monkeypatch.setenv(TUNE, "mx_gemv_tc=0")
    assert not take(0, "bfloat16", "mxfp4", 4096, 14336, 0, 0, 0, 8)
    monkeypatch.setenv(TUNE, "mx_gemv_tc_rows=1")
    assert take(0, "bfloat16", "mxfp4", 4096, 14336, 0, 0, 0, 1)


def test_linear_mx_decode_kernel_choice(monkeypatch):
    """Where the decode gemv (bnb_gemv.cu with MX scales) runs linear_mx, which linear_mx asks before
    the kernels above (no GPU: the rule on a device reported as sm_90): NVFP4 and MXFP4 with fp16 /
    bf16 input (not fp32), K % 64 == 0, x and codes 16-byte aligned, the
    scales 4 (NVFP4) / 2 (MXFP4) bytes, two rows or more, one row from DECODE_MX_B1_MIN_BYTES of codes
    on (never MXFP4 with fp16 input; mx_gemv_dec_b1_min moves it); not on sm_80, not with mx_gemv_dec=0."""
    monkeypatch.setattr(cbnb.rt, "device_arch", lambda dev: 90)
    monkeypatch.delenv(TUNE, raising=False)

    def take(dt, fmt, n, k, px, pc, ps, rows=2):
        return cbnb.decode_gemv_mx_takes(0, dt, fmt, n, k, px, pc, ps, rows)

    assert cbnb.DECODE_MX_DTYPES == {"nvfp4": ("float16", "bfloat16"), "mxfp4": ("float16", "bfloat16")}
    for fmt, dt in (("nvfp4", "float16"), ("nvfp4", "bfloat16"), ("mxfp4", "float16"), ("mxfp4", "bfloat16")):
        assert take(dt, fmt, 4096, 14336, 0, 0, 0) and take(dt, fmt, 16, 64, 16, 32, 4, rows=40)
        # 28 MiB of codes, one row: the decode gemv, but for MXFP4 with fp16 input (never at one row)
        assert take(dt, fmt, 4096, 14336, 0, 0, 0, rows=1) == ((fmt, dt) != ("mxfp4", "float16"))
        assert not take(dt, fmt, 4096, 4096, 0, 0, 0, rows=1) and take(dt, fmt, 4096, 4096, 0, 0, 0, rows=2)
        assert not take(dt, fmt, 4096, 14336 + 32, 0, 0, 0)  # K % 64 != 0
        assert not take(dt, fmt, 4096, 14336, 8, 0, 0)  # x not 16-byte aligned
        assert not take(dt, fmt, 4096, 14336, 0, 4, 0)  # codes not 16-byte aligned
        assert not take(dt, fmt, 4096, 14336, 0, 0, 1)  # scales not 2-byte aligned
    assert take("bfloat16", "mxfp4", 64, 64, 0, 0, 2) and not take("bfloat16", "nvfp4", 64, 64, 0, 0, 2)
    assert not take("float32", "nvfp4", 4096, 14336, 0, 0, 0) and not take("float32", "mxfp4", 4096, 14336, 0, 0, 0)
    monkeypatch.setenv(TUNE, "mx_gemv_dec_b1_min=0")
    assert take("bfloat16", "nvfp4", 64, 64, 0, 0, 0, rows=1) and take("float16", "mxfp4", 64, 64, 0, 0, 0, rows=1)
    monkeypatch.setenv(TUNE, "mx_gemv_dec=0")
    assert not take("bfloat16", "nvfp4", 4096, 14336, 0, 0, 0)
    monkeypatch.delenv(TUNE)
    monkeypatch.setattr(cbnb.rt, "device_arch", lambda dev: 80)
    assert not take("bfloat16", "nvfp4", 4096, 14336, 0, 0, 0)


@needs_gpu
def test_linear_mx_graph_capture(rng):
    """linear_mx (nvfp4, bf16, batch 4) captured in a CUDA graph and replayed on new inputs: the same
    bits as eager calls."""
    torch = _torch()
    n, k = 512, 1024
    codes, scales, g, _ = _linear_case("nvfp4", rng, n, k, "bfloat16")
    cd, sd = to_dev(codes), to_dev(mx.swizzle(scales))
    gd = to_dev(np.array([g], np.float32))
    x = torch.empty((4, k), dtype=torch.bfloat16, device="cuda")
    out = torch.empty((4, n), dtype=torch.bfloat16, device="cuda")

    def step():
        cmx.linear_mx(None, x, cd, sd, out, n=n, k=k, fmt="nvfp4", swizzled=True, global_scale=gd)

    from quantcore.bench import capture_graph

    graph = capture_graph(step)
    for _ in range(2):
        x.copy_(torch.randn((4, k), device="cuda"))
        graph.replay()
        got = out.clone()
        step()
        torch.cuda.synchronize()
        assert torch.equal(got, out)


# -- host-side plans of the dequantize kernel and the panel path (no GPU needed) --------------------
def test_div_magic_divides_like_the_kernel():
    """mx_dequantize's block index -> row: (umulhi(b, mul) + b) >> shift == b // ncols for b < 2^31."""
    rng = np.random.default_rng(5)
    divisors = list(range(1, 600)) + [int(d) for d in rng.integers(1, 1 << 24, 300)] + [1 << 20, (1 << 20) + 1]
    for d in divisors:
        mul, shift = cmx.div_magic(d)
        assert 0 < mul < 1 << 32
        b = np.concatenate([rng.integers(0, 1 << 31, 200), [0, 1, d - 1, d, d + 1, (1 << 31) - 1]]).astype(np.uint64)
        got = (((b * np.uint64(mul)) >> np.uint64(32)) + b) >> np.uint64(shift)
        assert np.array_equal(got, b // np.uint64(d)), d


@pytest.mark.parametrize("fmt,dtype", [("nvfp4", "bfloat16"), ("mxfp4", "float32"), ("mxfp8", "float16")])
@pytest.mark.parametrize("rows,cols,capacity", [(300, 512, 8), (256, 256, 3), (1000, 1024, 64), (129, 96, 2),
                                                (16384, 16384, 1056), (5, 4096, 1056)])
@pytest.mark.parametrize("waves", [1, 4])
def test_dequantize_grid_scale_steps(fmt, dtype, rows, cols, capacity, waves):
    """mx_dequantize's hoisted scale addresses: where dequantize_grid returns a scale step, every
    chunk a thread takes (t, t + stride, ...) reads the scale the per-chunk swizzle formula gives;
    the grid stays within ``waves`` times the CTAs that fit at once."""
    blk = mx.block_size(fmt)
    if cols % blk:
        pytest.skip("not a whole number of blocks")
    per_chunk = 16 // (4 if dtype == "float32" else 2)
    cpb = blk // per_chunk
    ncols = cols // blk
    nchr = cols // per_chunk
    pcols = mx.swizzled_shape(rows, ncols)[1]
    trb = pcols // 4 * 512
    grid, sstep = cmx.dequantize_grid(rows * nchr, nchr, capacity, trb, waves)
    assert 1 <= grid <= max(1, capacity * waves)
    if (rows, cols, capacity) == (16384, 16384, 1056):  # the goal shape: more than one wave when asked
        assert (grid > capacity) == (waves > 1)
    if sstep == 0:
        return
    stride = grid * cmx.DQ_THREADS
    assert stride % (128 * nchr) == 0
    offs = mx.swizzle_offsets(rows, ncols).reshape(-1)  # row-major block index -> swizzled offset
    t = np.arange(min(stride, rows * nchr))
    so0 = offs[t // cpb]
    for i in range(1, -(-rows * nchr // stride)):
        q = t + i * stride
        ok = q < rows * nchr
        assert np.array_equal((so0 + i * sstep)[ok], offs[q[ok] // cpb])


@pytest.mark.parametrize("m,n,k", [(8192, 8192, 8192), (256, 8192, 8192), (16384, 16384, 16384), (65536, 8192, 8192),
                                   (300, 70000, 8192), (1000, 700, 1 << 19), (8192, 8192, 1 << 20)])
def test_panel_plan_within_workspace_bound(m, n, k):
    """The panel path's workspace (the dequantized A and B panels) stays within
    max(256 MiB, (m + n) * k * 2 / 8); panels are whole or multiples of the 128-row scale tiles."""
    plan = cmx.mm_panels(m, n, k)
    bound = cmx.mm_workspace_bytes(m, n, k)
    assert bound == max(256 << 20, (m + n) * k * 2 // 8)
    if plan is None:  # not even 128 + 128 rows of K fit
        assert 2 * 128 * 2 * k > bound
        assert cmx.mm_path(m, n, k, "auto") == "fused"
        return
    mp, np_ = plan
    assert (mp + np_) * k * 2 <= bound
    for p, full in ((mp, m), (np_, n)):
        assert 0 < p <= full and (p == full or p % 128 == 0)
    assert cmx.mm_path(m, n, k, "auto") == ("panel" if m >= cmx.MM_FUSED_MAX_M else "fused")
    assert cmx.mm_path(m, n, k, "wgmma") == "fused"
    if (m, n, k) == (8192, 8192, 8192):
        assert plan == (m, n)  # one pass: both operands whole, exactly 256 MiB
