"""Safety tier through the public API: invalid inputs raise the same exception type on every
backend, with the same message, and a host array given to a device backend raises
:class:`~quantcore.errors.DeviceError`.

Each invalid input is built twice from the same numpy data: once as numpy arrays for the numpy
``reference`` backend, once as the backend's own arrays (``be.from_numpy``), and the public
function is called with ``backend=``. The reference must raise a
:class:`~quantcore.errors.QuantcoreError` subclass (never a built-in exception), and the backend the
same type with the same message (the backend's name read as "reference"): the core validates before
any kernel launch, so a difference means the core cannot read the backend's arrays, or the backend
validates on its own. A call that the reference accepts must succeed on the backend too. The
reference declares exactly the capabilities of the backend under test, so a call outside them
raises UnsupportedError on both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend import Backend, Capability
from ..errors import DeviceError, QuantcoreError
from .harness import SAFETY, Case, Verdict, _describe_exception, declared_group

#: ``build(arr, backend)`` returns a thunk making one public-API call; ``arr`` turns a numpy
#: array into the target's array kind.
Builder = Callable[[Callable[[np.ndarray], Any], Backend], Callable[[], Any]]


@dataclass(frozen=True)
class Invalid:
    """One invalid input of the public API: a name, the op it targets and how to build it."""

    name: str
    op: str
    build: Builder


def _reference_backend(declared: frozenset[Capability]) -> Backend:
    """The numpy reference backend, declaring exactly what the backend under test declares, so
    that a call outside the declared capabilities raises UnsupportedError on both."""
    from ..backends.reference import ReferenceBackend

    class Reference(ReferenceBackend):
        def capabilities(self) -> frozenset[Capability]:
            return declared

    return Reference()


def _outcome(thunk: Callable[[], Any]) -> tuple[type | None, str, str]:
    """(exception type or None, its description, its message)."""
    try:
        thunk()
    except Exception as exc:  # noqa: BLE001 - the exception type is what is compared
        return type(exc), _describe_exception(exc), str(exc)
    return None, "", ""


def _same_error(item: Invalid) -> Callable[[Backend, np.random.Generator], Verdict]:
    def run(be: Backend, rng: np.random.Generator) -> Verdict:
        v = Verdict()
        expected, etext, emsg = _outcome(item.build(lambda a: a, _reference_backend(frozenset(be.capabilities()))))
        got, text, msg = _outcome(item.build(lambda a: be.from_numpy(np.ascontiguousarray(a)), be))
        if expected is not None and not issubclass(expected, QuantcoreError):
            v.fail(SAFETY, f"the reference backend raised {etext}: invalid input must raise a QuantcoreError "
                           "subclass (a defect of the core's validation)")
        elif expected is None and got is not None:
            v.fail(SAFETY, f"a valid call raised {text} (the reference backend accepts it)")
        elif expected is not None and got is None:
            v.fail(SAFETY, f"an invalid input was accepted; the reference backend raises {expected.__name__}")
        elif expected is not got:
            v.fail(SAFETY, f"raised {text}; the reference backend raises {expected.__name__} "
                           "(every backend must raise the same type)")
        elif msg.replace(repr(be.name), "'reference'") != emsg:
            v.fail(SAFETY, f"raised {expected.__name__} with the message {msg!r}; the reference backend's is "
                           f"{emsg!r} (every backend must give the same message)")
        else:
            v.note(f"raised {expected.__name__ if expected else 'nothing'}, as the reference backend does")
        return v

    return run


def same_error_cases(family: str, items: Iterable[Invalid], declared: frozenset[Capability]) -> list[Case]:
    """One safety case per invalid input whose op the backend declares (any format / dtype)."""
    out = []
    for item in items:
        group = declared_group(declared, item.op)
        if not group:
            continue
        out.append(Case(id=f"{family}/{item.op}/api/invalid-{item.name}", tier=SAFETY,
                        capability=group[0], run=_same_error(item)))
    return out


def host_array_case(family: str, op: str, declared: frozenset[Capability],
                    call: Callable[[Backend, Capability], Any]) -> list[Case]:
    """A numpy array passed to the public API: a backend whose native arrays are numpy arrays
    must accept it; any other backend must raise DeviceError (no silent copy).

    ``call(backend, capability)`` makes the call with numpy inputs for a declared capability.
    """
    group = declared_group(declared, op)
    if not group:
        return []

    def run(be: Backend, rng: np.random.Generator) -> Verdict:
        v = Verdict()
        host_native = isinstance(be.from_numpy(np.zeros(1, np.float32)), np.ndarray)
        got, text, _ = _outcome(lambda: call(be, group[0]))
        if host_native and got is not None:
            v.fail(SAFETY, f"numpy input raised {text}, but this backend's arrays are numpy arrays")
        elif not host_native and got is not DeviceError:
            v.fail(SAFETY, "a host (numpy) array given to a device backend must raise DeviceError; "
                           + (f"got {text}" if got else "it was accepted"))
        return v

    return [Case(id=f"{family}/{op}/api/host-array", tier=SAFETY, capability=group[0], run=run)]
