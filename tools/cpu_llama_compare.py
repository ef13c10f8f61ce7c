"""llama.cpp's CPU speed on quantcore's Q4_0 shapes (issue #25): ggml's mul_mat of a Q4_0 weight
[N, K] by one fp32 activation row, through the ggml libraries that llama-cpp-python bundles (its
CPU build), called with ctypes
the weight bytes are quantcore's ``quantize_q4_0`` (ggml's
block_q4_0, 18 bytes a block). ggml quantizes the activation to Q8_0 inside the call, as
quantcore's gemm_w4a8 quantizes it to Q8_1. Weights rotated over copies until one pass is >= 96 MB
(DRAM, not L3). ``ggml_graph_compute_with_ctx`` starts its threads per call: the fixed cost is
printed (a 64-row graph) so it can be told apart.

    python -m venv /tmp/venv_llama && /tmp/venv_llama/bin/pip install llama-cpp-python
    PYTHONPATH=. /tmp/venv_llama/bin/python tools/cpu_llama_compare.py [threads] [reps]

``QC_LLAMA_LIB`` overrides the folder of libggml-base.so / libggml-cpu.so.
"""
import ctypes
import glob
import os
import sys
import time

import numpy as np

L = os.environ.get("QC_LLAMA_LIB") or (glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages",
                                                                 "llama_cpp", "lib")) + [""])[0]
L = L.rstrip("/") + "/"
base = ctypes.CDLL(L + "libggml-base.so", mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(L + "libggml-cpu.so", mode=ctypes.RTLD_GLOBAL)
class Params(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]
vp = ctypes.c_void_p
base.ggml_init.restype = vp
base.ggml_init.argtypes = [Params]
base.ggml_new_tensor_2d.restype = vp
base.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
base.ggml_mul_mat.restype = vp
base.ggml_mul_mat.argtypes = [vp, vp, vp]
base.ggml_new_graph.restype = vp
base.ggml_new_graph.argtypes = [vp]
base.ggml_build_forward_expand.argtypes = [vp, vp]
base.ggml_get_data.restype = vp
base.ggml_get_data.argtypes = [vp]
base.ggml_nbytes.restype = ctypes.c_size_t
base.ggml_nbytes.argtypes = [vp]
cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
GGML_TYPE_F32, GGML_TYPE_Q4_0 = 0, 2
nth = int(sys.argv[1]) if len(sys.argv) > 1 else 2
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
import quantcore as qc  # noqa: E402

rng = np.random.default_rng(0)
print("ggml avx512:", cpu.ggml_cpu_has_avx512(), "vnni:", cpu.ggml_cpu_has_avx512_vnni(), "threads:", nth)
for N, K in [(64, 4096), (4096, 4096), (14336, 4096)]:
    w = rng.standard_normal((N, K)).astype(np.float32)
    wq = np.ascontiguousarray(qc.quantize_q4_0(w, backend="cpu")).view(np.uint8).reshape(-1)
    x = rng.standard_normal(K).astype(np.float32)
    nbytes = wq.nbytes + 4 * K
    ncopy = int(96e6 // nbytes) + 1
    ctx = base.ggml_init(Params(ncopy * (wq.nbytes + 4 * K + 4 * N + 4096) + (64 << 20), None, False))
    graphs, outs = [], []
    xt = base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, 1)
    ctypes.memmove(base.ggml_get_data(xt), x.ctypes.data, x.nbytes)
    for _ in range(ncopy):
        wt = base.ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_0, K, N)
        assert base.ggml_nbytes(wt) == wq.nbytes
        ctypes.memmove(base.ggml_get_data(wt), wq.ctypes.data, wq.nbytes)
        y = base.ggml_mul_mat(ctx, wt, xt)
        g = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(g, y)
        graphs.append(g)
        outs.append(y)
    for g in graphs[:2]:
        cpu.ggml_graph_compute_with_ctx(ctx, g, nth)
    # check against quantcore's W4A8 (both quantize the activation to 8 bits; ggml uses Q8_0)
    res = np.ctypeslib.as_array((ctypes.c_float * N).from_address(base.ggml_get_data(outs[0])))
    ref = np.asarray(qc.gemm_w4a8(qc.quantize_q4_0(w, backend="cpu"), x[None, :], N, 1, K, backend="cpu")).reshape(-1)
    rel = np.abs(res - ref).max() / np.abs(ref).max()
    ts = []
    for i in range(reps):
        g = graphs[i % ncopy]
        t = time.perf_counter()
        cpu.ggml_graph_compute_with_ctx(ctx, g, nth)
        ts.append(time.perf_counter() - t)
    ts = np.array(ts) * 1e6
    print(f"llama.cpp ggml mul_mat Q4_0 x f32 N1 {N}x{K}: best {ts.min():.0f} us median {np.median(ts):.0f} us "
          f"({nbytes / np.median(ts) / 1e3:.1f} GB/s median); "
          f"max rel diff vs quantcore gemm_w4a8 {rel:.2e}")
