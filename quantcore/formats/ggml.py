"""ggml block formats Q4_0, Q8_0, Q8_1 and the W4A8 dot product (``shared/design/FORMATS.md`` §3).

Bit for bit with ggml's ``quantize_row_*_ref`` C functions for finite input (fp32 arithmetic,
no FMA contraction). Non-finite input, which ggml leaves undefined, is defined here the way a
GPU's float-to-int conversion behaves: NaN converts to 0, out-of-range values saturate.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
QK = 32  #: elements per block, every ggml type here
Q4_0_BLOCK_BYTES = 18  #: half d; uint8 qs[16]
Q8_0_BLOCK_BYTES = 34  #: half d; int8 qs[32]
Q8_1_BLOCK_BYTES = 36  #: half d; half s; int8 qs[32]
Q4_0_OFFSET = 8  #: q4 codes are unsigned 0..15, value = (q - 8) * d
Q4_0_ROUND_BIAS = 8.5
Q8_MAX = 127
#: fp16 bits of Q8_1's ``s`` when it is NaN (a block with an infinity); see quantize_q8_1.
Q8_1_NAN_S_BITS = 0xFE00
Q8_1_NAN_S_F32 = np.array(0xFFC00000, dtype=np.uint32).view(F32)
BLOCK_BYTES = {"q4_0": Q4_0_BLOCK_BYTES, "q8_0": Q8_0_BLOCK_BYTES, "q8_1": Q8_1_BLOCK_BYTES}


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(F32).reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def _trunc_to_int(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """C's float-to-int truncation with a GPU's behaviour off range: NaN -> 0, saturate."""
    t = np.trunc(np.nan_to_num(v.astype(np.float64), nan=0.0, posinf=hi, neginf=lo))
    return np.clip(t, lo, hi).astype(np.int32)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` (half away from zero), exact: computed in fp64 on fp32 inputs."""
    v64 = np.nan_to_num(v.astype(np.float64), nan=0.0, posinf=Q8_MAX, neginf=-Q8_MAX)
    r = np.sign(v64) * np.floor(np.abs(v64) + 0.5)
    return np.clip(r, -128, 127).astype(np.int32)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1.0) / np.where(d != 0, d, F32(1.0)), F32(0.0)).astype(F32)


def quantize_q4_0(w: np.ndarray) -> np.ndarray:
    """``w [..., K]`` (K % 32 == 0) -> uint8 ``[..., K/32, 18]``.

    Per block: ``max`` = the signed value of the first element of largest |x| (NaN skipped),
    ``d = max / -8``, ``id = 1/d`` (0 if d == 0), ``q = min(15, trunc(f32(x*id) + 8.5))``;
    element j in the low nibble of ``qs[j]``, element j+16 in its high nibble.
    """
    b = _blocks(w)
    mag = np.abs(b)
    mag = np.where(np.isnan(mag), F32(-1.0), mag)
    first = np.argmax(mag, axis=-1)[..., None]
    mx = np.take_along_axis(b, first, axis=-1)[..., 0]
    mx = np.where(np.isnan(mx), F32(0.0), mx).astype(F32)
    d = (mx / F32(-Q4_0_OFFSET)).astype(F32)
    inv = _inverse(d)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = (b * inv[..., None]).astype(F32)
        biased = (scaled + F32(Q4_0_ROUND_BIAS)).astype(F32)
    q = np.minimum(15, _trunc_to_int(biased, -128, 127)).astype(np.uint8)
    out = np.empty(b.shape[:-1] + (Q4_0_BLOCK_BYTES,), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = (q[..., :16] & 0x0F) | (q[..., 16:] << 4)
    return out


def _q8_core(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    b = _blocks(a)
    amax = np.fmax.reduce(np.abs(b), axis=-1)
    amax = np.where(np.isnan(amax), F32(0.0), amax).astype(F32)
    d = (amax / F32(Q8_MAX)).astype(F32)
    inv = _inverse(d)
    with np.errstate(invalid="ignore", over="ignore"):
        q = _round_half_away((b * inv[..., None]).astype(F32))
    return b, d, q


def quantize_q8_0(a: np.ndarray) -> np.ndarray:
    """``a [..., K]`` -> uint8 ``[..., K/32, 34]``: ``d = amax/127``, ``q = roundf(x * (1/d))``."""
    _, d, q = _q8_core(a)
    out = np.empty(d.shape + (Q8_0_BLOCK_BYTES,), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q.astype(np.int8).view(np.uint8)
    return out


def quantize_q8_1(a: np.ndarray) -> np.ndarray:
    """``a [..., K]`` -> uint8 ``[..., K/32, 36]``: Q8_0's d and q, plus ``s = fp16(f32(sum(q)) * d)``."""
    _, d, q = _q8_core(a)
    with np.errstate(invalid="ignore"):
        s = (q.sum(axis=-1).astype(F32) * d).astype(F32)
    # A block holding an infinity has d = inf and q = 0, so s = 0 * inf = NaN. Pin its bits to
    # the x86 default NaN (0xFFC00000 -> fp16 0xFE00) so every host and kernel writes the same.
    s = np.where(np.isnan(s), Q8_1_NAN_S_F32, s)
    out = np.empty(d.shape + (Q8_1_BLOCK_BYTES,), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    with np.errstate(over="ignore"):
        out[..., 2:4] = s.astype(np.float16)[..., None].view(np.uint8)
    out[..., 4:] = q.astype(np.int8).view(np.uint8)
    return out


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(F32)


def unpack_q4_0(wq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """-> ``(d fp32 [..., nb], q uint8 [..., nb, 32])`` with q in 0..15."""
    wq = np.asarray(wq, dtype=np.uint8)
    qs = wq[..., 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return _half(wq, 0), q


def unpack_q8(aq: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """-> ``(d, q int8 [..., nb, 32], s or None)`` for kind "q8_0" / "q8_1"."""
    aq = np.asarray(aq, dtype=np.uint8)
    if kind == "q8_1":
        return _half(aq, 0), aq[..., 4:].view(np.int8), _half(aq, 2)
    return _half(aq, 0), aq[..., 2:].view(np.int8), None


def dequantize_q4_0(wq: np.ndarray) -> np.ndarray:
    """uint8 ``[..., nb, 18]`` -> fp32 ``[..., nb*32]``: ``(q - 8) * d``."""
    d, q = unpack_q4_0(wq)
    v = (q.astype(F32) - F32(Q4_0_OFFSET)) * d[..., None]
    return v.astype(F32).reshape(*v.shape[:-2], -1)


def dequantize_q8(aq: np.ndarray, kind: str) -> np.ndarray:
    """uint8 ``[..., nb, 34|36]`` -> fp32 ``[..., nb*32]``: ``q * d``."""
    d, q, _ = unpack_q8(aq, kind)
    v = q.astype(F32) * d[..., None]
    return v.astype(F32).reshape(*v.shape[:-2], -1)


def gemm_q4_0_q8_1(wq: np.ndarray, aq: np.ndarray) -> np.ndarray:
    """``out[m, n] = sum_b d4[m,b] * (d8[n,b] * sum_j q4*q8 - 8 * s8[n,b])``, evaluated in fp64.

    ``wq`` uint8 [M, K/32, 18], ``aq`` uint8 [N, K/32, 36] -> fp64 [M, N]. Integer dot products are
    exact; the float part is fp64, so this is the reference the tolerance tier measures against.
    """
    d4, q4 = unpack_q4_0(wq)
    d8, q8, s8 = unpack_q8(aq, "q8_1")
    sumi = np.einsum("mbj,nbj->mnb", q4.astype(np.int32), q8.astype(np.int32), optimize=True)
    inner = d8.astype(np.float64)[None] * sumi - Q4_0_OFFSET * s8.astype(np.float64)[None]
    return np.einsum("mb,mnb->mn", d4.astype(np.float64), inner, optimize=True)
