"""``quantcore quantize``: quantize the 2-D weights of a safetensors checkpoint.

- nf4 / fp4: a bitsandbytes-compatible safetensors file. Each quantized tensor ``X`` becomes
  ``X`` (packed uint8 [(n+1)//2, 1]) plus ``X.absmax``, ``X.quant_map``, ``X.nested_absmax``,
  ``X.nested_quant_map`` and ``X.quant_state.bitsandbytes__<type>``, the layout a
  ``bnb.nn.Linear4bit`` state dict (and transformers) uses, so ``X = "<layer>.weight"`` loads there.
- q4_0: a GGUF file (through the ``gguf`` package) with Q4_0 tensors, ggml's bytes.
- mxfp4 / nvfp4: safetensors with ``X`` (packed E2M1 codes [N, K/2]), ``X.scale`` (swizzled scale
  bytes) and, for nvfp4, ``X.global_scale`` (fp32 [1]).
Tensors that are not 2-D floats of at least ``min_numel`` elements, or whose K does not fit the
format's block, are copied unchanged. A progress bar shows per-tensor progress.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from . import api
from .arrays import FLOAT_DTYPES
from .errors import ParameterError, UnsupportedError
from .formats import ggml, mx
from .io import load_safetensors, save_safetensors


def _progress(items: list[str], desc: str) -> Iterable[str]:
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, unit="tensor", file=sys.stderr)
    except ImportError:
        def plain():
            for i, it in enumerate(items, 1):
                print(f"\r{desc}: {i}/{len(items)} {it[:60]:<60}", end="", file=sys.stderr, flush=True)
                yield it
            print(file=sys.stderr)

        return plain()


def _eligible(a: np.ndarray, fmt: str, min_numel: int) -> bool:
    if a.ndim != 2 or a.dtype not in FLOAT_DTYPES or a.size < min_numel:
        return False
    block = ggml.QK if fmt == "q4_0" else mx.BLOCK_SIZE.get(fmt, 1)
    return a.shape[1] % block == 0


def quantize_checkpoint(src: str, dst: str, fmt: str, *, blocksize: int = 64, backend: Any = None,
                        min_numel: int = 4096) -> int:
    """Quantize ``src`` (safetensors) into ``dst``; returns 0. See the module docstring."""
    if fmt not in ("nf4", "fp4", "q4_0", "mxfp4", "nvfp4"):
        raise ParameterError(f"unknown format {fmt!r}")
    tensors, meta = load_safetensors(src)
    names = sorted(tensors)
    out: dict[str, np.ndarray] = {}
    quantized = 0
    gguf_items: list[tuple[str, np.ndarray, Any]] = []
    for name in _progress(names, f"quantize {os.path.basename(src)} -> {fmt}"):
        a = np.array(tensors[name])  # one tensor in memory at a time
        if not _eligible(a, fmt, min_numel):
            if fmt == "q4_0":
                gguf_items.append((name, a, None))
            else:
                out[name] = a
            continue
        quantized += 1
        if fmt in ("nf4", "fp4"):
            packed, state = api.quantize_4bit(a, blocksize, fmt, True, backend=backend)
            out[name] = packed
            for key, value in state.as_dict(packed=True).items():
                out[f"{name}.{key}"] = np.asarray(value)
        elif fmt == "q4_0":
            gguf_items.append((name, api.quantize_q4_0(a, backend=backend), "Q4_0"))
        else:
            out.update(_quantize_mx(name, a, fmt, backend))
    if fmt == "q4_0":
        _write_gguf(dst, gguf_items, meta)
    else:
        meta = dict(meta)
        block = mx.BLOCK_SIZE.get(fmt, blocksize)
        meta.update({"quantcore.format": fmt, "quantcore.blocksize": str(block)})
        if fmt in ("mxfp4", "nvfp4"):
            meta["quantcore.scale_layout"] = "swizzled 128x4"
        save_safetensors(dst, out, meta)
    print(f"wrote {dst}: {quantized} of {len(names)} tensors quantized to {fmt}", file=sys.stderr)
    return 0


def _quantize_mx(name: str, a: np.ndarray, fmt: str, backend: Any) -> dict[str, np.ndarray]:
    try:
        from . import api_mx
    except ImportError as exc:
        raise UnsupportedError(f"{fmt} needs the MX formats module, which is not available") from exc
    if fmt == "mxfp4":
        codes, scales = api_mx.scaled_mxfp4_quant(a, backend=backend)
        return {name: np.asarray(codes), f"{name}.scale": np.asarray(scales)}
    amax = float(np.abs(a.astype(np.float32)).max())
    g = np.array([mx.nvfp4_global_scale(amax) if amax > 0 else 1.0], dtype=np.float32)
    codes, scales = api_mx.scaled_nvfp4_quant(a, g, backend=backend)
    return {name: np.asarray(codes), f"{name}.scale": np.asarray(scales), f"{name}.global_scale": g}


def _write_gguf(dst: str, items: list[tuple[str, np.ndarray, Any]], meta: dict[str, str]) -> None:
    try:
        import gguf
    except ImportError as exc:
        raise UnsupportedError("writing GGUF needs the gguf package: pip install quantcore[io]") from exc
    writer = gguf.GGUFWriter(dst, arch="quantcore")
    writer.add_name(os.path.basename(dst))
    for name, data, kind in items:
        if kind == "Q4_0":
            rows, nb, _ = data.shape
            # a uint8 tensor with a quantized raw_dtype: gguf derives [rows, K] from the bytes
            writer.add_tensor(name, data.reshape(rows, nb * 18), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        elif data.dtype == FLOAT_DTYPES[2]:
            writer.add_tensor(name, data.view(np.uint16), raw_shape=data.shape,
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
