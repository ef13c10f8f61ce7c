"""gemv_4bit at decode shapes in CUDA graphs: kernel configurations side by side (GPU machine).

    python3 tools/dev/decode_time.py [--tunes "" "gemv_kernel=2"] [--batches 1 4 8 16] [--step]

Each row: one op call replayed in a CUDA graph of 20 calls over rotating weights (> 200 MB per
pass, so L2 holds none of them), the median of 7 graph replays / 20; GB/s on the 4-bit bytes
(packed + nested statistics + input + output) and % of the device's copy bandwidth (measured in
the same run). ``--step`` adds the decode step: the seven Llama-3-8B linears x 32 layers in one
graph. torch bf16 F.linear on the same shapes beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from quantcore import api
from quantcore.backend import Nested
from quantcore.registry import get_backend

LLAMA8B = [("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
           ("gate", 14336, 4096), ("up", 14336, 4096), ("down", 4096, 14336)]
SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (1024, 8192),
          (28672, 8192), (8192, 28672)]


def nested(s):
    return Nested(absmax2=s.state2.absmax, code2=s.state2.code, offset=s.offset) if s.state2 is not None else None


def graph_time(fn, reps=7) -> float:
    """us per fn() call: fn is captured once (it makes 20 calls), replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = graph_time(lambda: [y.copy_(x) for _ in range(4)]) / 4
    return 2 * x.numel() / t / 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tunes", nargs="*", default=["", "gemv_kernel=2"])
    p.add_argument("--batches", nargs="*", type=int, default=[1, 4, 8, 16])
    p.add_argument("--shapes", default="all")
    p.add_argument("--step", action="store_true")
    p.add_argument("--qt", default="nf4")
    args = p.parse_args()
    be = get_backend("cuda")
    torch.manual_seed(0)
    copy = copy_gbps()
    print(f"device {torch.cuda.get_device_name()}  copy {copy:.0f} GB/s")
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    print(f"{'shape':>14} {'B':>3} " + " ".join(f"{(t or 'default'):>22}" for t in args.tunes) + f" {'torch bf16':>16}")
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed, st = api.quantize_4bit(w, 64, args.qt, True, backend=be)
        nbytes4 = packed.numel() + st.absmax.numel() + 4 * st.state2.absmax.numel()
        copies = max(1, min(20, (200 << 20) // nbytes4 + 1))
        ps = [packed.clone() for _ in range(copies)]
        wb = [w] + [w.clone() for _ in range(max(0, min(20, (200 << 20) // (2 * n * k) + 1) - 1))]
        for b in args.batches:
            a = torch.randn(b, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(b, n, device="cuda", dtype=torch.bfloat16)
            nbytes = nbytes4 + 2 * b * (n + k)
            cells = []
            ref = None
            for tune in args.tunes:
                os.environ["QUANTCORE_CUDA_TUNE"] = tune
                fn = lambda: [be.gemv_4bit(a, ps[i % len(ps)], st.absmax, out, n=n, k=k, blocksize=64,  # noqa: E731
                                           quant_type=args.qt, nested=nested(st)) for i in range(20)]
                t = graph_time(fn) / 20
                be.gemv_4bit(a, packed, st.absmax, out, n=n, k=k, blocksize=64, quant_type=args.qt, nested=nested(st))
                torch.cuda.synchronize()
                got = out.float().clone()
                if ref is None:
                    ref = got
                    diff = ""
                else:
                    diff = f" d{(got - ref).abs().max().item():.1e}"
                cells.append(f"{t:7.2f}us {100 * nbytes / t / 1e3 / copy:4.1f}%{diff}")
            os.environ["QUANTCORE_CUDA_TUNE"] = ""
            tt = graph_time(lambda: [torch.nn.functional.linear(a, wb[i % len(wb)]) for i in range(20)]) / 20
            print(f"{n:>6}x{k:<7} {b:>3} " + " ".join(f"{c:>22}" for c in cells) + f" {tt:8.2f}us {tt / t:4.2f}x", flush=True)
        del ps, wb, w
        torch.cuda.empty_cache()
    if args.step:
        for b in args.batches:
            layers = []
            for _ in range(32):
                layer = []
                for _name, n, k in LLAMA8B:
                    layer.append((n, k))
                layers.append(layer)
            weights = {}
            for _name, n, k in LLAMA8B:
                if (n, k) not in weights:
                    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                    weights[(n, k)] = api.quantize_4bit(w, 64, args.qt, True, backend=be)
            packs = [[(weights[(n, k)][0].clone(), weights[(n, k)][1], n, k) for (n, k) in layer] for layer in layers]
            ins = {k: torch.randn(b, k, device="cuda", dtype=torch.bfloat16) for k in (4096, 14336)}
            outs = {n: torch.empty(b, n, device="cuda", dtype=torch.bfloat16) for n in (4096, 1024, 14336)}
            nbytes = sum(p.numel() + s.absmax.numel() + 4 * s.state2.absmax.numel() for layer in packs for p, s, _, _ in layer)
            cells = []
            # grouped: q/k/v and gate/up as one launch each (the layer's 7 linears in 4 launches)
            gins = {k: ins[k] for k in ins}
            gouts = {6144: torch.empty(b, 6144, device="cuda", dtype=torch.bfloat16),
                     28672: torch.empty(b, 28672, device="cuda", dtype=torch.bfloat16)}

            def gstep():
                for layer in packs:
                    (pq, sq, _, _), (pk, sk, _, _), (pv, sv, _, _), o, (pg, sg, _, _), (pu, su, _, _), d = layer
                    be.gemv_4bit_grouped(gins[4096], [(pq, sq.absmax, nested(sq), 4096, 64, args.qt),
                                                      (pk, sk.absmax, nested(sk), 1024, 64, args.qt),
                                                      (pv, sv.absmax, nested(sv), 1024, 64, args.qt)],
                                         gouts[6144], k=4096)
                    for p, s, n, k in (o,):
                        be.gemv_4bit(ins[k], p, s.absmax, outs[n], n=n, k=k, blocksize=64, quant_type=args.qt,
                                     nested=nested(s))
                    be.gemv_4bit_grouped(gins[4096], [(pg, sg.absmax, nested(sg), 14336, 64, args.qt),
                                                      (pu, su.absmax, nested(su), 14336, 64, args.qt)],
                                         gouts[28672], k=4096)
                    p, s, n, k = d
                    be.gemv_4bit(ins[k], p, s.absmax, outs[n], n=n, k=k, blocksize=64, quant_type=args.qt,
                                 nested=nested(s))
            tg = graph_time(gstep, reps=5)
            cells.append(f"grouped {tg / 1e3:6.3f}ms {100 * nbytes / tg / 1e3 / copy:4.1f}%")
            for tune in args.tunes:
                os.environ["QUANTCORE_CUDA_TUNE"] = tune

                def step():
                    for layer in packs:
                        for p, s, n, k in layer:
                            be.gemv_4bit(ins[k], p, s.absmax, outs[n], n=n, k=k, blocksize=64, quant_type=args.qt,
                                         nested=nested(s))
                t = graph_time(step, reps=5)
                cells.append(f"{t / 1e3:6.3f}ms {100 * nbytes / t / 1e3 / copy:4.1f}%")
            os.environ["QUANTCORE_CUDA_TUNE"] = ""
            del packs
            wsb = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _name, n, k in LLAMA8B] for _ in range(32)]

            def tstep():
                for layer in wsb:
                    for w in layer:
                        torch.nn.functional.linear(ins[w.shape[1]], w)
            tt = graph_time(tstep, reps=5)
            del wsb
            torch.cuda.empty_cache()
            print(f"decode step B{b}: " + "  ".join(cells) + f"  torch bf16 {tt / 1e3:.3f}ms ({tt / t:.2f}x of the last)",
                  flush=True)


if __name__ == "__main__":
    main()
