"""The conformance suite as pytest tests: ``pytest --pyargs quantcore.conformance --backend NAME``.

One test per case (its id is the case id, so ``-k`` selects cases as in ``quantcore check``),
then ``test_coverage``: the verdict over the whole run. Options (from the quantcore pytest
plugin): ``--backend``, ``--conformance-level quick|full``, ``--conformance-seed N``,
``--conformance-json PATH``. The coverage table is printed in the terminal summary.
"""

from __future__ import annotations

import pytest

from quantcore.conformance.plugin import session_for


def pytest_generate_tests(metafunc) -> None:
    if "conformance_case" not in metafunc.fixturenames:
        return
    sess = session_for(metafunc.config)
    if sess.error:
        params = [pytest.param(None, id="backend-unavailable")]
    else:
        params = [pytest.param(c, id=c.id) for c in sess.cases]
    metafunc.parametrize("conformance_case", params)


@pytest.fixture
def conformance(request):
    return session_for(request.config)


def test_case(conformance_case, conformance) -> None:
    if conformance.error:
        pytest.fail(conformance.error, pytrace=False)
    result = conformance.run(conformance_case)
    if not result.ok:
        tiers = ", ".join(sorted(result.verdict.tiers))
        pytest.fail(f"[{tiers}] {conformance_case.id}\n{result.verdict.detail()}\n"
                    f"reproduce: {conformance.reproduce(conformance_case)}", pytrace=False)


def test_coverage(conformance) -> None:
    """The verdict: something declared, nothing failed, every declared group tested (when the
    whole suite ran)."""
    if conformance.error:
        pytest.fail(conformance.error, pytrace=False)
    report = conformance.report()
    if report.reasons:
        pytest.fail("\n".join(report.reasons) + "\n\n" + report.table(), pytrace=False)
