"""The cuda backend's bitsandbytes family: 4-bit quantize / dequantize / gemv (the decode kernel,
the many-row GEMM, the fallback kernels), blockwise 8-bit and double quantization. ``BnbOps`` holds
the ops (a mixin of ``CudaBackend``); the launch choices below are shared with the eager plans."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

from quantcore.arrays import as_dtype, dtype_name
from quantcore.backend import Nested, grouped_run_end
from quantcore.formats import bnb, mx
from quantcore.formats.kernel_defines import (
    DECODE_GEMV_QT,
    LAUNCH_GEOMETRY,
    QUANT_TYPE_CODE,
    gm_slot_bytes,
    gw_slot_bytes,
)
from quantcore.formats.kernel_interface import GEMV_TC_WEIGHT_NAMES, arg_index

from . import runtime as rt
from .common import _F4, _F8, _FM, _FV, _G, TYPE_TAG, _b, _cdiv, _log2, _resident, _tag
from .runtime import Launcher, aligned, kernel_args

_DEQUANT_THREADS, _DEQUANT_WORDS = _G["QC_DQ4_THREADS"], _G["QC_DQ4_WORDS"]
_GEMV_WARPS, _GEMV_U, _GEMV_V = _G["QC_GEMV_MMA_WARPS"], _G["QC_GEMV_MMA_U"], (4, 8)
_GEMV_SMEM = _G["QC_GEMV_MMA_SMEM"]
_TREE_CHUNK = _G["QC_DQ_TREE_CHUNK"]
# double_quantize: absmax values per chunk sum, the most chunk sums the quantize launch reduces, the
# chunk-sum kernel's threads
_SUM_CHUNK, _SUM_MAX_PARTS, _SUM3_THREADS = _G["QC_DQ_SUM_CHUNK"], _G["QC_DQ_SUM_MAX_PARTS"], _G["QC_DQ_SUM_THREADS"]

# -- the kernel instantiations, by op (used by the launchers and by the nvcc compile test) ----------
def _q4(tag: str, qt: str) -> str:
    return f"qc::quantize_4bit_kernel<{tag}, {QUANT_TYPE_CODE[qt]}>"


# quantize_4bit's default kernel (kernels_cuda/bnb_4bit.cu): G = blocksize / 16 threads per block (its
# instances, _Q4V3_G), S pipeline stages of one tile of 256 x 16 elements (3: what 4 CTAs per
# multiprocessor can hold for fp32 input); quantize_4bit_kernel takes the larger blocksizes
_Q4V3_G = (2, 4, 8, 16, 32)
_Q4V3_STAGES = _G["QC_Q4_STAGES"]


def _q4v3(tag: str, qt: str, g: int) -> str:
    return f"qc::quantize_4bit_v3_kernel<{tag}, {QUANT_TYPE_CODE[qt]}, {g}, {_Q4V3_STAGES}>"


def _dq4(tag: str, qt: str, nested: bool) -> str:
    return f"qc::dequantize_4bit_kernel<{tag}, {QUANT_TYPE_CODE[qt]}, {_b(nested)}>"


def _gemv(tag: str, qt: str, nested: bool) -> str:
    return f"qc::gemv_4bit_simple_kernel<{tag}, {QUANT_TYPE_CODE[qt]}, {_b(nested)}>"


def _gemv_mma(tag: str, qt: str, nested: bool, v: int) -> str:
    return f"qc::gemv_4bit_mma_kernel<{tag}, {QUANT_TYPE_CODE[qt]}, {_b(nested)}, {v}>"


def _gemv_tc(tag: str, qt: str, nested: bool, nb: int, xs: bool, short: bool) -> str:
    """The decode gemv's instance; ``qt`` a 4-bit type or an MX FP4 format (linear_mx: DECODE_GEMV_QT)."""
    ch, st = _GT_SHORT_RING if short else _GT_LONG_RING
    return f"qc::gemv_4bit_tc_kernel<{tag}, {DECODE_GEMV_QT[qt]}, {_b(nested)}, {nb}, {_b(xs)}, {ch}, {st}>"


#: linear_mx on the decode gemv: (format, input dtype) -> the bytes of codes from which one input row
#: takes it (two or more rows always do). Graph-timed on an H200, session 21: mx_gemv.cu's CUDA-core
#: kernel is faster at one row below ~8192 x 4096 and equal there, the decode gemv faster from 4096 x
#: 14336 on (docs/performance.md MXDEC-2); MXFP4 with fp16 input (the split mma) is slower at one row
#: whatever the size (MXDEC-4): never. ``QUANTCORE_CUDA_TUNE=mx_gemv_dec_b1_min=BYTES`` overrides them.
DECODE_MX_B1_MIN_BYTES = {("nvfp4", "float16"): 24 << 20, ("nvfp4", "bfloat16"): 24 << 20,
                          ("mxfp4", "float16"): math.inf, ("mxfp4", "bfloat16"): 24 << 20}
#: ... the decode gemv's MX instances: format -> input dtypes
DECODE_MX_DTYPES = {fmt: tuple(d for f, d in DECODE_MX_B1_MIN_BYTES if f == fmt) for fmt in ("nvfp4", "mxfp4")}


def _gemv_tc_instances(tag: str, qt: str, nested: bool) -> list[tuple[str, str]]:
    return [(_FV, _gemv_tc(tag, qt, nested, nb, xs, short)) for nb in (1, 2) for xs in (False, True)
            for short in (False, True)]


def _gemm4(tag: str, qt: str, nested: bool, cfg: tuple[int, int, int], cl: int = 1) -> str:
    ww, wr, wk = cfg
    return (f"qc::gemm_4bit_kernel<{tag}, {QUANT_TYPE_CODE[qt]}, {_b(nested)}, {ww}, {wr}, {wk}, {_gm_stages(cfg)}, "
            f"{cl}>")


def _qbw(tag: str, cells: bool = True) -> str:
    """quantize_blockwise's default kernel (by cells), or (cells False) the one that subtracts a
    center read from device memory (double_quantize below its chunk-sum size)."""
    return f"qc::quantize_blockwise_v3_kernel<{tag}>" if cells else f"qc::quantize_blockwise_kernel<{tag}>"


def _dqbw(tag: str) -> str:
    return f"qc::dequantize_blockwise_kernel<{tag}>"


def _tree(from_f32: bool | None) -> str:
    """double_quantize's small-input tree level kernels (fp32 or fp64 input); None: the chunk sums."""
    if from_f32 is None:
        return "qc::absmax_chunk_sum_v3_kernel"
    return f"qc::absmax_tree_sum_kernel<{_b(from_f32)}>"


def instances() -> list[tuple[str, str]]:
    """Every (source file, name expression) of the family the backend can launch."""
    tags = list(TYPE_TAG.values())
    out: list[tuple[str, str]] = []
    for qt in bnb.QUANT_TYPES:
        for tag in tags:
            out += [(_F4, _q4(tag, qt))] + [(_F4, _q4v3(tag, qt, g)) for g in _Q4V3_G]
            for nested in (False, True):
                out.append((_F4, _dq4(tag, qt, nested)))
                out.append((_F4, _gemv(tag, qt, nested)))
                if tag != TYPE_TAG["float32"]:
                    out += [(_F4, _gemv_mma(tag, qt, nested, v)) for v in _GEMV_V]
                    out += _gemv_tc_instances(tag, qt, nested)
                    out += [(_FM, _gemm4(tag, qt, nested, cfg)) for cfg in _GM_CONFIGS]
                    out += [(_FM, _gemm4(tag, qt, nested, _GM_CONFIGS[-1], cl)) for cl in _GM_CLUSTERS[1:]]
                    out += [(_FM, _gemm4wg_tma(tag, qt, nested, nb, cl)) for nb in _GW_NB for cl in _GW_CLUSTERS]
    for fmt, dts in DECODE_MX_DTYPES.items():
        for dt in dts:
            out += _gemv_tc_instances(TYPE_TAG[dt], fmt, False)
    for tag in tags:
        out += [(_F8, _qbw(tag)), (_F8, _qbw(tag, cells=False)), (_F8, _dqbw(tag))]
    out += [(_F8, _tree(True)), (_F8, _tree(False)), (_F8, _tree(None))]
    return out


def _gemv_ksplit(ntiles: int, nsp: int, sms: int) -> int:
    """Warps of a CTA that share one 16-row tile (splitting K), for the tensor-core gemv.

    A CTA has 8 warps; with ``ks`` warps per tile it covers 8 / ks tiles, and two CTAs fit on a
    multiprocessor. The split whose CTA count fills the resident slots best (the last wave least
    empty), the smallest on a tie: a longer K range per warp keeps more loads in flight. Each warp
    keeps at least two iterations (8 super-pieces) of K.
    """
    slots = 2 * sms
    best, best_eff = 1, 0.0
    ks = 1
    while ks <= _GEMV_WARPS and (ks == 1 or nsp >= 2 * _GEMV_U * ks):
        groups = _cdiv(ntiles, _GEMV_WARPS // ks)
        eff = groups / (_cdiv(groups, slots) * slots)
        if eff > best_eff + 0.02:
            best, best_eff = ks, eff
        ks *= 2
    return best


class BnbOps:
    """The family's ops (a mixin of CudaBackend)."""

    # -- bitsandbytes 4-bit --------------------------------------------------------------------------
    def quantize_4bit(self, x, packed, absmax, *, blocksize, quant_type):
        n = rt.numel(x)
        if n == 0:
            return
        launch = Launcher(x)
        # kQuantThreads, kQuantElems, kQuantCtasPerSm: a persistent grid of what is resident (the
        # kernels' __launch_bounds__), so every CTA is in the one wave
        threads, elems, per_sm = _G["QC_Q4_THREADS"], _G["QC_Q4_ELEMS"], _G["QC_Q4_CTAS_PER_SM"]
        vec = aligned(x, 16) and aligned(packed, 8)
        g, tag = blocksize // elems, _tag(x)
        if g in _Q4V3_G:  # tiles of threads x elems through a shared-memory ring
            tile = threads * elems
            grid = _resident(launch.device, _cdiv(n, tile), per_sm)
            expr = _q4v3(tag, quant_type, g)
            launch(_F4, expr, (grid,), threads, kernel_args(expr, x=x, packed=packed, absmax=absmax, n=n, vec=vec),
                   shared_mem=_Q4V3_STAGES * tile * as_dtype(dtype_name(x.dtype)).itemsize)
            return
        grid = _resident(launch.device, _cdiv(_cdiv(n, elems), threads), per_sm)
        expr = _q4(tag, quant_type)
        launch(_F4, expr, (grid,), threads,
               kernel_args(expr, x=x, packed=packed, absmax=absmax, n=n, log2bs=_log2(blocksize), vec=vec))

    def dequantize_4bit(self, packed, absmax, out, *, blocksize, quant_type, nested: Nested | None):
        n = rt.numel(out)
        if n == 0:
            return
        launch = Launcher(out)
        launch(*_dequantize_launch(launch.device, packed, absmax, out, n=n, tag=_tag(out), out_aligned=aligned(out, 16),
                                   blocksize=blocksize, quant_type=quant_type, nested=nested))

    def gemv_4bit(self, a, packed, absmax, out, *, n, k, blocksize, quant_type, nested: Nested | None):
        rows = rt.numel(a) // k
        if rows == 0 or n == 0:
            return
        launch = Launcher(a)
        spec = _gemv_launch(launch.device, a, packed, absmax, out, rows=rows, n=n, k=k, blocksize=blocksize,
                            quant_type=quant_type, nested=nested)
        launch(*spec[:6], pdl=spec[0] == _FV)

    def gemv_4bit_grouped(self, a, groups, out, *, k):
        rows = rt.numel(a) // k
        ntot = sum(g[3] for g in groups)
        if rows == 0 or ntot == 0:
            return
        launch = Launcher(a)
        dev, dt = launch.device, dtype_name(a.dtype)
        tc = _gemv_tc_takes_input(dev, dt, a, rows, k)
        col, i = 0, 0
        while i < len(groups):
            p, am, nst, n, bs, qt = groups[i]
            j = i + 1
            if _gemm4_takes(dev, dt, a, p, am, rows, k, bs):  # many rows: the GEMM, one launch per weight
                launch(*_gemm4_launch(dev, a, p, am, nst, out[:, col:], rows=rows, n=n, k=k, blocksize=bs,
                                      quant_type=qt, ldo=ntot)[:6])
            elif tc and _gemv_tc_takes_weight(p, bs):
                # the following weights of the same kind go in the same launch (at most _GT_GROUPS)
                j = grouped_run_end(groups, i, _GT_GROUPS, lambda g, nested=nst is None, bs=bs:
                                    (g[2] is None) == nested and _gemv_tc_takes_weight(g[0], bs))
                launch(*_gemv_tc_launch(dev, a, [g[:4] for g in groups[i:j]], out[:, col:], rows=rows, k=k,
                                        blocksize=bs, quant_type=qt, ldo=ntot)[:6], pdl=True)
            else:
                tmp = self.empty((rows, n), as_dtype(dt), like=a)
                self.gemv_4bit(a, p, am, tmp, n=n, k=k, blocksize=bs, quant_type=qt, nested=nst)
                out[:, col:col + n] = tmp
            col += sum(g[3] for g in groups[i:j])
            i = j

    def double_quantize(self, absmax, qabsmax, absmax2, offset):
        nb = rt.numel(absmax)
        if nb == 0:
            return
        launch = Launcher(absmax)
        size = 1 << (nb - 1).bit_length()  # the tree's padded leaf count
        # two launches: the chunk sums (in qabsmax's first bytes, the CTA counter in offset's 4
        # bytes), then the quantization, which computes and subtracts the offset itself; from two
        # chunks up, and up to _SUM_MAX_PARTS of them
        if _SUM_CHUNK < nb and size // _SUM_CHUNK <= _SUM_MAX_PARTS:
            base = rt.pointer(qabsmax)
            parts = (base + 7) // 8 * 8
            nchunks = _cdiv(nb, _SUM_CHUNK)
            ndefer = _cdiv(parts + 8 * nchunks - base, bnb.NESTED_BLOCKSIZE)  # codes over the sums
            launch(_F8, _tree(None), (nchunks,), _SUM3_THREADS,
                   kernel_args(_tree(None), src=absmax, nb=nb, vec=aligned(absmax, 16), partials=parts,
                               counter=offset))
            self._quantize_blockwise(launch, absmax, None, qabsmax, absmax2, None, nb, bnb.NESTED_BLOCKSIZE,
                                     tree={"partials": parts, "npart": size // _SUM_CHUNK, "nchunks": nchunks,
                                           "offset": offset, "nb": nb, "ndefer": ndefer})
            return
        # below that: tree levels of fp64 partial sums kept in qabsmax's bytes until the codes
        # overwrite them, a one-CTA last level writing the offset, then the quantization
        base = rt.pointer(qabsmax)
        region = (base + 7) // 8 * 8
        src, count, from_f32 = absmax, nb, True
        while True:
            chunks = _cdiv(count, _TREE_CHUNK)
            if chunks == 1:
                launch(_F8, _tree(from_f32), (1,), _G["QC_DQ_TREE_THREADS"],
                       kernel_args(_tree(from_f32), src=src, count=count, partial=None, offset=offset, nb=nb))
                break
            if region + 8 * chunks > base + nb:
                raise AssertionError("double_quantize: partial sums do not fit in qabsmax")  # nb >= 2049 here
            launch(_F8, _tree(from_f32), (chunks,), _G["QC_DQ_TREE_THREADS"],
                   kernel_args(_tree(from_f32), src=src, count=count, partial=region, offset=None, nb=nb))
            src, count, from_f32 = region, chunks, False
            region += 8 * chunks
        self._quantize_blockwise(launch, absmax, None, qabsmax, absmax2, offset, nb,
                                 bnb.NESTED_BLOCKSIZE, cells=False)

    # -- blockwise 8-bit -----------------------------------------------------------------------------
    def _quantize_blockwise(self, launch, x, thresholds, codes, absmax, center, n, blocksize, *,
                            cells=True, tree=None):
        """The default kernel rounds by cells and, with ``tree`` (double_quantize's chunk sums),
        computes and subtracts the offset itself; ``cells`` False: the kernel that subtracts
        ``*center``."""
        vec = aligned(x, 16) and aligned(codes, 8)
        common = {"x": x, "thresholds": thresholds, "codes": codes, "absmax": absmax, "n": n,
                  "log2bs": _log2(blocksize), "vec": vec}
        if cells:
            threads = _G["QC_QBW_THREADS"]  # kernel bounds: 2 CTAs per multiprocessor
            grid = _resident(launch.device, _cdiv(_cdiv(n, 8), threads), 2)
            tree = tree or {"partials": None, "npart": 0, "nchunks": 0, "offset": None, "nb": 0, "ndefer": 0}
            launch(_F8, _qbw(_tag(x)), (grid,), threads, kernel_args(_qbw(_tag(x)), **common, **tree))
            return
        threads = max(256, blocksize // 8)
        expr = _qbw(_tag(x), cells=False)
        launch(_F8, expr, (_resident(launch.device, _cdiv(_cdiv(n, 8), threads), 2048 // threads),),
               threads, kernel_args(expr, **common, center=center))

    def quantize_blockwise(self, x, thresholds, codes, absmax, *, blocksize):
        n = rt.numel(x)
        if n:
            self._quantize_blockwise(Launcher(x), x, thresholds, codes, absmax, None, n, blocksize)

    def dequantize_blockwise(self, codes, absmax, code, out, *, blocksize):
        n = rt.numel(out)
        if n == 0:
            return
        vec = aligned(codes, 8) and aligned(out, 16)
        expr = _dqbw(_tag(out))
        threads = _G["QC_DQBW_THREADS"]
        Launcher(out)(_F8, expr, (_cdiv(n, threads * _G["QC_DQBW_WORDS"] * 8),), threads,
                      kernel_args(expr, codes=codes, absmax=absmax, code=code, out=out, n=n,
                                  log2bs=_log2(blocksize), vec=vec))


# -- gemv_4bit: the kernel choice (shared by the launcher and the eager launch plans) ----------------
#: positions of a and out in the other gemv kernels' parameter lists (the per-call slots of a plan)
_GEMV_SLOTS = tuple(arg_index("gemv_4bit_simple_kernel", a) for a in ("a", "out"))
assert all(tuple(arg_index(k, a) for a in ("a", "out")) == _GEMV_SLOTS
           for k in ("gemv_4bit_mma_kernel", "gemm_4bit_kernel", "gemm_4bit_wgmma_tma_kernel"))
# bnb_gemv.cu: warps per CTA, weights per launch, the bytes of a warp's ring (the generated header's
# QC_GV_*, which the kernel compiles with; QC_GV_XS_BYTES: the input bytes its decode table's free halves hold)
_GT_WARPS, _GT_GROUPS, _GT_RING, _GT_XS, _GT_SHORT_MAX = (
    LAUNCH_GEOMETRY[k] for k in ("QC_GV_WARPS", "QC_GV_GROUPS", "QC_GV_RING", "QC_GV_XS_BYTES", "QC_GV_SHORT_MAX"))
# (chunks per stage, stages) of a warp's ring: the long one, and the short one for little work per warp
_GT_LONG_RING = (LAUNCH_GEOMETRY["QC_GV_CHUNKS"], LAUNCH_GEOMETRY["QC_GV_STAGES"])
_GT_SHORT_RING = (LAUNCH_GEOMETRY["QC_GV_CHUNKS_SHORT"], LAUNCH_GEOMETRY["QC_GV_STAGES_SHORT"])
_GT_SLOTS = tuple(arg_index("gemv_4bit_tc_kernel", a) for a in ("a", "out"))


def _gt_smem(nb: int, device: int) -> int:
    """Dynamic shared memory of the decode gemv: its 64 KiB table must start on a 64 KiB boundary of
    the shared window (the kernel places its small arrays around that boundary and checks the fit):
    the device's maximum, which covers the worst placement."""
    need = 65536 + 4 * _GT_GROUPS * bnb.DYNAMIC_MAP.size + 12 * _GT_WARPS * 2 + _GT_WARPS * _GT_RING
    return max(need + _GT_RING, int(rt.device_props(device).get("sharedMemPerBlockOptin", 0)))


def _gemv_tc_takes_input(device: int, dt: str, a: Any, rows: int, k: int) -> bool:
    """Does the decode kernel (bnb_gemv.cu) take this input? fp16 / bf16 (16 rows per weight
    pass), 64-element chunks, 16-byte rows, sm_90; ``gemv_kernel=1`` picks the mma kernel instead
    (comparisons)."""
    return (dt != "float32" and rows > 0 and k % 64 == 0 and k < 1 << 26 and aligned(a, 16)
            and rt.device_arch(device) >= 90 and rt.tune("gemv_kernel", 0) == 0)


def _gemv_tc_takes_weight(packed: Any, blocksize: int) -> bool:
    """... and this weight: chunks inside blocks, 16-byte aligned codes (the kernel's 16-byte
    cp.async copies), chunk counts in 32 bits."""
    return blocksize >= 64 and aligned(packed, 16) and rt.numel(packed) * 2 // 64 < 1 << 31


def _gemv_tc_launch(device, a, weights, out, *, rows, k, blocksize, quant_type, ldo, scols=0, gscales=()):
    """(file, kernel, grid, block, arguments, shared memory, slots) of the decode gemv over
    ``weights`` [(packed, absmax, nested, n)] (one nestedness) into ``out`` [rows, ldo]. An MX
    ``quant_type`` (weights: codes, scale bytes, None, n) takes ``scols`` (the swizzled scales'
    padded column count, 0 for row-major) and ``gscales`` (per weight NVFP4's global scale, or None)."""
    nested = weights[0][2] is not None
    named = {"a": a, "out": out, "ldo": ldo, "rows": rows, "k": k, "log2bs": _log2(blocksize),
             "ngroups": len(weights), "scols": scols}
    for i, names in enumerate(GEMV_TC_WEIGHT_NAMES):  # packed, absmax, absmax2, code2, offset, n
        p, am, nst, n = weights[i] if i < len(weights) else (None, None, None, 0)
        named.update(zip(names, (p, am, *_nested_named(nst).values(), n)))
    for i, g in enumerate(gscales):
        if g is not None:
            named[GEMV_TC_WEIGHT_NAMES[i][2]] = g  # absmax2_i: NVFP4's global scale
    ntiles = sum(_cdiv(w[3], 16) for w in weights)
    nb = 1 if rows <= 8 else 2
    # a CTA's input rows (8 nb at most) in its decode table's free halves when they fit there
    xs = min(rows, 8 * nb) * k * 2 <= _GT_XS
    grid = (max(1, min(ntiles, rt.sm_count(device))), _cdiv(rows, 8 * nb))
    # the short ring (4-chunk stages) when the busiest warp's range is short: it starts computing
    # after half the bytes of a long stage; long ranges keep the long ring (fewer stage turns)
    short = _cdiv(ntiles, grid[0]) * (k // 64) < _GT_SHORT_MAX * _GT_WARPS
    expr = _gemv_tc(_tag(a), quant_type, nested, nb, xs, rt.tune("gemv_short", int(short)) == 1)
    return (_FV, expr, grid, 32 * _GT_WARPS, kernel_args(expr, **named), _gt_smem(nb, device), _GT_SLOTS)


def decode_gemv_mx_takes(device: int, dt: str, fmt: str, n: int, k: int, px: int, pc: int, ps: int,
                         rows: int) -> bool:
    """Does the decode gemv run linear_mx for this weight and ``rows`` input rows (x, codes, scales at
    addresses px, pc, ps; backends/cuda/mx.py asks)? A (format, input dtype) of DECODE_MX_B1_MIN_BYTES
    and for one row a weight of its bytes or more, 64-element chunks (K % 64 == 0), 16-byte aligned
    input and codes, the scale loads aligned (4 bytes NVFP4, 2 MXFP4), chunk counts in 31 bits, sm_90;
    ``QUANTCORE_CUDA_TUNE=mx_gemv_dec=0`` turns it off."""
    least = DECODE_MX_B1_MIN_BYTES.get((fmt, dt))
    if least is None or (rows == 1 and n * k // 2 < rt.tune("mx_gemv_dec_b1_min", least)):
        return False
    return (k % 64 == 0 and k < 1 << 26 and px % 16 == 0
            and pc % 16 == 0 and ps % (4 if fmt == "nvfp4" else 2) == 0 and n * (k // 64) < 1 << 31
            and rt.device_arch(device) >= 90 and rt.tune("mx_gemv_dec", 1) == 1)


def decode_gemv_mx_launch(device, x, weights, out, *, rows, k, fmt, scols, ldo):
    """The decode gemv's launch (as _gemv_tc_launch gives it) of linear_mx over ``weights`` [(codes,
    scales, global scale or None, n)] (at most _GT_GROUPS, one format): out [rows, ldo] = x @ [W_1 ...]^T."""
    return _gemv_tc_launch(device, x, [(c, s, None, n) for c, s, _, n in weights], out, rows=rows, k=k,
                           blocksize=mx.block_size(fmt), quant_type=fmt, ldo=ldo, scols=scols,
                           gscales=[g for _, _, g, _ in weights])


#: weights one decode-gemv launch reads (kernels_cuda/bnb_gemv.cu QC_GV_GROUPS)
DECODE_GROUPS = _GT_GROUPS


def _nested_named(nested: Nested | None) -> dict[str, Any]:
    """The double-quantization arguments by name (absmax2, code2, offset; None when not nested)."""
    return {"absmax2": nested.absmax2 if nested else None, "code2": nested.code2 if nested else None,
            "offset": nested.offset if nested else None}


# bnb_gemm.cu (gemv_4bit for more than _GM_MIN_ROWS rows): threads, the dynamic shared memory a CTA
# takes (the generated header's QC_GM_*); the CTA shapes (WW, WR, WK): warps along the weight rows
# (64 each), the input rows (32 each) and K, the least L2 traffic per mma first
_GM_THREADS, _GM_SMEM, _GM_TABLE = (LAUNCH_GEOMETRY[k] for k in ("QC_GM_THREADS", "QC_GM_SMEM", "QC_GM_TABLE"))
_GM_CONFIGS = ((4, 2, 1), (8, 1, 1), (2, 2, 2), (4, 1, 2), (2, 1, 4))
#: the cluster sizes (sm_90) that split K further, for the last (most CTAs) shape when its grid is small
_GM_CLUSTERS = (1, 2, 4)
_GM_MAX_STAGES = 6
#: the decode kernel (bnb_gemv.cu) reads the weight once per 16 input rows: above that, the GEMM
_GM_MIN_ROWS = 16


@functools.cache
def _gm_stages(cfg: tuple[int, int, int]) -> int:
    """Ring stages of a CTA shape: the slots that fit around the 64 KiB-aligned pair table in
    _GM_SMEM bytes wherever the window starts (the kernel places the table at the boundary that
    leaves the most), at most _GM_MAX_STAGES."""
    return _ring_stages(gm_slot_bytes(*cfg), _GM_TABLE, _GM_SMEM, _GM_MAX_STAGES, f"{cfg}")


def _ring_stages(slot: int, table: int, smem: int, most_stages: int, what: str, slot_align: int = 16,
                 reserve: int = 0, lead: int = 0, starts: Any = range(0, 65536, 16), least: int = 3) -> int:
    """bnb_gemm.cu's place_table for every window start in ``starts`` (default: any 16-byte step): the
    fewest slots of ``slot`` bytes (from the window's start rounded up to ``slot_align``, plus ``lead``
    bytes) that fit around a ``table``-byte table at a multiple of its size below the window's last
    ``reserve`` bytes (rounded down to 16), at most ``most_stages``; at least ``least`` or an
    AssertionError."""
    worst = most_stages
    for start in starts:
        base, end, most = -(-start // slot_align) * slot_align + lead, (start + smem - reserve) & ~15, 0
        b = -(-base // table) * table
        while b + table <= end:
            most = max(most, (b - base) // slot + (end - b - table) // slot)
            b += table
        worst = min(worst, most)
    if worst < least:
        raise AssertionError(f"bnb_gemm.cu: {what} leaves {worst} ring stages")
    return worst


def _gm_config(rows: int, n: int, sms: int) -> tuple[int, int, int]:
    """The CTA shape for ``rows`` x ``n``: the first of _GM_CONFIGS (least traffic) whose grid fills
    at least 3/4 of the multiprocessors' slots (one CTA each) in its last wave, with no input row
    block more than half empty at 32 rows or fewer; else the one with the most CTAs (``gm_cfg=i``
    forces _GM_CONFIGS[i - 1]: comparisons, tests)."""
    forced = rt.tune("gm_cfg", 0)
    if forced:
        return _GM_CONFIGS[forced - 1]
    best, best_ctas = _GM_CONFIGS[-1], 0
    for ww, wr, wk in _GM_CONFIGS:
        if wr > 1 and rows <= 32:
            continue
        ctas = _cdiv(n, 64 * ww) * _cdiv(rows, 32 * wr)
        if ctas >= 0.75 * sms and ctas / (_cdiv(ctas, sms) * sms) >= 0.75:
            return ww, wr, wk
        if ctas > best_ctas:
            best, best_ctas = (ww, wr, wk), ctas
    return best


def _gemm4_takes(device: int, dt: str, a: Any, packed: Any, absmax: Any, rows: int, k: int, blocksize: int) -> bool:
    """Does the many-row GEMM (bnb_gemm.cu) take this call? More than 16 fp16 / bf16 rows, 64-element
    chunks inside blocks, 16-byte aligned input and codes, 4-byte aligned absmax, chunk counts in 31
    bits, sm_80+ with 227 KiB of shared memory per CTA (``gemm4=0`` or ``gemv_kernel=1`` turn it
    off: comparisons)."""
    return (rows > _GM_MIN_ROWS and dt != "float32" and k % 64 == 0 and blocksize >= 64 and aligned(a, 16)
            and aligned(packed, 16) and aligned(absmax, 4) and rt.numel(packed) * 2 // 64 < 1 << 31
            and gemm4_runs_on(device) and rt.tune("gemm4", 1) == 1 and rt.tune("gemv_kernel", 0) == 0)


#: quantcore.torch's linear_4bit takes gemv_4bit up to this many rows where a many-row GEMM runs,
#: dequantize + matmul above: the wgmma GEMM (compute capability 9.0) is faster at 128 .. 512 rows at
#: 14336 x 4096 and 4096 x 14336 and, but for the wave rule below, slower from 1024 (H200, session 22,
#: docs/performance.md "NF4 prefill on wgmma"), the mma.sync GEMM through 128 (H100, session 16) ...
LINEAR_GEMM_ROWS = {"wgmma": 512, "mma": 128}
#: ... the wgmma GEMM's 512 rows for weights of at least this many elements (4096 x 4096), the mma.sync
#: GEMM's rows below: its grid of 128-row weight tiles is small there (H200, session 24, kernel us,
#: wgmma GEMM / dequantize + matmul: 4096 x 4096 at 256 / 512 / 1024 rows 25.8 / 34.0, 36.5 / 41.7, 54.3 /
#: 62.5; 1024 x 4096 at 256 / 512 rows 25.3 / 16.8, 25.7 / 18.0: tools/dev/eager_layer_wall.py) ...
LINEAR_WGMMA_MIN_WEIGHT = 4096 * 4096
#: ... except for eager calls (not captured in a CUDA graph), which take the wgmma GEMM's 512 rows for
#: every weight: their time is the host's, and the GEMM is one bound launch where dequantize + matmul
#: are two launches, an allocation and F.linear (the same call, wall time per call of back-to-back eager
#: calls: 1024 x 4096 at 512 rows 24.0 against 57.5 us; session 24)
#: ... and above those 512 rows, up to LINEAR_WGMMA_MAX_ROWS, for a call whose rows fill the wgmma
#: GEMM's waves of 256 x 128 tiles to LINEAR_WGMMA_FILL or more (rows x n against waves x SMs x 256 x
#: 128). H100, session 26 (the TMA GEMM; tools/dev/linear_rows_rule.py, us, GEMM / dequantize + matmul,
#: eight Llama-3 8B / 70B weights at 256..4096 rows): fill 0.97 GEMM faster through 2048 rows (4096 x
#: 4096 at 2048 104.2 / 109.2, 28672 x 8192 1324 / 1405), a tie or slower from 3072 (28672 x 8192 at 3072
#: 2018 / 2017, 4096 rows 2784 / 2596); fill 0.85 faster (14336 x 4096 at 1024 / 1536 200.7 / 211.6, 293.5
#: / 298.5); fill 0.73 faster in one wave or at 768 rows, slower at 1536 in two waves (4096 x 14336 318.4
#: / 284.2): these limits take the faster path on all but four 768-row calls (4-9% slower there), 0.85%
#: over the faster on average where the session-23 limits (0.95, 1280 rows) gave 3.3%
LINEAR_WGMMA_MAX_ROWS = 2048
LINEAR_WGMMA_FILL = 0.8


class LinearRule(NamedTuple):
    """linear_4bit's row rule on one device (:func:`gemm4_linear_rule`)."""

    small: int  #: gemv_4bit rows for weights below min_weight in captured calls
    eager_small: int  #: ... in eager calls (``gw_eager=0``: small; comparisons)
    big: int  #: ... for weights from min_weight on
    min_weight: int  #: LINEAR_WGMMA_MIN_WEIGHT (``gw_min_weight`` overrides it; 0 without the wgmma GEMM)
    sms: int  #: multiprocessors of the wgmma GEMM's wave rule (0 where it does not run)


def gemm4_linear_rule(device: int) -> LinearRule:
    """linear_4bit's gemv_4bit rows on ``device`` (LINEAR_GEMM_ROWS); zeros without a many-row GEMM."""
    if not gemm4_runs_on(device):
        return LinearRule(0, 0, 0, 0, 0)
    mma = LINEAR_GEMM_ROWS["mma"]
    if not _gw_runs_on(device):
        return LinearRule(mma, mma, mma, 0, 0)
    big = LINEAR_GEMM_ROWS["wgmma"]
    return LinearRule(mma, big if rt.tune("gw_eager", 1) else mma, big,
                      rt.tune("gw_min_weight", LINEAR_WGMMA_MIN_WEIGHT), rt.sm_count(device))


def gemm4_linear_rows(rule: LinearRule, n: int = 0, k: int = 0, rows: int = 0, eager: bool = False) -> int:
    """linear_4bit's gemv_4bit rows under a device's ``rule`` (:func:`gemm4_linear_rule`) for an [n, k]
    weight (n, k 0: any weight, the smaller rule); with ``rows``, for a call of that many rows: ``rows``
    itself where the wgmma GEMM takes it above its plain limit (the wave rule above); ``eager``: for a
    call not captured in a CUDA graph (the wgmma GEMM's rows for every weight)."""
    small, eager_small, big, min_weight, sms = rule
    if n * k < min_weight:
        return eager_small if eager else small
    if sms and big < rows <= LINEAR_WGMMA_MAX_ROWS:
        tile_rows = max(_GW_NB)  # (input rows of the tile at these rows)
        waves = _cdiv(_cdiv(rows, tile_rows) * _cdiv(n, _GW_WEIGHT_ROWS), sms)
        if rows * n >= LINEAR_WGMMA_FILL * waves * sms * tile_rows * _GW_WEIGHT_ROWS:
            return rows
    return big


def gemm4_runs_on(device: int) -> bool:
    """Can the many-row GEMM run on ``device``: sm_80+ with the shared memory per CTA it takes."""
    return rt.device_arch(device) >= 80 and int(rt.device_props(device).get("sharedMemPerBlockOptin", 0)) >= _GM_SMEM


def _gm_cluster(device: int, cfg: tuple[int, int, int], ctas: int, k: int) -> int:
    """CTAs per cluster splitting K (sm_90, the last shape of _GM_CONFIGS): the largest of
    _GM_CLUSTERS whose grid still fits the multiprocessors once, each CTA keeping 4 stages or more
    (``gm_cl`` forces it)."""
    if cfg != _GM_CONFIGS[-1] or rt.device_arch(device) < 90:
        return 1
    forced = rt.tune("gm_cl", 0)
    if forced:
        return forced
    sms, wk = rt.sm_count(device), cfg[2]
    return max(c for c in _GM_CLUSTERS if c == 1 or (ctas * c <= sms and k // 64 >= 4 * wk * c))


def _gemm4_launch(device, a, packed, absmax, nested, out, *, rows, n, k, blocksize, quant_type, ldo):
    """(file, kernel, grid, block, arguments, shared memory, slots) of the many-row GEMM into ``out``
    [rows, ldo]: grid x the CTA's input row blocks (the CTAs of one weight tile run together), y its
    weight row blocks, z the K slices of a cluster. From _GW_MIN_ROWS rows on sm_90a, the wgmma GEMM."""
    if _gemm4wg_takes(device, rows, n):
        return _gemm4wg_launch(device, a, packed, absmax, nested, out, rows=rows, n=n, k=k, blocksize=blocksize,
                               quant_type=quant_type, ldo=ldo)
    cfg = _gm_config(rows, n, rt.sm_count(device))
    ww, wr, _ = cfg
    grid = (_cdiv(rows, 32 * wr), _cdiv(n, 64 * ww))
    cl = _gm_cluster(device, cfg, grid[0] * grid[1], k)
    expr = _gemm4(_tag(a), quant_type, nested is not None, cfg, cl)
    args = kernel_args(expr, a=a, packed=packed, absmax=absmax, **_nested_named(nested), out=out, ldo=ldo, rows=rows,
                       n=n, k=k, log2bs=_log2(blocksize))
    return _FM, expr, (*grid, cl), _GM_THREADS, args, _GM_SMEM, _GEMV_SLOTS


# bnb_gemm.cu's wgmma GEMM (sm_90a; gemv_4bit from _GW_MIN_ROWS rows): input rows per CTA (the
# m64n128 / m64n256 MMA's N), its dynamic shared memory, the rows from which it takes a call
_GW_NB = (128, 256)
# (threads and weight rows per CTA, shared memory)
_GW_THREADS, _GW_WEIGHT_ROWS, _GW_SMEM = (LAUNCH_GEOMETRY[k] for k in ("QC_GW_THREADS", "QC_GW_ROWS", "QC_GW_SMEM"))
# (H200, session 22, us, mma.sync GEMM / wgmma GEMM: 14336 x 4096 at 32 / 64 / 96 rows 39.4 / 41.2, 59.5 /
# 40.5, 98.1 / 39.7; 4096 x 14336 64.0 / 74.1, 57.4 / 73.3, 103.8 / 72.5: from 96 rows always, from 64 where
# the weight's 128-row tiles alone fill 3/4 of the multiprocessors)
_GW_MIN_ROWS, _GW_WIDE_MIN_ROWS = 65, 33
#: its cluster sizes splitting K (grids smaller than the multiprocessors). Clusters of 4 measured ~2x
#: slower than the same work in one wave without them (H200, session 22: 4096 x 14336 at 256 rows, 32
#: clusters of 4: 124 us; the same FLOPs at 14336 x 4096 without clusters 60 us), 2 faster (512 rows:
#: 64 clusters of 2, 110 us against 149 us without): not offered (``gw_cl=4`` forces it)
_GW_CLUSTERS = (1, 2)


#: the wgmma GEMM's time per multiply-add of the 128-row tile against the 256-row one (H200, session 22:
#: 14336 x 4096 at 512 rows, 4 waves of 128 x 128 tiles 181.6 us, 2 waves of 128 x 256 tiles 120.7 us)
_GW_NB128_COST = 1.5


def _gw_shape(rows: int, n: int, k: int, sms: int) -> tuple[int, int]:
    """The wgmma GEMM's (input rows per CTA, CTAs per cluster splitting K): for each tile, the largest
    of _GW_CLUSTERS whose grid still fits the multiprocessors once (each CTA keeping 8 stages or more),
    then the tile of least estimated time (waves x the CTA's work: NB / CL, the 128-row tile's per
    _GW_NB128_COST). ``gw_nb`` / ``gw_cl`` force them."""
    best = None
    for nb in _GW_NB:
        ctas = _cdiv(rows, nb) * _cdiv(n, _GW_WEIGHT_ROWS)
        cl = max(c for c in _GW_CLUSTERS if c == 1 or (ctas * c <= sms and k // 64 >= 8 * c))
        cost = _cdiv(ctas * cl, sms) * nb / cl * (_GW_NB128_COST if nb == 128 else 1.0)
        if best is None or cost < best[0]:
            best = (cost, nb, cl)
    nb = rt.tune("gw_nb", 0) or best[1]
    return nb, rt.tune("gw_cl", 0) or (best[2] if nb == best[1] else 1)


_GWT_MAX_STAGES = LAUNCH_GEOMETRY["QC_GWT_MAX_STAGES"]
_GWT_CODES = LAUNCH_GEOMETRY["QC_GW_STAGE_CODES"]  # a stage's codes (bnb_gemm.cu kWtCodes)
#: where a CTA's dynamic shared memory starts (the kernel has no static shared memory): 0 or the 1 KiB
#: the system reserves. The kernel traps where its ring does not fit (tests/test_cuda.py runs every tile).
_GWT_WINDOW_STARTS = (0, 1024)


@functools.cache
def _gwt_stages(nb: int) -> int:
    """Ring stages of the TMA GEMM's NB tile: the stages' codes (4 KiB each) at the window's start, then
    the input slots around the pair table, the barriers and code2's copy at its end; the most stages
    whose codes and slots fit at the window starts of _GWT_WINDOW_STARTS."""
    reserve = 4 * bnb.DYNAMIC_MAP.size + 15 + 16 * _GWT_MAX_STAGES
    for s in range(_GWT_MAX_STAGES, 2, -1):
        if _ring_stages(gw_slot_bytes(nb), _GM_TABLE, _GW_SMEM, s, "", slot_align=1024, reserve=reserve,
                        lead=s * _GWT_CODES, starts=_GWT_WINDOW_STARTS, least=0) >= s:
            return s
    raise AssertionError(f"bnb_gemm.cu: the TMA GEMM's NB={nb} tile leaves fewer than 3 stages")


def _gemm4wg_tma(tag: str, qt: str, nested: bool, nb: int, cl: int = 1) -> str:
    """The TMA wgmma GEMM's instance (bnb_gemm.cu gemm_4bit_wgmma_tma_kernel) for an NB tile, clusters of cl."""
    stages = rt.tune("gw_tma_s", 0) or _gwt_stages(nb)  # (a forced depth: the kernel traps where it does not fit)
    return f"qc::gemm_4bit_wgmma_tma_kernel<{tag}, {QUANT_TYPE_CODE[qt]}, {_b(nested)}, {nb}, {stages}, {cl}>"


@functools.lru_cache(maxsize=256)
def _input_map(address: int, rows: int, k: int, nb: int) -> bytes:
    """The TMA GEMM's input map: [rows, k] 16-bit, boxes of 64 x nb, the 128-byte swizzle."""
    return rt.tensor_map_2d(address, "u16", k, rows, 2 * k, (64, nb), 128)


@functools.lru_cache(maxsize=256)
def _codes_map(address: int, n: int, k: int) -> bytes:
    """The TMA GEMM's codes map: [n, k / 2] bytes, boxes of 32 x 128 rows, the 32-byte swizzle."""
    return rt.tensor_map_2d(address, "u8", k // 2, n, k // 2, (32, _GW_WEIGHT_ROWS), 32)


#: the TMA GEMM's maps argument (its position) and the input map in it (byte 0), re-pointed at each
#: call's input by a planned launch (slot 0 of _GEMV_SLOTS: the input)
_GWT_MAPS = ((arg_index("gemm_4bit_wgmma_tma_kernel", "maps"), 0, 0),)


def _gw_runs_on(device: int) -> bool:
    """Does the wgmma GEMM run on ``device``: compute capability 9.0 (sm_90a) unless ``gemm4wg=0``."""
    return rt.device_arch(device) == 90 and rt.tune("gemm4wg", 1) == 1


def _gemm4wg_takes(device: int, rows: int, n: int) -> bool:
    """Does the wgmma GEMM take a call the many-row GEMM would take: compute capability 9.0 (sm_90a),
    more than 64 rows, or more than 32 where the grid of 128-row weight tiles fills 3/4 of the
    multiprocessors (``gemm4wg=0`` turns it off, ``gw_min_rows`` sets the rows: comparisons, tests)."""
    if not _gw_runs_on(device):
        return False
    forced = rt.tune("gw_min_rows", 0)
    if forced:
        return rows >= forced
    return rows >= _GW_MIN_ROWS or (rows >= _GW_WIDE_MIN_ROWS and _cdiv(n, _GW_WEIGHT_ROWS) >= 0.75 * rt.sm_count(device))


def _gemm4wg_launch(device, a, packed, absmax, nested, out, *, rows, n, k, blocksize, quant_type, ldo):
    """(file, kernel, grid, block, arguments, shared memory, slots) of the wgmma GEMM into ``out``
    [rows, ldo]: grid x the tiles (NB input rows x 128 weight rows, input row blocks fastest: the CTAs
    of one weight tile run together): without a cluster a persistent grid, one CTA per multiprocessor
    taking every gridDim.x-th tile (NPW-16: 1-3% faster than a CTA per tile from 1024 rows on), with
    clusters one CTA per tile; z the K slices of a cluster."""
    sms = rt.sm_count(device)
    nb, cl = _gw_shape(rows, n, k, sms)
    tiles = _cdiv(rows, nb) * _cdiv(n, _GW_WEIGHT_ROWS)
    persist = rt.tune("gw_persist", 1)  # (0: a CTA per tile, comparisons; N > 1: N CTAs, tests)
    ctas = min(tiles, sms if persist == 1 else persist) if cl == 1 and persist else tiles
    expr = _gemm4wg_tma(_tag(a), quant_type, nested is not None, nb, cl)
    maps = _input_map(rt.pointer(a), rows, k, nb) + _codes_map(rt.pointer(packed), n, k)
    args = kernel_args(expr, a=a, packed=packed, absmax=absmax, **_nested_named(nested), out=out, ldo=ldo,
                       rows=rows, n=n, k=k, log2bs=_log2(blocksize), maps=maps)
    return _FM, expr, (ctas, 1, cl), _GW_THREADS, args, _GW_SMEM, _GEMV_SLOTS, _GWT_MAPS


def _gemv_launch(device, a, packed, absmax, out, *, rows, n, k, blocksize, quant_type, nested):
    """(file, kernel, grid, block, arguments, shared memory, slots) of the gemv for these arrays;
    ``out`` None leaves its pointer 0 (a plan fills it per call)."""
    dt = dtype_name(a.dtype)
    if _gemm4_takes(device, dt, a, packed, absmax, rows, k, blocksize):
        return _gemm4_launch(device, a, packed, absmax, nested, out, rows=rows, n=n, k=k, blocksize=blocksize,
                             quant_type=quant_type, ldo=n)
    if _gemv_tc_takes_input(device, dt, a, rows, k) and _gemv_tc_takes_weight(packed, blocksize):
        return _gemv_tc_launch(device, a, [(packed, absmax, nested, n)], out, rows=rows, k=k,
                               blocksize=blocksize, quant_type=quant_type, ldo=n)
    common = {"a": a, "packed": packed, "absmax": absmax, **_nested_named(nested), "out": out, "rows": rows, "n": n,
              "k": k, "log2bs": _log2(blocksize)}
    sms = rt.sm_count(device)
    # bytes per lane and super-piece: 8 (a super-piece of 64 elements) unless a block or the
    # row length only allows 32
    v = 8 if blocksize >= 64 and k % 64 == 0 else 4
    if dt != "float32" and k % (8 * v) == 0 and aligned(a, 16) and aligned(packed, v):
        # the register-fed mma kernel (bnb_4bit.cu): sm_80, or blocks / rows the decode kernel leaves
        ksplit = rt.tune("gemv_ksplit", 0) or _gemv_ksplit(_cdiv(n, 16), k // (8 * v), sms)
        ngroups = _cdiv(_cdiv(n, 16), _GEMV_WARPS // ksplit)
        cap = rt.tune("gemv_ctas_per_sm", 0) or 2
        grid = (min(ngroups, cap * sms), _cdiv(rows, 8))
        expr = _gemv_mma(_tag(a), quant_type, nested is not None, v)
        return (_F4, expr, grid, 32 * _GEMV_WARPS, kernel_args(expr, **common, ksplit=ksplit), _GEMV_SMEM,
                _GEMV_SLOTS)
    threads = _G["QC_GEMV_SIMPLE_THREADS"]  # a warp per weight row
    grid = (min(_cdiv(n, threads // 32), 16 * sms), _cdiv(rows, 8))
    expr = _gemv(_tag(a), quant_type, nested is not None)
    return _F4, expr, grid, threads, kernel_args(expr, **common), 0, _GEMV_SLOTS


# -- dequantize_4bit: the launch (shared by the launcher and the eager launch plans) ---------------------
#: positions of packed and out in the dequantize kernel's parameter list
_DEQUANT_SLOTS = tuple(arg_index("dequantize_4bit_kernel", a) for a in ("packed", "out"))


def _dequantize_launch(device, packed, absmax, out, *, n, tag, out_aligned, blocksize, quant_type, nested):
    """(file, kernel, grid, block, arguments) of dequantize_4bit; ``out`` None leaves its pointer 0
    (a plan fills it per call) and ``out_aligned`` says whether it is 16-byte aligned."""
    vec = aligned(packed, 4) and out_aligned
    grid = _resident(device, _cdiv(_cdiv(n, 8), _DEQUANT_THREADS * _DEQUANT_WORDS), 2048 // _DEQUANT_THREADS)
    expr = _dq4(tag, quant_type, nested is not None)
    return (_F4, expr, (grid,), _DEQUANT_THREADS,
            kernel_args(expr, packed=packed, absmax=absmax, **_nested_named(nested), out=out, n=n,
                        log2bs=_log2(blocksize), vec=vec))


