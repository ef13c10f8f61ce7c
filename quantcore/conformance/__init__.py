"""The conformance suite: certifies a backend against the numpy reference of the core.

A vendor registers a backend and runs, without writing a test::

    quantcore check --backend NAME [--quick|--full] [--seed N] [--json PATH] [-k SUBSTRING] [--perf]
    python -m quantcore.conformance --backend NAME ...          # the same, without the CLI
    pytest --pyargs quantcore.conformance --backend NAME [--conformance-level full]

Tiers, for every op the backend declares (:meth:`quantcore.backend.Backend.capabilities`):

- bit-exact: quantizers and dequantizers equal :mod:`quantcore.formats` bit for bit, on random
  and adversarial inputs (:mod:`quantcore.conformance.families`);
- tolerance: gemv / gemm within bounds derived from the arithmetic
  (:mod:`quantcore.conformance.bounds`) of an fp64 reference;
- safety: poisoned outputs and guard bytes around every output (:mod:`.harness`), invalid inputs
  raise the same exception type as on the cpu backend (:mod:`.invalid`), no case stops the suite;
- coverage: a table of every (op, format, dtype) of :data:`quantcore.ops.ALL_CAPABILITIES` as
  passed / failed / not supported / untested.

The suite calls the backend's kernel-level ops with the backend's own arrays (``from_numpy``,
``view``, ``to_numpy``), so a device backend is tested on its device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .runner import Report

__all__ = ["run", "main"]


def run(backend: Any = "cpu", level: str = "quick", seed: int = 0, json_path: str | None = None,
        verbose: bool = False, select: tuple[str, ...] | list[str] = (), perf_reps: int = 0) -> Report:
    """Run the suite on ``backend`` (name or Backend instance) at ``level`` ("quick" / "full").

    Returns a :class:`~quantcore.conformance.runner.Report`: ``report.ok`` is the verdict,
    ``report.table()`` the coverage table, ``report.as_dict()`` the JSON content (also written to
    ``json_path`` when given). ``select``: run only cases whose id contains one of the substrings.
    ``perf_reps``: perf mode (``quantcore check --perf``), each checked op call also timed, the
    median of that many calls (``report.perf_table()``, ``result.perf_us`` / ``result.gbps``).
    """
    from .runner import run as _run

    return _run(backend, level=level, seed=seed, json_path=json_path, verbose=verbose, select=select,
                perf_reps=perf_reps)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quantcore check`` (``argv`` without the ``check`` word); the exit status."""
    from .runner import main as _main

    return _main(argv)
