"""The ranks of tests/test_parallel.py: ``python tests/tp_worker.py OUT_DIR CKPT_DIR`` spawns 2 CPU
processes (gloo); each runs every case and writes ``OUT_DIR/rank<r>.json`` (case -> result), which
the tests read. One spawn for all cases keeps the suite fast."""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

WORLD = 2


def _linear(n, k, seed, bias=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return lin.to(dtype)


def _quantized(fmt, lin, nested=True):
    import quantcore.nn as qnn

    if fmt in ("nf4", "fp4"):
        return qnn.Linear4bit.from_linear(lin, fmt, 64, nested)
    if fmt == "q4_0":
        return qnn.LinearQ4_0.from_linear(lin)
    if fmt in ("nvfp4", "mxfp4"):
        return qnn.LinearFP4.from_linear(lin, fmt)
    return copy.deepcopy(lin)


def _deq(mod):
    return mod.weight.detach().float() if type(mod) is torch.nn.Linear else mod.dequantize(torch.float32)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# (fmt, nested, n, k): aligned and misaligned second-level blocks, each format
LINEAR_CASES = [
    ("nf4", True, 256, 256), ("nf4", True, 192, 256), ("nf4", False, 192, 256), ("fp4", True, 128, 384),
    ("nf4", True, 4, 32768), ("q4_0", False, 96, 128), ("nvfp4", False, 64, 192), ("mxfp4", False, 64, 128),
    ("float", False, 48, 64),
]


def case_linear(rank, fmt, nested, n, k):
    """slice a quantized module: shards dequantize to the exact rows / columns; colwise forward
    (gathered) bitwise, rowwise forward (all-reduced) within tolerance."""
    from quantcore.nn.parallel import shard_linear, shard_spec

    res = {}
    lin = _linear(n, k, seed=n * 7 + k)
    ref = _quantized(fmt, lin, nested)
    w = _deq(ref)
    g = torch.Generator().manual_seed(3)
    xs = {"rows1": torch.randn(1, k, generator=g), "rows20": torch.randn(2, 10, k, generator=g)}
    for style in ("colwise", "rowwise"):
        mod = copy.deepcopy(ref)
        kw = {"output": "gather"} if style == "colwise" else {"input": "replicate"}
        shard_linear(mod, style, **kw)
        lo, hi = shard_spec(mod).split
        want = w[lo:hi] if style == "colwise" else w[:, lo:hi]
        res[f"{style}_weight_equal"] = bool(torch.equal(_deq(mod), want))
        res[f"{style}_local_shape"] = [mod.out_features, mod.in_features]
        if fmt in ("nf4", "fp4"):
            res[f"{style}_nested"] = mod.compress_statistics
        with torch.no_grad():
            for xn, x in xs.items():
                y, y1 = mod(x), ref(x)
                res[f"{style}_{xn}_equal"] = bool(torch.equal(y, y1))
                res[f"{style}_{xn}_rel"] = _rel(y, y1)
    return res


def case_errors(rank):
    import quantcore.nn as qnn
    from quantcore.errors import ParameterError, ShapeError, UnsupportedError
    from quantcore.nn.parallel import quantize_shard, shard_linear

    out = {}
    try:
        quantize_shard(qnn.LinearQ4_0.from_linear(_linear(8, 64, 1)), "colwise")
        out["quantize_shard_of_quantized"] = "no error"
    except UnsupportedError as exc:
        out["quantize_shard_of_quantized"] = f"{type(exc).__name__}: {exc}"
    for label, make, style in (
        ("4bit_col_inside_block", lambda: qnn.Linear4bit.from_linear(_linear(2, 32, 1)), "colwise"),
        ("4bit_row_inside_block", lambda: qnn.Linear4bit.from_linear(_linear(8, 192, 1)), "rowwise"),
        ("q4_0_row_inside_block", lambda: qnn.LinearQ4_0.from_linear(_linear(8, 96, 1)), "rowwise"),
        ("odd_rows", lambda: qnn.LinearQ4_0.from_linear(_linear(7, 64, 1)), "colwise"),
        ("conv", lambda: torch.nn.Conv1d(4, 4, 1), "colwise"),
    ):
        try:
            shard_linear(make(), style)
            out[label] = "no error"
        except (ShapeError, UnsupportedError) as exc:
            out[label] = f"{type(exc).__name__}: {exc}"
    try:
        shard_linear(qnn.LinearQ4_0.from_linear(_linear(8, 128, 1)), "rowwise", all_reduce="nvls")
        out["bad_all_reduce"] = "no error"
    except ParameterError as exc:
        out["bad_all_reduce"] = f"{type(exc).__name__}: {exc}"
    for ar in ("symm_mem", "oneshot"):  # symmetric memory is CUDA's: on CPU tensors the forward says so
        try:
            shard_linear(qnn.LinearQ4_0.from_linear(_linear(8, 128, 1)), "rowwise", all_reduce=ar)(torch.ones(1, 64))
            out[f"{ar}_on_cpu"] = "no error"
        except UnsupportedError as exc:
            out[f"{ar}_on_cpu"] = f"{type(exc).__name__}: {exc}"
    return out


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _greedy(model, ids, steps=4):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


IDS = torch.tensor([[1, 5, 9, 33, 7, 64, 2, 100]])


def case_llama(rank, fmt):
    """a tiny Llama quantized whole, then sharded (parallelize_llama): logits against TP=1."""
    import quantcore.nn as qnn
    from quantcore.nn.parallel import parallelize_llama

    model = qnn.quantize_model(_tiny_llama(), fmt, progress=False)
    ref = copy.deepcopy(model)
    parallelize_llama(model)
    l2, l1 = _logits(model, IDS), _logits(ref, IDS)
    return {"rel": _rel(l2, l1), "max_abs": float((l2 - l1).abs().max()), "tokens_equal": _greedy(model, IDS) == _greedy(ref, IDS),
            "q_local": model.model.layers[0].self_attn.q_proj.out_features,
            "down_local": model.model.layers[0].mlp.down_proj.in_features}


FROM_FLOAT_CASES = [("nf4", False), ("nf4", True), ("fp4", True), ("q4_0", False), ("mxfp4", False), ("nvfp4", False)]


def case_llama_bf16(rank):
    """bf16 activations: the rowwise all-reduce in bf16 (Megatron's) and in float32 (reduce_dtype)."""
    import quantcore.nn as qnn
    from quantcore.nn.parallel import parallelize_llama

    ref = qnn.quantize_model(_tiny_llama().to(torch.bfloat16), "nf4", progress=False)
    bf, f32 = parallelize_llama(copy.deepcopy(ref)), parallelize_llama(copy.deepcopy(ref), reduce_dtype=torch.float32)
    want = _logits(ref, IDS).float()
    return {"rel_bf16_reduce": _rel(_logits(bf, IDS).float(), want),
            "rel_fp32_reduce": _rel(_logits(f32, IDS).float(), want),
            "tokens_equal": _greedy(bf, IDS) == _greedy(ref, IDS) == _greedy(f32, IDS)}


def case_from_float(rank, fmt, nested):
    """each rank quantizes only its float shard (parallelize_llama(fmt=...)) against the shard of
    the whole model's quantization."""
    import quantcore.nn as qnn
    from quantcore.nn.parallel import parallelize_llama, shard_spec

    base = _tiny_llama()
    full = qnn.quantize_model(copy.deepcopy(base), fmt, compress_statistics=nested, progress=False)
    model = parallelize_llama(copy.deepcopy(base), fmt=fmt, compress_statistics=nested)
    weq, codes_eq, worst = True, True, 0.0
    for name, mod in qnn.quantized_modules(model):
        spec = shard_spec(mod)
        if spec is None:
            continue
        ref = full.get_submodule(name)
        lo, hi = spec.split
        w = ref.dequantize(torch.float32)
        want = w[lo:hi] if spec.style == "colwise" else w[:, lo:hi]
        got = mod.dequantize(torch.float32)
        weq &= bool(torch.equal(got, want))
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        if fmt in ("nf4", "fp4"):
            n, k = ref.out_features, ref.in_features
            packed = ref.weight.reshape(-1)[: n * k // 2].reshape(n, k // 2)
            want_p = packed[lo:hi] if spec.style == "colwise" else packed[:, lo // 2: hi // 2]
            codes_eq &= bool(torch.equal(mod.weight.reshape(-1), want_p.reshape(-1)))
    ref_full = copy.deepcopy(full)
    parallelize_llama(full)
    return {"weights_equal": weq, "codes_equal": codes_eq, "worst_rel_weight_diff": worst,
            "logits_rel_vs_tp1": _rel(_logits(model, IDS), _logits(ref_full, IDS))}


def case_parallelize_module(rank):
    """torch's parallelize_module with quantcore's styles on a DeviceMesh (an MLP: colwise then rowwise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import quantcore.nn as qnn
    from quantcore.nn.parallel import QuantColwiseParallel, QuantRowwiseParallel

    mesh = init_device_mesh("cpu", (WORLD,))
    mlp = torch.nn.Sequential(_linear(256, 128, 5), torch.nn.GELU(), _linear(128, 256, 6))
    mlp = qnn.quantize_model(mlp, "nf4", skip=(), progress=False)
    ref = copy.deepcopy(mlp)
    parallelize_module(mlp, mesh, {"0": QuantColwiseParallel(), "2": QuantRowwiseParallel()})
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rel = _rel(mlp(x), ref(x))
    try:
        parallelize_module(copy.deepcopy(ref), mesh, {"0": ColwiseParallel()})
        torch_style = "accepted"
    except Exception as exc:  # torch's own style on a quantcore module
        torch_style = f"{type(exc).__name__}: {str(exc)[:120]}"
    return {"rel": rel, "local": [mlp[0].out_features, mlp[2].in_features], "torch_colwise_on_linear4bit": torch_style}


def case_load(rank, ckpt, fmt):
    """each rank reads only its slices of a quantized checkpoint (memory maps), on a meta model."""
    import quantcore.nn as qnn
    import quantcore.nn.parallel as P
    from quantcore.io import load_safetensors

    path = os.path.join(ckpt, f"{fmt}.safetensors")
    ref = _tiny_llama()
    with torch.device("meta"):
        model = _tiny_llama()
    qnn.replace_linear(model, fmt, device="meta")
    P.parallelize_llama(model)
    taken = []
    real_take = P._take

    arrays = load_safetensors(path)[0]
    spans = sorted((v.__array_interface__["data"][0], v.nbytes, k) for k, v in arrays.items() if v.nbytes)

    def spy(x):  # which checkpoint tensor a read comes from, and how many bytes it takes
        t = real_take(x)
        if not isinstance(x, torch.Tensor):
            p = x.__array_interface__["data"][0]
            key = next((k for s, n, k in spans if s <= p < s + n), None)  # None: not the file's
            taken.append((key, t.numel() * t.element_size()))
        return t

    real_arrays = P._checkpoint_arrays
    P._take, P._checkpoint_arrays = spy, lambda p: arrays  # these very maps
    try:
        read = P.load_sharded(model, path)
    finally:
        P._take, P._checkpoint_arrays = real_take, real_arrays
    model.model.rotary_emb = ref.model.rotary_emb  # a non-persistent buffer: not in any checkpoint
    # TP=1: the same file loaded whole
    full = qnn.replace_linear(_tiny_llama(), fmt, device="meta")
    full.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in load_safetensors(path)[0].items()},
                         assign=True)
    tp2 = copy.deepcopy(full)
    P.parallelize_llama(tp2)
    sizes = {k: int(v.nbytes) for k, v in arrays.items()}
    weights = [k for k in sizes if ".layers." in k and k.endswith(("proj.weight", "proj.weight_packed"))]
    per_key: dict = {}
    for key, b in taken:
        per_key[key] = per_key.get(key, 0) + b
    return {"logits_equal_tp2": bool(torch.equal(_logits(model, IDS), _logits(tp2, IDS))),
            "rel_vs_tp1": _rel(_logits(model, IDS), _logits(full, IDS)),
            "weights": len(weights), "weight_fractions": sorted({read[k] / sizes[k] for k in weights}),
            "weight_read_fractions": sorted({per_key.get(k, 0) / sizes[k] for k in weights}),
            "reads_from_maps": sum(b for _, b in taken), "file_tensor_bytes": sum(sizes.values())}


def case_compile(rank):
    """torch.compile(fullgraph=True) through a sharded MLP: the collectives are traced."""
    import quantcore.nn as qnn
    from quantcore.nn.parallel import shard_linear

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    qnn.quantize_model(mlp, "nf4", skip=(), progress=False)
    ref = copy.deepcopy(mlp)
    shard_linear(mlp[0], "colwise")
    shard_linear(mlp[2], "rowwise")
    x = torch.randn(2, 128)
    with torch.no_grad():
        got = torch.compile(mlp, fullgraph=True)(x)
        return {"rel_vs_tp1": _rel(got, ref(x)), "rel_vs_eager": _rel(got, mlp(x))}


def case_deferred(rank):
    """A rowwise layer with all_reduce="deferred" returns its partial sums (the bias on rank 0 only);
    all_reduce_add_rms_norm sums them, adds the residual and normalizes, as the unfused ops do."""
    import quantcore.nn as qnn
    from quantcore.errors import ParameterError, ShapeError
    from quantcore.nn.parallel import all_reduce_add_rms_norm, parallelize_llama, shard_linear

    lin = qnn.quantize_model(torch.nn.Sequential(_linear(64, 256, 9)), "nf4", skip=(), progress=False)[0]
    summed = copy.deepcopy(lin)
    shard_linear(lin, "rowwise", input="replicate", all_reduce="deferred")
    shard_linear(summed, "rowwise", input="replicate")
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(3, 256, generator=g), torch.randn(3, 64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    with torch.no_grad():
        part, full = lin(x), summed(x)
        total = part.clone()
        dist.all_reduce(total)
        h, normed = all_reduce_add_rms_norm(part, res, w, 1e-5, None, "group")
        h_ref = res + total
        n_ref = (h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-5)) * w
        alone = [dist.new_group([r]) for r in range(WORLD)][rank]  # every rank makes every group, in order
        h1, n1 = all_reduce_add_rms_norm(total, res, w, 1e-5, alone, "group")  # one rank
    # the bias enters rank 0's partial sums, not after the sum: equal within the rounding of the order
    out = {"partials_sum_to_output": _rel(total, full), "partial_differs": not torch.equal(part, full),
           "h_equal": bool(torch.equal(h, h_ref)), "norm_rel": _rel(normed, n_ref),
           "one_rank_equal": bool(torch.equal(h1, h_ref) and torch.equal(n1, n_ref))}
    for name, fn in (("llama_refuses", lambda: parallelize_llama(_tiny_llama(), all_reduce="deferred")),
                     ("bad_weight", lambda: all_reduce_add_rms_norm(part, res, w[:32], 1e-5, None, "group")),
                     ("bad_method", lambda: all_reduce_add_rms_norm(part, res, w, 1e-5, None, "deferred"))):
        try:
            fn()
            out[name] = "accepted"
        except (ParameterError, ShapeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def run(rank, out_dir, ckpt):
    # a file rendezvous: no port to pick (and none to collide with)
    dist.init_process_group("gloo", init_method=f"file://{os.path.abspath(out_dir)}/rendezvous", rank=rank,
                            world_size=WORLD)
    torch.set_num_threads(1)
    results = {}

    def record(name, fn, *args):
        try:
            results[name] = fn(*args)
        except Exception:
            results[name] = {"exception": traceback.format_exc()}

    for fmt, nested, n, k in LINEAR_CASES:
        record(f"linear-{fmt}-{'nested' if nested else 'plain'}-{n}x{k}", case_linear, rank, fmt, nested, n, k)
    record("errors", case_errors, rank)
    for fmt in ("nf4", "q4_0", "nvfp4"):
        record(f"llama-{fmt}", case_llama, rank, fmt)
    record("llama-bf16", case_llama_bf16, rank)
    for fmt, nested in FROM_FLOAT_CASES:
        record(f"from_float-{fmt}-{'nested' if nested else 'plain'}", case_from_float, rank, fmt, nested)
    record("parallelize_module", case_parallelize_module, rank)
    for fmt in ("nf4", "nvfp4"):
        record(f"load-{fmt}", case_load, rank, ckpt, fmt)
    record("compile", case_compile, rank)
    record("deferred", case_deferred, rank)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    dist.destroy_process_group()


def write_checkpoints(ckpt):
    """The quantized tiny Llamas the load cases read (their state dicts, as safetensors)."""
    import quantcore.nn as qnn
    from quantcore.io import save_safetensors

    for fmt in ("nf4", "nvfp4"):
        model = qnn.quantize_model(_tiny_llama(), fmt, progress=False)
        save_safetensors(os.path.join(ckpt, f"{fmt}.safetensors"), {k: v.contiguous() for k, v in model.state_dict().items()})


if __name__ == "__main__":
    out_dir, ckpt = sys.argv[1], sys.argv[2]
    write_checkpoints(ckpt)
    torch.multiprocessing.spawn(run, args=(out_dir, ckpt), nprocs=WORLD, join=True)
