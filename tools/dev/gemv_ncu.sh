#!/usr/bin/env bash
# The decode gemv (kernels_cuda/bnb_gemv.cu gemv_4bit_tc_kernel) under ncu on the GPU machine: its
# fourth launch per format and shape (tools/cuda_profile_gemv.py), one line per metric: time, DRAM
# bytes and throughput, issue activity, the stall reasons, shared-memory wavefronts.
# Usage (repository root): FMTS="nf4 mxfp4" SHAPES="28672x8192 8192x8192" bash tools/dev/gemv_ncu.sh
. tools/dev/env.sh "${OUT:-/tmp/gv_ncu}"
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum
M=$M,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active
M=$M,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,launch__grid_size,launch__block_size
for r in barrier long_scoreboard wait short_scoreboard mio_throttle lg_throttle math_pipe_throttle no_instruction \
         selected not_selected dispatch_stall; do
  M=$M,smsp__average_warp_latency_issue_stalled_$r.ratio
done
for f in ${FMTS:-nf4 mxfp4}; do
  for sh in ${SHAPES:-28672x8192 8192x8192}; do
    timeout 120 ncu --clock-control none --kernel-name regex:gemv_4bit_tc --launch-skip 3 --launch-count 1 \
      --metrics "$M" python3 tools/cuda_profile_gemv.py --fmt "$f" --reps 5 ${sh/x/ } 2>&1 \
      | grep -E "^\s+(gpu__|dram|lts|sm__|smsp|l1tex|launch)" | awk -v t="$f $sh" '{print t, $1, $NF}'
  done
done
