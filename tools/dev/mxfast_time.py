"""MX dequantize and scaled_fp4_mm's panel path on the cuda backend, in one process (issue 20,
items 3 and 4): the copy ceiling; mx_dequantize at 16384^2 for every format / output dtype
(swizzled scales, and row-major for bf16) in % of copy; optionally the previous kernel (argv
``--old PATH``: its source, compiled under the name mx_quant_old.cu) timed and compared bit for bit
with the new one on random bytes; scaled_fp4_mm at 8192^3 (panel path, fused wgmma kernel, torch
bf16 matmul) and over M at N = K = 8192; the panel path against the fused kernel on a shape split
into several panels (a small workspace forced), with a bias. CUDA events around one call queued
behind a ~1 ms sleep kernel, median (tools/cuda_mx_bench.timed)."""

import argparse
import pathlib
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tools/: cuda_mx_bench
from cuda_mx_bench import copy_ceiling, timed  # noqa: E402
from quantcore.backends.cuda import mx as cmx  # noqa: E402

from quantcore.formats import kernel_defines, mx  # noqa: E402

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SCALE_RANGE = {"nvfp4": (40, 60), "mxfp4": (120, 130), "mxfp8": (120, 130)}


def dq_inputs(fmt, rows, cols, swizzled, dev, full_bytes=False):
    blk = mx.block_size(fmt)
    codes = torch.randint(0, 256, (rows, mx.codes_cols(fmt, cols)), dtype=torch.uint8, device=dev)
    shape = mx.swizzled_shape(rows, cols // blk) if swizzled else (rows, cols // blk)
    lo, hi = (0, 256) if full_bytes else SCALE_RANGE[fmt]
    scales = torch.randint(lo, hi, shape, dtype=torch.uint8, device=dev)
    g = torch.tensor([0.37], dtype=torch.float32, device=dev) if fmt == "nvfp4" else None
    return codes, scales, g


def old_dequantize(codes, scales, out, g, rows, cols, fmt, swizzled):
    dev = 0
    ncols = cols // mx.block_size(fmt)
    pcols = mx.swizzled_shape(rows, ncols)[1] if swizzled else ncols
    name = f"qc_mx_dequantize_{fmt}_{str(out.dtype).split('.')[-1]}"
    fn = cmx.function(dev, "mx_quant_old.cu", cmx.quant_arch(dev), name)
    grid, block = cmx._grid2(ncols, rows)
    args = (np.uint64(codes.data_ptr()), np.uint64(scales.data_ptr()), np.uint64(out.data_ptr()),
            np.uint64(0 if g is None else g.data_ptr()), np.int64(rows), np.int32(ncols), np.int32(pcols),
            np.int32(bool(swizzled)), np.int32(1))
    cmx.rt.Launcher(out).run(fn, name, grid, block, args)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default=None)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--mm", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-mm", action="store_true", help="dequantize only")
    ap.add_argument("--unroll", default="", help="comma-separated geometries to time first: UNROLL or UNROLL:CVT8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(0), torch.__version__)
    if args.old:
        text = pathlib.Path(args.old).read_text()
        kt = cmx.kernel_text
        cmx.kernel_text = lambda name: text if name == "mx_quant_old.cu" else kt(name)

    t, copy = copy_ceiling(args.reps)
    print(f"copy 2 GiB d2d: {t:.4f} ms {copy:.0f} GB/s")

    # -- bit-exactness against the previous kernel (every scale byte, random codes, odd shapes)
    if args.old:
        bad = 0
        for fmt in ("nvfp4", "mxfp4", "mxfp8"):
            for dt in DT:
                for swz in (True, False):
                    for rows, cols in ((300, 4096), (129, 96 if fmt == "nvfp4" else 160), (1, 32)):
                        codes, scales, g = dq_inputs(fmt, rows, cols, swz, dev, full_bytes=True)
                        o1 = torch.full((rows, cols), float("nan"), dtype=DT[dt], device=dev)
                        o2 = torch.full((rows, cols), 7.0, dtype=DT[dt], device=dev)
                        old_dequantize(codes, scales, o1, g, rows, cols, fmt, swz)
                        cmx.mx_dequantize(None, codes, scales, o2, rows=rows, cols=cols, fmt=fmt, swizzled=swz,
                                          global_scale=g)
                        iv = torch.int32 if dt == "float32" else torch.int16
                        if not torch.equal(o1.view(iv), o2.view(iv)):
                            bad += 1
                            print(f"MISMATCH {fmt} {dt} swz={swz} {rows}x{cols}: "
                                  f"{int((o1.view(iv) != o2.view(iv)).sum())} elements")
        print(f"bit-exact against the previous kernel: {'OK' if bad == 0 else f'{bad} MISMATCHES'}")

    # -- dequantize timing at n x n; first the sweep of kernel geometries (QC_MXDQ_UNROLL: chunks
    # per thread in flight together; QC_MXDQ_CVT8: MXFP8 codes by the hardware conversion or the table)
    # each rebuilt, bf16 swizzled, its output compared bit for bit with the default's
    n = args.n
    geo = kernel_defines.MX_DEQUANT_GEOMETRY
    default = (geo["QC_MXDQ_UNROLL"], geo["QC_MXDQ_CVT8"])

    def use(u, c8):
        geo["QC_MXDQ_UNROLL"], geo["QC_MXDQ_CVT8"] = u, c8
        cmx.DQ_UNROLL = u
        cmx._modules.clear()
        cmx._functions.clear()
        cmx._occupancy.clear()

    variants = [tuple(int(x) for x in v.split(":")) if ":" in v else (int(v), default[1])
                for v in args.unroll.split(",") if v]
    if variants:
        for fmt in ("nvfp4", "mxfp4", "mxfp8"):
            codes, scales, g = dq_inputs(fmt, n, n, True, dev)
            ref = torch.empty((n, n), dtype=torch.bfloat16, device=dev)
            out = torch.empty_like(ref)
            nbytes = codes.numel() + scales.numel() + out.numel() * out.element_size()
            for u, c8 in [default] + variants:
                use(u, c8)
                o = ref if (u, c8) == default else out
                t = timed(lambda c=codes, s=scales, o=o, f=fmt, g=g: cmx.mx_dequantize(
                    None, c, s, o, rows=n, cols=n, fmt=f, swizzled=True, global_scale=g), args.reps)
                same = "" if o is ref else (" bit-equal" if torch.equal(ref.view(torch.int16), out.view(torch.int16))
                                            else " MISMATCH")
                print(f"dequant unroll={u} cvt8={c8} {fmt} bfloat16 swizzled {t:.4f} {nbytes / t / 1e6:.0f} "
                      f"{100 * nbytes / t / 1e6 / copy:.1f}{same}")
            del codes, scales, ref, out
        use(*default)
    print("op fmt dtype layout ms GB/s %copy")
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        for dt in DT:
            for swz in ((True, False) if dt == "bfloat16" else (True,)):
                codes, scales, g = dq_inputs(fmt, n, n, swz, dev)
                out = torch.empty((n, n), dtype=DT[dt], device=dev)
                nbytes = codes.numel() + scales.numel() + out.numel() * out.element_size()
                lay = "swizzled" if swz else "row-major"
                t = timed(lambda c=codes, s=scales, o=out, f=fmt, w=swz, g=g: cmx.mx_dequantize(
                    None, c, s, o, rows=n, cols=n, fmt=f, swizzled=w, global_scale=g), args.reps)
                print(f"dequant {fmt} {dt} {lay} {t:.4f} {nbytes / t / 1e6:.0f} {100 * nbytes / t / 1e6 / copy:.1f}")
                if args.old and dt == "bfloat16" and swz:
                    t = timed(lambda c=codes, s=scales, o=out, f=fmt, w=swz, g=g: old_dequantize(
                        c, s, o, g, n, n, f, w), args.reps)
                    print(f"dequant-old {fmt} {dt} {lay} {t:.4f} {nbytes / t / 1e6:.0f} "
                          f"{100 * nbytes / t / 1e6 / copy:.1f}")
                del codes, scales, out
    torch.cuda.empty_cache()

    if args.skip_mm:
        return
    # -- scaled_fp4_mm: correctness of the panel path against the fused kernel, several panels + bias
    for fmt in ("nvfp4", "mxfp4"):
        m_, n_, k_ = 1000, 700, 4096
        blk = mx.block_size(fmt)
        lo, hi = SCALE_RANGE[fmt]
        a = torch.randint(0, 256, (m_, k_ // 2), dtype=torch.uint8, device=dev)
        b = torch.randint(0, 256, (n_, k_ // 2), dtype=torch.uint8, device=dev)
        sa = torch.randint(lo, hi, mx.swizzled_shape(m_, k_ // blk), dtype=torch.uint8, device=dev)
        sb = torch.randint(lo, hi, mx.swizzled_shape(n_, k_ // blk), dtype=torch.uint8, device=dev)
        alpha = torch.tensor([0.75], dtype=torch.float32, device=dev)
        bias = torch.randn(n_, device=dev).to(torch.bfloat16)
        for use_bias in (None, bias):
            ref = torch.full((m_, n_), float("nan"), dtype=torch.bfloat16, device=dev)
            cmx.scaled_fp4_mm(None, a, b, sa, sb, alpha, use_bias, ref, m=m_, n=n_, k=k_, fmt=fmt, mode="wgmma")
            res = {}
            for wsmin in (cmx.MM_WORKSPACE_MIN, 8 << 20):
                saved = cmx.MM_WORKSPACE_MIN
                cmx.MM_WORKSPACE_MIN = wsmin
                panels = cmx.mm_panels(m_, n_, k_)
                out = torch.full((m_, n_), float("nan"), dtype=torch.bfloat16, device=dev)
                cmx.scaled_fp4_mm(None, a, b, sa, sb, alpha, use_bias, out, m=m_, n=n_, k=k_, fmt=fmt,
                                  mode="panel")
                cmx.MM_WORKSPACE_MIN = saved
                d = (out.float() - ref.float()).norm() / ref.float().norm()
                res[panels] = (float(d), bool(torch.isnan(out).any()))
            print(f"panel vs fused {fmt} M{m_} N{n_} K{k_} bias={use_bias is not None}: "
                  + ", ".join(f"panels {p}: rel {r:.2e} nan {nn}" for p, (r, nn) in res.items()))

    # -- scaled_fp4_mm timing
    mm = args.mm
    a16 = torch.randn((mm, mm), device=dev, dtype=torch.bfloat16)
    b16 = torch.randn((mm, mm), device=dev, dtype=torch.bfloat16)
    tt = timed(lambda: torch.matmul(a16, b16.t()), args.reps)
    flops = 2.0 * mm**3
    print(f"torch bf16 {mm}^3 {tt:.4f} ms {flops / tt / 1e9:.0f} TFLOPS")
    for fmt in ("nvfp4", "mxfp4"):
        blk = mx.block_size(fmt)
        lo, hi = SCALE_RANGE[fmt]
        a = torch.randint(0, 256, (mm, mm // 2), dtype=torch.uint8, device=dev)
        b = torch.randint(0, 256, (mm, mm // 2), dtype=torch.uint8, device=dev)
        sa = torch.randint(lo, hi, mx.swizzled_shape(mm, mm // blk), dtype=torch.uint8, device=dev)
        sb = torch.randint(lo, hi, mx.swizzled_shape(mm, mm // blk), dtype=torch.uint8, device=dev)
        alpha = torch.ones(1, dtype=torch.float32, device=dev)
        out = torch.empty((mm, mm), dtype=torch.bfloat16, device=dev)
        o2 = torch.empty_like(out)
        for mode in ("wgmma", "panel"):
            t = timed(lambda ops=(a, b, sa, sb, alpha, None, out), f=fmt, md=mode: cmx.scaled_fp4_mm(
                None, *ops, m=mm, n=mm, k=mm, fmt=f, mode=md), args.reps)
            print(f"scaled_fp4_mm {fmt} {mode} {mm}^3 {t:.4f} ms {flops / t / 1e9:.0f} TFLOPS {tt / t:.3f}x torch")
        cmx.scaled_fp4_mm(None, a, b, sa, sb, alpha, None, o2, m=mm, n=mm, k=mm, fmt=fmt, mode="wgmma")
        print(f"  panel vs fused rel diff {float((out.float() - o2.float()).norm() / o2.float().norm()):.2e}")
        aw = torch.empty((mm, mm), dtype=torch.bfloat16, device=dev)
        ptrs = (a.data_ptr(), sa.data_ptr(), aw.data_ptr())
        t = timed(lambda p=ptrs, w=aw, f=fmt: cmx._dequantize_launch(
            cmx.rt.Launcher(w), 0, *p, 0, rows=mm, cols=mm, fmt=f, dtype="bfloat16", swizzled=True), args.reps)
        print(f"  one operand's dequant {t:.4f} ms")
        del aw
    print("M sweep at N = K = 8192 (nvfp4): M, torch ms, panel ms, fused ms")
    for m_ in (16, 64, 128, 256, 512, 1024, 2048, 4096):
        a = torch.randint(0, 256, (m_, mm // 2), dtype=torch.uint8, device=dev)
        sa = torch.randint(40, 60, mx.swizzled_shape(m_, mm // 16), dtype=torch.uint8, device=dev)
        b = torch.randint(0, 256, (mm, mm // 2), dtype=torch.uint8, device=dev)
        sb = torch.randint(40, 60, mx.swizzled_shape(mm, mm // 16), dtype=torch.uint8, device=dev)
        out = torch.empty((m_, mm), dtype=torch.bfloat16, device=dev)
        x16 = torch.randn((m_, mm), device=dev, dtype=torch.bfloat16)
        t0 = timed(lambda x=x16: torch.matmul(x, b16.t()), args.reps)
        r = [timed(lambda md=mode, ops=(a, b, sa, sb, alpha, None, out), m_=m_: cmx.scaled_fp4_mm(
            None, *ops, m=m_, n=mm, k=mm, fmt="nvfp4", mode=md), args.reps) for mode in ("panel", "wgmma")]
        print(f"M{m_} {t0:.4f} {r[0]:.4f} {r[1]:.4f}")


if __name__ == "__main__":
    main()
