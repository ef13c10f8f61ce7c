"""Eager prefill of one Llama-3-8B layer's linears on the GPU machine: wall time and GPU time per layer
for torch bf16 F.linear, quantcore.nn.Linear4bit under linear_4bit's path rule and under a variant of
it (QUANTCORE_CUDA_TUNE settings, one process, taken in turn), and bitsandbytes' Linear4bit.

The seven linears (q, k, v, o, gate, up, down) run back to back under no_grad on one input of ROWS rows,
as a transformers forward calls them (without the attention and norms between). `wall` is the host's
view of an eager forward: 20 layers queued back to back, synchronized at the end, per layer, median of
7 rounds (max(host, GPU) per call, as eager prefill sees it); `gpu` is the GPU's time per layer (CUDA
events around 20 layers queued behind a sleep kernel: no host gap timed). Per shape, the same two
figures per call.

    python3 tools/dev/eager_layer_wall.py [--rows 256,512] [--rules ";gw_min_weight=0"] [--per-shape]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from quantcore.backends import cuda
from quantcore.backends.cuda import runtime as rt

import quantcore.nn as qnn
from quantcore.bench import CudaTimer

LAYER = (("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096), ("gate", 14336, 4096),
         ("up", 14336, 4096), ("down", 4096, 14336))


def set_rule(spec: str) -> None:
    """QUANTCORE_CUDA_TUNE = spec (unset for ""), and linear_4bit's device rule read again."""
    if spec:
        os.environ[rt.ENV_TUNE] = spec
    else:
        os.environ.pop(rt.ENV_TUNE, None)
    cuda.CudaBackend._GEMM4_RULE.clear()  # the device's rule is read once: read it again


def wall_us(fn, n: int = 20, rounds: int = 7) -> float:
    """Wall time per call of ``n`` calls back to back, synchronized at the end; median of rounds."""
    fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(res)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="512")
    p.add_argument("--rules", default=";gw_min_weight=0", help="QUANTCORE_CUDA_TUNE settings, ';'-separated")
    p.add_argument("--per-shape", action="store_true")
    args = p.parse_args()
    try:
        import bitsandbytes as bnb
    except ImportError:
        bnb = None
    timer = CudaTimer(torch)
    lins = {name: torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for name, n, k in LAYER}
    with torch.no_grad():
        qmods = {name: qnn.Linear4bit.from_linear(lin) for name, lin in lins.items()}
        bmods = {}
        if bnb is not None:
            for name, lin in lins.items():
                b = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.bfloat16,
                                      quant_type="nf4")
                b.load_state_dict(lin.state_dict())
                bmods[name] = b.cuda()
    rules = args.rules.split(";")
    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in (4096, 14336)}

        def layer(mods, x=x):
            def run():
                for name, _, k in LAYER:
                    mods[name](x[k])
            return run

        impls = {"torch bf16": lins}
        impls.update({f"quantcore nf4 [{r or 'default'}]": (qmods, r) for r in rules})
        if bmods:
            impls["bnb nf4"] = bmods
        with torch.no_grad():
            res = {}
            for _ in range(2):  # two passes, implementations in turn: the second pass is reported
                for label, impl in impls.items():
                    mods, rule = impl if isinstance(impl, tuple) else (impl, None)
                    if rule is not None:
                        set_rule(rule)
                    res[label] = (wall_us(layer(mods)), timer.kernel([layer(mods)], 20, warmup=3))
                    set_rule("")
        base = res["torch bf16"]
        print(f"rows {rows}: one layer's 7 linears, us per layer (wall eager / gpu), x = torch bf16's over this")
        for label, (w, g) in res.items():
            print(f"  {label:36s} wall {w:8.1f} ({base[0] / w:4.2f}x)  gpu {g:8.1f} ({base[1] / g:4.2f}x)")
        if args.per_shape:
            with torch.no_grad():
                for name, n, k in LAYER[:2] + LAYER[4:5] + LAYER[6:]:
                    line = []
                    for label, impl in impls.items():
                        mods, rule = impl if isinstance(impl, tuple) else (impl, None)
                        if rule is not None:
                            set_rule(rule)
                        call = (lambda m, xx: lambda: m(xx))(mods[name], x[k])
                        line.append(f"{label} {wall_us(call, n=50):.1f}/{timer.kernel([call], 20, warmup=3):.1f}")
                        set_rule("")
                    print(f"  {n}x{k} (wall/gpu us): " + " | ".join(line))


if __name__ == "__main__":
    main()
