"""Both mx_quantize kernels of kernels_cuda/mx_quant.cu, bit for bit against quantcore.formats.mx.

Version 2 (cp.async-staged tiles, persistent grid, packed bf16x2 MXFP4 path; its band layout
for NVFP4 and pair layout for MXFP8) and version 1 (one thread per block) stay selectable through
``QUANTCORE_CUDA_TUNE`` (``mx_quant_v``, ``mx_quant_layout``, ``mx_quant_sst``, ``mx_quant_bf16x2``,
``mx_quant_ctas``: the last variant also runs a grid of one CTA per SM, so each CTA walks many
tiles, and stores NVFP4 scales a byte at a time); each variant runs the conformance
family's adversarial inputs plus shapes that reach every branch of the launcher and kernel:
partial last tiles, a block count per row that is not a power of two (the division path), an odd
NVFP4 block count (falls back to version 1), swizzled padding, wide-range blocks outside the
bf16x2 path's exponent window, NaN / Inf / signed zeros, and a negative or zero global scale.

GPU only (skipped with the reason elsewhere); run on the GPU machine with the same pytest command.
"""

from __future__ import annotations

import numpy as np
import pytest
from quantcore.backends.cuda import mx as cmx

from quantcore.formats import mx
from tests.cuda_arrays import TUNE
from tests.test_cuda_mx import GPU_REASON, _assert_bits, empty_dev, to_dev, to_host

#: the MX conformance family's input kinds (quantcore.conformance.families.mx.quantize_input)
KINDS = ("random", "partial-tiles", "one-block", "zero-blocks", "ties", "scale-boundaries", "nonfinite",
         "subnormal", "huge")
needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=f"needs an NVIDIA GPU: {GPU_REASON}")

VARIANTS = {
    "v1": "mx_quant_v=1",
    "v2": "mx_quant_v=2",  # band layout for NVFP4 (swizzled, 4k blocks per row), 2-byte NVFP4 scale stores
    "v2-flat": "mx_quant_v=2,mx_quant_layout=0",
    "v2-pair": "mx_quant_v=2,mx_quant_layout=2",  # MXFP8 pair layout (opt-in)
    "v2-fp32-path": "mx_quant_v=2,mx_quant_layout=0,mx_quant_bf16x2=0,mx_quant_ctas=1,mx_quant_sst=0",
}
#: kernel the variant must have launched at least once (layouts chosen by the launcher)
WANT = {("v2", "nvfp4"): "qc_mx_quantize2b_", ("v2-pair", "mxfp8"): "qc_mx_quantize2p_"}
FMTS = ("mxfp4", "mxfp8", "nvfp4")
DTYPES = ("bfloat16", "float16", "float32")


def _run(x: np.ndarray, fmt: str, mode: str | None, swizzled: bool, g, names: list[str]):
    rows, k = x.shape
    blk = mx.block_size(fmt)
    codes = empty_dev((rows, mx.codes_cols(fmt, k)), np.uint8)
    sshape = mx.swizzled_shape(rows, k // blk) if swizzled else (rows, k // blk)
    scales = empty_dev(sshape, np.uint8)
    gd = to_dev(np.array([g], np.float32)) if fmt == "nvfp4" else None
    cmx.mx_quantize(None, to_dev(x), codes, scales, rows=rows, cols=k, fmt=fmt, scale_mode=mode,
                    swizzled=swizzled, global_scale=gd)
    c, s = mx.quantize(x.astype(np.float32) if x.dtype != np.float32 else x, fmt, scale_mode=mode or "floor",
                       global_scale=g)
    what = f"{fmt} {x.dtype} {x.shape} mode={mode} swizzled={swz_name(swizzled)} g={g} kernels={names[-1:]}"
    _assert_bits(to_host(codes), c, what + " codes")
    _assert_bits(to_host(scales), mx.swizzle(s) if swizzled else s, what + " scales")


def swz_name(s: bool) -> str:
    return "yes" if s else "no"


def _extra_inputs(fmt: str, rng: np.random.Generator) -> list[np.ndarray]:
    blk = mx.block_size(fmt)
    xs = []
    # 1000 units: a partial last tile of 256; 125 blocks per row (MX) / 250 (NVFP4): not a power of two
    x = rng.standard_normal((8, 4000)) * np.exp2(rng.uniform(-30, 30, (8, 1)))
    xs.append(x)
    # blocks whose scales leave the bf16x2 window (byte < 8 or > 245) next to ordinary ones
    x = rng.standard_normal((4, 8 * blk))
    x[0, :blk] *= 2.0**-125
    x[1, blk:2 * blk] *= 2.0**-140
    x[2, 2 * blk:3 * blk] *= 2.0**120
    x[3, 3 * blk:4 * blk] *= 2.0**126
    xs.append(x)
    # signed zeros, infinities, NaN of both signs, subnormals, inside otherwise normal blocks
    x = rng.standard_normal((130, 2 * blk))
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, 80, replace=False)
    flat[idx[:10]] = -0.0
    flat[idx[10:20]] = 0.0
    flat[idx[20:30]] = np.inf
    flat[idx[30:40]] = -np.inf
    flat[idx[40:50]] = np.nan
    flat[idx[50:60]] = -np.nan
    flat[idx[60:80]] = rng.uniform(-1, 1, 20) * 1e-41
    xs.append(x)
    # an odd number of NVFP4 blocks in total (version 2 needs whole 32-element units)
    xs.append(rng.standard_normal((3, blk)))
    # NVFP4 band layout: 20 blocks per row (a multiple of 4, not a power of two), a partial band
    # of 200 rows; 16 blocks per row (the shift path) with 130 rows and wide-range rows
    xs.append(rng.standard_normal((200, 20 * 16)) * np.exp2(rng.uniform(-20, 20, (200, 1))))
    xs.append(rng.standard_normal((130, 16 * 16)) * np.exp2(rng.uniform(-20, 20, (130, 1))))
    return xs


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    from quantcore.arrays import BF16

    T = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}[dtype]
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(np.float32).astype(T)


@needs_gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_versions_bit_exact(variant, fmt, dtype, rng, monkeypatch):
    from quantcore.conformance.families.mx import _global_scale, quantize_input

    monkeypatch.setenv(TUNE, VARIANTS[variant])
    names: list[str] = []
    real_function = cmx.function

    def spy(dev, source, arch, name, smem=0):
        names.append(name)
        return real_function(dev, source, arch, name, smem)

    monkeypatch.setattr(cmx, "function", spy)
    modes = (None,) if fmt == "nvfp4" else ("floor", "rceil")
    inputs = [quantize_input(kind, fmt, rng, dtype) for kind in KINDS]
    inputs = [x.reshape(-1, x.shape[-1]) for x in inputs]
    inputs += [_cast(x, dtype) for x in _extra_inputs(fmt, rng)]
    for x in inputs:
        gs = [None]
        if fmt == "nvfp4":
            g0 = _global_scale(x)
            gs = [g0, np.float32(1.0), np.float32(-g0) if np.isfinite(g0) else np.float32(-1.0), np.float32(0.0)]
        for g in gs:
            for mode in modes:
                for swz in (False, True):
                    _run(x, fmt, mode, swz, g, names)
    want = "qc_mx_quantize_" if variant == "v1" else WANT.get((variant, fmt), "qc_mx_quantize2_")
    assert any(n.startswith(want) for n in names), names
