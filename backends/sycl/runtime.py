"""SYCL plumbing of the ``sycl`` backend: OpenCL ICD setup, the C++ host shim, kernel builds, launches.

The chain (measured facts in docs/sycl.md): dpctl owns the queue and the USM
memory; a small C++ shim (``shim.cpp``), built at first use with the system C++ compiler against
the headers and ``libsycl.so`` of the ``intel-sycl-rt`` wheel and cached on disk, compiles the SYCL
sources of ``kernels_sycl/`` at run time with the runtime's kernel compiler (once per process and
device) and submits kernels to the dpctl queue. Python talks to the shim through ctypes.

Nothing here imports dpctl at module import time: :func:`setup_opencl_icd` must run first.
"""

from __future__ import annotations

import ctypes
import numbers
import os
import subprocess
import threading
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from quantcore import cache
from quantcore.errors import BackendUnavailableError, KernelError
from quantcore.formats import kernel_defines, kernel_interface

#: dpctl filter string of the device the backend uses by default (e.g. "opencl:cpu:0", "level_zero:gpu").
ENV_DEVICE = "QUANTCORE_SYCL_DEVICE"
#: Where built artefacts are cached (default $XDG_CACHE_HOME/quantcore or ~/.cache/quantcore).
ENV_CACHE = cache.ENV_CACHE

# Kinds of kernel arguments (keep in sync with ArgKind in shim.cpp), by the interface's argument kind.
ARG_PTR, ARG_I32, ARG_I64, ARG_F32 = 0, 1, 2, 3
_ARG_KINDS = {"ptr": (ARG_PTR, ctypes.c_void_p), "i32": (ARG_I32, ctypes.c_int32),
              "i64": (ARG_I64, ctypes.c_int64), "f32": (ARG_F32, ctypes.c_float)}

#: The one bundle's root source and the folder of kernel sources (package data).
KERNEL_PACKAGE = "quantcore.kernels_sycl"
KERNEL_ROOT = "entry_points.cpp"

#: Build options of the kernel bundle: no FMA contraction and correctly rounded fp32 division,
#: which the bit-exact tier depends on (see docs/sycl.md, "bit-exactness").
BASE_BUILD_OPTIONS = ("-ffp-contract=off", "-foffload-fp32-prec-div")

_lock = threading.RLock()


# -- locating the wheels' files ------------------------------------------------------------------
def _dist_file(dist: str, pattern: str) -> Path | None:
    """First file of the installed distribution ``dist`` whose posix path ends with ``pattern``."""
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace("\\", "/").endswith(pattern):
            path = Path(f.locate()).resolve()
            if path.exists():
                return path
    return None


def sycl_runtime_dirs() -> tuple[Path, Path]:
    """``(include_dir, lib_dir)`` of the intel-sycl-rt wheel, or BackendUnavailableError."""
    header = _dist_file("intel-sycl-rt", "include/sycl/sycl.hpp")
    lib = _dist_file("intel-sycl-rt", "libsycl.so")
    if header is None or lib is None:
        raise BackendUnavailableError(
            "the SYCL runtime headers or libsycl.so were not found (package intel-sycl-rt); "
            "install the extra: pip install 'quantcore[sycl]'"
        )
    return header.parent.parent, lib.parent


def sycl_runtime_version() -> str:
    try:
        return metadata.version("intel-sycl-rt")
    except metadata.PackageNotFoundError:
        return "unknown"


# -- OpenCL ICD ------------------------------------------------------------------------------------
_icd_note = [""]


def setup_opencl_icd() -> str:
    """Point the OpenCL ICD loader at the CPU driver of the intel-opencl-rt wheel.

    The wheel's ICD file names a path that does not exist, so without this the SYCL runtime sees no
    OpenCL device. The loader reads ``OCL_ICD_FILENAMES`` when the SYCL runtime first enumerates
    platforms, so this must run before the first dpctl device query. A user's own setting wins.
    Returns a one-line note of what was done (shown by ``quantcore info``).
    """
    with _lock:
        if _icd_note[0]:
            return _icd_note[0]
        if os.environ.get("OCL_ICD_FILENAMES"):
            note = f"OCL_ICD_FILENAMES set by the user ({os.environ['OCL_ICD_FILENAMES']})"
        else:
            driver = _dist_file("intel-opencl-rt", "libintelocl.so")
            if driver is None:
                note = "intel-opencl-rt not installed: no OpenCL CPU device"
            else:
                os.environ["OCL_ICD_FILENAMES"] = str(driver)
                note = f"OCL_ICD_FILENAMES={driver} (set by quantcore)"
        _icd_note[0] = note
        return note


def import_dpctl() -> Any:
    """dpctl, imported after the ICD setup; BackendUnavailableError when it is not installed."""
    setup_opencl_icd()
    try:
        import dpctl
        import dpctl.memory  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError(
            f"dpctl is not importable ({exc}); install the extra: pip install 'quantcore[sycl]'"
        ) from exc
    return dpctl


# -- the host shim -----------------------------------------------------------------------------------
def _compiler() -> str:
    return cache.host_compiler(purpose="the sycl backend builds a small host shim at first use")


def _shim_source() -> Path:
    return Path(__file__).with_name("shim.cpp")


#: Flags of the shim's build (besides the include / library paths, the source and the output).
SHIM_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING")


def shim_build_command(compiler: str, include_dir: Path, lib_dir: Path, output: str) -> list[str]:
    return [compiler, *SHIM_FLAGS, f"-I{include_dir}", str(_shim_source()), f"-L{lib_dir}", "-lsycl",
            f"-Wl,-rpath,{lib_dir}", "-o", output]


def shim_cache_key(compiler: str, include_dir: Path, lib_dir: Path) -> str:
    """Hash of everything the shim binary depends on: its source, the build command (flags), the
    compiler and its ``--version``, the runtime's version and paths."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
        version = out.stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    return cache.digest(_shim_source().read_bytes(), compiler, version,
                        *shim_build_command(compiler, include_dir, lib_dir, "OUT"),
                        sycl_runtime_version(), str(include_dir), str(lib_dir), length=20)


def _compile_shim(cmd: list[str]) -> None:
    """Run the shim's build command (KernelError with the compiler's log on failure)."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise KernelError(f"building the SYCL host shim failed:\n$ {' '.join(cmd)}\n"
                          f"{res.stdout}{res.stderr}")


def build_shim(force: bool = False) -> Path:
    """Path of the shim shared library, built now unless a cached build matches its inputs.

    A cached library is used only when its sidecar checksum (``<name>.sha256``, written after the
    library) matches the file; otherwise it is built afresh. The cache folder must be private
    (:func:`quantcore.cache.private_dir`: BackendUnavailableError otherwise). The build goes to a
    temporary file in the cache folder and is renamed into place, so two processes building at
    once both end with a complete library.
    """
    include_dir, lib_dir = sycl_runtime_dirs()
    cxx = _compiler()
    name = f"qc_sycl_shim-{shim_cache_key(cxx, include_dir, lib_dir)}.so"

    def build(tmp: Path) -> Path:
        _compile_shim(shim_build_command(cxx, include_dir, lib_dir, str(tmp / name)))
        return tmp / name

    return cache.cached_file(cache.private_dir("sycl"), name, build, force=force)


class Shim:
    """ctypes bindings of shim.cpp (one per process)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        vp, cp, i32, i64p = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)
        sig = {
            "qc_last_error": (cp, []),
            "qc_sycl_version": (cp, []),
            "qc_build": (vp, [vp, cp, i32, vp, vp, i32, vp]),
            "qc_bundle_free": (None, [vp]),
            "qc_get_kernel": (vp, [vp, cp]),
            "qc_kernel_free": (None, [vp]),
            "qc_kernel_info": (i32, [vp, vp, i64p]),
            "qc_launch": (i32, [vp, vp, ctypes.c_size_t, ctypes.c_size_t, i32, vp, vp, vp, vp]),
            "qc_event_wait": (i32, [vp]),
            "qc_event_free": (None, [vp]),
            "qc_queue_wait": (i32, [vp]),
            "qc_memcpy": (i32, [vp, vp, vp, ctypes.c_size_t]),
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        self.lib = lib
        self.path = path

    def error(self) -> str:
        return (self.lib.qc_last_error() or b"").decode(errors="replace")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise KernelError(f"{what} failed: {self.error()}")


_shim: list[Shim | None] = [None]


def shim() -> Shim:
    with _lock:
        if _shim[0] is None:
            _shim[0] = Shim(build_shim())
        return _shim[0]


# -- kernel sources and geometry ---------------------------------------------------------------------
def kernel_sources() -> tuple[str, dict[str, str]]:
    """``(root source, {include name: text})``: entry_points.cpp, every header of kernels_sycl/ and
    the generated quantcore_constants.h (the core's tables)."""
    folder = resources.files(KERNEL_PACKAGE)
    includes = {kernel_defines.HEADER_NAME: kernel_defines.constants_header()}
    for entry in folder.iterdir():
        if entry.name.endswith(".hpp"):
            includes[entry.name] = entry.read_text()
    return folder.joinpath(KERNEL_ROOT).read_text(), includes


#: The kernels' launch geometry (generated into their header from the core, kernel_defines), with
#: the default required sub-group size.
GEOMETRY = {**kernel_defines.SYCL_GEOMETRY, "QC_SUBGROUP_SIZE": kernel_defines.SYCL_SUBGROUP_SIZE}


# -- programs (one compiled bundle per context and device) ----------------------------------------------
class Program:
    """The kernels of kernels_sycl/ compiled for one queue's context and device."""

    def __init__(self, queue: Any, subgroup_size: int, fp64: bool, source: str | None = None,
                 includes: dict[str, str] | None = None, extra_options: tuple[str, ...] = (),
                 interface: dict[str, tuple[kernel_interface.Arg, ...]] | None = None):
        self.shim = shim()
        if source is None:
            source, includes = kernel_sources()
            interface = kernel_interface.sycl_kernels()
        #: kernel name -> its declared arguments (kernel_interface); a launch passes each as its kind
        self.interface = interface or {}
        includes = includes or {}
        self.subgroup_size = subgroup_size
        self.fp64 = fp64
        self.options = (*BASE_BUILD_OPTIONS, f"-DQC_SUBGROUP_SIZE={subgroup_size}",
                        f"-DQC_HAVE_FP64={int(fp64)}", *extra_options)
        names = list(includes)
        c_names = (ctypes.c_char_p * len(names))(*[n.encode() for n in names])
        c_texts = (ctypes.c_char_p * len(names))(*[includes[n].encode() for n in names])
        c_opts = (ctypes.c_char_p * len(self.options))(*[o.encode() for o in self.options])
        handle = self.shim.lib.qc_build(queue.addressof_ref(), source.encode(), len(names),
                                        c_names, c_texts, len(self.options), c_opts)
        if not handle:
            raise KernelError("compiling the SYCL kernels failed (options: "
                              f"{' '.join(self.options)}):\n{self.shim.error()}")
        self.handle = handle
        self._kernels: dict[str, int] = {}
        self._klock = threading.Lock()

    def kernel(self, name: str) -> int:
        with self._klock:
            k = self._kernels.get(name)
            if k is None:
                k = self.shim.lib.qc_get_kernel(self.handle, name.encode())
                if not k:
                    raise KernelError(f"kernel {name!r}: {self.shim.error()}")
                self._kernels[name] = k
            return k

    def kernel_info(self, name: str, queue: Any) -> dict[str, int]:
        """Required sub-group size (0 = none stated), max sub-group size, max work-group size."""
        out = (ctypes.c_int64 * 3)()
        self.shim.check(self.shim.lib.qc_kernel_info(self.kernel(name), queue.addressof_ref(), out),
                        f"querying kernel {name}")
        return {"required_subgroup_size": out[0], "max_subgroup_size": out[1],
                "max_workgroup_size": out[2]}

    def launch(self, queue: Any, name: str, groups: int, wg: int, args: tuple, dep: int | None = None,
               want_event: bool = False) -> int | None:
        """Submit ``name`` over ``groups`` work-groups of ``wg`` items. ``args`` in the kernel's
        declared order (kernel_interface), each passed as its declared kind: a pointer is a native
        array (anything with ``.ptr``) or None (null), an integer an int, an f32 a float; anything
        else raises KernelError naming the kernel and the argument."""
        declared = self.interface.get(name)
        if declared is None:
            raise KernelError(f"kernel {name}: not declared in the kernel interface "
                              "(quantcore/formats/kernel_interface.py)")
        if len(args) != len(declared):
            raise KernelError(f"kernel {name} takes {len(declared)} arguments "
                              f"({', '.join(a.name for a in declared)}), got {len(args)}")
        n = len(args)
        kinds = (ctypes.c_int * n)()
        holders = [_marshal(name, a, v) for a, v in zip(declared, args)]
        for i, a in enumerate(declared):
            kinds[i] = _ARG_KINDS[a.kind][0]
        values = (ctypes.c_void_p * n)(*[ctypes.addressof(v) for v in holders])
        event = ctypes.c_void_p(0)
        if groups <= 0:
            return None
        rc = self.shim.lib.qc_launch(queue.addressof_ref(), self.kernel(name), groups * wg, wg, n,
                                     kinds, values, dep, ctypes.byref(event) if want_event else None)
        self.shim.check(rc, f"launching {name} ({groups} x {wg})")
        return event.value if want_event else None

    def __del__(self):  # pragma: no cover - process teardown order is not ours to test
        try:
            for k in self._kernels.values():
                self.shim.lib.qc_kernel_free(k)
            self.shim.lib.qc_bundle_free(self.handle)
        except Exception:
            pass


def _marshal(kernel: str, arg: kernel_interface.Arg, value: Any) -> Any:
    """``value`` as the ctypes value of ``arg``'s declared kind (KernelError when it is not one)."""
    kind = arg.kind
    if kind == "ptr":
        if value is None or hasattr(value, "ptr"):
            return ctypes.c_void_p(0 if value is None else value.ptr)
        what = "a device array or None"
    elif kind in ("i32", "i64"):
        bits = 32 if kind == "i32" else 64
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) \
                and -(1 << (bits - 1)) <= int(value) < 1 << (bits - 1):
            return _ARG_KINDS[kind][1](int(value))
        what = f"an integer that fits {kind}"
    elif kind == "f32":
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return ctypes.c_float(float(value))
        what = "a float"
    else:  # pragma: no cover - the SYCL declarations use these kinds only
        raise KernelError(f"kernel {kernel}: argument {arg.name} has kind {kind}, which the shim cannot pass")
    raise KernelError(f"kernel {kernel}: argument {arg.name} ({arg.type}) must be {what}, got "
                      f"{type(value).__name__} {value!r}"[:300])


def compile_source(queue: Any, source: str, includes: dict[str, str] | None = None,
                   options: tuple[str, ...] = (), interface: dict[str, str] | None = None) -> Program:
    """Compile arbitrary SYCL source for ``queue`` (KernelError with the compiler log on failure);
    ``interface`` declares its kernels' arguments: name -> ``"const f32* x, i64 n"``."""
    return Program(queue, subgroup_size=GEOMETRY["QC_SUBGROUP_SIZE"], fp64=False, source=source,
                   includes=includes, extra_options=options,
                   interface={k: kernel_interface.args(v) for k, v in (interface or {}).items()})


def pick_subgroup_size(device: Any) -> int:
    """The required sub-group size of the gemv / GEMM kernels on ``device``, stated explicitly.

    GPUs get the header's size (32, bitsandbytes' choice). On a CPU device a sub-group is a SIMD
    vector, so the size is the device's native float vector width (8 with AVX2, 16 with AVX-512):
    32 lanes on an AVX2 machine are four registers per value and ran about 2x slower (docs/sycl.md).
    """
    sizes = [int(s) for s in device.sub_group_sizes]
    want = GEOMETRY["QC_SUBGROUP_SIZE"]
    if device.is_cpu:
        native = int(getattr(device, "native_vector_width_float", 0) or 0)
        if native in sizes:
            return native
    if want in sizes:
        return want
    smaller = [s for s in sizes if s < want]
    if not smaller:
        raise BackendUnavailableError(f"the SYCL device offers sub-group sizes {sizes}; the gemv and "
                                      f"GEMM kernels need {want} or a smaller power of two")
    return max(smaller)
