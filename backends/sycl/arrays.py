"""The ``sycl`` backend's native array: a contiguous typed view of SYCL USM memory.

A :class:`SyclArray` is a shape, a numpy dtype (bfloat16 from ml_dtypes included), a USM address
and the dpctl queue the memory belongs to. It owns nothing itself: it keeps the object that owns
the memory (a ``dpctl.memory`` object, a dpnp array, ...) alive. It exposes
``__sycl_usm_array_interface__``, so dpctl and dpnp take it zero-copy, and moves to the host only
through the explicit :meth:`SyclArray.to_numpy`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quantcore.arrays import as_dtype, dtype_name
from quantcore.errors import DeviceError, ShapeError


class SyclArray:
    """A C-contiguous array in SYCL USM memory. ``ptr`` is the address of element 0."""

    __slots__ = ("shape", "dtype", "ptr", "queue", "owner")

    def __init__(self, owner: Any, ptr: int, shape: tuple[int, ...], dtype: Any, queue: Any):
        self.owner = owner
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = as_dtype(dtype)
        self.queue = queue

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: Any, queue: Any) -> SyclArray:
        """Uninitialised device USM memory for ``shape`` x ``dtype`` on ``queue``."""
        import dpctl.memory as dm

        nbytes = int(np.prod(shape, dtype=np.int64)) * as_dtype(dtype).itemsize
        mem = dm.MemoryUSMDevice(max(nbytes, 1), queue=queue)
        return cls(mem, mem.__sycl_usm_array_interface__["data"][0], shape, dtype, queue)

    @classmethod
    def from_usm(cls, obj: Any, shape: tuple[int, ...] | None = None, dtype: Any = None) -> SyclArray:
        """Zero-copy view of a USM object: a dpnp array, a ``dpctl.memory`` object, or anything
        with ``__sycl_usm_array_interface__``. ``shape`` / ``dtype`` reinterpret an untyped buffer
        (a dpctl memory object is uint8 [nbytes]); the object must be C-contiguous."""
        iface = obj.__sycl_usm_array_interface__
        own_shape = tuple(iface["shape"])
        own_dtype = as_dtype(obj.dtype) if hasattr(obj, "dtype") else np.dtype(iface["typestr"])
        strides = iface.get("strides")
        if strides is not None:
            # The interface gives strides in elements; None means C-contiguous.
            if tuple(strides) != _c_strides(own_shape, 1) and int(np.prod(own_shape)) > 1:
                raise DeviceError("the sycl backend takes C-contiguous USM arrays; this one has strides "
                                  f"{tuple(strides)} (make a contiguous copy, e.g. dpnp.ascontiguousarray)")
        ptr = int(iface["data"][0]) + int(iface.get("offset", 0) or 0) * own_dtype.itemsize
        nbytes = int(np.prod(own_shape, dtype=np.int64)) * own_dtype.itemsize
        shape = own_shape if shape is None else tuple(shape)
        dtype = own_dtype if dtype is None else as_dtype(dtype)
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > nbytes:
            raise ShapeError(f"shape {shape} x {dtype_name(dtype)} needs more than the {nbytes} bytes "
                             "of the USM object")
        return cls(obj, ptr, shape, dtype, _queue_of(obj, iface))

    # -- properties -----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def __sycl_usm_array_interface__(self) -> dict:
        return {"data": (self.ptr, False), "shape": self.shape, "strides": None,
                "typestr": self.dtype.str, "version": 1, "syclobj": self.queue}

    # -- views ------------------------------------------------------------------------------------
    def reshape(self, *shape: Any) -> SyclArray:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if -1 in shape:
            known = int(np.prod([s for s in shape if s != -1], dtype=np.int64)) or 1
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ShapeError(f"cannot reshape an array of {self.size} elements into {shape}")
        return SyclArray(self.owner, self.ptr, shape, self.dtype, self.queue)

    def byte_view(self, byte_offset: int, shape: tuple[int, ...], dtype: Any) -> SyclArray:
        """A typed view of ``shape`` x ``dtype`` starting ``byte_offset`` bytes into this array."""
        dtype = as_dtype(dtype)
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if byte_offset < 0 or byte_offset + need > self.nbytes:
            raise ShapeError(f"a view of {need} bytes at offset {byte_offset} does not fit in "
                             f"{self.nbytes} bytes")
        return SyclArray(self.owner, self.ptr + byte_offset, shape, dtype, self.queue)

    # -- host copies (explicit) -----------------------------------------------------------------------
    def to_numpy(self) -> np.ndarray:
        """Copy to a new numpy array (waits for the work queued before it on an in-order queue)."""
        from .runtime import shim

        out = np.empty(self.shape, dtype=self.dtype)
        if self.nbytes:
            sh = shim()
            sh.check(sh.lib.qc_memcpy(self.queue.addressof_ref(), out.ctypes.data, self.ptr, self.nbytes),
                     "copying to the host")
        return out

    def copy_from_numpy(self, a: np.ndarray) -> None:
        """Overwrite this array with the bytes of the numpy array ``a`` (same size in bytes)."""
        from .runtime import shim

        a = np.ascontiguousarray(a)
        if a.nbytes != self.nbytes:
            raise ShapeError(f"copying {a.nbytes} bytes into an array of {self.nbytes} bytes")
        if a.nbytes:
            sh = shim()
            sh.check(sh.lib.qc_memcpy(self.queue.addressof_ref(), self.ptr, a.ctypes.data, a.nbytes),
                     "copying from the host")

    def __repr__(self) -> str:
        return (f"SyclArray(shape={self.shape}, dtype={dtype_name(self.dtype)}, "
                f"device={self.queue.sycl_device.filter_string})")


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, acc = [], itemsize
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _queue_of(obj: Any, iface: dict) -> Any:
    """The dpctl queue of a USM object (its own queue when it has one)."""
    import dpctl
    import dpctl.memory as dm

    q = getattr(obj, "sycl_queue", None)
    if isinstance(q, dpctl.SyclQueue):
        return q
    syclobj = iface.get("syclobj")
    if isinstance(syclobj, dpctl.SyclQueue):
        return syclobj
    return dm.as_usm_memory(obj).sycl_queue
