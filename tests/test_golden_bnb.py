"""quantcore's reference against bitsandbytes' own CUDA output (tests/golden, made by
tools/make_golden_bnb.py with bitsandbytes 0.50.2 on an H200).

What must hold (docs/formats.md): bitsandbytes' bytes with its state dequantize to its values bit for
bit (plain and double-quantized); quantizing gives bitsandbytes' bytes except where x * (1/absmax)
lands on a rounding threshold (bitsandbytes' fast-math reciprocal is one ulp off for ~13% of
mantissas), always to the neighbouring code; the double-quantization offset is within a few ulps
(bitsandbytes' fp32 mean has no fixed order) and the nested codes are then identical.
"""

from pathlib import Path

import numpy as np
import pytest

import quantcore as qc
from quantcore.formats import bnb
from quantcore.io import load_safetensors

from .conftest import FLOAT_DTYPES, bits

GOLDEN = Path(__file__).parent / "golden"
G = np.load(GOLDEN / "bnb_golden.npz")
N = int(G["n"][0])


def x_of(dname):
    return G[f"x_{dname}"].view(FLOAT_DTYPES[dname])


def test_made_with_bitsandbytes_0_50():
    assert bytes(G["bnb_version"]).decode() == "0.50.2"


def test_code_tables_are_bitsandbytes():
    assert np.array_equal(bits(G["dynamic_map"]), bits(bnb.DYNAMIC_MAP))
    assert np.array_equal(G["code_nf4"], bnb.NF4_CODE)
    # bitsandbytes' fp4 quant_map holds +0.0 at code 8 where its kernel decodes -0.0: equal by value
    assert np.array_equal(G["code_fp4"], bnb.FP4_CODE)


def _near_threshold(x, absmax, thresholds, bs):
    """True where x * r lies within 2 fp32 ulps of a threshold for r = 1/absmax +- 1 ulp."""
    xs = x.astype(np.float32)
    a = np.repeat(absmax, bs)[: xs.size]
    out = np.zeros(xs.size, dtype=bool)
    with np.errstate(all="ignore"):
        r = (np.float32(1) / a).astype(np.float32)
        for rr in (r, np.nextafter(r, np.float32(0)), np.nextafter(r, np.float32(np.inf))):
            s = (xs * rr).astype(np.float32)
            for t in thresholds:
                out |= np.abs(s - t) <= 2 * np.spacing(np.abs(t).astype(np.float32))
    return out


@pytest.mark.parametrize("dname", list(FLOAT_DTYPES))
@pytest.mark.parametrize("qt", ["nf4", "fp4"])
@pytest.mark.parametrize("bs", bnb.BLOCKSIZES_4BIT)
def test_4bit_against_bitsandbytes(dname, qt, bs):
    x = x_of(dname)
    key = f"{qt}_{dname}_{bs}_plain"
    packed, absmax = bnb.quantize_4bit(x, bs, qt)
    assert np.array_equal(bits(absmax), bits(G[key + "_absmax"]))
    ours = bnb.unpack_4bit_bnb(packed, N)
    theirs = bnb.unpack_4bit_bnb(G[key + "_packed"], N)
    diff = np.flatnonzero(ours != theirs)
    assert diff.size <= 4, f"{diff.size} codes differ"
    if diff.size:
        thresholds = bnb.NF4_THRESHOLDS if qt == "nf4" else np.concatenate([bnb.FP4_THRESHOLDS, -bnb.FP4_THRESHOLDS])
        near = _near_threshold(x, absmax, thresholds, bs)
        assert near[diff].all(), "a code differs away from a rounding threshold"
        vals = bnb.code_4bit(qt)
        order = np.argsort(np.argsort(vals))  # rank of each code's value
        assert (np.abs(order[ours[diff]].astype(int) - order[theirs[diff]]) == 1).all()

    # bitsandbytes' bytes + its state -> its values, bit for bit
    out = bnb.dequantize_4bit(G[key + "_packed"], G[key + "_absmax"], N, bs, qt, FLOAT_DTYPES[dname])
    assert np.array_equal(bits(out), bits(G[key + "_out"]))


@pytest.mark.parametrize("dname", list(FLOAT_DTYPES))
@pytest.mark.parametrize("qt", ["nf4", "fp4"])
@pytest.mark.parametrize("bs", bnb.BLOCKSIZES_4BIT)
def test_double_quant_against_bitsandbytes(dname, qt, bs):
    key = f"{qt}_{dname}_{bs}_dq"
    plain_absmax = G[f"{qt}_{dname}_{bs}_plain_absmax"]
    qabsmax, absmax2, offset = bnb.double_quantize(plain_absmax)
    ulps = abs(int(bits(np.array([offset], np.float32))[0]) - int(bits(G[key + "_offset"])[0]))
    assert ulps <= 4, f"offset {ulps} ulps from bitsandbytes' mean"
    # absmax2 = max |absmax - offset| moves with the offset's last bits, and only then
    d2 = np.abs(bits(absmax2).astype(np.int64) - bits(G[key + "_absmax2"]).astype(np.int64))
    assert d2.max() <= (0 if ulps == 0 else 4)
    assert (qabsmax != G[key + "_absmax"]).sum() <= 1
    assert np.array_equal(bits(G[key + "_code2"]), bits(bnb.DYNAMIC_MAP))
    # bitsandbytes' nested state decodes to its values exactly (two roundings, no FMA)
    absmax = bnb.dequantize_absmax(G[key + "_absmax"], G[key + "_absmax2"], G[key + "_offset"][0])
    out = bnb.dequantize_4bit(G[key + "_packed"], absmax, N, bs, qt, FLOAT_DTYPES[dname])
    assert np.array_equal(bits(out), bits(G[key + "_out"]))


@pytest.mark.parametrize("dname", list(FLOAT_DTYPES))
@pytest.mark.parametrize("bs", bnb.BLOCKSIZES_8BIT)
def test_blockwise_8bit_against_bitsandbytes(dname, bs):
    x = x_of(dname)
    key = f"q8_{dname}_{bs}"
    codes, absmax = bnb.quantize_blockwise(x, bs)
    assert np.array_equal(bits(absmax), bits(G[key + "_absmax"]))
    diff = np.flatnonzero(codes != G[key + "_codes"])
    # only exact ties of the nearest-value rule (path dependent in bitsandbytes' binary search)
    # or fast-math reciprocal boundary cases, and always the neighbouring code
    assert diff.size <= 8
    assert (np.abs(codes[diff].astype(int) - G[key + "_codes"][diff]) == 1).all()
    if diff.size:
        assert _near_threshold(x, absmax, bnb.DYNAMIC_THRESHOLDS, bs)[diff].all()
    out = bnb.dequantize_blockwise(G[key + "_codes"], G[key + "_absmax"], bs, FLOAT_DTYPES[dname])
    assert np.array_equal(bits(out), bits(G[key + "_out"]))


@pytest.mark.parametrize("qt", ["nf4", "fp4"])
def test_linear4bit_checkpoint_loads_bit_exact(qt):
    """A bnb.nn.Linear4bit state dict saved as safetensors (transformers' layout) loads and
    dequantizes to bitsandbytes' values bit for bit, through the public API."""
    tensors, _ = load_safetensors(GOLDEN / f"bnb_linear4bit_{qt}.safetensors")
    layer = {k[len("layer."):]: np.array(v) for k, v in tensors.items() if k.startswith("layer.")}
    state = qc.QuantState.from_dict({k: v for k, v in layer.items() if k != "weight"})
    assert state.quant_type == qt and state.nested and state.shape == (64, 96)
    w = qc.dequantize_4bit(layer["weight"], state)
    assert w.dtype == FLOAT_DTYPES["bfloat16"]
    assert np.array_equal(bits(w), bits(np.array(tensors["reference.weight_dequantized"])))
    # our own quantization of the original weight gives the same bytes but for threshold ties
    # (bf16 inputs sit on a grid, so x * (1/absmax) can hit a threshold exactly)
    original = np.array(tensors["reference.weight_original"])
    packed, ours = qc.quantize_4bit(original, 64, qt)
    diff = np.flatnonzero(bnb.unpack_4bit_bnb(packed, 64 * 96) != bnb.unpack_4bit_bnb(layer["weight"], 64 * 96))
    assert diff.size <= 4
    if diff.size:
        plain = bnb.quantize_4bit(original, 64, qt)[1]
        t = bnb.NF4_THRESHOLDS if qt == "nf4" else np.concatenate([bnb.FP4_THRESHOLDS, -bnb.FP4_THRESHOLDS])
        assert _near_threshold(original.reshape(-1), plain, t, 64)[diff].all()
    assert np.array_equal(ours.absmax, layer["weight.absmax"])


@pytest.mark.parametrize("qt", ["nf4", "fp4"])
def test_linear4bit_checkpoint_as_torch_tensors(qt):
    """The same state dict as transformers hands it over: torch tensors with layer prefixes."""
    torch = pytest.importorskip("torch", reason="the torch form of the state dict needs torch")
    st_torch = pytest.importorskip("safetensors.torch", reason="loading as torch needs safetensors")
    sd = st_torch.load_file(str(GOLDEN / f"bnb_linear4bit_{qt}.safetensors"))
    state = qc.QuantState.from_dict({k: v for k, v in sd.items()
                                     if k.startswith("layer.weight.")})
    w = qc.dequantize_4bit(sd["layer.weight"], state)
    assert isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16
    assert torch.equal(w.view(torch.int16), sd["reference.weight_dequantized"].view(torch.int16))
