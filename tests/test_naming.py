"""One naming scheme across the op families (README, "Naming"): the format is ``fmt=`` in every
family (``quant_type=`` stays as bitsandbytes' alias in the 4-bit family), each family has one
generic function per direction beside its per-format shorthands."""

from __future__ import annotations

import numpy as np
import pytest

import quantcore as qc
from quantcore.errors import ParameterError

from .conftest import bits


@pytest.fixture
def x(rng):
    return rng.standard_normal((4, 96)).astype(np.float32)


def test_4bit_format_is_fmt_and_quant_type_is_its_alias(x):
    p1, s1 = qc.quantize_4bit(x, 64, fmt="fp4")
    p2, s2 = qc.quantize_4bit(x, 64, quant_type="fp4")  # bitsandbytes' keyword
    p3, s3 = qc.quantize_4bit(x, 64, "fp4")  # positional, as before
    p4, s4 = qc.quantize_4bit(x, 64, fmt="fp4", quant_type="fp4")  # the same value twice
    for p, s in ((p2, s2), (p3, s3), (p4, s4)):
        assert np.array_equal(p, p1) and s.quant_type == s1.quant_type == "fp4"
        assert np.array_equal(bits(qc.dequantize_4bit(p, s)), bits(qc.dequantize_4bit(p1, s1)))
    assert qc.quantize_4bit(x)[1].quant_type == "nf4"  # the default


def test_4bit_format_given_twice_differently_is_refused(x):
    with pytest.raises(ParameterError, match="given twice"):
        qc.quantize_4bit(x, 64, fmt="fp4", quant_type="nf4")
    with pytest.raises(ParameterError, match="fmt"):
        qc.quantize_4bit(x, 64, fmt="int4")


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q8_1"])
def test_ggml_generic_functions_are_the_per_format_ones(x, fmt):
    q = qc.quantize_ggml(x, fmt)
    assert np.array_equal(q, getattr(qc, f"quantize_{fmt}")(x))
    assert np.array_equal(qc.quantize_ggml(x[0], fmt), getattr(qc, f"quantize_{fmt}")(x[0]))
    for dt in ("float32", "bfloat16"):
        assert np.array_equal(bits(qc.dequantize_ggml(q, fmt, dt)),
                              bits(getattr(qc, f"dequantize_{fmt}")(q, dt)))


def test_ggml_unknown_format_is_a_parameter_error(x):
    with pytest.raises(ParameterError, match="fmt"):
        qc.quantize_ggml(x, "q5_0")
    with pytest.raises(ParameterError, match="fmt"):
        qc.dequantize_ggml(qc.quantize_q8_0(x), "Q8_0")


def test_every_family_names_its_format_fmt():
    import inspect

    from quantcore import api_mx

    for fn in (qc.quantize_4bit, qc.quantize_ggml, qc.dequantize_ggml, api_mx.quantize_mx,
               api_mx.dequantize_mx, api_mx.scaled_fp4_mm):
        assert "fmt" in inspect.signature(fn).parameters, fn.__name__
