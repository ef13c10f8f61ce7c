"""CUDA run time of the ``cuda`` backend: NVRTC compilation of kernels_cuda/*.cu, a disk cache of
the cubins, module loading per device, launches on the caller's stream, and the array interop
(torch CUDA tensors and CuPy arrays, zero-copy).

Why NVRTC through ctypes and not CuPy's ``RawModule``: CuPy appends ``-ftz=true`` to every
NVRTC compilation it makes (after the caller's options, and NVRTC keeps the last one), which
flushes subnormals and breaks the formats' bit-exactness on subnormal inputs. Here the options
are exactly ``-std=c++17 -ftz=false --fmad=false`` plus the architecture and the include paths,
and the NVRTC library is the one CuPy itself loaded. CuPy still loads the cubins and launches
them (``cupy.cuda.function.Module`` / ``Function``).

Nothing here imports cupy or torch at module import; they are imported on first use.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import os
import sys
import threading
import warnings
from importlib import resources
from typing import Any

import numpy as np

from quantcore import cache
from quantcore.backend import LAUNCH_CONTEXT
from quantcore.errors import BackendUnavailableError, DeviceError, KernelError
from quantcore.formats import kernel_defines, kernel_interface

#: the options every kernel is compiled with (besides the architecture and include paths):
#: IEEE arithmetic with subnormals, no a*b+c contraction (kernels write fmaf where they want it)
COMPILE_OPTIONS = ("-std=c++17", "-ftz=false", "-prec-div=true", "-prec-sqrt=true", "--fmad=false")

_lock = threading.RLock()


# -- lazy imports ----------------------------------------------------------------------------------
def cupy():
    import cupy as cp  # noqa: PLC0415 - optional dependency, imported on first use

    return cp


def torch_module():
    return sys.modules.get("torch")


# -- kernel sources ----------------------------------------------------------------------------------
def kernel_dir() -> str:
    """Folder holding the .cu / .cuh sources (installed package data or the source tree)."""
    return str(resources.files("quantcore.kernels_cuda"))


def cache_dir() -> str:
    """The cubin cache's folder, ``<cache root>/cuda`` (:func:`quantcore.cache.cache_root`)."""
    return str(cache.cache_root() / "cuda")


_header_dirs: set[str] = set()


def header_dir() -> str:
    """Where quantcore_constants.h is written (the cache folder), returned after writing it."""
    d = os.path.join(cache_dir(), "include")
    if d not in _header_dirs:
        with _lock:
            if d not in _header_dirs:
                cache.private_dir("cuda", "include")
                kernel_defines.write_header(d)
                _header_dirs.add(d)
    return d


def _sources_digest() -> str:
    """Digest of the generated constants header and every .cu / .cuh source (names and bytes)."""
    parts: list[str | bytes] = [kernel_defines.constants_header()]
    kd = kernel_dir()
    for name in sorted(os.listdir(kd)):
        if name.endswith((".cu", ".cuh")):
            with open(os.path.join(kd, name), "rb") as f:
                parts += [name, f.read()]
    return cache.digest(*parts, length=64)


# -- NVRTC -------------------------------------------------------------------------------------------
class Nvrtc:
    """The few NVRTC entry points needed, through ctypes."""

    def __init__(self, path: str):
        self.path = path
        # NVRTC dlopen()s its builtins library by soname; a pip-installed NVRTC is not on the loader
        # path, so load the one beside it first (a later dlopen by soname then finds it loaded).
        here = os.path.dirname(os.path.realpath(path))
        for builtins in sorted(glob.glob(os.path.join(here, "libnvrtc-builtins.so*"))):
            if ".alt." not in builtins:
                try:
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass
        lib = ctypes.CDLL(path)
        self.lib = lib
        vp = ctypes.c_void_p
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                           ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(vp)]
        lib.nvrtcAddNameExpression.argtypes = [vp, ctypes.c_char_p]
        lib.nvrtcCompileProgram.argtypes = [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [vp, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [vp, ctypes.c_char_p]
        lib.nvrtcGetCUBINSize.argtypes = [vp, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetCUBIN.argtypes = [vp, ctypes.c_char_p]
        lib.nvrtcGetLoweredName.argtypes = [vp, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, status: int, what: str, log: str = "") -> None:
        if status != 0:
            msg = self.lib.nvrtcGetErrorString(status).decode()
            raise KernelError(f"NVRTC {what} failed: {msg}" + (f"\n{log}" if log else ""))

    def compile(self, source: str, filename: str, name_expr: str | None,
                options: list[str]) -> tuple[bytes, str, str]:
        """-> (cubin, lowered name of ``name_expr``, compiler log). ``name_expr`` None: a module of
        ``extern "C"`` kernels, looked up by their own names (the lowered name is then "")."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0,
                                                None, None), "nvrtcCreateProgram")
        what = name_expr if name_expr is not None else filename
        try:
            if name_expr is not None:
                self._check(self.lib.nvrtcAddNameExpression(prog, name_expr.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            self._check(status, f"compilation of {what} ({filename}, options {' '.join(options)})", log)
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            if name_expr is None:
                return cubin.raw, "", log
            lowered = ctypes.c_char_p()
            self._check(self.lib.nvrtcGetLoweredName(prog, name_expr.encode(), ctypes.byref(lowered)),
                        "nvrtcGetLoweredName")
            return cubin.raw, lowered.value.decode(), log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_candidates() -> list[str]:
    found: list[str] = []
    # the library CuPy uses (loaded by its first compile or version query)
    try:
        from cupy_backends.cuda.libs import nvrtc as cupy_nvrtc  # noqa: PLC0415

        cupy_nvrtc.getVersion()
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith("libnvrtc.so"):
                    found.append(path)
    except Exception:  # noqa: BLE001 - any failure just means: look elsewhere
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            found += sorted(glob.glob(os.path.join(os.environ[var], "lib64", "libnvrtc.so*")))
    for site in sys.path:
        found += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so*")))
        found += sorted(glob.glob(os.path.join(site, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
    found += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))
    lib = ctypes.util.find_library("nvrtc")
    if lib:
        found.append(lib)
    return [p for p in dict.fromkeys(found) if "builtins" not in os.path.basename(p)]


_nvrtc: Nvrtc | None = None


def nvrtc() -> Nvrtc:
    global _nvrtc
    with _lock:
        if _nvrtc is None:
            errors = []
            for path in _nvrtc_candidates():
                try:
                    _nvrtc = Nvrtc(path)
                    break
                except (OSError, AttributeError, KernelError) as exc:
                    errors.append(f"{path}: {exc}")
            if _nvrtc is None:
                raise BackendUnavailableError(
                    "NVRTC (libnvrtc.so) not found: install the CUDA runtime compiler (it comes with "
                    "cupy-cuda13x's dependencies or the CUDA toolkit) or set CUDA_PATH"
                    + (f"; tried: {'; '.join(errors)}" if errors else ""))
        return _nvrtc


def kernel_target(expr: str, arch: int) -> str:
    """NVRTC target of a kernel: ``sm_90a`` for a kernel named ``*wgmma*`` on compute capability 9.0
    (Hopper's warpgroup MMA needs the arch-specific features; its body is compiled out elsewhere, and
    the launchers take it only there), else ``sm_<arch>``."""
    return "sm_90a" if arch == 90 and "wgmma" in expr else f"sm_{arch}"


def compile_source(comp: Nvrtc, source: str, filename: str, name_expr: str | None,
                   options: list[str]) -> tuple[bytes, str, str]:
    """NVRTC build of ``kernels_cuda/<filename>`` (its text ``source``) with ``options`` and the include
    folders (the generated header's, kernels_cuda); the program is named by its full path, since NVRTC
    looks for a quoted include next to the program first: a bare name would take a same-named header
    from the working directory. -> (cubin, lowered name, log), as :meth:`Nvrtc.compile`."""
    return comp.compile(source, os.path.join(kernel_dir(), filename), name_expr,
                        list(options) + [f"-I{header_dir()}", f"-I{kernel_dir()}"])


# -- compiled kernels ----------------------------------------------------------------------------------
class KernelCache:
    """cubin per (source file, name expression, architecture): compiled once (disk cache), loaded
    once per device; returns CuPy ``Function`` objects."""

    def __init__(self) -> None:
        self._functions: dict[tuple[int, str, str], Any] = {}
        self._modules: list[Any] = []  # keep loaded modules alive
        self._digest: str | None = None

    def _cubin(self, filename: str, expr: str, arch: int) -> tuple[bytes, str]:
        comp = nvrtc()
        if self._digest is None:
            self._digest = _sources_digest()
        options = list(COMPILE_OPTIONS) + [f"--gpu-architecture={kernel_target(expr, arch)}"]
        key = cache.digest(self._digest, filename, expr, str(arch), str(comp.version), *COMPILE_OPTIONS,
                           length=40)

        def build() -> tuple[bytes, bytes]:
            with open(os.path.join(kernel_dir(), filename)) as f:
                source = f.read()
            cubin, lowered, _ = compile_source(comp, source, filename, expr, options)
            return cubin, lowered.encode()

        # used only when both files match their sidecar checksums (else compiled afresh)
        cubin, name = cache.cached_bytes(cache.private_dir("cuda"), (key + ".cubin", key + ".name"), build)
        return cubin, name.decode(errors="replace").strip()

    def function(self, device: int, filename: str, expr: str) -> Any:
        key = (device, filename, expr)
        fn = self._functions.get(key)
        if fn is not None:
            return fn
        with _lock:
            fn = self._functions.get(key)
            if fn is None:
                cubin, lowered = self._cubin(filename, expr, device_arch(device))
                mod = load_module(device, cubin)
                fn = mod.get_function(lowered)
                self._modules.append(mod)
                self._functions[key] = fn
        return fn


KERNELS = KernelCache()


def load_module(device: int, cubin: bytes) -> Any:
    """A cubin loaded on ``device`` (a CuPy ``Module``: ``get_function(name)``); keep it alive."""
    from cupy.cuda import function as cufunction  # noqa: PLC0415

    with cupy().cuda.Device(device):
        mod = cufunction.Module()
        mod.load(cubin)
    return mod


def precompile(instances: list[tuple[str, str]], device: int = 0, workers: int = 8) -> int:
    """Compile (into the disk cache) every (file, name expression) for ``device``'s architecture,
    ``workers`` NVRTC compilations at a time (ctypes releases the GIL). Returns the count."""
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    arch = device_arch(device)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda fe: KERNELS._cubin(fe[0], fe[1], arch), instances))
    return len(instances)


# -- device facts ------------------------------------------------------------------------------------
_props: dict[int, dict] = {}


def device_props(device: int) -> dict:
    p = _props.get(device)
    if p is None:
        p = dict(cupy().cuda.runtime.getDeviceProperties(device))
        _props[device] = p
    return p


def device_arch(device: int) -> int:
    p = device_props(device)
    return int(p["major"]) * 10 + int(p["minor"])


def sm_count(device: int) -> int:
    return int(device_props(device)["multiProcessorCount"])


def device_name(device: int) -> str:
    name = device_props(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


# -- arrays ------------------------------------------------------------------------------------------
_KINDS: dict[type, str] = {}


def kind(x: Any) -> str:
    """'torch', 'cupy', 'numpy' or 'other' (a property of the type: cached, asked ~30 times a call)."""
    t = type(x)
    k = _KINDS.get(t)
    if k is None:
        mod = t.__module__.split(".")[0]
        if mod == "torch" and hasattr(t, "data_ptr"):
            k = "torch"
        elif mod == "cupy":
            k = "cupy"
        elif issubclass(t, np.ndarray):
            k = "numpy"
        else:
            k = "other"
        _KINDS[t] = k
    return k


def pointer(x: Any) -> int:
    return int(x.data_ptr()) if kind(x) == "torch" else int(x.data.ptr)


def device_index(x: Any) -> int:
    if kind(x) == "torch":
        idx = x.device.index
        return int(idx) if idx is not None else int(torch_module().cuda.current_device())
    return int(x.device.id)


def numel(x: Any) -> int:
    return int(x.numel()) if kind(x) == "torch" else int(x.size)


def check_device_array(x: Any, what: str = "array") -> None:
    k = kind(x)
    if k == "torch" and x.device.type == "cuda":
        return
    if k == "cupy":
        return
    where = str(x.device) if k == "torch" else ("host memory (numpy)" if k == "numpy" else type(x).__name__)
    raise DeviceError(
        f"the cuda backend takes CUDA arrays (torch CUDA tensors or CuPy arrays); this {what} is on "
        f"{where}. Move it to the GPU (for example tensor.cuda() or cupy.asarray(a)) or use "
        "quantcore.use_backend('cpu')")


# -- streams -------------------------------------------------------------------------------------------
_ext_streams: dict[tuple[int, int], Any] = {}


def stream_for(x: Any, device: int) -> Any:
    """The caller's current stream: torch's for torch tensors, CuPy's for CuPy arrays (None: CuPy
    launches on its own current stream)."""
    if kind(x) != "torch":
        return None
    ptr = int(torch_module().cuda.current_stream(device).cuda_stream)
    s = _ext_streams.get((device, ptr))
    if s is None:
        with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external; both work
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cupy().cuda.ExternalStream(ptr, device)
        _ext_streams[(device, ptr)] = s
    return s


class Launcher:
    """Launches the kernels of one op: on the device of ``like`` and on the caller's stream."""

    __slots__ = ("device", "stream", "_switch")

    def __init__(self, like: Any):
        self.device = device_index(like)
        self.stream = stream_for(like, self.device)
        self._switch = cupy().cuda.runtime.getDevice() != self.device

    def raw_stream(self) -> int | None:
        """The launch stream as a ``cudaStream_t`` value for a :class:`PlannedLaunch`, or None where
        a planned launch cannot be used (the caller's current device is another one, so its
        context is not the function's)."""
        return None if self._switch else self.stream_handle()

    def stream_handle(self) -> int:
        """The launch stream as a ``cudaStream_t`` value (the caller's stream, else CuPy's current one)."""
        return int(self.stream.ptr) if self.stream is not None else int(cupy().cuda.get_current_stream().ptr)

    def __call__(self, filename: str, expr: str, grid: tuple[int, ...], block: int, args: tuple,
                 shared_mem: int = 0, pdl: bool = False) -> None:
        if any(isinstance(v, np.void) for v in args):  # a by-value struct: CuPy's launch takes scalars only
            with cupy().cuda.Device(self.device) if self._switch else contextlib.nullcontext():
                launch_once(self.device, filename, expr, grid, block, args, shared_mem, pdl, self.stream_handle())
            return
        stream = self.raw_stream() if pdl else None
        if stream is not None:  # a programmatic dependent launch (see launch_pdl)
            launch_once(self.device, filename, expr, grid, block, args, shared_mem, True, stream)
            return
        self.run(kernel_function(self.device, filename, expr, shared_mem), expr, grid, block, args, shared_mem)

    def run_pdl(self, fn: Any, what: str, grid: tuple[int, ...], block: int, args: tuple,
                shared_mem: int = 0) -> None:
        """Launch the loaded kernel ``fn`` as a programmatic dependent (:func:`launch_pdl`) where
        that is possible, else as :meth:`run` does; the kernel must wait (griddepcontrol.wait)
        before it reads its arguments."""
        stream = self.raw_stream() if pdl_available() else None
        if stream is not None:
            launch_once(self.device, "", what, grid, block, args, shared_mem, True, stream, function=fn)
            return
        self.run(fn, what, grid, block, args, shared_mem)

    def run(self, fn: Any, what: str, grid: tuple[int, ...], block: int | tuple[int, ...], args: tuple,
            shared_mem: int = 0) -> None:
        """Launch the loaded kernel ``fn`` (``what`` names it in errors); ``block`` an int (x) or
        up to three sizes."""
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        block = (int(block), 1, 1) if isinstance(block, int) else tuple(int(b) for b in block) + (1,) * (3 - len(block))
        try:
            if self._switch:
                with cupy().cuda.Device(self.device):
                    fn(grid, block, args, shared_mem=shared_mem, stream=self.stream)
            else:
                fn(grid, block, args, shared_mem=shared_mem, stream=self.stream)
        except Exception as exc:  # noqa: BLE001 - report which kernel failed and how
            raise KernelError(f"launch of {what} (grid {grid}, block {block}, shared {shared_mem} B) "
                              f"failed: {type(exc).__name__}: {exc}") from exc


_smem_limit: dict[int, int] = {}  #: id(function) -> dynamic shared memory limit set so far


def kernel_function(device: int, filename: str, expr: str, shared_mem: int = 0) -> Any:
    """The loaded kernel, allowed ``shared_mem`` bytes of dynamic shared memory (every launch path
    takes its function here)."""
    return allow_shared_memory(KERNELS.function(device, filename, expr), device, shared_mem)


def allow_shared_memory(fn: Any, device: int, nbytes: int) -> Any:
    """``fn``, allowed ``nbytes`` of dynamic shared memory (over 48 KiB needs the opt-in; the
    default limit counts the kernel's static shared memory too, so it is raised from 32 KiB on);
    the limit only grows, so a launch with less after one with more keeps working."""
    if nbytes > 32 * 1024:
        _raise_smem_limit(fn, device, nbytes)
    return fn


def _raise_smem_limit(fn: Any, device: int, nbytes: int) -> None:
    if _smem_limit.get(id(fn), 0) >= nbytes:
        return
    drv = cupy().cuda.driver
    attr = getattr(drv, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
    with cupy().cuda.Device(device):
        drv.funcSetAttribute(fn.ptr, attr, int(nbytes))
    _smem_limit[id(fn)] = int(nbytes)


# -- kernel arguments (runtime.kernel_args builds every launch's tuple) -----------------------------
NULL = np.uint64(0)
_TO_NUMPY = {"i32": np.int32, "i64": np.int64, "u32": np.uint32, "u64": np.uint64, "f32": np.float32}
_INTS = (int, np.integer)


def _pointer_value(v: Any) -> np.uint64:
    if v is None:
        return NULL
    return np.uint64(v) if isinstance(v, _INTS) else np.uint64(pointer(v))  # an address, or an array


def _by_value_converter(kernel: str, arg: kernel_interface.Arg):
    size = kernel_interface.BY_VALUE[arg.kind]
    dtype = np.dtype((np.void, size))

    def convert(v: Any) -> np.generic:
        if isinstance(v, np.void) and v.dtype == dtype:
            return v
        if isinstance(v, (bytes, bytearray)) and len(v) == size:
            return np.frombuffer(bytes(v), dtype=dtype)[0]
        raise TypeError(f"{kernel}: argument {arg.name} ({arg.type}) takes {size} bytes, got {type(v).__name__}")

    return convert


def _scalar_converter(kernel: str, arg: kernel_interface.Arg):
    if arg.kind in kernel_interface.BY_VALUE:
        return _by_value_converter(kernel, arg)
    to = _TO_NUMPY[arg.kind]
    if arg.kind == "f32":
        return to

    def convert(v: Any) -> np.generic:
        if isinstance(v, _INTS):  # bools are ints: flags
            return to(v)
        raise TypeError(f"{kernel}: argument {arg.name} ({arg.type}) takes an integer, got {type(v).__name__} {v!r}")

    return convert


#: kernel name expression -> (parameter names in order, their set, one converter per parameter)
_ARG_PLANS: dict[str, tuple] = {}


def _arg_plan(kernel: str) -> tuple:
    plan = _ARG_PLANS.get(kernel)
    if plan is None:
        declared = kernel_interface.CUDA_KERNELS[kernel_interface.cuda_kernel(kernel)]
        names = tuple(a.name for a in declared)
        convs = tuple(_pointer_value if a.is_pointer else _scalar_converter(kernel, a) for a in declared)
        plan = _ARG_PLANS[kernel] = (names, frozenset(names), convs)
    return plan


def kernel_args(kernel: str, **values: Any) -> tuple[np.generic, ...]:
    """The argument tuple of the CUDA kernel ``kernel`` (its name expression, or its declared family
    name) from named values: ordered and converted as quantcore/formats/kernel_interface.py declares
    its parameters (pointers: an array, a raw address or None; integers and floats to their
    declared width). A missing or unknown name raises TypeError. The order and converters are
    worked out once per name expression (this runs on every eager launch)."""
    names, nameset, convs = _arg_plan(kernel)
    if len(values) == len(names):  # then a missing name is a KeyError, and no name is extra
        try:
            return tuple([c(values[n]) for n, c in zip(names, convs)])
        except KeyError:
            pass
    missing = [n for n in names if n not in values]
    extra = [n for n in values if n not in nameset]
    raise TypeError(f"{kernel}: " + "; ".join(
        ([f"missing: {', '.join(missing)}"] if missing else [])
        + ([f"not parameters of {kernel_interface.cuda_kernel(kernel)}: {', '.join(extra)}"] if extra else [])))


def aligned(x: Any, nbytes: int) -> bool:
    return pointer(x) % nbytes == 0


ENV_TUNE = "QUANTCORE_CUDA_TUNE"


def tune(name: str, default: int) -> int:
    """Launch parameter override for experiments: QUANTCORE_CUDA_TUNE="gemv_ksplit=4,w4t_tile=0"."""
    spec = os.environ.get(ENV_TUNE)
    if not spec:
        return default
    for item in spec.split(","):
        key, _, val = item.partition("=")
        if key.strip() == name:
            return int(val)
    return default


# The raw QUANTCORE_CUDA_TUNE value, read on every planned call (a launch plan is valid for the
# tuning it was made under): one dict lookup in os.environ's own store, where there is one,
# instead of os.environ.get's key encoding (~1 us).
try:
    _ENV_DATA, _ENV_TUNE_KEY = os.environ._data, os.environ.encodekey(ENV_TUNE)
except AttributeError:  # pragma: no cover - another Python's os.environ
    _ENV_DATA = None


def tune_spec() -> Any:
    """The QUANTCORE_CUDA_TUNE setting as stored (for comparison only; None when unset)."""
    if _ENV_DATA is None:  # pragma: no cover
        return os.environ.get(ENV_TUNE)
    return _ENV_DATA.get(_ENV_TUNE_KEY)


def raw_stream_getter() -> Any:
    """``f(device) -> int``: torch's current stream on ``device`` as a ``cudaStream_t`` value,
    without building a ``torch.cuda.Stream`` (torch's own generated code reads it this way)."""
    torch = torch_module()
    f = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if f is not None:
        return f
    return lambda device: int(torch.cuda.current_stream(device).cuda_stream)  # pragma: no cover


def current_context() -> int:
    """The calling thread's current CUDA context (0 when none)."""
    return int(cupy().cuda.driver.ctxGetCurrent())


def device_context(device: int) -> int:
    """The context kernels are loaded in for ``device`` (its primary context)."""
    with cupy().cuda.Device(device):
        return current_context()


class PlannedLaunch:
    """One kernel launch set up once: the function handle, the geometry and an argument buffer
    (8 bytes per argument, each kernel parameter read from the start of its slot). A call writes
    the per-call pointers into their ``slots`` and launches through ``cuLaunchKernel`` on the
    stream it is given (~1/3 of the host time of a CuPy ``Function`` call with the same tuple,
    which converts every argument on every launch). The caller's thread must have the function's
    context current (see :func:`device_context`)."""

    __slots__ = ("expr", "grid", "block", "shared_mem", "_fn", "_buf", "_params", "_params_ptr",
                 "_slots", "_lock", "_launch", "pdl", "_offsets", "_maps")

    def __init__(self, device: int, filename: str, expr: str, grid: tuple[int, ...], block: int,
                 args: tuple, shared_mem: int = 0, slots: tuple[int, ...] = (), pdl: bool = False,
                 function: Any = None, maps: tuple[tuple[int, int, int], ...] = ()):
        # ``maps``: (argument, byte offset in it, position in ``slots``): a tensor map in a by-value
        # argument whose global address is the pointer a call writes into that slot
        # ``function``: a kernel already loaded (a module of several entry points, such as the MX
        # family's), allowed ``shared_mem``; else ``filename`` / ``expr`` name it
        fn = function if function is not None else kernel_function(device, filename, expr, shared_mem)
        self.expr = expr
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.block = int(block)
        self.shared_mem = int(shared_mem)
        self._fn = int(fn.ptr)
        n = max(1, len(args))
        # each argument at its own offset: 8 bytes for a scalar or pointer, a by-value struct (np.void)
        # at a 64-byte boundary (a CUtensorMap's alignment)
        raws, offsets, end = [], [], 0
        for v in args:
            raw = np.asarray(v).tobytes() if isinstance(v, np.generic) else b""
            if not raw or (len(raw) > 8 and not isinstance(v, np.void)):
                raise TypeError(f"PlannedLaunch takes numpy scalars of at most 8 bytes or np.void structs, got {v!r}")
            end = -(-end // 64) * 64 if isinstance(v, np.void) else end
            raws.append(raw)
            offsets.append(end)
            end += max(8, len(raw))
        self._buf = ctypes.create_string_buffer(max(8, end) + 64)
        shift = -ctypes.addressof(self._buf) % 64
        self._offsets = tuple(shift + o for o in offsets) or (shift,)
        base = ctypes.addressof(self._buf)
        for o, raw in zip(self._offsets, raws):
            ctypes.memmove(base + o, raw, len(raw))
        self._params = (ctypes.c_void_p * n)(*(base + o for o in self._offsets[:n]))
        self._params_ptr = ctypes.addressof(self._params)
        self._slots = tuple(ctypes.c_uint64.from_buffer(self._buf, self._offsets[i]) for i in slots)
        self._maps = tuple((base + self._offsets[a] + off, pos) for a, off, pos in maps)
        self._lock = threading.Lock()  # the buffer is shared: fill and launch as one step
        self._launch = cupy().cuda.driver.launchKernel
        self.pdl = pdl and pdl_available()

    def args(self) -> tuple[int, ...]:
        """The argument slots as unsigned 64-bit values (tests)."""
        return tuple(ctypes.c_uint64.from_buffer(self._buf, o).value for o in self._offsets[:len(self._params)])

    def __call__(self, stream: int, *pointers: int, plain: bool = False) -> None:
        """Launch with the slots set to ``pointers`` (``plain``: not as a programmatic dependent, whatever
        the launch was set up as)."""
        with self._lock:
            for slot, p in zip(self._slots, pointers):
                slot.value = p
            for addr, pos in self._maps:
                replace_tensor_map_address(addr, pointers[pos])
            self._go(stream, plain)

    def with_args(self, stream: int, args: tuple) -> None:
        """Launch with every argument replaced by ``args`` (of the types the launch was set up with:
        :func:`launch_once`)."""
        base = ctypes.addressof(self._buf)
        with self._lock:
            for o, v in zip(self._offsets, args):
                raw = v.tobytes()
                ctypes.memmove(base + o, raw, len(raw))
            self._go(stream)

    def _go(self, stream: int, plain: bool = False) -> None:  # (the caller holds the lock)
        # (where a launch may be a programmatic dependent, decided per launch: not behind another library's
        # kernels - quantcore.backend.LAUNCH_CONTEXT, the torch layer's calls -, where such a launch only adds
        # ~1 us, for that kernel never releases its dependents early)
        gx, gy, gz = self.grid
        try:
            if self.pdl and not plain and not LAUNCH_CONTEXT.after_foreign:
                launch_pdl(self._fn, self.grid, self.block, self.shared_mem, stream, self._params_ptr)
            else:
                self._launch(self._fn, gx, gy, gz, self.block, 1, 1, self.shared_mem, stream, self._params_ptr, 0)
        except Exception as exc:  # noqa: BLE001 - the same report as Launcher's
            raise KernelError(f"launch of {self.expr} (grid {self.grid}, block {self.block}, shared "
                              f"{self.shared_mem} B) failed: {type(exc).__name__}: {exc}") from exc


#: launch_once's planned launches: (device, file, kernel, grid, block, shared memory, pdl, argument types)
_ONCE: dict[tuple, PlannedLaunch] = {}
_ONCE_MAX = 512


def launch_once(device: int, filename: str, expr: str, grid: tuple[int, ...], block: int, args: tuple,
                shared_mem: int, pdl: bool, stream: int, function: Any = None) -> None:
    """One launch through a planned launch (a programmatic dependent one, or one with a by-value
    struct, which CuPy's launch cannot pass), set up once per kernel, geometry and argument types and
    then given each call's arguments (:meth:`PlannedLaunch.with_args`): an unplanned call's launch
    costs what a planned one does, not a new plan's set-up (kernel lookup, buffers: ~300 us a grouped
    decode gemv in session 26)."""
    key = (device, filename, expr, None if function is None else int(function.ptr), tuple(grid), block, shared_mem,
           pdl, tuple(v.dtype.str for v in args))
    plan = _ONCE.get(key)
    if plan is None:
        if len(_ONCE) >= _ONCE_MAX:  # (a bound on the geometries kept: the oldest go)
            for k in list(_ONCE)[:_ONCE_MAX // 4]:
                del _ONCE[k]
        plan = _ONCE[key] = PlannedLaunch(device, filename, expr, grid, block, args, shared_mem, pdl=pdl,
                                          function=function)
        plan(stream)
        return
    plan.with_args(stream, args)


# -- TMA tensor maps (sm_90) -----------------------------------------------------------------------
# Encoded on the host by the driver (cuTensorMapEncodeTiled) and passed to a kernel by value; a planned
# launch re-points a map at each call's array with cuTensorMapReplaceAddress.
_TMAP_ELEM = {"u8": 0, "u16": 1}  # CU_TENSOR_MAP_DATA_TYPE_UINT8 / UINT16
_TMAP_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}
_tmap_driver: list = []


def _tmap_functions() -> tuple:
    if not _tmap_driver:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            enc, rep = lib.cuTensorMapEncodeTiled, lib.cuTensorMapReplaceAddress
        except (OSError, AttributeError) as exc:
            raise KernelError(f"TMA tensor maps need a driver with cuTensorMapEncodeTiled: {exc}") from exc
        enc.restype = rep.restype = ctypes.c_int
        enc.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                        ctypes.c_int]
        rep.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _tmap_driver[:] = [enc, rep]
    return tuple(_tmap_driver)


def tensor_map_2d(address: int, elem: str, inner: int, outer: int, row_bytes: int, box: tuple[int, int],
                  swizzle: int) -> bytes:
    """A CUtensorMap (128 bytes) of the row-major 2-D array at ``address``: ``outer`` rows of ``inner``
    ``elem`` ("u8" / "u16") elements, ``row_bytes`` apart; boxes of box[0] x box[1] elements, the
    shared-memory swizzle of ``swizzle`` bytes (0, 32, 64, 128); L2 promotion 256 bytes; elements
    outside the array read as zeros."""
    enc, _ = _tmap_functions()
    buf = (ctypes.c_uint8 * 192)()
    addr = (ctypes.addressof(buf) + 63) & ~63
    dims = (ctypes.c_uint64 * 2)(inner, outer)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    boxd = (ctypes.c_uint32 * 2)(*box)
    one = (ctypes.c_uint32 * 2)(1, 1)
    res = enc(addr, _TMAP_ELEM[elem], 2, address, dims, strides, boxd, one, 0, _TMAP_SWIZZLE[swizzle], 3, 0)
    if res != 0:
        raise KernelError(f"cuTensorMapEncodeTiled failed with CUresult {res} (address {address:#x}, "
                          f"{outer} x {inner} {elem}, row {row_bytes} B, box {box}, swizzle {swizzle})")
    return bytes((ctypes.c_uint8 * 128).from_address(addr))


def replace_tensor_map_address(map_address: int, address: int) -> None:
    """Point the CUtensorMap at ``map_address`` (64-byte aligned, host memory) at ``address``."""
    res = _tmap_functions()[1](map_address, address)
    if res != 0:
        raise KernelError(f"cuTensorMapReplaceAddress failed with CUresult {res} (address {address:#x})")


# -- programmatic dependent launch (sm_90) ----------------------------------------------------------
# A kernel launched with the programmatic-stream-serialization attribute may start while the
# previous kernel in the stream drains; it must execute ``griddepcontrol.wait`` before it reads
# any of its arguments (kernels_cuda/bnb_gemv.cu waits after building its decode table). Captured
# in a CUDA graph, the attribute becomes a programmatic edge. Launched through the driver's
# cuLaunchKernelEx (CuPy exposes no launch attributes).
class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("nattrs", ctypes.c_uint)]


_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_pdl: list = []  # [cuLaunchKernelEx or None, the attribute]


def pdl_available() -> bool:
    """Can kernels be launched as programmatic dependents here (a driver with cuLaunchKernelEx)?
    ``QUANTCORE_CUDA_TUNE=pdl=0`` turns it off (timing comparisons). Whether one launch is one is
    decided when it is made (:meth:`PlannedLaunch._go`)."""
    if not _pdl:
        fn = None
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        except (OSError, AttributeError):
            fn = None
        attr = _LaunchAttr()
        attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value = (1).to_bytes(4, "little") + bytes(60)
        _pdl[:] = [fn, attr]
    return _pdl[0] is not None and tune("pdl", 1) == 1


def launch_pdl(fn: int, grid: tuple[int, int, int], block: int, shared_mem: int, stream: int, params: int) -> None:
    """cuLaunchKernelEx of ``fn`` with the programmatic-stream-serialization attribute."""
    cfg = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, shared_mem, stream,
                        ctypes.pointer(_pdl[1]), 1)
    res = _pdl[0](ctypes.byref(cfg), fn, params, None)
    if res != 0:
        raise KernelError(f"cuLaunchKernelEx failed with CUresult {res}")
