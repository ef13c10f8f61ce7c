"""Toolchain detection and the build of ``kernels_maca/*.maca`` into ``libqc_maca.so``.

Two modes, chosen by what the machine has (never by torch, whose MetaX build also calls its
device "cuda"):

- ``mxcc``: the MetaX SDK is present (``$MACA_PATH``, default ``/opt/maca``, holding
  ``mxgpu_llvm/bin/mxcc``). Each source compiles with
  ``mxcc -x maca -O3 -std=c++17 -fPIC -c``; the objects link into a shared object with
  ``-lmcruntime``.
- ``nvcc-compat``: no MetaX SDK, but nvcc and an NVIDIA GPU. The same sources compile with nvcc,
  with ``kernels_maca/compat`` first on the include path so that ``<mc_runtime.h>``,
  ``<maca_fp16.h>`` and ``<maca_bfloat16.h>`` resolve to the CUDA mappings there.

The command lines come from pure functions (a unit test pins them). The library is cached under
``<cache root>/maca/<key>/`` (``$QUANTCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/quantcore``, else
``~/.cache/quantcore``: :mod:`quantcore.cache`), keyed by a hash of the sources, the generated
constants header, the compiler's version, the mode and the target; it is written atomically
(built in a private folder, then renamed into place) with a sidecar checksum that is checked
before the library is loaded (a mismatch builds it afresh).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from quantcore import cache
from quantcore.errors import KernelError
from quantcore.formats import kernel_defines

LIBRARY_NAME = "libqc_maca.so"
MODE_MXCC = "mxcc"
MODE_NVCC_COMPAT = "nvcc-compat"
DEFAULT_MACA_PATH = "/opt/maca"


# -- where things are ----------------------------------------------------------------------------
def kernel_dir() -> Path:
    """Folder of the MACA sources (works installed and from the source tree)."""
    return Path(str(resources.files("quantcore.kernels_maca")))


def compat_dir() -> Path:
    """Folder of the CUDA compatibility headers (mappings only)."""
    return kernel_dir() / "compat"


def sources() -> list[Path]:
    """Every ``*.maca`` source, sorted by name."""
    return sorted(kernel_dir().glob("*.maca"))


def cache_root() -> Path:
    """The library cache's folder, ``<cache root>/maca``: ``$QUANTCORE_CACHE_DIR/maca``, else
    ``$XDG_CACHE_HOME/quantcore/maca``, else ``~/.cache/quantcore/maca``
    (:func:`quantcore.cache.cache_root`; nothing is created)."""
    return cache.cache_root() / "maca"


def mxcc_path(maca_path: str) -> str:
    return os.path.join(maca_path, "mxgpu_llvm", "bin", "mxcc")


def find_maca_path() -> str | None:
    """The MetaX SDK folder: ``$MACA_PATH`` (else /opt/maca) if it holds mxcc, else the SDK of
    an ``mxcc`` found on PATH; None without one."""
    candidate = os.environ.get("MACA_PATH") or DEFAULT_MACA_PATH
    if os.path.isfile(mxcc_path(candidate)):
        return candidate
    found = shutil.which("mxcc")
    if found:  # <sdk>/mxgpu_llvm/bin/mxcc
        return str(Path(found).resolve().parents[2])
    return None


def metax_driver_present() -> bool:
    """mx-smi (MetaX's management tool) on PATH: a MetaX driver without the SDK, perhaps."""
    return shutil.which("mx-smi") is not None


def find_nvcc() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.path.isfile(default) else None


# -- devices, through the vendors' driver libraries (no Python package is imported) -------------
@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str  #: "sm_90" for an NVIDIA GPU; "" for a MetaX one


def nvidia_gpus() -> list[Gpu]:
    """NVIDIA GPUs the driver (libcuda) reports; [] without a driver or a GPU."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return []
    count = ctypes.c_int(0)
    if cu.cuInit(0) != 0 or cu.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    gpus = []
    for i in range(count.value):
        dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
        name = ctypes.create_string_buffer(256)
        if cu.cuDeviceGet(ctypes.byref(dev), i) != 0:
            continue
        cu.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # COMPUTE_CAPABILITY_MAJOR
        cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # COMPUTE_CAPABILITY_MINOR
        cu.cuDeviceGetName(name, 256, dev)
        gpus.append(Gpu(name.value.decode(errors="replace"), f"sm_{major.value}{minor.value}"))
    return gpus


def metax_gpu_count(maca_path: str) -> int:
    """MetaX devices the MACA runtime reports (mcGetDeviceCount); 0 when it cannot tell."""
    try:
        mc = ctypes.CDLL(os.path.join(maca_path, "lib", "libmcruntime.so"))
    except OSError:
        return 0
    count = ctypes.c_int(0)
    return count.value if mc.mcGetDeviceCount(ctypes.byref(count)) == 0 else 0


# -- command lines (pure) -------------------------------------------------------------------------
def mxcc_compile_command(maca_path: str, source: str, obj: str, include_dirs: list[str]) -> list[str]:
    """``mxcc -x maca -O3 -std=c++17 -fPIC -I... -c source -o obj`` (MetaX's public build scripts)."""
    return [mxcc_path(maca_path), "-x", "maca", "-O3", "-std=c++17", "-fPIC",
            *[f"-I{d}" for d in include_dirs], "-c", source, "-o", obj]


def mxcc_link_command(maca_path: str, objects: list[str], output: str) -> list[str]:
    """Link the objects into a shared object against the MACA runtime (``-lmcruntime``)."""
    lib = os.path.join(maca_path, "lib")
    llvm_lib = os.path.join(maca_path, "mxgpu_llvm", "lib")
    return [mxcc_path(maca_path), "-shared", "-fPIC", *objects, f"-L{lib}", "-lmcruntime",
            f"-Wl,-rpath,{lib}:{llvm_lib}", "-o", output]


def runtime_library_path(maca_path: str) -> str:
    """What ``LD_LIBRARY_PATH`` must hold to run MACA programs ."""
    return f"{maca_path}/lib:{maca_path}/mxgpu_llvm/lib"


def _nvcc_targets(archs: list[str]) -> list[str]:
    if len(archs) == 1:
        return [f"-arch={archs[0]}"]
    return [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]


def nvcc_compile_command(nvcc: str, archs: list[str], source: str, obj: str,
                         include_dirs: list[str]) -> list[str]:
    """nvcc in compatibility mode: the MACA source compiled as CUDA, with the compat headers
    (``<mc_runtime.h>`` ... mapped onto CUDA) first on the include path. No ``-fmad=false``: the
    kernels spell their two-rounding expressions with ``__fmul_rn`` / ``__fadd_rn``."""
    return [nvcc, "-x", "cu", "-std=c++17", "-O3", "-Xcompiler", "-fPIC", *_nvcc_targets(archs),
            f"-I{compat_dir()}", *[f"-I{d}" for d in include_dirs], "-c", source, "-o", obj]


def nvcc_link_command(nvcc: str, archs: list[str], objects: list[str], output: str) -> list[str]:
    return [nvcc, "-shared", *_nvcc_targets(archs), *objects, "-o", output]


@dataclass(frozen=True)
class Toolchain:
    """What builds the library: the mode, the compiler, and the SDK folder or the GPU targets."""

    mode: str  #: MODE_MXCC or MODE_NVCC_COMPAT
    compiler: str
    maca_path: str | None = None  #: mxcc mode
    archs: tuple[str, ...] = ()  #: nvcc-compat mode, e.g. ("sm_90",)

    def compile_command(self, source: str, obj: str, include_dirs: list[str]) -> list[str]:
        if self.mode == MODE_MXCC:
            return mxcc_compile_command(self.maca_path, source, obj, include_dirs)
        return nvcc_compile_command(self.compiler, list(self.archs), source, obj, include_dirs)

    def link_command(self, objects: list[str], output: str) -> list[str]:
        if self.mode == MODE_MXCC:
            return mxcc_link_command(self.maca_path, objects, output)
        return nvcc_link_command(self.compiler, list(self.archs), objects, output)


# -- build ---------------------------------------------------------------------------------------
def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise KernelError(f"maca: could not run {cmd[0]} to {what}: {exc}") from exc
    if proc.returncode != 0:
        raise KernelError(f"maca: {what} failed (exit {proc.returncode})\n$ {' '.join(cmd)}\n"
                          f"{proc.stdout}{proc.stderr}")


def compile_sources(toolchain: Toolchain, out_dir: Path, srcs: list[Path] | None = None) -> list[str]:
    """Compile every source (in parallel) into ``out_dir`` against a freshly written constants
    header; returns the object paths. Raises KernelError with the compiler log on failure."""
    srcs = sources() if srcs is None else srcs
    kernel_defines.write_header(out_dir)
    includes = [str(kernel_dir()), str(out_dir)]
    objects = [str(out_dir / (s.stem + ".o")) for s in srcs]
    cmds = [toolchain.compile_command(str(s), o, includes) for s, o in zip(srcs, objects)]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for f in [pool.submit(_run, c, f"compile {s.name}") for c, s in zip(cmds, srcs)]:
            f.result()
    return objects


def cache_key(toolchain: Toolchain) -> str:
    parts: list[str | bytes] = [repr(toolchain), cache.tool_version(toolchain.compiler, missing_ok=True),
                                kernel_defines.constants_header()]
    files = sources() + sorted(kernel_dir().glob("*.h")) + sorted(compat_dir().glob("*.h"))
    for f in files:
        parts += [f.name, f.read_bytes()]
    parts += [repr(toolchain.compile_command("SRC", "OBJ", ["INC"])),
              repr(toolchain.link_command(["OBJ"], "LIB"))]
    return cache.digest(*parts, length=24)


def build_library(toolchain: Toolchain) -> Path:
    """Path of the cached ``libqc_maca.so`` for this toolchain, building it first if needed.

    A cached library is used only when its sidecar checksum (``libqc_maca.so.sha256``, written
    after the library) matches the file; otherwise it is built afresh. The cache folders must be
    private (:func:`quantcore.cache.private_dir`: BackendUnavailableError otherwise)."""
    def build(tmp_dir: Path) -> Path:
        objects = compile_sources(toolchain, tmp_dir)
        lib = tmp_dir / LIBRARY_NAME
        _run(toolchain.link_command(objects, str(lib)), "link libqc_maca.so")
        return lib  # installed atomically: readers see the whole library or none

    return cache.cached_file(cache.private_dir("maca", cache_key(toolchain)), LIBRARY_NAME, build)
