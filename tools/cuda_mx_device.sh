#!/bin/bash
# One call on the GPU machine: build the MX modules with NVRTC (SASS summary), run the GPU tests,
# then the benchmark. Logs under $OUT (or /tmp/cuda_mx_out). Usage: bash tools/cuda_mx_device.sh [pytest -k expr]
. tools/dev/env.sh /tmp/cuda_mx_out  # OUT, PYTHONPATH, the kernel cache
nvidia-smi -L
python3 - <<'PY' 2>&1 | tee "$OUT/build.log"
import os, re, shutil, subprocess, time
from quantcore.backends.cuda import mx as cmx
out = os.environ.get("OUT", "/tmp/cuda_mx_out")
for src, arch in ((cmx.QUANT_SOURCE, "sm_90"), (cmx.GEMM_SOURCE, "sm_90a"), (cmx.GEMM_SOURCE, "sm_90")):
    t = time.time()
    cub = cmx.compile_cubin(src, arch)
    print(f"{src} {arch}: NVRTC {time.time() - t:.1f} s, {len(cub)} bytes")
    p = f"/tmp/{src}-{arch}.cubin"
    open(p, "wb").write(cub)
    sass = ""
    for tool in (shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm",
                 shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"):
        args = [tool, p] if "nvdisasm" in tool else [tool, "-sass", p]
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode == 0 and r.stdout:
            sass = r.stdout
            break
        print(tool, r.returncode, r.stderr[:200])
    if src == cmx.GEMM_SOURCE:
        open(f"{out}/gemm_{arch}.sass", "w").write(sass)
    pieces = re.split(r"(?:Function : |\.text\.)(qc_\w+)", sass)
    for name, fn in zip(pieces[1::2], pieces[2::2]):
        ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", fn)
        if not ops:
            continue
        cnt = {}
        for o in ops:
            base = o.split(".")[0]
            cnt[base] = cnt.get(base, 0) + 1
        keys = ("HGMMA", "HMMA", "LDSM", "LDGSTS", "WARPGROUP", "BAR", "LDL", "STL", "HFMA2", "LOP3", "SHF", "LDS", "STS")
        print(f"  {name}: {len(ops)} instr; " + ", ".join(f"{k} {cnt.get(k, 0)}" for k in keys))
PY
K="${1:-not compiles}"
timeout 400 python3 -m pytest -q -x -k "$K" tests/test_cuda_mx.py 2>&1 | tee "$OUT/pytest.log" | tail -40
timeout 200 python3 tools/cuda_mx_bench.py --experiments --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
