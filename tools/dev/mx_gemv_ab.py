"""A/B timing of linear_mx's gemvs for docs/performance.md, in one process on one device (VARIANTS,
each a ``QUANTCORE_CUDA_TUNE`` setting): mx_gemv.cu's CUDA-core kernel (old), its tensor-core one at
every B (tc), session 20's default (prev: the CUDA-core kernel at B 1, the tensor-core one from B 2)
and today's (default: the decode gemv of bnb_gemv.cu with MX scales where it runs). Per (format, input dtype, N x K, B): the bench's single-launch kernel time (CUDA events, one
call behind a sleep kernel, weights rotated through 256 MiB) and the graph-timed time per launch (20
launches over the rotated weights in one CUDA graph; the tensor-core kernel launches as a
programmatic dependent, so launches overlap there), the bytes (codes + scale bytes + input + output)
and the percentage of the copy rate; plus the relative difference of the last variant's outputs
from the first's (||last - first|| / ||first||, seeded random codes and scales). Prints a table and one JSON line (AB_JSON).

Usage: python3 tools/dev/mx_gemv_ab.py [--shapes 4096x14336:1,8 ...] [--fmts mxfp4 nvfp4]
       [--dtypes bfloat16 float16] [--variants prev default]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from gemv_decode_ab import graph_per_launch  # this folder: the same graph timing as the NF4 gemv's A/B
from quantcore.backends.cuda import mx as cmx
from quantcore.backends.cuda.runtime import ENV_TUNE

from quantcore.bench import Bench
from quantcore.formats import mx

DEFAULT_SHAPES = ("4096x14336:1,8", "14336x4096:1,8", "8192x8192:1,4,8,16", "28672x8192:1,4,8,16")
#: old: the CUDA-core kernel at every B; tc: the tensor-core kernel at every B (B 1 included); prev:
#: the launcher's pick without the decode gemv (the CUDA-core kernel at B 1, GEMV_TC_MIN_ROWS);
#: default: what the launcher picks now
VARIANTS = {"old": "mx_gemv_tc=0,mx_gemv_dec=0", "tc": "mx_gemv_tc_rows=1,mx_gemv_dec=0", "prev": "mx_gemv_dec=0",
            "default": ""}


def weights(fmt: str, n: int, k: int, sets: int):
    """``sets`` random weights (codes, swizzled scales) on the device: scale bytes in a moderate range
    (E8M0 120..134, E4M3 0x28..0x50), every E2M1 code."""
    nbk = k // mx.block_size(fmt)
    prow, pcols = mx.swizzled_shape(n, nbk)
    lo, hi = (120, 135) if fmt == "mxfp4" else (0x28, 0x51)
    out = []
    for _ in range(sets):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        scales = torch.randint(lo, hi, (prow, pcols), dtype=torch.uint8, device="cuda")
        out.append((codes, scales))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    p.add_argument("--fmts", nargs="+", default=list(mx.FP4_FORMATS))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--variants", nargs="+", default=["prev", "default"])
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args()
    b = Bench("cuda", quick=False, reps=args.reps, verbose=False)
    b.bnb = None
    b.copy()
    copy = b.copy_gbps
    be = b.be
    res = {"device": torch.cuda.get_device_name(), "copy_gbps": copy, "rows": []}
    print(f"device {res['device']}, copy {copy:.0f} GB/s")
    print(f"{'fmt':6} {'dtype':9} {'N x K':>11} {'B':>3} {'MB':>7} " +
          " ".join(f"{v + ' us':>9} {v + ' graph':>11} {'%copy':>6}" for v in args.variants) + "  rel.diff")
    base_env = os.environ.get(ENV_TUNE, "")
    for spec in args.shapes:
        dims, _, bl = spec.partition(":")
        n, k = (int(v) for v in dims.split("x"))
        batches = [int(v) for v in bl.split(",")] if bl else [1]
        for fmt in args.fmts:
            blk = mx.block_size(fmt)
            wbytes = n * k // 2 + n * (k // blk)
            ws = weights(fmt, n, k, b.sets(wbytes))
            g = torch.tensor([3.0], dtype=torch.float32, device="cuda") if fmt == "nvfp4" else None
            for dt in args.dtypes:
                for bt in batches:
                    torch.manual_seed(n + k + bt)
                    x = (torch.randn((bt, k), device="cuda") / 4).to(getattr(torch, dt))
                    nbytes = wbytes + 2 * bt * k + 2 * bt * n
                    row = {"fmt": fmt, "dtype": dt, "n": n, "k": k, "b": bt, "bytes": nbytes}
                    outs = {}
                    line = f"{fmt:6} {dt:9} {f'{n}x{k}':>11} {bt:>3} {nbytes / 1e6:7.2f} "
                    for v in args.variants:
                        os.environ[ENV_TUNE] = ",".join(s for s in (base_env, VARIANTS[v]) if s)
                        out = torch.empty((bt, n), dtype=x.dtype, device="cuda")
                        fns = [lambda c=c, s=s, x=x, out=out, n=n, k=k, fmt=fmt, g=g: cmx.linear_mx(
                                   be, x, c, s, out, n=n, k=k, fmt=fmt, swizzled=True, global_scale=g)
                               for c, s in ws]
                        fns[0]()
                        torch.cuda.synchronize()
                        outs[v] = out.float().clone()
                        us = b.timer.kernel(fns, args.reps, warmup=max(3, len(fns)))
                        gus = graph_per_launch(b, fns)
                        pct = 100.0 * nbytes / (us * 1e3) / copy if copy else 0.0
                        row[v] = {"us": us, "graph_us": gus, "pct_copy": pct,
                                  "graph_pct_copy": 100.0 * nbytes / (gus * 1e3) / copy if copy else 0.0}
                        line += f"{us:9.1f} {gus:11.1f} {pct:6.1f} "
                    os.environ[ENV_TUNE] = base_env
                    if len(outs) > 1:
                        first, last = outs[args.variants[0]], outs[args.variants[-1]]
                        d = float((last - first).norm() / first.norm().clamp_min(1e-30))
                        row["rel_diff"] = d
                        line += f" {d:.2e}"
                    res["rows"].append(row)
                    print(line, flush=True)
            del ws
            torch.cuda.empty_cache()
    if not base_env:
        os.environ.pop(ENV_TUNE, None)
    print("AB_JSON " + json.dumps(res))


if __name__ == "__main__":
    main()
