"""quantcore.nn.parallel's one-shot all-reduce (all_reduce="oneshot", kernels_cuda/allreduce.cu) against
NCCL's, on 2 GPUs: tests/ar_worker.py under torchrun (eager rounds of several sizes and dtypes, then a
CUDA graph replayed with new inputs, a gemv's output reduced at once, the fused all-reduce + add + norm),
in each of the kernel's protocols. Needs 2 CUDA devices, NCCL and CuPy: skipped elsewhere (CI's CPU
machine; the one-GPU device kind), run on the 2-GPU device kind with the same pytest command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("cupy", reason="cupy is not installed: the cuda backend launches the kernel through it")
if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
    pytest.skip("needs 2 CUDA devices (the all-reduce runs between them)", allow_module_level=True)
if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
    pytest.skip("torch.distributed with NCCL is not available", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tune", ["", "ar_mode=1", "ar_mode=0,ar_pdl=0"], ids=["sentinels", "flags", "pull-plain"])
def test_oneshot_all_reduce_equals_nccl(tmp_path, tune):
    env = dict(os.environ)
    env["QUANTCORE_CUDA_TUNE"] = tune  # the kernel's protocols (kernels_cuda/allreduce.cu), PDL or not
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")  # NVLink multicast stays off
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(REPO, "tests", "ar_worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        res = json.loads((tmp_path / f"ar_rank{r}.json").read_text())
        bad = [c for c in res["eager"] if not c["same"]]
        assert not bad and len(res["eager"]) == 45, bad
        assert res["graph"] == [True] * 4
        assert res["after_gemv"] == [True] * 6
        assert len(res["fused_norm"]) == 9 and all(c["h_same"] and c["norm_close"] for c in res["fused_norm"]), \
            res["fused_norm"]
