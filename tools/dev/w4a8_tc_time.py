"""gemm_w4a8 for many rows (the int8 tensor-core GEMM, kernels_cuda/ggml.cu gemm_w4a8_tc_kernel)
beside torch bf16 F.linear (cuBLAS), torch._int_mm (cuBLASLt int8 on int8 operands of the same
shape) and dequantize_q4_0 + bf16 F.linear (the linear_q4_0 op's many-row path). CUDA events
around one call queued behind a ~1 ms sleep kernel, weight sets rotated past L2, median of
`reps`; bf16 activation; each quantcore output compared with the fp64 product of the
dequantized weight and the Q8_1-dequantized activation (relative Frobenius error; Q8_1's fp16 s,
which the format's formula uses, puts it near 7e-4). argv[1]: n
values (comma-separated), argv[2]: QUANTCORE_CUDA_TUNE settings to compare, ";"-separated.
Run by tools/dev/w4a8_tc_device.sh."""

import os
import sys

import torch
from quantcore.backends.cuda import create
from quantcore.backends.cuda.runtime import ENV_TUNE

from quantcore import api
from quantcore.bench import CudaTimer

SHAPES = [(4096, 14336), (14336, 4096)]


def med(fn, reps: int = 30) -> float:
    """fn(i) for rotating i (its three weights) timed by quantcore.bench's kernel timer."""
    return CudaTimer(torch).kernel([lambda j=j: fn(j) for j in range(3)], reps, warmup=3)


def main() -> None:
    be = create()
    ns = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [16, 64, 512, 2048, 4096]
    configs = sys.argv[2].split(";") if len(sys.argv) > 2 else [""]
    print(f"{'shape':26s} {'impl':22s} {'us':>9s} {'TOPS':>7s}  note")
    for m, k in SHAPES:
        g = torch.Generator(device="cuda")
        g.manual_seed(m)
        nsets = 3
        wf = [torch.randn(m, k, device="cuda", generator=g) * 0.05 for _ in range(nsets)]
        wqs = [api.quantize_q4_0(w, backend=be) for w in wf]
        wb = [w.to(torch.bfloat16) for w in wf]
        wi8 = [torch.randint(-128, 128, (k, m), device="cuda", dtype=torch.int8, generator=g).t().contiguous().t()
               for _ in range(nsets)]
        wdq = api.dequantize_q4_0(wqs[0], "float32", backend=be).double()
        del wf
        for n in ns:
            shape = f"N{n} M{m} K{k}"
            ops = 2.0 * n * m * k
            a = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
            out = torch.empty(m, n, device="cuda")
            adq = api.dequantize_q8_1(api.quantize_q8_1(a, backend=be), "float32", backend=be).double()
            ref = (wdq @ adq.t()).float()
            for cfg in configs:
                os.environ[ENV_TUNE] = cfg
                out.fill_(float("nan"))
                be.gemm_w4a8(wqs[0], a, out)
                torch.cuda.synchronize()
                err = float(((out - ref).norm() / ref.norm()).item())
                t = med(lambda i, a=a, out=out, wqs=wqs: be.gemm_w4a8(wqs[i % len(wqs)], a, out))
                print(f"{shape:26s} {'quantcore ' + (cfg or 'default'):22s} {t:9.1f} {ops / t / 1e6:7.1f}  "
                      f"rel.err {err:.1e}", flush=True)
            os.environ[ENV_TUNE] = ""
            t = med(lambda i, a=a, wb=wb: torch.nn.functional.linear(a, wb[i % len(wb)]))
            print(f"{shape:26s} {'torch-bf16':22s} {t:9.1f} {ops / t / 1e6:7.1f}", flush=True)
            if n > 16:
                ai8 = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8, generator=g)
                try:
                    t = med(lambda i, ai8=ai8, wi8=wi8: torch._int_mm(ai8, wi8[i % len(wi8)]))
                    print(f"{shape:26s} {'torch._int_mm':22s} {t:9.1f} {ops / t / 1e6:7.1f}", flush=True)
                except RuntimeError as exc:
                    print(f"{shape:26s} torch._int_mm failed: {str(exc)[:100]}")
            if n >= 16:
                t = med(lambda i, a=a, wqs=wqs: torch.nn.functional.linear(
                    a, api.dequantize_q4_0(wqs[i % len(wqs)], "bfloat16", backend=be)))
                print(f"{shape:26s} {'dequant+bf16 linear':22s} {t:9.1f} {ops / t / 1e6:7.1f}", flush=True)
            if n <= 512:
                aq = api.quantize_q8_1(a, backend=be)
                t = med(lambda i, aq=aq, out=out, wqs=wqs: be.gemm_q4_0_q8_1(wqs[i % len(wqs)], aq, out))
                print(f"{shape:26s} {'quantcore q4_0_q8_1':22s} {t:9.1f} {ops / t / 1e6:7.1f}", flush=True)
            del a, out, ref, adq


if __name__ == "__main__":
    main()
