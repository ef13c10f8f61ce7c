#!/bin/bash
# The wgmma NF4 GEMM (kernels_cuda/bnb_gemm.cu gemm_4bit_wgmma_tma_kernel) on the GPU machine: its time per
# QUANTCORE_CUDA_TUNE setting (TUNES="a;b": a CTA per tile gw_persist=0, the input-row tile gw_nb, the ring depth gw_tma_s, the cluster
# gw_cl) beside torch bf16, then ncu (full set, SASS
# source page with stall samples) of the default kernel at ROWS rows (default 512) of 14336 x 4096
# (NCU=0: timing only; NCU=mem: the memory sections of the wgmma GEMM and of torch's bf16 GEMM). Logs under $OUT.
. tools/dev/env.sh /tmp/gw_probe
ROWS="${ROWS:-512}"
cat > /tmp/gw_one.py <<PY
import os, sys, torch
import quantcore as qc
from quantcore.backends.cuda import plans as cuda_plans
from quantcore.backends.cuda import runtime as rt
from quantcore.bench import CudaTimer
be = qc.get_backend("cuda")
n, k = 14336, 4096
ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(3)]
qs = [qc.quantize_4bit(w, 64, "nf4", True, backend=be) for w in ws]
def gemv(x, out, p, s):
    be.gemv_4bit(x, p, s.absmax, out, n=n, k=k, blocksize=64, quant_type="nf4", nested=cuda_plans._state_nested(s))
if sys.argv[1] == "time":
    tm = CudaTimer(torch)
    for rows in (512, 2048):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        t_torch = tm.kernel([lambda w=w: torch.nn.functional.linear(x, w) for w in ws], 20, warmup=3)
        res = []
        for tune in os.environ.get("TUNES", ";gw_persist=0;gw_nb=128;gw_tma_s=3").split(";"):
            os.environ[rt.ENV_TUNE] = tune
            res.append((tune or "default", tm.kernel([lambda p=p, s=s: gemv(x, out, p, s) for p, s in qs], 20, warmup=3)))
        os.environ.pop(rt.ENV_TUNE, None)
        print(f"rows {rows}: torch {t_torch:.1f} us | " + " | ".join(f"{a} {t:.1f}" for a, t in res), flush=True)
else:
    rows = int(sys.argv[2])
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        if sys.argv[1] == "torch":
            torch.nn.functional.linear(x, ws[0])
        else:
            gemv(x, out, *qs[0])
    torch.cuda.synchronize()
    print("ok")
PY
timeout 150 python3 /tmp/gw_one.py time | tee "$OUT/time.log"
[ "${NCU:-1}" = 0 ] && exit 0
if [ "${NCU:-1}" = mem ]; then
  for who in ncu torch; do
    name=$([ $who = ncu ] && echo regex:gemm_4bit_wgmma || echo "regex:nvjet|gemm|cutlass")
    timeout 120 ncu --clock-control none --kernel-name "$name" --launch-skip 1 --launch-count 1 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --metrics lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum,gpc__cycles_elapsed.avg.per_second \
      python3 /tmp/gw_one.py $who "$ROWS" > "$OUT/ncu_mem_$who.txt" 2>&1
    echo "== $who rc=$?"; grep -E "Duration|Throughput|lts__|dram__bytes|gpc__cycles|Hit Rate|L2 Compression|Frequency" "$OUT/ncu_mem_$who.txt" | head -24
  done
  exit 0
fi
timeout 240 ncu --clock-control none --kernel-name regex:gemm_4bit_wgmma --launch-skip 1 --launch-count 1 \
  --set full --import-source no -o /tmp/gw -f python3 /tmp/gw_one.py ncu "$ROWS" > "$OUT/ncu_run.log" 2>&1
echo "ncu rc=$?"; tail -3 "$OUT/ncu_run.log"
ncu -i /tmp/gw.ncu-rep --page details --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section Occupancy > "$OUT/details.txt" 2>&1
ncu -i /tmp/gw.ncu-rep --page source --csv --print-source sass > "$OUT/source_sass.csv" 2>"$OUT/source_err.txt"
grep -E "Issue Slots Busy|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Stall|Throughput|Pipe|Bank|Shared" "$OUT/details.txt" | head -60
