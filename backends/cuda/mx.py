"""The MX family (NVFP4, MXFP4, MXFP8) on the ``cuda`` backend: launchers of
``kernels_cuda/mx_quant.cu`` and ``kernels_cuda/mx_gemm.cu``.

Each op here takes the backend instance first and then the arguments of the protocol method of
the same name (:class:`quantcore.backend.Backend`, section "MX family"); arguments arrive
validated by the core, outputs are preallocated, and nothing here synchronizes or reads a device
value on the host. Only scaled_fp4_mm's panel path (:func:`mm_path`) allocates: its workspace and
a 4-byte beta from the output's allocator (torch's caching allocator or CuPy's pool, stream-ordered),
and it calls cuBLAS through CuPy; the other ops, and scaled_fp4_mm below MM_FUSED_MAX_M rows, can be
captured in a CUDA graph (the panel path under capture is not tested).

Arrays are torch CUDA tensors or CuPy arrays (contiguous); kernels run on the caller's current
stream (torch's current stream for tensors, CuPy's for CuPy arrays) on the array's device.

Build, load and launch go through the backend's one CUDA runtime (:mod:`.runtime`): the sources
are compiled at first use with its NVRTC (ctypes) into a cubin for the device, with the include
folders of the other kernels (the generated format constants of
:func:`quantcore.formats.kernel_defines.constants_header`, ``mx_common.cuh``) and the same flags
(:data:`.runtime.COMPILE_OPTIONS`: ``-ftz=false --fmad=false -prec-div=true`` the exact
conversions need), cached by :func:`quantcore.cache.cached_bytes`. The GEMM module is built
for ``sm_90a`` on compute capability 9.0 (wgmma back end) and for ``sm_XY`` elsewhere (mma.sync
back end, sm_80 and newer); ``QUANTCORE_CUDA_MX_GEMM=mma`` forces the mma.sync back end.
"""

from __future__ import annotations

import importlib.resources
import os
import threading
from typing import Any

import numpy as np

from quantcore import cache
from quantcore.arrays import as_dtype, dtype_name
from quantcore.backend import grouped_run_end
from quantcore.errors import DeviceError, KernelError, UnsupportedError
from quantcore.formats import kernel_defines, mx

from . import bnb as _bnb
from . import runtime as rt
from .common import empty
from .runtime import kernel_args

QUANT_SOURCE = "mx_quant.cu"
GEMM_SOURCE = "mx_gemm.cu"
HEADERS = ("mx_common.cuh", "qc_common.cuh", "wgmma.cuh")
GEMM_MODE_ENV = "QUANTCORE_CUDA_MX_GEMM"
#: "auto" (:func:`mm_path`: the panel path from MM_FUSED_MAX_M rows, the fused kernel below), "panel"
#: (dequantize + cuBLAS), "wgmma" / "mma" (the fused kernel's two back ends: wgmma on compute
#: capability 9.0, mma.sync on 8.x and others).
GEMM_MODES = ("auto", "panel", "wgmma", "mma")
_MXG = kernel_defines.MX_KERNEL_GEOMETRY  # generated into the kernels' header too
#: threads per CTA of quantize version 1, swizzle, unswizzle and the bias fill
THREADS = _MXG["QC_MX_THREADS"]
#: Dynamic shared memory of the GEMM kernels (mx_gemm.cu asserts its kSmemBytes equals it), its
#: output tile and CTA raster group.
GEMM_SMEM_BYTES = _MXG["QC_MXG_SMEM_BYTES"]
GEMM_BM, GEMM_BN, GEMM_GROUP_M = _MXG["QC_MXG_BM"], _MXG["QC_MXG_BN"], _MXG["QC_MXG_GROUP_M"]


#: the GEMM's timing experiments per back end (entry-point suffixes, compiled only with
#: -DQCMX_TIMING_VARIANTS; mx_gemm.cu QCMX_WG_VARIANT)
GEMM_TIMING_VARIANTS = {"wgmma": ("_nodq", "_nomma", "_alu", "_smem", "_nohmul", "_nof2fp", "_ss", "_ssnodq")}


_lock = threading.Lock()
_modules: dict[tuple[int, str, str, bool], Any] = {}
_functions: dict[tuple[int, str, str, str, bool], Any] = {}


# -- build -------------------------------------------------------------------------------------------
def kernel_text(name: str) -> str:
    """Text of a file in ``quantcore.kernels_cuda`` (works installed and from the source tree)."""
    return importlib.resources.files("quantcore.kernels_cuda").joinpath(name).read_text()


def headers() -> tuple[list[str], list[str]]:
    """(contents, include names) of the headers the MX sources include."""
    contents = [kernel_defines.constants_header()] + [kernel_text(h) for h in HEADERS]
    return contents, [kernel_defines.HEADER_NAME, *HEADERS]


def compile_cubin(source: str, arch: str, use_cache: bool = True, timing: bool = False) -> bytes:
    """NVRTC build of ``kernels_cuda/<source>`` for ``arch`` ("sm_90a", "sm_80" ...) -> cubin.

    Compiled with :func:`.runtime.nvrtc` (the backend's one NVRTC path) and cached on disk under
    ``<cache root>/cuda-mx`` (:func:`quantcore.cache.cached_bytes`), keyed by the source, headers,
    options, target and NVRTC version, so a new process does not rebuild (the GEMM takes tens of
    seconds); a cached cubin is used only when it matches its sidecar checksum.
    ``timing`` also builds the GEMM's timing experiments (``-DQCMX_TIMING_VARIANTS``)."""
    comp = rt.nvrtc()
    contents, names = headers()
    text = kernel_text(source)
    options = [*rt.COMPILE_OPTIONS, f"--gpu-architecture={arch}",
               *(["-DQCMX_TIMING_VARIANTS"] if timing else [])]
    key = cache.digest(text, *contents, *names, *options, repr(comp.version))
    name = f"{os.path.splitext(source)[0]}{'-timing' if timing else ''}-{arch}-{key}.cubin"

    def build() -> tuple[bytes]:
        return (rt.compile_source(comp, text, source, None, options)[0],)

    return cache.cached_bytes(cache.private_dir("cuda-mx") if use_cache else None, (name,), build)[0]


def compute_capability(device: int) -> tuple[int, int]:
    p = rt.device_props(device)
    return int(p["major"]), int(p["minor"])


def gemm_mode() -> str:
    mode = os.environ.get(GEMM_MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in GEMM_MODES:
        raise KernelError(f"{GEMM_MODE_ENV}={mode!r}: expected one of {GEMM_MODES}")
    return mode


def gemm_arch(device: int, mode: str | None = None) -> tuple[str, bool]:
    """(NVRTC target, wgmma back end?) of the GEMM module on ``device``."""
    mode = mode or gemm_mode()
    major, minor = compute_capability(device)
    if major < 8:
        raise UnsupportedError(f"scaled_fp4_mm needs compute capability 8.0 or newer (bf16 mma), "
                               f"this GPU has {major}.{minor}")
    if (major, minor) == (9, 0) and mode != "mma":
        return "sm_90a", True
    if mode == "wgmma":
        raise UnsupportedError(f"the {mode} back end needs compute capability 9.0, not {major}.{minor}")
    return f"sm_{major}{minor}", False


def _module(device: int, source: str, arch: str, timing: bool = False):
    key = (device, source, arch, timing)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                _modules[key] = mod = rt.load_module(device, compile_cubin(source, arch, timing=timing))
    return mod


def function(device: int, source: str, arch: str, name: str, smem: int = 0, timing: bool = False):
    """A kernel of the module (loaded once per device / source / arch; ``timing``: of the module
    built with the GEMM's timing experiments)."""
    key = (device, source, arch, name, timing)
    fn = _functions.get(key)
    if fn is None:
        fn = rt.allow_shared_memory(_module(device, source, arch, timing).get_function(name), device, smem)
        _functions[key] = fn
    return fn


# -- arrays ------------------------------------------------------------------------------------------
def ptr(a: Any) -> int:
    """The device address of ``a`` (0 for None: an absent optional operand)."""
    return 0 if a is None else rt.pointer(a)


def _contiguous(a: Any) -> bool:
    return bool(a.is_contiguous()) if rt.kind(a) == "torch" else bool(a.flags.c_contiguous)


def _dtype(a: Any) -> str:
    return dtype_name(as_dtype(a.dtype))


def _check(*arrays: Any) -> int:
    """The one device of the CUDA arrays given (None skipped); DeviceError for a host array, arrays
    on two devices or a non-contiguous array."""
    dev = None
    for a in arrays:
        if a is None:
            continue
        rt.check_device_array(a)
        d = rt.device_index(a)
        if dev is None:
            dev = d
        elif d != dev:
            raise DeviceError(f"arrays on different devices (cuda:{dev} and cuda:{d})")
        if not _contiguous(a):
            raise DeviceError("the cuda backend's MX kernels need contiguous arrays")
    return 0 if dev is None else dev


def _grid2(cols: int, rows: int, per_thread_cols: int = 1) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A block of 256 threads as (bx, by): bx covers columns (a power of two up to 32), by rows."""
    tcols = -(-cols // per_thread_cols)
    bx = 1
    while bx < 32 and bx < tcols:
        bx *= 2
    by = THREADS // bx
    gy = min(-(-rows // by), 65535)
    return (-(-tcols // bx), max(gy, 1), 1), (bx, by, 1)


# -- ops -------------------------------------------------------------------------------------------------
#: Kernel version of mx_quantize per (format, input dtype): 2 (cp.async-staged tiles, persistent
#: grid) or 1 (one thread per block straight from global memory), whichever was faster in the
#: side-by-side timing on an H200 (docs/performance.md, MX log: version 2 wins for mxfp4 and for
#: 16-bit nvfp4, version 1 for 16-bit mxfp8 and fp32 nvfp4). ``QUANTCORE_CUDA_TUNE=mx_quant_v=N``
#: forces one version for every format.
QUANT_VERSION_DEFAULT = {
    ("mxfp4", "bfloat16"): 2, ("mxfp4", "float16"): 2, ("mxfp4", "float32"): 2,
    ("nvfp4", "bfloat16"): 2, ("nvfp4", "float16"): 2, ("nvfp4", "float32"): 1,
    ("mxfp8", "bfloat16"): 1, ("mxfp8", "float16"): 1, ("mxfp8", "float32"): 2,
}
#: CTAs per SM of version 2 where the sweep (16384^2 bf16: 1, 2 or 3 CTAs per SM) found fewer
#: than fit better; elsewhere as many as fit (3: 64 KiB of shared memory each).
#: ``QUANTCORE_CUDA_TUNE=mx_quant_ctas=N`` overrides it.
QUANT2_CTAS_DEFAULT = {("mxfp4", "bfloat16"): 1, ("nvfp4", "bfloat16"): 2}
#: Unit layout of version 2 per format (mx_quant.cu, QCMX_FLAT / QCMX_BAND / QCMX_PAIR): 0 flat
#: tiles of 256 consecutive units; 1 band (NVFP4 with swizzled scales and a multiple of 4 blocks per
#: row: 128 rows x 4 blocks per tile, whole 32-byte sectors of scales); 2 pair (MXFP8: two lanes per
#: unit, 512 contiguous bytes per code store). H200, 16384^2 bf16: NVFP4 band 173 us (bench,
#: 93% of copy; ncu 170 us) against 245 us flat; MXFP8 pair 215 us (ncu) is not faster than
#: version 1 (194 us), so it stays opt-in. ``QUANTCORE_CUDA_TUNE=mx_quant_layout=N`` picks a
#: layout; ``mx_quant_sst=0`` stores NVFP4's scales a byte at a time (timing comparisons).
QUANT2_LAYOUT_DEFAULT = {"nvfp4": 1}
#: Threads and dynamic shared memory of version 2 (ring stages x threads (units) x 32 elements x
#: bytes per element: 4 stages of 16-bit input, 2 of fp32 = 64 KiB either way).
QUANT2_THREADS = _MXG["QC_MXQ2_THREADS"]
QUANT2_SMEM = {dt: _MXG[f"QC_MXQ2_STAGES_{bits}"] * QUANT2_THREADS * 32 * bits // 8
               for dt, bits in (("float32", 32), ("float16", 16), ("bfloat16", 16))}
_occupancy: dict[tuple[int, str], int] = {}


def _quant2_grid(dev: int, fn, name: str, smem: int, ntiles: int, ctas: int) -> int:
    """Persistent grid of version 2: ``ctas`` per SM (0: as many as fit), at most one per tile;
    ``QUANTCORE_CUDA_TUNE=mx_quant_ctas=N`` forces N CTAs per SM."""
    sms = rt.sm_count(dev)
    per_sm = rt.tune("mx_quant_ctas", ctas)
    if per_sm <= 0:
        per_sm = _occupancy.get((dev, name), 0)
        if per_sm <= 0:
            try:
                with rt.cupy().cuda.Device(dev):
                    per_sm = int(rt.cupy().cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                        fn.ptr, QUANT2_THREADS, smem))
            except Exception:  # noqa: BLE001 - an older CuPy without the query: 3 fit by shared memory
                per_sm = 3
            per_sm = _occupancy[(dev, name)] = max(per_sm, 1)
    return max(1, min(ntiles, sms * per_sm))


def mx_quantize(be, x, codes, scales, *, rows: int, cols: int, fmt: str, scale_mode: str | None,
                swizzled: bool, global_scale=None) -> None:
    """x [rows, cols] (fp32 / fp16 / bf16) -> codes, scales (row-major or swizzled, padding zeroed)."""
    dev = _check(x, codes, scales, global_scale)
    blk = mx.block_size(fmt)
    ncols = cols // blk
    prow, pcols = mx.swizzled_shape(rows, ncols) if swizzled else (rows, ncols)
    dt = _dtype(x)
    rceil = int(scale_mode == "rceil")
    vec = int(ptr(x) % 16 == 0 and ptr(codes) % 16 == 0)
    nelem = rows * cols
    version = rt.tune("mx_quant_v", QUANT_VERSION_DEFAULT.get((fmt, dt), 2))
    if version == 2 and vec and nelem % 32 == 0 and nelem > 0 and rows * ncols < 2**31 and prow * pcols < 2**31:
        mode = rceil | (2 if rt.tune("mx_quant_bf16x2", 1) == 0 else 0)
        layout = rt.tune("mx_quant_layout", QUANT2_LAYOUT_DEFAULT.get(fmt, 0))
        tag = ""
        if fmt == "nvfp4":
            even = ptr(scales) % 2 == 0  # the 2-byte scale stores
            if layout == 1 and even and swizzled and ncols % 4 == 0:
                tag = "b"
            if even and (not swizzled or ncols % 2 == 0) and rt.tune("mx_quant_sst", 1):
                mode |= 4
        elif fmt == "mxfp8" and layout == 2:
            tag = "p"
        name = f"qc_mx_quantize2{tag}_{fmt}_{dt}"
        smem = QUANT2_SMEM[dt]
        fn = function(dev, QUANT_SOURCE, quant_arch(dev), name, smem)
        nunits = nelem // 32
        ntiles = prow // 128 * (ncols // 4) if tag == "b" else -(-nunits // QUANT2_THREADS)
        grid = _quant2_grid(dev, fn, name, smem, ntiles, QUANT2_CTAS_DEFAULT.get((fmt, dt), 0))
        shift = ncols.bit_length() - 1 if ncols & (ncols - 1) == 0 else -1
        args = kernel_args(name, x=ptr(x), codes=ptr(codes), scales=ptr(scales), gscale=ptr(global_scale),
                           nunits=nunits, rows=rows, ncols=ncols, ncols_shift=shift, prow=prow, pcols=pcols,
                           swizzled=bool(swizzled), mode=mode)
        rt.Launcher(x).run(fn, name, (grid, 1, 1), (QUANT2_THREADS, 1, 1), args, smem)
        return
    name = f"qc_mx_quantize_{fmt}_{dt}"
    fn = function(dev, QUANT_SOURCE, quant_arch(dev), name)
    grid, block = _grid2(pcols, prow)
    args = kernel_args(name, x=ptr(x), codes=ptr(codes), scales=ptr(scales), gscale=ptr(global_scale), rows=rows,
                       ncols=ncols, prow=prow, pcols=pcols, swizzled=bool(swizzled), rceil=rceil, vec=vec)
    rt.Launcher(x).run(fn, name, grid, block, args)


#: The MX dequantize kernel's launch geometry (kernel_defines.MX_DEQUANT_GEOMETRY: threads per CTA,
#: 16-byte chunks per thread in flight); the grid is :func:`dequantize_grid`'s (every CTA builds its
#: value table once).
DQ_THREADS = kernel_defines.MX_DEQUANT_GEOMETRY["QC_MXDQ_THREADS"]
DQ_UNROLL = kernel_defines.MX_DEQUANT_GEOMETRY["QC_MXDQ_UNROLL"]
#: chunks per launch (the kernel indexes chunks in 32 bits; larger tensors go in row panels)
DQ_MAX_CHUNKS = 1 << 30
#: CTAs per launch in multiples of those that fit at once: MXFP8 (a code byte per element, the largest
#: reads of the three) streams faster from a grid of ~4 waves of fewer steps each than from one
#: resident wave (H200, 16384^2, tools/dev/mxdq_grid.py: swizzled 82.8-83.2% -> 86.5-87.2% of copy for
#: bf16 / fp16 / fp32 out, the same bits); the FP4 formats are best at one wave (docs/performance.md, MXDQ-9)
DQ_WAVES = {"mxfp8": 4}


def div_magic(d: int) -> tuple[int, int]:
    """(mul, shift) with ``b // d == (umulhi(b, mul) + b) >> shift`` for 0 <= b < 2**31 (d >= 1)."""
    shift = (d - 1).bit_length()
    return ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def _occupancy_grid(dev: int, fn, name: str, threads: int, smem: int, work_ctas: int) -> int:
    """As many CTAs as fit on the device at once (occupancy query), at most ``work_ctas``."""
    per_sm = _occupancy.get((dev, name), 0)
    if per_sm <= 0:
        try:
            with rt.cupy().cuda.Device(dev):
                per_sm = int(rt.cupy().cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, smem))
        except Exception:  # noqa: BLE001 - an older CuPy without the query: 2048 threads per SM
            per_sm = 2048 // threads
        per_sm = _occupancy[(dev, name)] = max(per_sm, 1)
    return max(1, min(work_ctas, rt.sm_count(dev) * per_sm))


def dequantize_grid(nchunks: int, chunks_per_row: int, capacity: int, tile_row_bytes: int,
                    waves: int = 1) -> tuple[int, int]:
    """(CTAs, scale step) of qc_mx_dequantize_*: ``waves`` times as many CTAs as fit at once
    (``capacity``), at most one per DQ_THREADS * DQ_UNROLL chunks. With swizzled scales
    (``tile_row_bytes`` > 0) the grid is a multiple of the CTAs that cover 128 rows where that fits,
    so that a thread's grid-stride steps keep its block column and move by whole 128-row swizzle
    tiles: the scale step (bytes per step, 0 = worked out per chunk) is then constant."""
    capacity *= waves
    work = -(-nchunks // (DQ_THREADS * DQ_UNROLL))
    tile_chunks = mx.SWIZZLE_ROWS * chunks_per_row
    if tile_row_bytes and tile_chunks % DQ_THREADS == 0 and tile_chunks // DQ_THREADS <= capacity:
        unit = tile_chunks // DQ_THREADS
        units = max(1, min(capacity // unit, -(-work // unit)))
        return units * unit, units * tile_row_bytes
    return max(1, min(work, capacity)), 0


def _dequantize_launch(launcher: rt.Launcher, dev: int, pc: int, ps: int, po: int, pg: int, *, rows: int,
                       cols: int, fmt: str, dtype: str, swizzled: bool) -> None:
    """One op's launches of qc_mx_dequantize_<fmt>_<dtype> on raw addresses (codes, scales, out, global
    scale or 0: NVFP4 without the division, the GEMM panels' exact operand values); row panels of a
    multiple of 128 rows where the tensor has more than DQ_MAX_CHUNKS chunks."""
    blk = mx.block_size(fmt)
    ncols = cols // blk
    pcols = mx.swizzled_shape(rows, ncols)[1] if swizzled else ncols
    item = np.dtype(np.float32).itemsize if dtype == "float32" else 2
    per_chunk = 16 // item  # output elements per chunk
    code_bytes = per_chunk // 2 if fmt != "mxfp8" else per_chunk
    name = f"qc_mx_dequantize_{fmt}_{dtype}"
    fn = function(dev, QUANT_SOURCE, quant_arch(dev), name)
    mul, shift = div_magic(ncols)
    tile_row_bytes = pcols // mx.SWIZZLE_COLS * mx.SWIZZLE_TILE_BYTES
    vec = int(pc % min(code_bytes, 8) == 0 and po % 16 == 0)
    chunks_per_row = cols // per_chunk
    panel = max(mx.SWIZZLE_ROWS, DQ_MAX_CHUNKS // chunks_per_row // mx.SWIZZLE_ROWS * mx.SWIZZLE_ROWS)
    for r0 in range(0, rows, panel):
        prow = min(panel, rows - r0)
        nchunks = prow * chunks_per_row
        s_off = r0 // mx.SWIZZLE_ROWS * tile_row_bytes if swizzled else r0 * ncols
        grid, sstep = dequantize_grid(nchunks, chunks_per_row, _occupancy_grid(dev, fn, name, DQ_THREADS, 0, 1 << 30),
                                      tile_row_bytes if swizzled else 0, DQ_WAVES.get(fmt, 1))
        args = kernel_args(name, codes=pc + r0 * cols * code_bytes // per_chunk, scales=ps + s_off,
                           out=po + r0 * cols * item, gscale=pg, nchunks=nchunks, ncols=ncols, div_mul=mul,
                           div_shift=shift, tile_row_bytes=tile_row_bytes, sstep=sstep, swizzled=bool(swizzled),
                           vec=vec)
        launcher.run(fn, name, (grid, 1, 1), (DQ_THREADS, 1, 1), args)


def mx_dequantize(be, codes, scales, out, *, rows: int, cols: int, fmt: str, swizzled: bool,
                  global_scale=None) -> None:
    """codes + scales (+ NVFP4 global scale) -> out [rows, cols] (fp32 / fp16 / bf16)."""
    dev = _check(codes, scales, out, global_scale)
    _dequantize_launch(rt.Launcher(out), dev, ptr(codes), ptr(scales), ptr(out), ptr(global_scale), rows=rows,
                       cols=cols, fmt=fmt, dtype=_dtype(out), swizzled=swizzled)


def swizzle_scales(be, scales, out, *, rows: int, cols: int) -> None:
    """scales uint8 [rows, cols] -> out [ceil(rows/128)*128, ceil(cols/4)*4], padding zeroed."""
    dev = _check(scales, out)
    prow, pcols = mx.swizzled_shape(rows, cols)
    fn = function(dev, QUANT_SOURCE, quant_arch(dev), "qc_mx_swizzle")
    grid, block = _grid2(pcols, prow, per_thread_cols=4)
    args = kernel_args("qc_mx_swizzle", s=ptr(scales), out=ptr(out), rows=rows, cols=cols, prow=prow, pcols=pcols,
                       aligned=ptr(out) % 4 == 0)
    rt.Launcher(out).run(fn, "qc_mx_swizzle", grid, block, args)


def unswizzle_scales(be, swz, out, *, rows: int, cols: int) -> None:
    """swz [ceil(rows/128)*128, ceil(cols/4)*4] -> out uint8 [rows, cols]."""
    dev = _check(swz, out)
    pcols = mx.swizzled_shape(rows, cols)[1]
    fn = function(dev, QUANT_SOURCE, quant_arch(dev), "qc_mx_unswizzle")
    grid, block = _grid2(cols, rows, per_thread_cols=4)
    args = kernel_args("qc_mx_unswizzle", swz=ptr(swz), out=ptr(out), rows=rows, cols=cols, pcols=pcols,
                       aligned=ptr(swz) % 4 == 0)
    rt.Launcher(out).run(fn, "qc_mx_unswizzle", grid, block, args)


def gemm_kernel_name(fmt: str, wgmma: bool, cpw: int) -> str:
    """Entry point of mx_gemm.cu's fused kernel."""
    return f"qc_mx_gemm_{'wgmma' if wgmma else 'mma'}_{fmt}_cp{cpw}"


#: The two-pass path of scaled_fp4_mm ("panel"): both operands dequantized to their exact bf16 values
#: (e2m1 * block scale; the NVFP4 global scales are in alpha) into a workspace, then one cuBLAS
#: bf16 GEMM per panel pair (fp32 accumulation, alpha from the device, bias through beta = 1 on an
#: output pre-filled with the bias rows; beta is a 4-byte device scalar of its own). The workspace
#: (the dequantized panels) is at most MM_WORKSPACE_MIN bytes (256 MiB) or 1/8 of the operands' bf16
#: size, whichever is larger (docs/formats-mx.md); larger operands go in panels of a multiple of 128
#: rows (A's rows outside, B's inside).
MM_WORKSPACE_MIN = 256 << 20
#: Below this many rows of A, "auto" takes the fused kernel (wgmma on compute capability 9.0,
#: mma.sync elsewhere): the panel path dequantizes all of B for few rows (docs/performance.md, "MX
#: dequantize and FP4 GEMM (prefill)").
MM_FUSED_MAX_M = 1024
_CUDA_R_16BF, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT = 14, 68, -1
_CUBLAS_OP_N, _CUBLAS_OP_T, _CUBLAS_POINTER_MODE_DEVICE = 0, 1, 1


def mm_workspace_bytes(m: int, n: int, k: int) -> int:
    """The panel path's workspace bound: max(256 MiB, (m + n) * k * 2 / 8) bytes."""
    return max(MM_WORKSPACE_MIN, (m + n) * k * 2 // 8)


def mm_panels(m: int, n: int, k: int) -> tuple[int, int] | None:
    """(A rows, B rows) per panel of the panel path within :func:`mm_workspace_bytes` (None: not even
    128 + 128 rows fit; the fused kernel then runs)."""
    ws, row = mm_workspace_bytes(m, n, k), 2 * k
    if (m + n) * row <= ws:
        return m, n
    step = mx.SWIZZLE_ROWS
    mp = min(m, ws // 2 // row // step * step)
    if mp < step:
        return None
    np_ = min(n, (ws - mp * row) // row // step * step)
    return mp, np_


def mm_path(m: int, n: int, k: int, mode: str) -> str:
    """The one place scaled_fp4_mm picks its path: "panel" (dequantize + cuBLAS) or "fused"."""
    if mode == "panel":
        if mm_panels(m, n, k) is None:
            raise UnsupportedError(f"scaled_fp4_mm: K = {k} is too long for the panel path's workspace")
        return "panel"
    if mode != "auto":
        return "fused"
    return "panel" if m >= MM_FUSED_MAX_M and mm_panels(m, n, k) is not None else "fused"


def _scaled_fp4_mm_panel(be, dev: int, a, b, scale_a, scale_b, alpha, bias, out, *, m: int, n: int, k: int,
                         fmt: str) -> None:
    cp = rt.cupy()
    cublas = cp.cuda.cublas
    mp, np_ = mm_panels(m, n, k)
    nbytes = (mp + np_) * k * 2
    # the workspace from the output's allocator (torch's caching allocator or CuPy's pool, stream-ordered)
    ws, beta = empty((nbytes,), "uint8", like=out), empty((1,), "float32", like=out)
    pw = ptr(beta)
    pa_ws, pb_ws = ptr(ws), ptr(ws) + mp * k * 2
    launcher = rt.Launcher(out)
    pcols = mx.swizzled_shape(1, k // mx.block_size(fmt))[1]
    srow = pcols // mx.SWIZZLE_COLS * mx.SWIZZLE_TILE_BYTES  # swizzled scale bytes per 128 rows
    with cp.cuda.Device(dev):
        stream = launcher.stream_handle()
        # beta (device fp32) = 1 over the bias rows written into out, else 0
        fill = function(dev, QUANT_SOURCE, quant_arch(dev), "qc_mx_mm_bias_fill")
        grid = max(1, min(m, rt.sm_count(dev) * 8)) if bias is not None else 1
        launcher.run(fill, "qc_mx_mm_bias_fill", (grid, 1, 1), (THREADS, 1, 1),
                     kernel_args("qc_mx_mm_bias_fill", bias=ptr(bias), out=ptr(out), beta=pw, m=m, n=n))

        def dequant(pc: int, ps: int, dst: int, r0: int, rows: int) -> None:
            _dequantize_launch(launcher, dev, pc + r0 * k // 2, ps + r0 // mx.SWIZZLE_ROWS * srow, dst, 0,
                               rows=rows, cols=k, fmt=fmt, dtype="bfloat16", swizzled=True)

        handle = cp.cuda.device.get_cublas_handle()
        cublas.setStream(handle, stream)
        old_mode = cublas.getPointerMode(handle) if hasattr(cublas, "getPointerMode") else 0
        cublas.setPointerMode(handle, _CUBLAS_POINTER_MODE_DEVICE)
        # ws and beta are released when this returns: the allocators (torch's caching allocator, CuPy's pool)
        # hand it out again only in this stream's order
        try:
            for m0 in range(0, m, mp):
                mrows = min(mp, m - m0)
                dequant(ptr(a), ptr(scale_a), pa_ws, m0, mrows)
                for n0 in range(0, n, np_):
                    nrows = min(np_, n - n0)
                    if np_ < n or m0 == 0:  # B once when it fits whole
                        dequant(ptr(b), ptr(scale_b), pb_ws, n0, nrows)
                    # column-major view: out^T[n, m] = B_ws [k, n]^T x A_ws [k, m] (ldc = n)
                    cublas.gemmEx(handle, _CUBLAS_OP_T, _CUBLAS_OP_N, nrows, mrows, k, ptr(alpha),
                                  pb_ws, _CUDA_R_16BF, k, pa_ws, _CUDA_R_16BF, k, pw,
                                  ptr(out) + 2 * (m0 * n + n0), _CUDA_R_16BF, n, _CUBLAS_COMPUTE_32F,
                                  _CUBLAS_GEMM_DEFAULT)
        finally:
            cublas.setPointerMode(handle, old_mode)


def scaled_fp4_mm(be, a, b, scale_a, scale_b, alpha, bias, out, *, m: int, n: int, k: int, fmt: str,
                  mode: str | None = None, variant: str = "") -> None:
    """out bf16 [m, n] = alpha * A @ B^T + bias, A / B packed E2M1 with swizzled scales.

    ``mode`` ("auto", "panel", "wgmma", "mma") overrides ``QUANTCORE_CUDA_MX_GEMM`` (tests,
    benchmarks); "auto" takes the panel path (dequantize + cuBLAS, :func:`mm_path`) from
    :data:`MM_FUSED_MAX_M` rows on and the fused kernel below: "wgmma" on compute capability 9.0,
    else "mma".
    ``variant`` selects a timing experiment (nvfp4, 16-byte copies only; wrong results by design;
    built into a separate module, see mx_gemm.cu): one of :data:`GEMM_TIMING_VARIANTS`.
    MXFP4 on the wgmma kernel (16-byte copies) decodes to fp16 in the CTAs whose scale bytes all lie
    in 110..141 (exact there; bf16 elsewhere); ``QUANTCORE_CUDA_TUNE=mx_gemm_f16=0`` keeps bf16.
    """
    dev = _check(a, b, scale_a, scale_b, alpha, bias, out)
    mode = mode or gemm_mode()
    arch, wgmma = gemm_arch(dev, "auto" if mode == "panel" else mode)
    if not variant and mm_path(m, n, k, mode) == "panel":
        _scaled_fp4_mm_panel(be, dev, a, b, scale_a, scale_b, alpha, bias, out, m=m, n=n, k=k, fmt=fmt)
        return
    ptrs = (ptr(a), ptr(b), ptr(scale_a), ptr(scale_b))
    if (k // 2) % 16 == 0 and all(p % 16 == 0 for p in ptrs):
        cpw = 16
    elif all(p % 4 == 0 for p in ptrs):
        cpw = 4
    else:
        raise KernelError("scaled_fp4_mm needs its operands and scales 4-byte aligned (got a view at an odd "
                          "offset); pass contiguous arrays that start at an aligned address")
    ntiles = -(-m // GEMM_BM) * -(-n // GEMM_BN)
    flags = int(n % 2 == 0 and ptr(out) % 4 == 0)  # bit 0: bf16 pairs may be stored
    if wgmma and fmt == "mxfp4" and cpw == 16 and not variant and rt.tune("mx_gemm_f16", 1):
        flags |= 2  # the fp16 decode where the CTA's scales allow it (mx_gemm.cu, kE8F16Lo)
    name = gemm_kernel_name(fmt, wgmma, cpw) + variant
    args = kernel_args(name, a=ptrs[0], b=ptrs[1], scale_a=ptrs[2], scale_b=ptrs[3], alpha=ptr(alpha), bias=ptr(bias),
                       out=ptr(out), m=m, n=n, k=k, flags=flags)
    fn = function(dev, GEMM_SOURCE, arch, name, GEMM_SMEM_BYTES, timing=bool(variant))
    rt.Launcher(out).run(fn, name, (ntiles, 1, 1), (THREADS, 1, 1), args, GEMM_SMEM_BYTES)


def quant_arch(device: int) -> str:
    major, minor = compute_capability(device)
    return f"sm_{major}{minor}"


def capabilities(device: int | None = None) -> list:
    """The MX capabilities this module implements (all of quantcore.formats.mx.capabilities();
    scaled_fp4_mm needs compute capability 8.0+, checked at launch)."""
    return list(mx.capabilities())


# -- linear_mx: the weight-only gemv (kernels_cuda/mx_gemv.cu) ----------------------------------------
GEMV_SOURCE = "mx_gemv.cu"
#: Input-row counts with a kernel instance of the CUDA-core gemv (qc_mx_gemv_<fmt>_<dtype>_b<NB>: the
#: kernel for fp32 inputs and the fallback); a launch takes at most QC_MXGV_MAX_BATCH input rows, larger
#: B is launched in slices of that many.
GEMV_BATCHES = (1, 2, 4, 8, 16)
GEMV_THREADS = 32 * kernel_defines.MX_GEMV_GEOMETRY["QC_MXGV_WARPS"]
GEMV_MAX_BATCH = kernel_defines.MX_GEMV_GEOMETRY["QC_MXGV_MAX_BATCH"]
#: The tensor-core gemv (qc_mx_gemv_tc_<fmt>_<dtype>_h<H>, H blocks of 8 input rows): the default for
#: fp16 / bf16 inputs from GEMV_TC_MIN_ROWS input rows per launch on, where :func:`gemv_tc_takes`
#: holds; a persistent grid of one CTA per multiprocessor (QC_MXTC_WARPS warps, QC_MXTC_SMEM bytes of
#: shared memory) launched as a programmatic dependent on compute capability 9.0. One input row stays
#: on the CUDA-core kernel, which is faster there; from 2 rows the tensor-core kernel is (the figures:
#: docs/performance.md, "Weight-only MX (decode)"). ``QUANTCORE_CUDA_TUNE=mx_gemv_tc=0`` runs the CUDA-core
#: kernel for every B, ``mx_gemv_tc_rows=N`` moves the threshold (tests run the tensor-core kernel at
#: B 1 with N = 1).
GEMV_TC_THREADS = 32 * kernel_defines.MX_GEMV_GEOMETRY["QC_MXTC_WARPS"]
GEMV_TC_SMEM = kernel_defines.MX_GEMV_GEOMETRY["QC_MXTC_SMEM"]
GEMV_TC_DTYPES = ("float16", "bfloat16")
GEMV_TC_MIN_ROWS = 2


def gemv_kernel_name(fmt: str, dtype: str, nb: int) -> str:
    return f"qc_mx_gemv_{fmt}_{dtype}_b{nb}"


def gemv_tc_kernel_name(fmt: str, dtype: str, h: int) -> str:
    return f"qc_mx_gemv_tc_{fmt}_{dtype}_h{h}"


def gemv_tc_takes(dev: int, dtype: str, fmt: str, n: int, k: int, px: int, pc: int, ps: int, rows: int) -> bool:
    """Does the tensor-core gemv run a launch of ``rows`` input rows (x, codes, scales at addresses px,
    pc, ps)? fp16 / bf16 inputs on compute capability 8.0+, at least GEMV_TC_MIN_ROWS rows, K a multiple
    of 64 (whole chunks), x and codes 16-byte aligned, the scale loads aligned (2 bytes MXFP4, 4 NVFP4),
    chunk counts in 32 bits."""
    if dtype not in GEMV_TC_DTYPES or not rt.tune("mx_gemv_tc", 1) or compute_capability(dev)[0] < 8:
        return False
    if rows < rt.tune("mx_gemv_tc_rows", GEMV_TC_MIN_ROWS):
        return False
    return (k % 64 == 0 and px % 16 == 0 and pc % 16 == 0 and ps % (4 if fmt == "nvfp4" else 2) == 0
            and -(-n // 16) * (k // 64) < 2**31)


def linear_mx(be, x, codes, scales, out, *, n: int, k: int, fmt: str, swizzled: bool, global_scale=None) -> None:
    """out [B, n] (x's dtype) = x [B, K] @ W^T, W the fp4 weight given by codes [n, k/2] and its
    scales (row-major or swizzled; NVFP4 with its global scale): one launch per 16 input rows, of the
    tensor-core gemv where :func:`gemv_tc_takes`, else of the CUDA-core one."""
    dev = _check(x, codes, scales, out, global_scale)
    rows = int(out.shape[0])
    dt = _dtype(x)
    ncols = k // mx.block_size(fmt)
    pcols = mx.swizzled_shape(n, ncols)[1] if swizzled else ncols
    if (mx.swizzled_shape(n, ncols)[0] * pcols if swizzled else n * ncols) >= 2**31:
        raise KernelError(f"linear_mx: the scales of a [{n}, {k}] weight exceed the kernel's 32-bit offsets")
    launcher = rt.Launcher(out)
    if _bnb.decode_gemv_mx_takes(dev, dt, fmt, n, k, ptr(x), ptr(codes), ptr(scales), rows):
        # the decode gemv (bnb_gemv.cu with MX scales): every input row in one launch
        spec = _bnb.decode_gemv_mx_launch(dev, x, [(codes, scales, global_scale, n)], out, rows=rows, k=k, fmt=fmt,
                                          scols=pcols if swizzled else 0, ldo=n)
        launcher(*spec[:6], pdl=True)
        return
    xsize, osize = as_dtype(x.dtype).itemsize, as_dtype(out.dtype).itemsize
    arch = quant_arch(dev)
    flags = int(bool(swizzled))
    if ptr(codes) % 16 == 0 and (k // 2) % 16 == 0:
        flags |= 2
    if ptr(codes) % 4 == 0:
        flags |= 4
    if ptr(x) % 16 == 0:
        flags |= 8
    if fmt == "nvfp4" and ptr(scales) % 2 == 0 and (swizzled or ncols % 2 == 0):
        flags |= 16  # a unit's two scale bytes in one 16-bit load
    for b0 in range(0, rows, GEMV_MAX_BATCH):
        nrows = min(GEMV_MAX_BATCH, rows - b0)
        px, po = ptr(x) + b0 * k * xsize, ptr(out) + b0 * n * osize
        if gemv_tc_takes(dev, dt, fmt, n, k, px, ptr(codes), ptr(scales), nrows):
            name = gemv_tc_kernel_name(fmt, dt, 1 if nrows <= 8 else 2)
            fn = function(dev, GEMV_SOURCE, arch, name, GEMV_TC_SMEM)
            args = kernel_args(name, x=px, codes=ptr(codes), scales=ptr(scales), gscale=ptr(global_scale), out=po,
                               nrows=nrows, n=n, k=k, pcols=pcols, flags=int(bool(swizzled)))
            grid = max(1, min(rt.sm_count(dev), -(-n // 16)))
            run = launcher.run_pdl if compute_capability(dev) >= (9, 0) else launcher.run
            run(fn, name, (grid, 1, 1), GEMV_TC_THREADS, args, GEMV_TC_SMEM)
            continue
        nb = next(b for b in GEMV_BATCHES if b >= nrows)
        name = gemv_kernel_name(fmt, dt, nb)
        fn = function(dev, GEMV_SOURCE, arch, name)
        grid = -(-n // kernel_defines.mx_gemv_rows(nb))
        args = kernel_args(name, x=px, codes=ptr(codes), scales=ptr(scales), gscale=ptr(global_scale), out=po,
                           nrows=nrows, n=n, k=k, pcols=pcols, flags=flags)
        launcher.run(fn, name, (grid, 1, 1), (GEMV_THREADS, 1, 1), args)


def linear_mx_grouped(be, x, groups, out, *, k: int) -> None:
    """out [B, sum n] = x @ [W_1, W_2, ...]^T for ``groups`` [(codes, scales, global_scale, n, fmt,
    swizzled)]: runs of up to DECODE_GROUPS weights of one format and scale layout that the decode gemv
    takes go in one launch of it (whatever their size: one launch instead of several is the point);
    any other weight runs linear_mx into a temporary, copied into its columns."""
    dev = _check(x, out, *(a for w in groups for a in w[:3]))
    rows, ntot = int(out.shape[0]), int(out.shape[1])
    dt = _dtype(x)
    launcher = rt.Launcher(out)

    def decodes(g) -> bool:  # the decode gemv's conditions, for any number of rows (2: no size rule)
        return _bnb.decode_gemv_mx_takes(dev, dt, g[4], g[3], k, ptr(x), ptr(g[0]), ptr(g[1]), 2)

    col, i = 0, 0
    while i < len(groups):
        codes, scales, g, n, fmt, swizzled = groups[i]
        j = i + 1
        if decodes(groups[i]):
            j = grouped_run_end(groups, i, _bnb.DECODE_GROUPS, decodes)
        if j - i > 1:
            ncols = k // mx.block_size(fmt)
            spec = _bnb.decode_gemv_mx_launch(dev, x, [w[:4] for w in groups[i:j]], out[:, col:], rows=rows, k=k,
                                              fmt=fmt, scols=mx.swizzled_shape(n, ncols)[1] if swizzled else 0,
                                              ldo=ntot)
            launcher(*spec[:6], pdl=True)
        else:
            tmp = empty((rows, n), as_dtype(dt), like=x)
            linear_mx(be, x, codes, scales, tmp, n=n, k=k, fmt=fmt, swizzled=swizzled, global_scale=g)
            out[:, col:col + n] = tmp
        col += sum(w[3] for w in groups[i:j])
        i = j


__all__ = [
    "capabilities", "compile_cubin", "gemm_arch", "linear_mx", "linear_mx_grouped", "mx_dequantize", "mx_quantize", "scaled_fp4_mm",
    "swizzle_scales", "unswizzle_scales",
]
