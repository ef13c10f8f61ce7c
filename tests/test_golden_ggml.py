"""quantcore's ggml reference against bytes gguf-py wrote (tests/golden/ggml_golden.npz, made by
tools/make_golden_ggml.py with gguf 0.19.0). Runs without gguf installed."""

from pathlib import Path

import numpy as np

from quantcore.formats import ggml

from .conftest import bits


def test_stored_golden_from_gguf_py():
    """The bytes gguf-py wrote (tests/golden/ggml_golden.npz, tools/make_golden_ggml.py)."""
    g = np.load(Path(__file__).parent / "golden" / "ggml_golden.npz")
    x = g["x"]
    rows = x.shape[0]
    assert np.array_equal(ggml.quantize_q4_0(x).reshape(rows, -1), g["Q4_0"])
    assert np.array_equal(ggml.quantize_q8_0(x).reshape(rows, -1), g["Q8_0"])
    assert np.array_equal(bits(ggml.dequantize_q4_0(g["Q4_0"].reshape(rows, -1, 18))), bits(g["Q4_0_deq"]))
    assert np.array_equal(bits(ggml.dequantize_q8(g["Q8_0"].reshape(rows, -1, 34), "q8_0")), bits(g["Q8_0_deq"]))
    q81 = ggml.quantize_q8_1(x)
    q80 = g["Q8_0"].reshape(rows, -1, 34)
    assert np.array_equal(q81[..., :2], q80[..., :2]) and np.array_equal(q81[..., 4:], q80[..., 2:])
