"""Where a compiled decode step's GPU time goes (device machine): the kernels of one Llama-3-8B-shaped decode
step under torch.compile(mode="reduce-overhead") (CUDA graphs), per variant, from torch.profiler's CUPTI
trace of STEPS replayed steps. Prints per variant: the step's wall time (CUDA events), the kernels' summed
time and count per step, the time between kernels (wall - kernels: launch gaps, graph overhead), and the
kernels grouped by name (quantcore's gemvs, torch's matmuls, attention, the rest) with their top names.

    python3 tools/dev/e2e_step_profile.py --variants bf16,qc-nf4-grouped [--layers 32] [--batch 1] [--steps 8]
        [--eager-host [--no-compiled]]

--eager-host first times eager decode steps (host-bound: the model's Python) and prints cProfile's top
functions by own time per step, for comparing the host cost of a variant's linear layers with bf16's.

The model, its quantization and the decode loop are quantcore.bench_e2e's (same seed and settings).
"""

from __future__ import annotations

import argparse
import collections
import gc
import statistics

import torch
from transformers import StaticCache

from quantcore import bench_e2e as be
from quantcore.bench import trace_kernels


def categorize(name: str) -> str:
    n = name.lower()
    if n.startswith("triton"):  # inductor's fused kernels (their names may contain an op's name)
        return "attention" if "attention" in n else "triton (inductor)"
    if "gemv_4bit" in n or "qc::" in n or "quantcore" in n or "mx_gemv" in n or "w4a8" in n:
        return "quantcore"
    if "gemv" in n or "gemm" in n or "nvjet" in n or "cutlass" in n or "sm90_xmma" in n or "splitk" in n:
        return "torch matmul"
    if "flash" in n or "attention" in n or "fmha" in n or "sdpa" in n:
        return "attention"
    return "other"


def eager_host_profile(variant: str, model, cache, prompt, args) -> None:
    """Eager decode steps (the model called as bench_e2e's eager mode does): wall time per step, then
    cProfile over args.steps steps, the top functions by their own time (calls and us per step)."""
    import cProfile
    import pstats
    import time

    n = args.steps
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with torch.no_grad():

        def run(profiler=None):
            cache.reset()
            tok = model(input_ids=prompt, use_cache=True, logits_to_keep=1, past_key_values=cache)
            tok = tok.logits[:, -1:].argmax(-1)
            sync()
            t0 = time.perf_counter()
            if profiler is not None:
                profiler.enable()
            for _ in range(n):
                tok = model(input_ids=tok, use_cache=True, past_key_values=cache).logits[:, -1:].argmax(-1)
            if profiler is not None:
                profiler.disable()
            sync()
            return (time.perf_counter() - t0) / n * 1e3

        run()
        walls = [run() for _ in range(3)]
        prof = cProfile.Profile()
        pwall = run(prof)
    print(
        f"\n== {variant}: eager decode, {args.layers} layers, batch {args.batch}: {statistics.median(walls):.2f} ms "
        f"a step ({pwall:.2f} under cProfile)"
    )
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[: args.host_top]
    print(f"  {'calls/step':>10s} {'own us/step':>11s} {'cum us/step':>11s}  function")
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in rows:
        print(
            f"  {nc / n:10.1f} {tt / n * 1e6:11.1f} {ct / n * 1e6:11.1f}  {fn} ({file.rsplit('/', 2)[-1]}:{line})"
        )


def profile_variant(variant: str, args) -> None:
    config = be.model_config(args.preset, args.layers)
    model = be.quantize_variant(be.build_model(config, args.device), variant)
    cache = StaticCache(config=model.config, max_cache_len=16 + args.steps * 4 + 8)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (args.batch, 16), generator=gen).to(args.device)
    if args.eager_host:
        eager_host_profile(variant, model, cache, prompt, args)
    if args.no_compiled:
        return
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)
    with torch.no_grad():

        def run(n):
            cache.reset()
            tok = model(input_ids=prompt, use_cache=True, logits_to_keep=1, past_key_values=cache)
            tok = tok.logits[:, -1:].argmax(-1)
            for _ in range(n):
                torch.compiler.cudagraph_mark_step_begin()
                tok = step(input_ids=tok, use_cache=True, past_key_values=cache).logits[:, -1:].argmax(-1)
            return tok

        run(args.steps)
        run(args.steps)
        torch.cuda.synchronize()
        # the wall time per step, CUDA events around the steps (the prefill not timed)
        cache.reset()
        tok = (
            model(input_ids=prompt, use_cache=True, logits_to_keep=1, past_key_values=cache)
            .logits[:, -1:]
            .argmax(-1)
        )
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(args.steps):
            torch.compiler.cudagraph_mark_step_begin()
            tok = step(input_ids=tok, use_cache=True, past_key_values=cache).logits[:, -1:].argmax(-1)
        e1.record()
        torch.cuda.synchronize()
        wall_us = e0.elapsed_time(e1) * 1e3 / args.steps
        cache.reset()
        tok = (
            model(input_ids=prompt, use_cache=True, logits_to_keep=1, past_key_values=cache)
            .logits[:, -1:]
            .argmax(-1)
        )
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                torch.compiler.cudagraph_mark_step_begin()
                tok = step(input_ids=tok, use_cache=True, past_key_values=cache).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
    # the kernels' start and end from the trace (us); the gap before a kernel: its start minus the end of the
    # one before it (negative where a programmatic dependent started early)
    kern = trace_kernels(prof)
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for i, (ts, dur, name) in enumerate(kern):
        per_name[name].append(dur)
        if i:
            pts, pdur, pname = kern[i - 1]
            gaps[(categorize(pname), categorize(name))].append(ts - (pts + pdur))
    n = args.steps
    total = sum(sum(v) for v in per_name.values()) / n
    count = sum(len(v) for v in per_name.values()) / n
    cats: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, []])
    for name, times in per_name.items():
        c = cats[categorize(name)]
        c[0] += sum(times) / n
        c[1] += len(times) / n
        c[2].append((sum(times) / n, len(times) / n, name))
    print(
        f"\n== {variant}: {args.layers} layers, batch {args.batch}, {n} steps ({torch.cuda.get_device_name()})"
    )
    print(
        f"step wall {wall_us:8.1f} us | kernels {total:8.1f} us in {count:6.1f} launches | between kernels "
        f"{wall_us - total:7.1f} us ({(wall_us - total) / max(count, 1):.2f} us a launch)"
    )
    print("  gaps between consecutive kernels (previous -> next: count a step, median, mean, sum a step; us)")
    for (a, b), g in sorted(gaps.items(), key=lambda kv: -sum(kv[1])):
        print(
            f"      {a:18s} -> {b:18s} {len(g) / n:6.1f} {statistics.median(g):7.2f} {statistics.fmean(g):7.2f} "
            f"{sum(g) / n:8.1f}"
        )
    for cat, (t, k, names) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
        print(f"  {cat:18s} {t:8.1f} us {k:6.1f} launches ({t / max(k, 1e-9):6.2f} us each)")
        for tt, kk, name in sorted(names, reverse=True)[: args.top]:
            print(f"      {tt:8.1f} us {kk:6.1f}x  {name[:140]}")
    model = step = cache = None  # noqa: F841 - freed before the next variant
    torch._dynamo.reset()
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="bf16,qc-nf4-grouped")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--preset", default="llama3-8b", help="bench_e2e's model preset (tiny: a CPU dry run)")
    p.add_argument("--device", default="cuda", help="cpu: --eager-host --no-compiled only (a dry run)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=6)
    p.add_argument(
        "--eager-host", action="store_true", help="also time eager steps and cProfile their host side"
    )
    p.add_argument("--host-top", type=int, default=30, help="functions listed by --eager-host")
    p.add_argument("--no-compiled", action="store_true", help="skip the compiled step's profile")
    args = p.parse_args()
    for v in args.variants.split(","):
        profile_variant(v, args)


if __name__ == "__main__":
    main()
