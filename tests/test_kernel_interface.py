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
from quantcore.formats.kernel_interface import CUDA_KERNELS, ENTRY_POINTS, args, cuda_kernel

KERNELS_CUDA = Path(__file__).resolve().parents[1] / "kernels_cuda"

#: C spellings of the CUDA sources -> the interface's types
_C_BASE = {"u8": "u8", "uint8_t": "u8", "u16": "u16", "u32": "u32", "float": "f32", "double": "f64", "void": "void",
           "int": "i32", "i64": "i64", "long long": "i64", "unsigned": "u32", "unsigned int": "u32",
           "unsigned long long": "u64", "typename T::S": "elem", "T::S": "elem"}


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
    p = re.sub(r"__restrict__|qcmx::|qc::|__attribute__\(\(.*?\)\)", " ", param)
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
