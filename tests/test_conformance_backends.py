"""The conformance suite on every built-in backend available where the tests run.

One parametrized test per backend the registry knows: ``nox -s tests`` (plain ``pytest``)
certifies cpu and sycl on a CPU machine and, with the same command, cuda and maca on a GPU
machine; a backend that is unavailable here skips with its own reason. The backend test files
(tests/test_sycl.py, tests/test_maca.py, tests/test_cuda*.py) keep only what the suite cannot
see: builds, streams, graphs, error reporting, sizes beyond the suite's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quantcore.conformance import run
from quantcore.conformance.runner import PASSED
from quantcore.ops import ALL_CAPABILITIES
from quantcore.registry import _BUILTIN, availability

REPO = Path(__file__).resolve().parents[1]

#: the level each backend is certified at: full everywhere, unless QUANTCORE_CONFORMANCE_LEVEL says
LEVEL = os.environ.get("QUANTCORE_CONFORMANCE_LEVEL", "full")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name", sorted(_BUILTIN))
def test_backend_passes_conformance(name, tmp_path):
    avail = availability(name)
    if not avail:
        pytest.skip(f"{name} backend unavailable here: {avail.reason}")
    path = tmp_path / f"{name}.json"
    report = run(name, LEVEL, json_path=str(path))
    assert not report.failures, "\n".join(f"{r.case.id}: {r.verdict.detail()}" for r in report.failures)
    assert report.ok, report.reasons
    declared = [row for row in report.coverage if row.blocksizes_declared]
    assert declared and all(row.status == PASSED for row in declared), report.table()
    if LEVEL == "full":  # the full level tests every declared blocksize
        for row in declared:
            assert row.blocksizes_tested == row.blocksizes_declared, row
    data = json.loads(path.read_text())
    assert data["verdict"] == "pass" and data["level"] == LEVEL and data["backend"] == name
    assert len(data["cases"]) == len(report.results)
    if name == "cpu":  # the reference declares the whole catalogue
        assert report.declared == len(ALL_CAPABILITIES)


def test_seeds_do_not_depend_on_the_hash_seed(tmp_path):
    """The ``rng`` fixture draws the same numbers in two processes with different PYTHONHASHSEED."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import rng  # noqa: F401\n")
    (tmp_path / "test_draw.py").write_text(textwrap.dedent("""
        def test_draw(rng):
            print("DRAW", rng.integers(0, 2**62, 4).tolist())
    """))
    draws = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")]))
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                              str(tmp_path / "test_draw.py")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        draws.append(next(line for line in res.stdout.splitlines() if "DRAW" in line))
    assert draws[0] == draws[1], draws


@pytest.mark.parametrize("name", sorted(_BUILTIN))
def test_capabilities_are_built_once_per_instance(name):
    """``supports`` consults ``capabilities()`` on every public call: the set is built once."""
    from quantcore.registry import _instance

    be = _instance(name)
    first = be.capabilities()
    if not first:
        pytest.skip(f"{name} declares nothing here: {availability(name).reason}")
    assert be.capabilities() is first


# -- perf mode ------------------------------------------------------------------------------------------
def test_check_perf_times_each_checked_op_with_the_bench_timer(monkeypatch, capsys):
    """``quantcore check --perf`` times each case's kernel-level op with quantcore.bench's timer
    (here a stand-in that reports 2 us a call, so the GB/s column is checkable) and prints it."""
    from quantcore import bench
    from quantcore.conformance.runner import main

    timed = []

    class FixedTimer:
        def __init__(self, sync):
            pass

        def kernel(self, fns, reps, warmup):
            for fn in fns:
                fn()  # the op itself runs
            timed.append(reps)
            return 2.0

    monkeypatch.setattr(bench, "HostTimer", FixedTimer)
    case = "ggml/quantize_q8_0/q8_0/float32/bs32/random"
    assert main(["--backend", "cpu", "--perf", "--perf-reps", "7", "-k", case, "-q"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(f"| {case} |"))
    _, _, op, us, gbps, _ = (c.strip() for c in row.split("|"))
    assert op == "quantize_q8_0" and us == "2.0" and timed == [7]
    # the bytes the runner counted (inputs read once, outputs written once) over 2 us
    report = run("cpu", select=[case], perf_reps=3)
    (r,) = report.results
    assert float(gbps) == pytest.approx(r.perf_bytes / 2e-6 / 1e9, rel=1e-2)
    assert r.perf_bytes > 0 and r.as_dict()["perf_bytes"] == r.perf_bytes


def test_check_perf_on_cpu_measures_real_times():
    report = run("cpu", select=["bnb/dequantize_4bit/nf4/float32/bs64/", "bnb/quantize_4bit/nf4/float32/bs64/api"],
                 perf_reps=3)
    timed = [r for r in report.results if r.perf_us]
    assert report.ok and timed and all(r.perf_us > 0 and r.gbps > 0 for r in timed)
    assert any(not r.perf_us for r in report.results)  # the public-API case has no op call to time
    assert "| case | op | us | GB/s |" in report.perf_table()
    assert all(r.perf_us is None for r in run("cpu", select=["bnb/dequantize_4bit/nf4/float32/bs64/"]).results)
