"""ggml Q4_0 / Q8_0 / Q8_1: bit for bit with gguf-py (the PyPI package of llama.cpp) and the C rules."""

import numpy as np
import pytest

import quantcore as qc
from quantcore.formats import ggml

gguf = pytest.importorskip("gguf", reason="gguf-py is the peer the ggml goldens come from")
from gguf import quants  # noqa: E402

from .conftest import bits  # noqa: E402


def _data(rng, rows=64, k=1024):
    x = rng.standard_normal((rows, k)).astype(np.float32) * rng.uniform(0.001, 50, (rows, 1)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block
    x[1, :32] = 3.0  # all equal: the first maximum wins
    x[2, 5] = -x[2, :32].__abs__().max()  # a negative maximum
    return x


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0"])
def test_bytes_equal_gguf_py(rng, kind):
    x = _data(rng)
    ours = {"Q4_0": ggml.quantize_q4_0, "Q8_0": ggml.quantize_q8_0}[kind](x).reshape(x.shape[0], -1)
    theirs = quants.quantize(x, getattr(gguf.GGMLQuantizationType, kind))
    assert np.array_equal(ours, theirs)
    deq = quants.dequantize(theirs, getattr(gguf.GGMLQuantizationType, kind))
    mine = ggml.dequantize_q4_0(ours.reshape(64, -1, 18)) if kind == "Q4_0" else ggml.dequantize_q8(ours.reshape(64, -1, 34), "q8_0")
    assert np.array_equal(bits(mine), bits(deq.astype(np.float32)))


def test_q4_0_layout_low_nibbles_first():
    x = np.zeros(32, dtype=np.float32)
    x[0], x[16] = -8.0, 7.0  # max = -8 -> d = 1, id = 1
    b = ggml.quantize_q4_0(x[None])[0, 0]
    assert np.frombuffer(b[:2].tobytes(), np.float16)[0] == 1.0
    assert b[2] & 0x0F == 0 and b[2] >> 4 == 15  # element 0 low, element 16 high
    assert all(v == 0x88 for v in b[3:])


def test_q8_1_sum_term_is_d_times_sum_of_codes(rng):
    a = rng.standard_normal((4, 256)).astype(np.float32)
    blocks = ggml.quantize_q8_1(a)
    d, q, s = ggml.unpack_q8(blocks, "q8_1")
    expect = (q.astype(np.int32).sum(-1).astype(np.float32) * d).astype(np.float16).astype(np.float32)
    # d is stored as fp16, the sum uses the fp32 d: recompute it from the block maxima
    amax = np.abs(a.reshape(4, 8, 32)).max(-1)
    d32 = (amax / np.float32(127)).astype(np.float32)
    expect = (q.astype(np.int32).sum(-1).astype(np.float32) * d32).astype(np.float16).astype(np.float32)
    assert np.array_equal(s, expect)
    assert np.array_equal(ggml.quantize_q8_0(a)[..., 2:], blocks[..., 4:])


def test_q8_round_half_away_from_zero():
    a = np.zeros(32, dtype=np.float32)
    a[0] = 127.0  # d = 1
    a[1], a[2], a[3] = 2.5, -2.5, 0.49999997
    q = ggml.unpack_q8(ggml.quantize_q8_0(a[None]), "q8_0")[1][0, 0]
    assert (q[1], q[2], q[3]) == (3, -3, 0)


def test_q4_0_no_fma_rounding():
    # x * id + 8.5 rounded twice (product, then sum) as ggml's C code without contraction
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, 32)).astype(np.float32)
    d = (x[np.arange(256), np.abs(x).argmax(1)] / np.float32(-8)).astype(np.float32)
    idv = (np.float32(1) / d).astype(np.float32)
    q = np.minimum(15, np.trunc(((x * idv[:, None]).astype(np.float32) + np.float32(8.5)).astype(np.float32))).astype(np.uint8)
    got = ggml.unpack_q4_0(ggml.quantize_q4_0(x))[1][:, 0]
    assert np.array_equal(got, q)


def test_nonfinite_inputs_are_defined():
    a = np.zeros((1, 32), dtype=np.float32)
    a[0, 0], a[0, 1], a[0, 2] = np.nan, 1.0, -2.0
    q4 = ggml.quantize_q4_0(a)  # NaN skipped by the max; NaN code -> trunc(NaN) = 0
    assert ggml.unpack_q4_0(q4)[1][0, 0, 0] == 0
    q8 = ggml.unpack_q8(ggml.quantize_q8_0(a), "q8_0")[1]
    assert q8[0, 0, 0] == 0 and q8[0, 0, 2] == -127


def test_w4a8_reference_matches_dequantized_product(rng):
    w = rng.standard_normal((48, 256)).astype(np.float32)
    a = rng.standard_normal((5, 256)).astype(np.float32)
    wq, aq = ggml.quantize_q4_0(w), ggml.quantize_q8_1(a)
    ref = ggml.dequantize_q4_0(wq).astype(np.float64) @ ggml.dequantize_q8(aq, "q8_1").astype(np.float64).T
    got = ggml.gemm_q4_0_q8_1(wq, aq)
    # s8 is fp16-rounded d*sum(q): differs from the exact sum by at most 8 * half an fp16 ulp per block
    assert np.abs(got - ref).max() < 1e-2 * np.abs(ref).max()



def test_q4_0_block_of_zeros_has_d_minus_zero_as_llama_cpp():
    """llama.cpp's quantize_row_q4_0_ref starts its max at +0.0 and replaces it only for a strictly
    larger |x|, so every block without a nonzero number gets d = +0.0 / -8 = -0.0 (bytes 00 80), also
    when x[0] is -0.0 (gguf-py takes that -0.0 and writes +0.0; llama-quantize's files are the C's)."""
    x = np.zeros((3, 32), np.float32)
    x[0, 0] = -0.0
    x[1] = -0.0
    for q in (ggml.quantize_q4_0(x), np.asarray(qc.quantize_q4_0(x, backend="cpu"))):
        assert (q[..., 0:2] == [0x00, 0x80]).all() and (q[..., 2:] == 0x88).all()


def test_q4_0_bytes_equal_llama_cpp_c_reference():
    """Every block type through llama.cpp's own quantize_row_q4_0_ref (libggml-base of llama-cpp-python)."""
    import ctypes
    import glob
    import os

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (see docs/gguf.md)")
    libs = glob.glob(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so*"))
    if not libs:
        pytest.skip("llama-cpp-python without libggml-base.so")
    ref = ctypes.CDLL(libs[0]).quantize_row_q4_0_ref
    ref.argtypes, ref.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    rng = np.random.default_rng(11)
    x = rng.standard_normal((48, 32)).astype(np.float32)
    x[0], x[1], x[2] = 0.0, -0.0, np.nan
    x[3, :] = 0.0
    x[3, 0] = -0.0
    x[4, 7] = np.nan
    x[5] *= np.float32(1e-39)  # 1/d overflows: codes 0
    x[6] *= np.float32(1e30)  # d overflows fp16
    x[7, :] = 0.0
    x[7, 9] = np.float32(1e-45)
    want = np.zeros((48, 18), np.uint8)
    ref(x.ctypes.data, want.ctypes.data, x.size)
    with np.errstate(all="ignore"):
        for got in (ggml.quantize_q4_0(x), np.asarray(qc.quantize_q4_0(x, backend="cpu"))):
            assert np.array_equal(got.reshape(48, 18), want), np.nonzero((got.reshape(48, 18) != want).any(1))
