"""The kernel interface, declared once: every kernel's arguments, in the order the kernels take them.

An op's entry points in the cpu library (``qc_<op>``), the MACA library (``qc_maca_<op>``) and the
SYCL bundle (``qc_<op>_<dtype>``, one free-function kernel per element type) take the arguments of
:data:`ENTRY_POINTS`; a dialect adds only its trailing extra (the cpu thread count, the MACA stream),
declared once per dialect. From this one declaration come:

- the C prototypes of every dialect, generated into ``quantcore_constants.h`` as the macros
  ``QC_CPU_PROTOTYPES``, ``QC_MACA_PROTOTYPES`` and ``QC_SYCL_PROTOTYPES``
  (:func:`prototype_macros`), which each dialect expands before its definitions: a definition that
  disagrees with its prototype does not compile (``extern "C"`` functions cannot be overloaded);
- the ctypes argument types of the cpu and maca libraries (:func:`ctypes_signatures`);
- the argument kinds the SYCL launcher marshals values by (:func:`sycl_kernels`).

The CUDA ``__global__`` kernels are templates compiled at run time, so no prototype can be generated
for them: :data:`CUDA_KERNELS` declares their parameter lists, the launchers build argument tuples
from it by name (``backends/cuda/runtime.kernel_args``), and tests/test_kernel_interface.py parses
kernels_cuda/*.cu and compares every ``__global__`` parameter list with it.

Types, in C-like notation: ``const u8*`` / ``u8*`` (bytes), ``f32``, ``f64``, ``u16``, ``u32``,
``bf16`` pointers; ``const elem*`` / ``elem*``: elements of the dtype that the ``dtype`` argument
names (SYCL and CUDA type them per instance, the others take ``void*``); ``const void*``: an
absmax (fp32, or uint8 codes when absmax2 is given) or a differently typed input; the scalars
``i32``, ``i64``, ``u32``, ``u64``, ``f32``. Plain Python (no numpy): kernel_defines and every
backend import it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

#: Element types a pointer may point to, and the scalar types.
POINTEES = ("u8", "u16", "u32", "f32", "f64", "bf16", "i32", "i64", "elem", "void")
SCALARS = ("i32", "i64", "u32", "u64", "f32")
#: values passed by value that are not scalars: ``tmap2``, two CUtensorMaps (2 x 128 bytes, 64-byte
#: aligned; CUDA only: a ``__grid_constant__`` parameter the kernel's TMAs read)
BY_VALUE = {"tmap2": 256}


class Arg(NamedTuple):
    name: str
    type: str  #: "i64", "const u8*", "elem*" ...

    @property
    def is_pointer(self) -> bool:
        return self.type.endswith("*")

    @property
    def kind(self) -> str:
        """``ptr`` or the scalar type: what a launcher converts the value to."""
        return "ptr" if self.is_pointer else self.type


def args(spec: str) -> tuple[Arg, ...]:
    """``"const u8* packed, i64 n"`` -> (Arg("packed", "const u8*"), Arg("n", "i64"))."""
    out = []
    for item in spec.split(","):
        words = item.replace("*", "* ").split()
        if len(words) < 2:
            raise ValueError(f"argument {item!r}: expected '<type> <name>'")
        type_, name = " ".join(words[:-1]).replace(" *", "*"), words[-1]
        base = type_.removeprefix("const ").rstrip("*")
        if (base not in POINTEES) if type_.endswith("*") else (type_ not in SCALARS and type_ not in BY_VALUE):
            raise ValueError(f"argument {item!r}: unknown type {type_!r}")
        out.append(Arg(name, type_))
    return tuple(out)


# -- the entry points of cpu, maca and sycl -------------------------------------------------------------
_NESTED = "const void* absmax, const f32* absmax2, const f32* code2, const f32* offset"
_GEMV = (f"const elem* a, i32 dtype, const u8* packed, {_NESTED}, elem* out, i64 rows, i64 n, i64 k, "
         "i32 blocksize, i32 quant_type")
_GGML_QUANTIZE = "const elem* x, i32 dtype, u8* out, i64 nblocks"
#: weights one grouped-gemv launch takes (cuda: kernels_cuda/bnb_gemv.cu QC_GT_GROUP_PARAMS x
#: QC_GV_GROUPS; sycl: qc_gemv_4bit_grouped), and the parameters of weight i of such a kernel
GEMV_TC_GROUPS = 4
_GEMV_TC_WEIGHT = ("const u8* packed{i}, const void* absmax{i}, const f32* absmax2_{i}, const f32* code2_{i}, "
                   "const f32* offset{i}, i64 n{i}")
#: their names per weight (the launchers pass weight i's arrays by these)
GEMV_TC_WEIGHT_NAMES = tuple(tuple(a.name for a in args(_GEMV_TC_WEIGHT.format(i=i))) for i in range(GEMV_TC_GROUPS))
_GEMV_WEIGHTS = ", ".join(_GEMV_TC_WEIGHT.format(i=i) for i in range(GEMV_TC_GROUPS))
_GEMM = "const u8* wq, const u8* aq, f32* out, i64 m, i64 n, i64 k"
#: the parameters of fp4 weight i of a grouped linear_mx kernel (sycl: qc_linear_mx_grouped)
_MX_WEIGHTS = ", ".join(f"const u8* codes{i}, const u8* scales{i}, const f32* global_scale{i}, i64 n{i}"
                        for i in range(GEMV_TC_GROUPS))

#: op -> its arguments. Sizes are i64; dtype, format, mode and flag codes i32 (kernel_defines'
#: DTYPE_CODE, QUANT_TYPE_CODE, GGML_FORMAT_CODE, mx.MX_FORMAT_CODE / SCALE_MODE_CODE); a nested
#: absmax is (uint8 codes, absmax2, code2, offset), a plain one (fp32, null, null, null).
ENTRY_POINTS: dict[str, tuple[Arg, ...]] = {op: args(spec) for op, spec in {
    "quantize_4bit": "const elem* x, i32 dtype, u8* packed, f32* absmax, i64 n, i32 blocksize, i32 quant_type",
    "dequantize_4bit": f"const u8* packed, {_NESTED}, elem* out, i32 dtype, i64 n, i32 blocksize, i32 quant_type",
    "double_quantize": "const f32* absmax, u8* qabsmax, f32* absmax2, f32* offset, i64 nblocks",
    "quantize_blockwise": "const elem* x, i32 dtype, const f32* thresholds, u8* codes, f32* absmax, i64 n, "
                          "i32 blocksize",
    "dequantize_blockwise": "const u8* codes, const f32* absmax, const f32* code, elem* out, i32 dtype, i64 n, "
                            "i32 blocksize",
    "gemv_4bit": _GEMV,
    "gemv_4bit_tiled": _GEMV,
    # up to GEMV_TC_GROUPS weights [n_i, K] that share the input in one launch (one quant type and
    # blocksize; nestedness per weight on sycl, one nestedness a launch on maca): weight i into
    # columns n_0 + ... + n_{i-1} .. of out [rows, ldo] (sycl, maca)
    "gemv_4bit_grouped": f"const elem* a, i32 dtype, {_GEMV_WEIGHTS}, elem* out, i64 ldo, i64 rows, i32 ngroups, "
                         "i64 k, i32 blocksize, i32 quant_type",
    "quantize_q4_0": _GGML_QUANTIZE,
    "quantize_q8_0": _GGML_QUANTIZE,
    "quantize_q8_1": _GGML_QUANTIZE,
    "dequantize_ggml": "const u8* q, i32 fmt, elem* out, i32 dtype, i64 nblocks",
    "gemm_q4_0_q8_1": _GEMM,
    "gemm_q4_0_q8_1_tiled": _GEMM,
    "gemm_w4a8": "const u8* wq, const elem* a, i32 dtype, f32* out, i64 m, i64 n, i64 k",
    "mx_quantize": "const elem* x, i32 dtype, u8* codes, u8* scales, i64 rows, i64 cols, i32 fmt, i32 scale_mode, "
                   "i32 swizzled, const f32* global_scale",
    "mx_dequantize": "const u8* codes, const u8* scales, elem* out, i32 dtype, i64 rows, i64 cols, i32 fmt, "
                     "i32 swizzled, const f32* global_scale",
    "swizzle_scales": "const u8* scales, u8* out, i64 rows, i64 cols",
    "unswizzle_scales": "const u8* swz, u8* out, i64 rows, i64 cols",
    "scaled_fp4_mm": "const u8* a, const u8* b, const u8* scale_a, const u8* scale_b, const f32* alpha, "
                     "const bf16* bias, bf16* out, i64 m, i64 n, i64 k, i32 fmt",
    "linear_mx": "const elem* x, i32 dtype, const u8* codes, const u8* scales, const f32* global_scale, elem* out, "
                 "i64 rows, i64 n, i64 k, i32 fmt, i32 swizzled",
    # up to GEMV_TC_GROUPS fp4 weights [n_i, K] of one format and scale layout that share the input in
    # one launch: weight i into columns n_0 + ... + n_{i-1} .. of out [rows, ldo] (sycl)
    "linear_mx_grouped": f"const elem* x, i32 dtype, {_MX_WEIGHTS}, elem* out, i64 ldo, i64 rows, i32 ngroups, "
                         "i64 k, i32 fmt, i32 swizzled",
}.items()}


class Dialect(NamedTuple):
    name: str
    ops: tuple[str, ...]  #: the ENTRY_POINTS it has
    symbol: str  #: "qc_{op}" ...
    result: str  #: the C result type of an entry point
    trailing: tuple[Arg, ...]  #: appended to every entry point
    c_types: dict[str, str]  #: pointee / scalar -> C spelling (elem: see prototypes)
    extra: dict[str, tuple[Arg, ...]]  #: op -> arguments of this dialect only, after the common ones
    own: dict[str, tuple[str, tuple[Arg, ...]]]  #: entry points of this dialect only: name -> (result, args)


_HOST_TYPES = {"u8": "uint8_t", "u16": "uint16_t", "u32": "uint32_t", "f32": "float", "f64": "double",
               "bf16": "uint16_t", "elem": "void", "void": "void", "i32": "int", "u64": "uint64_t"}

#: the cpu library (kernels_cpu/qc_cpu.cpp): gemv_4bit's tiles and the GEMMs' composites are the glue's
#: (the host runs them as one kernel), so it lacks the _tiled and gemm_w4a8 entry points
#: (and the grouped gemv / linear_mx: the cpu backend runs gemv_4bit / linear_mx per weight)
CPU = Dialect(
    "cpu", tuple(op for op in ENTRY_POINTS
                 if not op.endswith("_tiled") and op not in ("gemm_w4a8", "gemv_4bit_grouped", "linear_mx_grouped")),
    "qc_{op}", "void",
    args("i32 nt"),  # OpenMP threads (<= 0: the OpenMP default)
    {**_HOST_TYPES, "i64": "int64_t"}, {},
    {"qc_cpu_build_info": ("const char*", ()), "qc_cpu_max_threads": ("int", ()),
     "qc_stream_read": ("double", args("const f32* p, i64 n, i32 nt")),  # the bench's bandwidth ceilings
     "qc_stream_copy": ("void", args("const f32* src, f32* dst, i64 n, i32 nt"))},
)

#: the MACA launchers (kernels_maca/*.maca): each returns its mcError_t; long long is their i64 (no
#: grouped linear_mx: the API runs linear_mx per weight there)
MACA = Dialect(
    "maca", tuple(op for op in ENTRY_POINTS if op != "linear_mx_grouped"), "qc_maca_{op}", "int", (Arg("stream", "stream"),),
    {**_HOST_TYPES, "i64": "long long", "stream": "mcStream_t"}, {},
    {"qc_maca_error_string": ("const char*", args("i32 err")), "qc_maca_wave_size": ("int", ()),
     "qc_maca_device_wave_size": ("int", args("i32 device, i32* out")),
     "qc_maca_device_shared_memory": ("int", args("i32 device, i32* out")),
     "qc_maca_set_device": ("int", args("i32 device"))},
)

#: the SYCL free-function kernels (kernels_sycl/entry_points.cpp): one per element type, so no
#: dtype argument; int64_t is their i64
SYCL = Dialect(
    "sycl", tuple(ENTRY_POINTS), "qc_{op}", "void", (),
    {**_HOST_TYPES, "bf16": "qc::bf16", "i64": "int64_t"},
    # the blockwise quantizers spread a block over values_per_item work-items (the launcher's split)
    {op: args("i64 values_per_item") for op in ("quantize_4bit", "quantize_blockwise", "double_quantize")},
    # double_quantize's first step (its offset: one work-group's fp64 tree mean, on fp64 devices);
    # the kernel that reports the sub-group size the device really runs (a test)
    # (and the grouped gemv's column copy for many rows: rows of row_bytes from src into dst's rows of
    # dst_stride bytes)
    {"qc_absmax_mean": ("void", args("const f32* absmax, i64 nblocks, f32* offset")),
     "qc_copy_rows": ("void", args("const u8* src, u8* dst, i64 rows, i64 row_bytes, i64 dst_stride")),
     "qc_subgroup_probe": ("void", args("i64* out"))},
)
DIALECTS = {d.name: d for d in (CPU, MACA, SYCL)}
#: SYCL kernels that state their required sub-group size (they reduce over a sub-group)
SYCL_SUBGROUP_KERNELS = ("gemv_4bit", "gemv_4bit_tiled", "gemv_4bit_grouped", "gemm_q4_0_q8_1",
                         "gemm_q4_0_q8_1_tiled", "gemm_w4a8", "linear_mx", "linear_mx_grouped", "qc_subgroup_probe")
#: SYCL element types: kernel name suffix -> C type
SYCL_ELEMENTS = {"f32": "float", "f16": "qc::half", "bf16": "qc::bf16"}
#: dtype name (kernel_defines.DTYPE_CODE's keys) -> SYCL kernel name suffix
SYCL_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def dialect_args(dialect: Dialect, op: str) -> tuple[Arg, ...]:
    """The arguments of ``op``'s entry point in ``dialect``: the common ones (SYCL: without dtype),
    the dialect's extra for the op, its trailing ones."""
    common = ENTRY_POINTS[op]
    if dialect is SYCL:
        common = tuple(a for a in common if a.name != "dtype")
    return common + dialect.extra.get(op, ()) + dialect.trailing


def typed(op: str) -> bool:
    """Does ``op`` take elements of a dtype (then SYCL has one kernel per element type)?"""
    return any(a.type.removeprefix("const ").rstrip("*") == "elem" for a in ENTRY_POINTS[op])


def _c_decl(a: Arg, c_types: dict[str, str], elem: str) -> str:
    const = "const " if a.type.startswith("const ") else ""
    base = a.type.removeprefix("const ").rstrip("*")
    ctype = elem if base == "elem" else c_types[base]
    return f"{const}{ctype}{'*' if a.is_pointer else ''} {a.name}"


def prototypes(dialect: Dialect) -> list[str]:
    """The C declarations of every entry point of ``dialect`` (SYCL: each element type's kernel)."""
    out = []
    entries = [(dialect.symbol.format(op=op), dialect.result, dialect_args(dialect, op), op) for op in dialect.ops]
    entries += [(name, res, a, name) for name, (res, a) in dialect.own.items()]
    for name, result, arglist, key in entries:
        if dialect is SYCL:
            prefix = "QC_KERNEL_SUBGROUP" if key in SYCL_SUBGROUP_KERNELS else "QC_KERNEL"
            instances = ([(f"{name}_{sfx}", c) for sfx, c in SYCL_ELEMENTS.items()]
                         if key in ENTRY_POINTS and typed(key) else [(name, "void")])
            for inst, elem in instances:
                params = ", ".join(_c_decl(a, dialect.c_types, elem) for a in arglist)
                out.append(f"{prefix} {result} {inst}({params});")
        else:
            params = ", ".join(_c_decl(a, dialect.c_types, "void") for a in arglist) or "void"
            out.append(f"{result} {name}({params});")
    return out


def prototype_macros() -> list[tuple[str, str]]:
    """(macro name, body) of each dialect's prototypes, for the generated header: a dialect expands
    ``QC_<DIALECT>_PROTOTYPES`` where its entry points' declarations belong (cpu: inside its
    extern "C" block; maca: after QC_EXPORT; sycl: after QC_KERNEL / QC_KERNEL_SUBGROUP)."""
    macros = []
    for d in DIALECTS.values():
        decls = prototypes(d)
        if d is MACA:
            decls = [f"QC_EXPORT {p}" for p in decls]
        macros.append((f"QC_{d.name.upper()}_PROTOTYPES", " \\\n  ".join(decls)))
    return macros


def symbols(dialect: Dialect) -> dict[str, tuple[str, tuple[Arg, ...]]]:
    """Every C symbol of ``dialect``'s library: name -> (C result type, arguments)."""
    out = {dialect.symbol.format(op=op): (dialect.result, dialect_args(dialect, op)) for op in dialect.ops}
    out.update(dialect.own)
    return out


def ctypes_signatures(dialect: Dialect) -> dict[str, tuple[object, list[object]]]:
    """name -> (restype, argtypes) of every symbol of a host library (cpu, maca), for ctypes."""
    import ctypes

    scalar = {"i32": ctypes.c_int, "i64": ctypes.c_int64, "u32": ctypes.c_uint32, "u64": ctypes.c_uint64,
              "f32": ctypes.c_float}
    result = {"void": None, "int": ctypes.c_int, "double": ctypes.c_double, "const char*": ctypes.c_char_p}

    def ctype(a: Arg):
        if a.is_pointer or a.type == "stream":
            return ctypes.POINTER(ctypes.c_int) if a.type == "i32*" else ctypes.c_void_p
        return scalar[a.type]

    return {name: (result[res], [ctype(a) for a in arglist]) for name, (res, arglist) in symbols(dialect).items()}


def sycl_kernels() -> dict[str, tuple[Arg, ...]]:
    """SYCL kernel name (with its element type suffix) -> its arguments."""
    out = {}
    for name, (_, arglist) in symbols(SYCL).items():
        op = name.removeprefix("qc_")
        if op in ENTRY_POINTS and typed(op):
            out.update({f"{name}_{sfx}": arglist for sfx in SYCL_ELEMENTS})
        else:
            out[name] = arglist
    return out


# -- CUDA: the __global__ kernels' parameter lists ------------------------------------------------------------
#: ranks the one-shot all-reduce takes at most (kernels_cuda/allreduce.cu: one buffer parameter each)
AR_MAX_RANKS = 8
#: allreduce.cu: a round's arguments, after each kernel's tensors: the ranks' symmetric buffers
#: (QC_AR_MAX_RANKS), the round counter, this rank, the world, 16-byte units, a slot's bytes, the mode
_AR_ROUND = (", ".join(f"u8* buf{i}" for i in range(AR_MAX_RANKS))
             + ", u32* round, i32 rank, i32 world, i64 units, i64 slot_bytes, i32 mode")
_MX_GEMM = ("const u8* a, const u8* b, const u8* scale_a, const u8* scale_b, const f32* alpha, const u16* bias, "
            "u16* out, i32 m, i32 n, i32 k, i32 flags")
_MX_QUANTIZE2 = ("const elem* x, u8* codes, u8* scales, const f32* gscale, u32 nunits, u32 rows, u32 ncols, "
                 "i32 ncols_shift, u32 prow, u32 pcols, i32 swizzled, i32 mode")

#: kernel (a template's name, or the prefix of an extern "C" family such as qc_mx_gemv_<fmt>_<dtype>_b<NB>)
#: -> its parameters
CUDA_KERNELS: dict[str, tuple[Arg, ...]] = {name: args(spec) for name, spec in {
    # bnb_4bit.cu
    "quantize_4bit_kernel": "const elem* x, u8* packed, f32* absmax, i64 n, i32 log2bs, i32 vec",
    "quantize_4bit_v3_kernel": "const elem* x, u8* packed, f32* absmax, i64 n, i32 vec",
    "dequantize_4bit_kernel": f"const u8* packed, {_NESTED}, elem* out, i64 n, i32 log2bs, i32 vec",
    "gemv_4bit_mma_kernel": f"const u16* a, const u8* packed, {_NESTED}, u16* out, i32 rows, i64 n, i64 k, "
                            "i32 log2bs, i32 ksplit",
    "gemv_4bit_simple_kernel": f"const elem* a, const u8* packed, {_NESTED}, elem* out, i32 rows, i64 n, i64 k, "
                               "i32 log2bs",
    # bnb_8bit.cu
    "quantize_blockwise_kernel": "const elem* x, const f32* thresholds, u8* codes, f32* absmax, const f32* center, "
                                 "i64 n, i32 log2bs, i32 vec",
    "dequantize_blockwise_kernel": "const u8* codes, const f32* absmax, const f32* code, elem* out, i64 n, "
                                   "i32 log2bs, i32 vec",
    "absmax_tree_sum_kernel": "const void* src, i64 count, f64* partial, f32* offset, i64 nb",
    "quantize_blockwise_v3_kernel": "const elem* x, const f32* thresholds, u8* codes, f32* absmax, i64 n, "
                                    "i32 log2bs, i32 vec, const f64* partials, i32 npart, i32 nchunks, f32* offset, "
                                    "i64 nb, i32 ndefer",
    "absmax_chunk_sum_v3_kernel": "const f32* src, i64 nb, i32 vec, f64* partials, u32* counter",
    # bnb_gemm.cu
    "gemm_4bit_kernel": f"const u16* a, const u8* packed, {_NESTED}, u16* out, i64 ldo, i32 rows, i64 n, "
                        "i64 k, i32 log2bs",
    # maps: the input's and the codes' CUtensorMaps (TMA), by value
    "gemm_4bit_wgmma_tma_kernel": f"const u16* a, const u8* packed, {_NESTED}, u16* out, i64 ldo, i32 rows, i64 n, "
                                 "i64 k, i32 log2bs, tmap2 maps",
    # bnb_gemv.cu: the input, GEMV_TC_GROUPS weights, the output (scols: an MX weight's swizzled scale columns, 0 otherwise)
    "gemv_4bit_tc_kernel": "const u16* a, " + _GEMV_WEIGHTS
        + ", u16* out, i64 ldo, i32 rows, i64 k, i32 log2bs, i32 ngroups, i32 scols",
    # allreduce.cu: the rank's partial sums, the output, the ranks' symmetric buffers (QC_AR_MAX_RANKS)
    "all_reduce_oneshot_kernel": f"const elem* x, elem* out, {_AR_ROUND}",
    # allreduce.cu: the same round, then the residual add and the RMSNorm after it
    "all_reduce_add_rms_norm_kernel": "const elem* x, const elem* res, const elem* w, elem* res_out, elem* norm_out, "
        f"{_AR_ROUND}, i32 rows, f32 eps",
    # ggml.cu
    "quantize_ggml_kernel": "const elem* x, u8* out, i64 nblocks, i32 vec, i32 aligned2",
    "dequantize_ggml_kernel": "const u8* q, elem* out, i64 nblocks, i32 vec",
    "gemm_w4a8_stream_kernel": "const u8* wq, const void* act, void* out, i64 m, i32 n, i64 k, i32 kbs, i32 kc, "
                               "i32 nstage, i32 tpc, i32 vec, i32 yt",
    "w4a8_tc_act_kernel": "const void* x, u8* ws, i32 n, i64 nb, i32 npad, i64 nbp, i32 vec, i32 aligned4",
    "gemm_w4a8_tc_kernel": "const u8* wq, const u8* ws, f32* out, i64 m, i32 n, i64 nb, i32 npad, i64 nbp, "
                           "i32 wfast, i32 ovec",
    # mx_gemm.cu, mx_gemv.cu, mx_quant.cu (extern "C" families: <prefix>_<fmt>_<dtype>...)
    "qc_mx_gemm_mma": _MX_GEMM,
    "qc_mx_gemm_wgmma": _MX_GEMM,
    "qc_mx_gemm_smem_bytes": "i32* out",
    "qc_mx_gemv": "const elem* x, const u8* codes, const u8* scales, const f32* gscale, elem* out, i32 nrows, "
                  "i32 n, i32 k, i32 pcols, i32 flags",
    "qc_mx_gemv_tc": "const u16* x, const u8* codes, const u8* scales, const f32* gscale, u16* out, i32 nrows, "
                     "i32 n, i32 k, i32 pcols, i32 flags",
    "qc_mx_quantize": "const elem* x, u8* codes, u8* scales, const f32* gscale, i64 rows, i32 ncols, i64 prow, "
                      "i32 pcols, i32 swizzled, i32 rceil, i32 vec",
    "qc_mx_quantize2": _MX_QUANTIZE2,
    "qc_mx_dequantize": "const u8* codes, const u8* scales, elem* out, const f32* gscale, u32 nchunks, u32 ncols, "
                        "u32 div_mul, u32 div_shift, u32 tile_row_bytes, u32 sstep, i32 swizzled, i32 vec",
    "qc_mx_swizzle": "const u8* s, u8* out, i64 rows, i32 cols, i64 prow, i32 pcols, i32 aligned",
    "qc_mx_unswizzle": "const u8* swz, u8* out, i64 rows, i32 cols, i32 pcols, i32 aligned",
    "qc_mx_mm_bias_fill": "const u16* bias, u16* out, f32* beta, u64 m, u32 n",
}.items()}


@functools.cache
def cuda_kernel(name: str) -> str:
    """The CUDA_KERNELS key of a kernel name or name expression: ``qc::gemm_4bit_kernel<...>`` ->
    ``gemm_4bit_kernel``; ``qc_mx_gemv_nvfp4_bf16_b4`` -> ``qc_mx_gemv`` (the longest declared prefix)."""
    base = name.split("<", 1)[0].rsplit("::", 1)[-1].strip()
    if base in CUDA_KERNELS:
        return base
    best = max((k for k in CUDA_KERNELS if base.startswith(k)), key=len, default=None)
    if best is None:
        raise KeyError(f"CUDA kernel {name!r} is not declared in quantcore.formats.kernel_interface.CUDA_KERNELS")
    return best


def arg_index(kernel: str, name: str) -> int:
    """Position of argument ``name`` in ``kernel``'s CUDA parameter list (a launch plan's slots)."""
    return [a.name for a in CUDA_KERNELS[cuda_kernel(kernel)]].index(name)
