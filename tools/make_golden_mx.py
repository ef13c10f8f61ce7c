"""Make tests/golden/mx_golden.npz with torchao's reference (CPU) for MXFP4, MXFP8 and NVFP4.

    pip install torchao   # 0.18.0 was used, with torch 2.13 CPU
    python tools/make_golden_mx.py
    python tools/make_golden_mx.py --measure   # counts on a larger input, printed (not stored)

What is stored (all raw bytes; the inputs as bit patterns):
- ``x_float32`` / ``x_bfloat16``: [64, 256] seeded inputs with row and block magnitudes spread
  over 2^-40..2^40, an all-zero 32-element block (row 0), exact E2M1 ties (row 1) and a row of
  values on the E4M3 grid (row 2);
- ``xn_float32`` / ``xn_bfloat16``: [64, 256] NVFP4 inputs (see make_input_nvfp4);
- for each input dtype: ``torchao.prototype.mx_formats.mx_tensor.to_mx`` codes and E8M0 scales
  for MXFP4 and MXFP8 in FLOOR and RCEIL modes; ``nvfp4_tensor.nvfp4_quantize`` codes and E4M3
  scales with ``per_tensor_scale = amax / 2688`` (torchao's form of the global scale); the first
  8 rows of torchao's dequantization to fp32 (``mx_tensor.to_dtype`` for MX FLOOR,
  ``NVFP4Tensor.dequantize`` for NVFP4);
- ``swz_in`` [200, 7] random bytes and torchao's ``to_blocked`` of them (the 128x4 layout with
  padding).

The comparison rules are those of docs/formats-mx.md; tests/test_mx.py applies them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

R, K = 64, 256
SEED = 20261122


def make_input(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((R, K))
    x *= np.exp2(rng.integers(-40, 41, size=(R, 1)))  # row magnitudes
    x *= np.exp2(rng.integers(-3, 4, size=(R, K // 16))).repeat(16, axis=1)  # block magnitudes
    x[0, :32] = 0.0  # an all-zero block in every format
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[1] = np.resize(np.concatenate([ties, -ties]), K) * 8.0  # E2M1 ties at scale 2^3
    e4m3_grid = np.array([1.0, 1.125, 1.0625, 1.1875, 240.0, 248.0, 464.0, 0.0078125])
    x[2] = np.resize(e4m3_grid, K) * np.exp2(-3)
    return x.astype(np.float32)


def make_input_nvfp4(rng: np.random.Generator) -> np.ndarray:
    """NVFP4 has one global scale, so its blocks must share the E4M3 range: block magnitudes
    spread over 2^-4..2^4 only, plus an all-zero block (row 0) and three blocks so small that their
    E4M3 scale is subnormal or rounds to zero (row 3: scaled amax 2^-8, 1.5 * 2^-8, 1.5 * 2^-10)."""
    x = rng.standard_normal((R, K))
    x *= np.exp2(rng.integers(-4, 5, size=(R, K // 16))).repeat(16, axis=1)
    x[0, :16] = 0.0
    amax = np.abs(x).max()
    for j, target in enumerate((2.0**-8, 2.0**-9 * 3, 2.0**-10 * 1.5)):  # E4M3 subnormal scales
        blk = x[3, 16 * j: 16 * (j + 1)]
        x[3, 16 * j: 16 * (j + 1)] = blk / np.abs(blk).max() * (amax * target / 448.0)
    return x.astype(np.float32)


def measure(rows: int = 1024, k: int = 4096) -> None:
    """Count the differences between quantcore and torchao on a larger input (not stored)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    from quantcore.arrays import BF16
    from quantcore.formats import mx

    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, k)) * np.exp2(rng.integers(-4, 5, (rows, k // 16))).repeat(16, 1)
    x = x.astype(np.float32)
    for dt in (torch.float32, torch.bfloat16):
        xt = torch.from_numpy(x).to(dt)
        xn = x if dt == torch.float32 else xt.view(torch.int16).numpy().view(BF16)
        for fmt, elem in (("mxfp4", torch.float4_e2m1fn_x2), ("mxfp8", torch.float8_e4m3fn)):
            for mode in ("floor", "rceil"):
                ts, tc = to_mx(xt, elem, 32, ScaleCalculationMode[mode.upper()])
                c, s = mx.quantize_mx(xn, fmt, mode)
                print(f"{dt} {fmt} {mode}: scale bytes differing {int((s != ts.view(torch.uint8).numpy()).sum())}"
                      f" of {s.size}, code bytes differing "
                      f"{int((c != tc.contiguous().view(torch.uint8).numpy()).sum())} of {c.size}")
        amax = xt.abs().amax().float()
        ts, tc = nvfp4_quantize(xt, 16, per_tensor_amax_to_scale(amax))
        c, s = mx.quantize_nvfp4(xn, mx.nvfp4_global_scale(float(amax)))
        ts = ts.view(torch.uint8).numpy()
        same = np.repeat(s == ts, 16, 1)
        diff = (mx.unpack_fp4(c) != mx.unpack_fp4(tc.view(torch.uint8).numpy())) & same
        print(f"{dt} nvfp4: scale bytes differing {int((s != ts).sum())} of {s.size} "
              f"(torchao's 2^-6 clamp: {int(((ts == 8) & (s < 8)).sum())}); codes differing in blocks "
              f"with equal scales {int(diff.sum())} of {int(same.sum())} ({diff.sum() / same.sum():.2e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", default=str(Path(__file__).resolve().parents[1] / "tests" / "golden"
                                               / "mx_golden.npz"))
    ap.add_argument("--measure", action="store_true",
                    help="instead: count the differences with torchao on a [1024, 4096] input")
    args = ap.parse_args()
    if args.measure:
        measure()
        return

    import torchao
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        NVFP4Tensor,
        nvfp4_quantize,
        per_tensor_amax_to_scale,
    )
    from torchao.prototype.mx_formats.utils import to_blocked

    rng = np.random.default_rng(SEED)
    x32 = make_input(rng)
    out: dict[str, np.ndarray] = {
        "torchao_version": np.array(torchao.__version__),
        "torch_version": np.array(torch.__version__),
    }
    xn32 = make_input_nvfp4(rng)
    for dname in ("float32", "bfloat16"):
        dt = torch.float32 if dname == "float32" else torch.bfloat16
        bits = torch.int32 if dname == "float32" else torch.int16
        xt = torch.from_numpy(x32).to(dt)
        out[f"x_{dname}"] = xt.view(bits).numpy()
        for fmt, elem in (("mxfp4", torch.float4_e2m1fn_x2), ("mxfp8", torch.float8_e4m3fn)):
            for mode in ("floor", "rceil"):
                scale, data = to_mx(xt, elem, 32, ScaleCalculationMode[mode.upper()])
                out[f"{fmt}_{mode}_scales_{dname}"] = scale.view(torch.uint8).numpy()
                out[f"{fmt}_{mode}_codes_{dname}"] = data.contiguous().view(torch.uint8).numpy()
                if mode == "floor":
                    deq = to_dtype(data[:8].contiguous(), scale[:8].contiguous(), elem, 32, torch.float32)
                    out[f"{fmt}_dequant_{dname}"] = deq.numpy()
        xt = torch.from_numpy(xn32).to(dt)
        out[f"xn_{dname}"] = xt.view(bits).numpy()
        amax = xt.abs().amax().to(torch.float32)
        pts = per_tensor_amax_to_scale(amax)
        scales, data = nvfp4_quantize(xt, 16, pts)
        out[f"nvfp4_amax_{dname}"] = amax.reshape(1).numpy()
        out[f"nvfp4_pts_{dname}"] = pts.reshape(1).numpy()
        out[f"nvfp4_scales_{dname}"] = scales.view(torch.uint8).numpy()
        out[f"nvfp4_codes_{dname}"] = data.view(torch.uint8).numpy()
        t = NVFP4Tensor.to_nvfp4(xt, per_tensor_scale=pts)
        assert torch.equal(t.qdata.view(torch.uint8), data.view(torch.uint8))
        out[f"nvfp4_dequant_{dname}"] = t.dequantize(torch.float32)[:8].numpy()
    swz_in = rng.integers(0, 256, size=(200, 7), dtype=np.uint8)
    out["swz_in"] = swz_in
    out["swz_out"] = to_blocked(torch.from_numpy(swz_in)).numpy()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **out)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size} bytes) with torchao {torchao.__version__}")


if __name__ == "__main__":
    main()
