"""Shared fixtures: seeded generators and dtype helpers."""

import zlib

import numpy as np
import pytest

from quantcore.arrays import BF16

FLOAT_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
UINT_VIEW = {4: np.uint32, 2: np.uint16, 1: np.uint8}


@pytest.fixture
def rng(request):
    # one seed per test, from a stable hash of its node id (not hash(), which PYTHONHASHSEED
    # changes per process): the same data in every run, different data across tests
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bit patterns of an array (for exact comparisons that see -0.0 and NaN payloads)."""
    a = np.ascontiguousarray(a)
    return a.view(UINT_VIEW[a.dtype.itemsize])


def same_bits(got: np.ndarray, ref: np.ndarray) -> bool:
    """Bit-equal, except that a NaN in ``ref`` needs a NaN of any sign and payload in ``got`` (a
    GPU's canonical NaN is not numpy's)."""
    got, ref = np.asarray(got).reshape(-1), np.asarray(ref).reshape(-1)
    rnan = np.isnan(ref.astype(np.float32))
    gnan = np.isnan(got.astype(np.float32))
    return bool(np.array_equal(rnan, gnan) and np.array_equal(bits(got)[~rnan], bits(ref)[~rnan]))


def _installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "cpu" for ep in entry_points(group="quantcore.backends"))


#: Tests of the package's entry points (backends, the pytest plugin) need quantcore installed
#: (pip install -e .): a bare PYTHONPATH checkout has no metadata to read them from.
needs_install = pytest.mark.skipif(
    not _installed(), reason="quantcore is not installed (pip install -e .): no entry-point metadata"
)
