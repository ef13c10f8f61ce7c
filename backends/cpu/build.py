"""Build, cache and load the host kernels of the ``cpu`` backend (``kernels_cpu/qc_cpu.cpp``).

At first use the system C++ compiler builds one shared library (C++17, ``-O3 -fopenmp``, tuned for
the build machine's CPU) against ``quantcore_constants.h``, which
:mod:`quantcore.formats.kernel_defines` generates from the core's format constants. The library is
cached through :mod:`quantcore.cache` (folder ``cpu`` of the cache root) under a name that digests
everything it depends on: the source, the generated header, the compiler's path and ``--version``,
the flags, and the CPU (architecture, model and feature flags), so a cache shared by machines with
different CPUs or compilers never hands one a library built for another. Loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
import threading
from importlib import resources
from pathlib import Path

from quantcore import cache
from quantcore.errors import KernelError
from quantcore.formats import kernel_defines, kernel_interface

#: The compiler to use (a name on PATH or a path); default: $CXX, else c++, g++, clang++.
ENV_CXX = "QUANTCORE_CPU_CXX"
KERNEL_PACKAGE = "quantcore.kernels_cpu"
KERNEL_SOURCE = "qc_cpu.cpp"
#: Flags of every build. -ffp-contract=off: the bit-exact ops round each product and sum as the
#: reference does (no FMA contraction); no -ffast-math (NaN rules, IEEE division).
BASE_FLAGS = ("-std=c++17", "-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")

_lock = threading.RLock()


def compiler() -> str:
    """Path of the C++ compiler ($QUANTCORE_CPU_CXX, else $CXX, c++, g++, clang++)."""
    return cache.host_compiler(ENV_CXX, "the cpu backend builds its kernels at first use")


def compiler_version(cxx: str) -> str:
    return cache.tool_version(cxx)


def arch_flags() -> tuple[str, ...]:
    """Tune for the build machine's CPU: -march=native on x86, -mcpu=native on ARM, else none."""
    m = platform.machine().lower()
    if m in ("x86_64", "amd64", "i686", "i386"):
        return ("-march=native",)
    if m.startswith(("aarch64", "arm64", "arm")):
        return ("-mcpu=native",)
    return ()


def cpu_identity() -> str:
    """What ``-march=native`` depends on: the architecture, the CPU model and its feature flags
    (from /proc/cpuinfo where there is one, sorted and deduplicated)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu part", "cpu implementer") and not model:
                    model = value.strip()
                elif key in ("flags", "features"):
                    flags.update(value.split())
    except OSError:
        model = platform.processor()
    return f"{platform.machine()}|{model}|{' '.join(sorted(flags))}"


def source_text() -> str:
    return resources.files(KERNEL_PACKAGE).joinpath(KERNEL_SOURCE).read_text()


def build_flags() -> tuple[str, ...]:
    return BASE_FLAGS + arch_flags()


def artifact_key(cxx: str, version: str) -> str:
    return cache.digest(source_text(), kernel_defines.constants_header(), cxx, version,
                        *build_flags(), cpu_identity(), length=24)


def build(force: bool = False) -> Path:
    """Path of the kernel library, built now unless a verified cached build matches its inputs.

    Raises BackendUnavailableError (no compiler, cache folder not private) or KernelError (the
    build failed, with the compiler's log)."""
    with _lock:
        cxx = compiler()
        version = compiler_version(cxx)
        flags = build_flags()

        def compile_into(tmpdir: Path) -> Path:
            kernel_defines.write_header(tmpdir)
            src = tmpdir / KERNEL_SOURCE
            src.write_text(source_text())
            out = tmpdir / "qc_cpu.so"
            cmd = [cxx, *flags, f"-I{tmpdir}", str(src), "-o", str(out)]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.SubprocessError) as exc:
                raise KernelError(f"building the cpu kernels failed: {exc}") from exc
            if res.returncode != 0:
                raise KernelError(f"building the cpu kernels failed:\n$ {' '.join(cmd)}\n"
                                  f"{res.stdout}{res.stderr}")
            return out

        return cache.cached_file(cache.private_dir("cpu"), f"qc_cpu-{artifact_key(cxx, version)}.so", compile_into,
                                 force=force)


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    # every symbol's result and argument types, from the one declaration of the kernel interface
    for name, (res, args) in kernel_interface.ctypes_signatures(kernel_interface.CPU).items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib
