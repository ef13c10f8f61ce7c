"""Format families of the conformance suite: one module per family, found automatically.

The interface a family module implements (keep it; the runner depends on nothing else)
-------------------------------------------------------------------------------------
A module ``quantcore/conformance/families/<family>.py`` (any name not starting with ``_``)
defines::

    FAMILY = "mx"                                  # short name, the first part of every case id

    def cases(level: str, declared: frozenset[Capability]) -> Iterable[Case]:
        ...

``level`` is ``"quick"`` or ``"full"``; ``declared`` is what the backend under test declares
(:meth:`quantcore.backend.Backend.capabilities`). ``cases`` yields
:class:`quantcore.conformance.harness.Case` objects:

- ``id``: unique and stable, ``"<family>/<op>/<fmt>/<dtype>/bs<blocksize>/<what>"`` (only letters,
  digits and ``_ - . / [ ] :``, so it works with ``-k`` in the CLI and in pytest);
- ``tier``: ``"bit-exact"``, ``"tolerance"`` or ``"safety"``;
- ``capability``: the :class:`~quantcore.backend.Capability` the case certifies (its op, format,
  dtype and block size); ``requires``: further capabilities it needs (for example a fused nested
  dequantization that also needs ``double_quantize``);
- ``run(backend, rng) -> Verdict``: runs the case on the backend with data drawn from ``rng`` (a
  ``numpy.random.Generator`` seeded from the suite's seed and the case id).

A family yields cases only for declared capabilities (the runner drops any other), picks block
sizes with :func:`~quantcore.conformance.harness.pick_blocksizes`, builds data in ``run`` (not in
``cases``: collection must be cheap), and calls the op through
:func:`~quantcore.conformance.harness.run_op`, which poisons and guards the outputs and records the
safety findings, then compares with :func:`~quantcore.conformance.harness.compare_bits` or
:func:`~quantcore.conformance.harness.compare_tolerance`. Invalid-input cases go through the
public API with :func:`quantcore.conformance.invalid.same_error_cases`. Every catalogue entry of
:data:`quantcore.ops.ALL_CAPABILITIES` that a backend declares needs at least one case from some
family; otherwise the coverage report shows it as "untested" and the backend does not pass.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

#: Family modules that failed to import or to list their cases: (module name, error). The
#: runner turns each into a reason the verdict fails (their capabilities would go untested).
errors: list[tuple[str, str]] = []


def modules() -> list[ModuleType]:
    """Every family module in this package, in name order (broken ones recorded in ``errors``)."""
    found = []
    errors.clear()
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        try:
            mod = importlib.import_module(f"{__name__}.{info.name}")
        except Exception as exc:  # noqa: BLE001 - reported, the other families still run
            errors.append((info.name, f"{type(exc).__name__}: {exc}"))
            continue
        if callable(getattr(mod, "cases", None)):
            found.append(mod)
    return found
