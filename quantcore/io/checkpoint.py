"""Checkpoints as inputs: a transformers model folder (config.json, one or many safetensors shards
with ``model.safetensors.index.json``) or a single safetensors file; and the choice of the tensors a
loader expects quantized.

Which tensors are quantized in a folder is what transformers itself decides for a bitsandbytes
4-bit load: the model is built from config.json on the ``meta`` device (no memory), its modules
to keep come from transformers' ``HfQuantizer.get_modules_to_not_convert`` (output embedding,
tied weights, the last module, ``_keep_in_fp32_modules``) matched with transformers'
``should_convert_module``, and only ``nn.Linear`` layers are converted (embeddings and norms are
not linear layers). So the folder loads into the same modules transformers + bitsandbytes builds.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, UnsupportedError
from . import SafetensorsFile, TensorInfo

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: files of a model folder that hold weights in other formats: not copied into the output
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.gguf", "*.onnx",
                  "pytorch_model.bin.index.json", "*.safetensors", "*.safetensors.index.json")


@dataclass
class Tensor:
    name: str
    file: SafetensorsFile
    info: TensorInfo


@dataclass
class Checkpoint:
    """The tensors of a folder or file; ``config`` (config.json) and ``extra_files`` (relative
    paths of the other files to copy) for a folder."""

    path: str
    is_folder: bool
    tensors: dict[str, Tensor]
    config: dict[str, Any] | None = None
    extra_files: list[str] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return sorted({t.file.path for t in self.tensors.values()})

    @property
    def nbytes(self) -> int:
        return sum(t.info.nbytes for t in self.tensors.values())


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read it as JSON ({exc})") from exc


def open_checkpoint(path: str) -> Checkpoint:
    """A model folder or a ``.safetensors`` file (see the module docstring); CheckpointError otherwise."""
    if os.path.isdir(path):
        return _open_folder(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist")
    st = SafetensorsFile(path)
    return Checkpoint(path, False, {n: Tensor(n, st, st.info(n)) for n in st.names}, metadata=dict(st.metadata))


def _open_folder(path: str) -> Checkpoint:
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        data = _read_json(index)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index}: no weight_map of tensor name -> shard file")
        shard_names = sorted(set(wm.values()))
        for s in shard_names:
            if os.path.isabs(s) or ".." in s.replace("\\", "/").split("/"):
                raise CheckpointError(f"{index}: shard {s!r} points outside the folder")
    elif os.path.isfile(os.path.join(path, SINGLE_NAME)):
        wm, shard_names = None, [SINGLE_NAME]
    else:
        raise CheckpointError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME}: not a safetensors model folder "
                              "(convert .bin weights with transformers' save_pretrained first)")
    tensors: dict[str, Tensor] = {}
    for s in shard_names:
        sp = os.path.join(path, s)
        if not os.path.isfile(sp):
            raise CheckpointError(f"{path}: the index names shard {s}, which is missing")
        st = SafetensorsFile(sp)
        for n in st.names:
            if wm is not None and wm.get(n) != s:
                if n not in wm:
                    raise CheckpointError(f"{sp}: tensor {n!r} is not in {INDEX_NAME}")
                continue  # the index places it in another shard; that one is read
            if n in tensors:
                raise CheckpointError(f"{path}: tensor {n!r} is in two shards")
            tensors[n] = Tensor(n, st, st.info(n))
    if wm is not None:
        missing = sorted(set(wm) - set(tensors))
        if missing:
            raise CheckpointError(f"{index}: {len(missing)} tensor(s) listed but in no shard, e.g. {missing[0]!r}")
    cfg_path = os.path.join(path, "config.json")
    config = _read_json(cfg_path) if os.path.isfile(cfg_path) else None
    if config is not None and not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path}: not a JSON object")
    extra, skipped = [], []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for fn in sorted(files):
            rel = os.path.relpath(os.path.join(root, fn), path)
            if rel == "config.json" or fn.startswith("."):
                continue
            (skipped if any(fnmatch.fnmatch(fn, p) for p in _OTHER_WEIGHTS) else extra).append(rel)
    return Checkpoint(path, True, tensors, config, extra, skipped)


# -- which tensors to quantize --------------------------------------------------------------------------------
@dataclass
class Selection:
    """``linear``: qualified names of the linear layers to quantize; ``kept``: linear layer ->
    why it stays in float; ``default_skip``: transformers' own modules_to_not_convert."""

    linear: list[str]
    kept: dict[str, str]
    default_skip: list[str]
    model_type: str | None = None
    experts: list[str] = field(default_factory=list)  # gpt-oss: the 3-D expert parameters


def _pattern_matches(name: str, pattern: str) -> bool:
    # transformers' rule (start at a module boundary / regex / suffix), plus a glob
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    try:
        if re.match(rf"(?:{pattern}){boundary}", name):
            return True
    except re.error:
        pass
    return name.endswith(pattern) or fnmatch.fnmatchcase(name, pattern) or f".{pattern}." in f".{name}."


def select_from_config(ckpt: Checkpoint, user_skip: list[str]) -> Selection:
    """Build the model on the meta device and ask transformers (see the module docstring)."""
    try:
        import torch
        from torch import nn
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        from transformers.pytorch_utils import Conv1D
        from transformers.quantizers.base import HfQuantizer
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError as exc:
        raise UnsupportedError(f"quantizing a model folder needs torch and transformers to find the layers "
                               f"transformers quantizes (pip install 'quantcore[hf]'): {exc}") from exc
    import logging as _logging

    try:
        config = AutoConfig.from_pretrained(ckpt.path, local_files_only=True)
    except Exception as exc:  # transformers' own error for an unknown model_type etc.
        raise CheckpointError(f"{ckpt.path}/config.json: transformers cannot read it ({exc})") from exc
    tlog = _logging.getLogger("transformers")
    level = tlog.level
    tlog.setLevel(_logging.ERROR)
    try:
        with torch.device("meta"):
            try:
                model = AutoModelForCausalLM.from_config(config)
            except ValueError:
                model = AutoModel.from_config(config)
    except Exception as exc:
        raise CheckpointError(f"{ckpt.path}: transformers cannot build the model of this config ({exc})") from exc
    finally:
        tlog.setLevel(level)
    keep_fp32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    default = sorted(HfQuantizer.get_modules_to_not_convert(model, None, keep_fp32))
    auto = sorted(HfQuantizer.get_modules_to_not_convert(model, None, None))
    linear, kept, experts = [], {}, []
    for name, module in model.named_modules():
        if isinstance(module, Conv1D):
            raise UnsupportedError(f"{name} is a Conv1D layer (GPT-2 style, transposed weight): such models are "
                                   "not supported by quantcore quantize yet")
        if type(module) is not nn.Linear:
            if type(module).__name__ == "GptOssExperts":
                experts += [f"{name}.gate_up_proj", f"{name}.down_proj"]
            continue
        if not should_convert_module(name, auto):
            kept[name] = "transformers keeps it (output embedding, tied or last module)"
        elif not should_convert_module(name, keep_fp32):
            kept[name] = "the model's _keep_in_fp32_modules"
        elif not should_convert_module(name, user_skip or None):
            kept[name] = "--skip"
        else:
            linear.append(name)
    for p in user_skip:  # transformers' own matching, as it will read llm_int8_skip_modules back
        if not any(not should_convert_module(n, [p]) for n, m in model.named_modules() if type(m) is nn.Linear):
            raise CheckpointError(f"--skip {p!r} matches no linear layer (transformers matches a pattern from the "
                                  "start of a name at a module boundary, as a regex, or as a suffix: e.g. "
                                  "'lm_head', 'mlp.down_proj', 'model.layers.1')")
    return Selection(linear, kept, default, getattr(config, "model_type", None), experts)


#: names a single safetensors file's output head and embeddings have (no config to ask)
_NAME_SKIPS = ("lm_head", "embed_tokens", "embed", "wte", "wpe", "tok_embeddings", "word_embeddings",
               "output", "embed_out", "shared")


def select_by_name(ckpt: Checkpoint, user_skip: list[str], min_numel: int) -> Selection:
    """A single file has no config: 2-D ``*.weight`` tensors of at least ``min_numel`` elements whose
    layer is not named like an embedding or the output head."""
    from ..arrays import FLOAT_DTYPES

    linear, kept = [], {}
    for n, t in ckpt.tensors.items():
        if not n.endswith(".weight") or len(t.info.shape) != 2 or t.info.dtype not in FLOAT_DTYPES:
            continue
        layer = n[: -len(".weight")]
        parts = layer.split(".")
        if any(p in _NAME_SKIPS for p in parts):
            kept[layer] = "named like an embedding or the output head"
        elif any(_pattern_matches(layer, p) for p in user_skip):
            kept[layer] = "--skip"
        elif t.info.shape[0] * t.info.shape[1] < min_numel:
            kept[layer] = f"fewer than --min-numel {min_numel} elements"
        else:
            linear.append(layer)
    return Selection(linear, kept, [])
