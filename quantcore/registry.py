"""Backend registry: entry points, selection, the ``QUANTCORE_BACKEND`` variable.

Backends are found through the entry-point group ``quantcore.backends``; each entry point names
a zero-argument factory returning a :class:`~quantcore.backend.Backend`. Factories are cheap:
a backend imports its vendor packages only when asked for availability or used.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from importlib import metadata

from .backend import Availability, Backend
from .errors import BackendUnavailableError, ParameterError

ENTRY_POINT_GROUP = "quantcore.backends"
ENV_VAR = "QUANTCORE_BACKEND"
DEFAULT_BACKEND = "cpu"

#: Built-in backends, used when the package metadata is missing (a source tree on sys.path).
_BUILTIN = {
    "cpu": "quantcore.backends.cpu:create",
    "reference": "quantcore.backends.reference:create",
    "cuda": "quantcore.backends.cuda:create",
    "sycl": "quantcore.backends.sycl:create",
    "maca": "quantcore.backends.maca:create",
}

_lock = threading.RLock()
_factories: dict[str, Callable[[], Backend]] = {}
_instances: dict[str, Backend] = {}
_current = threading.local()
_global_name: list[str | None] = [None]


def _load(spec: str) -> Callable[[], Backend]:
    module, _, attr = spec.partition(":")
    return lambda: getattr(__import__(module, fromlist=[attr]), attr)()


def _discover() -> None:
    if _factories:
        return
    found: dict[str, Callable[[], Backend]] = {}
    try:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            found[ep.name] = (lambda ep=ep: ep.load()())
    except Exception:  # broken metadata must not break import
        pass
    for name, spec in _BUILTIN.items():
        found.setdefault(name, _load(spec))
    _factories.update(found)


def register_backend(name: str, factory: Callable[[], Backend], *, replace: bool = False) -> None:
    """Register a backend factory at run time (tests, or a vendor without packaging)."""
    with _lock:
        _discover()
        if name in _factories and not replace:
            raise ParameterError(f"a backend named {name!r} is already registered")
        _factories[name] = factory
        _instances.pop(name, None)


def unregister_backend(name: str) -> None:
    with _lock:
        _factories.pop(name, None)
        _instances.pop(name, None)


def backend_names() -> list[str]:
    with _lock:
        _discover()
        return sorted(_factories)


def _instance(name: str) -> Backend:
    with _lock:
        _discover()
        if name not in _factories:
            raise BackendUnavailableError(
                f"no backend named {name!r}; known backends: {', '.join(backend_names())}"
            )
        if name not in _instances:
            _instances[name] = _factories[name]()
        return _instances[name]


def availability(name: str) -> Availability:
    try:
        return _instance(name).availability()
    except BackendUnavailableError as exc:
        return Availability(False, str(exc))
    except Exception as exc:  # a broken third-party backend is reported, not raised
        return Availability(False, f"{type(exc).__name__}: {exc}")


def available_backends() -> dict[str, Availability]:
    """Every known backend with its availability (``.ok`` and ``.reason``)."""
    return {name: availability(name) for name in backend_names()}


def get_backend(name: str | None = None) -> Backend:
    """The selected backend (or ``name``); raises if it is unavailable, saying why."""
    if name is None:
        name = getattr(_current, "name", None) or _global_name[0] or os.environ.get(ENV_VAR)
        name = name or DEFAULT_BACKEND
    backend = _instance(name)
    avail = backend.availability()
    if not avail:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {avail.reason}")
    return backend


def set_backend(name: str) -> Backend:
    """Select the process-wide backend ("cpu", "reference", "cuda", "sycl", "maca" or a registered one)."""
    backend = get_backend(name)
    _global_name[0] = name
    return backend


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[Backend]:
    """Select ``name`` for the current thread inside a ``with`` block."""
    backend = get_backend(name)
    previous = getattr(_current, "name", None)
    _current.name = name
    try:
        yield backend
    finally:
        _current.name = previous
