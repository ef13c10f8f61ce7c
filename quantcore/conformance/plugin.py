"""pytest plugin (entry point ``pytest11: quantcore_conformance``): options and the report.

Loaded by every pytest run in an environment where quantcore is installed, so it only adds
options and a terminal-summary hook, and imports nothing heavy until the conformance module
(:mod:`quantcore.conformance.test_conformance`) is collected by
``pytest --pyargs quantcore.conformance --backend NAME``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("quantcore", "quantcore conformance suite")
    group.addoption(
        "--backend", action="store", default=None, metavar="NAME",
        help="quantcore backend the conformance suite certifies (default: $QUANTCORE_BACKEND or cpu)",
    )
    group.addoption(
        "--conformance-level", action="store", default="quick", choices=("quick", "full"),
        help="conformance level: quick (representative subset) or full (every blocksize and case)",
    )
    group.addoption(
        "--conformance-seed", action="store", type=int, default=0, metavar="N",
        help="base seed of the conformance suite's random cases (default 0)",
    )
    group.addoption(
        "--conformance-json", action="store", default=None, metavar="PATH",
        help="write the conformance report (coverage table included) as JSON to PATH",
    )


def selected_backend(config) -> str:
    """The backend named by ``--backend``, else ``$QUANTCORE_BACKEND``, else ``cpu``."""
    return config.getoption("--backend") or os.environ.get("QUANTCORE_BACKEND") or "cpu"


class ConformanceSession:
    """The backend, its cases and the results of one pytest session."""

    def __init__(self, config) -> None:
        from .runner import collect

        self.name = selected_backend(config)
        self.level = config.getoption("--conformance-level")
        self.seed = config.getoption("--conformance-seed")
        self.json_path = config.getoption("--conformance-json")
        self.results: list[Any] = []
        self.cases: list[Any] = []
        self.error: str | None = None
        self.backend = None
        try:
            from ..registry import get_backend

            self.backend = get_backend(self.name)
            self.cases, _ = collect(self.backend, self.level)
        except Exception as exc:  # noqa: BLE001 - reported by every test of the module
            self.error = f"cannot certify backend {self.name!r}: {type(exc).__name__}: {exc}"

    def run(self, case) -> Any:
        from .runner import run_case

        result = run_case(case, self.backend, self.seed)
        self.results.append(result)
        return result

    def reproduce(self, case) -> str:
        level = " --conformance-level full" if self.level == "full" else ""
        return (f"pytest --pyargs quantcore.conformance --backend {self.name}{level} "
                f"--conformance-seed {self.seed} -k '{case.id}'")

    def report(self) -> Any:
        from .runner import build_report

        ran = {r.case.id for r in self.results}
        filtered = any(c.id not in ran for c in self.cases)
        seconds = sum(r.seconds for r in self.results)
        return build_report(self.backend, self.level, self.seed, list(self.results), filtered, seconds,
                            command="quantcore check")


_SESSION = pytest.StashKey[ConformanceSession]()


def session_for(config) -> ConformanceSession:
    """The session's :class:`ConformanceSession`, created on first use."""
    if _SESSION not in config.stash:
        config.stash[_SESSION] = ConformanceSession(config)
    return config.stash[_SESSION]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    sess = config.stash.get(_SESSION, None)
    if sess is None or sess.backend is None or not sess.results:
        return
    report = sess.report()
    terminalreporter.section(f"quantcore conformance: {sess.name}")
    terminalreporter.write_line(report.table())
    terminalreporter.write_line("")
    terminalreporter.write_line(report.summary())
    if sess.json_path:
        from .runner import write_json

        write_json(report, sess.json_path)
        terminalreporter.write_line(f"JSON report written to {sess.json_path}")
