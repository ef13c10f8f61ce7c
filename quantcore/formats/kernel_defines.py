"""Feed every format constant to the kernel dialects from one place.

:func:`constants_header` renders the core's tables and sizes as a C/C++ header of macros
(``QC_NF4_CODE_INIT`` is a brace initializer, ``QC_QK`` a number ...). The CUDA, SYCL and MACA
backends write it as ``quantcore_constants.h`` next to their build and compile against it, so a
kernel never spells a table itself. fp32 values are written with 9 significant digits, which
round-trips every fp32 exactly.
"""

from __future__ import annotations

import numpy as np

from . import bnb, ggml, kernel_interface

HEADER_NAME = "quantcore_constants.h"


#: Integer codes the launchers receive for dtypes and 4-bit types (one definition for all).
DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}
QUANT_TYPE_CODE = {"nf4": 0, "fp4": 1}
#: The decode gemv's weight types (kernels_cuda/bnb_gemv.cu, its QT template argument): the 4-bit
#: types above and the MX FP4 formats it runs for linear_mx (QC_GV_QT_MXFP4, QC_GV_QT_NVFP4).
DECODE_GEMV_QT = {**QUANT_TYPE_CODE, "mxfp4": 2, "nvfp4": 3}
#: Integer codes of the ggml formats (a kernel's FMT template argument; QC_FMT_Q4_0 ... in the header).
GGML_FORMAT_CODE = {"q4_0": 0, "q8_0": 1, "q8_1": 2}


def gemv_ring_bytes(chunks: int, stages: int) -> int:
    """Bytes of one warp's ring in the decode gemv: ``stages`` slots of 16 rows, each row 32 bytes per
    64-element chunk plus 32 bytes of padding (rows on distinct banks; the stage's scales)."""
    return stages * 16 * (32 * chunks + 32)


def _gemv_geometry(warps: int, groups: int, ring: tuple[int, int], short_ring: tuple[int, int],
                   short_max: int) -> dict[str, int]:
    return {"QC_GV_WARPS": warps, "QC_GV_GROUPS": groups, "QC_GV_CHUNKS": ring[0], "QC_GV_STAGES": ring[1],
            "QC_GV_CHUNKS_SHORT": short_ring[0], "QC_GV_STAGES_SHORT": short_ring[1],
            "QC_GV_SHORT_MAX": short_max,
            "QC_GV_RING": max(gemv_ring_bytes(*ring), gemv_ring_bytes(*short_ring)), "QC_GV_XS_BYTES": 256 * 128}


#: Launch geometry that a kernel and its launcher share, generated into the header like the format
#: constants. The decode gemv (kernels_cuda/bnb_gemv.cu): warps per CTA, weights per launch, chunks
#: per ring stage and stages per warp ring (8 x 2), the same for short work (4 x 3: when a warp's range
#: holds fewer than QC_GV_SHORT_MAX chunks, it starts computing after 4 chunks instead of 8), the
#: larger ring's bytes (the launcher sizes shared memory for it), the input bytes a CTA keeps in its
#: decode table's free halves (256 rows of which the lanes' entries use 128 bytes).
#: The bitsandbytes kernels' launch geometry (kernels_cuda/bnb_4bit.cu, bnb_8bit.cu): quantize_4bit's
#: threads, elements per thread, CTAs per multiprocessor and ring stages; dequantize_4bit's threads and
#: packed words per thread; the fallback gemv's warps, pieces per iteration and shared memory (its
#: decode table of 256 x 64 words, the dynamic map, the reduction); quantize_blockwise's threads;
#: double_quantize's tree level chunk, chunk-sum threads and chunk (8 values per thread) and the
#: most chunk sums the quantize launch reduces (its 512 threads x 8).
_GEMV_MMA_WARPS = 8
BNB_GEOMETRY = {
    "QC_Q4_THREADS": 256, "QC_Q4_ELEMS": 16, "QC_Q4_CTAS_PER_SM": 4, "QC_Q4_STAGES": 3,
    "QC_DQ4_THREADS": 256, "QC_DQ4_WORDS": 8,
    "QC_GEMV_MMA_WARPS": _GEMV_MMA_WARPS, "QC_GEMV_MMA_U": 4,
    "QC_GEMV_MMA_SMEM": 4 * (256 * 64 + bnb.DYNAMIC_MAP.size + _GEMV_MMA_WARPS * 16 * 8),
    "QC_QBW_THREADS": 512,
    "QC_DQ_TREE_CHUNK": 2048, "QC_DQ_SUM_THREADS": 1024, "QC_DQ_SUM_CHUNK": 1024 * 8,
    "QC_DQ_SUM_MAX_PARTS": 512 * 8,
    # the fallback gemv (one warp per weight row), dequantize_blockwise (words of 8 codes per thread),
    # double_quantize's tree level (8 warps: the reference's pairwise order over their sums)
    "QC_GEMV_SIMPLE_THREADS": 256, "QC_DQBW_THREADS": 256, "QC_DQBW_WORDS": 2, "QC_DQ_TREE_THREADS": 256,
}
LAUNCH_GEOMETRY = {**_gemv_geometry(warps=16, groups=kernel_interface.GEMV_TC_GROUPS, ring=(8, 2), short_ring=(4, 3),
                                    short_max=80),
                   **BNB_GEOMETRY}
#: kernels_cuda/bnb_gemm.cu, gemv_4bit for many rows: threads per CTA, the pair table's bytes (256
#: code bytes x 256: the 64 KiB that one byte_perm addresses), the padding after an input row's
#: chunks and after a weight row's code chunks of a ring slot (rows on distinct banks), and the
#: dynamic shared memory a CTA takes (sm_90's 227 KiB: one CTA per multiprocessor)
LAUNCH_GEOMETRY.update({"QC_GM_THREADS": 256, "QC_GM_TABLE": 65536, "QC_GM_APAD": 16, "QC_GM_CPAD": 32,
                        "QC_GM_SMEM": 227 * 1024})


#: kernels_cuda/bnb_gemm.cu's wgmma GEMM (sm_90a, gemv_4bit for many rows): threads per CTA (two
#: warpgroups), its weight rows per CTA (the two warpgroups' m64 tiles) and its dynamic shared memory
#: (the ring's codes, the QC_GM_TABLE pair table with the input tiles around it, the ring's barriers,
#: code2's copy: one CTA per multiprocessor)
LAUNCH_GEOMETRY.update({"QC_GW_THREADS": 256, "QC_GW_ROWS": 128, "QC_GW_SMEM": 227 * 1024})
#: ... and its deepest ring (gemm_4bit_wgmma_tma_kernel: the space of its full / empty barriers)
LAUNCH_GEOMETRY["QC_GWT_MAX_STAGES"] = 8
#: ... and a stage's codes in bytes (its code slot): 64 4-bit elements of each of its weight rows
LAUNCH_GEOMETRY["QC_GW_STAGE_CODES"] = LAUNCH_GEOMETRY["QC_GW_ROWS"] * 64 // 2


def gw_slot_bytes(nb: int) -> int:
    """One ring slot of bnb_gemm.cu's wgmma GEMM with NB input rows per CTA (GwGeo::kSlot): the input
    tile (NB rows x 64 16-bit elements; the stage's codes have a slot of their own, bnb_gemm.cu kWtCodes)."""
    return nb * 128


def gm_slot_bytes(ww: int, wr: int, wk: int) -> int:
    """One ring slot of bnb_gemm.cu's (WW, WR, WK) CTA (GmGeo::kSlot): the packed codes of 64 WW
    weight rows, the input tile of 32 WR rows (WK chunks each, padded rows) and 8 bytes of scale data
    per weight row and chunk."""
    g = LAUNCH_GEOMETRY
    cpitch = 32 * wk + (g["QC_GM_CPAD"] if wk > 1 else 0)
    apitch = 128 * wk + g["QC_GM_APAD"]
    return 64 * ww * cpitch + 32 * wr * apitch + 64 * ww * wk * 8


#: kernels_cuda/allreduce.cu, the one-shot all-reduce of tensor-parallel decode (quantcore.nn.parallel):
#: threads of its one CTA, ranks at most (its buffer parameters), the flag words' bytes at the start of
#: each rank's symmetric buffer, rounds of slots after them (3: the sentinel protocol's; the flag
#: protocol uses 2), 16-byte units of a row per thread in all_reduce_add_rms_norm (rows of up to
#: 4 x 512 x 16 bytes: 16384 bf16), the sentinel word of a free slot (-0.0 in each element), the flag
#: bit of `mode` that lets the next kernel launch at the start (the protocol in the bits below it),
#: polls of a peer's flag or slot before the kernel traps
LAUNCH_GEOMETRY.update({"QC_AR_THREADS": 512, "QC_AR_MAX_RANKS": kernel_interface.AR_MAX_RANKS,
                        "QC_AR_FLAG_BYTES": 128, "QC_AR_ROUNDS": 3, "QC_AR_NORM_UNITS": 4,
                        "QC_AR_SENTINEL_16": 0x80008000, "QC_AR_SENTINEL_32": 0x80000000, "QC_AR_EARLY": 4,
                        "QC_AR_SPIN_LIMIT": 1 << 26})
#: the cpu backend's linear_mx (kernels_cpu/qc_cpu.cpp): input rows per call at most (its
#: accumulators; the glue splits larger batches)
LAUNCH_GEOMETRY["QC_CPU_MX_BATCH"] = 16
#: linear_mx's gemv (kernels_cuda/mx_gemv.cu): warps per CTA, input rows per launch at most, and the
#: weight rows per CTA: QC_MXGV_ROWS for up to 2 input rows, QC_MXGV_ROWS_B4 for 3..8, QC_MXGV_ROWS_B16
#: for 9..16 (the accumulators take RW x B registers); :func:`mx_gemv_rows` for the launcher.
MX_GEMV_GEOMETRY = {"QC_MXGV_WARPS": 4, "QC_MXGV_MAX_BATCH": 16, "QC_MXGV_ROWS": 4, "QC_MXGV_ROWS_B4": 2,
                    "QC_MXGV_ROWS_B16": 1}


def _mx_gemv_tc_geometry(warps: int, chunks: int, stages: int) -> dict[str, int]:
    pitch = 32 * chunks + 16  # bytes per row of a ring slot: 64-element chunks of 32 bytes; rows on distinct banks
    ring = stages * 16 * pitch
    scales = chunks * 4 * 16 * 4  # a stage's decoded scales: chunks x (at most 4 blocks) x 16 rows, fp32
    return {"QC_MXTC_WARPS": warps, "QC_MXTC_CHUNKS": chunks, "QC_MXTC_STAGES": stages, "QC_MXTC_PITCH": pitch,
            "QC_MXTC_RING": ring, "QC_MXTC_SCALES": scales, "QC_MXTC_SMEM": warps * (ring + scales)}


#: linear_mx's tensor-core gemv (kernels_cuda/mx_gemv.cu, mx_gemv_tc): warps per CTA (one CTA per
#: multiprocessor), 64-element chunks per ring stage, stages per warp ring, the slot row pitch, one
#: warp's ring and decoded-scale bytes, and the CTA's dynamic shared memory (the launcher's size).
MX_GEMV_GEOMETRY.update(_mx_gemv_tc_geometry(warps=16, chunks=4, stages=4))


def mx_gemv_rows(nb: int) -> int:
    """Weight rows per CTA of the linear_mx gemv instance for ``nb`` input rows (its template NB)."""
    g = MX_GEMV_GEOMETRY
    return g["QC_MXGV_ROWS"] if nb <= 2 else (g["QC_MXGV_ROWS_B4"] if nb <= 8 else g["QC_MXGV_ROWS_B16"])


def _tiled_geometry(tile_m: int, tile_n: int, tile_k: int, tm: int, tn: int, chunk: int) -> dict[str, int]:
    threads = (tile_m // tm) * (tile_n // tn)
    if tile_m % tm or tile_n % tn or tile_k % ggml.QK or tile_k % chunk:
        raise ValueError("tiles must hold whole micro-tiles, Q4_0 blocks and chunks")
    return {"QC_TILE_M": tile_m, "QC_TILE_N": tile_n, "QC_TILE_K": tile_k, "QC_TILE_TM": tm,
            "QC_TILE_TN": tn, "QC_TILE_CHUNK": chunk, "QC_TILE_THREADS": threads,
            "QC_TILED_MIN_ROWS": TILED_MIN_ROWS}


#: The many-rows kernels of the portable backends (kernels_sycl/tiled.hpp, kernels_maca/tiled.maca):
#: gemv_4bit with more than 8 activation rows and the W4A8 GEMMs with N > 8. A work-group / CTA
#: computes TILE_M weight rows x TILE_N activation rows, walking K in steps of TILE_K values
#: (TILE_K / 32 Q4_0 blocks) staged in local / shared memory; each of its THREADS work-items keeps
#: a TM x TN register micro-tile; a 4-bit weight tile is decoded in CHUNK consecutive values per
#: work-item. Fewer than TILED_MIN_ROWS rows go to the few-rows kernels (glue of both backends).
TILED_MIN_ROWS = 9
TILED_GEOMETRY = _tiled_geometry(tile_m=64, tile_n=64, tile_k=64, tm=4, tn=4, chunk=16)

#: The W4A8 tensor-core GEMM (kernels_cuda/ggml.cu gemm_w4a8_tc_kernel) and its launcher: Q4_0
#: blocks of K per pipeline stage, the padding of an activation row in shared memory (bytes), and
#: the row multiple of the Q8_1 workspace (the widest activation tile).
W4A8_TC_GEOMETRY = {"QC_W4T_BK": 8, "QC_W4T_APAD": 16, "QC_W4T_NPAD": 128,
                    # the ggml codecs' and the activation pass's threads per CTA (one block each)
                    "QC_GGML_THREADS": 256,
                    # the W4A8 streaming kernel for N <= 8 (gemm_w4a8_stream_kernel): consumer warps,
                    # weight rows per tile (the mma's M)
                    "QC_WS_WARPS": 16, "QC_WS_ROWS": 16,
                    # workspace bytes per (row, block): 32 int8 quants, the fp32 pair (d8, -d8 1.5 2^23),
                    # the fp16 s
                    "QC_W4T_WS_BLOCK_BYTES": ggml.QK + 8 + 2}


#: The MX dequantize kernel (kernels_cuda/mx_quant.cu, mx_dequantize_impl): threads per CTA and
#: 16-byte chunks per thread whose loads are in flight together; QC_MXDQ_CVT8: MXFP8 codes converted by the
#: hardware's E4M3 -> f16 conversion on sm_89+ (0: from the shared-memory table, as on older GPUs).
MX_DEQUANT_GEOMETRY = {"QC_MXDQ_THREADS": 256, "QC_MXDQ_UNROLL": 4, "QC_MXDQ_CVT8": 1}


def _mx_gemm_geometry(threads: int, bm: int, bn: int, stages: int, stage_k: int, bs_bufs: int,
                      group_m: int) -> dict[str, int]:
    from . import mx

    tile = mx.SWIZZLE_TILE_BYTES
    stage = bm * stage_k // 2 + bn * stage_k // 2 + 2 * 2 * tile + 2 * tile  # A, B codes; their scales
    smem = 1024 + bs_bufs * bn * 128 + stages * stage + 256 * 4  # alignment, B tiles, ring, scale table
    return {"QC_MXG_THREADS": threads, "QC_MXG_BM": bm, "QC_MXG_BN": bn, "QC_MXG_STAGES": stages,
            "QC_MXG_STAGE_K": stage_k, "QC_MXG_BS_BUFS": bs_bufs, "QC_MXG_GROUP_M": group_m,
            "QC_MXG_SMEM_BYTES": smem}


#: The other MX kernels (kernels_cuda/mx_quant.cu, mx_gemm.cu): threads per CTA of the one-item-per-
#: thread kernels (quantize version 1, swizzle, unswizzle, the bias fill); version 2 quantize's
#: threads (a 32-element unit each per tile) and ring stages for 16-bit and fp32 input; the fused
#: GEMM's threads, output tile, pipeline stages, K per stage, B tile buffers, CTA raster group and
#: its dynamic shared memory (the kernel asserts its own sum equals it).
MX_KERNEL_GEOMETRY = {"QC_MX_THREADS": 256, "QC_MXQ2_THREADS": 256, "QC_MXQ2_STAGES_16": 4, "QC_MXQ2_STAGES_32": 2,
                      **_mx_gemm_geometry(threads=256, bm=256, bn=128, stages=4, stage_k=128, bs_bufs=3, group_m=8)}


#: The SYCL kernels' launch geometry (kernels_sycl/, read by backends/sycl): blockwise dequantize
#: (bitsandbytes' kDequantizeBlockwise: work-items per work-group, packed bytes per work-item, a
#: tile of 512 bytes); blockwise quantize (work-items per work-group, at least this many consecutive
#: values per work-item, a block spread over blocksize / values_per_item work-items of one group);
#: gemv_4bit (one sub-group per weight row, rows per work-group, 4-bit values per lane and step);
#: the activation rows a gemv / GEMM work-group serves from one read of the weights; double
#: quantization's one summing work-group (fp64 tree); ggml quantize / dequantize (one work-item per
#: 32-value block); NVFP4 / MX (one work-item per block, value or scale byte); the ggml GEMMs (one
#: sub-group per weight row, the activation staged in chunks of QC_SUBGROUP_SIZE blocks).
SYCL_GEOMETRY = {"QC_DEQUANT_WG": 128, "QC_DEQUANT_BYTES_PER_ITEM": 4, "QC_QUANT_WG": 128,
                 "QC_QUANT_MIN_VALUES_PER_ITEM": 4, "QC_GEMV_ROWS_PER_WG": 4, "QC_GEMV_VALUES_PER_LANE": 32,
                 "QC_MAX_BATCH": 8, "QC_SUM_WG": 256, "QC_GGML_WG": 64, "QC_MX_WG": 128, "QC_GEMM_ROWS_PER_WG": 4}
#: The required sub-group size of the SYCL kernels that reduce over a sub-group (gemv, the ggml
#: GEMMs): 32 on GPUs (bitsandbytes' choice; its bf16 gemv was once wrong because the size did not
#: reach the kernel). The run-time build always passes -DQC_SUBGROUP_SIZE=<n> per device (on a CPU
#: device the native float width: 8 with AVX2, 16 with AVX-512, docs/sycl.md); this is the default.
SYCL_SUBGROUP_SIZE = 32


def _f32_list(values) -> str:
    vals = np.asarray(values, dtype=np.float32)
    items = []
    for v in vals:
        s = f"{float(v):.9g}"
        if "e" not in s and "." not in s and "inf" not in s and "nan" not in s:
            s += ".0"
        items.append(s + "f")
    return "{" + ", ".join(items) + "}"


def _int_list(values) -> str:
    return "{" + ", ".join(str(int(v)) for v in values) + "}"


def _entries() -> list[tuple[str, str]]:
    e = [
        ("QC_NF4_CODE_INIT", _f32_list(bnb.NF4_CODE)),
        ("QC_NF4_THRESHOLDS_INIT", _f32_list(bnb.NF4_THRESHOLDS)),
        ("QC_NF4_NTHRESHOLDS", str(bnb.NF4_THRESHOLDS.size)),
        ("QC_FP4_CODE_INIT", _f32_list(bnb.FP4_CODE)),
        ("QC_FP4_THRESHOLDS_INIT", _f32_list(bnb.FP4_THRESHOLDS)),
        ("QC_FP4_NTHRESHOLDS", str(bnb.FP4_THRESHOLDS.size)),
        ("QC_FP4_STEP_CODES_INIT", _int_list(bnb.FP4_STEP_CODES)),
        ("QC_FP4_SIGN_BIT", str(bnb.FP4_SIGN_BIT)),
        ("QC_QUANT_NF4", str(QUANT_TYPE_CODE["nf4"])),
        ("QC_QUANT_FP4", str(QUANT_TYPE_CODE["fp4"])),
        ("QC_GV_QT_MXFP4", str(DECODE_GEMV_QT["mxfp4"])),
        ("QC_GV_QT_NVFP4", str(DECODE_GEMV_QT["nvfp4"])),
        ("QC_NESTED_BLOCKSIZE", str(bnb.NESTED_BLOCKSIZE)),
        ("QC_DYNAMIC_NTHRESHOLDS", str(bnb.DYNAMIC_THRESHOLDS.size)),
        ("QC_DYNAMIC_MAP_INIT", _f32_list(bnb.DYNAMIC_MAP)),
        ("QC_DYNAMIC_THRESHOLDS_INIT", _f32_list(bnb.DYNAMIC_THRESHOLDS)),
        ("QC_QK", str(ggml.QK)),
        ("QC_Q4_0_BLOCK_BYTES", str(ggml.Q4_0_BLOCK_BYTES)),
        ("QC_Q8_0_BLOCK_BYTES", str(ggml.Q8_0_BLOCK_BYTES)),
        ("QC_Q8_1_BLOCK_BYTES", str(ggml.Q8_1_BLOCK_BYTES)),
        ("QC_Q4_0_OFFSET", str(ggml.Q4_0_OFFSET)),
        ("QC_Q4_0_ROUND_BIAS", f"{ggml.Q4_0_ROUND_BIAS}f"),
        ("QC_Q8_MAX", str(ggml.Q8_MAX)),
        ("QC_Q8_1_NAN_S_BITS", hex(ggml.Q8_1_NAN_S_BITS)),
        *((f"QC_FMT_{fmt.upper()}", str(code)) for fmt, code in GGML_FORMAT_CODE.items()),
        ("QC_DTYPE_F32", str(DTYPE_CODE["float32"])),
        ("QC_DTYPE_F16", str(DTYPE_CODE["float16"])),
        ("QC_DTYPE_BF16", str(DTYPE_CODE["bfloat16"])),
        *((name, str(value)) for name, value in LAUNCH_GEOMETRY.items()),
        *((name, str(value)) for name, value in MX_GEMV_GEOMETRY.items()),
        *((name, str(value)) for name, value in TILED_GEOMETRY.items()),
        *((name, str(value)) for name, value in W4A8_TC_GEOMETRY.items()),
        *((name, str(value)) for name, value in MX_DEQUANT_GEOMETRY.items()),
        *((name, str(value)) for name, value in MX_KERNEL_GEOMETRY.items()),
        *((name, str(value)) for name, value in SYCL_GEOMETRY.items()),
    ]
    try:  # the MX family adds its constants when present
        from . import mx

        e += mx.kernel_constants()
    except (ImportError, AttributeError):
        pass
    return e




def constants_header() -> str:
    lines = [
        "// Generated by quantcore.formats.kernel_defines from the core's format constants.",
        "// Do not edit: change the constant in quantcore/formats and every dialect follows.",
        "#pragma once",
    ]
    lines += [f"#define {name} {value}" for name, value in _entries()]
    lines += ["#ifndef QC_SUBGROUP_SIZE", f"#define QC_SUBGROUP_SIZE {SYCL_SUBGROUP_SIZE}", "#endif"]
    # each dialect's entry point declarations (quantcore.formats.kernel_interface), expanded by the
    # dialect before its definitions so that a definition that disagrees does not compile
    lines += [f"#define {name} \\\n  {body}" for name, body in kernel_interface.prototype_macros()]
    return "\n".join(lines) + "\n"


def write_header(directory) -> str:
    """Write ``quantcore_constants.h`` into ``directory`` if its content changed; return its path."""
    import os

    path = os.path.join(str(directory), HEADER_NAME)
    text = constants_header()
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except OSError:
        pass
    os.makedirs(str(directory), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path
