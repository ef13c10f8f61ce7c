"""Tensor parallelism of quantcore.nn modules (quantcore.nn.parallel) on CPU: 2 processes, gloo.

One spawn (tests/tp_worker.py) runs every case on both ranks and writes its results; the tests
check them. TP=2 against TP=1: shards of every format (sliced from a quantized module, or quantized
from their float shard), the forward of colwise (bitwise) and rowwise (tolerance) layers, a tiny
LlamaForCausalLM's logits and greedy tokens, torch's parallelize_module with quantcore's styles,
and a quantized checkpoint loaded sharded (what each rank reads). The GPU twin is
tools/tp_device.sh; its CPU run is the last test here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed: the tiny Llama needs it")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import tp_worker  # noqa: E402

RTOL = 1e-5  # float32 activations: rowwise partial sums reduced in another order


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _spawn(out, ckpt):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "tp_worker.py"), str(out), str(ckpt)],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp_worker.WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("tp_out"), tmp_path_factory.mktemp("tp_ckpt"))


def _case(ranks, name):
    out = []
    for r, res in enumerate(ranks):
        got = res[name]
        assert "exception" not in got, f"rank {r}: {got.get('exception')}"
        out.append(got)
    return out


@pytest.mark.parametrize("fmt,nested,n,k", tp_worker.LINEAR_CASES)
def test_shard_of_a_quantized_linear(ranks, fmt, nested, n, k):
    for r, res in enumerate(_case(ranks, f"linear-{fmt}-{'nested' if nested else 'plain'}-{n}x{k}")):
        # each rank holds exactly its rows / columns of the unsharded weight
        assert res["colwise_weight_equal"] and res["rowwise_weight_equal"], (r, res)
        assert res["colwise_local_shape"] == [n // 2, k] and res["rowwise_local_shape"] == [n, k // 2]
        for xn in ("rows1", "rows20"):  # the gemv path and the dequantize + matmul path
            if n // 2 >= 24:  # numpy's BLAS takes another kernel for a 2-row product (docs/parallel.md)
                assert res[f"colwise_{xn}_equal"], (r, xn, res)
            assert res[f"colwise_{xn}_rel"] < RTOL and res[f"rowwise_{xn}_rel"] < RTOL, (r, xn, res)
        if fmt in ("nf4", "fp4") and nested:
            # second-level blocks kept where a shard covers whole ones, else float32 absmax
            aligned_col = (n // 2 * k // 64) % 256 == 0
            assert res["colwise_nested"] == aligned_col
            assert res["rowwise_nested"] == ((k // 64) % 256 == 0 and (k // 2 // 64) % 256 == 0)


def test_shards_inside_a_block_are_refused(ranks):
    for res in _case(ranks, "errors"):
        assert res["4bit_col_inside_block"].startswith("ShapeError") and "64-blocks" in res["4bit_col_inside_block"]
        assert res["4bit_row_inside_block"].startswith("ShapeError")
        assert res["q4_0_row_inside_block"].startswith("ShapeError")
        assert res["odd_rows"].startswith("ShapeError") and "does not divide" in res["odd_rows"]
        assert res["conv"].startswith("UnsupportedError")
        assert res["quantize_shard_of_quantized"].startswith("UnsupportedError")
        assert res["bad_all_reduce"].startswith("ParameterError") and "symm_mem" in res["bad_all_reduce"]
        for ar in ("symm_mem", "oneshot"):
            assert res[f"{ar}_on_cpu"].startswith("UnsupportedError") and "CUDA" in res[f"{ar}_on_cpu"]


@pytest.mark.parametrize("fmt", ["nf4", "q4_0", "nvfp4"])
def test_tiny_llama_tp2_against_tp1(ranks, fmt):
    for res in _case(ranks, f"llama-{fmt}"):
        assert res["rel"] < RTOL, res
        assert res["tokens_equal"]
        assert res["q_local"] == 64 and res["down_local"] == 128  # half the heads, half the MLP


def test_tiny_llama_bf16_reduce_dtypes(ranks):
    # bf16 partial sums: a few bf16 roundings from TP=1; float32 partial sums: far closer
    for res in _case(ranks, "llama-bf16"):
        assert res["rel_bf16_reduce"] < 0.02 and res["rel_fp32_reduce"] <= res["rel_bf16_reduce"], res
        assert res["rel_fp32_reduce"] < 1e-3 and res["tokens_equal"], res


@pytest.mark.parametrize("fmt,nested", tp_worker.FROM_FLOAT_CASES)
def test_each_rank_quantizes_its_float_shard_bitwise(ranks, fmt, nested):
    # double quantization: the shards' absmax all-gathered and double-quantized whole, as TP=1 does
    for res in _case(ranks, f"from_float-{fmt}-{'nested' if nested else 'plain'}"):
        assert res["weights_equal"] and res["codes_equal"], res
        assert res["worst_rel_weight_diff"] == 0.0 and res["logits_rel_vs_tp1"] < RTOL


def test_parallelize_module_takes_quantcore_styles(ranks):
    for res in _case(ranks, "parallelize_module"):
        assert res["rel"] < RTOL and res["local"] == [128, 128]
        assert res["torch_colwise_on_linear4bit"].startswith("NotImplementedError")


@pytest.mark.parametrize("fmt", ["nf4", "nvfp4"])
def test_load_sharded_reads_only_the_slices(ranks, fmt):
    for res in _case(ranks, f"load-{fmt}"):
        assert res["logits_equal_tp2"] and res["rel_vs_tp1"] < RTOL, res
        assert res["weights"] == 14 and res["weight_fractions"] == [0.5]  # 7 projections x 2 layers
        assert res["weight_read_fractions"] == [0.5]  # bytes read out of each weight's memory map
        assert res["reads_from_maps"] < 0.8 * res["file_tensor_bytes"]


def test_device_script_cpu_twin(tmp_path):
    """tools/tp_device.sh's logic (tools/tp_decode.py: the decoder stack, the plan, the graph's
    fallback, the JSON) on CPU with gloo at small widths: TP=2 against TP=1."""
    env = _env()
    env.update(DEVICE="cpu", LAYERS="2", HIDDEN="256", INTERMEDIATE="512", HEADS="4", KV_HEADS="2", CTX="16",
               STEPS="3", OUT=str(tmp_path), PYTHON=sys.executable, ALL_REDUCE="group group:pdl=0")
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "tp_device.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "tp_decode.json").read_text())
    t1, t2 = res["tp1"], res["tp2"]
    # NAME:TUNE runs NAME with QUANTCORE_CUDA_TUNE=TUNE, into its own JSON
    assert res["tp2_group_pdl_0"]["cuda_tune"] == "pdl=0" and t2["cuda_tune"] is None
    assert (t1["world"], t2["world"]) == (1, 2) and t1["graph"] == t2["graph"] == "eager (cpu)"
    assert t2["vs_tp1"]["q_proj_colwise_bitwise"] and t2["vs_tp1"]["rel_l2"] < RTOL
    assert t1["tokens_per_s"] > 0 and t2["tokens_per_s"] > 0 and len(t2["per_rank"]) == 2
    # each rank holds half of the quantized weights (the norms replicated)
    half = t1["per_rank"][0]["weights_bytes"] / 2
    assert all(abs(r["weights_bytes"] - half) / half < 0.05 for r in t2["per_rank"])


@pytest.mark.parametrize("fuse", ["0", "1"], ids=["", "fuse-norm-rope"])
def test_device_script_cpu_twin_grouped(tmp_path, fuse):
    """GROUP=1: q / k / v and gate / up of every layer as grouped launches (quantcore.nn.group_linears
    on the colwise shards), TP=2 against TP=1 as above; FUSE_NORM=1: the rowwise layers' partial sums
    reduced by all_reduce_add_rms_norm (its gloo fallback here); FUSE_ROPE=1: rope and the cache
    writes as one glue function."""
    env = _env()
    env.update(DEVICE="cpu", GROUP="1", FUSE_NORM=fuse, FUSE_ROPE=fuse, LAYERS="2", HIDDEN="256", INTERMEDIATE="512", HEADS="4", KV_HEADS="2",
               CTX="16", STEPS="3", OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(REPO, "tools", "tp_device.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "tp_decode.json").read_text())
    t1, t2 = res["tp1"], res["tp2"]
    assert t1["grouped_linears"] == t2["grouped_linears"] == 4  # 2 layers x (q/k/v, gate/up)
    assert not t1["fuse_reduce_norm"] and t2["fuse_reduce_norm"] == (fuse == "1")
    assert t1["fuse_rope_cache"] == t2["fuse_rope_cache"] == (fuse == "1")
    assert t2["vs_tp1"]["layer0_rel_l2"] < RTOL and t2["vs_tp1"]["rel_l2"] < RTOL


def test_torch_compile_traces_the_collectives(ranks):
    # torch.compile(fullgraph=True) through a sharded nf4 MLP (inductor fuses: tolerance, not bitwise)
    for res in _case(ranks, "compile"):
        assert res["rel_vs_tp1"] < RTOL and res["rel_vs_eager"] < RTOL, res


def test_deferred_rowwise_and_the_fused_reduce_add_norm(ranks):
    # the partial sums add up to the reduced output (the bias once, in rank 0's partial sums); the fallback of all_reduce_add_rms_norm (gloo) is the all-reduce, the add and the norm
    for res in _case(ranks, "deferred"):
        assert res["partials_sum_to_output"] < 1e-6 and res["partial_differs"], res
        assert res["h_equal"] and res["norm_rel"] < 1e-6 and res["one_rank_equal"], res
        assert res["llama_refuses"].startswith("ParameterError") and "deferred" in res["llama_refuses"]
        assert res["bad_weight"].startswith("ShapeError") and res["bad_method"].startswith("ParameterError")

