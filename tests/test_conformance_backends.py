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
