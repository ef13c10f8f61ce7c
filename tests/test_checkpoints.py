"""``quantcore quantize`` without torch: the safetensors reader on malformed files, single-file
conversions read back, safe writes (refusals, --force, a full disk, interrupts), progress and the
summary, the GGUF dispatch, streaming under a memory limit, and the device backends' bytes.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import quantcore as qc
from quantcore import CheckpointError, ParameterError, UnsupportedError, api_mx
from quantcore.arrays import BF16
from quantcore.cli import main
from quantcore.convert import parse_size, quantize_checkpoint, read_quantized
from quantcore.io import MAX_HEADER_BYTES, SafetensorsFile, ShardWriter, load_safetensors, save_safetensors
from quantcore.registry import availability

REPO = Path(__file__).resolve().parents[1]


def _raw_file(path, header, data=b"", hlen=None):
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if hlen is None else hlen))
        f.write(raw)
        f.write(data)
    return path


def _one_line_error(capsys):
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("quantcore: error: "), err
    return err[0]


@pytest.fixture
def model_file(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "in.safetensors"
    save_safetensors(path, {
        "model.embed_tokens.weight": rng.standard_normal((64, 128)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": (rng.standard_normal((128, 128)) * 0.02).astype(np.float32),
        "model.layers.0.mlp.down_proj.weight": (rng.standard_normal((128, 128)) * 0.02).astype(BF16),
        "model.layers.0.norm.weight": np.ones(128, np.float32),
        "model.layers.0.small.weight": np.ones((8, 32), np.float32),
        "lm_head.weight": rng.standard_normal((64, 128)).astype(np.float32),
    })
    return path


# -- the reader on malformed files --------------------------------------------------------------------------
GOOD = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


@pytest.mark.parametrize("case, header, data, hlen, match", [
    ("lying header length", GOOD, bytes(16), 10**6, "runs past the end"),
    ("huge header length", GOOD, bytes(16), MAX_HEADER_BYTES + 1, "limit"),
    ("offsets outside the file", {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(8), None,
     "outside"),
    ("negative offset", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [-8, -4]}}, bytes(8), None, "outside"),
    ("reversed offsets", {"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}}, bytes(8), None, "outside"),
    ("overlap", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), None, "overlap"),
    ("shape vs bytes", {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), None, "12 bytes"),
    ("negative dim", {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), None, "non-negative"),
    ("float offsets", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}}, bytes(8), None, "two integers"),
    ("missing field", {"a": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "must have"),
    ("not an object", [1, 2], b"", None, "not an object"),
    ("bad metadata", {"__metadata__": {"k": 1}}, b"", None, "__metadata__"),
])
def test_malformed_safetensors_is_a_clear_error(tmp_path, case, header, data, hlen, match):
    path = _raw_file(tmp_path / "bad.safetensors", header, data, hlen)
    with pytest.raises(CheckpointError, match=match):
        SafetensorsFile(path)


def test_non_json_truncated_and_unknown_dtype(tmp_path, capsys):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 4) + b"\xff{[a")
    with pytest.raises(CheckpointError, match="not JSON"):
        SafetensorsFile(p)
    p.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="shorter than"):
        SafetensorsFile(p)
    _raw_file(p, {"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(qc.DTypeError, match="unsupported dtype"):
        SafetensorsFile(p)
    # the case: a negative offset once returned the JSON header's bytes as a tensor
    _raw_file(p, {"a": {"dtype": "U8", "shape": [4], "data_offsets": [-4, 0]}}, b"")
    assert main(["quantize", str(p), "-o", str(tmp_path / "o.safetensors"), "--format", "nf4", "-q"]) == 2
    assert "outside" in _one_line_error(capsys)


def test_truncated_real_file_refused(model_file, tmp_path):
    data = model_file.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_safetensors(cut)


def test_reader_maps_each_tensor_alone(model_file):
    st = SafetensorsFile(model_file)
    a = st.get("model.layers.0.mlp.up_proj.weight")
    assert isinstance(a.base, np.memmap) or isinstance(a, np.memmap) or a.base is not None
    assert not a.flags.writeable
    t, _ = load_safetensors(model_file)
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == BF16


# -- single files ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["nf4", "fp4", "nvfp4", "mxfp4"])
def test_single_file_reads_back_as_quantcore_dequantizes(model_file, tmp_path, capsys, fmt):
    out = tmp_path / "o.safetensors"
    assert main(["quantize", str(model_file), "-o", str(out), "--format", fmt, "-q"]) == 0
    err = capsys.readouterr().err
    assert "2 of 6 tensors quantized" in err and "kept unquantized:" in err
    assert "named like an embedding or the output head: lm_head.weight, model.embed_tokens.weight" in err
    assert "fewer than --min-numel 4096 elements: model.layers.N.small.weight" in err
    src, _ = load_safetensors(model_file)
    back = read_quantized(str(out))
    assert set(back) == {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    for name, got in back.items():
        w = np.asarray(src[name])
        if fmt in ("nf4", "fp4"):
            packed, st = qc.quantize_4bit(w, 64, fmt, True)
            want = qc.dequantize_4bit(packed, st, out_dtype="float32")
        elif fmt == "nvfp4":
            g = np.array([qc.nvfp4_global_scale(float(np.abs(w.astype(np.float32)).max()))], np.float32)
            want = api_mx.dequantize_nvfp4(*api_mx.scaled_nvfp4_quant(w, g, swizzle=False), g, swizzled=False)
        else:
            want = api_mx.dequantize_mxfp4(*api_mx.scaled_mxfp4_quant(w, swizzle=False), swizzled=False)
        assert np.array_equal(got, np.asarray(want)), name
    t, _ = load_safetensors(out)
    assert np.array_equal(t["lm_head.weight"], src["lm_head.weight"])


def test_usage_errors_are_one_line(model_file, tmp_path, capsys):
    for argv in (["--format", "q5_k"], ["--format", "nf4", "--blocksize", "x"], []):
        with pytest.raises(SystemExit) as e:
            main(["quantize", str(model_file), "-o", str(tmp_path / "o"), *argv])
        assert e.value.code == 2
        _one_line_error(capsys)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100KB") == 10**5
    assert parse_size("123") == 123
    for bad in ("", "5 parsecs", "0", "-1GB"):
        with pytest.raises(ParameterError):
            parse_size(bad)


# -- safe writes -----------------------------------------------------------------------------------------------
def _leftovers(folder):
    return [p for p in os.listdir(folder) if "quantcore-tmp" in p or "quantcore-old" in p or p.endswith(".data")]


def test_existing_output_needs_force(model_file, tmp_path, capsys):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous")
    assert main(["quantize", str(model_file), "-o", str(out), "--format", "nf4", "-q"]) == 2
    assert "--force" in _one_line_error(capsys) and out.read_bytes() == b"previous"
    assert main(["quantize", str(model_file), "-o", str(out), "--format", "nf4", "-q", "--force"]) == 0
    assert load_safetensors(out)[1]["quantcore.format"] == "nf4" and not _leftovers(tmp_path)


def test_output_equal_to_or_inside_an_input_refused(model_file, tmp_path, capsys):
    for dst in (model_file, tmp_path / "." / model_file.name):
        assert main(["quantize", str(dst), "-o", str(model_file), "--format", "nf4", "-q", "--force"]) == 2
        assert "is (or contains) the input" in _one_line_error(capsys)
    link = tmp_path / "link.safetensors"
    os.link(model_file, link)  # the same file under another name
    assert main(["quantize", str(model_file), "-o", str(link), "--format", "nf4", "-q", "--force"]) == 2
    _one_line_error(capsys)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(model_file.read_bytes())
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="inside the input folder"):
        quantize_checkpoint(folder, folder / "out", "nf4", progress=False)
    with pytest.raises(CheckpointError, match="contains"):  # --force would delete the input
        quantize_checkpoint(folder, tmp_path, "nf4", progress=False, force=True)
    assert os.path.exists(model_file) and model_file.stat().st_size > 1000


def test_unwritable_output_refused_before_any_work(model_file, tmp_path, monkeypatch, capsys):
    from quantcore import convert

    monkeypatch.setattr(convert, "_convert", lambda *a, **k: pytest.fail("work started"))
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "no" / "o.safetensors"), "--format", "nf4"]) == 2
    assert "does not exist" in _one_line_error(capsys)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real_access(p, mode))
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "o.safetensors"), "--format", "nf4"]) == 2
    assert "not writable" in _one_line_error(capsys)


def test_bad_backend_refused_before_any_work(model_file, tmp_path, capsys):
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "o.safetensors"), "--format", "nf4",
                 "--backend", "nosuch"]) == 2
    assert "nosuch" in _one_line_error(capsys) and not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("fail_at", [0, 3])
def test_full_disk_leaves_the_previous_output(model_file, tmp_path, monkeypatch, capsys, fail_at):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous")
    calls = []
    real_add = ShardWriter.add

    def add(self, name, a):
        calls.append(name)
        if len(calls) > fail_at:
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return real_add(self, name, a)

    monkeypatch.setattr(ShardWriter, "add", add)
    assert main(["quantize", str(model_file), "-o", str(out), "--format", "nf4", "-q", "--force"]) == 2
    assert "no space left on the device" in _one_line_error(capsys)
    assert out.read_bytes() == b"previous" and _leftovers(tmp_path) == []


def test_error_mid_folder_leaves_the_previous_folder(model_file, tmp_path, monkeypatch, capsys):
    from quantcore import convert

    out = tmp_path / "o.safetensors"
    monkeypatch.setattr(convert, "_quantize_bnb", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    assert main(["quantize", str(model_file), "-o", str(out), "--format", "nf4", "-q"]) == 2
    assert "RuntimeError: injected" in _one_line_error(capsys)
    assert not out.exists() and _leftovers(tmp_path) == []


_SLOW_RUN = """
import sys, time
from quantcore.io import ShardWriter
real = ShardWriter.add
def add(self, name, a):
    print("writing", flush=True)
    time.sleep(0.5)
    return real(self, name, a)
ShardWriter.add = add
from quantcore.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def _slow_subprocess(model_file, out):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-c", _SLOW_RUN, "quantize", str(model_file), "-o", str(out), "--format",
                          "nf4", "-q", "--force"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "writing"  # mid-way: the temporary output exists
    assert any("quantcore-tmp" in n for n in os.listdir(out.parent))
    return p


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_leaves_the_previous_output_and_no_temporaries(model_file, tmp_path, sig):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous")
    p = _slow_subprocess(model_file, out)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2 and err.strip().splitlines()[-1].startswith("quantcore: error: interrupted")
    assert out.read_bytes() == b"previous" and _leftovers(tmp_path) == []


def test_killed_run_leaves_the_output_and_the_next_run_cleans_up(model_file, tmp_path):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"previous")
    p = _slow_subprocess(model_file, out)
    p.kill()
    p.wait(timeout=60)
    assert out.read_bytes() == b"previous" and _leftovers(tmp_path)  # SIGKILL: nothing can clean up
    assert main(["quantize", str(model_file), "-o", str(out), "--format", "nf4", "-q", "--force"]) == 0
    assert _leftovers(tmp_path) == [] and load_safetensors(out)[1]["quantcore.format"] == "nf4"


# -- progress and summary ----------------------------------------------------------------------------------------
def test_plain_progress_without_tqdm(model_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "o.safetensors"), "--format", "nf4"]) == 0
    err = capsys.readouterr().err
    assert "6/6 tensors" in err and "MiB" in err and "kept unquantized:" in err


def test_tqdm_progress_counts_bytes_and_tensors(model_file, tmp_path, capsys):
    pytest.importorskip("tqdm", reason="tqdm is not installed: the plain fallback is tested above")
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "o.safetensors"), "--format", "nf4"]) == 0
    err = capsys.readouterr().err
    assert "6/6 tensors" in err and "quantize in.safetensors -> nf4" in err


# -- GGUF dispatch ------------------------------------------------------------------------------------------------
def test_gguf_without_the_reader_is_a_clear_error(tmp_path, monkeypatch, capsys):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "quantcore.io.gguf", None)
    assert main(["quantize", str(src), "-o", str(tmp_path / "o.gguf"), "--format", "q4_0"]) == 2
    assert _one_line_error(capsys) == "quantcore: error: GGUF support is not installed in this build"


def test_gguf_dispatch_writes_atomically(tmp_path, monkeypatch, capsys):
    import types

    seen = []

    def requantize_gguf(src, dst, fmt, *, pure=False, backend=None, progress=True, allow_requantize=False):
        seen.append((src, dst, fmt, pure))
        assert "quantcore-tmp" in dst and not os.path.exists(dst)
        if fmt == "q8_0" and not pure:
            with open(dst, "wb") as f:
                f.write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        with open(dst, "wb") as f:
            f.write(f"new {fmt} {pure}".encode())

    monkeypatch.setitem(sys.modules, "quantcore.io.gguf", types.SimpleNamespace(requantize_gguf=requantize_gguf))
    src, out = tmp_path / "m.gguf", tmp_path / "o.gguf"
    src.write_bytes(b"GGUF")
    assert main(["quantize", str(src), "-o", str(out), "--format", "q4_0", "--pure"]) == 0
    assert out.read_bytes() == b"new q4_0 True" and seen[-1][2:] == ("q4_0", True)
    assert capsys.readouterr().err.strip() == f"wrote {out} (q4_0, pure)"
    assert main(["quantize", str(src), "-o", str(out), "--format", "q4_0"]) == 2
    assert "--force" in _one_line_error(capsys)
    assert main(["quantize", str(src), "-o", str(out), "--format", "q8_0", "--force"]) == 2
    assert "no space left" in _one_line_error(capsys)
    assert out.read_bytes() == b"new q4_0 True" and _leftovers(tmp_path) == []
    assert main(["quantize", str(src), "-o", str(src), "--format", "q8_0", "--force"]) == 2
    assert "the input" in _one_line_error(capsys)
    assert main(["quantize", str(src), "-o", str(tmp_path / "x.gguf"), "--format", "nf4"]) == 2
    assert "q4_0 / q8_0 only" in _one_line_error(capsys)
    assert main(["quantize", str(src), "-o", str(tmp_path / "x.gguf"), "--format", "q4_0", "--skip", "x"]) == 2
    assert "--skip" in _one_line_error(capsys)
    n = len(seen)
    assert main(["quantize", str(tmp_path / "missing.gguf"), "-o", str(tmp_path / "y.gguf"), "--format", "q4_0"]) == 2
    assert "does not exist" in _one_line_error(capsys) and len(seen) == n


def test_pure_and_gguf_formats_need_a_gguf_input(model_file, tmp_path):
    with pytest.raises(ParameterError, match="--pure"):
        quantize_checkpoint(model_file, tmp_path / "o.safetensors", "nf4", pure=True)
    with pytest.raises(UnsupportedError, match="convert_hf_to_gguf.py"):
        quantize_checkpoint(model_file, tmp_path / "o.gguf", "q8_0")
    from quantcore.formats import GGUF_FORMATS, QUANTIZE_FORMATS, WEIGHT_FORMATS

    assert set(QUANTIZE_FORMATS) == set(WEIGHT_FORMATS) | set(GGUF_FORMATS) and "q8_0" in QUANTIZE_FORMATS


# -- any size: streaming under a memory limit ------------------------------------------------------------------------
_LIMITED = """
import resource, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
from quantcore.cli import main
raise SystemExit(main(sys.argv[2:]))
"""

_BASELINE = """
import resource, numpy, quantcore, quantcore.cli, quantcore.convert, quantcore.api_mx, json
print(json.dumps(open("/proc/self/status").read().split("VmPeak:")[1].split()[0]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
@pytest.mark.parametrize("fmt", ["nf4", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_checkpoint_larger_than_the_memory_limit(tmp_path, fmt):
    env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    base_kb = int(json.loads(subprocess.run([sys.executable, "-c", _BASELINE], capture_output=True, text=True,
                                            env=env, check=True).stdout))
    # 20 tensors of 16 MB: 320 MB on disk; the process may hold 160 MB beyond what importing takes
    src = tmp_path / "big"
    src.mkdir()
    rng = np.random.default_rng(0)
    block = (rng.standard_normal((1024, 4096)) * 0.02).astype(np.float32)
    n = 20
    with open(src / "in.safetensors", "wb") as f:
        header = {f"layers.{i}.proj.weight": {"dtype": "F32", "shape": [1024, 4096],
                                               "data_offsets": [i * block.nbytes, (i + 1) * block.nbytes]}
                  for i in range(n)}
        raw = json.dumps(header).encode()
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i in range(n):
            block[0, 0] = i
            f.write(block.tobytes())
    size = os.path.getsize(src / "in.safetensors")
    limit = base_kb * 1024 + 160 * 2**20
    assert size > limit - base_kb * 1024
    out = tmp_path / "o.safetensors"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _LIMITED, str(limit), "quantize", str(src / "in.safetensors"), "-o",
                        str(out), "--format", fmt, "-q"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{n} of {n} tensors quantized" in r.stderr
    # the limit is real: holding the checkpoint in memory fails under it
    hold = "import numpy as np, sys; a = np.fromfile(sys.argv[3], np.uint8); a += 1"
    r2 = subprocess.run([sys.executable, "-c", _LIMITED.replace("from quantcore.cli import main\nraise SystemExit("
                                                                "main(sys.argv[2:]))", hold), str(limit), "x",
                         str(src / "in.safetensors")], capture_output=True, text=True, env=env, timeout=120)
    assert r2.returncode != 0 and "MemoryError" in r2.stderr
    back = read_quantized(str(out))["layers.7.proj.weight"]
    assert back[0, 0] != 0 and back.shape == (1024, 4096)
    assert time.perf_counter() - t0 < 120


# -- device backends ---------------------------------------------------------------------------------------------------
_DEVICES = {name: availability(name) for name in ("sycl", "cuda", "maca")}


@pytest.mark.parametrize("backend", list(_DEVICES))
@pytest.mark.parametrize("fmt", ["nf4", "nvfp4", "mxfp4"])
def test_device_backend_gives_the_cpu_bytes(model_file, tmp_path, monkeypatch, fmt, backend):
    """--backend and QUANTCORE_BACKEND move each tensor to the device and back: the cpu's bytes."""
    if not _DEVICES[backend]:
        pytest.skip(f"{backend} backend unavailable: {_DEVICES[backend].reason}")
    quantize_checkpoint(model_file, tmp_path / "cpu.safetensors", fmt, backend="cpu", progress=False)
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "dev.safetensors"), "--format", fmt, "-q",
                 "--backend", backend]) == 0
    monkeypatch.setenv("QUANTCORE_BACKEND", backend)
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "env.safetensors"), "--format", fmt, "-q"]) == 0
    ref = (tmp_path / "cpu.safetensors").read_bytes()
    assert (tmp_path / "dev.safetensors").read_bytes() == ref and (tmp_path / "env.safetensors").read_bytes() == ref


def test_get_whole_maps_the_same_bytes(model_file, monkeypatch):
    """get(name, whole=True) asks the kernel to map the tensor's pages up front (MADV_POPULATE_READ);
    the array is the same, and an OS that declines the advice (here: an unknown advice number)
    changes nothing."""
    import quantcore.io as qio

    f = SafetensorsFile(model_file)
    for name in f.names:
        assert np.array_equal(f.get(name, whole=True).view(np.uint8), f.get(name).view(np.uint8))
    monkeypatch.setattr(qio, "_POPULATE_READ", 12345)
    name = next(iter(f.names))
    assert np.array_equal(f.get(name, whole=True).view(np.uint8), f.get(name).view(np.uint8))


@pytest.mark.parametrize("fmt", ["nf4", "nvfp4"])
def test_workers_write_the_bytes_of_one_process(model_file, tmp_path, fmt):
    """--workers N quantizes tensors in N processes and writes them in the plan's order: the output
    equals one process's byte for byte (a file, and a folder of several shards)."""
    quantize_checkpoint(model_file, tmp_path / "one.safetensors", fmt, progress=False)
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "two.safetensors"), "--format", fmt, "-q",
                 "--workers", "2"]) == 0
    assert (tmp_path / "two.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()


@pytest.mark.parametrize("fmt", ["nf4", "nvfp4"])
def test_devices_threads_write_the_bytes_of_one_worker(model_file, tmp_path, fmt):
    """--devices: worker threads in this process, two per GPU (the first GPU's twice as many where
    there is only one), results written in the plan's order: the bytes of a single worker."""
    if not _DEVICES["cuda"]:
        pytest.skip(f"cuda backend unavailable: {_DEVICES['cuda'].reason}")
    devs = "cuda:0,cuda:1" if len(qc.get_backend("cuda").devices()) > 1 else "cuda:0,cuda:0"
    for name, d in (("one", "cuda:0"), ("two", devs)):
        assert main(["quantize", str(model_file), "-o", str(tmp_path / f"{name}.safetensors"), "--format", fmt, "-q",
                     "--devices", d]) == 0
    quantize_checkpoint(model_file, tmp_path / "cpu.safetensors", fmt, backend="cpu", progress=False)
    ref = (tmp_path / "cpu.safetensors").read_bytes()
    assert (tmp_path / "one.safetensors").read_bytes() == ref and (tmp_path / "two.safetensors").read_bytes() == ref


def test_workers_and_devices_are_checked(model_file, tmp_path, capsys):
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "x.safetensors"), "--format", "nf4",
                 "--workers", "0"]) == 2
    assert "workers" in _one_line_error(capsys)
    assert main(["quantize", str(model_file), "-o", str(tmp_path / "x.safetensors"), "--format", "nf4",
                 "--devices", "cuda:x"]) == 2
    assert "--devices" in _one_line_error(capsys)
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("reserve", [0, 4096, 40])
def test_shard_writer_header_room_and_background_flushes(tmp_path, monkeypatch, reserve):
    """ShardWriter with header room writes the data once, straight into the file, and puts a
    space-padded header in the room; a header that outgrows it (40 bytes) or no room falls back to
    the data file and a copy. Flushes to the disk run in the background while it writes (here every
    KiB). Every way, safetensors' own reader and ours give the tensors back."""
    from safetensors.numpy import load_file

    monkeypatch.setattr(ShardWriter, "SYNC_BYTES", 1024)
    rng = np.random.default_rng(3)
    tensors = {f"t{i}": rng.standard_normal((17, 33 + i)).astype(np.float32) for i in range(6)}
    tensors["codes"] = rng.integers(0, 256, 1000, dtype=np.uint8)
    path = str(tmp_path / "s.safetensors")
    w = ShardWriter(path, {"format": "pt"}, reserve=reserve)
    for name, a in tensors.items():
        w.add(name, a)
    assert os.path.exists(path + ".data") == (reserve == 0)  # with room the data goes straight into the file
    w.close()
    assert not os.path.exists(path + ".data")
    header_len = int(np.frombuffer(open(path, "rb").read(8), "<u8")[0])
    assert header_len == (4096 if reserve == 4096 else header_len) and header_len % 8 == 0
    if reserve != 4096:
        assert header_len < 4096 // 4  # compact: no room was kept
    back = load_file(path)
    assert back.keys() == tensors.keys() and all(np.array_equal(back[k], v) for k, v in tensors.items())
    f = SafetensorsFile(path)
    assert all(np.array_equal(f.get(k), v) for k, v in tensors.items()) and f.metadata == {"format": "pt"}


def test_shard_writer_abort_removes_its_files(tmp_path):
    for reserve in (0, 1024):
        path = str(tmp_path / f"a{reserve}.safetensors")
        w = ShardWriter(path, reserve=reserve)
        w.add("x", np.ones(1000, np.float32))
        w.abort()
        assert not os.path.exists(path) and not os.path.exists(path + ".data")
