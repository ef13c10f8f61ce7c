"""Eager prefill of a Llama-3-8B-shaped model (quantcore.bench_e2e's model, --layers of it) under linear_4bit's
path rules, in one process: torch bf16 and the qc-nf4 model under each QUANTCORE_CUDA_TUNE setting of
--rules, taken in turn for --rounds rounds (the host's speed drifts between processes by +-30%, so only
times taken side by side are compared). Per setting: the wall time of one no-grad forward of --tokens
tokens at batch 1 (synchronized), median over rounds x 3 forwards; and, once, the GPU time of one forward
(CUDA events around 3 forwards queued behind a sleep kernel).

    python3 tools/dev/prefill_rule_ab.py [--layers 16] [--tokens 512] [--rules ";gw_eager=0"] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from eager_layer_wall import set_rule  # (this folder: the script's own)

from quantcore import bench_e2e
from quantcore.bench import CudaTimer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rules", default=";gw_eager=0")
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    cfg = bench_e2e.model_config("llama3-8b", args.layers)
    bf16 = bench_e2e.build_model(cfg, "cuda")
    qc = bench_e2e.quantize_qc(bench_e2e.build_model(cfg, "cuda"), "nf4")
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), device="cuda")
    settings = [("torch bf16", bf16, None)] + [(f"qc-nf4 [{r or 'default'}]", qc, r) for r in args.rules.split(";")]
    times: dict[str, list[float]] = {s[0]: [] for s in settings}
    with torch.no_grad():
        def fwd(model):
            return lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)

        for _label, model, rule in settings:  # warm-up: kernels, plans, bound launches
            if rule is not None:
                set_rule(rule)
            for _ in range(3):
                fwd(model)()
        torch.cuda.synchronize()
        for _ in range(args.rounds):
            for label, model, rule in settings:
                if rule is not None:
                    set_rule(rule)
                f = fwd(model)
                f()
                torch.cuda.synchronize()
                for _ in range(3):
                    t = time.perf_counter()
                    f()
                    torch.cuda.synchronize()
                    times[label].append((time.perf_counter() - t) * 1e3)
        gpu = {}
        for label, model, rule in settings:
            if rule is not None:
                set_rule(rule)
            gpu[label] = CudaTimer(torch).kernel([fwd(model)], 3, warmup=1) / 1e3
        set_rule("")
    base = statistics.median(times["torch bf16"])
    print(f"eager prefill, {args.tokens} tokens, {args.layers} layers, ms per forward (median of {args.rounds} x 3; "
          "min-max), x = bf16's wall over this; gpu ms")
    for label, ts in times.items():
        m = statistics.median(ts)
        print(f"  {label:32s} wall {m:7.2f} ({min(ts):6.2f}-{max(ts):6.2f}) {base / m:4.2f}x   gpu {gpu[label]:6.2f}")


if __name__ == "__main__":
    main()
