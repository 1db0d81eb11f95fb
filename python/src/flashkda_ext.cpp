// flashkda._ext: nanobind bindings over the C++ API (include/flashkda/flashkda.h).
//
// Tensors arrive as nb::ndarray (DLPack or the buffer protocol: torch, NumPy, CuPy, JAX) and are
// passed on as raw views, never copied. The Python layer (python/flashkda/) allocates outputs and
// the device workspace in the caller's framework and picks the stream; this file only checks what
// the C++ API cannot see (strides, devices, dtypes it has no name for) and forwards the rest.
// flashkda::Error becomes a Python exception (see translate_error below).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#if defined(FLASHKDA_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "api/validate.h"
#include "common/problem.h"
#include "cpu/oracle.h"
#include "flashkda/flashkda.h"

namespace nb = nanobind;

namespace {

using flashkda::DType;
using flashkda::ErrorCode;

// ---------------------------------------------------------------------------------------------
// Arguments

// The tensor arguments of forward(), in a fixed order; bit i of `bf16_views` marks argument i as a
// uint16 view of bfloat16 data (how NumPy arrays of ml_dtypes.bfloat16 come in: NumPy exports
// that dtype neither through DLPack nor through the buffer protocol).
enum ArgIndex : int {
  kQ, kK, kV, kG, kBeta, kALog, kDtBias, kOut, kInitialState, kFinalState, kCuSeqlens, kNumArgs
};

struct ArgSpec {
  const char* name;
  const char* expected_dtype;  // as the C++ validation words it
  bool writable;
};

constexpr ArgSpec kArgs[kNumArgs] = {
    {"q", "bfloat16", false},           {"k", "bfloat16", false},
    {"v", "bfloat16", false},           {"g", "bfloat16", false},
    {"beta", "bfloat16", false},        {"A_log", "float32", false},
    {"dt_bias", "float32", false},      {"out", "bfloat16", true},
    {"initial_state", "bfloat16 or float32", false},
    {"final_state", "bfloat16 or float32", true},
    {"cu_seqlens", "int64 or int32", false},
};

// Where a tensor lives, from its DLPack device.
struct Place {
  bool cuda = false;
  int device = 0;
  std::string str() const { return cuda ? "cuda:" + std::to_string(device) : std::string("cpu"); }
  bool operator==(const Place& o) const { return cuda == o.cuda && (!cuda || device == o.device); }
};

std::string shape_str(const nb::ndarray<>& a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

std::string dlpack_dtype_name(nb::dlpack::dtype d) {
  const char* base = "unknown";
  switch (static_cast<nb::dlpack::dtype_code>(d.code)) {
    case nb::dlpack::dtype_code::Int: base = "int"; break;
    case nb::dlpack::dtype_code::UInt: base = "uint"; break;
    case nb::dlpack::dtype_code::Float: base = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: base = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: base = "complex"; break;
    case nb::dlpack::dtype_code::Bool: return "bool";
    default: break;
  }
  std::string s = base + std::to_string(d.bits);
  if (d.lanes != 1) s += "x" + std::to_string(d.lanes);
  return s;
}

[[noreturn]] void type_error(const std::string& msg) { throw nb::type_error(msg.c_str()); }
[[noreturn]] void value_error(const std::string& msg) { throw nb::value_error(msg.c_str()); }

// The C++ dtype of a DLPack dtype; throws TypeError in the C++ validation's words when there is
// none. Dtypes the API knows but refuses for this argument are left to the C++ validation.
DType to_dtype(const ArgSpec& spec, nb::dlpack::dtype d, bool bf16_view) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(d.code);
  if (d.lanes == 1) {
    if (code == Code::Bfloat && d.bits == 16) return DType::kBF16;
    if (code == Code::UInt && d.bits == 16 && bf16_view) return DType::kBF16;
    if (code == Code::Float && d.bits == 32) return DType::kF32;
    if (code == Code::Float && d.bits == 16) return DType::kF16;
    if (code == Code::Float && d.bits == 64) return DType::kF64;
    if (code == Code::Int && d.bits == 32) return DType::kI32;
    if (code == Code::Int && d.bits == 64) return DType::kI64;
  }
  type_error(std::string(spec.name) + ": expected dtype " + spec.expected_dtype + ", got " + dlpack_dtype_name(d));
}

Place place_of(const ArgSpec& spec, const nb::ndarray<>& a) {
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory: the CPU backend reads it directly
      return {};
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      return {true, static_cast<int>(a.device_id())};
    default:
      value_error(std::string(spec.name) + ": expected a tensor in CPU or CUDA memory, got DLPack device type " +
                  std::to_string(a.device_type()));
  }
}

// The converted arguments, keeping the ndarrays (and so the producers' buffers) alive.
struct Converted {
  nb::ndarray<> arrays[kNumArgs];
  flashkda::Tensor tensors[kNumArgs];
  bool any = false;
  Place place;            // of the first tensor given
  const char* first = nullptr;
};

nb::ndarray<> import_array(const ArgSpec& spec, nb::handle h) {
  // Inputs are imported read-only (JAX and read-only NumPy arrays export nothing else).
  if (spec.writable) {
    nb::ndarray<> a;
    if (nb::try_cast(h, a, false)) return a;
  } else {
    nb::ndarray<nb::ro> a;
    if (nb::try_cast(h, a, false)) return nb::ndarray<>(a);
  }
  std::string type = nb::type_name(h.type()).c_str();
  std::string hint;
  if (nb::hasattr(h, "requires_grad") && nb::bool_(h.attr("requires_grad")))
    hint = " (a torch tensor that requires grad: pass .detach())";
  else if (spec.writable)
    hint = " (outputs must be writable)";
  type_error(std::string(spec.name) + ": expected a writable tensor or array (torch, NumPy, CuPy, JAX; " +
             "anything with DLPack or the buffer protocol), got " + type + hint);
}

void convert(Converted& c, int i, nb::handle h, uint32_t bf16_views) {
  if (h.is_none()) return;
  const ArgSpec& spec = kArgs[i];
  nb::ndarray<> a = import_array(spec, h);
  if (a.ndim() > 4)
    value_error(std::string(spec.name) + ": expected at most 4 dimensions, got " + std::to_string(a.ndim()) +
                " with shape " + shape_str(a));
  // Dense, row-major: the C++ API takes no strides.
  if (a.size() > 1) {
    int64_t expected = 1;
    for (size_t d = a.ndim(); d-- > 0;) {
      if (a.shape(d) != 1 && a.stride(d) != expected) {
        std::string strides = "[";
        for (size_t j = 0; j < a.ndim(); ++j) strides += (j ? ", " : "") + std::to_string(a.stride(j));
        value_error(std::string(spec.name) + ": expected a contiguous (dense, row-major) tensor, got shape " +
                    shape_str(a) + " with strides " + strides + "]" + " (in elements); pass a contiguous copy");
      }
      expected *= static_cast<int64_t>(a.shape(d));
    }
  }
  const Place place = place_of(spec, a);
  if (!c.any) {
    c.any = true;
    c.place = place;
    c.first = spec.name;
  } else if (!(place == c.place)) {
    value_error(std::string(spec.name) + ": is on " + place.str() + " but " + c.first + " is on " +
                c.place.str() + "; all tensors must be on the same device");
  }
  flashkda::Tensor& t = c.tensors[i];
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.dtype = to_dtype(spec, a.dtype(), (bf16_views >> i) & 1u);
  t.ndim = static_cast<int32_t>(a.ndim());
  for (size_t d = 0; d < a.ndim(); ++d) t.shape[d] = static_cast<int64_t>(a.shape(d));
  c.arrays[i] = std::move(a);
}

flashkda::Gate to_gate(int gate) {
  if (gate != 0 && gate != 1) value_error("gate: expected 0 (safe) or 1 (softplus), got " + std::to_string(gate));
  return static_cast<flashkda::Gate>(gate);
}

flashkda::ForwardArgs make_args(const Converted& c, float lower_bound, float scale, int gate, bool check_cu_seqlens) {
  flashkda::ForwardArgs a;
  a.q = c.tensors[kQ];
  a.k = c.tensors[kK];
  a.v = c.tensors[kV];
  a.g = c.tensors[kG];
  a.beta = c.tensors[kBeta];
  a.A_log = c.tensors[kALog];
  a.dt_bias = c.tensors[kDtBias];
  a.out = c.tensors[kOut];
  a.initial_state = c.tensors[kInitialState];
  a.final_state = c.tensors[kFinalState];
  a.cu_seqlens = c.tensors[kCuSeqlens];
  a.lower_bound = lower_bound;
  a.scale = scale;
  a.gate = to_gate(gate);
  a.seqlen_check = check_cu_seqlens ? flashkda::SeqlenCheck::kHost : flashkda::SeqlenCheck::kDeviceGuardsOnly;
  return a;
}

// ---------------------------------------------------------------------------------------------
// forward

// Runs flashkda::forward on the given tensors. `workspace_alloc(nbytes)` is called (on the CUDA
// path only, when the kernels need a workspace) and must return a writable device array of at
// least nbytes bytes, allocated in the caller's framework; it is kept alive until the launch
// returns (stream-ordered allocators such as torch's keep it valid for the enqueued work).
void forward(nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta, nb::handle A_log,
             nb::handle dt_bias, nb::handle out, nb::handle initial_state, nb::handle final_state,
             nb::handle cu_seqlens, float lower_bound, float scale, int gate, bool check_cu_seqlens,
             uintptr_t stream, nb::object workspace_alloc, uint32_t bf16_views) {
  Converted c;
  const nb::handle handles[kNumArgs] = {q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens};
  for (int i = 0; i < kNumArgs; ++i) convert(c, i, handles[i], bf16_views);
  const flashkda::ForwardArgs args = make_args(c, lower_bound, scale, gate, check_cu_seqlens);

  if (c.place.cuda && !flashkda::cuda_compiled())
    throw flashkda::Error(ErrorCode::kNoDevice,
                          std::string(c.first) + ": is on " + c.place.str() +
                              ", but this flashkda was built without its CUDA kernels (no nvcc at build "
                              "time); pass CPU tensors for the CPU backend, or reinstall with nvcc on PATH");

  nb::ndarray<> workspace;
  void* ws_ptr = nullptr;
  size_t ws_bytes = 0;
  if (c.place.cuda) {
    const size_t needed = flashkda::forward_workspace_size(args);
    if (needed > 0) {
      if (workspace_alloc.is_none())
        value_error("workspace_alloc: the CUDA path needs a workspace of " + std::to_string(needed) +
                    " bytes, but no allocator was given");
      nb::object buffer = workspace_alloc(needed);
      if (!nb::try_cast(buffer, workspace, false))
        type_error("workspace: the allocator returned " + std::string(nb::type_name(buffer.type()).c_str()) +
                   ", expected a writable device array");
      ws_ptr = workspace.data();
      ws_bytes = workspace.nbytes();
    }
  }
  nb::gil_scoped_release release;
  flashkda::forward(args, ws_ptr, ws_bytes, reinterpret_cast<cudaStream_t>(stream));
}

// Waits for the work on `stream` (frameworks without a stream to share, such as JAX).
void stream_synchronize(uintptr_t stream) {
#if defined(FLASHKDA_WITH_CUDA)
  cudaError_t err;
  {
    nb::gil_scoped_release release;
    err = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
  }
  if (err != cudaSuccess)
    throw flashkda::Error(ErrorCode::kCudaError,
                          std::string("cudaStreamSynchronize: ") + cudaGetErrorString(err));
#else
  (void)stream;
#endif
}

// ---------------------------------------------------------------------------------------------
// The fp64 oracle, for tests: the per-token definition of KDA.md on host tensors.

template <typename T>
nb::ndarray<nb::numpy, T> owned_numpy(std::unique_ptr<T[]> data, std::initializer_list<size_t> shape) {
  T* raw = data.release();
  nb::capsule owner(raw, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T>(raw, shape, owner);
}

nb::tuple oracle_forward(nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta, nb::handle A_log,
                         nb::handle dt_bias, nb::handle initial_state, nb::handle cu_seqlens, float lower_bound,
                         float scale, int gate, uint32_t bf16_views) {
  Converted c;
  const nb::handle handles[kNumArgs] = {q, k, v, g, beta, A_log, dt_bias, nb::none(), initial_state, nb::none(),
                                        cu_seqlens};
  for (int i = 0; i < kNumArgs; ++i) convert(c, i, handles[i], bf16_views);
  if (c.place.cuda) value_error(std::string(c.first) + ": the oracle reads host memory; pass CPU tensors");

  const flashkda::Tensor& tq = c.tensors[kQ];
  const flashkda::Tensor& tv = c.tensors[kV];
  if (tq.ndim != 4 || tv.ndim != 4) {
    // Let the C++ validation word the error.
    flashkda::ForwardArgs bad = make_args(c, lower_bound, scale, gate, true);
    flashkda::validate_forward(bad);
  }
  const size_t B = tq.shape[0], T = tq.shape[1], H = tq.shape[2], K = tq.shape[3], V = tv.shape[3];
  const size_t N = c.tensors[kCuSeqlens].given() ? c.tensors[kCuSeqlens].shape[0] - 1 : B;

  // The oracle ignores out / final_state, but validation wants them: point both at the fp64
  // buffers (large enough and aligned), with the dtypes the validation accepts.
  auto out = std::make_unique<double[]>(B * T * H * V + 1);
  auto state = std::make_unique<double[]>(N * H * V * K + 1);
  const DType state_dtype = c.tensors[kInitialState].given() ? c.tensors[kInitialState].dtype : DType::kF32;
  c.tensors[kOut] = flashkda::make_tensor(out.get(), DType::kBF16, B, T, H, V);
  c.tensors[kFinalState] = flashkda::make_tensor(state.get(), state_dtype, N, H, V, K);
  const flashkda::ForwardArgs args = make_args(c, lower_bound, scale, gate, true);
  const flashkda::Problem p = flashkda::validate_forward(args);
  if (p.cu_seqlens) flashkda::validate_sequence_offsets(flashkda::host_sequence_offsets(p), p.total_tokens);
  {
    nb::gil_scoped_release release;
    flashkda::oracle_forward(p, out.get(), state.get());
  }
  return nb::make_tuple(owned_numpy(std::move(out), {B, T, H, V}), owned_numpy(std::move(state), {N, H, V, K}));
}

// ---------------------------------------------------------------------------------------------
// Errors

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const flashkda::Error& e) {
    PyObject* type = PyExc_RuntimeError;
    switch (e.code()) {
      case ErrorCode::kInvalidArgument:
        // A wrong dtype is a type problem; every other contract violation a value problem.
        type = std::strstr(e.what(), ": expected dtype ") ? PyExc_TypeError : PyExc_ValueError;
        break;
      case ErrorCode::kUnsupported:
        type = PyExc_NotImplementedError;
        break;
      default:
        type = PyExc_RuntimeError;
        break;
    }
    PyErr_SetString(type, e.what());
  }
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "FlashKDA native extension: bindings over the C++ API (use the flashkda package, not this module)";
  nb::register_exception_translator(translate_error);

  m.def("forward", &forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"), nb::arg("beta"),
        nb::arg("A_log"), nb::arg("dt_bias"), nb::arg("out"), nb::arg("initial_state").none(),
        nb::arg("final_state").none(), nb::arg("cu_seqlens").none(), nb::arg("lower_bound"), nb::arg("scale"),
        nb::arg("gate"), nb::arg("check_cu_seqlens"), nb::arg("stream"), nb::arg("workspace_alloc").none(),
        nb::arg("bf16_views"),
        "Runs flashkda::forward on tensors given through DLPack / the buffer protocol (no copies).");
  m.def("oracle_forward", &oracle_forward, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
        nb::arg("beta"), nb::arg("A_log"), nb::arg("dt_bias"), nb::arg("initial_state").none(),
        nb::arg("cu_seqlens").none(), nb::arg("lower_bound"), nb::arg("scale"), nb::arg("gate"),
        nb::arg("bf16_views") = 0,
        "Testing hook: the fp64 per-token oracle on host tensors; returns (out [B, T, H, V], "
        "final_state [N, H, V, K]) as float64 NumPy arrays (final_state starts from initial_state or 0).");
  m.def("stream_synchronize", &stream_synchronize, nb::arg("stream"),
        "Waits for the work enqueued on a cudaStream_t (a no-op without CUDA).");
  m.def("cuda_compiled", &flashkda::cuda_compiled, "True when the library was built with its CUDA kernels.");
  m.def("cuda_device_count", &flashkda::cuda_device_count, "Usable CUDA devices (0 when none or no driver).");
  m.def("cuda_device_name", &flashkda::cuda_device_name, "Name of the current CUDA device, '' when none.");
  m.def("version", &flashkda::version, "Version of the C++ library.");

  m.attr("ARG_NAMES") = [] {
    nb::list names;
    for (const ArgSpec& s : kArgs) names.append(s.name);
    return nb::tuple(names);
  }();
}
