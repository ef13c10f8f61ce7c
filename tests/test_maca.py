"""The maca backend: MetaX MACA sources, their CUDA compatibility build, and the Python glue.

CPU-safe part (runs in CI): every ``kernels_maca/*.maca`` compiles and links with this machine's
nvcc through the compatibility header; the exact mxcc command lines are pinned; the compat header
holds mappings only; the sources use mc* names, one wave-width constant and no inline PTX;
the MX conversions of qc_mx.h, compiled for the host, match quantcore.formats.mx; availability
says why the backend cannot run here.

GPU part (skipped with the reason where the backend is unavailable; run on the GPU machine with
the same pytest command): the library's wave size, the public API on a side stream, launch errors
surfacing as KernelError, the cache folder. Bit-exactness and tolerances of every op are the
conformance suite's (tests/test_conformance_backends.py runs it on maca where it is available).
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np
import pytest
from quantcore.backends import maca
from quantcore.backends.maca import build

import quantcore as qc
from quantcore import ops
from quantcore.arrays import BF16
from quantcore.errors import DeviceError, KernelError
from quantcore.formats import ggml, kernel_interface, mx
from quantcore.formats.kernel_defines import DTYPE_CODE

from .conftest import bits

NVCC = build.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the MACA sources are "
                                "compile-checked with nvcc through the CUDA compatibility header")
KERNELS = build.kernel_dir()
EXPECTED_SOURCES = {"bnb_4bit.maca", "bnb_8bit.maca", "gemv_4bit.maca", "ggml_quant.maca",
                    "ggml_gemm.maca", "mx.maca", "runtime.maca", "tiled.maca"}


def _kernel_texts() -> dict[str, str]:
    """The MACA sources and their headers (not the compat folder)."""
    files = sorted(KERNELS.glob("*.maca")) + sorted(KERNELS.glob("*.h"))
    return {f.name: f.read_text() for f in files}


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


# -- the CUDA compatibility build, on any machine with nvcc (no GPU needed) -------------------------
@pytest.fixture(scope="module")
def compat_build(tmp_path_factory):
    """libqc_maca.so built here with nvcc through the compat header, in a private cache."""
    cache = tmp_path_factory.mktemp("xdg-cache")
    toolchain = build.Toolchain(build.MODE_NVCC_COMPAT, NVCC, archs=("sm_90",))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        mp.delenv("QUANTCORE_CACHE_DIR", raising=False)
        path = build.build_library(toolchain)
        mtime = path.stat().st_mtime_ns
        again = build.build_library(toolchain)
    return toolchain, path, again, mtime, cache


def test_sources_are_the_expected_set():
    assert {p.name for p in build.sources()} == EXPECTED_SOURCES


@needs_nvcc
def test_every_maca_source_compiles_and_links_with_nvcc_through_compat(compat_build):
    toolchain, path, again, mtime, cache = compat_build
    assert path.is_file() and path.name == build.LIBRARY_NAME
    assert str(path).startswith(str(cache / "quantcore" / "maca"))
    # second call: the cached library, not a rebuild
    assert again == path and path.stat().st_mtime_ns == mtime
    lib = maca._load_library(str(path), toolchain)
    for op in kernel_interface.MACA.ops:
        assert hasattr(lib, f"qc_maca_{op}"), op
    assert lib.qc_maca_wave_size() == 32  # the compatibility build's constant (NVIDIA warp)


@needs_nvcc
def test_launcher_error_codes_become_kernel_error(compat_build):
    toolchain, path, *_ = compat_build
    lib = maca._load_library(str(path), toolchain)
    # An unknown dtype code is rejected by the launcher (mcErrorInvalidValue), before any launch.
    rc = lib.qc_maca_quantize_4bit(None, 99, None, None, 64, 64, 0, None)
    assert rc != 0
    with pytest.raises(KernelError, match=r"maca quantize_4bit failed: invalid argument"):
        maca.MacaBackend._check(lib, "quantize_4bit", rc)
    rc = lib.qc_maca_dequantize_ggml(None, 7, None, 0, 1, None)  # no format has code 7
    with pytest.raises(KernelError, match="invalid argument"):
        maca.MacaBackend._check(lib, "dequantize_ggml", rc)
    # MX launchers: an unknown format or scale mode, nvfp4 without its global scale, K off the block
    f32 = DTYPE_CODE["float32"]
    nvfp4, mxfp4 = mx.MX_FORMAT_CODE["nvfp4"], mx.MX_FORMAT_CODE["mxfp4"]
    assert lib.qc_maca_mx_quantize(None, f32, None, None, 2, 64, 7, 0, 0, None, None) != 0
    assert lib.qc_maca_mx_quantize(None, f32, None, None, 2, 64, mxfp4, 5, 0, None, None) != 0
    assert lib.qc_maca_mx_quantize(None, f32, None, None, 2, 64, nvfp4, 0, 0, None, None) != 0
    assert lib.qc_maca_mx_quantize(None, f32, None, None, 2, 48, mxfp4, 0, 0, None, None) != 0
    assert lib.qc_maca_mx_dequantize(None, None, None, f32, 2, 64, nvfp4, 1, None, None) != 0
    assert lib.qc_maca_scaled_fp4_mm(None, None, None, None, None, None, None, 1, 1, 64, nvfp4, None) != 0
    assert lib.qc_maca_scaled_fp4_mm(None, None, None, None, 1, None, None, 1, 1, 48, mxfp4, None) != 0
    assert lib.qc_maca_unswizzle_scales(None, None, 0, 4, None) != 0
    # linear_mx: nvfp4 without its global scale, K off the block, an unknown format or dtype
    assert lib.qc_maca_linear_mx(None, f32, None, None, None, None, 1, 4, 64, nvfp4, 1, None) != 0
    assert lib.qc_maca_linear_mx(None, f32, None, None, None, None, 1, 4, 48, mxfp4, 1, None) != 0
    assert lib.qc_maca_linear_mx(None, f32, None, None, None, None, 1, 4, 64, 7, 1, None) != 0
    assert lib.qc_maca_linear_mx(None, 99, None, None, None, None, 1, 4, 64, mxfp4, 1, None) != 0


MX_HARNESS = r"""
#include "qc_mx.h"
#include <cstdio>
#include <vector>
// The conversions of qc_mx.h on the host, for tests/test_maca.py to compare with the reference.
// argv: inputs (fp32), per-input results (6 bytes each), decoders (3 x 256 fp32), swizzle
// offsets (int64) of each "rows,cols" shape given after them. Prints the number of swizzle
// positions whose inverse is wrong.
static std::vector<char> slurp(const char* path) {
  FILE* f = fopen(path, "rb");
  std::vector<char> buf;
  char tmp[1 << 16];
  size_t got;
  while ((got = fread(tmp, 1, sizeof(tmp), f)) > 0) buf.insert(buf.end(), tmp, tmp + got);
  fclose(f);
  return buf;
}
int main(int argc, char** argv) {
  std::vector<char> in = slurp(argv[1]);
  const size_t n = in.size() / 4;
  std::vector<unsigned char> res(6 * n);
  for (size_t i = 0; i < n; ++i) {
    float x;
    memcpy(&x, &in[4 * i], 4);
    const float a = fabsf(x);
    res[6 * i + 0] = qc_e2m1_code(x);
    res[6 * i + 1] = qc_e4m3_code(x);
    res[6 * i + 2] = qc_e8m0_scale(a, QC_EMAX_E2M1, QC_MAX_MANTISSA_BITS_E2M1, false);
    res[6 * i + 3] = qc_e8m0_scale(a, QC_EMAX_E2M1, QC_MAX_MANTISSA_BITS_E2M1, true);
    res[6 * i + 4] = qc_e8m0_scale(a, QC_EMAX_E4M3, QC_MAX_MANTISSA_BITS_E4M3, false);
    res[6 * i + 5] = qc_e8m0_scale(a, QC_EMAX_E4M3, QC_MAX_MANTISSA_BITS_E4M3, true);
  }
  FILE* f = fopen(argv[2], "wb");
  fwrite(res.data(), 1, res.size(), f);
  fclose(f);
  float dec[3 * 256];
  for (unsigned b = 0; b < 256; ++b) {
    dec[b] = qc_e4m3_value(b);
    dec[256 + b] = qc_e8m0_value(b);
    dec[512 + b] = qc_e8m0_multiplier(b);
  }
  f = fopen(argv[3], "wb");
  fwrite(dec, sizeof(float), 3 * 256, f);
  fclose(f);
  long long wrong = 0;
  f = fopen(argv[4], "wb");
  for (int s = 5; s < argc; ++s) {
    long long rows, cols;
    sscanf(argv[s], "%lld,%lld", &rows, &cols);
    const long long pc = qc_swizzle_pad_cols(cols);
    for (long long r = 0; r < rows; ++r)
      for (long long c = 0; c < cols; ++c) {
        const long long off = qc_swizzle_offset(r, c, pc);
        long long rr, cc;
        qc_swizzle_position(off, pc, &rr, &cc);
        wrong += rr != r || cc != c;
        fwrite(&off, sizeof(off), 1, f);
      }
  }
  fclose(f);
  printf("%lld\n", wrong);
  return wrong != 0;
}
"""


def _mx_conversion_inputs(rng) -> np.ndarray:
    """fp32 inputs where the MX conversions can go wrong: random bit patterns (every exponent,
    NaN payloads, subnormals), the E2M1 and E4M3 rounding midpoints at many power-of-two scales
    and one ulp either side, the E8M0 floor / rceil boundaries, specials."""
    f32 = np.float32
    parts = [rng.integers(0, 1 << 32, 1 << 21, dtype=np.uint64).astype(np.uint32).view(f32)]
    e4 = mx.e4m3_decode(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)
    mids = np.concatenate([mx.E2M1_MIDPOINTS.astype(np.float64), mx.E2M1_VALUES[:8].astype(np.float64),
                           (e4[:-1] + e4[1:]) / 2, e4, [452.0, 464.0, 480.0, 500.0]])
    scaled = (mids[None, :] * np.exp2(np.arange(-140, 128, dtype=np.float64))[:, None]).reshape(-1)
    with np.errstate(over="ignore"):
        v = scaled.astype(f32)
    v = v[np.isfinite(v)]
    parts += [v, np.nextafter(v, f32(np.inf)), np.nextafter(v, f32(-np.inf))]
    exps = np.arange(256, dtype=np.uint32) << np.uint32(23)
    mants = np.array([0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF], np.uint32)
    parts.append((exps[:, None] | mants[None, :]).reshape(-1).view(f32))
    parts.append(np.array([0.0, np.inf, np.nan, 448.0, 6.0, 2.0**-6, 2.0**-9, 2.0**-10, 2.0**-149], f32))
    x = np.concatenate(parts).astype(f32)
    return np.concatenate([x, -x])


@needs_nvcc
def test_mx_conversions_match_the_reference_on_the_host(tmp_path, rng):
    """The E2M1 / E4M3 / E8M0 conversions and the swizzle offsets of qc_mx.h, compiled for the
    host from the same header the kernels include, against quantcore.formats.mx."""
    from quantcore.formats import kernel_defines

    kernel_defines.write_header(tmp_path)
    src = tmp_path / "mx_harness.cu"
    src.write_text(MX_HARNESS)
    exe = tmp_path / "mx_harness"
    build._run([NVCC, "-x", "cu", "-O2", f"-I{KERNELS / 'compat'}", f"-I{KERNELS}", f"-I{tmp_path}", str(src),
                "-o", str(exe)], "compile the MX conversion harness")
    x = _mx_conversion_inputs(rng)
    x.tofile(tmp_path / "in.bin")
    shapes = [(1, 1), (128, 4), (130, 5), (257, 9), (33, 3), (300, 130)]
    build._run([str(exe), *(str(tmp_path / f) for f in ("in.bin", "res.bin", "dec.bin", "swz.bin")),
                *(f"{r},{c}" for r, c in shapes)], "run the MX conversion harness")
    res = np.fromfile(tmp_path / "res.bin", np.uint8).reshape(-1, 6)
    a = np.abs(x)
    with np.errstate(all="ignore"):
        expect = {"e2m1": mx.e2m1_round_codes(x), "e4m3": mx.e4m3_round_codes(x),
                  "e8m0 e2m1 floor": mx.e8m0_scale(a, "e2m1", "floor"),
                  "e8m0 e2m1 rceil": mx.e8m0_scale(a, "e2m1", "rceil"),
                  "e8m0 e4m3 floor": mx.e8m0_scale(a, "e4m3", "floor"),
                  "e8m0 e4m3 rceil": mx.e8m0_scale(a, "e4m3", "rceil")}
    for col, (what, ref) in enumerate(expect.items()):
        bad = np.flatnonzero(res[:, col] != ref)
        assert bad.size == 0, (f"{what}: {bad.size} of {x.size} differ; first {x[bad[0]]!r} "
                               f"(bits {x[bad[0]:bad[0] + 1].view(np.uint32)[0]:#x}): got "
                               f"{res[bad[0], col]:#x}, expected {ref[bad[0]]:#x}")
    dec = np.fromfile(tmp_path / "dec.bin", np.float32).reshape(3, 256)
    b = np.arange(256, dtype=np.uint8)
    for what, got, ref in (("e4m3 decode", dec[0], mx.e4m3_decode(b)), ("e8m0 decode", dec[1], mx.e8m0_decode(b)),
                           ("e8m0 multiplier", dec[2], mx.e8m0_element_multiplier(b))):
        _same(got, ref, what)
    offs = np.fromfile(tmp_path / "swz.bin", np.int64)
    ref = np.concatenate([mx.swizzle_offsets(r, c).reshape(-1) for r, c in shapes])
    assert np.array_equal(offs, ref)


@needs_nvcc
def test_a_broken_source_is_reported_with_the_compiler_log(tmp_path):
    bad = tmp_path / "broken.maca"
    bad.write_text('#include "qc_maca.h"\n__global__ void k(float* x) { x[0] = undefined_name; }\n')
    toolchain = build.Toolchain(build.MODE_NVCC_COMPAT, NVCC, archs=("sm_90",))
    with pytest.raises(KernelError, match=r"compile broken\.maca failed[\s\S]*undefined_name"):
        build.compile_sources(toolchain, tmp_path, [bad])


F16_HARNESS = r"""
#include "qc_maca.h"
#include <immintrin.h>
#include <cstdio>
// qc_half_bits_rn on every fp32 bit pattern: finite and Inf against the CPU's F16C conversion
// (IEEE round to nearest even), NaN against numpy's rule (sign and top payload bits kept).
int main() {
  unsigned long long bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static, 1 << 20)
  for (long long i = 0; i < (1LL << 32); ++i) {
    const uint32_t x = (uint32_t)i;
    float f;
    memcpy(&f, &x, 4);
    uint32_t ref;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
      ref = 0x7c00u + ((x & 0x7fffffu) >> 13);
      ref = ((x >> 16) & 0x8000u) | (ref == 0x7c00u ? ref + 1 : ref);
    } else {
      ref = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
    }
    bad += qc_half_bits_rn(f) != ref;
  }
  printf("%llu\n", bad);
  return bad != 0;
}
"""


def _has_f16c() -> bool:
    try:
        return " f16c" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@needs_nvcc
@pytest.mark.skipif(not _has_f16c(), reason="needs a CPU with F16C for the reference conversion")
def test_fp16_rounding_of_the_kernels_is_exact_on_every_fp32(tmp_path):
    from quantcore.formats import kernel_defines

    kernel_defines.write_header(tmp_path)
    src = tmp_path / "f16.cu"
    src.write_text(F16_HARNESS)
    exe = tmp_path / "f16"
    build._run([NVCC, "-x", "cu", "-O2", "-Xcompiler", "-fopenmp,-mf16c", f"-I{KERNELS / 'compat'}",
                f"-I{KERNELS}", f"-I{tmp_path}", str(src), "-o", str(exe)], "compile the fp16 harness")
    build._run([str(exe)], "run the fp16 harness (prints the number of mismatches)")


# -- command lines (pinned) -------------------------------------------------------------------------
def test_mxcc_command_lines_are_pinned():
    tc = build.Toolchain(build.MODE_MXCC, build.mxcc_path("/opt/maca"), maca_path="/opt/maca")
    assert tc.compile_command("/src/bnb_4bit.maca", "/b/bnb_4bit.o", ["/src", "/b"]) == [
        "/opt/maca/mxgpu_llvm/bin/mxcc", "-x", "maca", "-O3", "-std=c++17", "-fPIC",
        "-I/src", "-I/b", "-c", "/src/bnb_4bit.maca", "-o", "/b/bnb_4bit.o"]
    assert tc.link_command(["/b/a.o", "/b/b.o"], "/b/libqc_maca.so") == [
        "/opt/maca/mxgpu_llvm/bin/mxcc", "-shared", "-fPIC", "/b/a.o", "/b/b.o",
        "-L/opt/maca/lib", "-lmcruntime", "-Wl,-rpath,/opt/maca/lib:/opt/maca/mxgpu_llvm/lib",
        "-o", "/b/libqc_maca.so"]
    assert build.runtime_library_path("/opt/maca") == "/opt/maca/lib:/opt/maca/mxgpu_llvm/lib"


def test_build_on_metax_runs_exactly_the_pinned_mxcc_commands(monkeypatch, tmp_path):
    """What build_library would run on a MetaX machine: one mxcc compile per source against the
    sources' folder and the generated constants header, then one link with -lmcruntime."""
    ran = []

    def fake_run(cmd, what):
        out = Path(cmd[cmd.index("-o") + 1])
        ran.append((cmd, (out.parent / "quantcore_constants.h").is_file()))
        out.write_bytes(b"")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("QUANTCORE_CACHE_DIR", raising=False)
    monkeypatch.setattr(build, "_run", fake_run)
    tc = build.Toolchain(build.MODE_MXCC, build.mxcc_path("/opt/maca"), maca_path="/opt/maca")
    lib = build.build_library(tc)
    assert lib.name == "libqc_maca.so" and lib.parent.parent == tmp_path / "quantcore" / "maca"
    *compiles, (link, _) = ran
    assert len(compiles) == len(build.sources())
    compiles.sort(key=lambda c: c[0][-3])  # they run in parallel: order by source
    for (cmd, header_written), src in zip(compiles, build.sources()):
        workdir = Path(cmd[-1]).parent
        assert cmd == ["/opt/maca/mxgpu_llvm/bin/mxcc", "-x", "maca", "-O3", "-std=c++17", "-fPIC",
                       f"-I{KERNELS}", f"-I{workdir}", "-c", str(src), "-o", str(workdir / (src.stem + ".o"))]
        assert header_written  # the constants header sits in the include folder when mxcc runs
    assert link[:3] == ["/opt/maca/mxgpu_llvm/bin/mxcc", "-shared", "-fPIC"]
    assert link[-5:] == ["-L/opt/maca/lib", "-lmcruntime", "-Wl,-rpath,/opt/maca/lib:/opt/maca/mxgpu_llvm/lib",
                         "-o", link[-1]] and link[-1].endswith("libqc_maca.so")
    assert link[3:-5] == [str(Path(c[-1]).parent / (src.stem + ".o")) for (c, _), src in
                          zip(compiles, build.sources())]


def test_nvcc_compat_command_lines_are_pinned():
    tc = build.Toolchain(build.MODE_NVCC_COMPAT, "/cuda/bin/nvcc", archs=("sm_90",))
    assert tc.compile_command("/src/k.maca", "/b/k.o", ["/src", "/b"]) == [
        "/cuda/bin/nvcc", "-x", "cu", "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-arch=sm_90",
        f"-I{KERNELS / 'compat'}", "-I/src", "-I/b", "-c", "/src/k.maca", "-o", "/b/k.o"]
    assert tc.link_command(["/b/k.o"], "/b/lib.so") == [
        "/cuda/bin/nvcc", "-shared", "-arch=sm_90", "/b/k.o", "-o", "/b/lib.so"]
    two = build.Toolchain(build.MODE_NVCC_COMPAT, "nvcc", archs=("sm_80", "sm_90"))
    assert two.link_command([], "l.so")[2:4] == ["-gencode=arch=compute_80,code=sm_80",
                                                "-gencode=arch=compute_90,code=sm_90"]


# -- what the sources may and may not contain ---------------------------------------------------
def test_compat_header_holds_mappings_only():
    allowed = re.compile(r"^(#pragma once|#include [<\"][\w./]+[>\"]|#define \w+( .+)?|"
                         r"typedef [\w ]+ \w+;)$")
    headers = sorted((KERNELS / "compat").glob("*.h"))
    assert {h.name for h in headers} == {"maca_compat.h", "mc_runtime.h", "maca_fp16.h",
                                         "maca_bfloat16.h"}
    for h in headers:
        for line in _strip_comments(h.read_text()).splitlines():
            line = line.strip()
            assert not line or allowed.match(line), f"{h.name}: not a mapping: {line!r}"
    text = "".join(h.read_text() for h in headers)
    for word in ("__global__", "__device__", "{", "return"):
        assert word not in _strip_comments(text)


def test_sources_use_mc_runtime_names_and_no_cuda_names():
    for name, text in _kernel_texts().items():
        code = _strip_comments(text)
        assert not re.search(r"\bcuda\w*", code), f"{name} names a CUDA API"
        assert "__nv_" not in code, f"{name} names a CUDA type"
        assert not re.search(r"\bmaca(Malloc|Memcpy|Free|Stream|Error|GetLastError|Device)", code), (
            f"{name} uses a maca* runtime name (the MACA runtime spells them mc*)")
        assert not re.search(r"\basm\b|__asm", code), f"{name} has inline assembly"
    launchers = "".join(_kernel_texts().values())
    assert "mcStream_t stream" in launchers and "mcGetLastError" in launchers
    assert "mcDeviceAttributeMaxSharedMemoryPerBlock" in launchers


def test_wave_width_is_one_constant():
    texts = _kernel_texts()
    for name, text in texts.items():
        code = _strip_comments(text)
        assert "warpSize" not in code, f"{name} reads warpSize instead of QC_WAVE_SIZE"
        assert not re.search(r"0xffffffff\b|0xFFFFFFFF\b", code), f"{name} spells a 32-bit lane mask"
        if name != "qc_maca.h":
            assert "__shfl" not in code, f"{name} shuffles outside the wave helpers of qc_maca.h"
    common = _strip_comments(texts["qc_maca.h"])
    assert re.search(r"#define QC_WAVE_SIZE 64\b", common)
    assert "typedef unsigned long long qc_lane_mask_t" in common
    # every shuffle takes the full-width mask of the wave
    for call in re.findall(r"__shfl\w*\(([^,]+),", common):
        assert call.strip() == "QC_FULL_MASK"


def test_no_format_table_is_spelled_in_the_sources():
    # Tables and thresholds come from quantcore_constants.h; a long decimal literal in a kernel
    # would be a copy of one.
    for name, text in _kernel_texts().items():
        found = re.findall(r"\d\.\d{4,}", _strip_comments(text))
        assert not found, f"{name} spells constants {found[:3]}"
    assert "QC_NF4_THRESHOLDS_INIT" in _kernel_texts()["bnb_4bit.maca"]


# -- availability and adapters without a device -------------------------------------------------
def test_unavailable_without_metax_sdk_or_nvidia_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("MACA_PATH", str(tmp_path / "no-sdk"))
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(build, "nvidia_gpus", lambda: [])
    av = maca.create().availability()
    assert not av.ok
    assert av.reason == "no MetaX SDK (MACA_PATH) and no NVIDIA GPU for the compatibility mode"


def test_metax_sdk_is_detected_by_maca_path(monkeypatch, tmp_path):
    sdk = tmp_path / "maca"
    (sdk / "mxgpu_llvm" / "bin").mkdir(parents=True)
    (sdk / "mxgpu_llvm" / "bin" / "mxcc").write_text("")
    monkeypatch.setenv("MACA_PATH", str(sdk))
    assert build.find_maca_path() == str(sdk)
    monkeypatch.setattr(build, "metax_gpu_count", lambda path: 0)
    av = maca.create().availability()
    assert not av.ok and f"MetaX SDK is at {sdk}" in av.reason and "mcGetDeviceCount" in av.reason
    monkeypatch.setattr(build, "metax_gpu_count", lambda path: 1)
    monkeypatch.setattr(maca, "_torch_installed", lambda: True)
    be = maca.create()
    av = be.availability()
    assert av.ok and av.mode == maca.MXCC_MODE
    assert be._toolchain.compile_command("k.maca", "k.o", [])[:7] == [
        f"{sdk}/mxgpu_llvm/bin/mxcc", "-x", "maca", "-O3", "-std=c++17", "-fPIC", "-c"]


def test_compat_mode_needs_nvcc(monkeypatch, tmp_path):
    monkeypatch.setenv("MACA_PATH", str(tmp_path / "no-sdk"))
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setattr(build, "nvidia_gpus", lambda: [build.Gpu("NVIDIA H200", "sm_90")])
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    av = maca.create().availability()
    assert not av.ok and "no nvcc" in av.reason and "NVIDIA H200" in av.reason
    monkeypatch.setattr(build, "find_nvcc", lambda: "/cuda/bin/nvcc")
    monkeypatch.setattr(maca, "_torch_installed", lambda: True)
    be = maca.create()
    av = be.availability()
    assert av.ok and av.mode == "validated through the CUDA compatibility header"
    assert be._toolchain.archs == ("sm_90",)


def test_host_arrays_are_refused():
    be = maca.create()
    with pytest.raises(DeviceError, match="maca backend takes device arrays"):
        be.prepare(np.zeros(4, np.float32))


def test_capabilities_cover_every_family():
    caps = maca.create().capabilities()
    assert caps == frozenset(ops.bnb_capabilities() + ops.ggml_capabilities() + ops.mx_capabilities())
    assert frozenset(mx.capabilities()) <= caps
    assert caps == ops.ALL_CAPABILITIES


# -- on a GPU ----------------------------------------------------------------------------------------
def _maca_backend():
    be = maca.create()
    av = be.availability()
    if not av:
        pytest.skip(f"maca backend unavailable here: {av.reason}")
    return be


@pytest.fixture(scope="module")
def be():
    return _maca_backend()


def _same(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """Bit for bit, except that a NaN reference needs a NaN of any sign and payload."""
    got, ref = np.ascontiguousarray(got), np.ascontiguousarray(ref).reshape(got.shape)
    diff = bits(got) != bits(ref.astype(got.dtype))
    if got.dtype.kind == "f" or got.dtype == BF16:
        rnan, gnan = np.isnan(ref.astype(np.float32)), np.isnan(got.astype(np.float32))
        diff = np.where(rnan, ~gnan, diff)
    if diff.any():
        i = int(np.flatnonzero(diff)[0])
        raise AssertionError(f"{what}: {int(diff.sum())} of {diff.size} differ; first at {i}: "
                             f"got {got.reshape(-1)[i]!r}, expected {ref.reshape(-1)[i]!r}")


@pytest.mark.gpu
def test_library_wave_size_matches_the_device(be):
    import torch

    lib = be.library()
    assert lib.qc_maca_wave_size() == torch.cuda.get_device_properties(0).warp_size
    smem = ctypes.c_int(0)
    assert lib.qc_maca_device_shared_memory(0, ctypes.byref(smem)) == 0 and smem.value >= 16384
    assert be.availability().mode in (maca.COMPAT_MODE, maca.MXCC_MODE)


@pytest.mark.gpu
def test_public_api_roundtrip_on_a_side_stream(be, rng):
    import torch

    x = torch.from_numpy(rng.standard_normal((64, 96)).astype(np.float32)).cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        packed, state = qc.quantize_4bit(x, 64, "fp4", backend=be)
        out = qc.dequantize_4bit(packed, state, backend=be)
        wq = qc.quantize_q4_0(x, backend=be)
    stream.synchronize()
    assert out.is_cuda and out.dtype == torch.float32 and out.shape == x.shape
    p_ref, st_ref = qc.quantize_4bit(x.cpu().numpy(), 64, "fp4", backend="cpu")
    _same(packed.cpu().numpy(), p_ref, "packed")
    _same(out.cpu().numpy(), qc.dequantize_4bit(p_ref, st_ref, backend="cpu"), "out")
    _same(wq.cpu().numpy(), ggml.quantize_q4_0(x.cpu().numpy()), "q4_0")


@pytest.mark.gpu
def test_launch_errors_surface_as_kernel_error(be):
    import torch

    x = torch.zeros(64, device="cuda")
    packed = torch.empty(32, dtype=torch.uint8, device="cuda")
    absmax = torch.empty(1, device="cuda")
    with pytest.raises(KernelError, match="invalid argument"):
        be._launch("quantize_4bit", x, x, 99, packed, absmax, 64, 64, 0)  # no dtype code 99
    wq = torch.zeros((1, 1, 18), dtype=torch.uint8, device="cuda")
    n = 65536 * 8  # more activation rows than 65535 CTAs of 8 cover
    out = torch.empty((1, n), device="cuda")
    with pytest.raises(KernelError, match="invalid argument"):
        be._launch("gemm_q4_0_q8_1", out, wq, wq, out, 1, n, 32)


@pytest.mark.gpu
def test_cache_dir_is_used(be):
    be.library()
    assert Path(be.library_path).parent.parent == build.cache_root()
    assert os.path.basename(be.library_path) == build.LIBRARY_NAME


# -- MX family on a GPU ------------------------------------------------------------------------------
@pytest.mark.gpu
def test_mx_public_api_on_a_side_stream(be, rng):
    import torch

    import quantcore.api_mx as api_mx

    x = torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32)).cuda()
    g = float(mx.nvfp4_global_scale(float(x.abs().max())))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        c, s = api_mx.scaled_nvfp4_quant(x, g, backend=be)
        y = api_mx.dequantize_nvfp4(c, s, g, "bfloat16", backend=be)
        c8, s8 = api_mx.scaled_mxfp8_quant(x, scale_mode="rceil", swizzle=False, backend=be)
        out = api_mx.scaled_fp4_mm(c, c, s, s, 1.0 / (g * g), backend=be)
    stream.synchronize()
    assert c.is_cuda and out.dtype == torch.bfloat16 and out.shape == (64, 64)
    xh = x.cpu().numpy()
    c_ref, s_ref = mx.quantize_nvfp4(xh, np.float32(g))
    _same(c.cpu().numpy(), c_ref, "nvfp4 codes")
    _same(s.cpu().numpy(), mx.swizzle(s_ref), "nvfp4 scales")
    _same(be.to_numpy(y), mx.dequantize_nvfp4(c_ref, s_ref, np.float32(g), BF16), "nvfp4 dequantize")
    c8_ref, s8_ref = mx.quantize_mx(xh, "mxfp8", "rceil")
    _same(c8.cpu().numpy(), c8_ref, "mxfp8 codes")
    _same(s8.cpu().numpy(), s8_ref, "mxfp8 scales")


@pytest.mark.gpu
def test_mx_launch_errors_surface_as_kernel_error(be):
    import torch

    x = torch.zeros((2, 64), device="cuda")
    codes = torch.empty((2, 32), dtype=torch.uint8, device="cuda")
    scales = torch.empty((2, 4), dtype=torch.uint8, device="cuda")
    with pytest.raises(KernelError, match="maca mx_quantize failed: invalid argument"):
        be._launch("mx_quantize", x, x, DTYPE_CODE["float32"], codes, scales, 2, 64, mx.MX_FORMAT_CODE["nvfp4"],
                   0, 0, None)  # nvfp4 without its global scale
    out = torch.empty((1, 1), dtype=torch.bfloat16, device="cuda")
    alpha = torch.ones(1, device="cuda")
    with pytest.raises(KernelError, match="invalid argument"):  # more row tiles than CTAs
        be._launch("scaled_fp4_mm", out, codes, codes, scales, scales, alpha, None, out, 64 * 65536, 1, 64,
                   mx.MX_FORMAT_CODE["mxfp4"])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 9])
def test_grouped_gemv_is_the_single_gemvs(be, rng, rows):
    """qc_maca_gemv_4bit_grouped (and, from 9 rows, the tiled gemv per weight into its columns): the
    single gemv_4bit results bit for bit, for eight weights of mixed quant type, blocksize and
    nesting (so several launches), fp32 / fp16 / bf16."""
    import torch

    k = 256
    ws = []
    for n, nested, qt, bs in [(48, True, "nf4", 64), (16, False, "nf4", 64), (33, True, "nf4", 64),
                              (7, False, "fp4", 128), (20, True, "nf4", 64), (9, True, "nf4", 64),
                              (5, True, "nf4", 64), (70, False, "nf4", 64)]:
        w = torch.from_numpy((rng.standard_normal((n, k)) * 0.1).astype(np.float32)).cuda()
        ws.append(qc.quantize_4bit(w, blocksize=bs, quant_type=qt, compress_statistics=nested, backend=be))
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        a = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).cuda().to(dt)
        got = qc.gemv_4bit_grouped(a, ws, backend=be)
        want = torch.cat([qc.gemv_4bit(a, p, st, backend=be) for p, st in ws], dim=-1)
        assert got.shape == (rows, sum(st.shape[0] for _, st in ws))
        assert torch.equal(got.view(torch.int16) if dt != torch.float32 else got.view(torch.int32),
                           want.view(torch.int16) if dt != torch.float32 else want.view(torch.int32)), (rows, dt)
