"""Exhaustive check of E2M1 rounding over all 2^32 fp32 bit patterns (slow: run by nox -s slow).

quantcore's converter (``mx.e2m1_round_codes``: per-binade ``rint`` after a power-of-two
scaling) is compared with an independent formulation, the threshold rule: the magnitude index
is the number of midpoints below |x|, where a midpoint whose upper neighbour has an even index
counts when |x| >= it (a tie rounds up to the even code) and one whose lower neighbour is even
counts only when |x| > it; indices above 7 saturate; the sign bit is copied. NaN inputs are
checked against the documented rule (code 0x7) separately.
"""

import numpy as np
import pytest

from quantcore.formats import mx

CHUNK = 1 << 24

# midpoint i lies between magnitude indices i and i+1; ties go to the even one of the two
_TIE_UP = np.array([(i + 1) % 2 == 0 for i in range(7)])


def threshold_codes(v: np.ndarray) -> np.ndarray:
    a = np.abs(v)
    idx = np.zeros(v.shape, dtype=np.uint8)
    for t, up in zip(mx.E2M1_MIDPOINTS, _TIE_UP):
        idx += (a >= t) if up else (a > t)
    return idx | (np.signbit(v).astype(np.uint8) << 3)


def test_threshold_rule_on_the_documented_ties():
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    expect = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], dtype=np.float32)
    assert (mx.e2m1_decode(threshold_codes(ties)) == expect).all()
    assert (mx.e2m1_decode(threshold_codes(-ties)) == -expect).all()


@pytest.mark.slow
def test_e2m1_rounding_all_fp32_patterns():
    mismatches = 0
    first_bad = None
    nan_total = 0
    for start in range(0, 1 << 32, CHUNK):
        bits = np.arange(start, start + CHUNK, dtype=np.uint64).astype(np.uint32)
        v = bits.view(np.float32)
        ours = mx.e2m1_round_codes(v)
        nan = np.isnan(v)
        nan_total += int(nan.sum())
        assert (ours[nan] == mx.E2M1_NAN_CODE).all(), "NaN must convert to 0x7"
        ref = threshold_codes(v)
        bad = (ours != ref) & ~nan
        if bad.any():
            mismatches += int(bad.sum())
            if first_bad is None:
                first_bad = hex(int(bits[np.argmax(bad)]))
    assert nan_total == 2 * ((1 << 23) - 1)
    assert mismatches == 0, f"{mismatches} fp32 patterns round differently (first {first_bad})"
