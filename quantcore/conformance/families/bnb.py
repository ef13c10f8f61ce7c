"""bitsandbytes family: 4-bit NF4 / FP4, double quantization, blockwise 8-bit, gemv_4bit.

Bit-exact against :mod:`quantcore.formats.bnb`: quantize_4bit, dequantize_4bit (plain and with
nested statistics), double_quantize, quantize_blockwise, dequantize_blockwise. Tolerance:
gemv_4bit against an fp64 reference (:func:`quantcore.conformance.bounds.gemv_4bit`). Safety:
invalid inputs through the public API. Adversarial inputs are described in :data:`QUANTIZE_KINDS`.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

import numpy as np

from ... import api
from ...backend import Backend, Capability, Nested
from ...formats import bnb
from ...state import QuantState
from .. import bounds
from ..harness import (
    BIT_EXACT,
    DTYPES,
    F32,
    TOLERANCE,
    U8,
    Case,
    Out,
    Verdict,
    cast,
    check_op_bits,
    check_op_tolerance,
    compare_bits,
    compare_grouped,
    compare_tolerance,
    declared_group,
    finfo,
    neighbours,
    pick_blocksizes,
    scaled_normal,
    subnormals,
)
from ..invalid import Invalid, host_array_case, same_error_cases

FAMILY = "bnb"

#: Inputs of the quantizers (4-bit and 8-bit), by name; each names what it targets.
QUANTIZE_KINDS = {
    "random": "normal values, per-block scales over 16 octaves, partial last block, odd n",
    "whole-blocks": "n a multiple of the block size",
    "one": "a single element",
    "three": "three elements (odd, one partial block)",
    "nd": "a 2-D input (the public API passes the caller's shape)",
    "zero-blocks": "all +0.0 blocks, all -0.0 blocks, a zero partial last block",
    "thresholds": "values exactly on every rounding threshold and one ulp either side",
    "ties-scaled": "absmax not a power of two, x * (1/absmax) rounding exactly onto a threshold",
    "nonfinite": "NaN, +Inf, -Inf, an all-NaN block, NaN in the partial last block",
    "subnormal": "subnormal values of the input dtype, alone and beside normal ones",
    "huge": "values at the top of the dtype's range, beside tiny ones",
}
QUANTIZE_KINDS_FULL = {"large": "2^20 + 3 elements", "random-2": "a second random draw"}

DEQUANTIZE_KINDS = {
    "random-bytes": "every code in random order, absmax over 40 octaves, partial last block",
    "roundtrip": "the reference's own quantization of normal data",
    "absmax-special": "absmax 0, +Inf, NaN, subnormal, 3e38 and negative",
    "one": "a single element",
    "three": "three elements",
    "nd": "2-D output, 1-D packed input (what the public API passes)",
}
NESTED_KINDS = {
    "nested-random": "random codes, random nested statistics over 257+ blocks (partial group)",
    "nested-roundtrip": "the reference's quantization + double quantization",
    "nested-custom-code2": "a nested code table that is not the dynamic map",
}


def _thresholds(qt: str) -> np.ndarray:
    if qt == "nf4":
        return bnb.NF4_THRESHOLDS.astype(np.float64)
    if qt == "fp4":
        t = bnb.FP4_THRESHOLDS.astype(np.float64)
        return np.concatenate([t, -t])
    return bnb.DYNAMIC_THRESHOLDS.astype(np.float64)


def quantize_input(kind: str, rng: np.random.Generator, bs: int, dtype: str, thresholds: np.ndarray
                   ) -> np.ndarray:
    """The input array (dtype ``dtype``) of one quantizer case."""
    T = DTYPES[dtype]
    info = finfo(T)
    if kind == "random" or kind == "random-2":
        return cast(scaled_normal(rng, 5 * bs + bs // 2 + 1, bs), T)
    if kind == "whole-blocks":
        return cast(scaled_normal(rng, 4 * bs, bs), T)
    if kind == "large":
        return cast(scaled_normal(rng, (1 << 20) + 3, bs), T)
    if kind == "one":
        return cast(rng.standard_normal(1) * 3, T)
    if kind == "three":
        return cast(rng.standard_normal(3), T)
    if kind == "nd":
        return cast(scaled_normal(rng, 3 * (bs + 7), bs), T).reshape(3, bs + 7)
    if kind == "zero-blocks":
        x = scaled_normal(rng, 6 * bs + 5, bs)
        x[bs: 2 * bs] = 0.0
        x[3 * bs: 4 * bs] = -0.0
        x[6 * bs:] = 0.0
        return cast(x, T)
    if kind == "thresholds":
        # A block whose absmax is a power of two s has r = 1/s exact, so x * r lands exactly on
        # the threshold t when x = t * s is representable (always for fp32).
        vals = neighbours(thresholds, T).astype(np.float64)
        per_block = bs - 1
        nblocks = max(4, -(-2 * vals.size // per_block))
        x = np.empty(nblocks * bs)
        for b in range(nblocks):
            s = float(2.0 ** int(rng.integers(-6, 7 if dtype != "float16" else 5)))
            pick = rng.choice(vals, per_block, replace=vals.size < per_block)
            block = cast(pick * s, T).astype(np.float64)
            block = np.clip(block, -s, s)
            x[b * bs] = s if b % 2 == 0 else -s
            x[b * bs + 1: (b + 1) * bs] = block
        return cast(x, T)
    if kind == "ties-scaled":
        # With r = f32(1/absmax) inexact, f32(x * r) can still land exactly on a threshold; on
        # the fp16 / bf16 grids this is how real data hits ties. Search a few absmax values per
        # block and keep the one giving the most exact ties.
        nblocks = 4
        x = np.empty(nblocks * bs)
        for b in range(nblocks):
            best = None
            for _ in range(16):
                a = float(cast(rng.uniform(0.5, 8.0), T).astype(np.float64))
                r = np.float32(1) / np.float32(a)
                cand = np.unique(neighbours(thresholds * a, T).astype(np.float64))
                cand = cand[np.abs(cand) <= a]
                hit = np.isin((cand.astype(np.float32) * r).astype(np.float32),
                              thresholds.astype(np.float32))
                if best is None or hit.sum() > best[0]:
                    best = (int(hit.sum()), a, cand[hit], cand)
            _, a, ties, near = best
            pool = ties if ties.size else near
            x[b * bs] = a if b % 2 == 0 else -a
            x[b * bs + 1: (b + 1) * bs] = rng.choice(pool, bs - 1)
        return cast(x, T)
    if kind == "nonfinite":
        x = scaled_normal(rng, 6 * bs + 3, bs)
        x[rng.integers(0, bs, 3)] = np.nan
        x[bs + int(rng.integers(0, bs))] = np.inf
        x[2 * bs + int(rng.integers(0, bs // 2))] = -np.inf
        x[2 * bs + bs // 2 + int(rng.integers(0, bs // 2))] = np.inf
        x[3 * bs: 4 * bs] = np.nan
        x[4 * bs] = np.nan
        x[6 * bs + 1] = np.nan
        return cast(x, T)
    if kind == "subnormal":
        x = cast(scaled_normal(rng, 4 * bs, bs), T)
        x[:bs] = subnormals(rng, bs, T)
        x[bs: 2 * bs] = subnormals(rng, bs, T)
        x[bs + int(rng.integers(0, bs))] = T.type(1.0)
        x[2 * bs: 3 * bs] = T.type(0.0)
        x[2 * bs + int(rng.integers(0, bs))] = info.smallest_subnormal
        return x
    if kind == "huge":
        big = float(info.max)
        x = rng.uniform(0.5, 1.0, 4 * bs) * rng.choice([-1.0, 1.0], 4 * bs) * big
        x[bs: 2 * bs] = rng.standard_normal(bs) * 1e-3
        x[bs + int(rng.integers(0, bs))] = big
        x[2 * bs] = -big
        x[3 * bs:] = rng.standard_normal(bs)
        return cast(x, T)
    raise KeyError(kind)


# -- bit-exact cases -------------------------------------------------------------------------------
def _quantize_4bit(cap: Capability, kind: str, be: Backend, rng: np.random.Generator) -> Verdict:
    x = quantize_input(kind, rng, cap.blocksize, cap.dtype, _thresholds(cap.fmt))
    n = x.size
    packed, absmax = bnb.quantize_4bit(x, cap.blocksize, cap.fmt)

    def call(i, o):
        be.quantize_4bit(i["x"], o["packed"], o["absmax"], blocksize=cap.blocksize, quant_type=cap.fmt)

    outs = [Out("packed", ((n + 1) // 2, 1), U8), Out("absmax", absmax.shape, F32)]
    return check_op_bits(be, call, {"x": x}, outs, {"packed": packed, "absmax": absmax})


#: Inputs of quantize_4bit with double quantization (Backend.quantize_4bit_nested), by name.
NESTED_QUANT_KINDS = {
    "nested-random": "normal values over 772.5 blocks (three nested blocks and a partial one)",
    "nested-specials": "the zero-blocks, thresholds, subnormal and huge inputs, then normal values",
    "nested-nonfinite": "the nonfinite input first (an all-NaN block: a NaN offset, which every code follows)",
}
NESTED_QUANT_KINDS_FULL = {"nested-large": "2^21 elements + 3 blocks (129 units of 256 blocks)"}


def _quantize_4bit_nested(cap: Capability, kind: str, be: Backend, rng: np.random.Generator) -> Verdict:
    bs, T = cap.blocksize, DTYPES[cap.dtype]
    if kind == "nested-large":
        x = cast(scaled_normal(rng, ((1 << 21) // bs + 3) * bs, bs), T)
    else:
        head = {"nested-random": [], "nested-nonfinite": ["nonfinite"],
                "nested-specials": ["zero-blocks", "thresholds", "subnormal", "huge"]}[kind]
        parts = [quantize_input(k, rng, bs, cap.dtype, _thresholds(cap.fmt)).reshape(-1) for k in head]
        parts = [np.concatenate([p, np.zeros(-p.size % bs, dtype=p.dtype)]) for p in parts]  # whole blocks
        used = sum(p.size for p in parts)
        parts.append(cast(scaled_normal(rng, 772 * bs + bs // 2 + 1 - used, bs), T))
        x = np.concatenate(parts)
    n = x.size
    packed, absmax = bnb.quantize_4bit(x, bs, cap.fmt)
    q, a2, off = bnb.double_quantize(absmax)

    def call(i, o):
        be.quantize_4bit_nested(i["x"], o["packed"], o["qabsmax"], o["absmax2"], o["offset"], blocksize=bs,
                                quant_type=cap.fmt)

    outs = [Out("packed", ((n + 1) // 2, 1), U8), Out("qabsmax", q.shape, U8), Out("absmax2", a2.shape, F32),
            Out("offset", (1,), F32)]
    refs = {"packed": packed, "qabsmax": q, "absmax2": a2, "offset": np.array([off], dtype=np.float32)}
    return check_op_bits(be, call, {"x": x}, outs, refs)


def _random_absmax(rng: np.random.Generator, nb: int, octaves: float = 20.0) -> np.ndarray:
    return np.exp2(rng.uniform(-octaves, octaves, nb)).astype(np.float32)


def _nested_stats(kind: str, rng: np.random.Generator, nb: int):
    """(qabsmax uint8 [nb], absmax2 fp32, offset fp32 [1], code2 fp32 [256])."""
    nb2 = bnb.nblocks(nb, bnb.NESTED_BLOCKSIZE)
    code2 = bnb.DYNAMIC_MAP
    if kind == "nested-custom-code2":
        code2 = np.sort(rng.uniform(-1, 1, 256)).astype(np.float32)
    q = rng.integers(0, 256, nb, dtype=np.uint8)
    absmax2 = _random_absmax(rng, nb2, 6.0)
    offset = np.array([rng.uniform(0.5, 2.0)], dtype=np.float32)
    return q, absmax2, offset, code2


def _dequantize_4bit(cap: Capability, kind: str, be: Backend, rng: np.random.Generator) -> Verdict:
    bs, qt, T = cap.blocksize, cap.fmt, DTYPES[cap.dtype]
    out_shape: tuple[int, ...]
    nested = kind.startswith("nested")
    n = {"one": 1, "three": 3, "nd": 3 * (bs + 7)}.get(kind, 5 * bs + bs // 2 + 1)
    if nested:
        n = 257 * bs + bs // 2 + 1
    out_shape = (3, bs + 7) if kind == "nd" else (n,)
    nb = bnb.nblocks(n, bs)
    packed = rng.integers(0, 256, ((n + 1) // 2, 1), dtype=np.uint8)
    absmax = _random_absmax(rng, nb)
    inputs: dict[str, np.ndarray] = {}
    if kind == "roundtrip":
        packed, absmax = bnb.quantize_4bit(cast(scaled_normal(rng, n, bs), T), bs, qt)
    elif kind == "absmax-special":
        special = np.array([0.0, np.inf, np.nan, 1e-40, 3e38, -1.5, -0.0], dtype=np.float32)
        absmax[: special.size] = special[: nb] if nb < special.size else special
    elif kind == "nd":
        packed = packed.reshape(-1)
    if nested:
        if kind == "nested-roundtrip":
            packed, a = bnb.quantize_4bit(cast(scaled_normal(rng, n, bs), T), bs, qt)
            q, absmax2, off = bnb.double_quantize(a)
            offset, code2 = np.array([off], dtype=np.float32), bnb.DYNAMIC_MAP
        else:
            q, absmax2, offset, code2 = _nested_stats(kind, rng, nb)
        inputs.update(absmax2=absmax2, code2=code2, offset=offset)
        absmax_in = q
        effective = bnb.dequantize_absmax(q, absmax2, offset[0], code2)
    else:
        absmax_in = effective = absmax
    inputs.update(packed=packed, absmax=absmax_in)
    ref = bnb.dequantize_4bit(packed, effective, n, bs, qt, T).reshape(out_shape)

    def call(i, o):
        nest = Nested(i["absmax2"], i["code2"], i["offset"]) if nested else None
        be.dequantize_4bit(i["packed"], i["absmax"], o["out"], blocksize=bs, quant_type=qt, nested=nest)

    return check_op_bits(be, call, inputs, [Out("out", out_shape, T)], {"out": ref})


DOUBLE_QUANT_SIZES = {"quick": (1, 2, 255, 256, 257, 1000, 4099, 65543), "full": (
    1, 2, 3, 255, 256, 257, 511, 512, 513, 1000, 4099, 65536, 65543, (1 << 20) + 3)}
DOUBLE_QUANT_KINDS = ("random", "equal", "with-zeros", "nonfinite", "wide-range")


def _double_quantize(cap: Capability, kind: str, nb: int, be: Backend, rng: np.random.Generator
                     ) -> Verdict:
    absmax = np.abs(rng.standard_normal(nb)).astype(np.float32) * 3 + np.float32(0.01)
    if kind == "equal":
        absmax[:] = np.float32(rng.uniform(0.1, 10))
    elif kind == "with-zeros":
        absmax[rng.integers(0, nb, max(1, nb // 7))] = 0.0
    elif kind == "nonfinite":
        absmax[int(rng.integers(0, nb))] = np.inf if nb % 2 else np.nan
    elif kind == "wide-range":
        absmax = _random_absmax(rng, nb, 60.0)
    q, a2, off = bnb.double_quantize(absmax)

    def call(i, o):
        be.double_quantize(i["absmax"], o["qabsmax"], o["absmax2"], o["offset"])

    outs = [Out("qabsmax", (nb,), U8), Out("absmax2", a2.shape, F32), Out("offset", (1,), F32)]
    refs = {"qabsmax": q, "absmax2": a2, "offset": np.array([off], dtype=np.float32)}
    return check_op_bits(be, call, {"absmax": absmax}, outs, refs)


def _quantize_blockwise(cap: Capability, kind: str, be: Backend, rng: np.random.Generator) -> Verdict:
    x = quantize_input(kind, rng, cap.blocksize, cap.dtype, _thresholds("dynamic8"))
    codes, absmax = bnb.quantize_blockwise(x, cap.blocksize)

    def call(i, o):
        be.quantize_blockwise(i["x"], i["thresholds"], o["codes"], o["absmax"], blocksize=cap.blocksize)

    outs = [Out("codes", x.shape, U8), Out("absmax", absmax.shape, F32)]
    inputs = {"x": x, "thresholds": bnb.DYNAMIC_THRESHOLDS}
    return check_op_bits(be, call, inputs, outs, {"codes": codes.reshape(x.shape), "absmax": absmax})


BLOCKWISE_DEQUANT_KINDS = {
    "random-bytes": "every code, absmax over 40 octaves, partial last block",
    "roundtrip": "the reference's quantization of normal data",
    "absmax-special": "absmax 0, +Inf, NaN, subnormal, 3e38 and negative",
    "custom-code": "a code table that is not the dynamic map (the op takes it as an input)",
    "one": "a single element",
    "nd": "a 2-D input and output",
}


def _dequantize_blockwise(cap: Capability, kind: str, be: Backend, rng: np.random.Generator) -> Verdict:
    bs, T = cap.blocksize, DTYPES[cap.dtype]
    shape = {"one": (1,), "nd": (3, bs + 7)}.get(kind, (5 * bs + bs // 2 + 1,))
    n = int(np.prod(shape))
    nb = bnb.nblocks(n, bs)
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    absmax = _random_absmax(rng, nb)
    code = bnb.DYNAMIC_MAP
    if kind == "roundtrip":
        c, absmax = bnb.quantize_blockwise(cast(scaled_normal(rng, n, bs), T), bs)
        codes = c.reshape(shape)
    elif kind == "absmax-special":
        special = np.array([0.0, np.inf, np.nan, 1e-40, 3e38, -1.5, -0.0], dtype=np.float32)
        absmax[: min(nb, special.size)] = special[: min(nb, special.size)]
    elif kind == "custom-code":
        code = np.sort(rng.uniform(-2, 2, 256)).astype(np.float32)
    ref = bnb.dequantize_blockwise(codes, absmax, bs, T, code).reshape(shape)

    def call(i, o):
        be.dequantize_blockwise(i["codes"], i["absmax"], i["code"], o["out"], blocksize=bs)

    inputs = {"codes": codes, "absmax": absmax, "code": code}
    return check_op_bits(be, call, inputs, [Out("out", shape, T)], {"out": ref})


# -- tolerance: gemv_4bit --------------------------------------------------------------------------
def gemv_shapes(level: str, bs: int) -> list[tuple[int, int, int]]:
    """(batch B, N, K) for one blocksize: batch 1..8, 16..512 (prefill), N off every tile multiple,
    K a multiple of the blocksize, K not one (blocks straddle rows), K odd (so N*K is odd and a
    row starts mid-byte), and a large K at the full level. Odd positions run with double
    quantization."""
    k_odd = 2 * bs + 7
    # many rows at the quick level: the tiled paths with double quantization (100 rows: a partial
    # row tile; N 65: a partial weight tile) and without (64 rows; K crossing absmax blocks)
    many_quick = [(100, 65, 192), (64, 19, 2 * bs + 64)]
    if level == "quick":
        return [(1, 33, 3 * bs), (3, 17, 2 * bs), (8, 9, bs), (17, 5, k_odd), (2, 7, k_odd), *many_quick]
    # many rows (prefill): the tiled paths' partial row and column tiles (17, 100 rows; N 33, 130, 201)
    # and whole ones (64, 512 rows); K of a few 64-element stages (blocks straddle rows above bs 128)
    many = [(17, 130, 128), (64, 33, 192), (100, 201, 64), (512, 40, 128), (100, 9, k_odd)]
    shapes = [(1, 1, bs), (1, 33, 3 * bs), (2, 7, k_odd), (3, 129, bs), (4, 33, 3 * bs),
              (5, 9, k_odd), (6, 17, bs), (7, 300, 3 * bs), (8, 33, k_odd), (9, 65, bs),
              (17, 33, 3 * bs), (32, 7, bs + 32), (1, 64, 16384), (8, 16, 16384), *many, *many_quick]
    return shapes


def _gemv_operands(rng: np.random.Generator, cap: Capability, n: int, k: int, nested: bool,
                   a_shape: tuple[int, ...]):
    """Native-ready inputs, the exact fp64 A and W, for gemv_4bit."""
    T = DTYPES[cap.dtype]
    w_src = cast(rng.standard_normal((n, k)) * np.exp2(rng.uniform(-2, 2, (n, 1))), T)
    packed, absmax = bnb.quantize_4bit(w_src, cap.blocksize, cap.fmt)
    inputs: dict[str, np.ndarray] = {"packed": packed}
    if nested:
        q, absmax2, off = bnb.double_quantize(absmax)
        offset = np.array([off], dtype=np.float32)
        inputs.update(absmax=q, absmax2=absmax2, code2=bnb.DYNAMIC_MAP, offset=offset)
        effective = bnb.dequantize_absmax(q, absmax2, off)
    else:
        inputs["absmax"] = effective = absmax
    codes = bnb.unpack_4bit_bnb(packed, n * k)
    w = (bnb.code_4bit(cap.fmt)[codes].astype(np.float64)
         * np.repeat(effective.astype(np.float64), cap.blocksize)[: n * k]).reshape(n, k)
    a = cast(rng.standard_normal(a_shape), T)
    inputs["a"] = a
    return inputs, a.reshape(-1, k).astype(np.float64), w


def _gemv_4bit(cap: Capability, shape: tuple[int, int, int], nested: bool, a_nd: tuple[int, ...] | None,
               be: Backend, rng: np.random.Generator) -> Verdict:
    b, n, k = shape
    a_shape = a_nd if a_nd is not None else (b, k)
    inputs, a64, w64 = _gemv_operands(rng, cap, n, k, nested, a_shape)
    ref, bound = bounds.gemv_4bit(a64, w64, cap.dtype)
    rows = a64.shape[0]

    def call(i, o):
        nest = Nested(i["absmax2"], i["code2"], i["offset"]) if nested else None
        be.gemv_4bit(i["a"], i["packed"], i["absmax"], o["out"], n=n, k=k, blocksize=cap.blocksize,
                     quant_type=cap.fmt, nested=nest)

    return check_op_tolerance(be, call, inputs, Out("out", (rows, n), DTYPES[cap.dtype]), ref, bound)


# -- the public API, end to end with the backend's arrays -------------------------------------------
def _api_roundtrip(cap: Capability, be: Backend, rng: np.random.Generator) -> Verdict:
    """quantize_4bit (double quant) + dequantize_4bit through the public API, compared with the
    numpy reference backend on numpy arrays: every array of the state and the result bit for bit."""
    v = Verdict()
    x = cast(scaled_normal(rng, 3 * 5 * cap.blocksize + 6, cap.blocksize), DTYPES[cap.dtype])
    x = x.reshape(3, -1)
    results = []
    for backend, arr, back in ((_reference(), lambda a: a, np.asarray),
                               (be, be.from_numpy, lambda t: np.asarray(be.to_numpy(t)))):
        packed, state = api.quantize_4bit(arr(x), cap.blocksize, cap.fmt, compress_statistics=True,
                                          backend=backend)
        out = api.dequantize_4bit(packed, state, backend=backend)
        results.append({"packed": back(packed), "absmax": back(state.absmax),
                        "absmax2": back(state.state2.absmax), "offset": back(state.offset),
                        "out": back(out)})
    for name, ref in results[0].items():
        got = results[1][name]
        if got.shape != ref.shape:
            v.fail(BIT_EXACT, f"{name}: shape {got.shape}, the reference backend gives {ref.shape}")
            continue
        compare_bits(name, [results[1]], ref, None, v)
    return v


def _api_gemv(cap: Capability, be: Backend, rng: np.random.Generator) -> Verdict:
    """gemv_4bit through the public API with a 3-D activation [2, 3, K] (batch 6)."""
    v = Verdict()
    n, k = 19, 2 * cap.blocksize
    inputs, a64, w64 = _gemv_operands(rng, cap, n, k, False, (2, 3, k))
    state = QuantState(absmax=be.from_numpy(inputs["absmax"]), shape=(n, k),
                       code=be.from_numpy(bnb.code_4bit(cap.fmt)), blocksize=cap.blocksize,
                       quant_type=cap.fmt, dtype=cap.dtype)
    out = api.gemv_4bit(be.from_numpy(inputs["a"]), be.from_numpy(inputs["packed"]), state, backend=be)
    got = np.asarray(be.to_numpy(out))
    if got.shape != (2, 3, n):
        v.fail(TOLERANCE, f"gemv_4bit returned shape {got.shape}, expected (2, 3, {n})")
        return v
    ref, bound = bounds.gemv_4bit(a64, w64, cap.dtype)
    compare_tolerance("out", [{"out": got.reshape(6, n)}], ref, bound, None, v)
    return v


def _api_gemv_grouped(cap: Capability, rows: int, nested: bool | None, be: Backend,
                      rng: np.random.Generator) -> Verdict:
    """gemv_4bit_grouped through the public API: three weights of one K (N 33, 9, 17: partial tiles)
    and ``rows`` input rows; each column block against its own weight's bound. ``nested`` None: six
    weights (more than one launch takes on cuda and sycl), double quantization on every other one."""
    v = Verdict()
    k = 3 * cap.blocksize if cap.blocksize <= 512 else cap.blocksize
    ns = (33, 9, 17) if nested is not None else (33, 9, 17, 40, 8, 12)
    nests = (nested,) * len(ns) if nested is not None else (True, False) * 3
    a = cast(rng.standard_normal((rows, k)), DTYPES[cap.dtype])
    weights, refs = [], []
    for n, nested in zip(ns, nests):
        inputs, _, w64 = _gemv_operands(rng, cap, n, k, nested, (1, k))
        state2 = offset = None
        if nested:
            state2 = QuantState(absmax=be.from_numpy(inputs["absmax2"]), code=be.from_numpy(inputs["code2"]),
                                blocksize=bnb.NESTED_BLOCKSIZE, dtype="float32")
            offset = be.from_numpy(inputs["offset"])
        state = QuantState(absmax=be.from_numpy(inputs["absmax"]), shape=(n, k),
                           code=be.from_numpy(bnb.code_4bit(cap.fmt)), blocksize=cap.blocksize,
                           quant_type=cap.fmt, dtype=cap.dtype, offset=offset, state2=state2)
        weights.append((be.from_numpy(inputs["packed"]), state))
        refs.append(bounds.gemv_4bit(a.astype(np.float64), w64, cap.dtype))
    out = api.gemv_4bit_grouped(be.from_numpy(a), weights, backend=be)
    compare_grouped("gemv_4bit_grouped", np.asarray(be.to_numpy(out)), rows, list(zip(ns, refs)), v)
    return v


def _api_blockwise(cap: Capability, be: Backend, rng: np.random.Generator) -> Verdict:
    v = Verdict()
    x = cast(scaled_normal(rng, 2 * 3 * cap.blocksize + 10, cap.blocksize), DTYPES[cap.dtype])
    results = []
    for backend, arr, back in ((_reference(), lambda a: a, np.asarray),
                               (be, be.from_numpy, lambda t: np.asarray(be.to_numpy(t)))):
        codes, state = api.quantize_blockwise(arr(x.reshape(2, -1)), cap.blocksize, backend=backend)
        out = api.dequantize_blockwise(codes, state, backend=backend)
        results.append({"codes": back(codes), "absmax": back(state.absmax), "out": back(out)})
    for name, ref in results[0].items():
        compare_bits(name, [results[1]], ref, None, v)
    return v


def _reference() -> Backend:
    from ...backends.reference import ReferenceBackend

    return ReferenceBackend()


# -- invalid inputs ----------------------------------------------------------------------------------
def _state(arr, n: int = 100, bs: int = 64, qt: str = "nf4", **over) -> QuantState:
    x = np.linspace(-1, 1, n, dtype=np.float32)
    packed, absmax = bnb.quantize_4bit(x, bs, qt)
    fields = dict(absmax=arr(absmax), shape=(n,), code=arr(bnb.code_4bit(qt)), blocksize=bs,
                  quant_type=qt, dtype="float32")
    fields.update(over)
    return QuantState(**fields)


def _nested(arr, n: int = 100, **over) -> QuantState:
    """A nested (double-quantized) state of the same data as :func:`_state`, fields overridden."""
    x = np.linspace(-1, 1, n, dtype=np.float32)
    _, absmax = bnb.quantize_4bit(x, 64, "nf4")
    qabsmax, absmax2, offset = bnb.double_quantize(absmax)
    state2 = QuantState(absmax=arr(absmax2), code=arr(bnb.DYNAMIC_MAP), blocksize=bnb.NESTED_BLOCKSIZE,
                        dtype="float32")
    fields = dict(absmax=arr(qabsmax), shape=(n,), code=arr(bnb.NF4_CODE), blocksize=64, quant_type="nf4",
                  dtype="float32", offset=arr(np.array([offset], np.float32)), state2=state2)
    fields.update(over)
    return QuantState(**fields)


def _packed(n: int = 100) -> np.ndarray:
    return bnb.quantize_4bit(np.linspace(-1, 1, n, dtype=np.float32), 64, "nf4")[0]


def _invalid() -> list[Invalid]:
    f32 = np.linspace(-1, 1, 128, dtype=np.float32)
    q4 = "quantize_4bit"
    dq4 = "dequantize_4bit"
    gv = "gemv_4bit"

    def gemv_state(arr):
        w = np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64)
        p, a = bnb.quantize_4bit(w, 64, "nf4")
        return arr(p), QuantState(absmax=arr(a), shape=(8, 64), code=arr(bnb.NF4_CODE), blocksize=64,
                                  quant_type="nf4", dtype="float32")

    def gemv_call(arr, be, a, state_shape=None):
        p, st = gemv_state(arr)
        if state_shape is not None:
            st.shape = state_shape
        return lambda: api.gemv_4bit(arr(a), p, st, backend=be)

    return [
        Invalid("int32-input", q4, lambda arr, be: lambda: api.quantize_4bit(
            arr(np.arange(64, dtype=np.int32)), compress_statistics=False, backend=be)),
        Invalid("float64-input", q4, lambda arr, be: lambda: api.quantize_4bit(
            arr(f32.astype(np.float64)), compress_statistics=False, backend=be)),
        Invalid("empty-input", q4, lambda arr, be: lambda: api.quantize_4bit(
            arr(np.zeros(0, np.float32)), compress_statistics=False, backend=be)),
        Invalid("blocksize-48", q4, lambda arr, be: lambda: api.quantize_4bit(
            arr(f32), 48, compress_statistics=False, backend=be)),
        Invalid("quant-type-int4", q4, lambda arr, be: lambda: api.quantize_4bit(
            arr(f32), 64, "int4", compress_statistics=False, backend=be)),
        Invalid("packed-float32", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed().astype(np.float32)), _state(arr), backend=be)),
        Invalid("packed-too-short", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()[:-1]), _state(arr), backend=be)),
        Invalid("absmax-wrong-length", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr, absmax=arr(np.ones(3, np.float32))), backend=be)),
        Invalid("state-blocksize-48", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr, blocksize=48), backend=be)),
        Invalid("out-dtype-int8", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr), out_dtype="int8", backend=be)),
        Invalid("state-not-quantstate", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), {"absmax": arr(np.ones(2, np.float32))}, backend=be)),
        Invalid("valid-call", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr), backend=be)),
        Invalid("A-wrong-K", gv, lambda arr, be: gemv_call(arr, be, np.ones((1, 65), np.float32))),
        Invalid("A-float64", gv, lambda arr, be: gemv_call(arr, be, np.ones((1, 64), np.float64))),
        Invalid("state-1d", gv, lambda arr, be: gemv_call(arr, be, np.ones((1, 64), np.float32),
                                                          state_shape=(512,))),
        # hardening (the hostile-user cases): built-in exceptions or silent acceptance before
        Invalid("list-input", q4, lambda arr, be: lambda: api.quantize_4bit(
            [0.5] * 64, compress_statistics=False, backend=be)),
        Invalid("python-float-input", q4, lambda arr, be: lambda: api.quantize_4bit(1.5, backend=be)),
        Invalid("blocksize-float", q4, lambda arr, be: lambda: api.quantize_4bit(arr(f32), 64.0, backend=be)),
        Invalid("blocksize-numpy-int", q4, lambda arr, be: lambda: api.quantize_4bit(
            arr(f32), np.int64(64), "nf4", False, backend=be)),  # valid: numpy integers are ints
        Invalid("state-negative-shape", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr, shape=(-100,)), backend=be)),
        Invalid("state-float-shape", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr, shape=(100.0,)), backend=be)),
        Invalid("state-dtype-garbage", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr, dtype="garbage"), backend=be)),
        Invalid("state-blocksize-float", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr, blocksize=64.5), backend=be)),
        Invalid("state2-dict", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _nested(arr, state2={"absmax": 1}), backend=be)),
        Invalid("offset-float64", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _nested(arr, offset=arr(np.array([0.5], np.float64))), backend=be)),
        Invalid("offset-int32", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _nested(arr, offset=arr(np.array([1], np.int32))), backend=be)),
        Invalid("fp4-type-on-nf4-table", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr, quant_type="fp4", code=arr(bnb.NF4_CODE)), backend=be)),
        Invalid("reversed-nf4-table", dq4, lambda arr, be: lambda: api.dequantize_4bit(
            arr(_packed()), _state(arr, code=arr(np.ascontiguousarray(bnb.NF4_CODE[::-1]))), backend=be)),
        Invalid("blocksize-32", "quantize_blockwise", lambda arr, be: lambda: api.quantize_blockwise(
            arr(f32), 32, backend=be)),
        Invalid("uint8-input", "quantize_blockwise", lambda arr, be: lambda: api.quantize_blockwise(
            arr(np.zeros(64, np.uint8)), 64, backend=be)),
        Invalid("codes-wrong-count", "dequantize_blockwise", lambda arr, be: lambda: api.dequantize_blockwise(
            arr(np.zeros(100, np.uint8)), QuantState(absmax=arr(np.ones(2, np.float32)), shape=(128,),
                                                     code=arr(bnb.DYNAMIC_MAP), blocksize=64), backend=be)),
        Invalid("code-128-entries", "dequantize_blockwise", lambda arr, be: lambda: api.dequantize_blockwise(
            arr(np.zeros(128, np.uint8)), QuantState(absmax=arr(np.ones(2, np.float32)), shape=(128,),
                                                     code=arr(bnb.DYNAMIC_MAP[:128]), blocksize=64),
            backend=be)),
    ]


def _host_quantize(be: Backend, cap: Capability):
    x = cast(np.linspace(-1, 1, 2 * cap.blocksize), DTYPES[cap.dtype])
    return api.quantize_4bit(x, cap.blocksize, cap.fmt, compress_statistics=False, backend=be)


# -- the family's cases ------------------------------------------------------------------------------
def cases(level: str, declared: frozenset[Capability]) -> Iterable[Case]:
    """Every bitsandbytes case for the declared capabilities at ``level``."""
    q_kinds = list(QUANTIZE_KINDS) + (list(QUANTIZE_KINDS_FULL) if level == "full" else [])
    nested_kinds = list(NESTED_QUANT_KINDS) + (list(NESTED_QUANT_KINDS_FULL) if level == "full" else [])
    dq_cap = Capability("double_quantize", "dynamic8", "float32", bnb.NESTED_BLOCKSIZE)
    for qt in bnb.QUANT_TYPES:
        for dtype in DTYPES:
            for bs in pick_blocksizes(declared, "quantize_4bit", qt, dtype, level):
                cap = Capability("quantize_4bit", qt, dtype, bs)
                for kind in q_kinds:
                    yield Case(f"bnb/quantize_4bit/{qt}/{dtype}/bs{bs}/{kind}", BIT_EXACT, cap,
                               partial(_quantize_4bit, cap, kind))
                if dq_cap in declared:
                    for kind in nested_kinds:
                        yield Case(f"bnb/quantize_4bit/{qt}/{dtype}/bs{bs}/{kind}", BIT_EXACT, cap,
                                   partial(_quantize_4bit_nested, cap, kind), requires=(dq_cap,))
            for bs in pick_blocksizes(declared, "dequantize_4bit", qt, dtype, level):
                cap = Capability("dequantize_4bit", qt, dtype, bs)
                for kind in list(DEQUANTIZE_KINDS) + list(NESTED_KINDS):
                    yield Case(f"bnb/dequantize_4bit/{qt}/{dtype}/bs{bs}/{kind}", BIT_EXACT, cap,
                               partial(_dequantize_4bit, cap, kind))
            for bs in pick_blocksizes(declared, "gemv_4bit", qt, dtype, level):
                cap = Capability("gemv_4bit", qt, dtype, bs)
                for j, (b, n, k) in enumerate(gemv_shapes(level, bs)):
                    nested = j % 2 == 1
                    tag = "-nested" if nested else ""
                    yield Case(f"bnb/gemv_4bit/{qt}/{dtype}/bs{bs}/B{b}-N{n}-K{k}{tag}", TOLERANCE, cap,
                               partial(_gemv_4bit, cap, (b, n, k), nested, None))
                k = 2 * bs
                yield Case(f"bnb/gemv_4bit/{qt}/{dtype}/bs{bs}/A-1d-N9-K{k}", TOLERANCE, cap,
                           partial(_gemv_4bit, cap, (1, 9, k), False, (k,)))
                yield Case(f"bnb/gemv_4bit/{qt}/{dtype}/bs{bs}/A-3d-2x3-N9-K{k}-nested", TOLERANCE, cap,
                           partial(_gemv_4bit, cap, (6, 9, k), True, (2, 3, k)))
    for dtype in DTYPES:
        for bs in pick_blocksizes(declared, "quantize_blockwise", "dynamic8", dtype, level):
            cap = Capability("quantize_blockwise", "dynamic8", dtype, bs)
            for kind in q_kinds:
                yield Case(f"bnb/quantize_blockwise/dynamic8/{dtype}/bs{bs}/{kind}", BIT_EXACT, cap,
                           partial(_quantize_blockwise, cap, kind))
        for bs in pick_blocksizes(declared, "dequantize_blockwise", "dynamic8", dtype, level):
            cap = Capability("dequantize_blockwise", "dynamic8", dtype, bs)
            for kind in BLOCKWISE_DEQUANT_KINDS:
                yield Case(f"bnb/dequantize_blockwise/dynamic8/{dtype}/bs{bs}/{kind}", BIT_EXACT, cap,
                           partial(_dequantize_blockwise, cap, kind))
    cap = Capability("double_quantize", "dynamic8", "float32", bnb.NESTED_BLOCKSIZE)
    if cap in declared:
        for nb in DOUBLE_QUANT_SIZES[level]:
            for kind in DOUBLE_QUANT_KINDS:
                if kind != "random" and nb > 70000:
                    continue
                yield Case(f"bnb/double_quantize/dynamic8/float32/bs256/{kind}-nb{nb}", BIT_EXACT, cap,
                           partial(_double_quantize, cap, kind, nb))
    yield from _api_cases(declared)
    yield from same_error_cases(FAMILY, _invalid(), declared)
    yield from host_array_case(FAMILY, "quantize_4bit", declared, _host_quantize)


def _api_cases(declared: frozenset[Capability]) -> Iterable[Case]:
    for cap in _first_per_dtype(declared, "quantize_4bit"):
        need = (Capability("double_quantize", "dynamic8", "float32", bnb.NESTED_BLOCKSIZE),
                Capability("dequantize_4bit", cap.fmt, cap.dtype, cap.blocksize))
        if all(c in declared for c in need):
            yield Case(f"bnb/quantize_4bit/{cap.fmt}/{cap.dtype}/bs{cap.blocksize}/api-roundtrip",
                       BIT_EXACT, cap, partial(_api_roundtrip, cap), requires=need)
    for cap in _first_per_dtype(declared, "gemv_4bit"):
        yield Case(f"bnb/gemv_4bit/{cap.fmt}/{cap.dtype}/bs{cap.blocksize}/api-A-3d", TOLERANCE, cap,
                   partial(_api_gemv, cap))
        for rows, nested in ((1, True), (5, False), (16, True), (19, True), (3, None), (12, None)):
            tag = "-nested" if nested else "-six-mixed" if nested is None else ""
            yield Case(f"bnb/gemv_4bit/{cap.fmt}/{cap.dtype}/bs{cap.blocksize}/api-grouped-B{rows}{tag}", TOLERANCE,
                       cap, partial(_api_gemv_grouped, cap, rows, nested))
    for cap in _first_per_dtype(declared, "quantize_blockwise"):
        need = (Capability("dequantize_blockwise", cap.fmt, cap.dtype, cap.blocksize),)
        if all(c in declared for c in need):
            yield Case(f"bnb/quantize_blockwise/{cap.fmt}/{cap.dtype}/bs{cap.blocksize}/api-roundtrip",
                       BIT_EXACT, cap, partial(_api_blockwise, cap), requires=need)


def _first_per_dtype(declared: frozenset[Capability], op: str) -> list[Capability]:
    """One declared capability of ``op`` per dtype, preferring blocksize 64 and nf4."""
    best: dict[str, Capability] = {}
    for cap in declared_group(declared, op):
        cur = best.get(cap.dtype)
        score = (cap.blocksize != 64, cap.fmt != "nf4", cap.blocksize)
        if cur is None or score < (cur.blocksize != 64, cur.fmt != "nf4", cur.blocksize):
            best[cap.dtype] = cap
    return [best[d] for d in DTYPES if d in best]
