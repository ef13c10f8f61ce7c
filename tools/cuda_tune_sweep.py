"""Launch-parameter sweep of the cuda backend's gemv_4bit and gemm_w4a8 (device machine only).

Each configuration is set through QUANTCORE_CUDA_TUNE and measured with quantcore.bench in this
one process; the table shows which setting the heuristics in backends/cuda should pick.
"""

import os

from quantcore.backends.cuda.runtime import ENV_TUNE

from quantcore import bench

CASES = [
    ("gemv_4bit", (1, 16384, 16384), ["gemv_kernel=1", "gemv_ksplit=1", "gemv_ksplit=2", "gemv_ksplit=4",
                                      "gemv_ksplit=8"]),
    ("gemv_4bit", (1, 14336, 4096), ["gemv_kernel=1", "gemv_ksplit=1", "gemv_ksplit=2", "gemv_ksplit=4",
                                     "gemv_ksplit=8"]),
]
if os.environ.get("SWEEP_W4A8"):
    CASES += [("gemm_w4a8", (1, 4096, 14336), ["w4a8_small=0", "w4s_kc=64", "w4s_kc=128", "w4s_kc=224"]),
              ("gemm_w4a8", (8, 4096, 14336), ["w4a8_small=0", "w4s_kc=128", "w4s_kc=224", "w4s_cl=2,w4s_kc=224"])]

for op, size, configs in CASES:
    for cfg in configs:
        os.environ[ENV_TUNE] = cfg
        print(f"### {op} {size} {cfg}")
        b = bench.Bench("cuda", True, 30, False)
        b.bnb = None
        b.copy_gbps = None
        getattr(b, op)(size)
        for r in b.rows:
            if r.impl == "quantcore":
                print(f"SWEEP {op} {size} {cfg}: {r.kernel_us:.1f} us, {r.gbps:.0f} GB/s, {r.note}")
os.environ.pop(ENV_TUNE, None)
