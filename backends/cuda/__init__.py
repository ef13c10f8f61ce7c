"""The ``cuda`` backend: kernels_cuda/*.cu compiled at run time by NVRTC, launched through CuPy.

- Native arrays are the caller's own: torch CUDA tensors or CuPy arrays, used zero-copy (pointers
  are passed to the kernels); results come back as the same kind. A host array raises
  :class:`~quantcore.errors.DeviceError`.
- Every op launches on the caller's current stream (torch's current stream for torch tensors,
  CuPy's for CuPy arrays), does no host synchronization and allocates nothing beyond the outputs
  it is given (one exception: the W4A8 GEMM above the stream kernel's rows takes a workspace for
  the quantized activation from the caller's own allocator, stream-ordered), so it can be
  captured in a CUDA graph.
- Kernels are compiled on first use (one cubin per template instantiation, cached on disk under
  ``$QUANTCORE_CACHE_DIR`` or ``~/.cache/quantcore/cuda``); no nvcc is needed.

Each op has one launcher: the dtype and format select a template instantiation by name
(``qc::dequantize_4bit_kernel<qc::BF16, 0, true>``), not a branch per combination.

The double-quantization offset needs a reduction across the whole absmax array, done in a few
launches without any workspace: the fp64 partial sums of the first launches are kept in the
``qabsmax`` output itself (nb bytes; the partials need about nb/256), which the final launch then
overwrites with the codes. All scratch lives in the op's own outputs, so concurrent ops on
different streams never share memory.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from quantcore import ops
from quantcore.arrays import as_dtype, dtype_name
from quantcore.backend import Availability, Backend, Nested
from quantcore.errors import DeviceError, DTypeError
from quantcore.formats import bnb, ggml
from quantcore.formats.kernel_defines import (
    GGML_FORMAT_CODE,
    LAUNCH_GEOMETRY,
    QUANT_TYPE_CODE,
    W4A8_TC_GEOMETRY,
)

from . import mx as _mx
from . import runtime as rt
from .runtime import NULL, Launcher, aligned, i32, i64, ptr_arg

__all__ = ["CudaBackend", "create", "kernel_instances"]

#: dtype name -> kernel element tag
TYPE_TAG = {"float32": "qc::F32", "float16": "qc::F16", "bfloat16": "qc::BF16"}
GGML_FMT = GGML_FORMAT_CODE  # QC_FMT_* of the generated header (kernels_cuda/ggml.cu)
_F4 = "bnb_4bit.cu"
_F8 = "bnb_8bit.cu"
_FG = "ggml.cu"
_FV = "bnb_gemv.cu"
_FM = "bnb_gemm.cu"

# launch geometry the kernels compile with (the generated header; quantcore.formats.kernel_defines)
_G = LAUNCH_GEOMETRY
_DEQUANT_THREADS, _DEQUANT_WORDS = _G["QC_DQ4_THREADS"], _G["QC_DQ4_WORDS"]
_GEMV_WARPS, _GEMV_U, _GEMV_V = _G["QC_GEMV_MMA_WARPS"], _G["QC_GEMV_MMA_U"], (4, 8)
_GEMV_SMEM = _G["QC_GEMV_MMA_SMEM"]
_TREE_CHUNK = _G["QC_DQ_TREE_CHUNK"]
# double_quantize: absmax values per chunk sum, the most chunk sums the quantize launch reduces, the
# chunk-sum kernel's threads
_SUM_CHUNK, _SUM_MAX_PARTS, _SUM3_THREADS = _G["QC_DQ_SUM_CHUNK"], _G["QC_DQ_SUM_MAX_PARTS"], _G["QC_DQ_SUM_THREADS"]
#: gemm_w4a8_tc_kernel configurations (MT, WGM, WGN, WGK, ST), widest tile first: WGM x WGN x WGK warps
#: (rows x columns x K), a warp 16 MT rows x 32 columns, the CTA tile 16 MT WGM x 32 WGN, ST stages
_W4T_TILES = ((4, 2, 4, 1, 3), (2, 4, 2, 1, 4), (2, 2, 2, 2, 6), (1, 2, 1, 4, 4))
#: the time per output element of the first 4 configurations relative to the first's (measured at
#: n = 4096, docs/performance.md "W4A8 prefill"); the launcher takes the smallest
#: waves x BM x BN x cost (waves of one CTA per multiprocessor); w4t_tile=i forces one
_W4T_COST = (1.0, 1.14, 1.41, 1.92)
_W4_STREAM_WARPS, _W4_STREAM_ROWS = 16, 16  # gemm_w4a8_stream_kernel: kWsWarps (+ 1 producer for LD 0), kWsRows
_W4_SMEM_MAX = 227 * 1024  # dynamic shared memory per CTA on sm_90
#: gemm_w4a8_stream_kernel launches kept per (device, M, N, K, activation dtype, its 16-byte alignment,
#: QUANTCORE_CUDA_TUNE): everything of the launch but the three array pointers
_W4_LAUNCHES: dict[tuple, Any] = {}
_W4_MAX_LAUNCHES = 64  # kept at most (the cache starts over when full)
_W4_FLY = 64 * 1024  # LD 1: weight bytes in flight per CTA the ring should allow (~4.3 TB/s x ~2 us / 132 SMs)
#: the N <= 8 stream kernel's instances as (NB, CL, LD) keys: CL its cluster, LD its ring filler (0
#: bulk copies by a producer warp, 1 cp.async by every warp)
_W4_NB = tuple((nb, cl, ld) for ld in (0, 1) for cl in (1, 2, 4) for nb in (1, 2, 4, 8))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _log2(v: int) -> int:
    return int(v).bit_length() - 1


def _tag(x: Any) -> str:
    return TYPE_TAG[dtype_name(x.dtype)]


def _b(flag: bool) -> str:
    return "true" if flag else "false"


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


def _gemv_tc(tag: str, qt: str, nested: bool, nb: int) -> str:
    return f"qc::gemv_4bit_tc_kernel<{tag}, {QUANT_TYPE_CODE[qt]}, {_b(nested)}, {nb}>"


def _gemm4(tag: str, qt: str, nested: bool, bm: int, bn: int) -> str:
    return f"qc::gemm_4bit_kernel<{tag}, {QUANT_TYPE_CODE[qt]}, {_b(nested)}, {bm}, {bn}, {_gm_stages(bm, bn)}>"


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


def _qg(tag: str, fmt: str) -> str:
    return f"qc::quantize_ggml_kernel<{tag}, {GGML_FMT[fmt]}>"


def _dqg(tag: str, fmt: str) -> str:
    return f"qc::dequantize_ggml_kernel<{tag}, {GGML_FMT[fmt]}>"


def _w4t_act(tag: str, quantize: bool) -> str:
    return f"qc::w4a8_tc_act_kernel<{tag}, {_b(quantize)}>"


def _w4t(tile: tuple[int, ...]) -> str:
    return "qc::gemm_w4a8_tc_kernel<{}, {}, {}, {}, {}>".format(*tile)


def _w4t_geometry(tile: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(BM, BN, threads, shared memory bytes) of a gemm_w4a8_tc_kernel configuration (TcTile in ggml.cu)."""
    g = W4A8_TC_GEOMETRY
    mt, wgm, wgn, wgk, st = tile
    bm, bn, bk = 16 * mt * wgm, 32 * wgn, g["QC_W4T_BK"]
    stage = bm * bk * ggml.Q4_0_BLOCK_BYTES + bn * (bk * ggml.QK + g["QC_W4T_APAD"]) + bk * bn * (8 + 2)
    red = (wgk - 1) * wgm * wgn * mt * 64 * 32 * 4
    return bm, bn, 32 * wgm * wgn * wgk, max(st * stage, red)


def _gemm_small(tag: str, key: tuple[int, int, int]) -> str:
    nb, cl, ld = key
    return f"qc::gemm_w4a8_stream_kernel<{tag}, {nb}, {cl}, {ld}>"


def kernel_instances() -> list[tuple[str, str]]:
    """Every (source file, name expression) the backend can launch."""
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
                    out += [(_FV, _gemv_tc(tag, qt, nested, nb)) for nb in (1, 2)]
                    out += [(_FM, _gemm4(tag, qt, nested, bm, bn)) for bm in _GM_TILES for bn in _GM_TILES]
    for tag in tags:
        out += [(_F8, _qbw(tag)), (_F8, _qbw(tag, cells=False)), (_F8, _dqbw(tag))]
        for fmt in GGML_FMT:
            out += [(_FG, _qg(tag, fmt)), (_FG, _dqg(tag, fmt))]
        out.append((_FG, _w4t_act(tag, True)))
        out += [(_FG, _gemm_small(tag, nb)) for nb in _W4_NB]
    out.append((_FG, _w4t_act(TYPE_TAG["float32"], False)))
    out += [(_FG, _w4t(tile)) for tile in _W4T_TILES]
    out += [(_F8, _tree(True)), (_F8, _tree(False)), (_F8, _tree(None))]
    return out


def _resident(device: int, ctas: int, per_sm: int) -> int:
    """Grid of a persistent kernel: ``ctas`` pieces of work, at most what the device holds at once
    (``per_sm`` CTAs per multiprocessor: the kernel's launch bounds, or 2048 threads' worth), so
    per-CTA set-up is paid once per CTA and every CTA is in the one wave."""
    return max(1, min(ctas, rt.sm_count(device) * per_sm))


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


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self) -> None:
        self._avail: Availability | None = None
        self._lock = threading.Lock()

    # -- discovery -----------------------------------------------------------------------------------
    def availability(self) -> Availability:
        if self._avail is None:
            with self._lock:
                self._avail = self._probe()
        return self._avail

    @staticmethod
    def _probe() -> Availability:
        try:
            cp = rt.cupy()
        except ImportError:
            return Availability(False, "cupy is not installed: pip install quantcore[cuda]")
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001 - no driver, no device: all mean unavailable
            return Availability(False, f"no CUDA device ({type(exc).__name__}: {exc})")
        if count < 1:
            return Availability(False, "no CUDA device")
        try:
            comp = rt.nvrtc()
        except Exception as exc:  # noqa: BLE001
            return Availability(False, str(exc))
        names = ", ".join(rt.device_name(i) for i in range(count))
        return Availability(True, f"{count} device(s): {names}; NVRTC {comp.version[0]}.{comp.version[1]}")

    def devices(self) -> list[str]:
        if not self.availability():
            return []
        return [f"cuda:{i}" for i in range(rt.cupy().cuda.runtime.getDeviceCount())]

    _CAPS: frozenset | None = None

    def capabilities(self):
        if CudaBackend._CAPS is None:  # built once: the core checks it on every call
            CudaBackend._CAPS = frozenset(ops.bnb_capabilities() + ops.ggml_capabilities()
                                          + _mx.capabilities())  # MX family: see backends/cuda/mx.py
        return CudaBackend._CAPS

    # -- arrays --------------------------------------------------------------------------------------
    def prepare(self, x: Any) -> Any:
        rt.check_device_array(x)
        if rt.kind(x) == "torch":
            return x if x.is_contiguous() else x.contiguous()
        return rt.cupy().ascontiguousarray(x)

    def finish(self, native: Any, like: Any) -> Any:
        kn, kl = rt.kind(native), rt.kind(like)
        if kn == kl or kl not in ("torch", "cupy"):
            return native
        if kl == "torch":
            return rt.torch_module().from_dlpack(native)
        return rt.cupy().from_dlpack(native)

    def _default_kind(self, like: Any) -> str:
        k = rt.kind(like) if like is not None else None
        if k in ("torch", "cupy"):
            return k
        return "torch" if _torch_cuda() else "cupy"

    def empty(self, shape, dtype, like=None) -> Any:
        dt = as_dtype(dtype)
        if self._default_kind(like) == "torch":
            torch = _torch()
            device = like.device if rt.kind(like) == "torch" else torch.device("cuda", torch.cuda.current_device())
            return torch.empty(tuple(shape), dtype=_torch_dtype(dt), device=device)
        cp = rt.cupy()
        dev = like.device if rt.kind(like) == "cupy" else cp.cuda.Device()
        with dev:
            return cp.empty(tuple(shape), dtype=_cupy_dtype(dt))

    def from_numpy(self, a: np.ndarray, like: Any = None) -> Any:
        a = np.ascontiguousarray(a)
        if self._default_kind(like) == "torch":
            torch = _torch()
            device = like.device if rt.kind(like) == "torch" else torch.device("cuda", torch.cuda.current_device())
            if a.dtype == as_dtype("bfloat16"):
                return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
            return torch.from_numpy(a.copy()).to(device)
        cp = rt.cupy()
        dev = like.device if rt.kind(like) == "cupy" else cp.cuda.Device()
        with dev:
            return cp.asarray(a.astype(_cupy_dtype(a.dtype), copy=False))

    def to_numpy(self, x: Any) -> np.ndarray:
        if rt.kind(x) == "torch":
            t = x.detach()
            if str(t.dtype) == "torch.bfloat16":
                return t.view(_torch().int16).cpu().numpy().view(as_dtype("bfloat16"))
            return t.cpu().numpy()
        if rt.kind(x) == "cupy":
            return rt.cupy().asnumpy(x)
        raise DeviceError(f"to_numpy takes a torch CUDA tensor or a CuPy array, got {type(x).__name__}")

    def view(self, buf: Any, byte_offset: int, shape, dtype) -> Any:
        dt = as_dtype(dtype)
        nbytes = int(np.prod(shape)) * dt.itemsize
        part = buf.reshape(-1)[byte_offset: byte_offset + nbytes]
        if rt.kind(buf) == "torch":
            return part.view(_torch_dtype(dt)).view(tuple(shape))
        return part.view(_cupy_dtype(dt)).reshape(tuple(shape))

    def synchronize(self) -> None:
        if self.availability():
            rt.cupy().cuda.runtime.deviceSynchronize()

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
            launch(_F4, _q4v3(tag, quant_type, g), (grid,), threads,
                   (ptr_arg(x), ptr_arg(packed), ptr_arg(absmax), i64(n), i32(vec)),
                   shared_mem=_Q4V3_STAGES * tile * as_dtype(dtype_name(x.dtype)).itemsize)
            return
        grid = _resident(launch.device, _cdiv(_cdiv(n, elems), threads), per_sm)
        launch(_F4, _q4(tag, quant_type), (grid,), threads,
               (ptr_arg(x), ptr_arg(packed), ptr_arg(absmax), i64(n), i32(_log2(blocksize)), i32(vec)))

    def dequantize_4bit(self, packed, absmax, out, *, blocksize, quant_type, nested: Nested | None):
        n = rt.numel(out)
        if n == 0:
            return
        launch = Launcher(out)
        launch(*_dequantize_launch(launch.device, packed, absmax, out, n=n, tag=_tag(out), out_aligned=aligned(out, 16),
                                   blocksize=blocksize, quant_type=quant_type, nested=nested))

    def plan_dequantize_4bit(self, packed, state, out_dtype, *, previous, dtype):
        """A launch plan for repeated public ``dequantize_4bit`` calls (see
        ``quantcore.api.EAGER_PLANS``): torch CUDA tensors only; None where the call is not planned."""
        return _plan_dequantize_4bit(packed, state, out_dtype, previous, dtype)

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
                while (j < len(groups) and j - i < _GT_GROUPS and groups[j][4:] == (bs, qt)
                       and (groups[j][2] is None) == (nst is None) and _gemv_tc_takes_weight(groups[j][0], bs)):
                    j += 1
                launch(*_gemv_tc_launch(dev, a, [g[:4] for g in groups[i:j]], out[:, col:], rows=rows, k=k,
                                        blocksize=bs, quant_type=qt, ldo=ntot)[:6], pdl=True)
            else:
                tmp = self.empty((rows, n), as_dtype(dt), like=a)
                self.gemv_4bit(a, p, am, tmp, n=n, k=k, blocksize=bs, quant_type=qt, nested=nst)
                out[:, col:col + n] = tmp
            col += sum(g[3] for g in groups[i:j])
            i = j

    def plan_gemv_4bit(self, A, packed, state, *, previous, n, k):
        """A launch plan for repeated public ``gemv_4bit`` calls (see ``quantcore.api.EAGER_PLANS``):
        torch CUDA tensors only; None where the call is not planned (the full path runs)."""
        return _plan_gemv_4bit(A, packed, state, previous, n, k)

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
                   (ptr_arg(absmax), i64(nb), i32(aligned(absmax, 16)), np.uint64(parts), ptr_arg(offset)))
            self._quantize_blockwise(launch, absmax, NULL, qabsmax, absmax2, NULL, nb, bnb.NESTED_BLOCKSIZE,
                                     tree=(np.uint64(parts), i32(size // _SUM_CHUNK), i32(nchunks),
                                           ptr_arg(offset), i64(nb), i32(ndefer)))
            return
        # below that: tree levels of fp64 partial sums kept in qabsmax's bytes until the codes
        # overwrite them, a one-CTA last level writing the offset, then the quantization
        base = rt.pointer(qabsmax)
        region = (base + 7) // 8 * 8
        src, count, from_f32 = ptr_arg(absmax), nb, True
        while True:
            chunks = _cdiv(count, _TREE_CHUNK)
            if chunks == 1:
                launch(_F8, _tree(from_f32), (1,), 256, (src, i64(count), NULL, ptr_arg(offset), i64(nb)))
                break
            if region + 8 * chunks > base + nb:
                raise AssertionError("double_quantize: partial sums do not fit in qabsmax")  # nb >= 2049 here
            launch(_F8, _tree(from_f32), (chunks,), 256, (src, i64(count), np.uint64(region), NULL, i64(nb)))
            src, count, from_f32 = np.uint64(region), chunks, False
            region += 8 * chunks
        self._quantize_blockwise(launch, absmax, NULL, qabsmax, absmax2, ptr_arg(offset), nb,
                                 bnb.NESTED_BLOCKSIZE, cells=False)

    # -- blockwise 8-bit -----------------------------------------------------------------------------
    def _quantize_blockwise(self, launch, x, thresholds, codes, absmax, center, n, blocksize, *,
                            cells=True, tree=None):
        """The default kernel rounds by cells and, with ``tree`` (double_quantize's chunk sums),
        computes and subtracts the offset itself; ``cells`` False: the kernel that subtracts
        ``*center``."""
        vec = aligned(x, 16) and aligned(codes, 8)
        if cells:
            threads = _G["QC_QBW_THREADS"]  # kernel bounds: 2 CTAs per multiprocessor
            grid = _resident(launch.device, _cdiv(_cdiv(n, 8), threads), 2)
            extra = tree if tree is not None else (NULL, i32(0), i32(0), NULL, i64(0), i32(0))
            launch(_F8, _qbw(_tag(x)), (grid,), threads,
                   (ptr_arg(x), thresholds, ptr_arg(codes), ptr_arg(absmax), i64(n), i32(_log2(blocksize)),
                    i32(vec)) + extra)
            return
        threads = max(256, blocksize // 8)
        launch(_F8, _qbw(_tag(x), cells=False), (_resident(launch.device, _cdiv(_cdiv(n, 8), threads), 2048 // threads),),
               threads, (ptr_arg(x), thresholds, ptr_arg(codes), ptr_arg(absmax), center, i64(n),
                         i32(_log2(blocksize)), i32(vec)))

    def quantize_blockwise(self, x, thresholds, codes, absmax, *, blocksize):
        n = rt.numel(x)
        if n:
            self._quantize_blockwise(Launcher(x), x, ptr_arg(thresholds), codes, absmax, NULL, n, blocksize)

    def dequantize_blockwise(self, codes, absmax, code, out, *, blocksize):
        n = rt.numel(out)
        if n == 0:
            return
        vec = aligned(codes, 8) and aligned(out, 16)
        Launcher(out)(_F8, _dqbw(_tag(out)), (_cdiv(n, 256 * 2 * 8),), 256,
                      (ptr_arg(codes), ptr_arg(absmax), ptr_arg(code), ptr_arg(out), i64(n),
                       i32(_log2(blocksize)), i32(vec)))

    # -- ggml ----------------------------------------------------------------------------------------
    def _quantize_ggml(self, fmt, x, out):
        nblocks = rt.numel(x) // ggml.QK
        if nblocks:
            Launcher(x)(_FG, _qg(_tag(x), fmt), (_cdiv(nblocks, 256),), 256,
                        (ptr_arg(x), ptr_arg(out), i64(nblocks), i32(aligned(x, 16)), i32(aligned(out, 2))))

    def quantize_q4_0(self, w, out):
        self._quantize_ggml("q4_0", w, out)

    def quantize_q8_0(self, a, out):
        self._quantize_ggml("q8_0", a, out)

    def quantize_q8_1(self, a, out):
        self._quantize_ggml("q8_1", a, out)

    def dequantize_ggml(self, q, out, *, fmt):
        nblocks = rt.numel(out) // ggml.QK
        if nblocks:
            Launcher(out)(_FG, _dqg(_tag(out), fmt), (_cdiv(nblocks * 4, 256),), 256,
                          (ptr_arg(q), ptr_arg(out), i64(nblocks), i32(aligned(out, 16))))

    def _gemm(self, wq, act, out, quantize: bool, tag: str, n_rows: int, aligned4: bool):
        """gemm_w4a8_tc_kernel: the activation as Q8_1 values into a workspace (w4a8_tc_act_kernel:
        quantized from the float activation, or repacked from given Q8_1 blocks), then the tiled
        int8 tensor-core GEMM. The workspace (npad x nbp x 42 bytes) is allocated per call from the
        caller's allocator (torch's or CuPy's pool, stream-ordered)."""
        m, nb = int(wq.shape[0]), int(wq.shape[1])
        if m == 0 or n_rows == 0:
            return
        g = W4A8_TC_GEOMETRY
        launch = Launcher(wq)
        npad = _cdiv(n_rows, g["QC_W4T_NPAD"]) * g["QC_W4T_NPAD"]
        nbp = _cdiv(nb, g["QC_W4T_BK"]) * g["QC_W4T_BK"]
        ws = self.empty((npad * nbp * (ggml.QK + 8 + 2),), "uint8", like=wq)  # quants, (d8, -d8 1.5 2^23), s
        vec = aligned(act, 16) if quantize else False
        launch(_FG, _w4t_act(tag, quantize), (npad * nbp // 256,), 256,
               (ptr_arg(act), ptr_arg(ws), i32(n_rows), i64(nb), i32(npad), i64(nbp), i32(vec), i32(aligned4)))
        forced = rt.tune("w4t_tile", -1)
        if 0 <= forced < len(_W4T_TILES):
            tile = _W4T_TILES[forced]
        else:
            sms = rt.sm_count(launch.device)

            def est(i: int) -> float:
                bm, bn = _w4t_geometry(_W4T_TILES[i])[:2]
                return _cdiv(_cdiv(m, bm) * _cdiv(n_rows, bn), sms) * bm * bn * _W4T_COST[i]

            tile = _W4T_TILES[min(range(len(_W4T_COST)), key=est)]
        bm, bn, threads, smem = _w4t_geometry(tile)
        wfast = nb % g["QC_W4T_BK"] == 0 and aligned(wq, 16)
        ovec = n_rows % 2 == 0 and aligned(out, 8)
        launch(_FG, _w4t(tile), (_cdiv(m, bm), _cdiv(n_rows, bn)), threads,
               (ptr_arg(wq), ptr_arg(ws), ptr_arg(out), i64(m), i32(n_rows), i64(nb), i32(npad), i64(nbp),
                i32(wfast), i32(ovec)), shared_mem=smem)

    def gemm_q4_0_q8_1(self, wq, aq, out):
        self._gemm(wq, aq, out, False, TYPE_TAG["float32"], int(aq.shape[0]), aligned(aq, 4))

    def gemm_w4a8(self, wq, a, out):
        k = int(wq.shape[1]) * ggml.QK
        n = rt.numel(a) // k
        if not self._gemm_w4a8_small(wq, a, out, n, k):
            self._gemm(wq, a, out, True, _tag(a), n, False)

    def _gemm_w4a8_small(self, wq, a, out, n: int, k: int) -> bool:
        """N <= 8 on sm_90: the streaming kernel; False where it does not apply (then the tensor-core
        kernel runs). QUANTCORE_CUDA_TUNE: w4a8_small=0 sends these calls to the tensor-core kernel
        too; w4s_load=0 (default) fills the stream
        kernel's ring by bulk copies from a producer warp, 1 by cp.async from every warp (W-14:
        bit-equal, slower on the H200); w4s_cl (cluster 1/2/4), w4s_kc (blocks per stage row),
        w4s_stages (ring depth), w4s_fly (KiB in flight, w4s_load=1) override its geometry."""
        m, nbk = int(wq.shape[0]), k // ggml.QK
        if not (1 <= n <= 8 and m > 0 and nbk % 8 == 0 and aligned(wq, 16)):
            return False
        launch = Launcher(wq)
        # the stream kernel's launches, kept per geometry and tuning: a repeated call skips the
        # geometry search below and CuPy's argument conversion (its three pointers go into slots)
        stream = launch.raw_stream()
        key = (launch.device, m, n, k, _tag(a), aligned(a, 16), rt.tune_spec())
        planned = _W4_LAUNCHES.get(key) if stream is not None else None
        if planned is not None:
            planned(stream, rt.pointer(wq), rt.pointer(a), rt.pointer(out))
            return True
        if rt.tune("w4a8_small", 1) == 0 or rt.device_arch(launch.device) < 90:
            return False
        nb = 1 << (n - 1).bit_length()
        sms = rt.sm_count(launch.device)
        ld = 1 if rt.tune("w4s_load", 0) else 0
        # Cluster: the smallest that keeps the activation quantized per CTA (NB x K / CL
        # blocks, one lane each) at most 2048 blocks, so the prologue hides under the ring's fill.
        cl = rt.tune("w4s_cl", 0)
        if cl not in (1, 2, 4):
            cl = next((c for c in (1, 2, 4) if nb * _cdiv(nbk, c) <= 2048), 4)
        kbs = _cdiv(_cdiv(nbk, cl), 8) * 8
        # Clusters of one wave: a cluster lives in one GPC; 2 SMs always pair up there, 4 not
        # always (ncu, H200: 30 clusters of 4 on 132 SMs).
        waves = {1: sms, 2: sms // 2, 4: sms * 7 // 32}[cl]
        ntiles = _cdiv(m, _W4_STREAM_ROWS)
        tpc = _cdiv(ntiles, max(1, waves))
        fixed = kbs * nb * 40 + (2 * 16 + tpc) * _W4_STREAM_ROWS * nb * 4
        # Blocks per stage row. The time grows with the number of stages per CTA (measured:
        # docs/performance.md, the W4A8 N <= 8 log), so LD 0 takes the largest that leaves 2 stages. LD 1 runs nstage - 2 stages ahead, so
        # kc is halved until those hold w4s_fly bytes (or the ring is at its depth cap, where
        # halving kc would only shrink them).
        fly, cap = rt.tune("w4s_fly", _W4_FLY // 1024) * 1024, rt.tune("w4s_stages", 8)
        kc = min(kbs, _cdiv(rt.tune("w4s_kc", 128), 8) * 8)
        while True:
            units = _cdiv(kc * ggml.Q4_0_BLOCK_BYTES, 16)
            stage = _W4_STREAM_ROWS * 16 * (units if units % 2 else units + 1) + 16  # ws_stride
            nstage = min(cap, (_W4_SMEM_MAX - fixed) // stage)
            if kc <= 8 or (nstage >= 2 and (ld == 0 or nstage >= cap or (nstage - 2) * (stage - 16) >= fly)):
                break
            kc = _cdiv(kc // 2, 8) * 8
        if nstage >= 2:
            spec = (_FG, _gemm_small(_tag(a), (nb, cl, ld)), (cl * _cdiv(ntiles, tpc),),
                    32 * (_W4_STREAM_WARPS + 1 - ld))
            geometry = (i64(m), i32(n), i64(k), i32(kbs), i32(kc), i32(nstage), i32(tpc), i32(aligned(a, 16)))
            smem = fixed + nstage * stage
            launch(*spec, (ptr_arg(wq), ptr_arg(a), ptr_arg(out)) + geometry, shared_mem=smem)
            if stream is not None:
                if len(_W4_LAUNCHES) >= _W4_MAX_LAUNCHES:
                    _W4_LAUNCHES.clear()
                _W4_LAUNCHES[key] = rt.PlannedLaunch(launch.device, *spec, (NULL,) * 3 + geometry,
                                                     shared_mem=smem, slots=(0, 1, 2))
            return True
        return False

    # -- MX family (NVFP4, MXFP4, MXFP8): launchers in backends/cuda/mx.py ----------------------------
    def mx_quantize(self, x, codes, scales, *, rows, cols, fmt, scale_mode, swizzled, global_scale=None):
        _mx.mx_quantize(self, x, codes, scales, rows=rows, cols=cols, fmt=fmt, scale_mode=scale_mode,
                        swizzled=swizzled, global_scale=global_scale)

    def mx_dequantize(self, codes, scales, out, *, rows, cols, fmt, swizzled, global_scale=None):
        _mx.mx_dequantize(self, codes, scales, out, rows=rows, cols=cols, fmt=fmt, swizzled=swizzled,
                          global_scale=global_scale)

    def swizzle_scales(self, scales, out, *, rows, cols):
        _mx.swizzle_scales(self, scales, out, rows=rows, cols=cols)

    def unswizzle_scales(self, swz, out, *, rows, cols):
        _mx.unswizzle_scales(self, swz, out, rows=rows, cols=cols)

    def scaled_fp4_mm(self, a, b, scale_a, scale_b, alpha, bias, out, *, m, n, k, fmt):
        _mx.scaled_fp4_mm(self, a, b, scale_a, scale_b, alpha, bias, out, m=m, n=n, k=k, fmt=fmt)

    def linear_mx(self, x, codes, scales, out, *, n, k, fmt, swizzled, global_scale=None):
        _mx.linear_mx(self, x, codes, scales, out, n=n, k=k, fmt=fmt, swizzled=swizzled, global_scale=global_scale)


# -- dtype maps ------------------------------------------------------------------------------------------
def _torch():
    torch = rt.torch_module()
    if torch is None:
        import torch  # noqa: PLC0415 - only reached when the caller works with torch or has it
    return torch


def _torch_cuda() -> bool:
    try:
        return bool(_torch().cuda.is_available())
    except ImportError:
        return False


def _torch_dtype(dt: np.dtype):
    torch = _torch()
    name = dtype_name(dt)
    if not hasattr(torch, name):
        raise DTypeError(f"no torch dtype for {name}")
    return getattr(torch, name)


def _cupy_dtype(dt: np.dtype) -> np.dtype:
    dt = as_dtype(dt)
    if dtype_name(dt) == "bfloat16":
        try:
            rt.cupy().empty((0,), dtype=dt)
        except Exception as exc:  # noqa: BLE001
            raise DTypeError("this CuPy has no bfloat16 arrays; pass torch tensors for bfloat16 "
                             f"({type(exc).__name__}: {exc})") from exc
    return dt


def create() -> CudaBackend:
    return CudaBackend()


# -- gemv_4bit: the kernel choice (shared by the launcher and the eager launch plans) ----------------
#: positions of a and out in the older gemv kernels' parameter lists (the per-call slots of a plan)
_GEMV_SLOTS = (0, 6)
# bnb_gemv.cu: warps per CTA, weights per launch, the bytes of a warp's ring (the generated header's
# QC_GV_*, which the kernel compiles with); a and out are parameters 0 and 1 + 6 * _GT_GROUPS
_GT_WARPS, _GT_GROUPS, _GT_RING = (LAUNCH_GEOMETRY[k] for k in ("QC_GV_WARPS", "QC_GV_GROUPS", "QC_GV_RING"))
_GT_SLOTS = (0, 1 + 6 * _GT_GROUPS)


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
    """... and this weight: chunks inside blocks, 8-byte rows, chunk counts in 32 bits."""
    return blocksize >= 64 and aligned(packed, 8) and rt.numel(packed) * 2 // 64 < 1 << 31


def _gemv_tc_launch(device, a, weights, out, *, rows, k, blocksize, quant_type, ldo):
    """(file, kernel, grid, block, arguments, shared memory, slots) of the decode gemv over
    ``weights`` [(packed, absmax, nested, n)] (one nestedness) into ``out`` [rows, ldo]."""
    nested = weights[0][2] is not None
    args = [ptr_arg(a)]
    for i in range(_GT_GROUPS):
        if i < len(weights):
            p, am, nst, n = weights[i]
            args += [ptr_arg(p), ptr_arg(am)]
            args += [ptr_arg(nst.absmax2), ptr_arg(nst.code2), ptr_arg(nst.offset)] if nst else [NULL] * 3
            args.append(i64(n))
        else:
            args += [NULL] * 5 + [i64(0)]
    args += [ptr_arg(out) if out is not None else NULL, i64(ldo), i32(rows), i64(k), i32(_log2(blocksize)),
             i32(len(weights))]
    ntiles = sum(_cdiv(w[3], 16) for w in weights)
    nb = 1 if rows <= 8 else 2
    grid = (max(1, min(ntiles, rt.sm_count(device))), _cdiv(rows, 8 * nb))
    return (_FV, _gemv_tc(_tag(a), quant_type, nested, nb), grid, 32 * _GT_WARPS, tuple(args),
            _gt_smem(nb, device), _GT_SLOTS)


# bnb_gemm.cu (gemv_4bit for more than _GM_MIN_ROWS rows): threads, tile row pitch (the generated
# header's QC_GM_*); the tile sizes instantiated along both M (input rows) and N
_GM_THREADS, _GM_PITCH = (LAUNCH_GEOMETRY[k] for k in ("QC_GM_THREADS", "QC_GM_PITCH"))
_GM_TILES = (32, 64, 128)
_GM_SMEM_BUDGET = 113 * 1024  # two CTAs per SM (228 KiB, 1 KiB each reserved)
#: the decode kernel (bnb_gemv.cu) reads the weight once per 16 input rows: above that, the GEMM
_GM_MIN_ROWS = 16


def _gm_smem(bm: int, bn: int, stages: int) -> int:
    """The GEMM's shared memory (GmGeo::kBytes): the ring (a stage: activation tile, packed tile, 8
    bytes of scale data per weight row), two decoded weight tiles, the tables."""
    return stages * _gm_slot(bm, bn) + 2 * bn * _GM_PITCH + 4 * (16 + bnb.DYNAMIC_MAP.size)


def _gm_slot(bm: int, bn: int) -> int:
    return bm * _GM_PITCH + bn * 32 + bn * 8


def _gm_stages(bm: int, bn: int) -> int:
    """Ring stages of a (BM, BN) tile: as many as two CTAs per SM allow, 3 to 8."""
    return max(3, min(8, (_GM_SMEM_BUDGET - _gm_smem(bm, bn, 0)) // _gm_slot(bm, bn)))


def _gemm4_takes(device: int, dt: str, a: Any, packed: Any, absmax: Any, rows: int, k: int, blocksize: int) -> bool:
    """Does the many-row GEMM (bnb_gemm.cu) take this call? More than 16 fp16 / bf16 rows, 64-element
    stages inside blocks, 16-byte aligned input and codes, 4-byte aligned absmax, sm_80+ (``gemm4=0``
    or ``gemv_kernel=1`` turn it off: comparisons)."""
    return (rows > _GM_MIN_ROWS and dt != "float32" and k % 64 == 0 and blocksize >= 64 and aligned(a, 16)
            and aligned(packed, 16) and aligned(absmax, 4) and rt.device_arch(device) >= 80
            and rt.tune("gemm4", 1) == 1 and rt.tune("gemv_kernel", 0) == 0)


def _gemm4_launch(device, a, packed, absmax, nested, out, *, rows, n, k, blocksize, quant_type, ldo):
    """(file, kernel, grid, block, arguments, shared memory, slots) of the many-row GEMM into ``out``
    [rows, ldo]. Tiles: BM input rows (the fewest of 32 / 64 / 128 that cover them, 128 above),
    BN weight rows (the largest of 128 / 64 that still gives every SM a CTA, else 32)."""
    bm = rt.tune("gm_bm", 0) or next((t for t in _GM_TILES if rows <= t), _GM_TILES[-1])
    sms = rt.sm_count(device)
    bn = rt.tune("gm_bn", 0) or next((t for t in (128, 64) if _cdiv(n, t) * _cdiv(rows, bm) >= sms), 32)
    smem = _gm_smem(bm, bn, _gm_stages(bm, bn))
    nest = (ptr_arg(nested.absmax2), ptr_arg(nested.code2), ptr_arg(nested.offset)) if nested else (NULL,) * 3
    args = (ptr_arg(a), ptr_arg(packed), ptr_arg(absmax)) + nest + (
        ptr_arg(out) if out is not None else NULL, i64(ldo), i32(rows), i64(n), i64(k), i32(_log2(blocksize)))
    return (_FM, _gemm4(_tag(a), quant_type, nested is not None, bm, bn), (_cdiv(n, bn), _cdiv(rows, bm)),
            _GM_THREADS, args, smem, _GEMV_SLOTS)


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
    nest = (ptr_arg(nested.absmax2), ptr_arg(nested.code2), ptr_arg(nested.offset)) if nested else (NULL,) * 3
    common = (ptr_arg(a), ptr_arg(packed), ptr_arg(absmax)) + nest + (
        ptr_arg(out) if out is not None else NULL, i32(rows), i64(n), i64(k), i32(_log2(blocksize)))
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
        return (_F4, _gemv_mma(_tag(a), quant_type, nested is not None, v), grid, 32 * _GEMV_WARPS,
                common + (i32(ksplit),), _GEMV_SMEM, _GEMV_SLOTS)
    grid = (min(_cdiv(n, 8), 16 * sms), _cdiv(rows, 8))
    return _F4, _gemv(_tag(a), quant_type, nested is not None), grid, 256, common, 0, _GEMV_SLOTS


# -- dequantize_4bit: the launch (shared by the launcher and the eager launch plans) ---------------------
#: positions of packed and out in the dequantize kernel's parameter list
_DEQUANT_SLOTS = (0, 5)


def _dequantize_launch(device, packed, absmax, out, *, n, tag, out_aligned, blocksize, quant_type, nested):
    """(file, kernel, grid, block, arguments) of dequantize_4bit; ``out`` None leaves its pointer 0
    (a plan fills it per call) and ``out_aligned`` says whether it is 16-byte aligned."""
    vec = aligned(packed, 4) and out_aligned
    nest = (ptr_arg(nested.absmax2), ptr_arg(nested.code2), ptr_arg(nested.offset)) if nested else (NULL,) * 3
    grid = _resident(device, _cdiv(_cdiv(n, 8), _DEQUANT_THREADS * _DEQUANT_WORDS), 2048 // _DEQUANT_THREADS)
    return (_F4, _dq4(tag, quant_type, nested is not None), (grid,), _DEQUANT_THREADS,
            (ptr_arg(packed), ptr_arg(absmax)) + nest + (ptr_arg(out) if out is not None else NULL, i64(n),
                                                         i32(_log2(blocksize)), i32(vec)))


# -- eager launch plans (quantcore.api keeps them on the QuantState) ---------------------------------
_TENSOR: Any = None  # torch.Tensor, set when the first plan is made (torch is imported by then)
_MAX_GEOMETRIES = 8  # input geometries one plan keeps


def _tfp(t: Any) -> Any:
    """What the core's checks, the adapters and a launch read from an array: pointer, shape,
    strides, dtype and device of a torch tensor; None for None; False for anything else (never
    equal to a tensor's)."""
    if isinstance(t, _TENSOR):
        return t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device()
    return None if t is None else False


def _state_fp(s: Any) -> tuple:
    """The state's arrays and its nested state's fields. The state's own scalar fields are not
    read: assigning any field drops the state's plans (QuantState.__setattr__), and a plan is
    made only while they are immutable (a tuple shape)."""
    s2 = s.state2
    return (_tfp(s.absmax), _tfp(s.code), _tfp(s.offset),
            None if s2 is None else (s2.blocksize, _tfp(s2.absmax), _tfp(s2.code)))


class _StatePlan:
    """Launches of one op for one state and one packed weight on one device under one tuning
    setting, one per call geometry: ``entries`` maps a call's key (what the core's checks and the
    kernel choice read from the arguments besides the state, the packed weight and the devices)
    to what the call needs (output shape, dtype, launch). Subclasses say what the key is."""

    __slots__ = ("device", "ctx", "tune", "packed_fp", "state_fp", "entries", "hits", "_stream", "_ctx_now")

    def __init__(self, device: int, ctx: int, packed: Any, state: Any, tune: Any, stream: Any, ctx_now: Any):
        global _TENSOR
        _TENSOR = rt.torch_module().Tensor
        self.device, self.ctx, self.tune = device, ctx, tune
        self.packed_fp, self.state_fp = _tfp(packed), _state_fp(state)
        self.entries: dict[tuple, tuple] = {}
        self.hits = 0
        self._stream, self._ctx_now = stream, ctx_now

    def same(self, device: int, packed: Any, state: Any, tune: Any) -> bool:
        return (device == self.device and tune == self.tune and _tfp(packed) == self.packed_fp
                and _state_fp(state) == self.state_fp)

    def _entry(self, key: Any, packed: Any, state: Any) -> Any:
        """The entry of ``key`` while the packed weight, the state's arrays and the tuning are
        those the plan was made for, else None."""
        entry = self.entries.get(key)
        if (entry is None or _tfp(packed) != self.packed_fp or _state_fp(state) != self.state_fp
                or rt.tune_spec() != self.tune):
            return None
        return entry

    def _launch(self, launch: Any, first: Any, out: Any) -> Any:
        """Run a matched entry's launch on the caller's stream with these two arrays; None (the
        full path runs) when the thread's current context is another device's."""
        if self._ctx_now() != self.ctx:
            return None
        launch(self._stream(self.device), first.data_ptr(), out.data_ptr())
        self.hits += 1
        return out

    def add(self, key: Any, value: tuple) -> None:
        if len(self.entries) >= _MAX_GEOMETRIES and key not in self.entries:
            self.entries.clear()
        self.entries[key] = value


class _GemvPlan(_StatePlan):
    """gemv_4bit's plan; a call's key is the input's (shape, dtype, 16-byte alignment), all that
    the core's checks and the kernel choice read from the input besides its device and contiguity."""

    __slots__ = ()

    @staticmethod
    def key(A: Any) -> tuple:
        return A.shape, A.dtype, not A.data_ptr() & 15

    def match(self, A: Any, packed: Any, state: Any) -> Any:
        """The (output shape, launch) for these arguments, or None."""
        if type(A) is not _TENSOR or not A.is_contiguous() or A.get_device() != self.device:
            return None
        return self._entry(self.key(A), packed, state)

    def __call__(self, A: Any, packed: Any, state: Any) -> Any:
        entry = self.match(A, packed, state)
        if entry is None:
            return None
        return self._launch(entry[1], A, A.new_empty(entry[0]))

    def bind(self, A: Any, packed: Any, state: Any) -> _BoundGemv | None:
        """This plan's launch for A's geometry bound to these tensors (see :class:`_BoundGemv`), or
        None where the plan does not match them or a tensor counts no versions (inference tensors)."""
        entry = self.match(A, packed, state)
        if entry is None:
            return None
        s2 = state.state2
        arrays = (packed, state.absmax, state.code, state.offset) + ((s2.absmax, s2.code) if s2 is not None else ())
        try:
            return _BoundGemv(self, self.key(A), entry, tuple(t for t in arrays if t is not None))
        except RuntimeError:  # "Inference tensors do not track version counter"
            return None


class _BoundGemv:
    """One gemv plan entry bound to one input geometry and to the weight's and the state's tensors
    as they are now, for a caller that repeats the same call (a module's eager forward). A call
    checks the input (exact tensor type, shape, dtype, device, contiguity, 16-byte alignment), that
    the bound tensors keep their pointers and version counters (every in-place change, set_ /
    resize_ included, bumps a version; ``.data =`` gives another pointer), the thread's context and
    the tuning, then launches; anything else returns None and the caller takes the public path."""

    __slots__ = ("shape", "dtype", "align", "device", "out_shape", "launch", "tensors", "stamps", "plan")

    def __init__(self, plan: Any, key: tuple, entry: tuple, tensors: tuple):
        self.plan = plan
        self.shape, self.dtype, self.align = key
        self.device, self.out_shape, self.launch = plan.device, entry[0], entry[1]
        self.tensors = tensors
        self.stamps = tuple((t.data_ptr(), t._version) for t in tensors)

    def __call__(self, A: Any) -> Any:
        if (type(A) is not _TENSOR or A.shape != self.shape or A.dtype != self.dtype
                or (not A.data_ptr() & 15) != self.align or not A.is_contiguous()
                or A.get_device() != self.device):
            return None
        for t, (ptr, version) in zip(self.tensors, self.stamps):
            if t.data_ptr() != ptr or t._version != version:
                return None
        if rt.tune_spec() != self.plan.tune:
            return None
        return self.plan._launch(self.launch, A, A.new_empty(self.out_shape))


class _DequantPlan(_StatePlan):
    """dequantize_4bit's plan; a call's key is its ``out_dtype`` argument as given (the output's
    shape is the state's, its 16-byte alignment is checked per call)."""

    __slots__ = ()

    def match(self, packed: Any, state: Any, out_dtype: Any) -> Any:
        """The (output shape, torch dtype, launch) for these arguments, or None."""
        try:
            return self._entry(out_dtype, packed, state)
        except TypeError:  # an unhashable out_dtype: the full path reports it
            return None

    def __call__(self, packed: Any, state: Any, out_dtype: Any = None) -> Any:
        entry = self.match(packed, state, out_dtype)
        if entry is None:
            return None
        out = packed.new_empty(entry[0], dtype=entry[1])
        if out.data_ptr() & 15:  # the launch was set up for 16-byte stores
            return None
        return self._launch(entry[2], packed, out)


def _plannable(torch: Any, state: Any, arrays: tuple) -> bool:
    """May a call on these arrays and this state be planned? Only where prepare() hands the arrays
    through as they are (contiguous CUDA tensors) and the checks read nothing that can change
    without a field assignment or a new pointer: a host code table is compared by value on every
    call, a list shape can change in place."""
    s2 = state.state2
    need = arrays + (state.absmax,) + ((state.offset, s2.absmax, s2.code) if s2 is not None else ())
    if not all(isinstance(t, torch.Tensor) and t.is_cuda and t.is_contiguous() for t in need):
        return False
    if state.code is not None and not (isinstance(state.code, torch.Tensor) and state.code.is_cuda):
        return False
    return type(state.shape) is tuple and all(isinstance(d, (int, np.integer)) for d in state.shape)


def _plan_for(cls: type, previous: Any, device: int, packed: Any, state: Any) -> Any:
    """``previous`` when it was made for the same weight, state and tuning, else a new plan."""
    tune = rt.tune_spec()
    if isinstance(previous, cls) and previous.same(device, packed, state, tune):
        return previous
    return cls(device, rt.device_context(device), packed, state, tune, rt.raw_stream_getter(),
               rt.cupy().cuda.driver.ctxGetCurrent)


def _state_nested(state: Any) -> Nested | None:
    s2 = state.state2
    return Nested(absmax2=s2.absmax, code2=s2.code, offset=state.offset) if s2 is not None else None


def _plan_gemv_4bit(A: Any, packed: Any, state: Any, previous: Any, n: int, k: int) -> _GemvPlan | None:
    torch = rt.torch_module()
    if torch is None or type(A) is not torch.Tensor or n == 0 or not _plannable(torch, state, (A, packed)):
        return None
    rows = A.numel() // k
    if rows == 0:
        return None
    device = A.get_device()
    plan = _plan_for(_GemvPlan, previous, device, packed, state)
    if _GemvPlan.key(A) in plan.entries:
        return plan  # it had this call: the thread's current context was another device's
    spec = _gemv_launch(device, A, packed, state.absmax, None, rows=rows, n=n, k=k, blocksize=state.blocksize,
                        quant_type=state.quant_type, nested=_state_nested(state))
    launch = rt.PlannedLaunch(device, *spec[:5], shared_mem=spec[5], slots=spec[6], pdl=spec[0] == _FV)
    plan.add(_GemvPlan.key(A), (tuple(A.shape[:-1]) + (n,), launch))
    return plan


def _plan_dequantize_4bit(packed: Any, state: Any, out_dtype: Any, previous: Any, dtype: str) -> _DequantPlan | None:
    torch = rt.torch_module()
    if torch is None or not isinstance(packed, torch.Tensor) or not _plannable(torch, state, (packed,)):
        return None
    n = math.prod(state.shape)
    if n == 0:
        return None
    try:
        hash(out_dtype)
    except TypeError:
        return None
    device = packed.get_device()
    plan = _plan_for(_DequantPlan, previous, device, packed, state)
    if out_dtype in plan.entries:
        return plan  # it had this call: the thread's current context was another device's
    spec = _dequantize_launch(device, packed, state.absmax, None, n=n, tag=TYPE_TAG[dtype], out_aligned=True,
                              blocksize=state.blocksize, quant_type=state.quant_type, nested=_state_nested(state))
    launch = rt.PlannedLaunch(device, *spec, slots=_DEQUANT_SLOTS)
    plan.add(out_dtype, (tuple(state.shape), _torch_dtype(as_dtype(dtype)), launch))
    return plan
