"""nox sessions: tests, conformance per backend, slow, bench, lint, demo.

    nox -s tests                      # the test suite (GPU tests skip with a reason without a GPU)
    nox -s "conformance(backend='cpu')"
    nox -s slow                       # exhaustive checks (E2M1 over all 2^32 fp32 patterns)
    nox -s lint demo bench
    nox -s e2e -- --layers 8          # end-to-end Llama benchmark (GPU machine)
"""

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

BACKENDS = ["cpu", "reference", "cuda", "sycl", "maca"]
# torch is optional: it lets the tests cover torch-in/torch-out. 2.13.0 is the CPU build these
# machines keep on disk (a newer release would pull a multi-GB CUDA build). QC_NOX_TORCH=0 skips it.
TORCH = [os.environ.get("QC_NOX_TORCH_SPEC", "torch==2.13.0")] if os.environ.get("QC_NOX_TORCH", "1") == "1" else []
# the PyTorch layer's peers (the transformers plugin, bitsandbytes' checkpoints both ways) come with torch
TORCH_PEERS = ["transformers>=5.17", "accelerate>=1.0", "bitsandbytes>=0.49"] if TORCH else []
# the NVFP4 checkpoints' reader (tests/test_checkpoints_hf.py decompresses with it)
TORCH_PEERS += ["compressed-tensors>=0.12"] if TORCH else []
# the SYCL backend's runtime (dpctl + Intel's OpenCL CPU device) so its tests run everywhere.
SYCL = ["sycl"] if os.environ.get("QC_NOX_SYCL", "1") == "1" else []


def _install(session, extras=(), packages=()):
    session.install("-e", f".[{','.join(['test', *extras])}]", *packages)


@nox.session
def tests(session):
    """The project's tests, conformance of the built-in backends included."""
    _install(session, SYCL, TORCH + TORCH_PEERS)
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


@nox.session(venv_params=["--system-site-packages"])
def e2e(session):
    """End-to-end model benchmark (quantcore bench --e2e: Llama-3-8B-shaped, random weights, bf16 /
    bitsandbytes nf4 / quantcore nf4, q4_0, mxfp4) on the GPU machine. torch (a CUDA build) and
    bitsandbytes come from the interpreter's site packages; options pass through:
    nox -s e2e -- --layers 8 --json bench_out/e2e.json"""
    _install(session, packages=["transformers", "accelerate", "matplotlib"])
    session.run("quantcore", "bench", "--e2e", *session.posargs)


@nox.session
def demo(session):
    """The newcomer's first run, on every available backend."""
    session.install(".")
    session.run("quantcore", "demo")


@nox.session
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", ".")
