"""Safe outputs: write under a temporary name beside the destination, rename into place at the end.

:func:`check_output` refuses, before any work, an output that is (or is inside, or contains) an
input, an output whose folder is missing or not writable, and an existing output without
``force``. :class:`AtomicOutput` gives the temporary path; on success it renames it to the
destination (an existing destination is moved aside first and removed only once the new one is in
place), on any exception (KeyboardInterrupt and SIGTERM included, see :func:`sigterm_raises`) it
removes the temporary path and leaves the destination as it was. Temporary names are
``.<name>.quantcore-tmp-<pid>``; leftovers of a process that no longer runs (killed with SIGKILL)
are removed by the next run for the same destination.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
from collections.abc import Iterable, Iterator

from ..errors import CheckpointError

_TMP_TAG = ".quantcore-tmp-"
_OLD_TAG = ".quantcore-old-"


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output(dst: str, inputs: Iterable[str], *, force: bool) -> None:
    """Refuse an output that would clobber an input, that cannot be written, or that exists without
    ``force`` (:class:`CheckpointError`; nothing is created)."""
    real_dst = _real(dst)
    for src in inputs:
        real_src = _real(src)
        if _inside(real_src, real_dst) or _same_file(src, dst):
            raise CheckpointError(f"the output {dst} is (or contains) the input {src}: choose another -o")
        if _inside(real_dst, real_src) and os.path.isdir(real_src):
            raise CheckpointError(f"the output {dst} is inside the input folder {src}: choose another -o")
    parent = os.path.dirname(real_dst) or "."
    if not os.path.isdir(parent):
        raise CheckpointError(f"the output's folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"the output's folder {parent} is not writable")
    if os.path.lexists(dst) and not force:
        raise CheckpointError(f"{dst} exists: pass --force to replace it")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        with contextlib.suppress(OSError):
            os.remove(path)


def stale_temporaries(dst: str) -> list[str]:
    """Temporary paths beside ``dst`` left by processes that no longer run."""
    parent, name = os.path.split(_real(dst))
    out = []
    for tag in (_TMP_TAG, _OLD_TAG):
        prefix = f".{name}{tag}"
        for entry in os.listdir(parent or "."):
            pid = entry[len(prefix):].split(".", 1)[0] if entry.startswith(prefix) else ""
            if pid.isdigit() and not _pid_alive(int(pid)):
                out.append(os.path.join(parent, entry))
    return out


class AtomicOutput:
    """``with AtomicOutput(dst, folder=True) as tmp: <write tmp>``; see the module docstring."""

    def __init__(self, dst: str, *, folder: bool):
        self.dst = dst
        parent, name = os.path.split(_real(dst))
        self.tmp = os.path.join(parent, f".{name}{_TMP_TAG}{os.getpid()}")
        self._old = os.path.join(parent, f".{name}{_OLD_TAG}{os.getpid()}")
        self.folder = folder

    def __enter__(self) -> str:
        for p in stale_temporaries(self.dst) + [self.tmp, self._old, self.tmp + ".data"]:
            _remove(p)
        if self.folder:
            os.mkdir(self.tmp)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            _remove(self.tmp)
            _remove(self.tmp + ".data")
            return False
        try:
            self.commit()
        except BaseException:
            _remove(self.tmp)
            raise
        return False

    def commit(self) -> None:
        moved = False
        if os.path.lexists(self.dst):
            os.rename(self.dst, self._old)
            moved = True
        try:
            os.rename(self.tmp, self.dst)
        except BaseException:
            if moved:
                os.rename(self._old, self.dst)
            raise
        if moved:
            _remove(self._old)
        with contextlib.suppress(OSError):  # the rename itself durable where the platform allows it
            fd = os.open(os.path.dirname(_real(self.dst)) or ".", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while inside (main thread only), so the cleanup runs."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def describe_os_error(exc: OSError, where: str) -> str:
    """One line for an OSError met while writing ``where`` (a full disk named as such)."""
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device while writing {where}; the previous output is untouched"
    if exc.errno == errno.EDQUOT:
        return f"disk quota exceeded while writing {where}; the previous output is untouched"
    return f"writing {where} failed: {exc.strerror or exc}"
