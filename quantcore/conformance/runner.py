"""Collect the cases of every family for a backend, run them, and build the report.

The runner knows nothing about formats: families (:mod:`quantcore.conformance.families`) yield
the cases; the coverage table is built against :data:`quantcore.ops.ALL_CAPABILITIES`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import __version__
from ..backend import Backend, Capability
from ..ops import ALL_CAPABILITIES
from ..registry import get_backend
from . import families
from .harness import PERF, TIERS, Case, Perf, Verdict, case_seed

LEVELS = ("quick", "full")
PASSED, FAILED, NOT_SUPPORTED, UNTESTED, NOT_RUN = (
    "passed", "failed", "not supported", "untested", "not run (filtered)")

_OP_ORDER = ("quantize_4bit", "dequantize_4bit", "gemv_4bit", "quantize_blockwise",
             "dequantize_blockwise", "double_quantize", "quantize_q4_0", "quantize_q8_0",
             "quantize_q8_1", "dequantize_ggml", "gemm_q4_0_q8_1", "gemm_w4a8", "mx_quantize",
             "mx_dequantize", "swizzle_scales", "unswizzle_scales", "scaled_fp4_mm")
_DTYPE_ORDER = ("float32", "float16", "bfloat16")


def _op_key(op: str) -> tuple[int, str]:
    return (_OP_ORDER.index(op) if op in _OP_ORDER else len(_OP_ORDER), op)


def _group_key(g: tuple[str, str, str]) -> tuple:
    op, fmt, dt = g
    return (_op_key(op), fmt, _DTYPE_ORDER.index(dt) if dt in _DTYPE_ORDER else 9, dt)


@dataclass
class CaseResult:
    """One case's outcome as it goes into the report."""

    case: Case
    verdict: Verdict
    seconds: float
    seed: int
    perf_us: float | None = None  #: perf mode: the op's time (summed over the case's op calls)
    perf_bytes: int = 0  #: perf mode: the bytes those calls read and write

    @property
    def ok(self) -> bool:
        return self.verdict.ok

    @property
    def gbps(self) -> float | None:
        return self.perf_bytes / (self.perf_us * 1e-6) / 1e9 if self.perf_us else None

    def as_dict(self) -> dict[str, Any]:
        c = self.case.capability
        return {
            "id": self.case.id, "tier": self.case.tier, "op": c.op, "fmt": c.fmt, "dtype": c.dtype,
            "blocksize": c.blocksize, "status": PASSED if self.ok else FAILED,
            "failed_tiers": sorted(self.verdict.tiers), "detail": self.verdict.detail(),
            "seconds": round(self.seconds, 4), "seed": self.seed,
            **({"perf_us": round(self.perf_us, 3), "perf_bytes": self.perf_bytes, "gbps": round(self.gbps, 3)}
               if self.perf_us else {}),
        }


@dataclass
class CoverageRow:
    """One (op, fmt, dtype) group of the catalogue with its status."""

    op: str
    fmt: str
    dtype: str
    status: str
    blocksizes_all: list[int]
    blocksizes_declared: list[int]
    blocksizes_tested: list[int]
    cases: int = 0
    passed: int = 0
    failed_tiers: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Report:
    """Everything one run found; ``ok`` is the verdict (see :func:`verdict_reasons`)."""

    backend: str
    level: str
    seed: int
    availability: str
    devices: list[str]
    results: list[CaseResult]
    coverage: list[CoverageRow]
    extra_capabilities: list[str]
    declared: int
    filtered: bool
    seconds: float
    reasons: list[str] = field(default_factory=list)
    command: str = "quantcore check"

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if not r.ok]

    def reproduce(self, result: CaseResult) -> str:
        """The command that reruns one case with the same data."""
        level = " --full" if self.level == "full" else ""
        return (f"{self.command} --backend {self.backend}{level} --seed {self.seed} "
                f"-k '{result.case.id}'")

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "level": self.level, "seed": self.seed,
            "verdict": "pass" if self.ok else "fail", "reasons": self.reasons,
            "availability": self.availability, "devices": self.devices,
            "quantcore_version": __version__, "python": platform.python_version(),
            "numpy": np.__version__, "platform": platform.platform(),
            "seconds": round(self.seconds, 2), "filtered": self.filtered,
            "declared_capabilities": self.declared,
            "catalogue_capabilities": len(ALL_CAPABILITIES),
            "cases_total": len(self.results), "cases_failed": len(self.failures),
            "coverage": [row.as_dict() for row in self.coverage],
            "extra_capabilities": self.extra_capabilities,
            "cases": [r.as_dict() for r in self.results],
        }

    def table(self) -> str:
        """The coverage table as Markdown (what ``quantcore check`` prints at the end)."""
        lines = ["| op | fmt | dtype | status | blocksizes | cases passed | failed tiers |",
                 "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in self.coverage:
            cases = f"{row.passed}/{row.cases}" if row.cases else "-"
            lines.append(f"| {row.op} | {row.fmt} | {row.dtype} | {row.status} | {_blocksizes(row)} | "
                         f"{cases} | {', '.join(row.failed_tiers) or '-'} |")
        return "\n".join(lines)

    def perf_table(self) -> str:
        """Perf mode: the time and bandwidth of each timed case's op as Markdown, then how many
        cases had no kernel-level op call to time (the public-API and invalid-input cases) or
        failed (not timed)."""
        lines = ["| case | op | us | GB/s |", "| --- | --- | --- | --- |"]
        timed = [r for r in self.results if r.perf_us]
        for r in timed:
            lines.append(f"| {r.case.id} | {r.case.op} | {r.perf_us:.1f} | {r.gbps:.2f} |")
        if len(timed) < len(self.results):
            lines.append(f"\n{len(self.results) - len(timed)} of {len(self.results)} cases not timed "
                         "(no kernel-level op call: public-API and invalid-input cases; or failed)")
        return "\n".join(lines)

    def summary(self) -> str:
        """One verdict line (and the reasons when it fails)."""
        counts = {s: sum(1 for r in self.coverage if r.status == s)
                  for s in (PASSED, FAILED, NOT_SUPPORTED, UNTESTED, NOT_RUN)}
        tiers = []
        for t in TIERS:
            of_tier = [r for r in self.results if r.case.tier == t]
            tiers.append(f"{t} {sum(r.ok for r in of_tier)}/{len(of_tier)}")
        groups = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        text = (f"{'PASS' if self.ok else 'FAIL'}: backend {self.backend!r} ({self.level}, seed "
                f"{self.seed}): {len(self.results) - len(self.failures)}/{len(self.results)} cases "
                f"passed ({', '.join(tiers)}) in {self.seconds:.1f} s; (op, fmt, dtype) groups: "
                f"{groups}; declared {self.declared}/{len(ALL_CAPABILITIES)} catalogue capabilities")
        if self.reasons:
            text += "\n" + "\n".join(f"  - {r}" for r in self.reasons)
        return text


def _blocksizes(row: CoverageRow) -> str:
    """``tested of declared``: "64 of 32..4096 (all 8)", "all 8", "256" or "-"."""
    if not row.blocksizes_declared:
        return "-"
    if len(row.blocksizes_all) == 1:
        return str(row.blocksizes_all[0])
    decl = row.blocksizes_declared
    declared = (f"all {len(decl)}" if decl == row.blocksizes_all
                else f"{','.join(map(str, decl))} of {len(row.blocksizes_all)}")
    if row.blocksizes_tested == decl:
        return f"{','.join(map(str, decl))} ({declared})" if decl != row.blocksizes_all else declared
    tested = ",".join(map(str, row.blocksizes_tested)) or "none"
    return f"{tested} tested; declared {declared}"


def collect(be: Backend, level: str = "quick", select: Iterable[str] = ()) -> tuple[list[Case], bool]:
    """The cases for ``be`` at ``level`` whose capabilities it declares; with ``select``, only
    cases whose id contains one of the substrings. Returns (cases, filtered)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    declared = frozenset(be.capabilities())
    out: list[Case] = []
    seen: set[str] = set()
    for mod in families.modules():
        try:
            listed = list(mod.cases(level, declared))
        except Exception as exc:  # noqa: BLE001 - reported as a reason the run fails
            families.errors.append((mod.__name__, f"{type(exc).__name__}: {exc}"))
            continue
        for case in listed:
            if not all(c in declared for c in case.needs()):
                continue
            if case.id in seen:
                raise RuntimeError(f"duplicate conformance case id {case.id!r} in {mod.__name__}")
            seen.add(case.id)
            out.append(case)
    select = [s for s in select if s]
    if select:
        return [c for c in out if any(s in c.id for s in select)], True
    return out, False


def run_case(case: Case, be: Backend, seed: int, perf_reps: int = 0) -> CaseResult:
    """Run one case; any exception it raises is a failure of its tier, never a crash. With
    ``perf_reps``, each op call of the case is also timed (median of that many calls, with
    :func:`quantcore.bench.timer_for`'s timer) once it has been checked."""
    s = case_seed(seed, case.id)
    perf = None
    if perf_reps:
        from ..bench import timer_for

        perf = Perf(timer_for(be), perf_reps)
    token = PERF.set(perf)
    t0 = time.perf_counter()
    try:
        with np.errstate(all="ignore"):
            verdict = case.run(be, np.random.default_rng(s))
    except Exception as exc:  # noqa: BLE001 - a failing case must not stop the suite
        from .harness import _describe_exception

        verdict = Verdict()
        verdict.fail(case.tier, f"the case raised {_describe_exception(exc)}")
    finally:
        PERF.reset(token)
    result = CaseResult(case, verdict, time.perf_counter() - t0, s)
    if perf is not None and perf.records and verdict.ok:
        result.perf_us = sum(us for us, _ in perf.records)
        result.perf_bytes = sum(b for _, b in perf.records)
    return result


def build_report(be: Backend, level: str, seed: int, results: list[CaseResult], filtered: bool,
                 seconds: float, command: str = "quantcore check") -> Report:
    declared = frozenset(be.capabilities())
    groups: dict[tuple[str, str, str], list[int]] = {}
    for cap in ALL_CAPABILITIES:
        groups.setdefault((cap.op, cap.fmt, cap.dtype), []).append(cap.blocksize)
    by_group: dict[tuple[str, str, str], list[CaseResult]] = {}
    for r in results:
        c = r.case.capability
        by_group.setdefault((c.op, c.fmt, c.dtype), []).append(r)
    rows = []
    for key in sorted(groups, key=_group_key):
        op, fmt, dt = key
        allbs = sorted(groups[key])
        decl = sorted(b for b in allbs if Capability(op, fmt, dt, b) in declared)
        rs = by_group.get(key, [])
        tested = sorted({r.case.capability.blocksize for r in rs})
        failed_tiers = sorted({t for r in rs for t in r.verdict.tiers})
        if not decl:
            status = NOT_SUPPORTED
        elif any(not r.ok for r in rs):
            status = FAILED
        elif not rs:
            status = NOT_RUN if filtered else UNTESTED
        else:
            status = PASSED
        rows.append(CoverageRow(op, fmt, dt, status, allbs, decl, tested, len(rs),
                                sum(1 for r in rs if r.ok), failed_tiers))
    extra = sorted(str(c) for c in declared - ALL_CAPABILITIES)
    try:
        avail = be.availability()
        availability = avail.mode or avail.reason or ("available" if avail else "unavailable")
    except Exception as exc:  # noqa: BLE001
        availability = f"availability() raised {type(exc).__name__}: {exc}"
    try:
        devices = [str(d) for d in be.devices()]
    except Exception:  # noqa: BLE001
        devices = []
    report = Report(be.name, level, seed, availability, devices, results, rows, extra,
                    len(declared & ALL_CAPABILITIES), filtered, seconds, command=command)
    report.reasons = verdict_reasons(report)
    return report


def verdict_reasons(report: Report) -> list[str]:
    """Why a run does not pass (empty list: it passes).

    A run fails if any case failed, if the backend declares nothing in the catalogue (a backend
    that declares nothing is not "passing"), or if a declared group had no case (untested).
    """
    reasons = [f"family module {name} is broken: {err}" for name, err in families.errors]
    if report.declared == 0:
        reasons.append("the backend declares no capability of the catalogue (quantcore.ops.ALL_CAPABILITIES)")
    if report.failures:
        reasons.append(f"{len(report.failures)} case(s) failed")
    untested = [f"{r.op}[{r.fmt},{r.dtype}]" for r in report.coverage if r.status == UNTESTED]
    if untested:
        reasons.append(f"declared but no case tests it: {', '.join(untested)}")
    if not report.results and report.declared:
        reasons.append("no case ran")
    return reasons


def run(
    backend: str | Backend = "cpu", level: str = "quick", seed: int = 0, json_path: str | None = None,
    verbose: bool = False, select: Iterable[str] = (), out: Callable[[str], None] | None = None,
    command: str = "quantcore check", perf_reps: int = 0,
) -> Report:
    """Run the conformance suite on ``backend`` (a name or an instance) and return the Report.

    ``level`` "quick" or "full"; ``seed`` the base seed of every case; ``json_path`` where to write
    the JSON report; ``select`` substrings of case ids to run (like ``-k``); ``out`` receives the
    progress lines and the table (``print`` when ``verbose``; nothing otherwise); ``perf_reps``
    (perf mode, ``quantcore check --perf``): also time each checked op call, the median of that
    many calls, and print :meth:`Report.perf_table`.
    """
    be = backend if isinstance(backend, Backend) else get_backend(backend)
    emit = out if out is not None else (print if verbose else (lambda s: None))
    cases, filtered = collect(be, level, select)
    emit(f"quantcore conformance: backend {be.name!r}, level {level}, seed {seed}, {len(cases)} cases")
    t0 = time.perf_counter()
    results = []
    current_op = None
    for case in cases:
        if verbose and case.op != current_op:
            current_op = case.op
            emit(f"  {case.op} ...")
        r = run_case(case, be, seed, perf_reps)
        results.append(r)
        if not r.ok:
            emit(f"FAIL {case.id} [{', '.join(sorted(r.verdict.tiers))}]")
            for line in r.verdict.detail().splitlines():
                emit(f"    {line}")
    report = build_report(be, level, seed, results, filtered, time.perf_counter() - t0, command)
    for r in report.failures:
        emit(f"reproduce: {report.reproduce(r)}")
    emit("")
    emit(report.table())
    if perf_reps:
        emit("")
        emit(f"perf ({be.name}, median of {perf_reps} calls per op; GB/s: inputs read once + outputs "
             "written once):")
        emit(report.perf_table())
    emit("")
    emit(report.summary())
    if json_path:
        write_json(report, json_path)
        emit(f"JSON report written to {json_path}")
    return report


def write_json(report: Report, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report.as_dict(), fh, indent=1)
        fh.write("\n")


def main(argv: list[str] | None = None, prog: str = "quantcore check") -> int:
    """``quantcore check``: run the suite, print the table, exit 0 only on a pass."""
    import argparse
    import faulthandler

    parser = argparse.ArgumentParser(
        prog=prog, description="Run the quantcore conformance suite on a backend and print its "
                               "coverage table (exit status 0 only if every declared capability passes).")
    parser.add_argument("--backend", default=os.environ.get("QUANTCORE_BACKEND") or "cpu",
                        help="backend name (default: $QUANTCORE_BACKEND or cpu)")
    lv = parser.add_mutually_exclusive_group()
    lv.add_argument("--quick", dest="level", action="store_const", const="quick",
                    help="representative subset: every op x format x dtype, a few blocksizes (default)")
    lv.add_argument("--full", dest="level", action="store_const", const="full",
                    help="every declared blocksize, every adversarial case, bigger shapes")
    parser.add_argument("--seed", type=int, default=0, help="base seed of the random cases (default 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("-k", dest="select", action="append", default=[], metavar="SUBSTRING",
                        help="run only cases whose id contains SUBSTRING (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the case ids and exit")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines, only the table")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each op as it starts (the default)")
    parser.add_argument("--perf", action="store_true",
                        help="also time each case's op once checked (quantcore.bench's timer) and print "
                             "a table of time and GB/s")
    parser.add_argument("--perf-reps", type=int, default=20, metavar="N",
                        help="with --perf: timed calls per op, the median is reported (default 20)")
    args = parser.parse_args(argv)
    level = args.level or "quick"
    try:  # a crash inside a kernel then prints the Python stack, which names the case
        if not faulthandler.is_enabled():
            faulthandler.enable()
    except (AttributeError, OSError, ValueError):  # stderr without a file descriptor (captured)
        pass
    try:
        be = get_backend(args.backend)
    except Exception as exc:  # noqa: BLE001
        print(f"{prog}: cannot use backend {args.backend!r}: {exc}", file=sys.stderr)
        return 2
    if args.list:
        cases, _ = collect(be, level, args.select)
        for c in cases:
            print(c.id)
        return 0
    if args.perf and args.perf_reps < 1:
        parser.error("--perf-reps must be at least 1")
    report = run(be, level, args.seed, args.json, verbose=not args.quiet, select=args.select,
                 out=lambda line: print(line, flush=True), command=prog,
                 perf_reps=args.perf_reps if args.perf else 0)
    return 0 if report.ok else 1
