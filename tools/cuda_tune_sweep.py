"""Launch-parameter sweep of the cuda backend's gemv_4bit and gemm_w4a8 (device machine only).

Each configuration is set through QUANTCORE_CUDA_TUNE and measured with quantcore.bench in this
one process; the table shows which setting the heuristics in backends/cuda should pick.
"""

import os

from quantcore import bench

CASES = [
    ("gemv_4bit", (1, 16384, 16384), ["gemv_ksplit=1", "gemv_ksplit=2", "gemv_ksplit=4", "gemv_ksplit=8",
                                      "gemv_ksplit=4,gemv_ctas_per_sm=2", "gemv_ksplit=8,gemv_ctas_per_sm=2"]),
    ("gemv_4bit", (1, 14336, 4096), ["gemv_ksplit=2", "gemv_ksplit=4", "gemv_ksplit=8",
                                     "gemv_ksplit=8,gemv_ctas_per_sm=2"]),
    ("gemm_w4a8", (1, 4096, 14336), ["gemm_tpc=1", "gemm_tpc=2", "gemm_tpc=4"]),
    ("gemm_w4a8", (8, 4096, 14336), ["gemm_tpc=1", "gemm_tpc=2", "gemm_tpc=4"]),
    ("gemm_w4a8", (1, 14336, 4096), ["gemm_tpc=4", "gemm_tpc=7", "gemm_tpc=8"]),
]

for op, size, configs in CASES:
    for cfg in configs:
        os.environ["QUANTCORE_CUDA_TUNE"] = cfg
        print(f"### {op} {size} {cfg}")
        b = bench.Bench("cuda", True, 30, False)
        b.bnb = None
        b.copy_gbps = None
        getattr(b, op)(size)
        for r in b.rows:
            if r.impl == "quantcore":
                print(f"SWEEP {op} {size} {cfg}: {r.kernel_us:.1f} us, {r.gbps:.0f} GB/s, {r.note}")
os.environ.pop("QUANTCORE_CUDA_TUNE", None)
