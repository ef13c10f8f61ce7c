"""The kernel interface (quantcore/formats/kernel_interface.py) against the kernel sources.

The cpu, maca and sycl entry points are checked by their compilers (the generated prototypes:
tests/test_cpu_kernels.py, test_maca.py, test_sycl.py build them). The CUDA kernels are templates
compiled at run time, which no prototype can declare: here every ``__global__`` parameter list of
kernels_cuda/*.cu is parsed (macros of the same file expanded) and compared, types and order, with
its declaration, and every declaration must have a kernel. The launchers build their argument
tuples from the declarations (backends/cuda/runtime.kernel_args), so source, declaration and
launcher cannot drift apart.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from quantcore.formats import kernel_defines, kernel_interface
from quantcore.formats.kernel_interface import CUDA_KERNELS, ENTRY_POINTS, arg_index, args, cuda_kernel

KERNELS_CUDA = Path(__file__).resolve().parents[1] / "kernels_cuda"

#: C spellings of the CUDA sources -> the interface's types
_C_BASE = {"u8": "u8", "uint8_t": "u8", "u16": "u16", "u32": "u32", "float": "f32", "double": "f64", "void": "void",
           "int": "i32", "i64": "i64", "long long": "i64", "unsigned": "u32", "unsigned int": "u32",
           "unsigned long long": "u64", "typename T::S": "elem", "T::S": "elem", "TmaMaps2": "tmap2"}


def _strip(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return text.replace("\\\n", " ")


def _close(text: str, i: int) -> int:
    """Index of the parenthesis that closes the one at ``text[i]``."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j
    raise ValueError("unbalanced parentheses")


def _macros(text: str) -> dict[str, tuple[list[str] | None, str]]:
    out = {}
    for m in re.finditer(r"^[ \t]*#define[ \t]+(\w+)(\([^)]*\))?[ \t]*(.*)$", text, re.M):
        params = [p.strip() for p in m.group(2)[1:-1].split(",")] if m.group(2) else None
        out[m.group(1)] = (params, m.group(3))
    return out


def _expand(params: str, macros) -> str:
    """``params`` with the macros of its file expanded (object-like and function-like, ## pasting)."""
    for _ in range(8):
        hits = [m for m in re.finditer(r"\b\w+\b", params) if m.group(0) in macros]
        if not hits:
            return params
        m = hits[0]
        formal, body = macros[m.group(0)]
        if formal is None:
            params = params[:m.start()] + body + params[m.end():]
            continue
        open_ = params.index("(", m.end())
        end = _close(params, open_)
        for f, a in zip(formal, (a.strip() for a in params[open_ + 1:end].split(","))):
            body = re.sub(rf"\s*##\s*{f}\b", a, body)
            body = re.sub(rf"\b{f}\b", a, body)
        params = params[:m.start()] + body + params[end + 1:]
    raise AssertionError(f"macros nest too deep in {params!r}")


def _type(param: str) -> str:
    p = re.sub(r"__restrict__|__grid_constant__|qcmx::|qc::|__attribute__\(\(.*?\)\)", " ", param)
    pointer = "*" in p
    const = bool(re.search(r"\bconst\b", p))
    words = re.sub(r"\bconst\b", " ", p.replace("*", " ")).split()
    base = " ".join(words[:-1])  # the last word is the name
    if base not in _C_BASE:
        raise AssertionError(f"parameter {param!r}: C type {base!r} has no interface type")
    t = _C_BASE[base]
    return f"{'const ' if const and pointer else ''}{t}{'*' if pointer else ''}"


def cuda_global_kernels() -> list[tuple[str, str, list[str]]]:
    """(file, kernel name up to any token pasting, parameter types) of every __global__ function."""
    found = []
    for path in sorted(KERNELS_CUDA.glob("*.cu")) + sorted(KERNELS_CUDA.glob("*.cuh")):
        text = _strip(path.read_text())
        macros = _macros(text)
        for g in re.finditer(r"__global__", text):
            i = g.end()
            while True:  # skip the attributes: void, __launch_bounds__(...), QC_WS_CLUSTER(...)
                m = re.compile(r"\s*([\w#]+)\s*(\()?").match(text, i)
                word = m.group(1)
                if m.group(2) and word not in ("__launch_bounds__", "__attribute__") and word not in macros:
                    break
                i = _close(text, m.end() - 1) + 1 if m.group(2) else m.end()
            name = word.split("##")[0].rstrip("_")
            params = _expand(text[m.end():_close(text, m.end() - 1)], macros)
            parts = [p.strip() for p in params.split(",") if p.strip()]
            found.append((path.name, name, [_type(p) for p in parts]))
    return found


def test_every_cuda_kernel_matches_its_declaration():
    found = cuda_global_kernels()
    assert len(found) >= len(CUDA_KERNELS)
    seen = set()
    for file, name, types in found:
        key = cuda_kernel(name)
        seen.add(key)
        declared = [a.type for a in CUDA_KERNELS[key]]
        assert types == declared, (f"{file}: {name}'s parameters {types} differ from the declaration of {key} "
                                   f"in quantcore/formats/kernel_interface.py: {declared}")
    assert seen == set(CUDA_KERNELS), f"declared without a kernel: {set(CUDA_KERNELS) - seen}"


def test_the_parser_sees_a_drifted_parameter():
    """The comparison above can fail: a kernel whose list differs from the declaration is caught."""
    text = (KERNELS_CUDA / "ggml.cu").read_text()
    assert "i64 nblocks, int vec) {" in text
    drifted = _type("int nblocks")
    assert drifted == "i32" != CUDA_KERNELS["dequantize_ggml_kernel"][2].type


def test_cuda_kernel_args_orders_and_converts_by_name():
    pytest.importorskip("numpy")
    import numpy as np
    from quantcore.backends.cuda.runtime import kernel_args

    got = kernel_args("qc::dequantize_ggml_kernel<qc::F32, 0>", out=16, q=None, vec=True, nblocks=3)
    assert got == (np.uint64(0), np.uint64(16), np.int64(3), np.int32(1))
    assert [type(v) for v in got] == [np.uint64, np.uint64, np.int64, np.int32]
    with pytest.raises(TypeError, match="missing: vec"):
        kernel_args("dequantize_ggml_kernel", q=None, out=None, nblocks=3)
    with pytest.raises(TypeError, match="not parameters of dequantize_ggml_kernel: bogus"):
        kernel_args("dequantize_ggml_kernel", q=None, out=None, nblocks=3, vec=0, bogus=1)
    with pytest.raises(TypeError, match="nblocks"):
        kernel_args("dequantize_ggml_kernel", q=None, out=None, nblocks=2.5, vec=0)


# -- the entry points of cpu, maca and sycl -------------------------------------------------------------------
def test_declarations_are_well_formed():
    with pytest.raises(ValueError, match="unknown type"):
        args("f16* x")
    for op, arglist in ENTRY_POINTS.items():
        names = [a.name for a in arglist]
        assert len(names) == len(set(names)), op
        # a typed op names its dtype (cpu and maca take void*; SYCL drops it for its per-dtype kernels)
        assert kernel_interface.typed(op) == ("dtype" in names), op


@pytest.mark.parametrize("dialect", ["cpu", "maca"])
def test_ctypes_signatures_follow_the_declaration(dialect):
    d = kernel_interface.DIALECTS[dialect]
    sigs = kernel_interface.ctypes_signatures(d)
    for op in d.ops:
        res, argtypes = sigs[d.symbol.format(op=op)]
        declared = kernel_interface.dialect_args(d, op)
        assert len(argtypes) == len(declared)
        for a, t in zip(declared, argtypes):
            want = {"ptr": ctypes.c_void_p, "stream": ctypes.c_void_p, "i32": ctypes.c_int, "i64": ctypes.c_int64,
                    "f32": ctypes.c_float}[a.kind]
            assert t is want, (op, a)


def test_prototypes_reach_the_generated_header():
    header = kernel_defines.constants_header()
    for macro in ("QC_CPU_PROTOTYPES", "QC_MACA_PROTOTYPES", "QC_SYCL_PROTOTYPES"):
        assert f"#define {macro} \\" in header
    assert "void qc_quantize_4bit(const void* x, int dtype, uint8_t* packed, float* absmax, int64_t n, " \
           "int blocksize, int quant_type, int nt);" in header
    assert "QC_EXPORT int qc_maca_quantize_4bit(const void* x, int dtype, uint8_t* packed, float* absmax, " \
           "long long n, int blocksize, int quant_type, mcStream_t stream);" in header
    assert "QC_KERNEL void qc_quantize_4bit_bf16(const qc::bf16* x, uint8_t* packed, float* absmax, int64_t n, " \
           "int blocksize, int quant_type, int64_t values_per_item);" in header


# -- every CUDA launch path builds its arguments from the declaration (fake arrays, no GPU) ----------
class _Ptr:
    def __init__(self, ptr: int):
        self.ptr = ptr


class _FakeArray:
    """A stand-in CuPy array: a device address, a shape and a dtype (the launchers read no data)."""

    _next = [1 << 20]

    def __init__(self, shape, dtype):
        import numpy as np

        from quantcore.arrays import as_dtype

        self.shape = tuple(shape)
        self.dtype = as_dtype(dtype)
        self.size = int(np.prod(self.shape))
        self.ndim = len(self.shape)
        self.data = _Ptr(self._next[0])
        self._next[0] += (self.size * self.dtype.itemsize // 256 + 2) * 256
        self.device = type("Dev", (), {"id": 0})()
        self.flags = type("Flags", (), {"c_contiguous": True})()

    def __getitem__(self, key):
        col = key[1].start or 0
        view = _FakeArray((self.shape[0], self.shape[1] - col), self.dtype)
        view.data = _Ptr(self.data.ptr + col * self.dtype.itemsize)
        return view


_FakeArray.__module__ = "cupy._fake"  # runtime.kind() takes it for a CuPy array


def test_every_cuda_launch_path_builds_its_arguments(monkeypatch):
    """Drive the cuda backend's launchers on an sm_90 stand-in (every family, the decode and
    fallback gemv, the grouped gemv, both W4A8 paths, double_quantize's two paths, the MX codecs,
    gemv and GEMM, the one-shot all-reduce) and check each launch's tuple against its kernel's declaration: a launcher that
    passes a wrong or missing name raises in kernel_args, one whose values have the wrong width
    fails here."""
    import types

    import numpy as np
    from quantcore.backends.cuda import bnb, common, ggml
    from quantcore.backends.cuda import mx as cmx
    from quantcore.backends.cuda import runtime as rt

    from quantcore.backend import Nested

    launches = []

    class Recorder:
        def __init__(self, like):
            self.device = 0

        def raw_stream(self):
            return None

        def stream_handle(self):
            return 0

        def __call__(self, file, expr, grid, block, args, shared_mem=0, pdl=False):
            launches.append((expr, args))

        def run(self, fn, what, grid, block, args, shared_mem=0):
            launches.append((what, args))

        def run_pdl(self, fn, what, grid, block, args, shared_mem=0):
            launches.append((what, args))

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        driver=types.SimpleNamespace(occupancyMaxActiveBlocksPerMultiprocessor=lambda *a: 4),
        Device=lambda d: types.SimpleNamespace(__enter__=lambda s: s, __exit__=lambda *a: None)))
    for mod in (rt, bnb, ggml):
        monkeypatch.setattr(mod, "Launcher", Recorder, raising=False)
    monkeypatch.setattr(rt, "cupy", lambda: fake_cupy)
    monkeypatch.setattr(rt, "device_props", lambda d: {"sharedMemPerBlockOptin": 232448, "major": 9, "minor": 0,
                                                       "multiProcessorCount": 132, "name": "stand-in"})
    monkeypatch.setattr(rt, "sm_count", lambda d: 132)
    monkeypatch.setattr(rt, "device_arch", lambda d: 90)
    monkeypatch.setattr(rt, "tensor_map_2d", lambda *a, **k: bytes(128))  # (the driver encodes them)
    monkeypatch.setattr(cmx, "function", lambda *a, **k: types.SimpleNamespace(ptr=1))
    monkeypatch.setattr(cmx, "_check", lambda *a: 0)
    monkeypatch.setattr(cmx, "_occupancy_grid", lambda *a, **k: 264)

    class Backend(bnb.BnbOps, ggml.GgmlOps):
        def empty(self, shape, dtype, like=None):
            return _FakeArray(shape, dtype)

    A, be = _FakeArray, Backend()
    nested = Nested(A((1,), np.float32), A((256,), np.float32), A((1,), np.float32))
    for dt in ("float32", "float16", "bfloat16"):
        be.quantize_4bit(A((8192,), dt), A((4096,), np.uint8), A((128,), np.float32), blocksize=64, quant_type="nf4")
        be.quantize_4bit(A((8192,), dt), A((4096,), np.uint8), A((2,), np.float32), blocksize=4096, quant_type="fp4")
        for nst in (None, nested):
            am = A((512,), np.float32 if nst is None else np.uint8)
            be.dequantize_4bit(A((16384,), np.uint8), am, A((32768,), dt), blocksize=64, quant_type="nf4", nested=nst)
            for rows in (1, 5, 40, 200):  # the decode gemv, the mma.sync GEMM, the wgmma GEMM (TMA)
                be.gemv_4bit(A((rows, 512), dt), A((32 * 512,), np.uint8), am, A((rows, 64), dt), n=64, k=512,
                             blocksize=64, quant_type="nf4", nested=nst)
        be.quantize_blockwise(A((5000,), dt), A((255,), np.float32), A((5000,), np.uint8), A((20,), np.float32),
                              blocksize=256)
        be.dequantize_blockwise(A((5000,), np.uint8), A((20,), np.float32), A((256,), np.float32), A((5000,), dt),
                                blocksize=256)
        for fmt in ("q4_0", "q8_0", "q8_1"):
            be._quantize_ggml(fmt, A((64, 256), dt), A((64 * 8 * 36,), np.uint8))
            be.dequantize_ggml(A((64, 8, 36), np.uint8), A((64, 256), dt), fmt=fmt)
        for rows in (4, 40):  # the streaming kernel, the tensor-core GEMM
            be.gemm_w4a8(A((128, 8, 18), np.uint8), A((rows, 256), dt), A((128, rows), np.float32))
    groups = [(A((64 * 256,), np.uint8), A((512,), np.float32), None, 64, 64, "nf4") for _ in range(5)]
    be.gemv_4bit_grouped(A((3, 512), "bfloat16"), groups, A((3, 320), "bfloat16"), k=512)
    for nb in (3000, 40000):  # the tree levels; the chunk sums
        be.double_quantize(A((nb,), np.float32), A((nb,), np.uint8), A((nb // 256 + 1,), np.float32),
                           A((1,), np.float32))
    with monkeypatch.context() as m:
        m.setenv("QUANTCORE_CUDA_TUNE", "gemv_kernel=1")  # the register-fed mma gemv
        be.gemv_4bit(A((4, 512), "float16"), A((32 * 512,), np.uint8), A((512,), np.float32), A((4, 64), "float16"),
                     n=64, k=512, blocksize=64, quant_type="nf4", nested=None)
    for fmt, blk in (("nvfp4", 16), ("mxfp4", 32), ("mxfp8", 32)):
        gs = A((1,), np.float32) if fmt == "nvfp4" else None
        codes = A((128, 256 if fmt == "mxfp8" else 128), np.uint8)
        for dt in ("float32", "bfloat16"):
            cmx.mx_quantize(be, A((128, 256), dt), codes, A((128, 256 // blk), np.uint8), rows=128, cols=256, fmt=fmt,
                            scale_mode="rceil", swizzled=True, global_scale=gs)
            cmx.mx_dequantize(be, codes, A((128, 256 // blk), np.uint8), A((128, 256), dt), rows=128, cols=256,
                              fmt=fmt, swizzled=False, global_scale=gs)
        if fmt != "mxfp8":
            # the decode gemv (bnb_gemv.cu, the default here), then mx_gemv.cu's tensor-core gemv and its
            # CUDA-core one (one input row)
            for rows, tune in ((4, ""), (4, "mx_gemv_dec=0"), (1, "mx_gemv_dec=0")):
                with monkeypatch.context() as m:
                    m.setenv("QUANTCORE_CUDA_TUNE", tune)
                    cmx.linear_mx(be, A((rows, 512), "bfloat16"), A((256, 256), np.uint8),
                                  A((256, 512 // blk), np.uint8), A((rows, 256), "bfloat16"), n=256, k=512, fmt=fmt,
                                  swizzled=True, global_scale=gs)
            cmx.scaled_fp4_mm(be, A((256, 256), np.uint8), A((256, 256), np.uint8), A((256 * 32,), np.uint8),
                              A((256 * 32,), np.uint8), A((1,), np.float32), A((256,), "bfloat16"),
                              A((256, 256), "bfloat16"), m=256, n=256, k=512, fmt=fmt)
    # linear_mx_grouped: each run of weights of one format in one decode-gemv launch (4 nvfp4, then 2 mxfp4)
    gsn = A((1,), np.float32)
    mxg = [(A((64, 256), np.uint8), A((64, 32), np.uint8), gsn, 64, "nvfp4", False) for _ in range(4)]
    mxg += [(A((64, 256), np.uint8), A((64, 16), np.uint8), None, 64, "mxfp4", False) for _ in range(2)]
    n0, gout = len(launches), A((3, 384), "bfloat16")
    cmx.linear_mx_grouped(be, A((3, 512), "bfloat16"), mxg, gout, k=512)
    assert len(launches) == n0 + 2 and all("gemv_4bit_tc_kernel" in expr for expr, _ in launches[n0:])
    (_, first), (_, second) = launches[n0:]

    def gv(args, name):
        return int(args[arg_index("gemv_4bit_tc_kernel", name)])

    assert all(gv(first, f"absmax2_{i}") == gsn.data.ptr for i in range(4))  # each weight's global scale
    assert gv(second, "absmax2_0") == 0 and gv(second, "n1") == 64 and gv(second, "n2") == 0
    assert gv(first, "out") == gout.data.ptr and gv(second, "out") == gout.data.ptr + 256 * 2  # its columns
    assert gv(first, "ldo") == gv(second, "ldo") == 384
    cmx.swizzle_scales(be, A((200, 8), np.uint8), A((256, 8), np.uint8), rows=200, cols=8)
    for dt in ("float32", "bfloat16"):  # the one-shot all-reduce of tensor-parallel decode, 2 ranks
        common.all_reduce_oneshot(A((8192,), dt), A((8192,), dt), [1 << 20, 2 << 20], A((1,), np.int32), rank=1)
        common.all_reduce_add_rms_norm(A((2, 8192), dt), A((2, 8192), dt), A((8192,), dt), A((2, 8192), dt),
                                       A((2, 8192), dt), 1e-5, [1 << 20, 2 << 20], A((1,), np.int32), rank=1)
    cmx.unswizzle_scales(be, A((256, 8), np.uint8), A((200, 8), np.uint8), rows=200, cols=8)

    width = {"ptr": np.uint64, "i32": np.int32, "i64": np.int64, "u32": np.uint32, "u64": np.uint64,
             "f32": np.float32, "tmap2": np.void}
    kernels = set()
    for name, args_ in launches:
        key = cuda_kernel(name)
        kernels.add(key)
        assert [type(v) for v in args_] == [width[a.kind] for a in CUDA_KERNELS[key]], name
    # every kernel a launcher reaches on sm_90 (the GEMM's mma back end, the v1 quantize the launcher
    # picks by format, and the probe are the others)
    assert kernels >= set(CUDA_KERNELS) - {"qc_mx_gemm_mma", "qc_mx_gemm_smem_bytes", "qc_mx_mm_bias_fill"}, \
        set(CUDA_KERNELS) - kernels
