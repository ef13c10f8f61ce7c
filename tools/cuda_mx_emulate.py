"""Host emulation of kernels_cuda/mx_gemm.cu's data flow, to check its layouts without a GPU.

Follows one CTA byte for byte as the kernel does: the cp.async stage layout (B rows XOR-swizzled
on (row/2)%4), the scale-byte lookup table, the three-operation fp4 -> bf16 pair decode, the A
fragments of every thread, the B tile in the 128-byte swizzled layout, and then
  * the mma.sync back end: ldmatrix fragments and m16n8k16 semantics (PTX ISA layouts), and
  * the wgmma back end: the K-major SW128 operand as the descriptor describes it,
accumulated in fp64 and compared with quantcore.formats.mx.scaled_fp4_mm's fp64 reference.

What it cannot check: the hardware itself (descriptor encoding, wgmma timing, races). The GPU
tests in tests/test_cuda_mx.py do that. Run: python tools/cuda_mx_emulate.py
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from quantcore.formats import mx

BF = np.dtype(ml_dtypes.bfloat16)
STAGE_K, ROW_BYTES = 128, 64


def bf16_bits_to_f64(h: np.ndarray) -> np.ndarray:
    return np.asarray(h, np.uint16).view(BF).astype(np.float64)


def f64_to_bf16_bits(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float64).astype(BF).view(np.uint16)


def bmul2(a: int, b: int) -> int:
    """fma.rn.bf16x2(a, b, -0): each half rounded once to bf16."""
    lo = f64_to_bf16_bits(bf16_bits_to_f64(a & 0xFFFF) * bf16_bits_to_f64(b & 0xFFFF))
    hi = f64_to_bf16_bits(bf16_bits_to_f64(a >> 16) * bf16_bits_to_f64(b >> 16))
    return int(lo) | (int(hi) << 16)


def fp4_pair(q: int, shl: int) -> int:
    x = (q << shl) & 0xF000F000
    return (x | (x >> 6)) & 0x81C081C0


def lut_table(fmt: str) -> list[int]:
    out = []
    for b in range(256):
        if fmt == "nvfp4":
            v = np.float32(mx.e4m3_decode(np.array([b], np.uint8))[0]) * np.float32(2.0**117)
        else:
            v = mx.e8m0_decode(np.array([b], np.uint8))[0]
        h = int(np.array([v], np.float32).view(np.uint32)[0] >> 16)
        out.append(h | (h << 16))
    return out


def emulate(fmt: str, M: int, N: int, K: int, wgmma: bool, rng: np.random.Generator) -> float:
    blk = mx.block_size(fmt)
    xa = rng.standard_normal((M, K)).astype(np.float32) * np.float32(4.0)
    xb = rng.standard_normal((N, K)).astype(np.float32)
    ga = mx.nvfp4_global_scale(np.abs(xa).max()) if fmt == "nvfp4" else None
    gb = mx.nvfp4_global_scale(np.abs(xb).max()) if fmt == "nvfp4" else None
    a, sa = mx.quantize(xa, fmt, global_scale=ga)
    b, sb = mx.quantize(xb, fmt, global_scale=gb)
    sa, sb = mx.swizzle(sa), mx.swizzle(sb)
    alpha = np.float32(1.0) / (ga * gb) if fmt == "nvfp4" else np.float32(0.75)
    ref = mx.scaled_fp4_mm(a, b, sa, sb, alpha, None, fmt).astype(np.float64)

    lut = lut_table(fmt)
    KB, nkb = K // 2, K // blk
    nkt = -(-nkb // 4)
    KT = STAGE_K // blk // 4
    nsub = -(-K // 64)
    nmt = -(-M // 128)
    out = np.zeros((M, N))
    sa_flat, sb_flat = sa.reshape(-1), sb.reshape(-1)
    for m0 in range(0, M, 256):
        for n0 in range(0, N, 128):
            acc = np.zeros((256, 128))
            for j in range(nsub):
                st, h = j // 2, j % 2
                # --- the stage as cp.async leaves it
                As = np.zeros(256 * ROW_BYTES, np.uint8)
                Bp = np.zeros(128 * ROW_BYTES, np.uint8)
                SAs = np.zeros(4 * 512, np.uint8)
                SBs = np.zeros(2 * 512, np.uint8)
                for row in range(256):
                    for c in range(4):
                        off = st * 64 + c * 16
                        if m0 + row < M and off < KB:
                            d = row * 64 + ((c ^ ((row >> 1) & 3)) << 4)
                            As[d:d + 16] = a[m0 + row, off:off + 16]
                for row in range(128):
                    for c in range(4):
                        off = st * 64 + c * 16
                        if n0 + row < N and off < KB:
                            d = row * 64 + ((c ^ ((row >> 1) & 3)) << 4)
                            Bp[d:d + 16] = b[n0 + row, off:off + 16]
                for tile in range(2 * KT):
                    mt, kt = tile // KT, tile % KT
                    gm, gk = m0 // 128 + mt, st * KT + kt
                    if gm < nmt and gk < nkt:
                        o = (gm * nkt + gk) * 512
                        SAs[tile * 512: tile * 512 + 512] = sa_flat[o:o + 512]
                for tile in range(KT):
                    gk = st * KT + tile
                    if gk < nkt:
                        o = ((n0 // 128) * nkt + gk) * 512
                        SBs[tile * 512: tile * 512 + 512] = sb_flat[o:o + 512]
                nval = nkb - j * (64 // blk)

                def mask(w, nv):
                    return w if nv >= 4 else (0 if nv <= 0 else w & ((1 << (8 * nv)) - 1))

                def u32(buf, off):
                    return int(buf[off:off + 4].view(np.uint32)[0])

                # --- B tile (swizzled, bf16 bits) written by the 256 threads
                Bs = np.zeros(128 * 64, np.uint16)  # element index = byte offset / 2
                for tid in range(256):
                    n, part = tid & 127, tid >> 7
                    ch = 2 * h + part
                    base = n * 64 + ((ch ^ ((n >> 1) & 3)) << 4)
                    q = [u32(Bp, base + 4 * i) for i in range(4)]
                    soff = (n & 31) * 16 + (n >> 5) * 4
                    if fmt == "nvfp4":
                        sw = mask(u32(SBs, h * 512 + soff), nval)
                        S = [lut[(sw >> (16 * part)) & 0xFF], lut[(sw >> (16 * part + 8)) & 0xFF]]
                    else:
                        sw = mask(u32(SBs, soff) >> (16 * h), nval)
                        S = [lut[(sw >> (8 * part)) & 0xFF]] * 2
                    for s4 in range(4):
                        c = 2 * s4 + part
                        for i in range(4):
                            x = fp4_pair(q[i], 12 - 4 * s4)
                            if fmt != "nvfp4":
                                x = bmul2(x, 0x7E807E80)
                            w = bmul2(x, S[i >> 1])
                            e = (n * 128 + ((c ^ (n & 7)) << 4) + 4 * i) // 2
                            Bs[e], Bs[e + 1] = w & 0xFFFF, w >> 16
                # --- A fragments per thread -> logical A tile [256, 64]
                Alog = np.full((256, 64), np.nan)
                for tid in range(256):
                    lane, warp = tid & 31, tid >> 5
                    g, t = lane >> 2, lane & 3
                    for mt in range(2):
                        rb = ((warp >> 2) * 128 + mt * 64 + (warp & 3) * 16) if wgmma else (warp * 32 + mt * 16)
                        for rr in range(2):
                            row = rb + g + 8 * rr
                            sw4 = (row >> 1) & 3
                            q = [u32(As, row * 64 + (((2 * h + hh) ^ sw4) << 4) + 4 * t) for hh in range(2)]
                            soff = (row & 127 & 31) * 16 + ((row & 127) >> 5) * 4
                            if fmt == "nvfp4":
                                sw = mask(u32(SAs, ((row >> 7) * 2 + h) * 512 + soff), nval)
                                S = [lut[(sw >> (8 * (t >> 1))) & 0xFF], lut[(sw >> (8 * (2 + (t >> 1)))) & 0xFF]]
                            else:
                                sw = mask(u32(SAs, (row >> 7) * 512 + soff) >> (16 * h), nval)
                                S = [lut[sw & 0xFF], lut[(sw >> 8) & 0xFF]]
                            for s4 in range(4):
                                for hh in range(2):
                                    w = fp4_pair(q[hh], 12 - 4 * s4)
                                    if fmt != "nvfp4":
                                        w = bmul2(w, 0x7E807E80)
                                    w = bmul2(w, S[hh])
                                    reg = hh * 2 + rr
                                    # mma A fragment: reg 0 (g, 2t), 1 (g+8, 2t), 2 (g, 2t+8), 3 (g+8, 2t+8)
                                    kk = 16 * s4 + 2 * t + (8 if reg >= 2 else 0)
                                    Alog[row, kk] = bf16_bits_to_f64(w & 0xFFFF)
                                    Alog[row, kk + 1] = bf16_bits_to_f64(w >> 16)
                assert not np.isnan(Alog).any(), "A fragment positions not covered"
                # --- B as the MMA sees it: logical [128 n, 64 k]
                Blog = np.full((128, 64), np.nan)
                if wgmma:
                    # K-major SW128: element (n, k) at n*128 + 2k, with address bits [4:6] ^= [7:9]
                    for s in range(4):
                        for n in range(128):
                            for kk in range(16):
                                addr = 32 * s + n * 128 + 2 * kk
                                addr ^= ((addr >> 7) & 7) << 4
                                Blog[n, 16 * s + kk] = bf16_bits_to_f64(Bs[addr // 2])
                else:
                    for s in range(4):
                        for p in range(8):
                            for lane in range(32):  # ldmatrix.x4: lane l gives a row address of matrix l/8
                                mi, ri = lane >> 3, lane & 7
                                n = 16 * p + (mi >> 1) * 8 + ri
                                chunk = 2 * s + (mi & 1)
                                addr = n * 128 + ((chunk ^ ri) << 4)
                                # matrix mi row ri: 8 bf16 -> B[k = 8*chunk + e, n]
                                for e in range(8):
                                    Blog[n, 8 * chunk + e] = bf16_bits_to_f64(Bs[addr // 2 + e])
                assert not np.isnan(Blog).any(), "B positions not covered"
                acc += Alog @ Blog.T
            fac = 2.0**18 if fmt == "nvfp4" else 1.0
            rows, cols = min(256, M - m0), min(128, N - n0)
            out[m0:m0 + rows, n0:n0 + cols] = acc[:rows, :cols] * fac * float(alpha)
    got = out.astype(np.float32).astype(BF).astype(np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def check_pipeline(nsub: int, stages: int = 4) -> None:
    """The kernel's cp.async schedule (prologue, per-step wait / barrier / refill / dequantize):
    every stage is read from the buffer its load targeted, after a wait that covers that load,
    and no load targets a buffer whose previous stage some thread may still be reading."""
    nstage = -(-nsub // 2)
    groups: list[int | None] = []      # stage loaded by each commit group
    writer = {}                        # buffer -> index of the last group writing it
    last_read_step = {}                # buffer -> step in which its current stage was last read
    done = -1                          # groups guaranteed complete (after a wait + barrier)

    def load(st: int, step: int) -> None:
        b = st % stages
        if st < nstage:
            prev = last_read_step.get(b)
            assert prev is None or prev < step, f"stage {st} overwrites buffer {b} read in step {prev}"
            writer[b] = len(groups)
        groups.append(st if st < nstage else None)

    def wait(pending: int) -> None:
        nonlocal done
        done = max(done, len(groups) - 1 - pending)

    def read(sub: int, step: int) -> None:
        st, b = sub // 2, (sub // 2) % stages
        g = writer.get(b)
        assert g is not None and groups[g] == st, f"sub-step {sub} reads buffer {b} without stage {st}"
        assert g <= done, f"sub-step {sub} reads stage {st} before its copy is waited for"
        last_read_step[b] = step

    for st in range(stages):          # prologue
        load(st, -1)
    wait(stages - 1)
    read(0, -1)
    for j in range(nsub):
        more = j + 1 < nsub
        newstage = more and (j + 1) % 2 == 0
        if newstage:
            wait(stages - 2)
        # barrier, MMAs of step j
        if more:
            if newstage:
                load((j + 1) // 2 + stages - 1, j)
            read(j + 1, j)


def main() -> int:
    for nsub in range(1, 41):
        check_pipeline(nsub)
    print("pipeline schedule OK for 1..40 steps")
    rng = np.random.default_rng(1)
    worst = 0.0
    for fmt in ("nvfp4", "mxfp4"):
        for wg in (False, True):
            for (M, N, K) in ((256, 128, 128), (130, 70, 192), (300, 136, 96)):
                err = emulate(fmt, M, N, K, wg, rng)
                print(f"{fmt} {'wgmma' if wg else 'mma  '} M={M} N={N} K={K}: max rel err {err:.3g}")
                worst = max(worst, err)
    ok = worst < 1e-2
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
