"""``quantcore quantize``: checkpoints in, checkpoints that the ecosystem's loaders read out.

Inputs: a transformers model folder (config.json, ``model.safetensors`` or shards with
``model.safetensors.index.json``), a single ``.safetensors`` file, or a ``.gguf`` file (handed to
:func:`quantcore.io.gguf.requantize_gguf`). Outputs (docs/checkpoints.md has the details):

- nf4 / fp4: bitsandbytes' 4-bit layout (``W`` packed uint8, ``W.absmax``, ``W.quant_map``,
  ``W.nested_absmax``, ``W.nested_quant_map``, ``W.quant_state.bitsandbytes__<type>``) and, for a
  folder, the ``quantization_config`` transformers writes for ``BitsAndBytesConfig(load_in_4bit=True,
  bnb_4bit_use_double_quant=True)``: ``from_pretrained`` loads it with bitsandbytes installed.
- nvfp4: compressed-tensors' ``nvfp4-pack-quantized`` layout (``weight_packed``, ``weight_scale``
  F8_E4M3, ``weight_global_scale``), weight-only (NVFP4A16), with its quantization_config.
- mxfp4: OpenAI gpt-oss' layout (``<param>_blocks`` uint8 [..., K/32, 16], ``<param>_scales``
  E8M0 bytes) with ``quant_method: mxfp4``; a folder must be a gpt-oss model (transformers reads
  this layout only there).
- q4_0 / q8_0: a GGUF input only (llama.cpp's rules, through quantcore.io.gguf).

The conversion streams: one tensor is read (memory-mapped, its own byte range only), quantized
(MX formats in row chunks), written to the current shard's data file and dropped; shards close at
``max_shard_size``. Everything is written into a temporary name beside the output and renamed at
the end (:mod:`quantcore.io.atomic`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import api, registry
from . import validate as v
from .arrays import FLOAT_DTYPES, as_dtype
from .errors import CheckpointError, ParameterError, UnsupportedError
from .formats import GGUF_FORMATS, QUANTIZE_FORMATS, bnb, mx
from .io import ShardWriter
from .io.atomic import AtomicOutput, check_output, sigterm_raises
from .io.checkpoint import (
    INDEX_NAME,
    SINGLE_NAME,
    Checkpoint,
    Selection,
    open_checkpoint,
    select_by_name,
    select_from_config,
)
from .progress import Progress

DEFAULT_MAX_SHARD_SIZE = "5GB"
#: elements per chunk of rows quantized at once (MX formats): bounds the temporaries to a few tens of MB
CHUNK_ELEMENTS = 1 << 20
F8_E4M3 = as_dtype("float8_e4m3fn")


def parse_size(text: str | int) -> int:
    """"5GB", "500MB", "2GiB", "1000" -> bytes (decimal units as transformers reads them)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
        if not m:
            raise ParameterError(f"max shard size {text!r}: give a number of bytes or e.g. 500MB, 5GB, 2GiB")
        unit = m.group(2).rstrip("B") or ""
        mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
        size = int(float(m.group(1)) * mult)
    if size <= 0:
        raise ParameterError(f"max shard size must be positive, got {text!r}")
    return size


# -- quantizing one tensor -----------------------------------------------------------------------------------------
class _Mover:
    """Moves arrays to the backend and back (the cpu backend takes numpy as it is)."""

    def __init__(self, backend: Any):
        name = backend if isinstance(backend, str) or backend is None else None
        self.be = backend if name is None and backend is not None else registry.get_backend(name)
        self.host = self.be.name == "cpu"

    def to(self, a: np.ndarray) -> Any:
        a = np.ascontiguousarray(a)
        return a if self.host else self.be.finish(self.be.from_numpy(a), None)

    def back(self, x: Any) -> np.ndarray:
        return np.asarray(x) if self.host else self.be.to_numpy(self.be.prepare(x))


def _quantize_bnb(name: str, a: np.ndarray, fmt: str, blocksize: int, mv: _Mover) -> dict[str, np.ndarray]:
    from .state import QuantState

    packed, st = api.quantize_4bit(mv.to(a), blocksize, fmt, True, backend=mv.be)
    host = QuantState(absmax=mv.back(st.absmax), shape=st.shape, code=mv.back(st.code), blocksize=st.blocksize,
                      quant_type=st.quant_type, dtype=st.dtype, offset=mv.back(st.offset),
                      state2=QuantState(absmax=mv.back(st.state2.absmax), code=mv.back(st.state2.code),
                                        blocksize=st.state2.blocksize, dtype="float32"))
    out = {name: mv.back(packed)}
    for key, value in host.as_dict(packed=True).items():
        out[f"{name}.{key}"] = np.asarray(value)
    return out


def _row_chunks(rows: int, k: int):
    step = max(1, CHUNK_ELEMENTS // max(k, 1))
    for r in range(0, rows, step):
        yield r, min(rows, r + step)


def _amax(a2: np.ndarray) -> float:
    m = 0.0
    for r0, r1 in _row_chunks(a2.shape[0], a2.shape[1]):
        m = max(m, float(np.abs(a2[r0:r1].astype(np.float32)).max()))
    return m


def _quantize_mx_rows(a2: np.ndarray, fmt: str, g: Any, mv: _Mover) -> tuple[np.ndarray, np.ndarray]:
    from . import api_mx

    rows, k = a2.shape
    blk = mx.block_size(fmt)
    codes = np.empty((rows, k // 2), np.uint8)
    scales = np.empty((rows, k // blk), np.uint8)
    gd = None if g is None else mv.to(np.asarray([g], np.float32))
    for r0, r1 in _row_chunks(rows, k):
        c, s = api_mx.quantize_mx(mv.to(a2[r0:r1]), fmt, global_scale=gd, swizzle=False, backend=mv.be)
        codes[r0:r1], scales[r0:r1] = mv.back(c), mv.back(s)
    return codes, scales


def _quantize_nvfp4(name: str, a: np.ndarray, mv: _Mover) -> dict[str, np.ndarray]:
    g = np.float32(mx.nvfp4_global_scale(_amax(a)))
    codes, scales = _quantize_mx_rows(a, "nvfp4", g, mv)
    base = name.removesuffix(".weight") + "."
    return {base + "weight_packed": codes, base + "weight_scale": scales.view(F8_E4M3),
            base + "weight_global_scale": np.asarray([g], np.float32)}


def _quantize_mxfp4(name: str, a: np.ndarray, mv: _Mover, experts: bool) -> dict[str, np.ndarray]:
    nb, per = mx.MX_BLOCK, mx.MX_BLOCK // 2  # E2M1 codes of a block: 32 elements in 16 bytes
    if experts:  # gpt-oss keeps [E, K, N] in memory and [E, N, K/32, 16] on disk
        e, k, n = a.shape
        blocks = np.empty((e, n, k // nb, per), np.uint8)
        scales = np.empty((e, n, k // nb), np.uint8)
        for i in range(e):
            c, s = _quantize_mx_rows(np.ascontiguousarray(a[i].T), "mxfp4", None, mv)
            blocks[i], scales[i] = c.reshape(n, k // nb, per), s
    else:
        rows, k = a.shape
        c, scales = _quantize_mx_rows(a, "mxfp4", None, mv)
        blocks = c.reshape(rows, k // nb, per)
    return {f"{name}_blocks": blocks, f"{name}_scales": scales}


def _quantize_tensor(name: str, a: np.ndarray, fmt: str, blocksize: int, mv: _Mover, experts: bool
                     ) -> dict[str, np.ndarray]:
    if fmt in bnb.QUANT_TYPES:
        return _quantize_bnb(name, a, fmt, blocksize, mv)
    if fmt == "nvfp4":
        return _quantize_nvfp4(name, a, mv)
    return _quantize_mxfp4(name, a, mv, experts)


# -- conversion spread over workers (--workers N: processes; --devices cuda:0,cuda:1: threads) ------------
#: worker threads per GPU of --devices, at least: the host's copy of a tensor into pinned memory and its
#: upload take most of a thread's time, so a second thread on the same GPU overlaps them (measured on two
#: H200s, 6.98 GB of bf16 to nf4 in a started process: one GPU 1.85 s with one thread, 1.18 s with two;
#: two GPUs 1.19 s with one thread each, 1.00 s with two; docs/parallel.md)
THREADS_PER_DEVICE = 2
#: the calling worker's state: its backend mover and open files (one per process, or per thread)
_WORKER = threading.local()
#: worker threads set themselves up one at a time: the first import of a GPU package (torch) by two
#: threads at once let one of them see it partly initialized (seen on the 2-GPU machine)
_INIT_LOCK = threading.Lock()


def _worker_init(backend: Any, devices: Any = None) -> None:
    """A worker: its backend and, for a thread of ``--devices``, its GPU (one of ``devices``, taken
    in turn through a queue), made the backend's current device for that thread."""
    with _INIT_LOCK:
        _WORKER.mover = _Mover(backend)
        if devices is not None:
            _WORKER.mover.be.use_device(int(devices.get()))
    _WORKER.files = {}


def _worker_quantize(task: tuple) -> dict[str, np.ndarray]:
    path, name, fmt, blocksize, experts = task
    from .io import SafetensorsFile

    files = _WORKER.files
    f = files.get(path)
    if f is None:
        f = files[path] = SafetensorsFile(path)
    return _quantize_tensor(name, f.get(name, whole=True), fmt, blocksize, _WORKER.mover, experts)


class _Pool:
    """Tensors quantized by ``workers`` workers, results taken back in the plan's order (so the
    output is the one a single worker writes, byte for byte); at most 2 x workers in flight.
    With ``devices`` the workers are threads of this process, each on a GPU (taken in turn):
    no start-up and no copies between processes (the copies to and from the GPUs and the
    kernels run outside the interpreter's lock); else processes (the cpu backend)."""

    def __init__(self, workers: int, backend: Any, devices: list[str] | None):
        import concurrent.futures

        backend_name = backend if isinstance(backend, str) or backend is None else backend.name
        if devices:
            import queue

            ids: Any = queue.SimpleQueue()
            for i in range(workers):
                ids.put(devices[i % len(devices)].split(":")[-1])
            self.ex = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="quantcore-convert",
                                                            initializer=_worker_init,
                                                            initargs=(backend_name, ids))
        else:
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")  # no CUDA context or threads inherited
            self.ex = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                                                             initargs=(backend_name,))
        self.depth = 2 * workers
        self.pending: list[Any] = []

    def results(self, tasks: list[tuple]):
        """Yields each task's result in order."""
        it = iter(tasks)
        for t in it:
            self.pending.append(self.ex.submit(_worker_quantize, t))
            if len(self.pending) >= self.depth:
                break
        for t in it:
            yield self.pending.pop(0).result()
            self.pending.append(self.ex.submit(_worker_quantize, t))
        while self.pending:
            yield self.pending.pop(0).result()

    def close(self) -> None:
        for f in self.pending:
            f.cancel()
        self.ex.shutdown(wait=True, cancel_futures=True)


def parse_devices(text: str | None) -> list[str] | None:
    """``--devices cuda:0,cuda:1`` -> ["cuda:0", "cuda:1"] (None when not given)."""
    if text is None:
        return None
    devs = [d.strip() for d in str(text).split(",") if d.strip()]
    bad = [d for d in devs if not (d.split(":")[-1].isdigit() and (":" not in d or d.split(":")[0] in ("cuda", "gpu")))]
    if not devs or bad:
        raise ParameterError(f"--devices takes a comma-separated list such as cuda:0,cuda:1, got {text!r}")
    return devs


def _out_bytes(fmt: str, shape: tuple[int, ...], blocksize: int) -> int:
    n = math.prod(shape)
    if fmt in bnb.QUANT_TYPES:
        nb = bnb.nblocks(n, blocksize)
        return (n + 1) // 2 + nb + 4 * bnb.nblocks(nb, bnb.NESTED_BLOCKSIZE) + 64 + 1024 + 256
    return n // 2 + n // mx.block_size(fmt) + 4


def _header_room(items: list, meta: dict[str, str]) -> int:
    """Bytes of safetensors header that a shard of (at most) these items needs, generously: up to 9
    entries per quantized tensor (bitsandbytes' weight, absmax, quant_map, nested statistics, quant
    state; fewer for MX), each its name, a suffix and the dtype, shape and offsets."""
    per = sum((9 if it.action == "quantize" else 1) * (len(it.name) + 192) for it in items)
    return 256 + len(json.dumps(meta)) + per


# -- the plan ------------------------------------------------------------------------------------------------------
@dataclass
class Item:
    name: str
    action: str  # "quantize" | "copy"
    reason: str = ""
    experts: bool = False


@dataclass
class Summary:
    """What a conversion did (also printed)."""

    output: str
    fmt: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # tensor -> why it stayed as it was
    shards: list[str] = field(default_factory=list)
    in_bytes: int = 0
    out_bytes: int = 0

    def lines(self) -> list[str]:
        out = [f"wrote {self.output}: {len(self.quantized)} of {len(self.quantized) + len(self.kept)} tensors "
               f"quantized to {self.fmt}, {self.in_bytes / 2**20:.1f} MiB -> {self.out_bytes / 2**20:.1f} MiB"
               + (f" in {len(self.shards)} shards" if len(self.shards) > 1 else "")]
        if self.kept:
            out.append("kept unquantized:")
            by_reason: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
            for name, why in self.kept.items():
                by_reason[why][re.sub(r"\.\d+\.", ".N.", name)] += 1
            for why, names in sorted(by_reason.items()):
                listed = ", ".join(f"{n} (x{c})" if c > 1 else n for n, c in sorted(names.items()))
                out.append(f"  {why}: {listed}")
        return out


def _plan(ckpt: Checkpoint, sel: Selection, fmt: str) -> list[Item]:
    blk = mx.block_size(fmt) if fmt in mx.FP4_FORMATS else 1
    targets = {f"{m}.weight": m for m in sel.linear}
    kept_layers = {f"{m}.weight": why for m, why in sel.kept.items()}
    experts = set(sel.experts)
    items = []
    missing = sorted(set(targets) - set(ckpt.tensors))
    if missing:
        raise CheckpointError(f"{ckpt.path}: the model has linear layer {targets[missing[0]]!r} but the checkpoint "
                              f"has no {missing[0]!r} (its tensor names do not follow the model's modules)")
    for name in sorted(ckpt.tensors):
        info = ckpt.tensors[name].info
        if fmt == "mxfp4" and ckpt.is_folder:
            if name in experts:
                if info.dtype not in FLOAT_DTYPES or len(info.shape) != 3 or info.shape[1] % mx.MX_BLOCK:
                    raise CheckpointError(f"{name}: a gpt-oss expert tensor of shape {info.shape} {info.dtype} "
                                          "cannot be MXFP4 (needs float [E, K, N], K a multiple of 32)")
                items.append(Item(name, "quantize", experts=True))
            else:
                items.append(Item(name, "copy", "gpt-oss keeps it in bf16 (only the MoE experts are MXFP4)"))
            continue
        if name in targets:
            if info.dtype not in FLOAT_DTYPES:
                items.append(Item(name, "copy", f"not a float16/bfloat16/float32 tensor ({info.dtype})"))
            elif info.shape[-1] % blk:
                items.append(Item(name, "copy", f"in_features {info.shape[-1]} is not a multiple of {fmt}'s "
                                                f"block of {blk}"))
            else:
                items.append(Item(name, "quantize"))
        elif name in kept_layers:
            items.append(Item(name, "copy", kept_layers[name]))
        else:
            items.append(Item(name, "copy", "not a linear layer's weight (embedding, norm, bias, buffer)"
                              if ckpt.is_folder else "not a 2-D float weight"))
    return items


# -- configs ---------------------------------------------------------------------------------------------------------
def bnb_quantization_config(fmt: str, skip: list[str] | None, compute_dtype: str = "float32") -> dict[str, Any]:
    """The ``quantization_config`` transformers writes for ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type=fmt, bnb_4bit_use_double_quant=True, llm_int8_skip_modules=skip)`` (its
    default compute dtype float32 and quant storage uint8)."""
    return {
        "_load_in_4bit": True, "_load_in_8bit": False, "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": fmt, "bnb_4bit_use_double_quant": True,
        "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": skip, "llm_int8_threshold": 6.0, "load_in_4bit": True, "load_in_8bit": False,
        "quant_method": "bitsandbytes",
    }


def nvfp4_quantization_config(ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors' config for NVFP4 weights (group 16, tensor_group strategy with a global
    scale), no activation quantization, stored ``nvfp4-pack-quantized``."""
    weights = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": mx.NVFP4_BLOCK, "strategy": "tensor_group",
               "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed", "global_compression_ratio": None,
        "kv_cache_scheme": None, "sparsity_config": {}, "ignore": ignore,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "nvfp4-pack-quantized"}},
    }


def mxfp4_quantization_config() -> dict[str, Any]:
    """The config OpenAI's gpt-oss checkpoints carry: everything but the MoE experts stays bf16."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


# -- the conversion ----------------------------------------------------------------------------------------------------
def _is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def quantize_checkpoint(src: str, dst: str, fmt: str, *, blocksize: int = 64, backend: Any = None,
                        skip: list[str] | tuple[str, ...] = (), max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                        force: bool = False, pure: bool = False, progress: bool = True,
                        min_numel: int = 4096, allow_requantize: bool = False, workers: int = 1,
                        devices: str | list[str] | None = None) -> Summary | None:
    """Quantize ``src`` into ``dst`` (see the module docstring); returns the :class:`Summary`
    (None for a GGUF input). Raises a :class:`quantcore.QuantcoreError` subclass before any work for
    a bad request, and leaves ``dst`` as it was on any failure."""
    if fmt not in QUANTIZE_FORMATS:
        raise ParameterError(f"unknown format {fmt!r}; one of {', '.join(QUANTIZE_FORMATS)}")
    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.exists(src):
        raise CheckpointError(f"{src} does not exist")
    if _is_gguf(src):
        if workers != 1 or devices is not None:
            raise ParameterError("--workers / --devices apply to safetensors inputs (a GGUF is requantized in one process)")
        if skip:
            raise ParameterError("--skip applies to safetensors inputs; a GGUF follows llama-quantize's rules")
        return _quantize_gguf(src, dst, fmt, pure=pure, backend=backend, progress=progress, force=force,
                              allow_requantize=allow_requantize)
    if fmt in GGUF_FORMATS:
        raise UnsupportedError(
            f"--format {fmt} writes GGUF, and only from a GGUF input: a GGUF that llama.cpp runs needs the "
            "model's architecture, hyperparameters and tokenizer. Convert first with llama.cpp's "
            "convert_hf_to_gguf.py (e.g. `python convert_hf_to_gguf.py MODEL_DIR --outtype f16 --outfile "
            f"IN.gguf`), then run `quantcore quantize IN.gguf -o OUT.gguf --format {fmt}`")
    if pure or allow_requantize:
        raise ParameterError("--pure and --allow-requantize apply to a GGUF input only")
    if fmt in bnb.QUANT_TYPES and blocksize not in bnb.BLOCKSIZES_4BIT:
        raise ParameterError(f"{fmt} blocksize must be one of {bnb.BLOCKSIZES_4BIT}, got {blocksize}")
    shard_limit = parse_size(max_shard_size)
    devs = devices if isinstance(devices, list) else parse_devices(devices)
    nworkers = v.positive_int(workers, "workers")
    if devs is not None:  # threads: at least THREADS_PER_DEVICE per GPU (one uploads while another waits)
        nworkers = max(nworkers, THREADS_PER_DEVICE * len(devs))
        backend = backend or "cuda"
    mover = _Mover(backend)  # BackendUnavailableError now, before any work
    ckpt = open_checkpoint(src)
    if ckpt.config is not None and "quantization_config" in ckpt.config:
        qm = ckpt.config["quantization_config"]
        raise CheckpointError(f"{src} is already quantized (quant_method "
                              f"{qm.get('quant_method') if isinstance(qm, dict) else qm!r}); give a float checkpoint")
    if ckpt.is_folder and ckpt.config is None:
        raise CheckpointError(f"{src}: a model folder needs its config.json (to know which layers are linear)")
    if os.path.isdir(dst) != ckpt.is_folder and os.path.lexists(dst):
        what = "a folder" if ckpt.is_folder else "a file"
        raise CheckpointError(f"{dst} exists and is not {what}, as the output of {src} would be")
    check_output(dst, [src, *ckpt.files], force=force)
    skip = list(skip)
    if ckpt.is_folder:
        sel = select_from_config(ckpt, skip)
        if fmt == "mxfp4" and sel.model_type != "gpt_oss":
            raise UnsupportedError(
                f"a model folder in mxfp4 is written in OpenAI's gpt-oss layout, which transformers reads for "
                f"gpt-oss models only (this one is {sel.model_type!r}); use --format nvfp4 (compressed-tensors) "
                "or quantize a single .safetensors file")
        if fmt == "mxfp4" and not sel.experts:
            raise CheckpointError(f"{src}: no gpt-oss expert weights found in the model transformers builds")
        if fmt == "mxfp4" and skip:
            raise ParameterError("--skip does not apply to mxfp4 gpt-oss folders (only the MoE experts are MXFP4)")
    else:
        sel = select_by_name(ckpt, skip, min_numel)
    items = _plan(ckpt, sel, fmt)
    with sigterm_raises(), AtomicOutput(dst, folder=ckpt.is_folder) as tmp:
        # --devices: worker threads even for one GPU (its tensors' reads and uploads overlap the writing here)
        pool = _Pool(nworkers, backend, devs) if nworkers > 1 or devs else None
        summary = _convert(ckpt, sel, items, tmp, dst, fmt, blocksize, mover, shard_limit, skip, progress, pool)
    for line in summary.lines():
        print(line, file=sys.stderr)
    return summary


def _convert(ckpt: Checkpoint, sel: Selection, items: list[Item], tmp: str, dst: str, fmt: str, blocksize: int,
             mover: _Mover, shard_limit: int, skip: list[str], progress: bool, pool: _Pool | None = None) -> Summary:
    summary = Summary(dst, fmt, in_bytes=ckpt.nbytes)
    shards: list[ShardWriter] = []
    weight_map: dict[str, int] = {}
    meta = {"format": "pt"} if ckpt.is_folder else {**ckpt.metadata, "quantcore.format": fmt}
    if not ckpt.is_folder:
        meta["quantcore.blocksize"] = str(blocksize if fmt in bnb.QUANT_TYPES else mx.block_size(fmt))

    def shard_for(nbytes: int, i: int) -> ShardWriter:  # i: the item to write (a new shard has room for the rest)
        if not shards or (ckpt.is_folder and shards[-1].size and shards[-1].size + nbytes > shard_limit):
            if shards:
                shards[-1].close()
            path = os.path.join(tmp, f"shard-{len(shards):05d}") if ckpt.is_folder else tmp
            shards.append(ShardWriter(path, meta, reserve=_header_room(items[i:], meta)))
        return shards[-1]

    bar = Progress(ckpt.nbytes, f"quantize {os.path.basename(os.path.normpath(ckpt.path))} -> {fmt}", progress,
                   pieces=len(items))
    tasks = [(ckpt.tensors[it.name].file.path, it.name, fmt, blocksize, it.experts)
             for it in items if it.action != "copy"]
    done = pool.results(tasks) if pool is not None else None
    try:
        for i, it in enumerate(items):
            t = ckpt.tensors[it.name]
            if it.action == "copy":
                w = shard_for(t.info.nbytes, i)
                w.add_raw(it.name, t.info.dtype_name, t.info.shape, t.file, it.name)
                weight_map[it.name] = len(shards) - 1
                summary.kept[it.name] = it.reason
            else:
                w = shard_for(_out_bytes(fmt, t.info.shape, blocksize), i)
                if done is not None:
                    out = next(done)
                else:
                    a = t.file.get(it.name, whole=True)
                    out = _quantize_tensor(it.name, a, fmt, blocksize, mover, it.experts)
                    del a
                for k, v in out.items():
                    w.add(k, v)
                    weight_map[k] = len(shards) - 1
                del out
                summary.quantized.append(it.name)
            bar.step(t.info.nbytes, it.name)
        if not shards:
            shard_for(0, len(items))
        shards[-1].close()
    except BaseException:
        for s in shards:
            s.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.close()
    summary.out_bytes = sum(s.size for s in shards)
    if not ckpt.is_folder:
        summary.shards = [dst]
        return summary
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for s, name in zip(shards, names):
        os.rename(s.path, os.path.join(tmp, name))
    summary.shards = names
    if n > 1:
        index = {"metadata": {"total_size": summary.out_bytes},
                 "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
        _write_json(os.path.join(tmp, INDEX_NAME), index)
    config = dict(ckpt.config or {})
    config["quantization_config"] = _quantization_config(fmt, sel, items, skip)
    _write_json(os.path.join(tmp, "config.json"), config)
    for rel in ckpt.extra_files:
        target = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(ckpt.path, rel), target)
    return summary


def _quantization_config(fmt: str, sel: Selection, items: list[Item], skip: list[str]) -> dict[str, Any]:
    if fmt in bnb.QUANT_TYPES:
        # no --skip: transformers' own default (null); else the full list, as llm_int8_skip_modules
        # replaces transformers' default
        kept = sorted({*sel.default_skip, *skip})
        return bnb_quantization_config(fmt, kept if skip else None)
    if fmt == "nvfp4":
        done = {it.name.removesuffix(".weight") for it in items if it.action == "quantize"}
        ignore = sorted({*sel.kept, *(m for m in sel.linear if m not in done)})
        return nvfp4_quantization_config(ignore)
    return mxfp4_quantization_config()


def _write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


# -- GGUF ------------------------------------------------------------------------------------------------------------
def _quantize_gguf(src: str, dst: str, fmt: str, *, pure: bool, backend: Any, progress: bool, force: bool,
                   allow_requantize: bool = False) -> None:
    if fmt not in GGUF_FORMATS:
        raise UnsupportedError(f"a GGUF input is requantized to {' / '.join(GGUF_FORMATS)} only, not {fmt}")
    try:
        from .io.gguf import requantize_gguf
    except ModuleNotFoundError as exc:
        if exc.name not in ("quantcore.io.gguf",):
            raise UnsupportedError(f"GGUF support needs a package that is missing: {exc}") from exc
        raise UnsupportedError("GGUF support is not installed in this build") from exc
    check_output(dst, [src], force=force)
    if os.path.isdir(dst):
        raise CheckpointError(f"{dst} is a folder; the output of a GGUF input is a .gguf file")
    with sigterm_raises(), AtomicOutput(dst, folder=False) as tmp:
        requantize_gguf(src, tmp, fmt, pure=pure, backend=backend, progress=progress,
                        allow_requantize=allow_requantize)
        if not os.path.isfile(tmp):
            raise CheckpointError(f"the GGUF writer did not write {tmp}")
    print(f"wrote {dst} ({fmt}{', pure' if pure else ''})", file=sys.stderr)
    return None


# -- reading back ---------------------------------------------------------------------------------------------------
def read_quantized(path: str, out_dtype: str = "float32") -> dict[str, np.ndarray]:
    """Dequantize what :func:`quantize_checkpoint` wrote (a folder or file, any of its layouts) with
    quantcore: ``weight name -> float array`` for each quantized weight (the names the float
    checkpoint had; gpt-oss experts back in their [E, K, N] layout). The other tensors are not
    returned. For tests and inspection: it holds every result in memory."""
    from . import api_mx
    from .state import QuantState

    ckpt = open_checkpoint(path)
    t = {n: x for n, x in ckpt.tensors.items()}

    def get(n: str) -> np.ndarray:
        return np.asarray(t[n].file.get(n))

    out: dict[str, np.ndarray] = {}
    for n in sorted(t):
        m = re.fullmatch(r"(.*)\.quant_state\.bitsandbytes__(nf4|fp4)", n)
        if m:
            w = m.group(1)
            d = {k[len(w) + 1:]: get(k) for k in t if k.startswith(w + ".") and k != w}
            st = QuantState.from_dict(d)
            out[w] = np.asarray(api.dequantize_4bit(get(w), st, out_dtype=out_dtype))
        elif n.endswith(".weight_packed"):
            base = n[: -len("packed")]
            scales = get(base + "scale").view(np.uint8)
            g = get(base + "global_scale")
            out[n[: -len("_packed")]] = np.asarray(api_mx.dequantize_nvfp4(get(n), scales, g, out_dtype,
                                                                           swizzled=False))
        elif n.endswith("_blocks"):
            p = n[: -len("_blocks")]
            blocks, scales = get(n), get(p + "_scales").view(np.uint8)
            codes = blocks.reshape(*blocks.shape[:-2], -1)
            deq = np.asarray(api_mx.dequantize_mxfp4(codes.reshape(-1, codes.shape[-1]),
                                                     scales.reshape(-1, scales.shape[-1]), out_dtype, swizzled=False))
            deq = deq.reshape(*codes.shape[:-1], codes.shape[-1] * 2)
            out[p] = np.ascontiguousarray(np.swapaxes(deq, -1, -2)) if deq.ndim == 3 else deq
    if not out:
        raise CheckpointError(f"{path}: no quantized tensors in a layout quantcore writes")
    return out

