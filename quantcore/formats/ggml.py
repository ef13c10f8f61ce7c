"""ggml block formats Q4_0, Q8_0, Q8_1 and the W4A8 dot product (ggml's rules; docs/formats.md).

Bit for bit with ggml's ``quantize_row_*_ref`` C functions for finite input (fp32 arithmetic,
no FMA contraction) and with gguf-py's ``quants.py``.

NaN / Inf rules (identical on every backend). C leaves the float-to-int8 conversion of a
non-finite value undefined; ggml's C reference compiled for x86 (``cvttss2si`` gives the "integer
indefinite" 0x80000000, whose low byte is 0) and gguf-py (numpy's cast) both write 0, and so does
quantcore: a scaled value ``x * id`` (Q8) or ``x * id + 8.5`` (Q4_0) that is NaN or +-Inf becomes
the integer 0 (Q4_0 code 0 after ``min(15, .)``, Q8 code 0). This covers

- NaN elements (``NaN * id``) and Inf elements (their block has ``d = +-inf``, ``id = +-0``, so
  ``Inf * 0 = NaN``); the block maximum skips NaN (``amax`` is NaN-ignoring);
- a block so small that ``1/d`` overflows fp32 (``d`` below ~2.9e-39: fp32 subnormals, and tiny
  normals for Q8 where ``d = amax/127``): ``id = inf``, every ``x * id`` is +-Inf or NaN, every code 0
  (the fp16 ``d`` of such a block is 0, so its values decode to 0 either way).

Finite values never leave the code range (``|x * id| <= 127.0001`` for Q8, ``<= 8`` for Q4_0).
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
#: Blocks per chunk in the chunked loops (temporaries ~40 bytes per element: ~40 MB at 2^15
#: blocks). Read at call time: tests lower it to check that chunking changes nothing.
CHUNK_BLOCKS = (1 << 20) // QK


def _chunk_blocks() -> int:
    return max(1, int(CHUNK_BLOCKS))


def _chunked_quantize(fn, x: np.ndarray, width: int, out: np.ndarray | None, qk: int = QK,
                      step: int | None = None) -> np.ndarray:
    """``fn`` (per-block math, [..., K] -> [..., K/qk, width]) over ``x``'s blocks, ``step`` blocks
    (default :data:`CHUNK_BLOCKS`) at a time.

    ``x`` [..., K] (K % qk == 0) -> uint8 [..., K/qk, width], written into ``out`` when given
    (contiguous uint8 of that shape). Inputs it cannot split (0-d, K % qk, empty) go to ``fn``
    whole, as before chunking.
    """
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % qk or x.size == 0:
        res = fn(x)
        if out is not None:
            out[...] = res
        return res if out is None else out
    shape = x.shape[:-1] + (x.shape[-1] // qk, width)
    flat = x.reshape(-1, qk)
    res = np.empty(shape, dtype=np.uint8) if out is None else out
    if res.shape != shape or res.dtype != np.uint8 or not res.flags.c_contiguous:
        raise AssertionError(f"out must be a contiguous uint8 array of shape {shape}")
    dst = res.reshape(-1, width)
    step = step or _chunk_blocks()
    for s in range(0, flat.shape[0], step):
        dst[s : s + step] = fn(flat[s : s + step]).reshape(-1, width)
    return res


def _chunked_dequantize(fn, q: np.ndarray, width: int, out: np.ndarray | None, qk: int = QK,
                        step: int | None = None) -> np.ndarray:
    """``fn`` (per-block math, uint8 [..., nb, width] -> fp32 [..., nb*qk]) ``step`` blocks (default
    :data:`CHUNK_BLOCKS`) at a time.

    Returns fp32 ``[..., nb*32]``, or writes ``out`` (contiguous, that shape, any float dtype:
    each chunk's fp32 values are cast to it). Inputs it cannot split go to ``fn`` whole.
    """
    q = np.asarray(q, dtype=np.uint8)
    if q.ndim < 2 or q.shape[-1] != width or q.size == 0:
        res = fn(q)
        if out is not None:
            out[...] = res.astype(out.dtype)
        return res if out is None else out
    shape = q.shape[:-2] + (q.shape[-2] * qk,)
    flat = q.reshape(-1, 1, width)
    res = np.empty(shape, dtype=F32) if out is None else out
    if res.shape != shape or not res.flags.c_contiguous:
        raise AssertionError(f"out must be a contiguous array of shape {shape}")
    dst = res.reshape(-1, qk)
    step = step or _chunk_blocks()
    for s in range(0, flat.shape[0], step):
        dst[s : s + step] = fn(flat[s : s + step]).reshape(-1, qk).astype(dst.dtype, copy=False)
    return res


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(F32).reshape(*x.shape[:-1], x.shape[-1] // QK, QK)


def _finite_or_zero(v: np.ndarray) -> np.ndarray:
    """fp64 of ``v`` with NaN and +-Inf replaced by 0 (x86's and gguf-py's int8 conversion)."""
    v64 = v.astype(np.float64)
    return np.where(np.isfinite(v64), v64, 0.0)


def _trunc_to_int(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """C's float-to-int truncation; NaN and +-Inf -> 0 (see the module docstring)."""
    return np.clip(np.trunc(_finite_or_zero(v)), lo, hi).astype(np.int32)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` (half away from zero), exact: computed in fp64 on fp32 inputs; NaN and
    +-Inf -> 0 (see the module docstring)."""
    v64 = _finite_or_zero(v)
    r = np.sign(v64) * np.floor(np.abs(v64) + 0.5)
    return np.clip(r, -128, 127).astype(np.int32)


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d != 0, F32(1.0) / np.where(d != 0, d, F32(1.0)), F32(0.0)).astype(F32)


def quantize_q4_0(w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``w [..., K]`` (K % 32 == 0) -> uint8 ``[..., K/32, 18]`` (into ``out`` when given)."""
    return _chunked_quantize(_quantize_q4_0, w, Q4_0_BLOCK_BYTES, out)


def _quantize_q4_0(w: np.ndarray) -> np.ndarray:
    """quantize_q4_0 over the whole of ``w``.

    Per block: ``max`` = the signed value of the first element of largest |x| (NaN skipped; +0.0
    when no element is a nonzero number, as llama.cpp), ``d = max / -8``, ``id = 1/d`` (0 if d == 0), ``q = min(15, trunc(f32(x*id) + 8.5))``;
    element j in the low nibble of ``qs[j]``, element j+16 in its high nibble.
    """
    b = _blocks(w)
    mag = np.abs(b)
    mag = np.where(np.isnan(mag), F32(-1.0), mag)
    first = np.argmax(mag, axis=-1)[..., None]
    mx = np.take_along_axis(b, first, axis=-1)[..., 0]
    # a block without a nonzero number starts from +0.0 as llama.cpp's quantize_row_q4_0_ref does
    # (its max only changes for a strictly larger |x|), so d = -0.0 even when x[0] is -0.0
    mx = np.where(np.isnan(mx) | (mx == 0), F32(0.0), mx).astype(F32)
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


def quantize_q8_0(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a [..., K]`` -> uint8 ``[..., K/32, 34]``: ``d = amax/127``, ``q = roundf(x * (1/d))``."""
    return _chunked_quantize(_quantize_q8_0, a, Q8_0_BLOCK_BYTES, out)


def _quantize_q8_0(a: np.ndarray) -> np.ndarray:
    _, d, q = _q8_core(a)
    out = np.empty(d.shape + (Q8_0_BLOCK_BYTES,), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = q.astype(np.int8).view(np.uint8)
    return out


def quantize_q8_1(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a [..., K]`` -> uint8 ``[..., K/32, 36]``: Q8_0's d and q, plus ``s = fp16(f32(sum(q)) * d)``."""
    return _chunked_quantize(_quantize_q8_1, a, Q8_1_BLOCK_BYTES, out)


def _quantize_q8_1(a: np.ndarray) -> np.ndarray:
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


def dequantize_q4_0(wq: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 ``[..., nb, 18]`` -> fp32 ``[..., nb*32]``: ``(q - 8) * d`` (cast into ``out`` if given)."""
    return _chunked_dequantize(_dequantize_q4_0, wq, Q4_0_BLOCK_BYTES, out)


def _dequantize_q4_0(wq: np.ndarray) -> np.ndarray:
    d, q = unpack_q4_0(wq)
    v = (q.astype(F32) - F32(Q4_0_OFFSET)) * d[..., None]
    return v.astype(F32).reshape(*v.shape[:-2], -1)


def dequantize_q8(aq: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 ``[..., nb, 34|36]`` -> fp32 ``[..., nb*32]``: ``q * d`` (cast into ``out`` if given)."""
    return _chunked_dequantize(lambda q: _dequantize_q8(q, kind), aq, BLOCK_BYTES[kind], out)


def _dequantize_q8(aq: np.ndarray, kind: str) -> np.ndarray:
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


# ---------------------------------------------------------------------------------------------
# Q6_K (ggml's k-quant super-block of 256 values; llama-quantize keeps output.weight in it for
# Q4_0 files). Bit for bit with ggml's ``quantize_row_q6_K_ref`` (ggml-quants.c) for every fp32
# input, NaN and Inf included: each fp32 operation of the C code is one fp32 numpy operation here,
# in the same order (no FMA: ggml-base is built without -march flags), and ggml's ``nearest_int``
# bit trick is reproduced on the fp32 bits, so even its out-of-range results match.
# ---------------------------------------------------------------------------------------------

QK_K = 256  #: elements per k-quant super-block
Q6_K_SUB = 16  #: elements per Q6_K sub-block (one int8 scale each)
#: ql uint8[128] (low 4 bits), qh uint8[64] (high 2 bits), scales int8[16], half d
Q6_K_BLOCK_BYTES = QK_K // 2 + QK_K // 4 + QK_K // Q6_K_SUB + 2
Q6_K_NMAX = 32  #: codes are 0..63, value = (code - 32) * d * scale
GROUP_MAX_EPS = F32(1e-15)  #: ggml's "all zero" threshold on a group's max
_NEAREST_INT_MAGIC = F32(12582912.0)  #: 1.5 * 2^23
#: 256-value super-blocks per chunk of the Q6_K loops (~30 KB of temporaries per super-block)
CHUNK_SUPERBLOCKS = 512


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: the low 23 bits of ``fp32(v + 1.5*2^23)`` minus 2^22, as int32.

    Round half to even for ``|v| <= 2^22``; for other values (and NaN / Inf) it gives what the C
    code gives on the same bits, because it is the same computation.
    """
    v = np.asarray(v, dtype=F32)
    with np.errstate(invalid="ignore", over="ignore"):
        s = (v + _NEAREST_INT_MAGIC).astype(F32)
    return (s.view(np.int32) & np.int32(0x007FFFFF)) - np.int32(0x00400000)


def _first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """C's ``if (fabsf(v) > amax) { amax = fabsf(v); max = v; }`` from ``amax = max = 0`` along the
    last axis: ``(amax, max)``, the first element of largest magnitude, NaN never taken."""
    ax = np.abs(x)
    key = np.where(np.isnan(ax), F32(-1.0), ax)
    first = np.argmax(key, axis=-1)[..., None]
    amax = np.take_along_axis(key, first, axis=-1)[..., 0]
    mx = np.take_along_axis(x, first, axis=-1)[..., 0]
    taken = amax > 0
    return np.where(taken, amax, F32(0.0)).astype(F32), np.where(taken, mx, F32(0.0)).astype(F32)


def _qx_pass(xt: np.ndarray, w: np.ndarray, iscale: np.ndarray, nmax: int):
    """One pass of make_qx_quants' loop on ``xt [n, G]`` (element-major): ``(l, sumlx, suml2)``,
    the sums accumulated in element order in fp32 (``w*x[i]*l`` and ``w*l*l`` left to right)."""
    with np.errstate(invalid="ignore", over="ignore"):
        l_int = np.clip(nearest_int(iscale[None, :] * xt), -nmax, nmax - 1)
        lf = l_int.astype(F32)
        t1 = (w * xt) * lf
        t2 = (w * lf) * lf
        sumlx = t1[0].copy()
        suml2 = t2[0].copy()
        for i in range(1, xt.shape[0]):
            sumlx += t1[i]
            suml2 += t2[i]
    return l_int, sumlx, suml2


def make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL)`` on every row of ``x [G, n]``.

    Returns ``(scale fp32 [G], L uint8 [G, n])``: the weighted least-squares scale over the 19
    candidate inverse scales ``-(nmax + 0.1*is)/max`` (is = 0, then -9..9 without 0), weights
    ``x*x``, and the codes ``l + nmax`` of the best candidate; an all-zero group (``amax < 1e-15``)
    gives scale 0 and codes 0.
    """
    x = np.asarray(x, dtype=F32)
    amax, mx = _first_absmax(x)
    zero = amax < GROUP_MAX_EPS
    safe_max = np.where(zero, F32(1.0), mx).astype(F32)
    xt = np.ascontiguousarray(x.T)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        w = xt * xt
        iscale = F32(-nmax) / safe_max
        l_int, sumlx, suml2 = _qx_pass(xt, w, iscale, nmax)
        L = (l_int + nmax).astype(np.uint8)
        scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, F32(1.0)), F32(0.0)).astype(F32)
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            num = F32(nmax) + F32(0.1) * F32(step)
            iscale = -num / safe_max
            l_int, sumlx, suml2 = _qx_pass(xt, w, iscale, nmax)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            if not better.any():
                continue
            L = np.where(better[None, :], (l_int + nmax).astype(np.uint8), L)
            scale = np.where(better, sumlx / np.where(better, suml2, F32(1.0)), scale).astype(F32)
            best = np.where(better, scale * sumlx, best).astype(F32)
    L = np.where(zero[None, :], np.uint8(0), L)
    scale = np.where(zero, F32(0.0), scale).astype(F32)
    return scale, np.ascontiguousarray(L.T)


def quantize_q6_k(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x [..., K]`` (K % 256 == 0) -> uint8 ``[..., K/256, 210]``, ggml's ``quantize_row_q6_K_ref``.

    Per super-block: 16 sub-block scales from :func:`make_qx_quants_rmse1` (nmax 32); ``d =
    fp16(1/iscale)`` with ``iscale = -128/max_scale`` (the scale of largest magnitude); int8
    ``scales = min(127, nearest_int(iscale*scale))``; codes ``clamp(nearest_int(x/(d*sc)), -32,
    31) + 32`` (a sub-block whose ``d*sc`` is 0 keeps make_qx_quants' codes); a super-block whose
    scales are all below 1e-15 in magnitude is all zero bytes.
    """
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        from ..errors import ShapeError

        raise ShapeError(f"Q6_K needs a last dimension that is a multiple of {QK_K}, got shape {x.shape}")
    return _chunked_quantize(lambda c: _quantize_q6_k(c.astype(F32)), x, Q6_K_BLOCK_BYTES, out, QK_K,
                             max(1, int(CHUNK_SUPERBLOCKS)))


def _quantize_q6_k(xb: np.ndarray) -> np.ndarray:
    nb = xb.shape[0]
    nsub = QK_K // Q6_K_SUB
    sub = xb.reshape(nb * nsub, Q6_K_SUB)
    scales, L = make_qx_quants_rmse1(sub, Q6_K_NMAX)
    scales = scales.reshape(nb, nsub)
    L = L.reshape(nb, nsub, Q6_K_SUB)
    max_abs, max_scale = _first_absmax(scales)
    zero = max_abs < GROUP_MAX_EPS
    safe = np.where(zero, F32(1.0), max_scale).astype(F32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        iscale = (F32(-128.0) / safe).astype(F32)
        d16 = (F32(1.0) / iscale).astype(F32).astype(np.float16)
        sc = np.minimum(127, nearest_int(iscale[:, None] * scales))
        sc8 = (sc & 0xFF).astype(np.uint8).view(np.int8)  # C's int -> int8_t conversion (wraps)
        d = (d16.astype(F32)[:, None] * sc8.astype(F32)).astype(F32)
        use = d != 0  # C: `if (!d) continue;` (NaN d is used)
        safe_d = np.where(use, d, F32(1.0)).astype(F32)
        q = np.clip(nearest_int(xb.reshape(nb, nsub, Q6_K_SUB) / safe_d[..., None]), -32, 31) + 32
    L = np.where(use[..., None], q.astype(np.uint8), L).reshape(nb, QK_K)
    out = np.zeros((nb, Q6_K_BLOCK_BYTES), dtype=np.uint8)
    # per half (128 values): ql[64] holds values l and l+64 (rows 0/2) and l+32, l+96 (rows 1/3)
    Lh = L.reshape(nb, 2, 4, 32)
    lo = Lh & 0x0F
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=-1)
    hi = Lh >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out[:, : QK_K // 2] = ql.reshape(nb, QK_K // 2)
    out[:, QK_K // 2 : QK_K // 2 + QK_K // 4] = qh.reshape(nb, QK_K // 4)
    out[:, QK_K // 2 + QK_K // 4 : -2] = sc8.view(np.uint8)
    out[:, -2:] = d16[:, None].view(np.uint8)
    out[zero] = 0
    return out


def unpack_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 ``[..., nb, 210]`` -> ``(d fp32 [..., nb], scales int8 [..., nb, 16], q int8 [..., nb, 256])``
    with q in -32..31 in element order."""
    b = np.asarray(blocks, dtype=np.uint8)
    lead = b.shape[:-1]
    ql = b[..., : QK_K // 2].reshape(*lead, 2, 2, 32)
    qh = b[..., QK_K // 2 : QK_K // 2 + QK_K // 4].reshape(*lead, 2, 1, 32)
    sc = np.ascontiguousarray(b[..., QK_K // 2 + QK_K // 4 : -2]).view(np.int8)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-2)  # rows: l, l+32, l+64, l+96
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 0x03
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return _half(b, Q6_K_BLOCK_BYTES - 2), sc, q.reshape(*lead, QK_K)


def dequantize_q6_k(blocks: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """uint8 ``[..., nb, 210]`` -> fp32 ``[..., nb*256]``: ``fp32(d * scale) * q`` as ggml's
    ``dequantize_row_q6_K`` (``d * sc[is] * q``, left to right in fp32)."""
    b = np.asarray(blocks, dtype=np.uint8)
    if b.ndim < 2 or b.shape[-1] != Q6_K_BLOCK_BYTES:
        from ..errors import ShapeError

        raise ShapeError(f"Q6_K blocks must have shape [..., nb, {Q6_K_BLOCK_BYTES}], got {b.shape}")
    if b.size == 0:  # no blocks: nothing to decode (the chunked loop passes such input whole)
        res = np.empty(b.shape[:-2] + (0,), dtype=F32) if out is None else out
        return res
    return _chunked_dequantize(_dequantize_q6_k, b, Q6_K_BLOCK_BYTES, out, QK_K, max(1, int(CHUNK_SUPERBLOCKS)))


def _dequantize_q6_k(chunk: np.ndarray) -> np.ndarray:
    d, sc, q = unpack_q6_k(chunk.reshape(-1, Q6_K_BLOCK_BYTES))
    with np.errstate(invalid="ignore", over="ignore"):
        ds = (d[:, None] * sc.astype(F32)).astype(F32)
        return (ds[:, :, None] * q.reshape(-1, QK_K // Q6_K_SUB, Q6_K_SUB).astype(F32)).astype(F32)
