"""Error bounds of the tolerance tier, derived from the arithmetic each op is allowed to do.

Notation: ``u_T`` is the unit roundoff of dtype T (half an ulp of 1: fp32 ``2^-24``, fp16
``2^-11``, bf16 ``2^-8``), ``u32`` that of fp32, ``eta_T`` the largest error of one rounding into
T's subnormal range (half its smallest subnormal). One rounding of a value v into T gives
``v (1 + d) + e`` with ``|d| <= u_T`` and ``|e| <= eta_T``. The reference is exact (fp64 on
operands that are exact in fp64), so the bounds below cover every rounding a correct kernel makes.

gemv_4bit (``out[b, n] = T(sum_k a[b,k] * w[n,k])`` with ``w = code[q] * absmax``)
------------------------------------------------------------------------------------
Allowed arithmetic: any kernel that forms each term ``a_k * w_k`` with at most ``c_T`` roundings
in T or fp32, adds the K terms in fp32 in any order, and rounds the sum to T once.

- fp32 (``c = 2``): ``w = f32(code * absmax)`` and ``f32(a * w)``.
- fp16 / bf16 (``c = 4``): bitsandbytes' kernels form ``B = T(code) * T(absmax)`` in T and the
  product ``a * B`` in T: four roundings in T (each relative ``u_T``) per term.

Per term: ``|fl(t_k) - t_k| <= ((1 + u_T)^c - 1) |t_k| + c eta_T``. fp32 summation of K terms in
any order (Higham, Accuracy and Stability, thm 4.3 / eq. 4.4): error ``<= gamma_{K-1} sum |t_k|``
with ``gamma_m = m u32 / (1 - m u32)``. The final rounding to T adds ``u_T |acc|``. With
``S = sum_k |a_k w_k|`` (computed in fp64 per output element), to first order:

    |out - ref| <= 1.05 * (u_T |ref| + (c u_T + (K - 1) u32) S) + c K eta_T

The factor 1.05 covers the second-order terms (``c u_T <= 1/64`` and ``K u32 <= 1e-3`` for
K <= 16384, so they are below 3% of the first-order ones). This is a worst-case bound per element:
every kernel following the rules passes it, whatever its summation order.

The NMSE bound is statistical. Treat each rounding as an independent error of mean square at
most ``u^2 v^2`` (the worst case ``|d| <= u``; a uniformly distributed one has ``u^2 / 3``).
The test activations are zero-mean random numbers independent of the weights, so the partial sums
of the fp32 accumulation are random walks with ``sum_j s_j^2 <= K Q`` and the shared roundings
(one T(absmax) per block, one T(code) per code value) contribute like independent ones in
expectation. With ``Q = sum_k (a_k w_k)^2``:

    E[(out - ref)^2] <= u_T^2 ref^2 + (c u_T^2 + K u32^2) Q =: E
    NMSE = sum (out - ref)^2 / sum ref^2 <= 16 * sum E / sum ref^2

The margin 16 (4x in RMS, over an estimate that is itself >= 3x the uniform-rounding mean square)
keeps a correct kernel far from the bound while a kernel that accumulates in fp16 / bf16, drops a
partial block or mixes up block scales exceeds it.

gemm_q4_0_q8_1 / gemm_w4a8 (``out[m, n] = sum_b d4 (d8 sumi - 8 s8)``, fp32 output)
---------------------------------------------------------------------------------
``sumi = sum_j q4 q8`` is an exact integer (|sumi| <= 32 * 15 * 128 < 2^24, exact in fp32); d4,
d8, s8 are fp16 values (exact in fp32); ``8 s8`` is exact. A kernel may evaluate a block in any
association with at most ``c = 4`` fp32 roundings (for example ``d4 * d8``, ``* sumi``,
``d4 * 8 * s8``, the subtraction), each on a value bounded by
``V_b = |d4| (|d8 sumi| + 8 |s8|)``, so the cancellation inside ``d8 sumi - 8 s8`` is accounted
for. Then ``nb = K / 32`` block terms are added in fp32 in any order. With ``S = sum_b V_b``:

    |out - ref| <= 1.05 * (u32 |ref| + (4 + nb - 1) u32 S) + 4 nb eta_32

and, as above, with ``Q = sum_b V_b^2``: ``NMSE <= 16 * sum u32^2 (ref^2 + (4 + nb) Q) / sum ref^2``.
For gemm_w4a8 the reference first quantizes the activation with the core's ``quantize_q8_1``:
the kernel must produce the same Q8_1 bytes internally, so it is held to the same bound (an
online quantizer that differs, for example ``s = sum(x)`` or ``x / d``, shows up as an error far
above these bounds at small K).

linear_mx (``out[b, n] = T(sum_k a[b,k] * w[n,k])``, ``w`` the dequantized fp4 weight)
----------------------------------------------------------------------------------
The weight values are exact in fp64 (MXFP4 ``e2m1 * 2^e``; NVFP4 ``e2m1 * s / g``, which the
core's reference rounds to fp32 once). Allowed arithmetic: each term ``a_k * w_k`` formed with at
most ``c = 4`` fp32 roundings (the product, a per-block partial sum times its scale, the NVFP4
``1/g`` and its application), the K terms added in fp32 in any order, one rounding to T:

    |out - ref| <= 1.05 * (u_T |ref| + (c + K - 1) u32 S) + c K eta_32 + eta_T

and ``NMSE <= 16 * sum (u_T^2 ref^2 + (c + K) u32^2 Q) / sum ref^2`` (S, Q as for gemv_4bit).
Unlike gemv_4bit, no rounding in fp16 / bf16 is allowed before the final one.
"""

from __future__ import annotations

import numpy as np

from .harness import UNDERFLOW_ERROR, UNIT_ROUNDOFF, Bound

U32 = UNIT_ROUNDOFF["float32"]
NMSE_MARGIN = 16.0
SECOND_ORDER = 1.05


def _products(a: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """fp64 ``a @ w.T``, ``|a| @ |w|.T``, ``a^2 @ (w^2).T`` and K for ``a`` [B, K], ``w`` [N, K].
    einsum, not BLAS: multithreaded BLAS can be slower by 1000x on a loaded 2-core machine, and the
    reference need not be fast, only exact enough (fp64)."""
    a = np.asarray(a, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    return (np.einsum("bk,nk->bn", a, w), np.einsum("bk,nk->bn", np.abs(a), np.abs(w)),
            np.einsum("bk,nk->bn", a * a, w * w), a.shape[1])


def gemv_4bit(a: np.ndarray, w: np.ndarray, dtype: str) -> tuple[np.ndarray, Bound]:
    """fp64 reference ``a @ w.T`` and its bound; ``a`` [B, K] and ``w`` [N, K] exact values."""
    ref, s, q, k = _products(a, w)
    u, eta = UNIT_ROUNDOFF[dtype], UNDERFLOW_ERROR[dtype]
    c = 2 if dtype == "float32" else 4
    max_abs = SECOND_ORDER * (u * np.abs(ref) + (c * u + (k - 1) * U32) * s) + c * k * eta
    e = u * u * ref * ref + (c * u * u + k * U32 * U32) * q
    nmse = NMSE_MARGIN * float(e.sum()) / max(float((ref * ref).sum()), 1e-300)
    derivation = (f"Bound for {dtype}, K={k}: |err| <= 1.05*(u_T|ref| + ({c} u_T + (K-1) u32) "
                  f"sum|a w|) + {c} K eta_T; NMSE <= 16 sum(u_T^2 ref^2 + ({c} u_T^2 + K u32^2) "
                  "sum (a w)^2) / sum ref^2 (see quantcore.conformance.bounds)")
    return ref, Bound(max_abs=max_abs, nmse=nmse, derivation=derivation)


def gemm_q4_0_q8_1(d4: np.ndarray, q4: np.ndarray, d8: np.ndarray, q8: np.ndarray,
                   s8: np.ndarray) -> tuple[np.ndarray, Bound]:
    """fp64 reference and bound from unpacked operands.

    ``d4`` [M, nb], ``q4`` [M, nb, 32] (0..15), ``d8`` / ``s8`` [N, nb], ``q8`` [N, nb, 32].
    """
    d4 = d4.astype(np.float64)
    d8 = d8.astype(np.float64)
    s8 = s8.astype(np.float64)
    nb = d4.shape[1]
    sumi = np.einsum("mbj,nbj->mnb", q4.astype(np.int32), q8.astype(np.int32), optimize=True)
    inner = d8[None] * sumi - 8.0 * s8[None]
    ref = np.einsum("mb,mnb->mn", d4, inner)
    v = np.abs(d4)[:, None, :] * (np.abs(d8[None] * sumi) + 8.0 * np.abs(s8)[None])
    s = v.sum(axis=-1)
    q = (v * v).sum(axis=-1)
    eta = UNDERFLOW_ERROR["float32"]
    max_abs = SECOND_ORDER * (U32 * np.abs(ref) + (4 + nb - 1) * U32 * s) + 4 * nb * eta
    e = U32 * U32 * (ref * ref + (4 + nb) * q)
    nmse = NMSE_MARGIN * float(e.sum()) / max(float((ref * ref).sum()), 1e-300)
    derivation = (f"Bound for fp32 output, K={nb * 32}: |err| <= 1.05*(u32|ref| + (4 + nb - 1) u32 "
                  "sum_b |d4|(|d8 sumi| + 8|s8|)); NMSE <= 16 sum u32^2 (ref^2 + (4 + nb) "
                  "sum_b V_b^2) / sum ref^2 (see quantcore.conformance.bounds)")
    return ref, Bound(max_abs=max_abs, nmse=nmse, derivation=derivation)


def linear_mx(a: np.ndarray, w: np.ndarray, dtype: str) -> tuple[np.ndarray, Bound]:
    """fp64 reference ``a @ w.T`` and its bound (module docstring, linear_mx); ``a`` [B, K] and
    ``w`` [N, K] exact values."""
    ref, s, q, k = _products(a, w)
    u, eta = UNIT_ROUNDOFF[dtype], UNDERFLOW_ERROR[dtype]
    c = 4
    max_abs = (SECOND_ORDER * (u * np.abs(ref) + (c + k - 1) * U32 * s)
               + c * k * UNDERFLOW_ERROR["float32"] + eta)
    e = u * u * ref * ref + (c + k) * U32 * U32 * q
    nmse = NMSE_MARGIN * float(e.sum()) / max(float((ref * ref).sum()), 1e-300)
    derivation = (f"Bound for {dtype}, K={k}: |err| <= 1.05*(u_T|ref| + (4 + K - 1) u32 sum|a w|) "
                  "+ 4 K eta_32 + eta_T; NMSE <= 16 sum(u_T^2 ref^2 + (4 + K) u32^2 sum (a w)^2) / "
                  "sum ref^2 (see quantcore.conformance.bounds)")
    return ref, Bound(max_abs=max_abs, nmse=nmse, derivation=derivation)
