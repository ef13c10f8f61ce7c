"""The ``sycl`` backend: kernels_sycl/ compiled at run time, launched on a dpctl queue.

It runs on any device the SYCL runtime of the ``intel-sycl-rt`` wheel sees: the Intel OpenCL CPU
device (``intel-opencl-rt``, set up by the backend itself) here and in CI, Intel GPUs through Level
Zero for users. The device is dpctl's default one, or the one named by the dpctl filter string in
``QUANTCORE_SYCL_DEVICE`` (for example ``opencl:cpu``). How it works: docs/sycl.md.

Arrays (the choice and its reason are in docs/sycl.md):

- Native arrays are :class:`SyclArray` (typed USM views). USM arrays of the caller (dpnp arrays,
  anything with ``__sycl_usm_array_interface__``; dpctl memory objects through :func:`asarray`)
  are used zero-copy, results come back as the caller's kind, and the work runs on the array's
  own queue.
- Host arrays (numpy, torch CPU tensors) are not copied behind the caller's back: the public API
  raises DeviceError for them, and the adapters ``from_numpy`` / ``to_numpy`` (or
  ``SyclArray.to_numpy``) are the explicit copies.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from quantcore import ops
from quantcore.arrays import array_kind, as_dtype, device_of, dtype_name
from quantcore.backend import Availability, Backend, Nested, grouped_run_end, grouped_run_padded
from quantcore.errors import BackendUnavailableError, DeviceError, ParameterError
from quantcore.formats import bnb, ggml, kernel_interface
from quantcore.formats.kernel_defines import GGML_FORMAT_CODE, QUANT_TYPE_CODE, TILED_GEOMETRY, TILED_MIN_ROWS
from quantcore.formats.kernel_interface import GEMV_TC_GROUPS

from . import runtime
from .arrays import SyclArray

__all__ = ["SyclArray", "SyclBackend", "asarray", "create"]

G = runtime.GEOMETRY
T = TILED_GEOMETRY  #: the many-rows kernels' tiles (kernels_sycl/tiled.hpp), from the generated header


def asarray(obj: Any, shape: tuple[int, ...] | None = None, dtype: Any = None) -> SyclArray:
    """Zero-copy :class:`SyclArray` view of a USM object (dpnp array, ``dpctl.memory`` object ...).

    ``shape`` and ``dtype`` reinterpret an untyped buffer: a ``dpctl.memory.MemoryUSMDevice`` is
    uint8 [nbytes], so ``asarray(mem, (1024,), "bfloat16")`` views it as 1024 bfloat16 values.
    """
    return SyclArray.from_usm(obj, shape, dtype)


def _kdt(x: SyclArray) -> str:
    return kernel_interface.SYCL_SUFFIX[dtype_name(x.dtype)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _is_dpnp(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "dpnp"


class _Launcher:
    """Submits the kernels of one op on one queue. On an out-of-order queue (dpnp's default) it
    waits for the queue's earlier work first, chains its own kernels through events and waits for
    the last one, so the op is ordered on any queue."""

    def __init__(self, program: runtime.Program, queue: Any):
        self.program, self.queue = program, queue
        self.in_order = bool(queue.is_in_order)
        self.last: int | None = None
        if not self.in_order:
            queue.wait()

    def __call__(self, name: str, groups: int, wg: int, *args: Any) -> None:
        ev = self.program.launch(self.queue, name, groups, wg, args, dep=self.last,
                                 want_event=not self.in_order)
        if ev:
            self._drop()
            self.last = ev

    def _drop(self) -> None:
        if self.last:
            self.program.shim.lib.qc_event_free(self.last)
            self.last = None

    def finish(self) -> None:
        if self.last:
            try:
                self.program.shim.check(self.program.shim.lib.qc_event_wait(self.last), "waiting for a kernel")
            finally:
                self._drop()


class SyclBackend(Backend):
    name = "sycl"

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._queue: Any = None
        self._programs: dict[tuple[Any, Any], runtime.Program] = {}
        self._used_queues: dict[int, Any] = {}  #: queues this backend submitted to (synchronize)
        self._avail: Availability | None = None  #: a positive availability, once found
        self._caps: frozenset | None = None  #: capabilities(), once the device is known

    # -- discovery -------------------------------------------------------------------------------
    def default_queue(self) -> Any:
        """The backend's in-order dpctl queue on the default device (see QUANTCORE_SYCL_DEVICE)."""
        with self._lock:
            if self._queue is None:
                dpctl = runtime.import_dpctl()
                wanted = os.environ.get(runtime.ENV_DEVICE)
                try:
                    dev = dpctl.SyclDevice(wanted) if wanted else dpctl.select_default_device()
                except Exception as exc:
                    what = f"{runtime.ENV_DEVICE}={wanted!r}" if wanted else "the default device"
                    raise BackendUnavailableError(
                        f"no SYCL device for {what} ({exc}); devices seen: "
                        f"{[d.filter_string for d in dpctl.get_devices()] or 'none'}; "
                        f"OpenCL ICD: {runtime.setup_opencl_icd()}"
                    ) from exc
                self._queue = dpctl.SyclQueue(dev, property="in_order")
            return self._queue

    def availability(self) -> Availability:
        """Probed once when it succeeds (the public API asks on every call with ``backend="sycl"``,
        and the probe reads the wheels' file lists); a failure is probed again next time."""
        if self._avail is None:
            avail = self._probe()
            if avail:
                self._avail = avail
            return avail
        return self._avail

    def _probe(self) -> Availability:
        try:
            dpctl = runtime.import_dpctl()
            if not dpctl.get_devices():
                raise BackendUnavailableError(
                    "the SYCL runtime sees no device; OpenCL ICD: " + runtime.setup_opencl_icd() +
                    ". If dpctl was imported and queried before quantcore, set OCL_ICD_FILENAMES to "
                    "the intel-opencl-rt wheel's libintelocl.so before that"
                )
            runtime.sycl_runtime_dirs()
            runtime._compiler()
            dev = self.default_queue().sycl_device
        except BackendUnavailableError as exc:
            return Availability(False, str(exc))
        except Exception as exc:  # a broken install is reported, not raised
            return Availability(False, f"{type(exc).__name__}: {exc}")
        return Availability(True, f"{dev.name} ({dev.filter_string}) through dpctl {dpctl.__version__}, "
                                  f"SYCL runtime {runtime.sycl_runtime_version()}; kernels compiled "
                                  f"at first use; OpenCL ICD: {runtime.setup_opencl_icd()}")

    def devices(self) -> list[str]:
        """Every SYCL device the runtime sees (dpctl filter string, name, sub-group sizes, fp64),
        the backend's default marked with '*'."""
        try:
            dpctl = runtime.import_dpctl()
            devs = dpctl.get_devices()
            default = self.default_queue().sycl_device if devs else None
        except Exception as exc:
            return [f"none ({exc})"]
        rows = []
        for d in devs:
            mark = "*" if default is not None and d == default else ""
            rows.append(f"{mark}{d.filter_string} {d.name} ({d.device_type.name}, sub-groups "
                        f"{'/'.join(str(s) for s in d.sub_group_sizes)}, "
                        f"fp64 {'yes' if d.has_aspect_fp64 else 'no'})")
        return rows

    def capabilities(self):
        if self._caps is None:  # built once per instance: the core asks supports() on every call
            try:
                fp64 = self.default_queue().sycl_device.has_aspect_fp64
            except Exception:
                return frozenset()  # no device (not kept: a later call may find one)
            caps = ops.bnb_capabilities() + ops.ggml_capabilities() + ops.mx_capabilities()
            if not fp64:  # the double-quantization offset is an fp64 tree sum
                caps = [c for c in caps if c.op != "double_quantize"]
            self._caps = frozenset(caps)
        return self._caps

    # -- programs ----------------------------------------------------------------------------------
    def program(self, queue: Any = None) -> runtime.Program:
        """The compiled kernels for ``queue``'s context and device (built once per process)."""
        queue = queue if queue is not None else self.default_queue()
        key = (queue.sycl_context, queue.sycl_device)
        with self._lock:
            prog = self._programs.get(key)
            if prog is None:
                dev = queue.sycl_device
                prog = runtime.Program(queue, runtime.pick_subgroup_size(dev),
                                       fp64=bool(dev.has_aspect_fp64))
                self._programs[key] = prog
            return prog

    @contextlib.contextmanager
    def _launch(self, out: SyclArray, *arrays: Any) -> Iterator[_Launcher]:
        """A launcher on the queue of ``out``; every other array must share its context."""
        q = out.queue
        for a in arrays:
            if isinstance(a, SyclArray) and a.queue is not q and a.queue.sycl_context != q.sycl_context:
                raise DeviceError("the arrays of one sycl op must live in one SYCL context; got "
                                  f"{a.queue.sycl_device.filter_string} and {q.sycl_device.filter_string}")
        launcher = _Launcher(self.program(q), q)
        self._used_queues.setdefault(id(q), q)
        try:
            yield launcher
        finally:
            launcher.finish()

    # -- arrays --------------------------------------------------------------------------------------
    def _queue_like(self, like: Any) -> Any:
        if isinstance(like, SyclArray):
            return like.queue
        if array_kind(like) == "usm":
            return SyclArray.from_usm(like).queue
        return self.default_queue()

    def prepare(self, x: Any) -> SyclArray:
        if isinstance(x, SyclArray):
            return x
        if array_kind(x) == "usm":
            if _is_dpnp(x) and not x.flags.c_contiguous:
                import dpnp

                x = dpnp.ascontiguousarray(x)
            return SyclArray.from_usm(x)
        # No silent host <-> device copy (docs/sycl.md "arrays"): the copy is the
        # caller's explicit from_numpy / to_numpy.
        raise DeviceError(
            f"the sycl backend takes SYCL USM arrays (SyclArray, dpnp arrays); this one is "
            f"{type(x).__name__} on {device_of(x)}. Copy it explicitly: "
            "quantcore.get_backend('sycl').from_numpy(x), and the result back with .to_numpy()"
        )

    def finish(self, native: SyclArray, like: Any) -> Any:
        if _is_dpnp(like) and native.dtype.kind in "fiub":
            import dpnp

            return dpnp.asarray(native)  # zero-copy: dpnp reads the USM interface
        return native

    def empty(self, shape, dtype, like=None) -> SyclArray:
        return SyclArray.empty(tuple(shape), dtype, self._queue_like(like))

    def from_numpy(self, a, like=None) -> SyclArray:
        a = np.asarray(a)
        a = np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes a 0-d array 1-d
        out = SyclArray.empty(a.shape, a.dtype, self._queue_like(like))
        out.copy_from_numpy(a)
        return out

    def to_numpy(self, x) -> np.ndarray:
        if isinstance(x, SyclArray):
            return x.to_numpy()
        if array_kind(x) == "usm":
            return SyclArray.from_usm(x).to_numpy()
        return np.array(x, copy=True)

    def view(self, buf, byte_offset, shape, dtype) -> SyclArray:
        return buf.byte_view(int(byte_offset), tuple(shape), as_dtype(dtype))

    def synchronize(self) -> None:
        """Wait for the work queued on the backend's queue and on every queue an op ran on."""
        with self._lock:
            queues = list(self._used_queues.values())
            if self._queue is not None and id(self._queue) not in self._used_queues:
                queues.append(self._queue)
        for q in queues:
            runtime.shim().check(runtime.shim().lib.qc_queue_wait(q.addressof_ref()), "waiting for the queue")

    # -- helpers ----------------------------------------------------------------------------------------
    @staticmethod
    def _absmax_args(absmax: SyclArray, nested: Nested | None) -> tuple:
        if nested is None:
            return (absmax, None, None, None)
        return (absmax, nested.absmax2, nested.code2, nested.offset)

    @staticmethod
    def _quantize_geometry(n: int, blocksize: int) -> tuple[int, int]:
        """``(values_per_item, work-groups)`` of the blockwise quantizers (see bnb.hpp)."""
        wg = G["QC_QUANT_WG"]
        if blocksize <= 0 or blocksize & (blocksize - 1):
            raise ParameterError(f"blocksize must be a power of two, got {blocksize}")
        per_item = max(G["QC_QUANT_MIN_VALUES_PER_ITEM"], blocksize // wg)
        items_per_block = blocksize // per_item
        if per_item % 2 or items_per_block < 1 or wg % items_per_block:
            raise ParameterError(f"blocksize {blocksize} does not fit the quantize work-group of {wg}")
        return per_item, _cdiv(bnb.nblocks(n, blocksize), wg // items_per_block)

    @staticmethod
    def _dequantize_groups(nbytes: int) -> int:
        return _cdiv(nbytes, G["QC_DEQUANT_WG"] * G["QC_DEQUANT_BYTES_PER_ITEM"])

    # -- bitsandbytes ------------------------------------------------------------------------------------
    def quantize_4bit(self, x, packed, absmax, *, blocksize, quant_type):
        per_item, groups = self._quantize_geometry(x.size, blocksize)
        with self._launch(packed, x, absmax) as launch:
            launch(f"qc_quantize_4bit_{_kdt(x)}", groups, G["QC_QUANT_WG"], x, packed, absmax, x.size,
                   blocksize, QUANT_TYPE_CODE[quant_type], per_item)

    def dequantize_4bit(self, packed, absmax, out, *, blocksize, quant_type, nested):
        n = out.size
        with self._launch(out, packed, absmax) as launch:
            launch(f"qc_dequantize_4bit_{_kdt(out)}", self._dequantize_groups((n + 1) // 2),
                   G["QC_DEQUANT_WG"], packed, *self._absmax_args(absmax, nested), out, n, blocksize,
                   QUANT_TYPE_CODE[quant_type])

    def double_quantize(self, absmax, qabsmax, absmax2, offset):
        nb = absmax.size
        per_item, groups = self._quantize_geometry(nb, bnb.NESTED_BLOCKSIZE)
        with self._launch(qabsmax, absmax, absmax2, offset) as launch:
            launch("qc_absmax_mean", 1, G["QC_SUM_WG"], absmax, nb, offset)
            launch("qc_double_quantize", groups, G["QC_QUANT_WG"], absmax, qabsmax, absmax2, offset, nb,
                   per_item)

    def quantize_blockwise(self, x, thresholds, codes, absmax, *, blocksize):
        if thresholds.size != 255:
            raise ParameterError(f"8-bit thresholds must hold 255 values, got {thresholds.size}")
        per_item, groups = self._quantize_geometry(x.size, blocksize)
        with self._launch(codes, x, thresholds, absmax) as launch:
            launch(f"qc_quantize_blockwise_{_kdt(x)}", groups, G["QC_QUANT_WG"], x, thresholds, codes,
                   absmax, x.size, blocksize, per_item)

    def dequantize_blockwise(self, codes, absmax, code, out, *, blocksize):
        if code.size != 256:
            raise ParameterError(f"an 8-bit code table holds 256 values, got {code.size}")
        n = out.size
        with self._launch(out, codes, absmax, code) as launch:
            launch(f"qc_dequantize_blockwise_{_kdt(out)}", self._dequantize_groups(n), G["QC_DEQUANT_WG"],
                   codes, absmax, code, out, n, blocksize)

    def gemv_4bit(self, a, packed, absmax, out, *, n, k, blocksize, quant_type, nested):
        batch = a.size // k
        if batch * k != a.size or out.size != batch * n:
            raise ParameterError(f"gemv_4bit: A holds {a.size} values and out {out.size} for N={n}, K={k}")
        args = (a, packed, *self._absmax_args(absmax, nested), out, batch, n, k, blocksize,
                QUANT_TYPE_CODE[quant_type])
        with self._launch(out, a, packed, absmax) as launch:
            if batch >= TILED_MIN_ROWS:  # many rows: output tiles, the weight read once per tile
                launch(f"qc_gemv_4bit_tiled_{_kdt(a)}", _cdiv(n, T["QC_TILE_M"]) * _cdiv(batch, T["QC_TILE_N"]),
                       T["QC_TILE_THREADS"], *args)
            else:  # one sub-group per weight row
                launch(f"qc_gemv_4bit_{_kdt(a)}", _cdiv(n, G["QC_GEMV_ROWS_PER_WG"]),
                       G["QC_GEMV_ROWS_PER_WG"] * self.program(out.queue).subgroup_size, *args)

    def gemv_4bit_grouped(self, a, groups, out, *, k):
        """Weights that share the input: below QC_TILED_MIN_ROWS rows, one launch per run of up to
        GEMV_TC_GROUPS weights of one blocksize and quant type (a sub-group per row of all of them,
        each weight's results into its columns of ``out``); with more rows each weight's tiled gemv
        into a scratch array, its rows copied into its columns."""
        batch, ntot = _grouped_sizes("gemv_4bit_grouped", a, groups, out, k)
        isz = out.dtype.itemsize
        with self._launch(out, a, *(g[0] for g in groups)) as launch:
            col, i = 0, 0
            while i < len(groups):
                p, am, nst, n, bs, qt = groups[i]
                if batch >= TILED_MIN_ROWS:  # many rows: the tiled kernel's weight reuse, then a copy
                    tmp = SyclArray.empty((batch, n), out.dtype, out.queue)
                    launch(f"qc_gemv_4bit_tiled_{_kdt(a)}", _cdiv(n, T["QC_TILE_M"]) * _cdiv(batch, T["QC_TILE_N"]),
                           T["QC_TILE_THREADS"], a, p, *self._absmax_args(am, nst), tmp, batch, n, k, bs,
                           QUANT_TYPE_CODE[qt])
                    dst = out.byte_view(col * isz, (out.nbytes - col * isz,), "uint8")
                    launch("qc_copy_rows", _cdiv(batch * n * isz, G["QC_GGML_WG"]), G["QC_GGML_WG"], tmp, dst,
                           batch, n * isz, ntot * isz)
                    launch.finish()  # tmp is freed when this iteration ends
                    col, i = col + n, i + 1
                    continue
                j = grouped_run_end(groups, i, GEMV_TC_GROUPS)
                weights = []
                for g in grouped_run_padded(groups, i, j, GEMV_TC_GROUPS):
                    weights += [g[0], *self._absmax_args(g[1], g[2]), g[3]]
                nrows = sum(g[3] for g in groups[i:j])
                dst = out.byte_view(col * isz, ((out.nbytes - col * isz) // isz,), out.dtype) if col else out
                launch(f"qc_gemv_4bit_grouped_{_kdt(a)}", _cdiv(nrows, G["QC_GEMV_ROWS_PER_WG"]),
                       G["QC_GEMV_ROWS_PER_WG"] * self.program(out.queue).subgroup_size, a, *weights, dst, ntot, batch,
                       j - i, k, bs, QUANT_TYPE_CODE[qt])
                col, i = col + nrows, j

    # -- ggml --------------------------------------------------------------------------------------------
    def _ggml_codec(self, name: str, src: SyclArray, dst: SyclArray, values: int, *fmt: int) -> None:
        nblocks = values // ggml.QK
        with self._launch(dst, src) as launch:
            launch(name, _cdiv(nblocks, G["QC_GGML_WG"]), G["QC_GGML_WG"], src, *fmt, dst, nblocks)

    def quantize_q4_0(self, w, out):
        self._ggml_codec(f"qc_quantize_q4_0_{_kdt(w)}", w, out, w.size)

    def quantize_q8_0(self, a, out):
        self._ggml_codec(f"qc_quantize_q8_0_{_kdt(a)}", a, out, a.size)

    def quantize_q8_1(self, a, out):
        self._ggml_codec(f"qc_quantize_q8_1_{_kdt(a)}", a, out, a.size)

    def dequantize_ggml(self, q, out, *, fmt):
        if fmt not in ggml.BLOCK_BYTES:
            raise ParameterError(f"unknown ggml format {fmt!r}")
        self._ggml_codec(f"qc_dequantize_ggml_{_kdt(out)}", q, out, out.size, GGML_FORMAT_CODE[fmt])

    def _gemm(self, wq: SyclArray, act: SyclArray, out: SyclArray, quantized: bool) -> None:
        """The W4A8 GEMMs' one dispatch point. N < TILED_MIN_ROWS: the few-rows kernel (one
        sub-group per weight row, the activation quantized inside for gemm_w4a8). Many rows: a
        float activation is quantized to Q8_1 once (quantize_q8_1's kernel, the same bytes the
        few-rows kernel makes inside), then the tiled kernel."""
        m, n = out.shape
        k = wq.shape[1] * ggml.QK
        with self._launch(out, wq, act) as launch:
            if n >= TILED_MIN_ROWS:
                if not quantized:
                    nblocks = n * (k // ggml.QK)
                    aq = SyclArray.empty((nblocks * ggml.Q8_1_BLOCK_BYTES,), np.uint8, out.queue)
                    launch(f"qc_quantize_q8_1_{_kdt(act)}", _cdiv(nblocks, G["QC_GGML_WG"]), G["QC_GGML_WG"],
                           act, aq, nblocks)
                    act = aq
                launch("qc_gemm_q4_0_q8_1_tiled", _cdiv(m, T["QC_TILE_M"]) * _cdiv(n, T["QC_TILE_N"]),
                       T["QC_TILE_THREADS"], wq, act, out, m, n, k)
                if not quantized:  # the temporary is freed on return (sycl::free does not wait)
                    launch.finish()
                    runtime.shim().check(runtime.shim().lib.qc_queue_wait(out.queue.addressof_ref()),
                                         "waiting for the queue")
            else:
                sg = self.program(out.queue).subgroup_size
                name = "qc_gemm_q4_0_q8_1" if quantized else f"qc_gemm_w4a8_{_kdt(act)}"
                groups = _cdiv(m, G["QC_GEMM_ROWS_PER_WG"]) * _cdiv(n, G["QC_MAX_BATCH"])
                launch(name, groups, G["QC_GEMM_ROWS_PER_WG"] * sg, wq, act, out, m, n, k)

    def gemm_q4_0_q8_1(self, wq, aq, out):
        self._gemm(wq, aq, out, quantized=True)

    def gemm_w4a8(self, wq, a, out):
        self._gemm(wq, a, out, quantized=False)


    # -- NVFP4 / MX ---------------------------------------------------------------------------------------
    @staticmethod
    def _mx_fmt(fmt: str) -> int:
        from quantcore.formats import mx

        if fmt not in mx.MX_FORMAT_CODE:
            raise ParameterError(f"unknown MX format {fmt!r}")
        return mx.MX_FORMAT_CODE[fmt]

    def mx_quantize(self, x, codes, scales, *, rows, cols, fmt, scale_mode, swizzled, global_scale=None):
        from quantcore.formats import mx

        code = self._mx_fmt(fmt)
        nblocks = rows * (cols // mx.block_size(fmt))
        wg = G["QC_MX_WG"]
        with self._launch(codes, x, scales, global_scale) as launch:
            launch(f"qc_mx_quantize_{_kdt(x)}", _cdiv(nblocks, wg), wg, x, codes, scales, rows, cols, code,
                   mx.SCALE_MODE_CODE[scale_mode or "floor"], int(bool(swizzled)), global_scale)
            if swizzled:  # the padding of the 128x4 tiles is written as zeros
                scols = cols // mx.block_size(fmt)
                pr, pc = mx.swizzled_shape(rows, scols)
                launch("qc_swizzle_scales", _cdiv(pr * pc, wg), wg, None, scales, rows, scols)

    def mx_dequantize(self, codes, scales, out, *, rows, cols, fmt, swizzled, global_scale=None):
        code = self._mx_fmt(fmt)
        wg = G["QC_MX_WG"]
        with self._launch(out, codes, scales, global_scale) as launch:
            launch(f"qc_mx_dequantize_{_kdt(out)}", _cdiv(rows * cols, wg), wg, codes, scales, out, rows,
                   cols, code, int(bool(swizzled)), global_scale)

    def swizzle_scales(self, scales, out, *, rows, cols):
        wg = G["QC_MX_WG"]
        with self._launch(out, scales) as launch:
            launch("qc_swizzle_scales", _cdiv(out.size, wg), wg, scales, out, rows, cols)

    def unswizzle_scales(self, swz, out, *, rows, cols):
        wg = G["QC_MX_WG"]
        with self._launch(out, swz) as launch:
            launch("qc_unswizzle_scales", _cdiv(rows * cols, wg), wg, swz, out, rows, cols)

    def scaled_fp4_mm(self, a, b, scale_a, scale_b, alpha, bias, out, *, m, n, k, fmt):
        code = self._mx_fmt(fmt)
        wg = G["QC_MX_WG"]
        with self._launch(out, a, b, scale_a, scale_b, alpha, bias) as launch:
            launch("qc_scaled_fp4_mm", _cdiv(m * n, wg), wg, a, b, scale_a, scale_b, alpha, bias, out,
                   m, n, k, code)

    def linear_mx(self, x, codes, scales, out, *, n, k, fmt, swizzled, global_scale=None):
        code = self._mx_fmt(fmt)
        batch = x.size // k
        prog_sg = self.program(out.queue).subgroup_size
        with self._launch(out, x, codes, scales, global_scale) as launch:
            launch(f"qc_linear_mx_{_kdt(x)}", _cdiv(n, G["QC_GEMV_ROWS_PER_WG"]), G["QC_GEMV_ROWS_PER_WG"] * prog_sg,
                   x, codes, scales, global_scale, out, batch, n, k, code, int(bool(swizzled)))

    def linear_mx_grouped(self, x, groups, out, *, k):
        """Weights that share the input: one launch per run of up to GEMV_TC_GROUPS weights of one
        format and scale layout (a sub-group per row of all of them, each weight's results into its
        columns of ``out``), as gemv_4bit_grouped does below QC_TILED_MIN_ROWS rows."""
        batch, ntot = _grouped_sizes("linear_mx_grouped", x, groups, out, k)
        isz = out.dtype.itemsize
        prog_sg = self.program(out.queue).subgroup_size
        with self._launch(out, x, *(a for g in groups for a in g[:3])) as launch:
            col, i = 0, 0
            while i < len(groups):
                fmt, swizzled = groups[i][4:]
                j = grouped_run_end(groups, i, GEMV_TC_GROUPS)
                weights = [a for g in grouped_run_padded(groups, i, j, GEMV_TC_GROUPS) for a in g[:4]]
                nrows = sum(g[3] for g in groups[i:j])
                dst = out.byte_view(col * isz, ((out.nbytes - col * isz) // isz,), out.dtype) if col else out
                launch(f"qc_linear_mx_grouped_{_kdt(x)}", _cdiv(nrows, G["QC_GEMV_ROWS_PER_WG"]),
                       G["QC_GEMV_ROWS_PER_WG"] * prog_sg, x, *weights, dst, ntot, batch, j - i, k, self._mx_fmt(fmt),
                       int(bool(swizzled)))
                col, i = col + nrows, j


def _grouped_sizes(op: str, x: SyclArray, groups: list[tuple], out: SyclArray, k: int) -> tuple[int, int]:
    """(input rows, total N) of a grouped op (groups[i][3]: weight i's N), checked against the sizes."""
    batch, ntot = x.size // k, sum(g[3] for g in groups)
    if batch * k != x.size or out.size != batch * ntot:
        raise ParameterError(f"{op}: the input holds {x.size} values and out {out.size} for N={ntot}, K={k}")
    return batch, ntot


def create() -> SyclBackend:
    return SyclBackend()
