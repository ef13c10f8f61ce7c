"""The sycl backend: kernels_sycl/ compiled at run time and run on the OpenCL CPU device.

Runs wherever the ``sycl`` extra is installed (CI installs it); elsewhere every test skips with
the backend's own reason. Covers what the conformance suite does not: the device compiler's
arithmetic the bit-exact tier relies on (correctly rounded division, no FMA contraction, fp16 /
bf16 rounding), the explicit sub-group size, compile errors surfacing with the log, the OpenCL
ICD setup, the shim's disk cache, the array adapters (views, DeviceError for host arrays,
dpnp zero-copy, out-of-order queues), and gemm_w4a8 giving gemm_q4_0_q8_1's bits. Bit-exactness
and tolerances of every op are the conformance suite's (tests/test_conformance_backends.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import quantcore as qc
from quantcore import api
from quantcore.arrays import BF16
from quantcore.errors import DeviceError, KernelError
from quantcore.formats import bnb, ggml
from quantcore.registry import availability, get_backend

from .conftest import FLOAT_DTYPES, bits

_AVAIL = availability("sycl")
pytestmark = [
    pytest.mark.skipif(not _AVAIL, reason=f"sycl backend unavailable: {_AVAIL.reason}"),
    # the reference warns on the adversarial inputs (overflow, NaN); the comparisons are exact
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]
REPO = Path(__file__).resolve().parents[1]
DTYPES = list(FLOAT_DTYPES.values())


@pytest.fixture(scope="module")
def be():
    return get_backend("sycl")


@pytest.fixture(scope="module")
def runtime():
    from quantcore.backends.sycl import runtime

    return runtime


def dev(be, a):
    return be.from_numpy(np.ascontiguousarray(a))


def host(be, x):
    return be.to_numpy(x)


# -- the device compiler's arithmetic ------------------------------------------------------------------
ARITH_SRC = r"""
#include "qc_common.hpp"
namespace syclext = sycl::ext::oneapi;
namespace syclexp = sycl::ext::oneapi::experimental;
extern "C" SYCL_EXTERNAL SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((syclexp::nd_range_kernel<1>))
void arith(const float *x, const float *y, const float *z, float *recip, float *muladd,
           uint16_t *as_bf16, qc::half *as_half, int64_t n) {
  const int64_t i = syclext::this_work_item::get_nd_item<1>().get_global_id(0);
  if (i >= n) return;
  recip[i] = qc::recip_rn(x[i]);
  const float p = x[i] * y[i];
  muladd[i] = p + z[i];
  as_bf16[i] = qc::bf16_bits_rne(x[i]);
  qc::Elem<qc::half>::store(as_half, i, x[i]);
}
"""


def _random_bit_floats(rng, n):
    v = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1.1754942e-38, 65504.0,
                         65520.0, 65519.996, 6.1035156e-05, 5.9604645e-08, 2.9802322e-08, 3.4e38],
                        dtype=np.float32)
    v[: specials.size] = specials
    return v


def test_device_arithmetic_is_the_references(be, runtime, rng):
    """Correctly rounded 1/x, a*b+c with two roundings (no FMA contraction), RNE into fp16 and
    bf16: on random bit patterns (subnormals, huge values, NaN and Inf included), built with the
    backend's own options."""
    _, includes = runtime.kernel_sources()
    prog = runtime.compile_source(be.default_queue(), ARITH_SRC, includes, runtime.BASE_BUILD_OPTIONS,
                                  {"arith": "const f32* x, const f32* y, const f32* z, f32* recip, f32* muladd, "
                                            "u16* as_bf16, u16* as_half, i64 n"})
    n = 1 << 18
    x = _random_bit_floats(rng, n)
    y = rng.standard_normal(n).astype(np.float32)
    z = rng.standard_normal(n).astype(np.float32)
    out = {k: be.empty((n,), dt) for k, dt in
           (("recip", np.float32), ("muladd", np.float32), ("bf16", np.uint16), ("half", np.float16))}
    prog.launch(be.default_queue(), "arith", n // 128, 128,
                (dev(be, x), dev(be, y), dev(be, z), out["recip"], out["muladd"], out["bf16"],
                 out["half"], n))
    with np.errstate(all="ignore"):
        ref_recip = (np.float32(1.0) / x).astype(np.float32)
        ref_muladd = ((x * y).astype(np.float32) + z).astype(np.float32)
        ref_half = x.astype(np.float16)
    finite = ~np.isnan(x)
    assert np.array_equal(bits(host(be, out["recip"]))[finite], bits(ref_recip)[finite])
    got = host(be, out["muladd"])
    ok = np.isnan(ref_muladd) & np.isnan(got) | (bits(got) == bits(ref_muladd))
    assert ok.all(), f"{(~ok).sum()} of {n} a*b+c differ: contraction into FMA?"
    assert np.array_equal(host(be, out["bf16"]), bits(x.astype(BF16)))
    gh = host(be, out["half"])
    # numpy keeps a signalling NaN's payload where the hardware quiets it: compare NaN-ness only.
    assert np.array_equal(np.isnan(gh), np.isnan(ref_half))
    assert np.array_equal(bits(gh)[finite], bits(ref_half)[finite])


# -- build, errors, sub-group size ---------------------------------------------------------------------
def test_compile_error_surfaces_the_compiler_log(be, runtime):
    bad = textwrap.dedent("""
        #include <sycl/sycl.hpp>
        extern "C" SYCL_EXTERNAL void broken(int *p) { p[0] = qc_no_such_symbol; }
    """)
    with pytest.raises(KernelError) as info:
        runtime.compile_source(be.default_queue(), bad)
    msg = str(info.value)
    assert "qc_no_such_symbol" in msg and "error" in msg, msg


def test_required_subgroup_size_reaches_the_kernels(be):
    """bitsandbytes' bf16 gemv once ran with 8 lanes where 32 were meant: here the size is a
    kernel property (the runtime reports it back) and a probe kernel sees it at run time."""
    prog = be.program()
    q = be.default_queue()
    assert prog.subgroup_size in list(q.sycl_device.sub_group_sizes)
    names = ["qc_gemv_4bit_f32", "qc_gemv_4bit_f16", "qc_gemv_4bit_bf16", "qc_gemm_q4_0_q8_1",
             "qc_gemm_w4a8_bf16", "qc_gemv_4bit_tiled_f32", "qc_gemv_4bit_tiled_bf16",
             "qc_gemm_q4_0_q8_1_tiled", "qc_subgroup_probe"]
    for name in names:
        assert prog.kernel_info(name, q)["required_subgroup_size"] == prog.subgroup_size, name
    probe = be.empty((1,), np.int64)
    prog.launch(q, "qc_subgroup_probe", 1, 4 * prog.subgroup_size, (probe,))
    assert int(host(be, probe)[0]) == prog.subgroup_size


def test_arguments_are_passed_by_their_declared_kinds(be):
    """The launcher passes each argument as the kernel interface declares it (no guessing from the
    Python value); a value of another kind, or a wrong count, is a KernelError naming the kernel
    and the argument, before anything is submitted."""
    prog, q = be.program(), be.default_queue()
    out = be.empty((512,), np.uint8)
    with pytest.raises(KernelError, match=r"qc_swizzle_scales: argument rows \(i64\) must be an integer"):
        prog.launch(q, "qc_swizzle_scales", 1, 128, (None, out, 1.5, 4))
    with pytest.raises(KernelError, match=r"qc_swizzle_scales: argument out \(u8\*\) must be a device array"):
        prog.launch(q, "qc_swizzle_scales", 1, 128, (None, 3, 1, 4))
    with pytest.raises(KernelError, match=r"qc_gemv_4bit_f32: argument quant_type \(i32\) must be an integer that fits"):
        prog.launch(q, "qc_gemv_4bit_f32", 1, 128, (None,) * 7 + (1, 1, 64, 64, 1 << 40))
    with pytest.raises(KernelError, match=r"takes 4 arguments \(scales, out, rows, cols\), got 3"):
        prog.launch(q, "qc_swizzle_scales", 1, 128, (None, out, 1))
    with pytest.raises(KernelError, match="not declared in the kernel interface"):
        prog.launch(q, "qc_no_such_kernel", 1, 128, ())


def test_subgroup_size_choice(runtime):
    class Dev:
        def __init__(self, cpu, sizes, width):
            self.is_cpu, self.sub_group_sizes, self.native_vector_width_float = cpu, sizes, width

    want = runtime.GEOMETRY["QC_SUBGROUP_SIZE"]
    assert runtime.pick_subgroup_size(Dev(False, [8, 16, 32], 1)) == want  # GPU: bitsandbytes' 32
    assert runtime.pick_subgroup_size(Dev(True, [4, 8, 16, 32, 64], 8)) == 8  # AVX2 CPU
    assert runtime.pick_subgroup_size(Dev(True, [4, 8, 16, 32, 64], 16)) == 16  # AVX-512 CPU
    assert runtime.pick_subgroup_size(Dev(False, [8, 16], 1)) == 16


def test_geometry_comes_from_the_core(runtime):
    g = runtime.GEOMETRY
    assert g["QC_DEQUANT_WG"] * g["QC_DEQUANT_BYTES_PER_ITEM"] == 512  # bitsandbytes' tile
    assert g["QC_GEMV_ROWS_PER_WG"] == 4 and g["QC_MAX_BATCH"] == 8


SYCL2020_TU = r"""
#include "sycl2020_launchers.hpp"
template <typename T> void all(sycl::queue &q) {
  T *t = nullptr; uint8_t *u = nullptr; float *f = nullptr;
  const qc::Absmax am{f, nullptr, nullptr, nullptr, nullptr};
  namespace l = qc::sycl2020;
  l::dequantize_4bit<T>(q, u, am, t, 1, 64, 0);
  l::dequantize_blockwise_8bit<T>(q, u, f, f, t, 1, 64);
  l::quantize_4bit<T>(q, t, u, f, 1, 64, 0);
  l::quantize_blockwise_8bit<T>(q, t, f, u, f, 1, 64);
  l::gemv_4bit<T>(q, t, u, am, t, 1, 1, 64, 64, 0);
  l::quantize_ggml<T>(q, l::GgmlFormat::q4_0, t, u, 1);
  l::dequantize_ggml<T>(q, l::GgmlFormat::q8_1, u, t, 1);
  l::gemm_w4a8<true, T>(q, u, nullptr, t, f, 1, 1, 32);
  l::gemv_4bit_tiled<T>(q, t, u, am, t, 9, 1, 64, 64, 0);
  const qc::GroupW w[2] = {{u, am, 1}, {u, am, 2}};
  l::gemv_4bit_grouped<T>(q, t, w, 2, t, 3, 1, 64, 64, 0);
}
void instantiate(sycl::queue &q) {
  all<float>(q); all<sycl::half>(q); all<sycl::ext::oneapi::bfloat16>(q);
  qc::sycl2020::gemm_w4a8<false, float>(q, nullptr, nullptr, nullptr, nullptr, 1, 1, 32);
  qc::sycl2020::gemm_q4_0_q8_1_tiled(q, nullptr, nullptr, nullptr, 1, 9, 32);
  qc::sycl2020::double_quantize(q, nullptr, nullptr, nullptr, nullptr, 1);
}
"""


@pytest.mark.parametrize("subgroup", [8, 16, 32])
def test_sycl2020_launchers_compile_as_host_code(runtime, tmp_path, subgroup):
    """The SYCL 2020 launchers for offline compilers (no oneAPI extension), every instantiation,
    parsed and type-checked as host code by the system C++ compiler against the runtime's SYCL
    headers. No SYCL offline compiler (icpx, acpp) is installable here, so device-side rules are
    checked only by the run-time build of the same bodies (docs/sycl.md)."""
    from quantcore.formats import kernel_defines

    include_dir, _ = runtime.sycl_runtime_dirs()
    kernel_defines.write_header(tmp_path)
    (tmp_path / "tu.cpp").write_text(SYCL2020_TU)
    cmd = [runtime._compiler(), "-std=c++17", "-fsyntax-only", "-Werror", "-Wno-deprecated-declarations",
           "-Wno-attributes", "-DSYCL_DISABLE_FSYCL_SYCLHPP_WARNING", f"-DQC_SUBGROUP_SIZE={subgroup}",
           f"-I{include_dir}", f"-I{tmp_path}", f"-I{REPO / 'kernels_sycl'}", str(tmp_path / "tu.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


# -- OpenCL ICD and the shim cache (fresh processes) ----------------------------------------------------
def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_icd_is_set_up_when_the_user_did_not(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OCL_ICD_FILENAMES", "OCL_ICD_VENDORS")}
    res = _python("""
        import json, os
        from quantcore.registry import get_backend
        be = get_backend("sycl")
        import dpctl
        print(json.dumps({"icd": os.environ.get("OCL_ICD_FILENAMES"),
                          "devices": [d.filter_string for d in dpctl.get_devices()]}))
    """, env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["icd"] and out["icd"].endswith("libintelocl.so") and os.path.exists(out["icd"])
    assert any(d.startswith("opencl:cpu") for d in out["devices"])


def test_icd_setting_of_the_user_wins():
    env = dict(os.environ, OCL_ICD_FILENAMES="/nonexistent/libOpenCL-user.so")
    res = _python("""
        from quantcore.backends.sycl import runtime
        import os
        print(runtime.setup_opencl_icd()); print(os.environ["OCL_ICD_FILENAMES"])
    """, env)
    assert res.returncode == 0, res.stderr
    note, value = res.stdout.strip().splitlines()[-2:]
    assert "set by the user" in note and value == "/nonexistent/libOpenCL-user.so"


def test_shim_is_cached_and_rebuilt_when_its_source_changes(runtime, tmp_path, monkeypatch):
    monkeypatch.setenv(runtime.ENV_CACHE, str(tmp_path))
    first = runtime.build_shim()
    assert first.parent == tmp_path / "sycl" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert runtime.build_shim() == first and first.stat().st_mtime_ns == mtime  # cached
    changed = tmp_path / "shim.cpp"
    changed.write_text(runtime._shim_source().read_text() + "\n// a change\n")
    monkeypatch.setattr(runtime, "_shim_source", lambda: changed)
    second = runtime.build_shim()
    assert second != first and second.exists()
    assert not list((tmp_path / "sycl").glob("*.tmp"))


def test_two_processes_building_the_shim_at_once(tmp_path):
    env = dict(os.environ, QUANTCORE_CACHE_DIR=str(tmp_path))
    code = "from quantcore.backends.sycl import runtime; print(runtime.build_shim())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    built = list((tmp_path / "sycl").iterdir())
    name = Path(paths.pop()).name
    assert sorted(p.name for p in built) == sorted([name, name + ".sha256"])  # one library and its checksum, no temporary left


# -- arrays -------------------------------------------------------------------------------------------------
def test_host_arrays_are_refused_not_copied(be):
    with pytest.raises(DeviceError, match="from_numpy"):
        api.quantize_q4_0(np.zeros((2, 32), np.float32), backend="sycl")


def test_native_arrays_round_trip_through_the_public_api(be, rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    packed, state = api.quantize_4bit(dev(be, x), 64, "nf4", backend="sycl")
    from quantcore.backends.sycl import SyclArray

    assert isinstance(packed, SyclArray) and isinstance(state.absmax, SyclArray)
    ref_packed, _ = api.quantize_4bit(x, 64, "nf4", backend="cpu")
    assert np.array_equal(host(be, packed), ref_packed)


def test_view_is_a_window_into_the_buffer(be):
    buf = dev(be, np.zeros(64, np.uint8))
    v = be.view(buf, 16, (4,), np.float32)
    v.copy_from_numpy(np.array([1, 2, 3, 4], np.float32))
    raw = host(be, buf)
    assert np.array_equal(raw[16:32].view(np.float32), [1, 2, 3, 4])
    assert not raw[:16].any() and not raw[32:].any()
    with pytest.raises(qc.errors.ShapeError):
        be.view(buf, 60, (2,), np.float32)


def test_dpctl_memory_is_wrapped_zero_copy(be):
    import dpctl.memory as dm
    from quantcore.backends.sycl import asarray

    mem = dm.MemoryUSMShared(32 * 4, queue=be.default_queue())
    view = np.frombuffer(mem, dtype=np.float32)  # shared USM: host-visible
    view[:] = np.arange(32, dtype=np.float32)
    arr = asarray(mem, (1, 32), np.float32)
    assert arr.ptr == mem.__sycl_usm_array_interface__["data"][0]
    out = api.quantize_q8_0(arr, backend="sycl")
    assert np.array_equal(host(be, out), ggml.quantize_q8_0(view.reshape(1, 32)))


def test_dpnp_arrays_in_and_out_zero_copy(be, rng):
    dpnp = pytest.importorskip("dpnp", reason="dpnp is not installed (optional)")
    x = rng.standard_normal((8, 64)).astype(np.float32)
    xd = dpnp.asarray(x, device=be.default_queue().sycl_device.filter_string)
    assert be.prepare(xd).ptr == xd.__sycl_usm_array_interface__["data"][0]  # no copy
    qd = api.quantize_q8_1(xd, backend="sycl")
    assert type(qd).__module__.startswith("dpnp")
    assert np.array_equal(dpnp.asnumpy(qd), ggml.quantize_q8_1(x))
    yd = api.dequantize_q8_1(qd, "float32", backend="sycl")
    assert np.array_equal(dpnp.asnumpy(yd), ggml.dequantize_q8(ggml.quantize_q8_1(x), "q8_1"))


def test_out_of_order_queue_is_ordered(be, rng):
    """dpnp's queues are out of order: an op waits for the queue's earlier work and orders its
    own kernels (double quantization is two dependent kernels)."""
    import dpctl
    from quantcore.backends.sycl import SyclArray

    q = dpctl.SyclQueue(be.default_queue().sycl_device)
    assert not q.is_in_order
    absmax = (rng.random(3000) * 4).astype(np.float32)
    src = SyclArray.empty(absmax.shape, np.float32, q)
    src.copy_from_numpy(absmax)
    outs = [SyclArray.empty(s, d, q) for s, d in (((3000,), np.uint8), ((12,), np.float32), ((1,), np.float32))]
    be.double_quantize(src, *outs)
    ref = bnb.double_quantize(absmax)
    assert np.array_equal(outs[0].to_numpy(), ref[0])
    assert np.array_equal(bits(outs[1].to_numpy()), bits(ref[1]))
    assert bits(outs[2].to_numpy())[0] == bits(np.array([ref[2]], np.float32))[0]


# -- ops against the reference ------------------------------------------------------------------------
def _same(got, ref):
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, got.dtype, ref.shape, ref.dtype)
    diff = bits(got) != bits(ref)
    assert not diff.any(), f"{diff.sum()} of {diff.size} differ; first at {np.argwhere(diff)[:3].ravel()}"


@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (5, 3, 96), (13, 9, 1024), (64, 17, 4096)])
def test_gemm_w4a8_is_gemm_on_quantize_q8_1(be, rng, m, n, k):
    """The fused kernel quantizes the activation exactly as quantize_q8_1 does, so both GEMMs give
    the same bits; both are within fp32 rounding of the fp64 reference."""
    w = rng.standard_normal((m, k)).astype(np.float32)
    wq = ggml.quantize_q4_0(w)
    for dtype in DTYPES:
        a = (rng.standard_normal((n, k)) * 3).astype(dtype)
        o1, o2 = be.empty((m, n), np.float32), be.empty((m, n), np.float32)
        be.gemm_w4a8(dev(be, wq), dev(be, a), o1)
        be.gemm_q4_0_q8_1(dev(be, wq), dev(be, ggml.quantize_q8_1(a)), o2)
        g1, g2 = host(be, o1), host(be, o2)
        _same(g1, g2)
        ref = ggml.gemm_q4_0_q8_1(wq, ggml.quantize_q8_1(a))
        scale = np.abs(ref).max() + 1e-30
        assert np.max(np.abs(g1 - ref)) / scale < (k // 32 + 4) * 2.0**-23


# -- the conformance suite -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_grouped_gemv_is_the_single_gemvs(be, rng, rows):
    """qc_gemv_4bit_grouped (and, from 9 rows, the tiled gemv per weight with qc_copy_rows): the
    single gemv_4bit results bit for bit, for eight weights of mixed quant type, blocksize and
    nesting (so several launches, weights of one launch nested or not), fp32 / fp16 / bf16."""
    k = 256
    ws = []
    for n, nested, qt, bs in [(48, True, "nf4", 64), (16, False, "nf4", 64), (33, True, "nf4", 64),
                              (7, False, "fp4", 128), (20, True, "nf4", 64), (9, False, "nf4", 64),
                              (5, True, "nf4", 64), (70, False, "nf4", 64)]:
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        ws.append(qc.quantize_4bit(be.from_numpy(w), blocksize=bs, quant_type=qt, compress_statistics=nested,
                                   backend=be))
    for dt in FLOAT_DTYPES.values():
        a = be.from_numpy(rng.standard_normal((rows, k)).astype(dt))
        got = api.gemv_4bit_grouped(a, ws, backend=be).to_numpy()
        want = np.concatenate([api.gemv_4bit(a, p, st, backend=be).to_numpy() for p, st in ws], axis=-1)
        assert got.shape == (rows, sum(st.shape[0] for _, st in ws))
        assert np.array_equal(bits(got), bits(want)), (rows, dt)
