"""The on-disk cache of compiled artifacts (the sycl shim, the maca library, the cuda cubins).

One set of rules for every backend that caches what it compiles:

- **Where**: :func:`cache_root` is ``$QUANTCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/quantcore``,
  else ``~/.cache/quantcore``; each backend keeps a subfolder (``sycl``, ``maca``, ``cuda``,
  ``cuda-mx``).
- **Whose**: :func:`private_dir` creates missing folders with mode 0o700 and refuses (with a
  :class:`~quantcore.errors.BackendUnavailableError` naming the folder and the fix) a cache root or
  subfolder that is writable by its group or by others, or owned by another user: anyone who can
  write there could plant a library that quantcore would load and run (POSIX only).
- **What**: an artifact's file name carries :func:`digest` of everything it is built from (sources,
  flags, compiler version ...), so any change builds afresh under a new name.
- **Written whole**: :func:`write_artifact` / :func:`install_artifact` put the artifact in place
  atomically (a temporary file in the same folder, then ``os.replace``) and *then* write a sidecar
  ``<name>.sha256`` holding the artifact's own sha256, the same way.
- **Checked before use**: :func:`verified` / :func:`read_verified` return the artifact only when its
  sidecar matches the file's sha256; a missing, truncated, tampered or half-written artifact (or
  sidecar) gives None, and the caller builds afresh.

The compiled backends go through two helpers that put these rules together: :func:`cached_file`
(a library a compiler writes to disk: the cpu kernels, the sycl shim, the maca library) and
:func:`cached_bytes` (artifacts a compiler returns in memory: the cuda cubins). The host C++
compiler they build with is found by :func:`host_compiler`, and :func:`tool_version` gives the
version text that goes into an artifact's digest.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from quantcore.errors import BackendUnavailableError

#: Environment variable naming the cache root.
ENV_CACHE = "QUANTCORE_CACHE_DIR"
#: Suffix of the checksum file written beside each artifact.
SIDECAR_SUFFIX = ".sha256"
#: Mode of the folders the cache creates.
DIR_MODE = 0o700

_CHUNK = 1 << 20


# -- where ------------------------------------------------------------------------------------------
def cache_root() -> Path:
    """``$QUANTCORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/quantcore``, else ``~/.cache/quantcore``
    (absolute; nothing is created)."""
    base = os.environ.get(ENV_CACHE)
    if base:
        root = Path(os.path.expanduser(base))
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = Path(xdg) / "quantcore"
    return Path(os.path.abspath(root))


def _fix_hint(folder: Path) -> str:
    return (f"fix it with `chmod 700 {folder}` (a folder of your own), or set {ENV_CACHE} to a private "
            "folder (quantcore creates it with mode 0o700)")


def check_private_dir(folder: str | os.PathLike) -> Path:
    """``folder`` if it is a directory that only the current user can write to.

    Raises BackendUnavailableError naming the folder and the fix when it is not a directory, is
    owned by another user, or is writable by its group or by others. Symbolic links are followed
    (what is checked is the folder the files would land in). The ownership and mode checks apply
    on POSIX only."""
    folder = Path(folder)
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise BackendUnavailableError(
            f"the quantcore cache folder {folder} cannot be read ({exc}); set {ENV_CACHE} to a private "
            "folder of your own") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise BackendUnavailableError(
            f"the quantcore cache folder {folder} is not a directory; remove it or set {ENV_CACHE} "
            "to a private folder of your own")
    geteuid = getattr(os, "geteuid", None)
    if geteuid is None:  # pragma: no cover - not POSIX: no owner / mode bits to check
        return folder
    uid = geteuid()
    if st.st_uid != uid:
        raise BackendUnavailableError(
            f"the quantcore cache folder {folder} is owned by another user (uid {st.st_uid}, you are "
            f"uid {uid}); quantcore will not load compiled kernels from it: set {ENV_CACHE} to a "
            "private folder of your own (quantcore creates it with mode 0o700)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH))
                           if st.st_mode & bit)
        raise BackendUnavailableError(
            f"the quantcore cache folder {folder} is writable by {who} (mode "
            f"{oct(stat.S_IMODE(st.st_mode))}); quantcore will not load compiled kernels from it: "
            + _fix_hint(folder))
    return folder


def _make_dir(folder: Path) -> None:
    """Create ``folder`` (and missing parents) with mode 0o700 each, whatever the umask."""
    missing = []
    p = folder
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            continue  # another process made it: checked like any existing folder
        except OSError as exc:
            raise BackendUnavailableError(
                f"the quantcore cache folder {p} cannot be created ({exc}); set {ENV_CACHE} to a "
                "writable private folder") from exc
        os.chmod(p, DIR_MODE)


def private_dir(*parts: str) -> Path:
    """``cache_root() / parts...``, created (mode 0o700) where missing; the root and every
    subfolder down to it checked with :func:`check_private_dir`."""
    root = cache_root()
    folder = root.joinpath(*parts)
    _make_dir(folder)
    check_private_dir(root)
    p = root
    for part in parts:
        p = p / part
        check_private_dir(p)
    return folder


# -- what -------------------------------------------------------------------------------------------
def digest(*parts: str | bytes, length: int = 32) -> str:
    """Hex sha256 of ``parts`` (sources, flags, compiler versions ...), the first ``length`` digits,
    for an artifact's file name. Each part is length-prefixed, so ("ab", "c") and ("a", "bc")
    differ."""
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:length]


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sidecar(path: str | os.PathLike) -> Path:
    """The checksum file of the artifact at ``path``: ``<path>.sha256``."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


# -- written whole ----------------------------------------------------------------------------------
def _atomic_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_sidecar(path: Path, sha: str) -> None:
    _atomic_bytes(sidecar(path), f"{sha}  {path.name}\n".encode())


def write_artifact(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, then its sidecar checksum. An interruption leaves no
    partial file under ``path`` (at worst an artifact without a matching sidecar, which
    :func:`verified` rejects)."""
    path = Path(path)
    data = bytes(data)
    _atomic_bytes(path, data)
    _write_sidecar(path, hashlib.sha256(data).hexdigest())
    return path


def install_artifact(built: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Move the file ``built`` (a compiler's output, in the same file system as ``path``, e.g.
    a temporary file in the cache folder) to ``path`` atomically, then write its sidecar."""
    path = Path(path)
    sha = file_sha256(built)
    os.replace(built, path)
    _write_sidecar(path, sha)
    return path


# -- checked before use ------------------------------------------------------------------------------
def _expected_sha(path: Path) -> str | None:
    try:
        text = sidecar(path).read_text(errors="replace")
    except OSError:
        return None
    fields = text.split()
    if not fields or len(fields[0]) != 64:
        return None
    return fields[0].lower()


def verified(path: str | os.PathLike) -> Path | None:
    """``path`` when the artifact there matches its sidecar checksum, else None (missing,
    truncated, tampered or half written: the caller builds afresh)."""
    path = Path(path)
    want = _expected_sha(path)
    if want is None:
        return None
    try:
        got = file_sha256(path)
    except OSError:
        return None
    return path if hmac.compare_digest(got, want) else None


def read_verified(path: str | os.PathLike) -> bytes | None:
    """The bytes of the artifact at ``path`` when they match its sidecar checksum, else None. The
    bytes checked are the bytes returned (no window between the check and the use)."""
    path = Path(path)
    want = _expected_sha(path)
    if want is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if hmac.compare_digest(hashlib.sha256(data).hexdigest(), want) else None


# -- the build helpers -------------------------------------------------------------------------------
def cached_file(folder: str | os.PathLike, name: str, build: Callable[[Path], Path], *,
                force: bool = False) -> Path:
    """``folder / name`` when it matches its sidecar checksum; else ``build(tmp)`` makes it.

    ``build`` gets a fresh temporary folder inside ``folder`` (same file system, removed afterwards)
    and returns the path of the file it built there; that file is moved into place atomically with
    its sidecar (:func:`install_artifact`), so two processes building at once both end with a
    whole artifact. ``folder`` is used as given (make it with :func:`private_dir`); ``force``
    builds even over a valid artifact."""
    folder = Path(folder)
    target = folder / name
    if not force and verified(target) is not None:
        return target
    with tempfile.TemporaryDirectory(prefix=f"{name}.build-", dir=folder) as tmp:
        install_artifact(build(Path(tmp)), target)
    return target


def cached_bytes(folder: str | os.PathLike | None, names: Sequence[str],
                 build: Callable[[], Sequence[bytes]]) -> tuple[bytes, ...]:
    """The artifacts ``folder / name`` for every name, when each matches its sidecar checksum and
    none is empty; else ``build()`` gives their bytes (in the order of ``names``), which are
    written with :func:`write_artifact` and returned. ``folder`` None: no cache (build only). A
    write that fails (a read-only cache) leaves the build's result usable: it is still returned."""
    if folder is None:
        return tuple(build())
    folder = Path(folder)
    found = tuple(read_verified(folder / n) for n in names)
    if all(found):
        return found  # type: ignore[return-value]
    built = tuple(bytes(b) for b in build())
    if len(built) != len(names):
        raise ValueError(f"build() gave {len(built)} artifacts for {len(names)} names")
    try:
        for n, data in zip(names, built):
            write_artifact(folder / n, data)
    except OSError:
        pass
    return built


# -- the tools that build the artifacts ----------------------------------------------------------------
#: The host C++ compilers tried, in order, after ``$CXX``.
HOST_CXX = ("c++", "g++", "clang++")


def host_compiler(override_env: str | None = None, purpose: str = "") -> str:
    """Path of the host C++ compiler: ``$override_env`` alone when it is set (the backend's own
    choice), else ``$CXX``, then :data:`HOST_CXX` on PATH. BackendUnavailableError names what was
    tried, ``purpose`` (why the backend needs one) and how to get one."""
    want = os.environ.get(override_env) if override_env else None
    cands = [want] if want else [os.environ.get("CXX"), *HOST_CXX]
    for cand in cands:
        found = shutil.which(cand) if cand else None
        if found:
            return found
    tried = f"${override_env}={want}" if want else "$CXX, " + ", ".join(HOST_CXX)
    why = f"; {purpose}" if purpose else ""
    raise BackendUnavailableError(f"no C++ compiler found (tried {tried}){why}: install one (e.g. apt-get install g++)")


def tool_version(exe: str, missing_ok: bool = False) -> str:
    """``exe --version``'s output (part of an artifact's digest); BackendUnavailableError when the
    tool does not run ("" instead with ``missing_ok``: the build that follows reports it)."""
    try:
        res = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        if missing_ok:
            return ""
        raise BackendUnavailableError(f"the compiler {exe} does not run ({exc})") from exc
    if res.returncode != 0:
        if missing_ok:
            return ""
        raise BackendUnavailableError(f"`{exe} --version` failed: {res.stderr.strip()}")
    return res.stdout.strip()
