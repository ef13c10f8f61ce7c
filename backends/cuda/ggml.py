"""The cuda backend's ggml family: Q4_0 / Q8_0 / Q8_1 quantize and dequantize, and the W4A8 GEMMs
(the N <= 8 stream kernel, the int8 tensor-core kernel). ``GgmlOps`` holds the ops (a mixin of
``CudaBackend``)."""

from __future__ import annotations

from typing import Any

from quantcore.formats import ggml
from quantcore.formats.kernel_defines import (
    W4A8_TC_GEOMETRY,
)
from quantcore.formats.kernel_interface import arg_index

from . import runtime as rt
from .common import _FG, GGML_FMT, TYPE_TAG, _b, _cdiv, _tag
from .runtime import Launcher, aligned, kernel_args

#: gemm_w4a8_tc_kernel configurations (MT, WGM, WGN, WGK, ST), widest tile first: WGM x WGN x WGK warps
#: (rows x columns x K), a warp 16 MT rows x 32 columns, the CTA tile 16 MT WGM x 32 WGN, ST stages
_W4T_TILES = ((4, 2, 4, 1, 3), (2, 4, 2, 1, 4), (2, 2, 2, 2, 6), (1, 2, 1, 4, 4))
#: the time per output element of the first 4 configurations relative to the first's (measured at
#: n = 4096, docs/performance.md "W4A8 prefill"); the launcher takes the smallest
#: waves x BM x BN x cost (waves of one CTA per multiprocessor); w4t_tile=i forces one
_W4T_COST = (1.0, 1.14, 1.41, 1.92)
# gemm_w4a8_stream_kernel: kWsWarps (+ 1 producer for LD 0), kWsRows
_W4_STREAM_WARPS, _W4_STREAM_ROWS = W4A8_TC_GEOMETRY["QC_WS_WARPS"], W4A8_TC_GEOMETRY["QC_WS_ROWS"]
#: threads per CTA of the codecs and the activation pass (one block each)
_THREADS = W4A8_TC_GEOMETRY["QC_GGML_THREADS"]
_W4_SMEM_MAX = 227 * 1024  # dynamic shared memory per CTA on sm_90
#: gemm_w4a8_stream_kernel launches kept per (device, M, N, K, activation dtype, its 16-byte alignment,
#: QUANTCORE_CUDA_TUNE) as _W4Launch: everything of the launch but the three array pointers
_W4_LAUNCHES: dict[tuple, _W4Launch] = {}
_W4_MAX_LAUNCHES = 64  # kept at most (the cache starts over when full)
_W4_FLY = 64 * 1024  # LD 1: weight bytes in flight per CTA the ring should allow (~4.3 TB/s x ~2 us / 132 SMs)
_W4_MIN_SLICE = 112  # Q4_0 blocks: the shortest K slice a cluster's CTA takes (W-16)
_W4_STAGES = 3  # LD 0: ring stages at most (W-17)
_W4_SHORT_K = 448  # Q4_0 blocks per row (K = 14336) up to which a CTA quantizes <= 1 block per thread (W-16)
_W4_LONG_K_BLOCKS = 2048  # activation blocks a CTA quantizes at most above _W4_SHORT_K (W-16)
#: the N <= 8 stream kernel's instances as (NB, CL, LD) keys: CL its cluster, LD its ring filler (0
#: bulk copies by a producer warp, 1 cp.async by every warp)
_W4_NB = tuple((nb, cl, ld) for ld in (0, 1) for cl in (1, 2, 4) for nb in (1, 2, 4, 8))


def _qg(tag: str, fmt: str) -> str:
    return f"qc::quantize_ggml_kernel<{tag}, {GGML_FMT[fmt]}>"


def _dqg(tag: str, fmt: str) -> str:
    return f"qc::dequantize_ggml_kernel<{tag}, {GGML_FMT[fmt]}>"


def _w4t_act(tag: str, quantize: bool) -> str:
    return f"qc::w4a8_tc_act_kernel<{tag}, {_b(quantize)}>"


def _w4t(tile: tuple[int, ...]) -> str:
    return "qc::gemm_w4a8_tc_kernel<{}, {}, {}, {}, {}>".format(*tile)


def _w4t_geometry(tile: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(BM, BN, threads, shared memory bytes) of a gemm_w4a8_tc_kernel configuration (TcTile in ggml.cu)."""
    g = W4A8_TC_GEOMETRY
    mt, wgm, wgn, wgk, st = tile
    bm, bn, bk = 16 * mt * wgm, 32 * wgn, g["QC_W4T_BK"]
    stage = bm * bk * ggml.Q4_0_BLOCK_BYTES + bn * (bk * ggml.QK + g["QC_W4T_APAD"]) + bk * bn * (8 + 2)
    red = (wgk - 1) * wgm * wgn * mt * 64 * 32 * 4
    return bm, bn, 32 * wgm * wgn * wgk, max(st * stage, red)


def w4_stream_cluster(nb: int, nbk: int) -> int:
    """The stream kernel's cluster size (CTAs splitting K) for NB activation columns (1, 2, 4, 8)
    and nbk Q4_0 blocks per row: the smallest whose CTAs each quantize at most `per_cta`
    activation blocks (NB x nbk / CL, one consumer thread each), among those that leave each CTA a
    K slice of at least _W4_MIN_SLICE blocks (shorter slices cost more per tile than the prologue
    saves). Up to K = 14336 (_W4_SHORT_K blocks) one block per thread, so the prologue before the
    first stage is one block's work; longer rows amortize the prologue over a longer stream and
    lose more to clusters, so _W4_LONG_K_BLOCKS there. Measured on an H200: docs/performance.md, W-16."""
    per_cta = _W4_STREAM_WARPS * 32 if nbk <= _W4_SHORT_K else _W4_LONG_K_BLOCKS
    fits = [c for c in (1, 2, 4) if c == 1 or _cdiv(nbk, c) >= _W4_MIN_SLICE]
    return next((c for c in fits if nb * _cdiv(nbk, c) <= per_cta), fits[-1])


def _gemm_small(tag: str, key: tuple[int, int, int]) -> str:
    nb, cl, ld = key
    return f"qc::gemm_w4a8_stream_kernel<{tag}, {nb}, {cl}, {ld}>"


_W4_ARGS = ("wq", "act", "out")  # the stream kernel's per-call pointers


class _W4Launch:
    """The stream kernel's launch of one call geometry: ``gemm`` (planned, pointers wq, act, out in
    slots) writes gemm_w4a8's fp32 ``[M, N]``; :meth:`planned` makes others, such as a linear
    layer's ``y [N, M]`` in the activation's dtype from the same sums (the kernel's yt = 1)."""

    __slots__ = ("spec", "geometry", "smem", "gemm")

    def __init__(self, device: int, spec: tuple, geometry: dict, smem: int):
        self.spec, self.geometry, self.smem = spec, geometry, smem
        self.gemm = self.planned(device, 0)

    def planned(self, device: int, yt: int, wq: int | None = None) -> Any:
        """A PlannedLaunch of this geometry with its own argument buffer writing the output form
        ``yt``; ``wq`` (a pointer): written into the buffer, the slots then take act and out only."""
        names = _W4_ARGS if wq is None else _W4_ARGS[1:]
        return rt.PlannedLaunch(device, *self.spec, kernel_args(self.spec[1], wq=wq, act=None, out=None, yt=yt,
                                                                **self.geometry),
                                shared_mem=self.smem, slots=tuple(arg_index(self.spec[1], p) for p in names))


def w4_launch(device: int, wq: Any, a: Any, n: int, k: int) -> _W4Launch | None:
    """The stream kernel's launch kept for a ``gemm_w4a8(wq, a)`` call of this geometry on ``device``
    under the current tuning (one made before), or None."""
    return _W4_LAUNCHES.get(GgmlOps._w4_key(device, wq, a, n, k))


def instances() -> list[tuple[str, str]]:
    """Every (source file, name expression) of the family the backend can launch."""
    out: list[tuple[str, str]] = []
    for tag in TYPE_TAG.values():
        for fmt in GGML_FMT:
            out += [(_FG, _qg(tag, fmt)), (_FG, _dqg(tag, fmt))]
        out.append((_FG, _w4t_act(tag, True)))
        out += [(_FG, _gemm_small(tag, nb)) for nb in _W4_NB]
    out.append((_FG, _w4t_act(TYPE_TAG["float32"], False)))
    out += [(_FG, _w4t(tile)) for tile in _W4T_TILES]
    return out


class GgmlOps:
    """The family's ops (a mixin of CudaBackend)."""

    # -- ggml ----------------------------------------------------------------------------------------
    def _quantize_ggml(self, fmt, x, out):
        nblocks = rt.numel(x) // ggml.QK
        if nblocks:
            expr = _qg(_tag(x), fmt)
            Launcher(x)(_FG, expr, (_cdiv(nblocks, _THREADS),), _THREADS,
                        kernel_args(expr, x=x, out=out, nblocks=nblocks, vec=aligned(x, 16), aligned2=aligned(out, 2)))

    def quantize_q4_0(self, w, out):
        self._quantize_ggml("q4_0", w, out)

    def quantize_q8_0(self, a, out):
        self._quantize_ggml("q8_0", a, out)

    def quantize_q8_1(self, a, out):
        self._quantize_ggml("q8_1", a, out)

    def dequantize_ggml(self, q, out, *, fmt):
        nblocks = rt.numel(out) // ggml.QK
        if nblocks:
            expr = _dqg(_tag(out), fmt)
            Launcher(out)(_FG, expr, (_cdiv(nblocks * 4, _THREADS),), _THREADS,
                          kernel_args(expr, q=q, out=out, nblocks=nblocks, vec=aligned(out, 16)))

    def _gemm(self, wq, act, out, quantize: bool, tag: str, n_rows: int, aligned4: bool):
        """gemm_w4a8_tc_kernel: the activation as Q8_1 values into a workspace (w4a8_tc_act_kernel:
        quantized from the float activation, or repacked from given Q8_1 blocks), then the tiled
        int8 tensor-core GEMM. The workspace (npad x nbp x 42 bytes) is allocated per call from the
        caller's allocator (torch's or CuPy's pool, stream-ordered)."""
        m, nb = int(wq.shape[0]), int(wq.shape[1])
        if m == 0 or n_rows == 0:
            return
        g = W4A8_TC_GEOMETRY
        launch = Launcher(wq)
        npad = _cdiv(n_rows, g["QC_W4T_NPAD"]) * g["QC_W4T_NPAD"]
        nbp = _cdiv(nb, g["QC_W4T_BK"]) * g["QC_W4T_BK"]
        ws = self.empty((npad * nbp * g["QC_W4T_WS_BLOCK_BYTES"],), "uint8", like=wq)  # quants, (d8, -d8 1.5 2^23), s
        vec = aligned(act, 16) if quantize else False
        expr = _w4t_act(tag, quantize)
        launch(_FG, expr, (_cdiv(npad * nbp, _THREADS),), _THREADS,
               kernel_args(expr, x=act, ws=ws, n=n_rows, nb=nb, npad=npad, nbp=nbp, vec=vec, aligned4=aligned4))
        forced = rt.tune("w4t_tile", -1)
        if 0 <= forced < len(_W4T_TILES):
            tile = _W4T_TILES[forced]
        else:
            sms = rt.sm_count(launch.device)

            def est(i: int) -> float:
                bm, bn = _w4t_geometry(_W4T_TILES[i])[:2]
                return _cdiv(_cdiv(m, bm) * _cdiv(n_rows, bn), sms) * bm * bn * _W4T_COST[i]

            tile = _W4T_TILES[min(range(len(_W4T_COST)), key=est)]
        bm, bn, threads, smem = _w4t_geometry(tile)
        wfast = nb % g["QC_W4T_BK"] == 0 and aligned(wq, 16)
        ovec = n_rows % 2 == 0 and aligned(out, 8)
        launch(_FG, _w4t(tile), (_cdiv(m, bm), _cdiv(n_rows, bn)), threads,
               kernel_args(_w4t(tile), wq=wq, ws=ws, out=out, m=m, n=n_rows, nb=nb, npad=npad, nbp=nbp, wfast=wfast,
                           ovec=ovec), shared_mem=smem)

    def gemm_q4_0_q8_1(self, wq, aq, out):
        self._gemm(wq, aq, out, False, TYPE_TAG["float32"], int(aq.shape[0]), aligned(aq, 4))

    def gemm_w4a8(self, wq, a, out):
        k = int(wq.shape[1]) * ggml.QK
        n = rt.numel(a) // k
        if not self._gemm_w4a8_small(wq, a, out, n, k):
            self._gemm(wq, a, out, True, _tag(a), n, False)

    @staticmethod
    def _w4_key(device: int, wq: Any, a: Any, n: int, k: int) -> tuple:
        """The stream kernel's launch cache key of a call (device, geometry, input type and alignment, tuning)."""
        return device, int(wq.shape[0]), n, k, _tag(a), aligned(a, 16), rt.tune_spec()

    def _gemm_w4a8_small(self, wq, a, out, n: int, k: int) -> bool:
        """N <= 8 on sm_90: the streaming kernel; False where it does not apply (then the tensor-core
        kernel runs). QUANTCORE_CUDA_TUNE: w4a8_small=0 sends these calls to the tensor-core kernel
        too; w4s_load=0 (default) fills the stream
        kernel's ring by bulk copies from a producer warp, 1 by cp.async from every warp (W-14:
        bit-equal, slower on the H200); w4s_cl (cluster 1/2/4), w4s_kc (blocks per stage row),
        w4s_stages (ring depth), w4s_fly (KiB in flight, w4s_load=1) override its geometry."""
        m, nbk = int(wq.shape[0]), k // ggml.QK
        if not (1 <= n <= 8 and m > 0 and nbk % 8 == 0 and aligned(wq, 16)):
            return False
        launch = Launcher(wq)
        # the stream kernel's launches, kept per geometry and tuning: a repeated call skips the
        # geometry search below and CuPy's argument conversion (its three pointers go into slots)
        stream = launch.raw_stream()
        key = self._w4_key(launch.device, wq, a, n, k)
        planned = _W4_LAUNCHES.get(key) if stream is not None else None
        if planned is not None:
            planned.gemm(stream, rt.pointer(wq), rt.pointer(a), rt.pointer(out))
            return True
        if rt.tune("w4a8_small", 1) == 0 or rt.device_arch(launch.device) < 90:
            return False
        nb = 1 << (n - 1).bit_length()
        sms = rt.sm_count(launch.device)
        ld = 1 if rt.tune("w4s_load", 0) else 0
        cl = rt.tune("w4s_cl", 0)
        if cl not in (1, 2, 4):
            cl = w4_stream_cluster(nb, nbk)
        kbs = _cdiv(_cdiv(nbk, cl), 8) * 8
        # Clusters of one wave: a cluster lives in one GPC; 2 SMs always pair up there, 4 not
        # always (ncu, H200: 30 clusters of 4 on 132 SMs).
        waves = {1: sms, 2: sms // 2, 4: sms * 7 // 32}[cl]
        ntiles = _cdiv(m, _W4_STREAM_ROWS)
        tpc = _cdiv(ntiles, max(1, waves))
        fixed = kbs * nb * 40 + (2 * _W4_STREAM_WARPS + tpc) * _W4_STREAM_ROWS * nb * 4
        # Blocks per stage row. The time grows with the number of stages per CTA (measured:
        # docs/performance.md, the W4A8 N <= 8 log), so LD 0 takes the largest that leaves 2 stages. LD 1 runs nstage - 2 stages ahead, so
        # kc is halved until those hold w4s_fly bytes (or the ring is at its depth cap, where
        # halving kc would only shrink them).
        # The ring's depth: LD 0 at most _W4_STAGES (the deeper rings the shared memory allows
        # measured slower: docs/performance.md, W-17), LD 1 at most 8.
        fly, cap = rt.tune("w4s_fly", _W4_FLY // 1024) * 1024, rt.tune("w4s_stages", _W4_STAGES if ld == 0 else 8)
        kc = min(kbs, _cdiv(rt.tune("w4s_kc", 128), 8) * 8)
        while True:
            units = _cdiv(kc * ggml.Q4_0_BLOCK_BYTES, 16)
            stage = _W4_STREAM_ROWS * 16 * (units if units % 2 else units + 1) + 16  # ws_stride
            nstage = min(cap, (_W4_SMEM_MAX - fixed) // stage)
            if kc <= 8 or (nstage >= 2 and (ld == 0 or nstage >= cap or (nstage - 2) * (stage - 16) >= fly)):
                break
            kc = _cdiv(kc // 2, 8) * 8
        if nstage >= 2:
            spec = (_FG, _gemm_small(_tag(a), (nb, cl, ld)), (cl * _cdiv(ntiles, tpc),),
                    32 * (_W4_STREAM_WARPS + 1 - ld))
            geometry = {"m": m, "n": n, "k": k, "kbs": kbs, "kc": kc, "nstage": nstage, "tpc": tpc,
                        "vec": aligned(a, 16)}
            smem = fixed + nstage * stage
            launch(*spec, kernel_args(spec[1], wq=wq, act=a, out=out, yt=0, **geometry), shared_mem=smem)
            if stream is not None:
                if len(_W4_LAUNCHES) >= _W4_MAX_LAUNCHES:
                    _W4_LAUNCHES.clear()
                _W4_LAUNCHES[key] = _W4Launch(launch.device, spec, geometry, smem)
            return True
        return False

