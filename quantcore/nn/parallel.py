"""Tensor parallelism for :mod:`quantcore.nn` modules on ``torch.distributed`` (Megatron's pattern).

torch's own ``ColwiseParallel`` / ``RowwiseParallel`` accept only ``nn.Linear`` and ``nn.Embedding``
(they turn parameters into DTensors; a packed 4-bit weight ``[(N*K+1)//2, 1]`` with per-block
statistics in buffers has no dimension DTensor could shard along N or K). This module shards the
quantized weight and its statistics itself, at block boundaries, and gives ``ParallelStyle``
classes that ``torch.distributed.tensor.parallel.parallelize_module`` applies like torch's own:

- **colwise** (:class:`QuantColwiseParallel`): rank r keeps output rows ``[r*N/w, (r+1)*N/w)``; its
  output is its slice of the features (``output="shard"``, what the next rowwise layer takes) or
  all-gathered along the last dimension (``output="gather"``).
- **rowwise** (:class:`QuantRowwiseParallel`): rank r keeps input columns ``[r*K/w, (r+1)*K/w)``
  of every row; it takes its slice of the input (``input="shard"``, the previous colwise layer's
  output) or slices a replicated input (``input="replicate"``); the partial products are summed
  with one all-reduce (in ``reduce_dtype``, default the activation's), then the bias is added once.

A module is sharded in place (same class, same parameter names; ``in_features`` /
``out_features`` become the local sizes; :func:`shard_spec` tells the global ones), so
``state_dict`` keys and code that calls the module keep working. It works for
:class:`~quantcore.nn.Linear4bit`, :class:`~quantcore.nn.LinearQ4_0`,
:class:`~quantcore.nn.LinearFP4` and float ``nn.Linear`` (sharded as float: partly quantized models).

Where a shard ends inside a quantization block the sharding is refused (:class:`ShapeError`):
4-bit blocks run along the flattened ``N*K`` weight, so a column shard needs ``(N/w)*K`` and a row
shard ``K`` and ``K/w`` to be multiples of the blocksize; Q4_0 needs ``K/w % 32 == 0``, NVFP4 ``% 16``,
MXFP4 ``% 32``.

**Double quantization.** A Linear4bit's absmax is itself quantized in blocks of 256 absmax with one
offset for the whole weight. A column shard whose absmax range covers whole second-level blocks
keeps them as they are; any other shard (every row shard unless ``K/w`` spans multiples of 256
blocks) decodes its absmax to float32 with the kernels' own arithmetic (``code2[q] * absmax2 +
offset``, two fp32 roundings) and holds it un-nested: the same scales bit for bit, at 0.5 instead
of ~0.13 bits per weight for the statistics.

Two ways to get a sharded model, with these equalities (tested in ``tests/test_parallel.py``):

1. **Slice a quantized model** (``parallelize_module`` with these styles, :func:`parallelize_llama`
   without ``fmt``, :func:`load_sharded` from a quantized checkpoint): every shard dequantizes to
   exactly its rows / columns of the unsharded weight, every format, nested or not.
2. **Quantize shards from float** (:func:`quantize_shard`, :func:`parallelize_llama` with ``fmt``):
   each rank quantizes only its float shard, bitwise the slice of the unsharded quantization in
   every format: the blocks are the same elements; NVFP4's global scale comes from the whole
   weight's amax (all-reduced, max); double quantization's second level, whose offset is the mean of the whole
   weight's absmax, is computed from the all-gathered float32 absmax of every shard (1/64 of the
   weight's elements) by the backend's own double quantization, then sliced as in way 1.

Given the same weights, the colwise forward computes each output feature from the same inputs and
weights as the unsharded one (equal bit for bit where the backend's product for one feature does
not depend on how many features the call has: measured on the cpu backend, see docs/parallel.md);
the rowwise forward sums ``w`` partial products, so it equals the unsharded one within the
rounding of that sum (the tolerance tier).
"""

from __future__ import annotations

import fnmatch
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ParameterError, ShapeError, StateError, UnsupportedError
from ..formats import bnb, ggml, mx
from ..formats.kernel_defines import LAUNCH_GEOMETRY
from . import FORMATS, FORMATS_4BIT, Linear4bit, LinearFP4, LinearQ4_0, _frozen

COLWISE, ROWWISE = "colwise", "rowwise"
#: how a rowwise layer sums its partial products: "group" (``dist.all_reduce`` on the process group:
#: NCCL, gloo), "symm_mem" (torch's one-shot all-reduce on its symmetric memory: each GPU reads its
#: peers' partial sums over NVLink in one kernel) or "oneshot" (quantcore's one-shot kernel on symmetric
#: memory: one CTA, each rank's partial sums pushed into every rank's buffer, their arrival seen by sentinel
#: words, no barrier; kernels_cuda/allreduce.cu). The last
#: two are CUDA only, for the small outputs of decode; "oneshot" sends outputs over ONESHOT_MAX_BYTES
#: (prefill) to the group's all-reduce. "deferred": the layer returns this rank's partial sums (rank 0's
#: with the bias) and the caller sums them, e.g. with :func:`all_reduce_add_rms_norm`, which fuses the
#: all-reduce with the residual add and the norm that follow a decoder layer's rowwise layers.
ALL_REDUCE = ("group", "symm_mem", "oneshot", "deferred")
#: the largest rowwise output (bytes) that all_reduce="oneshot" reduces with its one-CTA kernel
ONESHOT_MAX_BYTES = 1 << 20
#: all_reduce_add_rms_norm's one kernel takes rows of up to this many 16-byte units (16384 bf16)
NORM_MAX_UNITS = LAUNCH_GEOMETRY["QC_AR_NORM_UNITS"] * LAUNCH_GEOMETRY["QC_AR_THREADS"]
_NB = bnb.NESTED_BLOCKSIZE  # 256 absmax per second-level block

#: Megatron's plan for a Llama decoder layer (module names relative to a layer)
LLAMA_PLAN: dict[str, str] = {
    "self_attn.q_proj": COLWISE, "self_attn.k_proj": COLWISE, "self_attn.v_proj": COLWISE,
    "self_attn.o_proj": ROWWISE,
    "mlp.gate_proj": COLWISE, "mlp.up_proj": COLWISE, "mlp.down_proj": ROWWISE,
}


# -- where a rank stands ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardSpec:
    """How a module is sharded: ``style`` "colwise" (rows of W, the output features) or "rowwise"
    (columns of W, the input features), this rank's ``rank`` of ``world``, the unsharded
    ``in_features`` / ``out_features``, and the forward's options."""

    style: str
    rank: int
    world: int
    in_features: int
    out_features: int
    output: str = "shard"  # colwise: "shard" or "gather"
    input: str = "shard"  # rowwise: "shard" or "replicate"
    reduce_dtype: torch.dtype | None = None  # rowwise: the all-reduce's dtype (None: the activation's)
    all_reduce: str = "group"  # rowwise: one of ALL_REDUCE

    @property
    def split(self) -> tuple[int, int]:
        """This rank's [lo, hi) along the sharded dimension (N for colwise, K for rowwise)."""
        full = self.out_features if self.style == COLWISE else self.in_features
        step = full // self.world
        return self.rank * step, (self.rank + 1) * step


def _group_info(mesh_or_group: Any) -> tuple[Any, int, int]:
    """(process group, rank, world size) of a 1-D DeviceMesh, a ProcessGroup, or None (the default
    group; rank 0 of 1 where torch.distributed is not initialized)."""
    import torch.distributed as dist

    if mesh_or_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    elif hasattr(mesh_or_group, "get_group") and hasattr(mesh_or_group, "ndim"):
        if mesh_or_group.ndim != 1:
            raise ParameterError(f"tensor parallelism takes a 1-D DeviceMesh (or its sub-mesh), got {mesh_or_group.ndim}-D")
        group = mesh_or_group.get_group()
    else:
        group = mesh_or_group
    return group, dist.get_rank(group), dist.get_world_size(group)


def _check_style(style: str, output: str, input: str, all_reduce: str = "group") -> None:
    if style not in (COLWISE, ROWWISE):
        raise ParameterError(f"style must be 'colwise' or 'rowwise', got {style!r}")
    if output not in ("shard", "gather"):
        raise ParameterError(f"output must be 'shard' or 'gather', got {output!r}")
    if input not in ("shard", "replicate"):
        raise ParameterError(f"input must be 'shard' or 'replicate', got {input!r}")
    if all_reduce not in ALL_REDUCE:
        raise ParameterError(f"all_reduce must be one of {ALL_REDUCE}, got {all_reduce!r}")


def _divide(full: int, world: int, what: str, name: str) -> int:
    if full % world:
        raise ShapeError(f"{name}: {what} = {full} does not divide over {world} ranks")
    return full // world


# -- slicing: the same code for a module's tensors and a checkpoint's memory maps ---------------------------
def _take(x: Any) -> torch.Tensor:
    """A slice as a torch tensor of its own (a copy of only the slice: a torch view would keep the
    whole tensor's storage alive, a memory map's slice is read here)."""
    if isinstance(x, torch.Tensor):
        return x.contiguous().clone() if x.device.type != "meta" else x.contiguous()
    from ..arrays import numpy_to_torch

    return numpy_to_torch(x.copy())


def _as_torch(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else _take(x)


def _decode_absmax(q: Any, blocks: torch.Tensor, absmax2: Any, first2: int, offset: Any, code2: Any) -> torch.Tensor:
    """float32 absmax of the blocks ``blocks`` (global indices) from their codes ``q`` and the
    second-level absmax ``absmax2`` (starting at second-level block ``first2``): ``code2[q] *
    absmax2[b // 256] + offset`` with two fp32 roundings (no FMA), as the backends decode it."""
    q, a2, off, c2 = _as_torch(q), _as_torch(absmax2), _as_torch(offset), _as_torch(code2)
    blocks = blocks.to(q.device)
    prod = c2.float()[q.reshape(-1).long()] * a2.float()[blocks // _NB - first2]
    return prod + off.float().reshape(-1)[0]


def shard_4bit(src: dict[str, Any], n: int, k: int, blocksize: int, style: str, rank: int, world: int,
               name: str = "weight") -> dict[str, torch.Tensor | None]:
    """This rank's share of a bitsandbytes 4-bit weight ``[n, k]``: ``src`` maps ``weight`` (packed
    uint8, any shape holding ``(n*k+1)//2`` bytes; None: statistics only), ``absmax`` and, when nested, ``nested_absmax``,
    ``nested_quant_map``, ``offset`` to torch tensors or numpy arrays (memory maps: only the slices
    are read). Returns the same names for the shard; nested ones are None where the shard holds
    float32 absmax (see the module's notes)."""
    nb = bnb.nblocks(n * k, blocksize)
    nested = src.get("nested_absmax") is not None
    packed = None if src.get("weight") is None else src["weight"].reshape(-1)
    absmax = src["absmax"].reshape(-1)
    out: dict[str, Any] = {"nested_absmax": None, "nested_quant_map": None, "offset": None}
    if style == COLWISE:
        nl = _divide(n, world, "out_features", name)
        if (nl * k) % blocksize:
            raise ShapeError(f"{name}: a column shard of {nl} rows x {k} = {nl * k} weights is not a whole "
                             f"number of {blocksize}-blocks (4-bit blocks run along the flattened weight)")
        e0, e1 = rank * nl * k, (rank + 1) * nl * k
        b0, b1 = e0 // blocksize, e1 // blocksize
        out["weight"] = None if packed is None else _take(packed[e0 // 2: e1 // 2]).reshape(-1, 1)
        q = absmax[b0:b1]
        a2 = src["nested_absmax"].reshape(-1)[b0 // _NB: bnb.nblocks(b1, _NB)] if nested else None
        if nested and b0 % _NB == 0 and (b1 % _NB == 0 or b1 == nb):
            out["absmax"] = _take(q)
            out["nested_absmax"] = _take(a2)
            out["nested_quant_map"], out["offset"] = _take(src["nested_quant_map"]), _take(src["offset"]).reshape(1)
        elif nested:
            out["absmax"] = _decode_absmax(q, torch.arange(b0, b1), a2, b0 // _NB, src["offset"],
                                           src["nested_quant_map"])
        else:
            out["absmax"] = _take(q)
        return out
    kl = _divide(k, world, "in_features", name)
    if k % blocksize or kl % blocksize:
        raise ShapeError(f"{name}: a row shard needs in_features ({k}) and its share ({kl}) to be multiples of "
                         f"the blocksize {blocksize}")
    k0, k1 = rank * kl, (rank + 1) * kl
    bpr, c0, c1 = k // blocksize, k0 // blocksize, k1 // blocksize
    out["weight"] = None if packed is None else \
        _take(packed[: n * k // 2].reshape(n, k // 2)[:, k0 // 2: k1 // 2]).reshape(-1, 1)
    q = absmax.reshape(n, bpr)[:, c0:c1]
    if nested and bpr % _NB == 0 and (c1 - c0) % _NB == 0:
        out["absmax"] = _take(q).reshape(-1)
        a2 = src["nested_absmax"].reshape(n, bpr // _NB)[:, c0 // _NB: c1 // _NB]
        out["nested_absmax"] = _take(a2).reshape(-1)
        out["nested_quant_map"], out["offset"] = _take(src["nested_quant_map"]), _take(src["offset"]).reshape(1)
    elif nested:
        # the shard's blocks fall in every second-level block: that small tensor is read whole
        blocks = (torch.arange(n)[:, None] * bpr + torch.arange(c0, c1)[None, :]).reshape(-1)
        out["absmax"] = _decode_absmax(q, blocks, src["nested_absmax"].reshape(-1), 0, src["offset"],
                                       src["nested_quant_map"])
    else:
        out["absmax"] = _take(q).reshape(-1)
    return out


def shard_rows_cols(src: dict[str, Any], style: str, rank: int, world: int, k: int, unit: int,
                    name: str = "weight") -> dict[str, torch.Tensor]:
    """This rank's share of tensors laid out ``[N, ...]`` per output row (Q4_0's ``[N, K/32, 18]``,
    NVFP4 / MXFP4 codes ``[N, K/2]`` and scales ``[N, K/blk]``, a float ``[N, K]``): rows for colwise;
    for rowwise the columns of K in ``[r*K/w, (r+1)*K/w)``, which must be whole ``unit``-blocks.
    ``src`` maps each name to ``(array, elements of K per entry of its dim 1)``."""
    out = {}
    for key, (t, per) in src.items():
        n = t.shape[0]
        if style == COLWISE:
            nl = _divide(n, world, "out_features", name)
            out[key] = _take(t[rank * nl: (rank + 1) * nl])
            continue
        kl = _divide(k, world, "in_features", name)
        if kl % unit:
            raise ShapeError(f"{name}: a row shard of {kl} input features is not a whole number of "
                             f"{unit}-element blocks")
        out[key] = _take(t[:, rank * kl // per: (rank + 1) * kl // per])
    return out


# -- sharding a module in place -------------------------------------------------------------------------------
def _unit(module: nn.Module) -> int:
    if isinstance(module, LinearQ4_0):
        return ggml.QK
    if isinstance(module, LinearFP4):
        return mx.block_size(module.fmt)
    return 1


def _row_tensors(module: nn.Module) -> dict[str, tuple[Any, int]]:
    """The tensors laid out per output row, with the K elements per entry of their dim 1."""
    if isinstance(module, LinearQ4_0):
        return {"weight": (module.weight, ggml.QK)}
    if isinstance(module, LinearFP4):
        return {"weight_packed": (module.weight_packed, 2), "weight_scale": (module.weight_scale, _unit(module))}
    return {"weight": (module.weight, 1)}


def _shard_tensors(module: nn.Module, spec: ShardSpec, name: str) -> None:
    """Replace ``module``'s weight tensors by this rank's share (the bias is handled by the caller)."""
    if isinstance(module, Linear4bit):
        b = module._buffers
        src = {"weight": module.weight.detach(), "absmax": b["absmax"], "nested_absmax": b["nested_absmax"],
               "nested_quant_map": b["nested_quant_map"], "offset": b["offset"]}
        out = shard_4bit(src, spec.out_features, spec.in_features, module.blocksize, spec.style, spec.rank,
                         spec.world, name)
        module.weight = _frozen(out["weight"])
        for key in ("absmax", "nested_absmax", "nested_quant_map", "offset"):
            module._buffers[key] = out[key]
        for cached in ("_state_cache", "_bound"):
            module.__dict__.pop(cached, None)
        return
    src = {key: (t.detach(), per) for key, (t, per) in _row_tensors(module).items()}
    out = shard_rows_cols(src, spec.style, spec.rank, spec.world, spec.in_features, _unit(module), name)
    for key, t in out.items():
        old = module._parameters[key]
        module._parameters[key] = nn.Parameter(t, requires_grad=old.requires_grad)


_SHARDABLE = (Linear4bit, LinearQ4_0, LinearFP4, nn.Linear)


def shard_linear(module: nn.Module, style: str, mesh_or_group: Any = None, *, output: str = "shard",
                 input: str = "shard", reduce_dtype: torch.dtype | None = None, all_reduce: str = "group",
                 name: str = "") -> nn.Module:
    """Shard ``module`` (a quantcore linear or a float ``nn.Linear``) in place for tensor parallelism
    over ``mesh_or_group`` (a 1-D DeviceMesh, a ProcessGroup, or None: the default group) and make
    its forward do the collectives; returns it. See the module's notes for the styles and options."""
    if not isinstance(module, _SHARDABLE):
        raise UnsupportedError(f"{name or 'module'}: tensor parallel sharding takes Linear4bit, LinearQ4_0, "
                               f"LinearFP4 or nn.Linear, got {type(module).__name__}")
    if shard_spec(module) is not None:
        raise StateError(f"{name or 'module'} is already sharded ({shard_spec(module)})")
    _check_style(style, output, input, all_reduce)
    if reduce_dtype is not None and reduce_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ParameterError(f"reduce_dtype must be a float dtype, got {reduce_dtype}")
    group, rank, world = _group_info(mesh_or_group)
    spec = ShardSpec(style, rank, world, module.in_features, module.out_features, output, input, reduce_dtype,
                     all_reduce)
    label = name or type(module).__name__
    _shard_tensors(module, spec, label)
    bias = module._parameters.get("bias")
    if bias is not None:
        if style == COLWISE:
            lo, hi = spec.split
            module.bias = nn.Parameter(_take(bias.detach()[lo:hi]), requires_grad=bias.requires_grad)
        else:  # the full bias, added once after the all-reduce
            module.bias = None
            module.tp_bias = bias
    if style == COLWISE:
        module.out_features //= world
    else:
        module.in_features //= world
    module.__dict__["_tp"] = (spec, group)
    module.forward = types.MethodType(_colwise_forward if style == COLWISE else _rowwise_forward, module)
    return module


def shard_spec(module: nn.Module) -> ShardSpec | None:
    """The :class:`ShardSpec` of a module sharded by this module, else None."""
    tp = module.__dict__.get("_tp")
    return None if tp is None else tp[0]


def _all_gather_last(y: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(parts, y.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _colwise_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    spec, group = self.__dict__["_tp"]
    y = type(self).forward(self, x)
    if spec.output == "gather" and spec.world > 1:
        y = _all_gather_last(y, group, spec.world)
    return y


#: (group name, numel, dtype, device) -> [two symmetric buffers, the one the next call takes]
_SYMM_BUFFERS: dict[tuple, list] = {}


def _symm_mem_all_reduce(y: torch.Tensor, group: Any) -> torch.Tensor:
    """``y`` summed over ``group`` by torch's one-shot all-reduce on symmetric memory (``y`` is copied
    into a symmetric buffer; every rank reads every peer's buffer after a barrier inside the kernel).
    Two buffers per shape, taken in turn: a rank writes a buffer again only after the next call's
    barrier, which every peer reaches after it has read that buffer. The buffers are made (a collective
    rendezvous) on the first call of each shape, so run one step eagerly before capturing a CUDA graph."""
    import torch.distributed._symmetric_memory as symm_mem

    if y.device.type != "cuda":
        raise UnsupportedError(f"all_reduce='symm_mem' needs CUDA tensors (got {y.device}); use 'group'")
    name = group.group_name
    key = (name, y.numel(), y.dtype, y.device)
    slot = _SYMM_BUFFERS.get(key)
    if slot is None:
        bufs = [symm_mem.empty(y.numel(), dtype=y.dtype, device=y.device) for _ in range(2)]
        for b in bufs:
            symm_mem.rendezvous(b, name)
        slot = _SYMM_BUFFERS[key] = [bufs, 0]
    buf = slot[0][slot[1]]
    slot[1] ^= 1
    buf.copy_(y.reshape(-1))
    out = y if y.is_contiguous() else torch.empty_like(y, memory_format=torch.contiguous_format)
    torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", name, out.view(-1))
    return out


#: (group name, bytes, dtype, device) -> (the symmetric buffer, every rank's buffer address here, round
#: counter, rank), or None where the one-shot kernel does not take the tensor (dist.all_reduce does)
_ONESHOT: dict[tuple, tuple | None] = {}


def _oneshot_all_reduce(y: torch.Tensor, group: Any) -> torch.Tensor:
    """``y`` summed over ``group`` by quantcore's one-shot kernel (kernels_cuda/allreduce.cu): each rank
    writes its partial sums into its slot of every rank's symmetric buffer and adds all slots in rank order
    as they arrive (a slot's words stop being the free-slot sentinel); the same bits on every rank, for two
    ranks the bits of NCCL's sum. One buffer per group and size, made by a collective rendezvous on
    the first call (run one step eagerly before capturing a CUDA graph); tensors over ONESHOT_MAX_BYTES,
    of another dtype or not a multiple of 16 bytes take ``dist.all_reduce``."""
    import torch.distributed as dist

    from ..backends.cuda import common as cuda_common

    if y.device.type != "cuda":
        raise UnsupportedError(f"all_reduce='oneshot' needs CUDA tensors (got {y.device}); use 'group'")
    ent = _oneshot_entry(y, group)
    if ent is None:
        dist.all_reduce(y, group=group)
        return y
    _, ptrs, rnd, rank = ent
    (x,) = _aligned16(y)
    out = torch.empty_like(x)
    cuda_common.all_reduce_oneshot(x, out, ptrs, rnd, rank)
    return out


def _oneshot_entry(y: torch.Tensor, group: Any) -> tuple | None:
    """The one-shot buffer (an :data:`_ONESHOT` entry) for tensors of ``y``'s bytes, dtype and device on
    ``group``, made on first use (a collective), or None where the kernel does not take them."""
    nbytes = y.numel() * y.element_size()
    key = (group.group_name, nbytes, y.dtype, y.device)
    ent = _ONESHOT.get(key, False)
    if ent is False:
        ent = _ONESHOT[key] = _oneshot_buffer(nbytes, y.dtype, y.device, group)
    return ent


def _aligned16(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors contiguous, copied where one starts off a 16-byte boundary (the one-shot kernels
    read and write 16-byte units)."""
    ts = tuple(t.contiguous() for t in ts)
    return tuple(t.clone() if t.data_ptr() % 16 else t for t in ts)


def _sum_over(y: torch.Tensor, group: Any, how: str) -> torch.Tensor:
    """``y`` summed over ``group`` as ``how`` says (:data:`ALL_REDUCE` but "deferred"); "group" and the
    one-shot path's fallback sum ``y`` in place."""
    import torch.distributed as dist

    if how == "symm_mem":
        return _symm_mem_all_reduce(y, group)
    if how == "oneshot":
        return _oneshot_all_reduce(y, group)
    dist.all_reduce(y, group=group)
    return y


def _oneshot_buffer(nbytes: int, dtype: torch.dtype, device: torch.device, group: Any) -> tuple | None:
    """The one-shot all-reduce's symmetric buffer for ``nbytes`` of ``dtype`` (a collective), or None where
    its kernel does not take such a tensor."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from ..backends.cuda import common as cuda_common
    from ..formats.kernel_interface import AR_MAX_RANKS

    if (nbytes % 16 or nbytes > ONESHOT_MAX_BYTES or dtype not in (torch.float32, torch.float16, torch.bfloat16)
            or dist.get_world_size(group) > AR_MAX_RANKS):
        return None
    buf = symm_mem.empty(cuda_common.ar_buffer_bytes(nbytes, dist.get_world_size(group)), dtype=torch.uint8,
                         device=device)
    cuda_common.ar_buffer_init(buf, torch.empty((), dtype=dtype).element_size())
    hdl = symm_mem.rendezvous(buf, group.group_name)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every rank's buffer is ready before any rank writes into it
    return buf, [int(p) for p in hdl.buffer_ptrs], torch.zeros(1, dtype=torch.int32, device=device), int(hdl.rank)


def all_reduce_add_rms_norm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                            group: Any = None, all_reduce: str = "oneshot") -> tuple[torch.Tensor, torch.Tensor]:
    """What a decoder layer does after a rowwise layer with ``all_reduce="deferred"``: ``h = residual +
    y`` with ``y`` the sum of the ranks' ``partial`` ([..., n]) over ``group`` (a ProcessGroup, 1-D
    DeviceMesh or None: the default group), then Llama's RMSNorm ``T(T(h * rsqrt(mean(h^2) + eps)) *
    weight)`` ([n]); returns ``(h, normed)``, each rounded to ``residual``'s dtype as the unfused ops
    round it. With ``all_reduce="oneshot"`` on CUDA (``partial``, ``residual`` and ``weight`` of one
    dtype, rows of a multiple of 16 bytes, at most ONESHOT_MAX_BYTES) one kernel does all of it
    (kernels_cuda/allreduce.cu: the one-shot all-reduce's round, then the add and the norm in the
    same CTA: two kernels fewer per rowwise layer than the all-reduce, the add and the norm); otherwise
    the partial sums are reduced as ``all_reduce`` says ("group", "symm_mem", "oneshot") and the add and
    the norm run as torch ops. On one rank it is the add and the norm. Like ``all_reduce="oneshot"``, a
    call under ``torch.compile`` is a graph break (CUDA graphs capture the kernel)."""
    group, _, world = _group_info(group)
    if all_reduce not in ALL_REDUCE or all_reduce == "deferred":
        raise ParameterError(f"all_reduce must be one of {ALL_REDUCE[:-1]}, got {all_reduce!r}")
    n = partial.shape[-1]
    if residual.shape != partial.shape or weight.shape != (n,):
        raise ShapeError(f"all_reduce_add_rms_norm takes partial and residual of one shape and a weight of their last "
                         f"dimension, got {tuple(partial.shape)}, {tuple(residual.shape)}, {tuple(weight.shape)}")
    if world > 1 and all_reduce == "oneshot" and partial.device.type == "cuda" and partial.numel():
        ent = _oneshot_entry(partial, group)
        row = n * partial.element_size()
        if (ent is not None and residual.dtype == weight.dtype == partial.dtype and row % 16 == 0
                and row <= 16 * NORM_MAX_UNITS):
            from ..backends.cuda import common as cuda_common

            _, ptrs, rnd, rank = ent
            x, res, w = _aligned16(partial, residual, weight)
            h, normed = torch.empty_like(res), torch.empty_like(res)
            cuda_common.all_reduce_add_rms_norm(x, res, w, h, normed, eps, ptrs, rnd, rank)
            return h, normed
    y = _sum_over(partial.clone(), group, all_reduce) if world > 1 else partial  # (the caller's partial kept)
    h = residual + y.to(residual.dtype)
    h32 = h.float()
    return h, (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight


def _rowwise_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    spec, group = self.__dict__["_tp"]
    if spec.input == "replicate":
        if x.shape[-1] != spec.in_features:
            raise ShapeError(f"a rowwise layer with input='replicate' takes {spec.in_features} input features, "
                             f"got {x.shape[-1]}")
        lo, hi = spec.split
        x = x[..., lo:hi]
    inp = x if spec.reduce_dtype is None else x.to(spec.reduce_dtype)
    y = type(self).forward(self, inp)
    bias = self._parameters.get("tp_bias")
    if spec.all_reduce == "deferred":  # partial sums; the bias once, on rank 0
        return y if bias is None or spec.rank else y + bias.to(y.dtype)
    if spec.world > 1:
        y = _sum_over(y, group, spec.all_reduce)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


# -- torch's parallelize_module ---------------------------------------------------------------------------------
def _parallel_style_base():
    from torch.distributed.tensor.parallel import ParallelStyle

    return ParallelStyle


class QuantColwiseParallel(_parallel_style_base()):
    """``parallelize_module`` style: shard a quantcore linear (or ``nn.Linear``) by output rows over a
    1-D DeviceMesh. ``output``: "shard" (keep this rank's features, for a rowwise layer next) or
    "gather" (all-gather them along the last dimension)."""

    def __init__(self, *, output: str = "shard"):
        super().__init__()
        _check_style(COLWISE, output, "shard")
        self.output = output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return shard_linear(module, COLWISE, device_mesh, output=self.output)


class QuantRowwiseParallel(_parallel_style_base()):
    """``parallelize_module`` style: shard a quantcore linear (or ``nn.Linear``) by input columns over
    a 1-D DeviceMesh; the partial outputs are all-reduced. ``input``: "shard" (the previous colwise
    layer's features) or "replicate" (the layer slices the full input); ``reduce_dtype``: the dtype
    of the product and the all-reduce (None: the activation's); ``all_reduce``: one of
    :data:`ALL_REDUCE`."""

    def __init__(self, *, input: str = "shard", reduce_dtype: torch.dtype | None = None, all_reduce: str = "group"):
        super().__init__()
        _check_style(ROWWISE, "shard", input, all_reduce)
        self.input, self.reduce_dtype, self.all_reduce = input, reduce_dtype, all_reduce

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return shard_linear(module, ROWWISE, device_mesh, input=self.input, reduce_dtype=self.reduce_dtype,
                            all_reduce=self.all_reduce)


# -- a Llama --------------------------------------------------------------------------------------------------
def _llama_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = [(n, m) for n, m in model.named_modules() if fnmatch.fnmatchcase(n, "*layers.[0-9]*")
           and n.rsplit(".", 1)[-1].isdigit()]
    if not out:
        raise ParameterError("no decoder layers found (modules named '...layers.<i>')")
    return out


def _check_llama(model: nn.Module, world: int) -> None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    for what, val in (("num_attention_heads", heads), ("num_key_value_heads", kv or heads)):
        if val is not None and val % world:
            raise ShapeError(f"{what} = {val} does not divide over {world} ranks: each rank needs whole heads")


def _quantize_shard(linear: nn.Linear, spec: ShardSpec, group: Any, fmt: str, blocksize: int,
                    compress_statistics: bool, compute_dtype, name: str) -> nn.Module:
    """Quantize only this rank's float shard of ``linear`` (see the module's notes: bitwise the
    slice of the whole weight's quantization except double quantization's second level)."""
    import torch.distributed as dist

    from . import _convert

    w = linear.weight.detach()
    src = {"weight": (w, 1)}
    if fmt in FORMATS_4BIT:
        if spec.style == COLWISE:
            nl = _divide(spec.out_features, spec.world, "out_features", name)
            if (nl * spec.in_features) % blocksize:
                raise ShapeError(f"{name}: a column shard of {nl} rows x {spec.in_features} weights is not a whole "
                                 f"number of {blocksize}-blocks")
        elif spec.in_features % blocksize or (spec.in_features // spec.world) % blocksize:
            raise ShapeError(f"{name}: a row shard needs in_features ({spec.in_features}) and its share to be "
                             f"multiples of the blocksize {blocksize}")
        unit = 1
    else:
        unit = ggml.QK if fmt == "q4_0" else mx.block_size(fmt)
    part = shard_rows_cols(src, spec.style, spec.rank, spec.world, spec.in_features, unit, name)["weight"]
    if fmt in FORMATS_4BIT:
        return _quantize_4bit_shard(part, spec, group, fmt, blocksize, compress_statistics, compute_dtype)
    shard = nn.Linear(part.shape[1], part.shape[0], bias=False, device="meta")
    shard.weight = nn.Parameter(part, requires_grad=False)
    if fmt != "nvfp4":
        return _convert(shard, fmt, blocksize, compress_statistics, compute_dtype)
    # the global scale from the whole weight's amax, the same on every rank
    amax = part.abs().max().float().reshape(1)
    if spec.world > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    gs = torch.tensor([float(mx.nvfp4_global_scale(float(amax)))], dtype=torch.float32, device=part.device)
    mod = LinearFP4(shard.in_features, shard.out_features, False, "nvfp4", device="meta")
    codes, scales = torch.ops.quantcore.quantize_mx(part.contiguous(), "nvfp4", "floor", gs, False)
    mod.weight_packed, mod.weight_scale, mod.weight_global_scale = _frozen(codes), _frozen(scales), _frozen(gs)
    return mod


def _double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backend's double quantization of a float32 absmax (what quantize_4bit with
    compress_statistics runs after the 4-bit pass, bit for bit: the Backend contract):
    (codes uint8, absmax2 float32, offset float32 [1])."""
    import numpy as np

    from .. import torch as qct

    def run(x, *, backend):
        backend.require("double_quantize", "dynamic8", "float32", _NB)
        xn = backend.prepare(x)
        nb = int(x.shape[0])
        q = backend.empty((nb,), np.dtype(np.uint8), like=xn)
        a2 = backend.empty((bnb.nblocks(nb, _NB),), np.dtype(np.float32), like=xn)
        off = backend.empty((1,), np.dtype(np.float32), like=xn)
        backend.double_quantize(xn, q, a2, off)
        return backend.finish(q, x), backend.finish(a2, x), backend.finish(off, x)

    return qct._run(absmax.device, run, (absmax.contiguous(),))


def _quantize_4bit_shard(part: torch.Tensor, spec: ShardSpec, group: Any, fmt: str, blocksize: int,
                         nested: bool, compute_dtype) -> Linear4bit:
    """A Linear4bit of this rank's float shard ``part``, bitwise the shard of the whole weight's
    quantization: the 4-bit pass on the shard only; with double quantization the shards' float32
    absmax are all-gathered (1/64 of the weight's elements) and double-quantized whole, as the
    unsharded quantization does, then sliced as :func:`shard_4bit` slices a quantized module."""
    import torch.distributed as dist

    from .. import torch as qct

    n_l, k_l = part.shape
    packed, st = qct.quantize_4bit(part.contiguous(), blocksize, fmt, False)
    absmax = st.absmax
    mod = Linear4bit(k_l, n_l, False, compute_dtype, nested, fmt, blocksize, device="meta", dtype=part.dtype)
    mod.weight = _frozen(packed)
    dev = packed.device
    if not nested:
        mod._set_state(st)  # absmax, quant_map and no nested statistics
        return mod
    mod._buffers["quant_map"] = torch.tensor(bnb.code_4bit(fmt), device=dev)
    parts = [absmax]
    if spec.world > 1:
        parts = [torch.empty_like(absmax) for _ in range(spec.world)]
        dist.all_gather(parts, absmax.contiguous(), group=group)
    n, k = spec.out_features, spec.in_features
    if spec.style == COLWISE:
        full = torch.cat(parts)
    else:  # each rank's [n, k/w/blocksize] absmax, side by side per row
        full = torch.cat([p.reshape(n, -1) for p in parts], dim=1).reshape(-1)
    q, a2, off = _double_quantize(full)
    code2 = torch.tensor(bnb.DYNAMIC_MAP, dtype=torch.float32, device=dev)
    out = shard_4bit({"weight": None, "absmax": q, "nested_absmax": a2, "nested_quant_map": code2, "offset": off},
                     n, k, blocksize, spec.style, spec.rank, spec.world)
    for key in ("absmax", "nested_absmax", "nested_quant_map", "offset"):
        mod._buffers[key] = out[key]
    return mod


def quantize_shard(linear: nn.Linear, style: str, mesh_or_group: Any = None, fmt: str = "nf4", *,
                   blocksize: int = 64, compress_statistics: bool = True, compute_dtype=None, output: str = "shard",
                   input: str = "shard", reduce_dtype: torch.dtype | None = None, all_reduce: str = "group",
                   name: str = "") -> nn.Module:
    """A new quantcore module holding this rank's shard of the float ``linear``, quantized from its
    float shard only (bitwise the shard of ``linear``'s whole quantization; see the module's
    notes), its forward doing the collectives as :func:`shard_linear`'s. Collective over the group
    (NVFP4's amax, double quantization's absmax): every rank calls it for the same layers in the
    same order. ``linear`` itself is left as it is."""
    _check_linear_arg(linear, name)
    if fmt not in FORMATS:
        raise ParameterError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    _check_style(style, output, input, all_reduce)
    group, rank, world = _group_info(mesh_or_group)
    spec = ShardSpec(style, rank, world, linear.in_features, linear.out_features, output, input, reduce_dtype,
                     all_reduce)
    label = name or "Linear"
    q = _quantize_shard(linear, spec, group, fmt, blocksize, compress_statistics, compute_dtype, label)
    bias = linear.bias
    if bias is not None:
        lo, hi = spec.split
        if style == COLWISE:
            q.bias = nn.Parameter(_take(bias.detach()[lo:hi]), requires_grad=bias.requires_grad)
        else:
            q.tp_bias = nn.Parameter(_take(bias.detach()), requires_grad=bias.requires_grad)
    q.__dict__["_tp"] = (spec, group)
    q.forward = types.MethodType(_colwise_forward if style == COLWISE else _rowwise_forward, q)
    return q


def _check_linear_arg(linear: Any, name: str) -> None:
    if type(linear) is not nn.Linear:
        raise UnsupportedError(f"{name or 'module'}: quantize_shard takes a float torch.nn.Linear, got "
                               f"{type(linear).__name__}")


def parallelize_llama(model: nn.Module, mesh_or_group: Any = None, *, fmt: str | None = None,
                      blocksize: int = 64, compress_statistics: bool = True, compute_dtype=None,
                      reduce_dtype: torch.dtype | None = None, all_reduce: str = "group") -> nn.Module:
    """Megatron's plan on every decoder layer of a Llama-shaped model (``...layers.<i>`` with
    ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``): q / k / v / gate / up colwise,
    their outputs kept sharded (each rank computes its heads and its slice of the MLP), o / down
    rowwise with one all-reduce each; embeddings, norms and lm_head stay replicated. One all-reduce
    per attention and one per MLP, as in Megatron.

    ``fmt`` None shards the modules as they are (quantcore modules sliced, float ``nn.Linear``
    sharded as float); a format ("nf4", "q4_0", ...) quantizes each float ``nn.Linear`` of the plan
    from its float shard on this rank (see the module's notes for what is bitwise). Needs the head
    counts to divide over the ranks. ``reduce_dtype`` and ``all_reduce`` go to the rowwise layers
    (see :class:`QuantRowwiseParallel`). Returns ``model``."""
    group, rank, world = _group_info(mesh_or_group)
    if fmt is not None and fmt not in FORMATS:
        raise ParameterError(f"fmt must be one of {FORMATS} or None, got {fmt!r}")
    _check_style(ROWWISE, "shard", "shard", all_reduce)
    if all_reduce == "deferred":  # transformers' decoder layers add a rowwise output to the residual as is
        raise ParameterError("parallelize_llama needs rowwise layers that sum their outputs: all_reduce='deferred' "
                             "is for code that reduces them itself (all_reduce_add_rms_norm)")
    _check_llama(model, world)
    rowwise = {"reduce_dtype": reduce_dtype, "all_reduce": all_reduce}
    for lname, layer in _llama_layers(model):
        for rel, style in LLAMA_PLAN.items():
            parent_name, _, child = rel.rpartition(".")
            parent = layer.get_submodule(parent_name)
            mod = getattr(parent, child, None)
            full = f"{lname}.{rel}"
            if mod is None:
                raise ParameterError(f"{full}: no such module (not a Llama-shaped layer)")
            opts = rowwise if style == ROWWISE else {}
            if fmt is not None and type(mod) is nn.Linear:
                setattr(parent, child, quantize_shard(mod, style, group if world > 1 else None, fmt,
                                                      blocksize=blocksize, compress_statistics=compress_statistics,
                                                      compute_dtype=compute_dtype, name=full, **opts))
            else:
                shard_linear(mod, style, group if world > 1 else None, name=full, **opts)
    return model


# -- loading a quantized checkpoint sharded ---------------------------------------------------------------------
def _checkpoint_arrays(path: Any) -> dict[str, Any]:
    """name -> read-only memory map of every tensor of a checkpoint (a ``.safetensors`` file or a
    model folder, as :func:`quantcore.io.checkpoint.open_checkpoint` reads them)."""
    import os

    from ..io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(os.fspath(path))
    return {name: t.file.get(name) for name, t in ckpt.tensors.items()}


def _read_shard(mod: nn.Module, spec: ShardSpec, prefix: str, arrays: dict[str, Any], used: set) -> dict:
    """The module's tensors for this rank, read from the checkpoint's memory maps."""
    from ..state import QuantState

    def get(key: str) -> Any:
        if prefix + key not in arrays:
            raise StateError(f"the checkpoint has no {prefix + key!r}")
        used.add(prefix + key)
        return arrays[prefix + key]

    label = prefix.rstrip(".")
    if isinstance(mod, Linear4bit):
        qs = {k[len(prefix) + 7:]: v for k, v in arrays.items() if k.startswith(prefix + "weight.")}
        used.update(prefix + "weight." + k for k in qs)
        # the small entries (the packed quant_state, code tables) whole; absmax stays a memory map
        state = QuantState.from_dict({k: (v if k in ("absmax", "nested_absmax") else v.copy()) for k, v in qs.items()})
        n, k = spec.out_features, spec.in_features
        if tuple(state.shape) != (n, k):
            raise ShapeError(f"{label}: the checkpoint's weight is {tuple(state.shape)}, the module's ({n}, {k})")
        src = {"weight": get("weight"), "absmax": state.absmax}
        if state.nested:
            src.update(nested_absmax=state.state2.absmax, nested_quant_map=state.state2.code,
                       offset=state.offset)
        out = shard_4bit(src, n, k, state.blocksize, spec.style, spec.rank, spec.world, label)
        out["_meta"] = (state.quant_type, state.blocksize, state.dtype)
        return out
    per = {"weight": 1}
    if isinstance(mod, LinearQ4_0):
        per = {"weight": ggml.QK}
    elif isinstance(mod, LinearFP4):
        per = {"weight_packed": 2, "weight_scale": _unit(mod)}
    out = shard_rows_cols({key: (get(key), p) for key, p in per.items()}, spec.style, spec.rank, spec.world,
                          spec.in_features, _unit(mod), label)
    if isinstance(mod, LinearFP4) and mod.fmt == "nvfp4":
        out["weight_global_scale"] = _take(get("weight_global_scale"))
    return out


def load_sharded(model: nn.Module, path: Any, device: Any = None) -> dict[str, int]:
    """Fill ``model`` (its sharded modules made by :func:`parallelize_llama` / :func:`shard_linear`,
    typically on the meta device after :func:`quantcore.nn.replace_linear`) from a quantized
    checkpoint (a ``.safetensors`` file or a model folder as ``save_pretrained`` writes it): each
    rank reads only its slices of the sharded modules' tensors through read-only memory maps
    (quantcore.io), the other tensors whole. Tensors go to ``device`` (default: each module's
    current device, or cpu for meta). Returns the bytes materialized per checkpoint key."""
    arrays = _checkpoint_arrays(path)
    used: set = set()
    read: dict[str, int] = {}
    for mname, mod in model.named_modules():
        spec = shard_spec(mod)
        if spec is None:
            continue
        prefix = f"{mname}." if mname else ""
        dev = device if device is not None else next(iter(mod.parameters())).device
        dev = torch.device("cpu") if torch.device(dev).type == "meta" else dev
        out = _read_shard(mod, spec, prefix, arrays, used)
        if isinstance(mod, Linear4bit):
            mod.quant_type, mod.blocksize, mod.weight_dtype = out.pop("_meta")
            mod.weight = _frozen(out.pop("weight").to(dev))
            for key in ("absmax", "nested_absmax", "nested_quant_map", "offset"):
                t = out.pop(key)
                mod._buffers[key] = None if t is None else t.to(dev)
            mod._buffers["quant_map"] = torch.tensor(bnb.code_4bit(mod.quant_type), device=dev)
            for cached in ("_state_cache", "_bound"):
                mod.__dict__.pop(cached, None)
            read[prefix + "weight"] = mod.weight.numel()
            read[prefix + "weight.absmax"] = mod.absmax.numel() * mod.absmax.element_size()
        else:
            for key, t in out.items():
                setattr(mod, key, _frozen(t.to(dev)))
                read[prefix + key] = t.numel() * t.element_size()
        bkey = prefix + "bias"
        if bkey in arrays:
            used.add(bkey)
            b = arrays[bkey]
            if spec.style == COLWISE:
                lo, hi = spec.split
                b = b[lo:hi]
            t = _take(b).to(dev)
            read[bkey] = t.numel() * t.element_size()
            setattr(mod, "bias" if spec.style == COLWISE else "tp_bias", nn.Parameter(t, requires_grad=False))
    rest = {}
    for key, a in arrays.items():
        if key in used:
            continue
        t = _take(a)
        rest[key] = t if device is None else t.to(device)
        read[key] = t.numel() * t.element_size()
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    sharded = tuple(f"{n}." for n, m in model.named_modules() if shard_spec(m) is not None)
    missing = [k for k in missing if not k.startswith(sharded)]
    if unexpected or missing:
        raise StateError(f"the checkpoint does not match the model: unexpected {sorted(unexpected)[:5]}, "
                         f"missing {sorted(missing)[:5]}")
    return read


__all__ = ["COLWISE", "LLAMA_PLAN", "QuantColwiseParallel", "QuantRowwiseParallel", "ROWWISE", "ShardSpec",
           "all_reduce_add_rms_norm", "load_sharded", "parallelize_llama", "quantize_shard", "shard_4bit",
           "shard_linear", "shard_rows_cols", "shard_spec"]
