"""The compiled-artifact caches (quantcore.cache and its users: the sycl shim, the maca library, the
cuda cubins): a content hash in the name, a sidecar checksum checked before loading (a tampered,
truncated or half-written artifact is built afresh), private folders only.

Everything here runs on a CPU: the sycl tests build the real shim (skipped without the sycl extra);
the maca and cuda tests replace the compiler with a fake one and check the cache logic around it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from quantcore import cache
from quantcore.errors import BackendUnavailableError, QuantcoreError
from quantcore.registry import availability

REPO = Path(__file__).resolve().parents[1]
POSIX = hasattr(os, "geteuid")
needs_posix = pytest.mark.skipif(not POSIX, reason="owner and mode bits are POSIX")


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A fresh private cache root (QUANTCORE_CACHE_DIR) that does not exist yet."""
    r = tmp_path / "qc-cache"
    monkeypatch.setenv(cache.ENV_CACHE, str(r))
    return r


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


# -- the helper -----------------------------------------------------------------------------------------
def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"
    monkeypatch.delenv(cache.ENV_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "quantcore"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_root() == tmp_path / "home" / ".cache" / "quantcore"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(cache.ENV_CACHE, "relative")
    assert cache.cache_root() == tmp_path / "relative"  # absolute, resolved once


def test_digest_changes_with_every_part():
    base = cache.digest("source", "-O2", "g++ 13.2", length=32)
    assert len(base) == 32 and base == cache.digest("source", "-O2", "g++ 13.2")
    assert base == cache.digest(b"source", b"-O2", b"g++ 13.2")  # str and bytes alike
    others = {cache.digest("source2", "-O2", "g++ 13.2"), cache.digest("source", "-O3", "g++ 13.2"),
              cache.digest("source", "-O2", "g++ 13.3"), cache.digest("source", "-O2"),
              cache.digest("sourc", "e-O2", "g++ 13.2"), cache.digest("source", "-O2", "g++ 13.2", "")}
    assert base not in others and len(others) == 6
    assert len(cache.digest("x", length=20)) == 20


def test_written_artifact_verifies_and_reads_back(root):
    folder = cache.private_dir("t")
    path = cache.write_artifact(folder / "a.bin", b"\x7fELF payload")
    assert cache.verified(path) == path
    assert cache.read_verified(path) == b"\x7fELF payload"
    side = cache.sidecar(path)
    assert side.name == "a.bin.sha256"
    assert side.read_text().split()[0] == hashlib.sha256(b"\x7fELF payload").hexdigest()
    assert sorted(p.name for p in folder.iterdir()) == ["a.bin", "a.bin.sha256"]  # no temporaries


@pytest.mark.parametrize("damage", ["append", "flip", "truncate", "empty", "no sidecar", "bad sidecar",
                                    "swapped", "missing"])
def test_damaged_artifact_is_not_returned(root, damage):
    folder = cache.private_dir("t")
    path = cache.write_artifact(folder / "a.so", bytes(range(256)) * 4)
    if damage == "append":
        path.write_bytes(path.read_bytes() + b"\0")
    elif damage == "flip":
        data = bytearray(path.read_bytes())
        data[100] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:500])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "no sidecar":
        cache.sidecar(path).unlink()
    elif damage == "bad sidecar":
        cache.sidecar(path).write_text("not a checksum\n")
    elif damage == "swapped":  # another valid artifact's sidecar
        other = cache.write_artifact(folder / "b.so", b"other")
        shutil.copy(cache.sidecar(other), cache.sidecar(path))
    else:
        path.unlink()
    assert cache.verified(path) is None
    assert cache.read_verified(path) is None


class _Interrupt(BaseException):
    """Stands for the process being killed (not an Exception: nothing may swallow it)."""


def test_interrupted_write_leaves_no_partial_artifact(root, monkeypatch):
    folder = cache.private_dir("t")
    final = folder / "lib.so"
    real_fdopen = os.fdopen

    def dying_fdopen(fd, *args, **kwargs):
        f = real_fdopen(fd, *args, **kwargs)

        class Half:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def write(self, data):
                f.write(data[: len(data) // 2])
                f.flush()
                raise _Interrupt

        return Half()

    monkeypatch.setattr(cache.os, "fdopen", dying_fdopen)
    with pytest.raises(_Interrupt):
        cache.write_artifact(final, b"x" * 10000)
    monkeypatch.undo()
    assert not final.exists() and not cache.sidecar(final).exists()
    assert list(folder.iterdir()) == []  # the temporary file is gone too
    assert cache.verified(final) is None


def test_interrupted_rename_keeps_the_previous_artifact(root, monkeypatch):
    folder = cache.private_dir("t")
    final = cache.write_artifact(folder / "lib.so", b"old build")

    def dying_replace(src, dst):
        raise _Interrupt

    monkeypatch.setattr(cache.os, "replace", dying_replace)
    with pytest.raises(_Interrupt):
        cache.write_artifact(final, b"new build")
    monkeypatch.undo()
    assert cache.read_verified(final) == b"old build"
    assert sorted(p.name for p in folder.iterdir()) == ["lib.so", "lib.so.sha256"]


def test_artifact_written_without_its_sidecar_is_rejected(root, monkeypatch):
    """Killed between the artifact and its sidecar: the new artifact does not match the old
    sidecar (or there is none), so it is built afresh, never trusted."""
    folder = cache.private_dir("t")
    fresh = folder / "fresh.so"
    old = cache.write_artifact(folder / "old.so", b"old build")

    def dying_sidecar(path, sha):
        raise _Interrupt

    monkeypatch.setattr(cache, "_write_sidecar", dying_sidecar)
    for path in (fresh, old):
        with pytest.raises(_Interrupt):
            cache.write_artifact(path, b"new build")
    monkeypatch.undo()
    assert fresh.read_bytes() == b"new build" and cache.verified(fresh) is None
    assert old.read_bytes() == b"new build" and cache.verified(old) is None


def test_install_artifact_moves_a_built_file(root):
    folder = cache.private_dir("t")
    built = folder / "out.tmp"
    built.write_bytes(b"linker output")
    final = cache.install_artifact(built, folder / "lib.so")
    assert not built.exists() and cache.read_verified(final) == b"linker output"


def test_cached_file_builds_once_and_leaves_no_temporary(root):
    folder = cache.private_dir("t")
    builds = []

    def build(tmp):
        builds.append(tmp)
        (tmp / "lib.so").write_bytes(b"build #%d" % len(builds))
        return tmp / "lib.so"

    path = cache.cached_file(folder, "lib.so", build)
    assert cache.cached_file(folder, "lib.so", build) == path and len(builds) == 1
    assert builds[0].parent == folder and not builds[0].exists()  # built beside it, then removed
    path.write_bytes(b"tampered")
    assert cache.read_verified(cache.cached_file(folder, "lib.so", build)) == b"build #2"
    assert cache.read_verified(cache.cached_file(folder, "lib.so", build, force=True)) == b"build #3"

    def broken(tmp):
        (tmp / "half.so").write_bytes(b"half")
        raise RuntimeError("compiler failed")

    with pytest.raises(RuntimeError, match="compiler failed"):
        cache.cached_file(folder, "other.so", broken)
    assert sorted(p.name for p in folder.iterdir()) == ["lib.so", "lib.so.sha256"]


def test_cached_bytes_reads_all_or_builds_all(root, monkeypatch):
    folder = cache.private_dir("t")
    builds = []

    def build():
        builds.append(1)
        return b"cubin %d" % len(builds), b"name %d" % len(builds)

    assert cache.cached_bytes(folder, ("k.cubin", "k.name"), build) == (b"cubin 1", b"name 1")
    assert cache.cached_bytes(folder, ("k.cubin", "k.name"), build) == (b"cubin 1", b"name 1")
    (folder / "k.name").write_bytes(b"other")  # one damaged artifact: both are built again
    assert cache.cached_bytes(folder, ("k.cubin", "k.name"), build) == (b"cubin 2", b"name 2")
    assert cache.cached_bytes(None, ("k.cubin", "k.name"), build) == (b"cubin 3", b"name 3")

    def unwritable(path, data):
        raise OSError("read-only file system")

    monkeypatch.setattr(cache, "write_artifact", unwritable)
    assert cache.cached_bytes(folder, ("j.cubin", "j.name"), build) == (b"cubin 4", b"name 4")
    with pytest.raises(ValueError, match="2 artifacts for 1 names"):
        cache.cached_bytes(folder, ("x",), build)


@needs_posix
def test_private_dir_creates_owner_only_folders(root):
    old = os.umask(0)  # even with a permissive umask
    try:
        folder = cache.private_dir("sycl", "sub")
    finally:
        os.umask(old)
    assert folder == root / "sycl" / "sub"
    for p in (root, root / "sycl", folder):
        assert _mode(p) == 0o700 and os.stat(p).st_uid == os.geteuid()
    assert cache.private_dir("sycl", "sub") == folder  # existing and private: accepted


@needs_posix
@pytest.mark.parametrize("where", ["root", "sub"])
@pytest.mark.parametrize("bits,who", [(0o020, "its group"), (0o002, "others"), (0o022, "its group and others")])
def test_folder_writable_by_others_is_refused(root, where, bits, who):
    folder = cache.private_dir("sycl")
    bad = root if where == "root" else folder
    os.chmod(bad, 0o700 | bits)
    with pytest.raises(BackendUnavailableError) as exc:
        cache.private_dir("sycl")
    msg = str(exc.value)
    assert str(bad) in msg and f"writable by {who}" in msg
    assert f"chmod 700 {bad}" in msg and "QUANTCORE_CACHE_DIR" in msg
    assert isinstance(exc.value, QuantcoreError)
    with pytest.raises(BackendUnavailableError, match="writable by"):
        cache.check_private_dir(bad)
    os.chmod(bad, 0o755)  # readable by others is fine
    assert cache.private_dir("sycl") == folder


@needs_posix
@pytest.mark.skipif(not POSIX or os.geteuid() != 0, reason="chown to another user needs root")
def test_folder_owned_by_another_user_is_refused(root):
    folder = cache.private_dir("maca")
    os.chown(folder, 65534, 65534)
    with pytest.raises(BackendUnavailableError) as exc:
        cache.private_dir("maca")
    msg = str(exc.value)
    assert str(folder) in msg and "owned by another user (uid 65534" in msg and "QUANTCORE_CACHE_DIR" in msg


def test_cache_path_that_is_a_file_is_refused(root):
    root.parent.mkdir(exist_ok=True)
    root.write_text("not a folder")
    with pytest.raises(BackendUnavailableError, match=f"{root}.*QUANTCORE_CACHE_DIR"):
        cache.private_dir()
    with pytest.raises(BackendUnavailableError, match=f"{root / 'cuda'} cannot be created"):
        cache.private_dir("cuda")


# -- maca (CPU side: a fake compiler) ---------------------------------------------------------------------
@pytest.fixture
def maca_build():
    from quantcore.backends.maca import build

    return build


def test_maca_cache_folder_follows_quantcore_cache_dir(maca_build, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "mine"))
    assert maca_build.cache_root() == tmp_path / "mine" / "maca"
    monkeypatch.delenv(cache.ENV_CACHE)
    assert maca_build.cache_root() == tmp_path / "xdg" / "quantcore" / "maca"


class _FakeMacaCompiler:
    """Stands for mxcc: writes each output named by ``-o`` and counts the links."""

    def __init__(self):
        self.links = 0
        self.calls = 0

    def __call__(self, cmd, what):
        self.calls += 1
        out = Path(cmd[cmd.index("-o") + 1])
        if out.name.endswith(".so"):
            self.links += 1
            out.write_bytes(b"fake libqc_maca.so build %d" % self.links)
        else:
            out.write_bytes(b"object")


@pytest.fixture
def fake_mxcc(maca_build, root, monkeypatch):
    fake = _FakeMacaCompiler()
    monkeypatch.setattr(maca_build, "_run", fake)
    tc = maca_build.Toolchain(maca_build.MODE_MXCC, maca_build.mxcc_path("/opt/maca"), maca_path="/opt/maca")
    return fake, tc


def test_maca_library_is_cached_verified_and_rebuilt_when_tampered(maca_build, fake_mxcc, root):
    fake, tc = fake_mxcc
    lib = maca_build.build_library(tc)
    assert lib.parent.parent == root / "maca" and lib.name == maca_build.LIBRARY_NAME
    assert fake.links == 1 and cache.verified(lib) == lib
    assert maca_build.build_library(tc) == lib and fake.links == 1  # warm cache: no rebuild
    lib.write_bytes(lib.read_bytes() + b"planted")
    assert maca_build.build_library(tc) == lib and fake.links == 2  # tampered: built afresh
    assert lib.read_bytes() == b"fake libqc_maca.so build 2" and cache.verified(lib) == lib
    cache.sidecar(lib).unlink()
    assert maca_build.build_library(tc) == lib and fake.links == 3  # unverifiable: built afresh
    assert maca_build.build_library(tc) == lib and fake.links == 3
    assert sorted(p.name for p in (root / "maca").iterdir()) == [lib.parent.name]  # no build folders left


@needs_posix
def test_maca_refuses_a_shared_cache_folder_before_building(maca_build, fake_mxcc, root):
    fake, tc = fake_mxcc
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    with pytest.raises(BackendUnavailableError, match=f"{root}.*writable by its group and others"):
        maca_build.build_library(tc)
    assert fake.calls == 0


# -- cuda (CPU side: a fake NVRTC) --------------------------------------------------------------------------
class _FakeNvrtc:
    version = (13, 0)

    def __init__(self):
        self.compiles = 0
        self.programs = []

    def compile(self, source, filename, name_expr, options):
        self.compiles += 1
        self.programs.append(filename)
        return b"cubin of " + name_expr.encode() + b" #%d" % self.compiles, "_Z" + name_expr, ""


def test_cuda_cubins_are_cached_verified_and_rebuilt_when_tampered(root, monkeypatch):
    from quantcore.backends.cuda import runtime

    fake = _FakeNvrtc()
    monkeypatch.setattr(runtime, "nvrtc", lambda: fake)
    first = runtime.KernelCache()._cubin("bnb_4bit.cu", "qc::k<1>", 90)
    assert first == (b"cubin of qc::k<1> #1", "_Zqc::k<1>") and fake.compiles == 1
    # named by its full path: NVRTC resolves a quoted include next to the program before the include
    # folders, so a bare name would take a same-named header from the working directory
    assert fake.programs == [os.path.join(runtime.kernel_dir(), "bnb_4bit.cu")]
    folder = root / "cuda"
    cubins = list(folder.glob("*.cubin"))
    assert len(cubins) == 1 and cache.verified(cubins[0]) and cache.verified(cubins[0].with_suffix(".name"))
    assert runtime.KernelCache()._cubin("bnb_4bit.cu", "qc::k<1>", 90) == first and fake.compiles == 1
    cubins[0].write_bytes(b"planted")
    assert runtime.KernelCache()._cubin("bnb_4bit.cu", "qc::k<1>", 90)[0] == b"cubin of qc::k<1> #2"
    cubins[0].with_suffix(".name").write_text("_Zother")
    assert runtime.KernelCache()._cubin("bnb_4bit.cu", "qc::k<1>", 90) == (b"cubin of qc::k<1> #3", "_Zqc::k<1>")
    assert fake.compiles == 3 and not list(folder.glob("*.tmp")) and not list(folder.glob("*.build-*"))


def test_cuda_mx_cubins_are_cached_verified_and_rebuilt_when_tampered(root, monkeypatch):
    """The MX module goes through the runtime's one NVRTC path (a whole module: no name
    expression) with the runtime's include folders and options, and the same verified cache."""
    from quantcore.backends.cuda import mx, runtime

    calls = []

    class Fake(_FakeNvrtc):
        def compile(self, source, filename, name_expr, options):
            calls.append((filename, name_expr, options))
            self.compiles += 1
            return b"mx cubin #%d" % self.compiles, "", ""

    fake = Fake()
    monkeypatch.setattr(runtime, "nvrtc", lambda: fake)
    assert mx.compile_cubin("mx_quant.cu", "sm_90") == b"mx cubin #1"
    assert mx.compile_cubin("mx_quant.cu", "sm_90") == b"mx cubin #1" and fake.compiles == 1
    filename, name_expr, options = calls[0]
    assert filename == os.path.join(runtime.kernel_dir(), "mx_quant.cu") and name_expr is None
    assert set(runtime.COMPILE_OPTIONS) <= set(options) and "--gpu-architecture=sm_90" in options
    assert f"-I{runtime.header_dir()}" in options and f"-I{runtime.kernel_dir()}" in options
    (path,) = (root / "cuda-mx").glob("mx_quant-sm_90-*.cubin")
    path.write_bytes(b"mx cubin #1 truncat")
    assert mx.compile_cubin("mx_quant.cu", "sm_90") == b"mx cubin #2" and fake.compiles == 2
    assert cache.read_verified(path) == b"mx cubin #2"
    assert mx.compile_cubin("mx_quant.cu", "sm_90", use_cache=False) == b"mx cubin #3"


# -- sycl: the real shim ------------------------------------------------------------------------------------
_SYCL = availability("sycl")
needs_sycl = pytest.mark.skipif(not _SYCL, reason=f"sycl backend unavailable: {_SYCL.reason}")


@pytest.fixture(scope="module")
def sycl_runtime():
    from quantcore.backends.sycl import runtime

    return runtime


@pytest.fixture(scope="module")
def built_shim(sycl_runtime, tmp_path_factory):
    """One real build of the shim (about 4 s), copied into each test's own cache."""
    origin = tmp_path_factory.mktemp("shim-origin")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cache.ENV_CACHE, str(origin))
        path = sycl_runtime.build_shim()
    return path


@pytest.fixture
def shim_cache(sycl_runtime, built_shim, root, monkeypatch):
    """A warm shim cache in ``root`` and a counter of the shim builds from now on."""
    folder = cache.private_dir("sycl")
    for p in (built_shim, cache.sidecar(built_shim)):
        if p.exists():
            shutil.copy2(p, folder / p.name)
    builds = []
    real = getattr(sycl_runtime, "_compile_shim", None)  # (absent before the verified cache)

    def counting(cmd):
        builds.append(cmd)
        real(cmd)

    monkeypatch.setattr(sycl_runtime, "_compile_shim", counting, raising=False)
    monkeypatch.setattr(sycl_runtime, "_shim", [None])  # a fresh process's state: nothing loaded
    return folder / built_shim.name, builds


@needs_sycl
def test_sycl_shim_is_built_once_with_a_sidecar(sycl_runtime, built_shim):
    assert built_shim.name.startswith("qc_sycl_shim-") and built_shim.suffix == ".so"
    assert cache.verified(built_shim) == built_shim
    assert sorted(p.name for p in built_shim.parent.iterdir()) == [built_shim.name, built_shim.name + ".sha256"]


@needs_sycl
def test_sycl_warm_cache_loads_without_rebuilding(sycl_runtime, shim_cache):
    path, builds = shim_cache
    mtime = path.stat().st_mtime_ns
    loaded = sycl_runtime.shim()
    assert loaded.path == path and builds == [] and path.stat().st_mtime_ns == mtime
    assert loaded.lib.qc_sycl_version()


@needs_sycl
@pytest.mark.parametrize("damage", ["append", "no sidecar"])
def test_sycl_tampered_shim_is_rebuilt_not_loaded(sycl_runtime, shim_cache, damage):
    """(A truncated shim is tested in a fresh process: loading one kills the process.)"""
    path, builds = shim_cache
    good = path.read_bytes()
    if damage == "append":  # still a loadable ELF: unchecked, it would be loaded as it is
        path.write_bytes(good + b"planted")
    else:
        cache.sidecar(path).unlink()
    loaded = sycl_runtime.shim()
    assert len(builds) == 1 and loaded.path == path
    assert cache.verified(path) == path and path.read_bytes() != good + b"planted"
    assert loaded.lib.qc_sycl_version()
    # the next fresh instance finds an intact cache: no rebuild
    sycl_runtime._shim[0] = None
    assert sycl_runtime.shim().path == path and len(builds) == 1
    assert not list(path.parent.glob("*.tmp")) and not list(path.parent.glob("*.build-*"))


@needs_sycl
@pytest.mark.parametrize("damage", ["append", "truncate"])
def test_sycl_fresh_processes_rebuild_a_tampered_shim_and_then_reuse_it(sycl_runtime, shim_cache, root, damage):
    path, _ = shim_cache
    good = path.read_bytes()
    # appended bytes still load; a truncated library, loaded, dies with SIGBUS
    path.write_bytes(good + b"planted" if damage == "append" else good[: len(good) // 3])
    code = ("from quantcore.backends.sycl import runtime; s = runtime.shim(); "
            "print(s.path, s.lib.qc_sycl_version().decode())")
    env = dict(os.environ, **{cache.ENV_CACHE: str(root)})
    mtimes = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        assert res.stdout.split()[0] == str(path)
        assert cache.verified(path) == path
        mtimes.append(path.stat().st_mtime_ns)
    assert mtimes[0] == mtimes[1]  # the second process loaded the first one's build


@needs_sycl
@needs_posix
def test_sycl_refuses_a_world_writable_cache(sycl_runtime, shim_cache):
    path, builds = shim_cache
    os.chmod(path.parent, 0o777)
    with pytest.raises(BackendUnavailableError, match=f"{path.parent}.*chmod 700"):
        sycl_runtime.shim()
    assert builds == []
