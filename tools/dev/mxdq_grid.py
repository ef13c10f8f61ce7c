"""MX dequantize at n x n (default 16384^2) under different grids (issue 20, item 3): the launcher's
grid (`backends/cuda/mx.py` dequantize_grid) against variants, every format to bf16 (or --dtypes), swizzled and
row-major scales, each output compared bit for bit with the default grid's. CUDA events around one
call queued behind a ~1 ms sleep kernel, median (tools/cuda_mx_bench.timed); % of a 2 GiB d2d copy
of the same process.

Variants (``--variants``, comma-separated):
  default      the launcher's rule
  waves=K      the launcher's rule with K waves of CTAs (K times those that fit at once)
  flat         swizzled scales without the constant scale step: grid = every CTA that fits, each
               chunk's swizzled offset worked out on its own (the row-major grid)
  units=K      swizzled: K CTA-units of 128 rows (K * 128 rows of chunks per grid step)
  ctas=C       C CTAs (swizzled: the flat form)
"""

import argparse
import itertools
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tools/: cuda_mx_bench
from cuda_mx_bench import copy_ceiling, timed  # noqa: E402
from quantcore.backends.cuda import mx as cmx  # noqa: E402

from quantcore.formats import mx  # noqa: E402

SCALE_RANGE = {"nvfp4": (40, 60), "mxfp4": (120, 130), "mxfp8": (120, 130)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--fmts", default="nvfp4,mxfp4,mxfp8")
    ap.add_argument("--variants", default="default,flat")
    ap.add_argument("--dtypes", default="bfloat16", help="output dtypes: bfloat16, float16, float32")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(0), torch.__version__)
    t, copy = copy_ceiling(args.reps)
    print(f"copy 2 GiB d2d: {t:.4f} ms {copy:.0f} GB/s")

    rule = cmx.dequantize_grid
    seen = []

    def grid_of(variant):
        def g(nchunks, chunks_per_row, capacity, tile_row_bytes, waves=1):
            if variant == "default":
                r = rule(nchunks, chunks_per_row, capacity, tile_row_bytes, waves)
            elif variant.startswith("waves="):
                r = rule(nchunks, chunks_per_row, capacity, tile_row_bytes, int(variant.split("=")[1]))
            elif variant == "flat":
                r = rule(nchunks, chunks_per_row, capacity, 0)
            elif variant.startswith("units="):
                k = int(variant.split("=")[1])
                unit = mx.SWIZZLE_ROWS * chunks_per_row // cmx.DQ_THREADS
                r = (k * unit, k * tile_row_bytes) if tile_row_bytes else rule(nchunks, chunks_per_row, capacity, 0)
            elif variant.startswith("ctas="):
                r = (int(variant.split("=")[1]), 0)
            else:
                raise SystemExit(f"unknown variant {variant}")
            seen.append((capacity, r))
            return r
        return g

    n = args.n
    print("fmt layout variant capacity grid sstep ms GB/s %copy same")
    for fmt, dt, swz in itertools.product(args.fmts.split(","), args.dtypes.split(","), (True, False)):
        blk = mx.block_size(fmt)
        codes = torch.randint(0, 256, (n, mx.codes_cols(fmt, n)), dtype=torch.uint8, device=dev)
        shape = mx.swizzled_shape(n, n // blk) if swz else (n, n // blk)
        scales = torch.randint(*SCALE_RANGE[fmt], shape, dtype=torch.uint8, device=dev)
        g = torch.tensor([0.37], dtype=torch.float32, device=dev) if fmt == "nvfp4" else None
        ref = None
        dtype = getattr(torch, dt)
        nbytes = codes.numel() + scales.numel() + n * n * dtype.itemsize
        for v in args.variants.split(","):
            if not swz and (v == "flat" or v.startswith("units=")):
                continue
            cmx.dequantize_grid = grid_of(v)
            out = torch.empty((n, n), dtype=dtype, device=dev)
            seen.clear()
            t = timed(lambda o=out, c=codes, s=scales, f=fmt, w=swz, g=g: cmx.mx_dequantize(
                None, c, s, o, rows=n, cols=n, fmt=f, swizzled=w, global_scale=g), args.reps)
            cap, (grid, sstep) = seen[-1]
            if ref is None:
                ref, same = out, "ref"
            else:
                same = "bit-equal" if torch.equal(ref.view(torch.uint8), out.view(torch.uint8)) else "MISMATCH"
            lay = ("swizzled" if swz else "row-major") + " " + dt
            print(f"{fmt} {lay} {v} {cap} {grid} {sstep} {t:.4f} {nbytes / t / 1e6:.0f} "
                  f"{100 * nbytes / t / 1e6 / copy:.1f} {same}", flush=True)
        cmx.dequantize_grid = rule
        del codes, scales, ref


if __name__ == "__main__":
    main()
