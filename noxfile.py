"""nox sessions: tests, conformance per backend, slow, bench, lint, demo.

    nox -s tests                      # the test suite (GPU tests skip with a reason without a GPU)
    nox -s "conformance(backend='cpu')"
    nox -s slow                       # exhaustive checks (E2M1 over all 2^32 fp32 patterns)
    nox -s lint demo bench
"""

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

BACKENDS = ["cpu", "cuda", "sycl", "maca"]
# torch is optional: it lets the tests cover torch-in/torch-out. 2.13.0 is the CPU build these
# machines keep on disk (a newer release would pull a multi-GB CUDA build). QC_NOX_TORCH=0 skips it.
TORCH = [os.environ.get("QC_NOX_TORCH_SPEC", "torch==2.13.0")] if os.environ.get("QC_NOX_TORCH", "1") == "1" else []
# the SYCL backend's runtime (dpctl + Intel's OpenCL CPU device) so its tests run everywhere.
SYCL = ["sycl"] if os.environ.get("QC_NOX_SYCL", "1") == "1" else []


def _install(session, extras=(), packages=()):
    session.install("-e", f".[{','.join(['test', *extras])}]", *packages)


@nox.session
def tests(session):
    """The project's tests, conformance of the built-in backends included."""
    _install(session, SYCL, TORCH)
    session.run("pytest", "-m", "not slow", *session.posargs)


@nox.session
def slow(session):
    """Exhaustive checks marked slow (minutes)."""
    _install(session)
    session.run("pytest", "-m", "slow", *session.posargs)


@nox.session
@nox.parametrize("backend", BACKENDS)
def conformance(session, backend):
    """The shipped conformance suite against one backend (cuda / maca need a GPU)."""
    _install(session, {"sycl": SYCL, "cuda": ["cuda"]}.get(backend, []))
    session.run("quantcore", "check", "--backend", backend, *(session.posargs or ["--full"]))


@nox.session
def bench(session):
    """Speed table (on the GPU machine for real figures)."""
    _install(session, packages=["matplotlib"])
    session.run("quantcore", "bench", *session.posargs)


@nox.session
def demo(session):
    """The newcomer's first run, on every available backend."""
    session.install(".")
    session.run("quantcore", "demo")


@nox.session
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", ".")
