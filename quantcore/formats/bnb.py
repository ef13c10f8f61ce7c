"""bitsandbytes formats: 4-bit NF4 / FP4, blockwise 8-bit (dynamic map), double quantization.

The rules are those of the peers' (bitsandbytes; docs/formats.md); the numpy functions here
are the reference semantics every backend must reproduce bit for bit. All work is vectorized, in
chunks of whole blocks (:data:`CHUNK_ELEMS`), so the temporaries stay a few tens of MB whatever the
tensor's size. Chunking changes no bit: every code and absmax is a function of its own block alone,
and the double-quantization offset (the mean of all absmax) is the same pairwise tree, summed an
aligned power-of-two chunk at a time (:func:`pairwise_sum_f64`).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32

#: Block sizes bitsandbytes accepts for 4-bit quantization.
BLOCKSIZES_4BIT = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: Block sizes for blockwise 8-bit.
BLOCKSIZES_8BIT = (64, 128, 256, 512, 1024, 2048, 4096)
#: Block size of the second-level (nested) quantization of absmax in double quantization.
NESTED_BLOCKSIZE = 256
#: Elements per chunk in the loops below (rounded down to whole blocks, at least one). The
#: temporaries of one chunk are about 25 bytes per element (quantize_4bit), ~26 MB at 2^20.
#: Read at call time: tests lower it to check that chunking changes nothing.
CHUNK_ELEMS = 1 << 20
QUANT_TYPES = ("nf4", "fp4")

#: NF4 code table, index = 4-bit code (bitsandbytes' ``get_4bit_type("nf4")``).
NF4_CODE = np.array(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    dtype=F32,
)
#: NF4 rounding thresholds (midpoints of adjacent codes, as bitsandbytes' dQuantizeNF4 has them);
#: code = number of thresholds t with ``x > t``.
NF4_THRESHOLDS = np.array(
    [
        -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
        -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
        0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
        0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
    ],
    dtype=F32,
)
#: bitsandbytes' own FP4 (sign bit 3, not E2M1): decode map in bit-pattern order.
#: As bitsandbytes' kernel decodes it: ``lut[code & 7] * (code & 8 ? -1 : 1)``, so 0b1000 is -0.0.
FP4_CODE = (
    np.array([0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3], dtype=F32) / F32(12)
).astype(F32)
#: FP4 magnitude thresholds on |x| (strict ``>``), ascending, and the 3-bit code each step selects.
FP4_THRESHOLDS = np.array(
    [0.00260417, 0.0859375, 0.20833333, 0.29166667, 0.4166667, 0.583333, 0.8333333], dtype=F32
)
FP4_STEP_CODES = np.array([0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011], dtype=np.uint8)
FP4_SIGN_BIT = 0b1000
#: The code of 0.0 for each 4-bit type (what a padded value of exactly zero becomes).
ZERO_CODE = {"nf4": 7, "fp4": 0}


def code_4bit(quant_type: str) -> np.ndarray:
    """The 16-entry fp32 decode table of ``quant_type`` ("nf4" or "fp4")."""
    return NF4_CODE if quant_type == "nf4" else FP4_CODE


#: bitsandbytes' ``create_dynamic_map(signed=True)`` as fp32 bit patterns. The table is a constant of
#: the format: bitsandbytes builds it with torch's fp32 ``linspace``, whose vectorized CPU path rounds
#: differently from numpy's (up to 12 values per range), so the exact bits are kept here and a test
#: recomputes them through torch and compares them with the ``nested_quant_map`` bitsandbytes writes.
_DYNAMIC_MAP_BITS = np.array(
    [
        0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
        0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
        0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
        0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
        0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
        0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
        0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
        0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
        0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
        0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
        0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
        0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
        0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
        0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
        0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
        0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
        0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
        0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
        0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
        0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
        0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
        0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
        0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
        0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
        0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
        0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
        0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
        0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
        0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
        0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
        0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
        0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
    ],
    dtype=np.uint32,
)


#: bitsandbytes' ``create_dynamic_map(signed=True)``: 256 fp32 values, code[127] == 0, code[255] == 1.
DYNAMIC_MAP = _DYNAMIC_MAP_BITS.view(F32)


def code_thresholds(code: np.ndarray) -> np.ndarray:
    """Decision thresholds for nearest-value rounding onto a sorted 256-entry ``code``.

    The exact midpoint of two fp32 values is exact in fp64. For an fp32 ``s``, ``s > mid`` holds
    exactly when ``s > floor_f32(mid)``, so the fp32 thresholds are the midpoints rounded toward
    -inf; ``index = number of thresholds t with s > t`` rounds to the nearest value with ties to
    the LOWER index, and NaN to index 0. Kernels receive this table as an input array.
    """
    code = np.asarray(code, dtype=F32)
    mid = (code[:-1].astype(np.float64) + code[1:].astype(np.float64)) / 2.0
    t = mid.astype(F32)
    too_high = t.astype(np.float64) > mid
    t[too_high] = np.nextafter(t[too_high], F32(-np.inf))
    return t


DYNAMIC_THRESHOLDS = code_thresholds(DYNAMIC_MAP)


def nblocks(n: int, blocksize: int) -> int:
    return -(-n // blocksize)


def chunk_elems(blocksize: int) -> int:
    """Elements per chunk for ``blocksize``: whole blocks (so an even number), at least one block."""
    return max(1, CHUNK_ELEMS // blocksize) * blocksize


def _flat(x: np.ndarray) -> np.ndarray:
    """The flattened input without a dtype conversion (a view when ``x`` is contiguous)."""
    return np.asarray(x).reshape(-1)


def _target(out: np.ndarray | None, size: int, dtype) -> np.ndarray:
    """A flat ``size``-element output: a fresh array, or ``out``'s flat view (contiguous, ``dtype``)."""
    if out is None:
        return np.empty(size, dtype=dtype)
    if out.size != size or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
        raise AssertionError(f"out must be a contiguous {np.dtype(dtype)} array of {size} elements")
    return out.reshape(-1)


def _blocks_f32(x: np.ndarray, blocksize: int) -> np.ndarray:
    """Flattened input as fp32, zero padded to whole blocks, shape [nblocks, blocksize]."""
    xf = np.ascontiguousarray(x).reshape(-1).astype(F32)
    nb = nblocks(xf.size, blocksize)
    pad = nb * blocksize - xf.size
    if pad:
        xf = np.concatenate([xf, np.zeros(pad, dtype=F32)])
    return xf.reshape(nb, blocksize)


def _absmax_and_scaled(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """absmax = NaN-ignoring max |x| per block; scaled = x * (1/absmax) in fp32, no clamp.

    Zero padding does not change a max of magnitudes. An all-zero block gives 1/0 = inf and
    0 * inf = NaN, which every rounding rule below maps to code 0, as bitsandbytes does.
    """
    absmax = np.fmax.reduce(np.abs(blocks), axis=1).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        recip = (F32(1.0) / absmax).astype(F32)
        scaled = (blocks * recip[:, None]).astype(F32)
    return absmax, scaled


def _round_4bit(scaled: np.ndarray, quant_type: str) -> np.ndarray:
    nan = np.isnan(scaled)
    if quant_type == "nf4":
        q = np.searchsorted(NF4_THRESHOLDS, scaled, side="left").astype(np.uint8)
        q[nan] = 0
        return q
    mag = np.abs(scaled)
    q = FP4_STEP_CODES[np.searchsorted(FP4_THRESHOLDS, mag, side="left").clip(0, 7)]
    q = np.where(nan, np.uint8(0), q)
    return (q | np.where(scaled < 0, np.uint8(FP4_SIGN_BIT), np.uint8(0))).astype(np.uint8)


def pack_4bit_bnb(q: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes bitsandbytes' way: element 2i in the HIGH nibble. Shape ((n+1)//2, 1)."""
    q = q.reshape(-1)
    if q.size % 2:
        raise AssertionError("pack_4bit_bnb expects an even number of codes (pad first)")
    return ((q[0::2] << 4) | q[1::2]).astype(np.uint8).reshape(-1, 1)


def unpack_4bit_bnb(packed: np.ndarray, n: int) -> np.ndarray:
    p = np.asarray(packed, dtype=np.uint8).reshape(-1)
    q = np.empty(p.size * 2, dtype=np.uint8)
    q[0::2] = p >> 4
    q[1::2] = p & 0x0F
    return q[:n]


def quantize_4bit(
    x: np.ndarray, blocksize: int, quant_type: str, packed: np.ndarray | None = None,
    absmax: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Reference 4-bit quantization of the flattened ``x`` (fp32 / fp16 / bf16).

    Returns ``(packed uint8 [(n+1)//2, 1], absmax fp32 [ceil(n/blocksize)])``, written into
    ``packed`` / ``absmax`` when given (contiguous, of those dtypes and sizes). The odd element's
    partner nibble is the block's quantization of 0.0 (normally the code of zero).
    """
    xf = _flat(x)
    n = int(xf.size)
    packed_out = np.empty(((n + 1) // 2, 1), dtype=np.uint8) if packed is None else packed
    pk = _target(packed_out, (n + 1) // 2, np.uint8)
    am = _target(absmax, nblocks(n, blocksize), F32)
    step = chunk_elems(blocksize)
    for s in range(0, n, step):
        m = min(step, n - s)
        a, scaled = _absmax_and_scaled(_blocks_f32(xf[s : s + m], blocksize))
        q = _round_4bit(scaled, quant_type).reshape(-1)[: m + (m % 2)]
        del scaled
        pk[s // 2 : s // 2 + (m + 1) // 2] = pack_4bit_bnb(q).reshape(-1)
        am[s // blocksize : s // blocksize + a.size] = a
    return packed_out, am


def dequantize_range_4bit(
    packed: np.ndarray, absmax: np.ndarray, start: int, stop: int, blocksize: int, code: np.ndarray
) -> np.ndarray:
    """fp32 ``code[q_i] * absmax[i // blocksize]`` for ``start <= i < stop`` of flat ``packed``
    (uint8, 1-D) and ``absmax`` (fp32, 1-D); any ``start``, odd or not."""
    p0, p1 = start // 2, (stop + 1) // 2
    q = unpack_4bit_bnb(packed[p0:p1], 2 * (p1 - p0))[start - 2 * p0 : stop - 2 * p0]
    vals = code[q]
    b0 = start // blocksize
    scale = np.repeat(absmax[b0 : nblocks(stop, blocksize)], blocksize)
    scale = scale[start - b0 * blocksize : stop - b0 * blocksize]
    return (vals * scale).astype(F32)


def dequantize_4bit(
    packed: np.ndarray, absmax: np.ndarray, n: int, blocksize: int, quant_type: str, out_dtype,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``out[i] = T(code[q_i] * absmax[i // blocksize])``: one fp32 multiply, one RNE rounding.

    Returns a flat ``[n]`` array of ``out_dtype``, or fills ``out`` (contiguous, ``n`` elements).
    """
    p = np.asarray(packed, dtype=np.uint8).reshape(-1)
    absmax = np.asarray(absmax, dtype=F32).reshape(-1)
    if 2 * p.size < n or absmax.size * blocksize < n:
        raise ValueError(f"{p.size} packed bytes and {absmax.size} absmax values cannot hold {n} elements")
    code = code_4bit(quant_type)
    res = _target(out, n, out_dtype)
    step = chunk_elems(blocksize)
    for s in range(0, n, step):
        e = min(s + step, n)
        res[s:e] = dequantize_range_4bit(p, absmax, s, e, blocksize, code).astype(out_dtype)
    return res if out is None else out


def quantize_blockwise(
    x: np.ndarray, blocksize: int, thresholds: np.ndarray = DYNAMIC_THRESHOLDS,
    codes: np.ndarray | None = None, absmax: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Reference blockwise 8-bit: ``(codes uint8 [n], absmax fp32 [nblocks])``, written into
    ``codes`` / ``absmax`` when given.

    Nearest code value (ties to the lower index, NaN to index 0) of ``x * (1/absmax)``.
    """
    xf = _flat(x)
    n = int(xf.size)
    q = _target(codes, n, np.uint8)
    am = _target(absmax, nblocks(n, blocksize), F32)
    step = chunk_elems(blocksize)
    for s in range(0, n, step):
        m = min(step, n - s)
        a, scaled = _absmax_and_scaled(_blocks_f32(xf[s : s + m], blocksize))
        scaled = scaled.reshape(-1)[:m]
        qc = np.searchsorted(thresholds, scaled, side="left").astype(np.uint8)
        qc[np.isnan(scaled)] = 0
        q[s : s + m] = qc
        am[s // blocksize : s // blocksize + a.size] = a
    return (q if codes is None else codes), am


def dequantize_blockwise(
    codes: np.ndarray, absmax: np.ndarray, blocksize: int, out_dtype, code: np.ndarray = DYNAMIC_MAP,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """``out[i] = T(code[q_i] * absmax[i // blocksize])``; flat, or written into ``out``."""
    codes = np.asarray(codes, dtype=np.uint8).reshape(-1)
    absmax = np.asarray(absmax, dtype=F32).reshape(-1)
    code = np.asarray(code, dtype=F32)
    n = codes.size
    if absmax.size * blocksize < n:
        raise ValueError(f"{absmax.size} absmax values cannot cover {n} codes in blocks of {blocksize}")
    res = _target(out, n, out_dtype)
    step = chunk_elems(blocksize)
    for s in range(0, n, step):
        e = min(s + step, n)
        scale = np.repeat(absmax[s // blocksize : nblocks(e, blocksize)], blocksize)[: e - s]
        res[s:e] = (code[codes[s:e]] * scale).astype(F32).astype(out_dtype)
    return res if out is None else out


def _tree_sum_f64(v: np.ndarray, size: int) -> np.float64:
    """Perfect-binary-tree sum of fp64 ``v`` zero padded to ``size`` (a power of two >= v.size)."""
    if size != v.size:
        v = np.concatenate([v, np.zeros(size - v.size)])
    while v.size > 1:
        v = v[0::2] + v[1::2]
    return np.float64(v[0])


def pairwise_sum_f64(values: np.ndarray) -> np.float64:
    """Sum in fp64 over a perfect binary tree in index order (zero padded to a power of two).

    Level by level, element i becomes ``v[2i] + v[2i+1]``. This is the one summation order all
    backends use for the double-quantization offset, so the offset is bit-identical everywhere
    (a GPU reduces aligned power-of-two chunks with the same tree, then the chunk sums). Here
    too: the tree's subtrees over aligned chunks of a power-of-two size (the last chunk zero
    padded to the full size) are summed one at a time, then the tree over the chunk sums.
    """
    v = _flat(values)
    if v.size == 0:
        return np.float64(0.0)
    chunk = 1 << (max(CHUNK_ELEMS, 1).bit_length() - 1)  # a power of two <= CHUNK_ELEMS
    if v.size <= chunk:
        return _tree_sum_f64(v.astype(np.float64), 1 << (v.size - 1).bit_length())
    sums = np.array([_tree_sum_f64(v[s : s + chunk].astype(np.float64), chunk)
                     for s in range(0, v.size, chunk)])
    return _tree_sum_f64(sums, 1 << (sums.size - 1).bit_length())


def absmax_offset(absmax: np.ndarray) -> np.float32:
    """Double-quantization offset: ``f32(pairwise_sum_f64(absmax) / n)``."""
    absmax = np.asarray(absmax, dtype=F32).reshape(-1)
    return F32(pairwise_sum_f64(absmax) / np.float64(absmax.size))


def double_quantize(
    absmax: np.ndarray, qabsmax: np.ndarray | None = None, absmax2: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Compress the fp32 absmax: ``(qabsmax uint8 [nb], absmax2 fp32 [ceil(nb/256)], offset)``.

    The offset is the mean of ALL absmax values; the centered values are then quantized chunk by
    chunk (written into ``qabsmax`` / ``absmax2`` when given).
    """
    absmax = np.asarray(absmax, dtype=F32).reshape(-1)
    offset = absmax_offset(absmax)
    nb = absmax.size
    q = _target(qabsmax, nb, np.uint8)
    a2 = _target(absmax2, nblocks(nb, NESTED_BLOCKSIZE), F32)
    step = chunk_elems(NESTED_BLOCKSIZE)
    for s in range(0, nb, step):
        centered = (absmax[s : s + step] - offset).astype(F32)
        quantize_blockwise(centered, NESTED_BLOCKSIZE, codes=q[s : s + centered.size],
                           absmax=a2[s // NESTED_BLOCKSIZE : nblocks(s + centered.size, NESTED_BLOCKSIZE)])
    return (q if qabsmax is None else qabsmax), (a2 if absmax2 is None else absmax2), offset


def dequantize_absmax(
    qabsmax: np.ndarray, absmax2: np.ndarray, offset, code2: np.ndarray = DYNAMIC_MAP
) -> np.ndarray:
    """``absmax[b] = code2[q[b]] * absmax2[b // 256] + offset``: two fp32 roundings, no FMA."""
    prod = dequantize_blockwise(qabsmax, absmax2, NESTED_BLOCKSIZE, F32, code2)
    return (prod + F32(offset)).astype(F32)
