"""The bitsandbytes-family reference: the rules of docs/formats.md, pinned case by case."""

import numpy as np
import pytest

from quantcore.formats import bnb

from .conftest import bits


def test_nf4_thresholds_are_midpoints_and_ties_go_low():
    mids = ((bnb.NF4_CODE[:-1].astype(np.float64) + bnb.NF4_CODE[1:]) / 2).astype(np.float32)
    assert np.allclose(mids, bnb.NF4_THRESHOLDS, rtol=0, atol=1e-7)
    # x exactly on a threshold takes the lower code (strict >); just above takes the upper
    for i, t in enumerate(bnb.NF4_THRESHOLDS):
        x = np.array([t, np.nextafter(t, np.float32(2))], dtype=np.float32)
        codes = bnb._round_4bit(x, "nf4")
        assert list(codes) == [i, i + 1]


def test_fp4_rounding_and_sign_of_negative_zero():
    x = np.array([0.0, -0.0, 0.00260417, 0.0026042, -1.0, 0.3, np.nan], dtype=np.float32)
    q = bnb._round_4bit(x, "fp4")
    assert q[0] == 0 and q[1] == 0, "-0.0 is not < 0: positive code"
    assert q[2] == 0b000 and q[3] == 0b001
    assert q[4] == 0b1011
    assert q[5] == 0b100  # 0.29166667 < 0.3 <= 0.4166667
    assert q[6] == 0, "NaN -> code 0"
    assert bits(bnb.FP4_CODE[8:9])[0] == 0x80000000, "code 0b1000 decodes to -0.0 as in bitsandbytes' kernel"


def test_packing_high_nibble_first_and_odd_pad_is_zero_code():
    x = np.array([-1.0, 1.0, 0.0], dtype=np.float32)
    packed, absmax = bnb.quantize_4bit(x, 64, "nf4")
    assert packed.shape == (2, 1) and absmax.tolist() == [1.0]
    assert packed[0, 0] == (0x0 << 4) | 0xF
    assert packed[1, 0] == (0x7 << 4) | bnb.ZERO_CODE["nf4"]


def test_zero_block_gives_code_zero_and_decodes_to_zero():
    x = np.zeros(64, dtype=np.float32)
    for qt in ("nf4", "fp4"):
        packed, absmax = bnb.quantize_4bit(x, 64, qt)
        assert absmax[0] == 0 and (packed == 0).all()  # NaN from 0 * inf -> code 0
        out = bnb.dequantize_4bit(packed, absmax, 64, 64, qt, np.float32)
        assert (out == 0).all()


def test_partial_last_block_uses_only_its_elements(rng):
    x = rng.standard_normal(100).astype(np.float32)
    x[64:] *= 100
    _, absmax = bnb.quantize_4bit(x, 64, "nf4")
    assert absmax[0] == np.abs(x[:64]).max() and absmax[1] == np.abs(x[64:]).max()


def test_nan_is_ignored_by_absmax_and_coded_zero():
    x = np.array([np.nan, 0.5, -0.25, 0.0], dtype=np.float32)
    packed, absmax = bnb.quantize_4bit(x, 32, "nf4")
    assert absmax[0] == 0.5
    assert bnb.unpack_4bit_bnb(packed, 4)[0] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dequantize_is_one_multiply_one_rounding(rng, dtype):
    x = rng.standard_normal(4096).astype(np.float32)
    packed, absmax = bnb.quantize_4bit(x, 128, "nf4")
    out = bnb.dequantize_4bit(packed, absmax, 4096, 128, "nf4", dtype)
    q = bnb.unpack_4bit_bnb(packed, 4096)
    expect = (bnb.NF4_CODE[q] * np.repeat(absmax, 128)).astype(np.float32).astype(dtype)
    assert np.array_equal(bits(out), bits(expect))


def test_dynamic_map_shape_and_landmarks():
    m = bnb.DYNAMIC_MAP
    assert m.shape == (256,) and m[127] == 0 and m[255] == 1.0
    assert np.isclose(m[0], -0.99296874) and (np.diff(m) > 0).all()


def test_dynamic_map_equals_torch_construction():
    torch = pytest.importorskip("torch", reason="torch reproduces bitsandbytes' create_dynamic_map")
    data = []
    for i in range(7):
        b = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        m = (b[:-1] + b[1:]) / 2.0
        data += ((10 ** (i - 6)) * m).tolist() + (-(10 ** (i - 6)) * m).tolist()
    data += [0, 1.0]
    data.sort()
    assert np.array_equal(bits(torch.tensor(data, dtype=torch.float32).numpy()), bits(bnb.DYNAMIC_MAP))


def test_8bit_thresholds_give_nearest_value_ties_low(rng):
    code = bnb.DYNAMIC_MAP.astype(np.float64)
    s = rng.uniform(-1, 1, 200_000).astype(np.float32)
    mids = (code[:-1] + code[1:]) / 2
    ties = mids[np.abs(mids.astype(np.float32).astype(np.float64) - mids) == 0].astype(np.float32)
    s = np.concatenate([s, ties, np.nextafter(ties, np.float32(2))])
    q = np.searchsorted(bnb.DYNAMIC_THRESHOLDS, s, side="left")
    dist = np.abs(code[None, :] - s.astype(np.float64)[:, None])
    best = dist.min(axis=1)
    nearest_low = np.argmax(dist == best[:, None], axis=1)  # first (lowest) index at min distance
    assert np.array_equal(q, nearest_low)


def test_pairwise_sum_order_is_a_binary_tree():
    v = np.array([1e16, 1.0, -1e16, 1.0, 3.0], dtype=np.float64)
    # tree: ((1e16 + 1) + (-1e16 + 1)) + (3 + 0) -> (1e16 + -1e16) + 3 = 3 in fp64
    assert bnb.pairwise_sum_f64(v) == ((v[0] + v[1]) + (v[2] + v[3])) + (v[4] + 0.0)
    assert bnb.pairwise_sum_f64(np.array([2.5])) == 2.5


def test_nested_absmax_uses_two_roundings(rng):
    absmax = np.abs(rng.standard_normal(3000)).astype(np.float32) + 0.1
    q, a2, off = bnb.double_quantize(absmax)
    got = bnb.dequantize_absmax(q, a2, off)
    prod = (bnb.DYNAMIC_MAP[q] * np.repeat(a2, 256)[:3000]).astype(np.float32)
    assert np.array_equal(bits(got), bits((prod + off).astype(np.float32)))
    assert np.abs(got - absmax).max() < 0.02 * absmax.max()
