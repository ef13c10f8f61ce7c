#!/bin/bash
# scaled_fp4_mm on the GPU machine: the warp-specialized kernel ("ws", GemmWS in
# kernels_cuda/mx_gemm.cu) side by side with the first wgmma kernel: NVRTC build, timing at
# 8192^3 (and 4096^3, 16384 x 8192 x 8192) against torch bf16 matmul in the same process, the
# ws experiments (no A / no B dequantization), the GPU tests and the conformance cases.
# Logs under $OUT (or /tmp/mxgemm_out). Usage: bash tools/dev/mxgemm_device.sh
. tools/dev/env.sh /tmp/mxgemm_out  # OUT, PYTHONPATH, the kernel cache
nvidia-smi -L
T0=$(date +%s)
for arch in sm_90a sm_90; do
  timeout 100 python3 -c "
import time; from quantcore.backends.cuda import mx as c; t = time.time()
c.compile_cubin(c.GEMM_SOURCE, '$arch'); print('mx_gemm.cu $arch NVRTC', round(time.time() - t, 1), 's')" &
done
wait
echo "build done at +$(( $(date +%s) - T0 )) s"

timeout 80 python3 - <<'PY' 2>&1 | tee "$OUT/time.log"
import json, os, statistics, sys
import torch
from quantcore.backends.cuda import mx as cmx
from quantcore.formats import mx
sys.path.insert(0, "tools/dev")
from mxgemm_time import operands  # the same random operands as the A/B timings

def timed(fn, reps, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)

dev = torch.device("cuda")
res = {"device": torch.cuda.get_device_name(0)}
print("device:", res["device"])
for (m, n, k) in ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 8192)):
    flops = 2.0 * m * n * k
    a16 = torch.randn((m, k), device=dev, dtype=torch.bfloat16)
    b16 = torch.randn((n, k), device=dev, dtype=torch.bfloat16)
    t = timed(lambda: torch.matmul(a16, b16.t()), 20)
    ref = flops / t / 1e9
    print(f"{m}x{n}x{k} torch bf16 matmul: {t:.4f} ms {ref:.0f} TFLOPS")
    res[f"{m}x{n}x{k}_torch_ms"] = t
    del a16, b16
    for fmt in mx.FP4_FORMATS:
        ac, bc, sa, sb, alpha = operands(fmt, dev, m, n, k)
        outs = {}
        runs = [("wgmma", ""), ("ws", "")]
        if fmt == "nvfp4" and m == 8192 and n == 8192:
            runs += [("wgmma", "_nodq"), ("ws", "_noadq"), ("ws", "_nobdq"), ("ws", "_nodq")]
        for mode, var in runs:
            out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
            def mm(mode=mode, var=var, out=out):
                cmx.scaled_fp4_mm(None, ac, bc, sa, sb, alpha, None, out, m=m, n=n, k=k, fmt=fmt, mode=mode, variant=var)
            t = timed(mm, 10)
            tf = flops / t / 1e9
            key = f"{m}x{n}x{k}_{fmt}_{mode}{var}"
            res[key + "_ms"] = t
            print(f"{m}x{n}x{k} {fmt} {mode}{var}: {t:.4f} ms {tf:.0f} TFLOPS {tf / ref:.3f}x torch")
            if not var:
                outs[mode] = out
        same = torch.equal(outs["ws"].view(torch.int16), outs["wgmma"].view(torch.int16))
        res[f"{m}x{n}x{k}_{fmt}_ws_bits_equal_wgmma"] = same
        print(f"{m}x{n}x{k} {fmt}: ws output bit-identical to wgmma: {same}")
        del ac, bc, sa, sb, outs
        torch.cuda.empty_cache()
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp/mxgemm_out"), "time.json"), "w"), indent=1)
PY
echo "timing done at +$(( $(date +%s) - T0 )) s"
timeout 75 python3 -m pytest -q -x tests/test_cuda_mx_gemm_ws.py 2>&1 | tee "$OUT/pytest_ws.log" | tail -15
echo "ws tests done at +$(( $(date +%s) - T0 )) s"
QUANTCORE_CUDA_MX_GEMM=ws timeout 45 python3 -m quantcore.conformance --backend cuda --full -k scaled_fp4_mm \
  2>&1 | tee "$OUT/conformance_ws.log" | tail -8
echo "conformance done at +$(( $(date +%s) - T0 )) s"
# the existing GEMM tests (explicit wgmma / mma modes) with the default mode set to ws, so the
# graph-capture test runs the ws kernel
QUANTCORE_CUDA_MX_GEMM=ws timeout 50 python3 -m pytest -q tests/test_cuda_mx.py -k "mm and not compiles" 2>&1 \
  | tee "$OUT/pytest_mm.log" | tail -8
echo "mm tests done at +$(( $(date +%s) - T0 )) s"
for mode in wgmma ws; do
  QUANTCORE_CUDA_MX_GEMM=$mode timeout 45 python3 -m quantcore.bench --backend cuda --ops scaled_fp4_mm -v \
    --json "$OUT/bench_$mode.json" --png "/tmp/bench_$mode.png" 2>&1 | tee "$OUT/bench_$mode.log" | tail -12
done
echo "all done at +$(( $(date +%s) - T0 )) s"
