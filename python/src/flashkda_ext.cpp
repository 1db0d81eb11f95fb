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

#include "api/arguments.h"
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

// The tensor arguments of forward() (api/arguments.h), in the table's order; bit i of
// `bf16_views` marks argument i as a uint16 view of bfloat16 data (how NumPy arrays of
// ml_dtypes.bfloat16 come in: NumPy exports that dtype neither through DLPack nor through the
// buffer protocol).
enum ArgIndex : int {
  kQ, kK, kV, kG, kBeta, kALog, kDtBias, kOut, kInitialState, kFinalState, kCuSeqlens, kStateIndices,
  kFinalStateIndices, kCheckpointOffsets, kCheckpointState, kTokenStateIndices, kNumArgs
};
static_assert(kNumArgs == flashkda::kNumTensorArguments, "one index per argument of the table");

constexpr bool same_name(const char* a, const char* b) { return *a == *b && (*a == 0 || same_name(a + 1, b + 1)); }
static_assert(same_name(flashkda::kTensorArguments[kQ].name, "q") && same_name(flashkda::kTensorArguments[kOut].name, "out") &&
                  same_name(flashkda::kTensorArguments[kCuSeqlens].name, "cu_seqlens") &&
                  same_name(flashkda::kTensorArguments[kFinalStateIndices].name, "final_state_indices") &&
                  same_name(flashkda::kTensorArguments[kCheckpointState].name, "checkpoint_state") &&
                  same_name(flashkda::kTensorArguments[kTokenStateIndices].name, "token_state_indices"),
              "ArgIndex follows the table's order");

// What the binding needs of an argument: its name, its dtypes in the validation's words, and
// whether it is written (imported writable).
struct ArgSpec {
  const char* name;
  const char* expected_dtype;
  bool writable;
};

constexpr ArgSpec spec_of(int i) {
  return {flashkda::kTensorArguments[i].name, flashkda::kTensorArguments[i].dtype_words,
          flashkda::kTensorArguments[i].output};
}

constexpr ArgSpec kArgs[kNumArgs] = {spec_of(0), spec_of(1), spec_of(2), spec_of(3), spec_of(4), spec_of(5),
                                     spec_of(6), spec_of(7), spec_of(8), spec_of(9), spec_of(10), spec_of(11),
                                     spec_of(12), spec_of(13), spec_of(14), spec_of(15)};

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

// The name of a DLPack dtype as the frameworks spell it (float8_e4m3fn, not "code 10").
std::string dlpack_dtype_name(nb::dlpack::dtype d) {
  // The DLPack 1.x codes of the narrow float formats (numbers, not nanobind's enumerators: those
  // exist from nanobind 2.5 on only).
  static const char* const kNarrowFloats[] = {
      "float8_e3m4",   "float8_e4m3",     "float8_e4m3b11fnuz", "float8_e4m3fn",
      "float8_e4m3fnuz", "float8_e5m2",   "float8_e5m2fnuz",    "float8_e8m0fnu",
      "float6_e2m3fn", "float6_e3m2fn",   "float4_e2m1fn"};
  std::string s;
  switch (d.code) {
    case 0: s = "int" + std::to_string(d.bits); break;
    case 1: s = "uint" + std::to_string(d.bits); break;
    case 2: s = "float" + std::to_string(d.bits); break;
    case 3: s = "opaque" + std::to_string(d.bits); break;
    case 4: s = "bfloat" + std::to_string(d.bits); break;
    case 5: s = "complex" + std::to_string(d.bits); break;
    case 6: s = "bool"; break;
    case 18: s = "bcomplex" + std::to_string(d.bits); break;
    default:
      if (d.code >= 7 && d.code <= 17)
        s = kNarrowFloats[d.code - 7];
      else
        s = "unknown DLPack dtype (code " + std::to_string(d.code) + ", " + std::to_string(d.bits) + " bits)";
      break;
  }
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

// h.<name>, or an invalid object when h has none (or reading it raises).
nb::object attr_or_null(nb::handle h, const char* name) {
  try {
    return nb::getattr(h, name, nb::none());
  } catch (const nb::python_error&) {
    return nb::object();
  }
}

std::string str_of(nb::handle h) {
  try {
    return nb::str(h).c_str();
  } catch (const nb::python_error&) {
    return std::string();
  }
}

// The name of an array's dtype as its framework spells it ("float8_e4m3fn" for torch's
// torch.float8_e4m3fn and for NumPy's ml_dtypes.float8_e4m3fn); "" when it has none.
std::string framework_dtype_name(nb::handle h) {
  nb::object dtype = attr_or_null(h, "dtype");
  if (!dtype.is_valid() || dtype.is_none()) return {};
  nb::object name = attr_or_null(dtype, "name");  // NumPy, CuPy, JAX
  std::string s = name.is_valid() && nb::isinstance<nb::str>(name) ? str_of(name) : str_of(dtype);
  const size_t dot = s.rfind('.');  // "torch.float8_e4m3fn"
  return dot == std::string::npos ? s : s.substr(dot + 1);
}

// Whether `dtype` is one of spec.expected_dtype's ("bfloat16 or float32").
bool expected_dtype(const ArgSpec& spec, const std::string& dtype) {
  const std::string expected = std::string(" ") + spec.expected_dtype + " ";
  return !dtype.empty() && expected.find(" " + dtype + " ") != std::string::npos;
}

// Imports h as an array without copying. When it cannot be imported, says why, in the terms of
// the argument and of h's own framework, whatever the framework: no data (torch's meta device), a
// dtype the library has no use for (float8, ...), a read-only output, or no array at all.
nb::ndarray<> import_array(const ArgSpec& spec, nb::handle h, bool bf16_view) {
  // Inputs are imported read-only (JAX and read-only NumPy arrays export nothing else).
  if (spec.writable) {
    nb::ndarray<> a;
    if (nb::try_cast(h, a, false)) return a;
  } else {
    nb::ndarray<nb::ro> a;
    if (nb::try_cast(h, a, false)) return nb::ndarray<>(a);
  }
  const std::string name = spec.name;
  const std::string type = nb::type_name(h.type()).c_str();

  nb::object device = attr_or_null(h, "device");
  if (device.is_valid() && !device.is_none()) {
    nb::object device_type = attr_or_null(device, "type");  // torch.device("meta").type == "meta"
    const std::string where = str_of(device_type.is_valid() && !device_type.is_none() ? device_type : device);
    if (where == "meta")
      value_error(name + ": tensors on the meta device have no data (device meta); pass CPU or CUDA tensors "
                  "(meta tensors go through flashkda's custom ops under torch.compile / FakeTensorMode only)");
  }
  std::string dtype = framework_dtype_name(h);
  if (bf16_view && dtype == "uint16") dtype = "bfloat16";  // NumPy's ml_dtypes.bfloat16, as its bits
  if (!dtype.empty() && !expected_dtype(spec, dtype))
    type_error(name + ": expected dtype " + spec.expected_dtype + ", got " + dtype);

  std::string hint;
  if (nb::hasattr(h, "requires_grad") && nb::bool_(h.attr("requires_grad"))) {
    hint = " (a torch tensor that requires grad: flashkda is inference only, pass " + name + ".detach())";
  } else if (spec.writable) {
    nb::ndarray<nb::ro> ro;
    if (nb::try_cast(h, ro, false))
      type_error(name + ": expected a writable tensor or array (it is written in place), got a read-only " + type);
  }
  type_error(name + ": expected a tensor or array (torch, NumPy, CuPy, JAX; anything with DLPack or the " +
             "buffer protocol), got " + type + hint);
}

void convert(Converted& c, int i, nb::handle h, uint32_t bf16_views) {
  if (h.is_none()) return;
  const ArgSpec& spec = kArgs[i];
  const bool bf16_view = (bf16_views >> i) & 1u;
  nb::ndarray<> a = import_array(spec, h, bf16_view);
  if (a.ndim() > static_cast<size_t>(flashkda::kMaxDims))
    value_error(std::string(spec.name) + ": expected at most " + std::to_string(flashkda::kMaxDims) + " dimensions, got " + std::to_string(a.ndim()) +
                " with shape " + shape_str(a));
  // Non-contiguous arrays other than q, k, v, g and beta (which may be views of a fused
  // projection: the C++ API takes their strides) are refused here, in the words users know.
  if (a.size() > 1 && !flashkda::kTensorArguments[i].strided) {
    int64_t expected = 1;
    for (size_t d = a.ndim(); d-- > 0;) {
      if (a.shape(d) != 1 && a.stride(d) != expected) {
        std::string strides = "[";
        for (size_t j = 0; j < a.ndim(); ++j) strides += (j ? ", " : "") + std::to_string(a.stride(j));
        value_error(std::string(spec.name) + ": expected a contiguous (dense, row-major) tensor, got shape " +
                    shape_str(a) + " with strides " + strides + "]" + " (in elements); pass a contiguous copy "
                    "(only q, k, v, g and beta may be strided views)");
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
  t.dtype = to_dtype(spec, a.dtype(), bf16_view);
  t.ndim = static_cast<int32_t>(a.ndim());
  for (size_t d = 0; d < a.ndim(); ++d) {
    t.shape[d] = static_cast<int64_t>(a.shape(d));
    t.strides[d] = static_cast<int64_t>(a.stride(d));  // elements; the C++ validation checks them
  }
  c.arrays[i] = std::move(a);
}

// Imports one array as argument `index` of forward() would be: raises the error that call would
// raise about it alone, if any (the torch path asks when torch cannot import another framework's
// array).
void check_array(int index, nb::handle h, bool bf16_view) {
  if (index < 0 || index >= kNumArgs)
    value_error("index: expected 0 to " + std::to_string(kNumArgs - 1) + ", got " + std::to_string(index));
  const ArgSpec& spec = kArgs[index];
  nb::ndarray<> a = import_array(spec, h, bf16_view);
  to_dtype(spec, a.dtype(), bf16_view);
}

flashkda::Gate to_gate(int gate) {
  if (gate != 0 && gate != 1) value_error("gate: expected 0 (safe) or 1 (softplus), got " + std::to_string(gate));
  return static_cast<flashkda::Gate>(gate);
}

flashkda::StateLayout to_state_layout(int layout) {
  if (layout != 0 && layout != 1)
    value_error("state_layout: expected 0 (V-major [.., V, K]) or 1 (K-major [.., K, V]), got " + std::to_string(layout));
  return static_cast<flashkda::StateLayout>(layout);
}

flashkda::ForwardArgs make_args(const Converted& c, float lower_bound, float scale, int gate, bool check_cu_seqlens,
                                int state_layout) {
  flashkda::ForwardArgs a;
  for (int i = 0; i < kNumArgs; ++i) a.*flashkda::kTensorArguments[i].member = c.tensors[i];
  a.lower_bound = lower_bound;
  a.scale = scale;
  a.gate = to_gate(gate);
  a.seqlen_check = check_cu_seqlens ? flashkda::SeqlenCheck::kHost : flashkda::SeqlenCheck::kDeviceGuardsOnly;
  a.state_layout = to_state_layout(state_layout);
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
             uintptr_t stream, nb::object workspace_alloc, uint32_t bf16_views, nb::handle state_indices,
             nb::handle final_state_indices, int state_layout, nb::handle checkpoint_offsets,
             nb::handle checkpoint_state, nb::handle token_state_indices) {
  Converted c;
  const nb::handle handles[kNumArgs] = {q, k, v, g, beta, A_log, dt_bias, out, initial_state, final_state, cu_seqlens,
                                        state_indices, final_state_indices, checkpoint_offsets, checkpoint_state,
                                        token_state_indices};
  for (int i = 0; i < kNumArgs; ++i) convert(c, i, handles[i], bf16_views);
  const flashkda::ForwardArgs args = make_args(c, lower_bound, scale, gate, check_cu_seqlens, state_layout);

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
// The fp64 oracle, for tests: the per-token definition of docs/contract.md on host tensors.

template <typename T>
nb::ndarray<nb::numpy, T> owned_numpy(std::unique_ptr<T[]> data, std::initializer_list<size_t> shape) {
  T* raw = data.release();
  nb::capsule owner(raw, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T>(raw, shape, owner);
}

// The elements of an fp64 buffer of the given dimensions; ValueError when its byte size does not
// fit in 64 bits (N sequences of H heads can be many more than the inputs' sizes suggest).
size_t fp64_elements(const char* name, std::initializer_list<size_t> dims) {
  size_t n = 1;
  bool overflow = false;
  for (size_t d : dims) overflow |= __builtin_mul_overflow(n, d, &n);
  overflow |= __builtin_mul_overflow(n, sizeof(double), &n);
  if (overflow) value_error(std::string(name) + ": the oracle's fp64 buffer would overflow 64 bits");
  return n / sizeof(double);
}

nb::tuple oracle_forward(nb::handle q, nb::handle k, nb::handle v, nb::handle g, nb::handle beta, nb::handle A_log,
                         nb::handle dt_bias, nb::handle initial_state, nb::handle cu_seqlens, float lower_bound,
                         float scale, int gate, uint32_t bf16_views, nb::handle state_indices, int state_layout) {
  Converted c;
  const nb::handle handles[kNumArgs] = {q, k, v, g, beta, A_log, dt_bias, nb::none(), initial_state, nb::none(),
                                        cu_seqlens, state_indices, nb::none(), nb::none(), nb::none(), nb::none()};
  for (int i = 0; i < kNumArgs; ++i) convert(c, i, handles[i], bf16_views);
  if (c.place.cuda) value_error(std::string(c.first) + ": the oracle reads host memory; pass CPU tensors");

  // Validate everything before allocating anything: the buffers' sizes come from the shapes, which
  // are only trusted (K = V = 128, H >= 1, B and T those of real q memory, N those of real
  // cu_seqlens memory, byte sizes within int64) once validate_forward has passed. For that first
  // pass out stands in place of q (an exact alias the validation accepts, once V = K) and
  // final_state of initial_state (or is absent): nothing is allocated and nothing is written.
  const flashkda::Tensor& tq = c.tensors[kQ];
  const flashkda::Tensor& tv = c.tensors[kV];
  const DType state_dtype = c.tensors[kInitialState].given() ? c.tensors[kInitialState].dtype : DType::kF32;
  c.tensors[kOut] = flashkda::make_tensor(tq.data, DType::kBF16, tq.shape[0], tq.shape[1], tq.shape[2], tv.shape[3]);
  c.tensors[kFinalState] = c.tensors[kInitialState];
  const flashkda::Problem checked = flashkda::validate_forward(make_args(c, lower_bound, scale, gate, true, state_layout));
  if (checked.cu_seqlens)
    flashkda::validate_sequence_offsets(flashkda::host_sequence_offsets(checked), checked.total_tokens);
  flashkda::validate_state_slots(checked, flashkda::host_sequence_offsets(checked));  // indices inside the pool

  const size_t B = checked.B, T = checked.T, H = checked.H, K = checked.K, V = checked.V, N = checked.N;
  // The oracle ignores out / final_state's dtypes: point both at the fp64 buffers (large enough
  // and aligned), with the dtypes the validation accepts.
  auto out = std::make_unique<double[]>(fp64_elements("out", {B, T, H, V}) + 1);
  auto state = std::make_unique<double[]>(fp64_elements("final_state", {N, H, V, K}) + 1);
  c.tensors[kOut] = flashkda::make_tensor(out.get(), DType::kBF16, B, T, H, V);
  // A pool of N slots in the state layout (K = V here): the oracle writes its per-sequence
  // [N, H, V, K] output by sequence, not through the slots.
  c.tensors[kFinalState] = flashkda::make_tensor(state.get(), state_dtype, N, H, V, K);
  c.tensors[kFinalStateIndices] = flashkda::Tensor{};
  const flashkda::ForwardArgs args = make_args(c, lower_bound, scale, gate, true, state_layout);
  const flashkda::Problem p = flashkda::validate_forward(args);
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
        // A wrong dtype or a missing tensor is a type problem; every other contract violation a
        // value problem.
        type = std::strstr(e.what(), ": expected dtype ") || std::strstr(e.what(), ": required tensor is missing")
                   ? PyExc_TypeError
                   : PyExc_ValueError;
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

  // Every tensor argument accepts None: it becomes a default flashkda::Tensor (not given), and the
  // C++ validation names a required one that is missing ("A_log: required tensor is missing").
  m.def("forward", &forward, nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(), nb::arg("g").none(),
        nb::arg("beta").none(), nb::arg("A_log").none(), nb::arg("dt_bias").none(), nb::arg("out").none(),
        nb::arg("initial_state").none(),
        nb::arg("final_state").none(), nb::arg("cu_seqlens").none(), nb::arg("lower_bound"), nb::arg("scale"),
        nb::arg("gate"), nb::arg("check_cu_seqlens"), nb::arg("stream"), nb::arg("workspace_alloc").none(),
        nb::arg("bf16_views"), nb::arg("state_indices").none() = nb::none(),
        nb::arg("final_state_indices").none() = nb::none(), nb::arg("state_layout") = 0,
        nb::arg("checkpoint_offsets").none() = nb::none(), nb::arg("checkpoint_state").none() = nb::none(),
        nb::arg("token_state_indices").none() = nb::none(),
        "Runs flashkda::forward on tensors given through DLPack / the buffer protocol (no copies).");
  m.def("oracle_forward", &oracle_forward, nb::arg("q").none(), nb::arg("k").none(), nb::arg("v").none(),
        nb::arg("g").none(), nb::arg("beta").none(), nb::arg("A_log").none(), nb::arg("dt_bias").none(),
        nb::arg("initial_state").none(),
        nb::arg("cu_seqlens").none(), nb::arg("lower_bound"), nb::arg("scale"), nb::arg("gate"),
        nb::arg("bf16_views") = 0, nb::arg("state_indices").none() = nb::none(), nb::arg("state_layout") = 0,
        "Testing hook: the fp64 per-token oracle on host tensors; returns (out [B, T, H, V], "
        "final_state [N, H, V, K]) as float64 NumPy arrays (final_state starts from initial_state or 0).");
  m.def("check_array", &check_array, nb::arg("index"), nb::arg("array"), nb::arg("bf16_view") = false,
        "Imports one array as argument ARG_NAMES[index] would be, raising the call's error when it cannot be.");
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
  m.attr("ARG_REQUIRED") = [] {  // forward()'s required tensors (fwd also requires out, which forward allocates)
    nb::list required;
    for (const flashkda::TensorArgument& arg : flashkda::kTensorArguments) required.append(arg.required);
    return nb::tuple(required);
  }();
}
