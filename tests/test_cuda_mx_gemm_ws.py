"""The warp-specialized persistent scaled_fp4_mm kernel (GemmWS in kernels_cuda/mx_gemm.cu,
``mode="ws"`` / ``QUANTCORE_CUDA_MX_GEMM=ws``).

CPU-safe part (CI): the sm_90a build has the four entry points, no local-memory spills, no
serialized wgmma pipeline, and setmaxnreg is honoured (ptxas warns C7508 when it ignores it); the
launcher's shared-memory size is the kernel's (a static_assert under -DQCMX_EXPECT_WS_SMEM).

GPU part (compute capability 9.0; skipped with the reason elsewhere): results within the fp64
bound of the conformance family on the same shapes as the first wgmma kernel, BIT-IDENTICAL to that
kernel (same bf16 operands, same wgmma sequence per tile, same epilogue), also when the grid is
capped so that every CTA walks several tiles (the mbarrier rings then run on across tiles, with
an odd number of 64-element steps per tile and with K below one stage), NaN scales and garbage
scale padding, and the kernel's reported shared memory.
"""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
from quantcore.backends.cuda import mx as cmx

from quantcore.arrays import BF16
from quantcore.formats import kernel_defines, mx
from tests.cuda_arrays import TUNE
from tests.test_cuda_mx import GPU_REASON, KDIR, NVCC, _operand, _torch, empty_dev, to_dev, to_host

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA sources are compile-checked "
                                                     "with nvcc where it is installed")


def _sm90_reason() -> str | None:
    if GPU_REASON is not None:
        return GPU_REASON
    major, minor = cmx.compute_capability(_torch().cuda.current_device())
    if (major, minor) != (9, 0):
        return f"the ws back end needs compute capability 9.0 (wgmma, setmaxnreg), this GPU has {major}.{minor}"
    return None


SM90_REASON = _sm90_reason()
needs_sm90 = pytest.mark.skipif(SM90_REASON is not None, reason=f"needs an H100/H200-class GPU: {SM90_REASON}")


@needs_nvcc
def test_ws_builds_without_spills(tmp_path):
    kernel_defines.write_header(tmp_path)
    cmd = [NVCC, "-std=c++17", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-ftz=false", "--fmad=false",
           "-prec-div=true", f"-I{tmp_path}", f"-DQCMX_EXPECT_SMEM={cmx.GEMM_SMEM_BYTES}",
           f"-DQCMX_EXPECT_WS_SMEM={cmx.GEMM_WS_SMEM_BYTES}", "-Xptxas", "-v", str(KDIR / cmx.GEMM_SOURCE),
           "-o", str(tmp_path / "k.cubin")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(cmd)}\n{log}"
    parts = re.split(r"Compiling entry function '([^']+)'", log)
    ents = {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    for fmt in mx.FP4_FORMATS:
        for cpw in (16, 4):
            name = cmx.gemm_kernel_name(fmt, True, cpw, ws=True)
            assert name in ents, sorted(ents)
            assert "0 bytes spill stores" in ents[name], (name, ents[name])
    assert "serialized" not in log, log  # C7513: ptxas could not keep the wgmma pipeline asynchronous
    assert "C7508" not in log and "setmaxnreg" not in log.lower(), log  # setmaxnreg ignored


def test_ws_smem_fits():
    assert cmx.GEMM_WS_SMEM_BYTES <= 227 * 1024
    assert "QCMX_EXPECT_WS_SMEM" in (KDIR / cmx.GEMM_SOURCE).read_text()


# -- GPU ----------------------------------------------------------------------------------------------
def _mm(fmt, a, b, sa, sb, alpha, bias, mode):
    m, n, k = a.shape[0], b.shape[0], 2 * a.shape[1]
    out = empty_dev((m, n), BF16)
    cmx.scaled_fp4_mm(None, to_dev(a), to_dev(b), to_dev(sa), to_dev(sb), to_dev(np.array([alpha], np.float32)),
                      None if bias is None else to_dev(bias), out, m=m, n=n, k=k, fmt=fmt, mode=mode)
    return to_host(out)


#: (m, n, k, CTAs): 0 = one CTA per SM (the default grid); N > 0 caps the grid so CTAs walk tiles
WS_SHAPES = {
    "nvfp4": [(1, 1, 64, 0), (33, 17, 128, 0), (130, 70, 192, 0), (300, 136, 96, 0), (257, 129, 1040, 0),
              (7, 300, 16, 0), (512, 384, 2048, 0), (600, 400, 1040, 5), (700, 300, 16, 3), (520, 260, 2048, 2),
              (1024, 1024, 448, 7)],
    "mxfp4": [(1, 1, 64, 0), (33, 17, 128, 0), (130, 70, 192, 0), (300, 136, 96, 0), (257, 129, 1056, 0),
              (7, 300, 32, 0), (512, 384, 2048, 0), (600, 400, 1056, 5), (700, 300, 32, 3), (520, 260, 2048, 2),
              (1024, 1024, 448, 7)],
}


@needs_sm90
@pytest.mark.parametrize("fmt", mx.FP4_FORMATS)
def test_ws_within_bound_and_same_bits_as_wgmma(fmt, rng, monkeypatch):
    from quantcore.conformance.families.mx import mm_bound

    for (m, n, k, ctas) in WS_SHAPES[fmt]:
        monkeypatch.setenv(TUNE, f"mx_gemm_ctas={ctas}")
        for with_bias, random_codes in ((False, False), (True, True)):
            a, sa, ga = _operand(fmt, rng, m, k, random_codes)
            b, sb, gb = _operand(fmt, rng, n, k, random_codes)
            alpha = np.float32(1.0) / (ga * gb) if fmt == "nvfp4" else np.float32(rng.uniform(0.5, 2))
            bias = rng.standard_normal(n).astype(BF16) if with_bias else None
            what = f"{fmt} m={m} n={n} k={k} ctas={ctas} bias={with_bias} random_codes={random_codes}"
            got = _mm(fmt, a, b, sa, sb, alpha, bias, "ws")
            ref_bits = _mm(fmt, a, b, sa, sb, alpha, bias, "wgmma")
            diff = np.flatnonzero(got.view(np.uint16) != ref_bits.view(np.uint16))
            assert diff.size == 0, f"{what}: {diff.size} elements differ from the wgmma kernel, first {diff[0]}"
            A, B = mx.fp4_operand(a, sa, fmt), mx.fp4_operand(b, sb, fmt)
            ref, bound = mm_bound(A, B, float(alpha), None if bias is None else bias.astype(np.float64))
            g64 = got.astype(np.float64)
            assert np.isfinite(g64).all(), what
            err = np.abs(g64 - ref)
            worst = float(np.max(err / np.maximum(bound.max_abs, 1e-300)))
            assert worst <= 1.0, f"{what}: error {worst:.3g} x the bound"
            nmse = float(np.sum(err**2) / max(np.sum(ref**2), 1e-300))
            assert nmse <= bound.nmse, f"{what}: NMSE {nmse:.3g} > {bound.nmse:.3g}"


@needs_sm90
@pytest.mark.parametrize("fmt", mx.FP4_FORMATS)
def test_ws_nan_scale_and_garbage_padding(fmt, rng, monkeypatch):
    monkeypatch.setenv(TUNE, "mx_gemm_ctas=1")  # one CTA walks both tiles
    m, n, k = 300, 150, 16 * 37 if fmt == "nvfp4" else 32 * 37  # 37 blocks: 3 padding columns
    a, sa, ga = _operand(fmt, rng, m, k, False)
    b, sb, gb = _operand(fmt, rng, n, k, False)
    nkb = k // mx.block_size(fmt)
    alpha = np.float32(1.0) if fmt == "mxfp4" else np.float32(1.0) / (ga * gb)
    for s_, rows in ((sa, m), (sb, n)):
        flat = s_.reshape(-1)
        pad = np.ones(flat.size, bool)
        pad[mx.swizzle_offsets(rows, nkb).reshape(-1)] = False
        flat[pad] = 0xFF
    A, B = mx.fp4_operand(a, sa, fmt), mx.fp4_operand(b, sb, fmt)
    ref = float(alpha) * (A @ B.T)
    got = _mm(fmt, a, b, sa, sb, alpha, None, "ws").astype(np.float64)
    assert np.isfinite(got).all()
    assert np.max(np.abs(got - ref)) <= 0.02 * np.max(np.abs(ref))
    sa2 = sa.copy()
    sa2.reshape(-1)[mx.swizzle_offsets(m, nkb)[261, 3]] = 0x7F if fmt == "nvfp4" else 0xFF  # second row tile
    got2 = _mm(fmt, a, b, sa2, sb, alpha, None, "ws").astype(np.float64)
    assert np.isnan(got2[261]).all()
    assert np.isfinite(np.delete(got2, 261, axis=0)).all()


@needs_sm90
def test_ws_smem_constant_is_the_kernels():
    torch = _torch()
    dev = torch.cuda.current_device()
    fn = cmx.function(dev, cmx.GEMM_SOURCE, "sm_90a", "qc_mx_gemm_ws_smem_bytes")
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    cmx.rt.Launcher(out).run(fn, "qc_mx_gemm_ws_smem_bytes", (1, 1, 1), (1, 1, 1), (np.uint64(out.data_ptr()),))
    assert int(out.item()) == cmx.GEMM_WS_SMEM_BYTES
