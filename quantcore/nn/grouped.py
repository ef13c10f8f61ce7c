"""One launch for the 4-bit linears that read the same input (an attention layer's q / k / v, an
MLP's gate / up): :func:`group_linears` ties such :class:`~quantcore.nn.Linear4bit` siblings (or
:class:`~quantcore.nn.LinearFP4` siblings) together without changing the model's structure or its
checkpoint keys.

The first member called with an input computes every member's output with
``torch.ops.quantcore.gemv_4bit_grouped`` (LinearFP4: ``linear_mx_grouped``; the cuda backend reads
the weights in one kernel) and keeps the others' outputs for that same input tensor; each following
member called with the same tensor takes its part. Anything else (another input, more rows than the
batch kernels take - ``quantcore.torch.GEMV_MAX_ROWS``: above it each member's GEMM or dequantize +
matmul is a launch of its own anyway, and the member's own call is bound to its tensors -, an input
that needs gradients, and for Linear4bit an eager call on a CUDA device outside a graph capture, where
the members' bound launches cost far less host time than the grouped op's dispatch: eager decode of a
Llama-3-8B-shaped model ran at 15.9 tok/s grouped against 31.9 alone on an H200, session 26) runs the
member alone, so results never depend on call order: each column block is the member's own gemv_4bit /
linear_mx result within the tolerance tier (on the cuda backend the grouped kernel splits K across warps
by the group's total size, so the bits may differ from a single-weight launch).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .. import torch as qct
from ..errors import ParameterError
from . import _eager  # (quantcore.nn imports this module after defining it)

#: sibling names grouped by default: Llama / Mistral / Qwen attention and MLP projections
DEFAULT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class LinearGroup:
    """Linear4bit (or LinearFP4) modules that share an input; see the module docstring. Held by each
    member (``member._qc_group``); not a module, so the model's state dict is unchanged."""

    def __init__(self, members: list[nn.Module]):
        from . import Linear4bit, LinearFP4

        first = members[0]
        self._fp4 = isinstance(first, LinearFP4)
        for m in members[1:]:
            if self._fp4:
                same = (isinstance(m, LinearFP4) and m.in_features == first.in_features and m.fmt == first.fmt
                        and m.weight.device == first.weight.device)
                what = "LinearFP4 modules must share in_features, fmt"
            else:
                same = (isinstance(m, Linear4bit) and m.in_features == first.in_features
                        and m.blocksize == first.blocksize and m.quant_type == first.quant_type
                        and m.compress_statistics == first.compress_statistics
                        and m.compute_dtype == first.compute_dtype and m.weight.device == first.weight.device)
                what = "Linear4bit modules must share in_features, blocksize, quant_type, compress_statistics, " \
                       "compute_dtype"
            if not same:
                raise ParameterError(f"grouped {what} and device")
        self.members = list(members)
        self.sizes = [m.out_features for m in members]
        self._x: torch.Tensor | None = None
        self._outs: list[torch.Tensor | None] = []

    def _compute(self, x: torch.Tensor) -> list[torch.Tensor]:
        first = self.members[0]
        inp = x if self._fp4 or first.compute_dtype is None else x.to(first.compute_dtype)
        inp = inp if inp.is_contiguous() else inp.contiguous()
        if self._fp4:
            y = torch.ops.quantcore.linear_mx_grouped(
                inp, [m.weight_packed for m in self.members], [m.weight_scale for m in self.members],
                [m.weight_global_scale for m in self.members], first.fmt)
        else:
            args = [m._state_args() for m in self.members]
            y = torch.ops.quantcore.gemv_4bit_grouped(
                inp, [a[0] for a in args], [a[1] for a in args], [a[2] for a in args], [a[3] for a in args],
                [a[4] for a in args], self.sizes, first.in_features, first.blocksize, first.quant_type)
        outs = []
        for m, part in zip(self.members, torch.split(y, self.sizes, dim=-1)):
            bias = m._parameters.get("bias")
            if bias is not None:
                part = part + bias.to(part.dtype)
            outs.append(part if part.dtype == x.dtype else part.to(x.dtype))
        return outs

    def forward(self, member: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output for ``x`` from a grouped call, or None where ``member`` should run alone."""
        if not self._fp4 and x.is_cuda and _eager(x) and not torch.cuda.is_current_stream_capturing():
            return None  # an eager cuda call: each member's own launch, bound to its tensors, costs less host time
        op = "linear_fp4" if self._fp4 else "linear_4bit"
        rows = qct._rows(x)
        if x.shape[-1] != self.members[0].in_features or rows > qct.GEMV_MAX_ROWS or qct.linear_path(
                rows, op, backend=qct.backend_for(x.device), k=x.shape[-1], device=x.device,
                n=min(self.sizes)) != "gemv":
            return None
        if torch.is_grad_enabled() and (x.requires_grad or any(
                p is not None and p.requires_grad for m in self.members for p in (m._parameters.get("bias"),))):
            return None  # the grouped op builds no autograd graph
        i = next(j for j, m in enumerate(self.members) if m is member)
        if self._x is x and self._outs[i] is not None:
            out = self._outs[i]
            self._outs[i] = None
            if all(o is None for o in self._outs):
                self._x = None
            return out
        outs = self._compute(x)
        out = outs[i]
        outs[i] = None
        self._x, self._outs = x, outs
        return out


def group_linears(model: nn.Module, groups: Iterable[Iterable[str]] = DEFAULT_GROUPS) -> int:
    """Tie the :class:`~quantcore.nn.Linear4bit` (or :class:`~quantcore.nn.LinearFP4`) children of
    every module of ``model`` named in one of ``groups`` (child attribute names, e.g. ``("q_proj",
    "k_proj", "v_proj")``) so that they run as one grouped gemv (LinearFP4: one linear_mx_grouped) for
    the inputs ``quantcore.torch.linear_path`` sends to the gemv path (up to ``GEMV_MAX_ROWS`` rows;
    Linear4bit on cuda up to the fused GEMM's limit). Returns the number of groups made. Children
    missing, of neither class or of both, or unlike (in_features and device; Linear4bit: blocksize,
    quant type, statistics, compute dtype; LinearFP4: fmt) leave that group out.
    :func:`ungroup_linears` undoes it."""
    from . import Linear4bit, LinearFP4

    groups = [tuple(g) for g in groups]
    made = 0
    for parent in model.modules():
        for names in groups:
            members = [parent._modules.get(n) for n in names]
            if len(members) < 2 or not (all(isinstance(m, Linear4bit) for m in members)
                                        or all(isinstance(m, LinearFP4) for m in members)):
                continue
            try:
                group = LinearGroup(members)
            except ParameterError:
                continue
            for m in members:
                m.__dict__["_qc_group"] = group
            made += 1
    return made


def ungroup_linears(model: nn.Module) -> None:
    """Undo :func:`group_linears`: every Linear4bit / LinearFP4 runs alone again."""
    for m in model.modules():
        m.__dict__.pop("_qc_group", None)
