"""``quantcore bench --e2e`` end to end on a micro Llama (``--preset tiny``) on the CPU (torch CPU
tensors, quantcore's cpu backend), so the GPU benchmark's code cannot rot: the variants run, the
JSON / table / ratios / merge are written, a failing variant is recorded and the others go on. The
timings are meaningless here; the compiled mode (inductor on the CPU) is in the slow test."""

import json
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the e2e benchmark drives a torch model")
pytest.importorskip("transformers", reason="transformers is not installed: the e2e benchmark builds a "
                                           "transformers LlamaForCausalLM")

from quantcore import bench_e2e  # noqa: E402

try:
    import quantcore.nn  # noqa: F401

    QC_NN = None
except Exception as exc:  # noqa: BLE001 - reported as the skip reason
    QC_NN = f"quantcore.nn not importable ({type(exc).__name__}: {exc})"

QC_VARIANTS = ["qc-nf4", "qc-q4_0", "qc-mxfp4"]
#: the smallest run: 1 timed run of 2 decode steps after a 4-token prompt, 16-token prefill
FAST = ["--preset", "tiny", "--device", "cpu", "--modes", "eager", "--batches", "1,2", "--new-tokens", "2",
        "--prompt-len", "4", "--prefill-len", "16", "--reps", "1", "--warmup", "1", "--png", ""]


def _run(tmp_path, *args, name="e2e.json"):
    path = tmp_path / name
    rc = bench_e2e.main([*FAST, "--json", str(path), *args])
    with open(path) as f:
        return rc, json.load(f)


def _by_variant(report):
    return {v["variant"]: v for v in report["variants"]}


def test_bf16_through_the_cli(tmp_path, capsys):
    """``quantcore bench --e2e`` (the command line's delegation) measures every metric of bf16 and
    writes the JSON the docs describe."""
    from quantcore import cli

    path = tmp_path / "cli.json"
    assert cli.main(["bench", "--e2e", *FAST, "--variants", "bf16", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "bf16: building LlamaForCausalLM" in out and "quantcore 0.1.0 bench --e2e" in out
    report = json.loads(path.read_text())
    assert report["model"]["layers"] == 2 and report["model"]["hidden_size"] == 256
    assert list(report["metrics"]) == ["prefill_16", "decode_eager_b1", "decode_eager_b2"]
    (v,) = report["variants"]
    assert v["status"] == "ok", v
    for key in report["metrics"]:
        m = v["metrics"][key]
        assert m["error"] is None and m["tokens_per_s"] > 0 and len(m["times_s"]) == 1
    n_linear = 2 * (256 * 256 * 2 + 128 * 256 * 2 + 3 * 256 * 512)  # q, o; k, v (2 kv heads); mlp
    assert v["linear_modules"] == 14 and v["linear_weight_bytes"] == 2 * n_linear
    assert v["lm_head_bytes"] == 2 * 512 * 256
    assert v["mem_resident_bytes"] is None  # no CUDA memory stats on the CPU


@pytest.mark.skipif(QC_NN is not None, reason=QC_NN or "")
def test_quantcore_variants_and_ratios(tmp_path, capsys):
    """bf16 and the three quantcore formats: all measured, about 4.5 bits per weight, logits near
    bf16's, the ratios against bf16 in the JSON and the table."""
    rc, report = _run(tmp_path, "--variants", ",".join(["bf16", *QC_VARIANTS]))
    assert rc == 0
    out = capsys.readouterr().out
    by = _by_variant(report)
    bf16 = by["bf16"]
    for name in QC_VARIANTS:
        v = by[name]
        assert v["status"] == "ok", (name, v["error"], v["traceback"])
        assert all(m["tokens_per_s"] > 0 for m in v["metrics"].values())
        assert v["linear_types"][0].startswith("quantcore.nn.")
        share = v["linear_weight_bytes"] / bf16["linear_weight_bytes"]
        assert 0.25 < share < 0.32, (name, share)  # 4 bits + scales over 16 bits
        assert v["lm_head_bytes"] == bf16["lm_head_bytes"]  # lm_head stays bf16
        assert 0 < v["logits_rel_err_vs_bf16"] < 0.5, name  # same weights before quantizing
        ratios = v["ratios"]["vs bf16"]
        assert ratios["linear_weight_bytes"] == pytest.approx(share)
        assert set(report["metrics"]) <= set(ratios)
    assert "ratios (tok/s" in out
    assert any(line.split()[:3] == ["qc-q4_0", "vs", "bf16"] for line in out.splitlines())


@pytest.mark.skipif(QC_NN is not None, reason=QC_NN or "")
def test_failure_is_recorded_and_merge(tmp_path, monkeypatch, capsys):
    """A variant that raises is in the table with its error and the next one still runs; a second
    call with --merge keeps the first call's variants and gives ratios across both."""
    real = bench_e2e.quantize_qc

    def broken(model, fmt, skip=("lm_head",)):
        if fmt == "q4_0":
            raise RuntimeError("injected failure for the test")
        return real(model, fmt, skip)

    monkeypatch.setattr(bench_e2e, "quantize_qc", broken)
    rc, report = _run(tmp_path, "--variants", "bf16,qc-q4_0,qc-nf4")
    assert rc == 1
    by = _by_variant(report)
    assert by["qc-q4_0"]["status"] == "failed"
    assert "injected failure" in by["qc-q4_0"]["error"] and "Traceback" in by["qc-q4_0"]["traceback"]
    assert by["bf16"]["status"] == by["qc-nf4"]["status"] == "ok"
    assert "RuntimeError: injected failure for the test" in capsys.readouterr().out

    monkeypatch.setattr(bench_e2e, "quantize_qc", real)
    rc, report = _run(tmp_path, "--variants", "qc-q4_0", "--merge")
    assert rc == 0
    by = _by_variant(report)
    assert [v["variant"] for v in report["variants"]] == ["bf16", "qc-nf4", "qc-q4_0"]
    assert by["qc-q4_0"]["status"] == "ok" and by["qc-q4_0"]["from_run"] is None
    assert by["bf16"]["from_run"] and "vs bf16" in by["qc-q4_0"]["ratios"]
    # another model's JSON is not merged
    rc, report = _run(tmp_path, "--variants", "qc-q4_0", "--merge", "--layers", "1")
    assert [v["variant"] for v in report["variants"]] == ["qc-q4_0"]
    assert any("not merged" in n for n in report["notes"])


def test_timeout_per_variant(tmp_path, monkeypatch):
    """--timeout-per-variant stops a variant (SIGALRM) and the run goes on to the next. The alarm
    fires in a stand-in build that sleeps: at a random point of a real build it could interrupt
    torch or transformers half-way through a change of global state (the default dtype)."""
    monkeypatch.setattr(bench_e2e, "build_model", lambda *a, **k: time.sleep(30))
    rc, report = _run(tmp_path, "--variants", "bf16", "--timeout-per-variant", "0.2")
    (v,) = report["variants"]
    assert rc == 1 and v["status"] == "timeout" and "timeout-per-variant" in v["error"]


def test_unavailable_variant_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_e2e, "available_variants",
                        lambda dev: {**dict.fromkeys(bench_e2e.ALL_VARIANTS), "bnb-nf4": "not installed here"})
    rc, report = _run(tmp_path, "--variants", "bnb-nf4", "--prefill-len", "0")
    (v,) = report["variants"]
    assert rc == 0 and v["status"] == "skipped" and v["error"] == "not installed here"


@pytest.mark.slow
@pytest.mark.skipif(QC_NN is not None, reason=QC_NN or "")
def test_compiled_mode_cpu(tmp_path):
    """The compiled mode (torch.compile fullgraph of model.forward over the StaticCache) on the CPU:
    skipped when inductor cannot compile even bf16 here; the quantcore modules must then compile
    too, and decode the same greedy tokens as eager."""
    rc, report = _run(tmp_path, "--variants", "bf16,qc-nf4", "--modes", "eager,compiled", "--batches", "1",
                      "--prefill-len", "0")
    by = _by_variant(report)
    err = by["bf16"]["metrics"]["decode_compiled_b1"]["error"]
    if err:
        pytest.skip(f"torch.compile does not work on this CPU: {err}")
    m = by["qc-nf4"]["metrics"]["decode_compiled_b1"]
    assert m["error"] is None and m["tokens_per_s"] > 0
    assert m["match_eager"] == 1.0
    assert rc == 0
