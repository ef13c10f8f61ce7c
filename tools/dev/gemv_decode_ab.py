"""A/B timing of the decode gemv (gemv_4bit, NF4 blocksize 64, double quantization, bf16 input) for
docs/performance.md: run it once per checkout on the same device (PYTHONPATH picks the checkout) and
compare the lines. Per shape (batch 1 unless given): the bench's single-launch kernel time (one
call behind a sleep kernel, rotated weights) and the graph-timed time per launch (20 launches over
rotated weights in one CUDA graph, programmatic dependent launches overlapping); the decode step
(Llama-3-8B linears x 32, q/k/v and gate/up grouped, one CUDA graph) as in `quantcore bench`; the
copy ceiling of the bench. For each shape also the output's bit checksum on seeded data (equal
between two versions whose arithmetic is the same) and its error against dequantize + fp32 matmul.
Prints a table and one JSON line (prefix AB_JSON).

With ``--fit`` it also fits the graph-timed times of batch 1 to ``fixed + bytes / rate`` (least
squares over the shapes): the launch's fixed cost and its streaming rate, the two numbers that decide
how well small shapes (tensor-parallel shards) do.

Usage: python3 tools/dev/gemv_decode_ab.py LABEL [--batches 1 8] [--step-batches 1 8]
       python3 tools/dev/gemv_decode_ab.py LABEL --shapes 5120x8192 28672x8192 8192x4096 8192x14336 --fit
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from quantcore import api
from quantcore.bench import Bench, _nested, _nested_bytes

SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (1024, 8192), (28672, 8192),
          (8192, 28672))


def graph_per_launch(b: Bench, fns, launches: int = 20) -> float:
    def seq():
        for i in range(launches):
            fns[i % len(fns)]()

    return b.graph_us(seq, reps=7) / launches


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("label")
    p.add_argument("--batches", nargs="+", type=int, default=[1])
    p.add_argument("--step-batches", nargs="*", type=int, default=[1, 8])
    p.add_argument("--big-batches", nargs="*", type=int, default=[8], help="extra batches for the >= 30 MB shapes")
    p.add_argument("--shapes", nargs="+", metavar="NxK", help="these weight shapes instead of Llama-3's")
    p.add_argument("--fit", action="store_true", help="fit batch 1's graph times to fixed + bytes / rate")
    args = p.parse_args()
    shapes = SHAPES if not args.shapes else tuple(tuple(int(v) for v in t.lower().split("x")) for t in args.shapes)
    b = Bench("cuda", quick=False, reps=60, verbose=False)
    b.bnb = None
    t0 = time.time()
    b.copy()
    copy = b.copy_gbps
    res = {"label": args.label, "device": torch.cuda.get_device_name(), "copy_gbps": copy, "shapes": [], "step": []}
    be, qt, bs = b.be, "nf4", 64
    cases = [(bt, n, k) for n, k in shapes for bt in args.batches]
    cases += [(bt, n, k) for n, k in shapes if n * k // 2 >= 30e6 for bt in args.big_batches if bt not in args.batches]
    for bt, n, k in cases:
        torch.manual_seed(n * 7 + k * 3 + bt)
        nbytes, ws, qs, a = b._nf4_case(bt, n, k, qt, bs)
        del ws
        out = torch.empty((bt, n), dtype=torch.bfloat16, device="cuda")
        fns = [lambda p=p, s=s, a=a, out=out, n=n, k=k: be.gemv_4bit(a, p, s.absmax, out, n=n, k=k, blocksize=bs,
                                                                     quant_type=qt, nested=_nested(s))
               for p, s in qs]
        single = b.timer.kernel(fns, 60, warmup=max(3, len(fns)))
        graph = graph_per_launch(b, fns)
        out.fill_(float("nan"))
        fns[0]()
        p0, s0 = qs[0]
        ref = a.float() @ api.dequantize_4bit(p0, s0, backend=be).float().t()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        chk = int(out.view(torch.int16).to(torch.int64).sum().item()) if not out.isnan().any() else -1
        res["shapes"].append({"b": bt, "n": n, "k": k, "bytes": nbytes, "single_us": single, "graph_us": graph,
                              "err": err, "checksum": chk,
                              "single_pct": 100 * nbytes / (single * 1e-6) / 1e9 / copy,
                              "graph_pct": 100 * nbytes / (graph * 1e-6) / 1e9 / copy})
        del qs, fns
        torch.cuda.empty_cache()
    layers, hid, inter = 32, 4096, 14336
    names = ((4096, hid), (1024, hid), (1024, hid), (hid, 4096), (inter, hid), (inter, hid), (hid, inter))
    base = {}
    for n, k in names:
        if (n, k) not in base:
            base[(n, k)] = api.quantize_4bit(b.rand((n, k), "bfloat16", 0.02), bs, qt, True, backend=be)
    w4 = [[(base[(n, k)][0].clone(), base[(n, k)][1], n, k) for n, k in names] for _ in range(layers)]
    for bt in args.step_batches:
        x = {k: b.rand((bt, k), "bfloat16") for k in (hid, inter)}
        outs = {n: torch.empty((bt, n), dtype=torch.bfloat16, device="cuda") for n in (4096, 1024, inter)}
        gout = {n: torch.empty((bt, n), dtype=torch.bfloat16, device="cuda") for n in (6144, 2 * inter)}
        io = 2 * bt * sum(n + k for n, k in names) * layers
        nbytes = sum(p.numel() + _nested_bytes(n * k, bs) for layer in w4 for p, _, n, k in layer) + io

        def one(p, st, n, k, x=x, outs=outs):
            be.gemv_4bit(x[k], p, st.absmax, outs[n], n=n, k=k, blocksize=bs, quant_type=qt, nested=_nested(st))

        def grp(members, k, out, x=x):
            be.gemv_4bit_grouped(x[k], [(p, st.absmax, _nested(st), n, bs, qt) for p, st, n, _ in members], out, k=k)

        def step(gout=gout):
            for q, kk, v, o, g, u, d in w4:
                grp((q, kk, v), hid, gout[6144])
                one(*o)
                grp((g, u), hid, gout[2 * inter])
                one(*d)

        us = b.graph_us(step, reps=7)
        res["step"].append({"b": bt, "bytes": nbytes, "us": us, "pct": 100 * nbytes / (us * 1e-6) / 1e9 / copy})
    print(f"{args.label}: {res['device']}, copy {copy:.0f} GB/s, {time.time() - t0:.0f} s")
    for r in res["shapes"]:
        print(f"{args.label} B{r['b']:<2d} {r['n']:>5d}x{r['k']:<5d} single {r['single_us']:7.1f} us "
              f"({r['single_pct']:4.1f}%)  graph {r['graph_us']:7.1f} us ({r['graph_pct']:4.1f}%)  "
              f"err {r['err']:.2e} sum {r['checksum']}")
    for r in res["step"]:
        print(f"{args.label} step B{r['b']:<2d} {r['us'] / 1e3:.3f} ms ({r['pct']:4.1f}% of copy)")
    if args.fit:
        res["fit"] = fit_fixed_rate([(r["bytes"], r["graph_us"]) for r in res["shapes"] if r["b"] == 1])
        if res["fit"]:
            f = res["fit"]
            print(f"{args.label} fit (B1, graph): {f['fixed_us']:.2f} us + bytes / {f['rate_gbps']:.0f} GB/s "
                  f"({100 * f['rate_gbps'] / copy:.0f}% of copy), worst residual {f['worst_residual_us']:.2f} us")
    print("AB_JSON " + json.dumps(res))


def fit_fixed_rate(points: list[tuple[float, float]]) -> dict | None:
    """Least-squares ``us = fixed + bytes / rate`` over (bytes, us) points (None under two sizes)."""
    if len({b for b, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    slope = sum((b - mx) * (t - my) for b, t in points) / sum((b - mx) ** 2 for b, _ in points)
    fixed = my - slope * mx
    worst = max(abs(t - (fixed + slope * b)) for b, t in points)
    return {"fixed_us": fixed, "rate_gbps": 1e-3 / slope if slope > 0 else float("inf"),
            "worst_residual_us": worst, "points": n}


if __name__ == "__main__":
    main()
