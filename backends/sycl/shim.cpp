// quantcore SYCL host shim: a C ABI over the SYCL runtime, loaded from Python through ctypes.
//
// Built at first use with the system C++ compiler against the headers and libsycl of the
// intel-sycl-rt wheel (see backends/sycl/runtime.py). It does four things only: compile SYCL
// source at run time with the runtime's kernel compiler, look kernels up by name, launch them on
// a queue that dpctl owns, and report errors as text. No exception crosses the C boundary: an
// uncaught sycl::exception would abort the Python process.

#include <sycl/sycl.hpp>

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace syclexp = sycl::ext::oneapi::experimental;

namespace {

thread_local std::string g_last_error;

int fail(const std::string &what) {
  g_last_error = what;
  return -1;
}

// Kinds of kernel arguments the Python side passes (keep in sync with runtime.py ARG_*).
enum ArgKind : int { ARG_PTR = 0, ARG_I32 = 1, ARG_I64 = 2, ARG_F32 = 3 };

struct Bundle {
  sycl::kernel_bundle<sycl::bundle_state::executable> exe;
};

template <typename T> T read_as(const void *p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

} // namespace

extern "C" {

const char *qc_last_error() { return g_last_error.c_str(); }

const char *qc_sycl_version() {
  static std::string v = std::to_string(__LIBSYCL_MAJOR_VERSION) + "." +
                         std::to_string(__LIBSYCL_MINOR_VERSION) + "." +
                         std::to_string(__LIBSYCL_PATCH_VERSION);
  return v.c_str();
}

// Compile `source` (SYCL C++) for the queue's device. Include files are passed by content, so
// nothing is read from disk at compile time. Returns an owned bundle handle, or NULL with the
// compiler log in qc_last_error().
void *qc_build(void *queue, const char *source, int ninclude, const char *const *include_names,
               const char *const *include_texts, int noptions, const char *const *options) {
  std::string log;
  try {
    sycl::queue &q = *static_cast<sycl::queue *>(queue);
    sycl::context ctx = q.get_context();
    if (!q.get_device().ext_oneapi_can_build(syclexp::source_language::sycl))
      return fail("this SYCL device cannot compile SYCL source at run time"), nullptr;
    syclexp::include_files includes;
    for (int i = 0; i < ninclude; ++i) includes.add(include_names[i], include_texts[i]);
    auto src = syclexp::create_kernel_bundle_from_source(
        ctx, syclexp::source_language::sycl, std::string(source),
        syclexp::properties{includes});
    std::vector<std::string> opts(options, options + noptions);
    auto exe = syclexp::build(src, std::vector<sycl::device>{q.get_device()},
                              syclexp::properties{syclexp::build_options{opts},
                                                  syclexp::save_log{&log}});
    return new Bundle{exe};
  } catch (const sycl::exception &e) {
    fail(std::string(e.what()) + (log.empty() ? "" : "\n" + log));
  } catch (const std::exception &e) {
    fail(e.what());
  }
  return nullptr;
}

void qc_bundle_free(void *bundle) { delete static_cast<Bundle *>(bundle); }

void *qc_get_kernel(void *bundle, const char *name) {
  try {
    auto *b = static_cast<Bundle *>(bundle);
    if (!b->exe.ext_oneapi_has_kernel(name))
      return fail(std::string("no kernel named ") + name + " in the bundle"), nullptr;
    return new sycl::kernel(b->exe.ext_oneapi_get_kernel(name));
  } catch (const std::exception &e) {
    fail(e.what());
  }
  return nullptr;
}

void qc_kernel_free(void *kernel) { delete static_cast<sycl::kernel *>(kernel); }

// out[0] = required sub-group size (0 when the kernel states none), out[1] = max sub-group size,
// out[2] = max work-group size for this kernel on the queue's device.
int qc_kernel_info(void *kernel, void *queue, int64_t *out) {
  try {
    auto &k = *static_cast<sycl::kernel *>(kernel);
    auto dev = static_cast<sycl::queue *>(queue)->get_device();
    namespace kds = sycl::info::kernel_device_specific;
    out[0] = static_cast<int64_t>(k.get_info<kds::compile_sub_group_size>(dev));
    out[1] = static_cast<int64_t>(k.get_info<kds::max_sub_group_size>(dev));
    out[2] = static_cast<int64_t>(k.get_info<kds::work_group_size>(dev));
    return 0;
  } catch (const std::exception &e) {
    return fail(e.what());
  }
}

// Submit a 1-D nd_range launch. Arguments are described by kind (ArgKind) and the address of
// their value. When `dep` is an event handle the launch waits for it; when `out_event` is not
// NULL it receives an owned event handle of this launch (free it with qc_event_free).
int qc_launch(void *queue, void *kernel, size_t global, size_t local, int nargs, const int *kinds,
              const void *const *values, void *dep, void **out_event) {
  try {
    sycl::queue &q = *static_cast<sycl::queue *>(queue);
    const sycl::kernel &k = *static_cast<sycl::kernel *>(kernel);
    sycl::event ev = q.submit([&](sycl::handler &h) {
      if (dep) h.depends_on(*static_cast<sycl::event *>(dep));
      for (int i = 0; i < nargs; ++i) {
        switch (kinds[i]) {
        case ARG_PTR: h.set_arg(i, read_as<void *>(values[i])); break;
        case ARG_I32: h.set_arg(i, read_as<int32_t>(values[i])); break;
        case ARG_I64: h.set_arg(i, read_as<int64_t>(values[i])); break;
        case ARG_F32: h.set_arg(i, read_as<float>(values[i])); break;
        default: throw std::runtime_error("unknown kernel argument kind " + std::to_string(kinds[i]));
        }
      }
      h.parallel_for(sycl::nd_range<1>{sycl::range<1>{global}, sycl::range<1>{local}}, k);
    });
    if (out_event) *out_event = new sycl::event(ev);
    return 0;
  } catch (const std::exception &e) {
    return fail(e.what());
  }
}

int qc_event_wait(void *event) {
  try {
    static_cast<sycl::event *>(event)->wait_and_throw();
    return 0;
  } catch (const std::exception &e) {
    return fail(e.what());
  }
}

void qc_event_free(void *event) { delete static_cast<sycl::event *>(event); }

int qc_queue_wait(void *queue) {
  try {
    static_cast<sycl::queue *>(queue)->wait_and_throw();
    return 0;
  } catch (const std::exception &e) {
    return fail(e.what());
  }
}

// Copy `nbytes` between any two of host / USM memory on the queue and wait for it.
int qc_memcpy(void *queue, void *dst, const void *src, size_t nbytes) {
  try {
    static_cast<sycl::queue *>(queue)->memcpy(dst, src, nbytes).wait_and_throw();
    return 0;
  } catch (const std::exception &e) {
    return fail(e.what());
  }
}

} // extern "C"
