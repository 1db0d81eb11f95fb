#include "api/validate.h"

#include "api/arguments.h"

#include <cmath>
#include <cstdint>
#include <string_view>
#include <utility>

namespace flashkda {
namespace {

// Head sizes the kernels implement today; the contract allows others later.
constexpr int64_t kSupportedHeadDim = 128;
// The big activation tensors are read with 16-byte vector accesses.
constexpr uintptr_t kActivationAlignment = 16;

std::string dims_string(std::initializer_list<int64_t> dims) {
  std::string s = "[";
  bool first = true;
  for (int64_t d : dims) {
    if (!first) s += ", ";
    s += std::to_string(d);
    first = false;
  }
  return s + "]";
}


std::string dtype_string(DType t) {
  const std::string name = dtype_name(t);
  return name == "unknown dtype" ? "unknown dtype code " + std::to_string(static_cast<int>(t)) : name;
}

// Every argument of the table: a required one left as a default Tensor (no data, no dimensions)
// is "missing", not "wrong dtype"; a given one has one of its dtypes.
void check_presence_and_dtypes(const ForwardArgs& a) {
  for (const TensorArgument& arg : kTensorArguments)
    if (arg.required && !(a.*arg.member).given()) fail(ErrorCode::kInvalidArgument, arg.name, ": required tensor is missing");
  for (const TensorArgument& arg : kTensorArguments) {
    const Tensor& t = a.*arg.member;
    if (!t.given()) continue;
    bool allowed = false;
    for (int i = 0; i < arg.num_dtypes; ++i) allowed |= t.dtype == arg.dtypes[i];
    if (!allowed)
      fail(ErrorCode::kInvalidArgument, arg.name, ": expected dtype ", arg.dtype_words, ", got ", dtype_string(t.dtype));
  }
}

void check_ndim(const char* name, const Tensor& t, int ndim, const char* layout) {
  if (t.ndim != ndim)
    fail(ErrorCode::kInvalidArgument, name, ": expected ", ndim, ndim == 1 ? " dimension " : " dimensions ", layout,
         ", got ", t.ndim, t.ndim == 1 ? " dimension" : " dimensions", " with shape ", shape_string(t));
  for (int i = 0; i < ndim; ++i)
    if (t.shape[i] < 0)
      fail(ErrorCode::kInvalidArgument, name, ": dimension ", i, " is negative in shape ", shape_string(t));
  // Every size the backends derive (offsets, byte counts, loop bounds) is a product of these
  // dimensions: a tensor whose byte size fits in int64 keeps all of them in range.
  int64_t bytes = static_cast<int64_t>(dtype_size(t.dtype));
  for (int i = 0; i < ndim; ++i)
    if (__builtin_mul_overflow(bytes, t.shape[i], &bytes))
      fail(ErrorCode::kInvalidArgument, name, ": shape ", shape_string(t), " of ", dtype_string(t.dtype),
           " is too large: its size in bytes overflows 64 bits");
}

void check_shape(const char* name, const Tensor& t, std::initializer_list<int64_t> dims, const char* layout) {
  check_ndim(name, t, static_cast<int>(dims.size()), layout);
  int i = 0;
  for (int64_t d : dims) {
    if (t.shape[i] != d)
      fail(ErrorCode::kInvalidArgument, name, ": expected shape ", dims_string(dims), " ", layout, ", got ",
           shape_string(t));
    ++i;
  }
}

void check_data(const char* name, const Tensor& t, uintptr_t alignment) {
  if (!t.data && t.numel() > 0)
    fail(ErrorCode::kInvalidArgument, name, ": data pointer is null for a tensor of shape ", shape_string(t));
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  if (address % alignment != 0)
    fail(ErrorCode::kInvalidArgument, name, ": data pointer must be ", alignment, "-byte aligned, got address 0x",
         std::hex, address, std::dec, " (offset ", address % alignment, ")");
}

// A head dimension the kernels implement (K or V).
void check_head_dim(const char* name, const char* dim, int64_t value) {
  if (value != kSupportedHeadDim)
    fail(ErrorCode::kUnsupported, name, ": head dimension ", dim, " must be ", kSupportedHeadDim,
         " (other sizes are not supported yet), got ", dim, " = ", value);
}

// A tensor of a known shape (its dtype checked already): shape, pointer.
void check_tensor(const char* name, const Tensor& t, std::initializer_list<int64_t> dims, const char* layout,
                  uintptr_t alignment) {
  check_shape(name, t, dims, layout);
  check_data(name, t, alignment);
}

// The bytes [begin, end) a validated tensor spans (empty when it has no data).
struct Extent {
  const char* name;
  uintptr_t begin, end;
};

// Elements from a view's first element to its last, plus one (numel() when dense; a strided view
// spans its gaps too).
int64_t span_elements(const Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t span = 1;
  for (int i = 0; i < t.ndim; ++i) span += (t.shape[i] - 1) * t.stride(i);
  return span;
}

Extent extent_of(const char* name, const Tensor& t) {
  const auto begin = reinterpret_cast<uintptr_t>(t.data);
  if (!t.data) return {name, 0, 0};
  return {name, begin, begin + static_cast<uintptr_t>(span_elements(t)) * dtype_size(t.dtype)};
}

std::string strides_string(const Tensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim && i < kMaxDims; ++i) s += (i ? ", " : "") + std::to_string(t.strides[i]);
  return s + "]";
}

// Strided views (their shapes checked already): only the arguments that may be one, the last
// dimension contiguous (q, k, v, g), no negative stride, a span whose bytes fit in int64.
void check_strides(const ForwardArgs& a) {
  for (const TensorArgument& arg : kTensorArguments) {
    const Tensor& t = a.*arg.member;
    if (!t.given() || t.dense()) continue;
    if (!arg.strided)
      fail(ErrorCode::kInvalidArgument, arg.name, ": expected a dense (contiguous, row-major) tensor, got strides ",
           strides_string(t), " for shape ", shape_string(t), "; only q, k, v, g and beta may be strided views");
    for (int i = 0; i < t.ndim; ++i)
      if (t.stride(i) < 0)
        fail(ErrorCode::kInvalidArgument, arg.name, ": negative strides are not supported, got strides ",
             strides_string(t), " for shape ", shape_string(t));
    if (t.ndim == 4 && t.shape[3] > 1 && t.stride(3) != 1)
      fail(ErrorCode::kInvalidArgument, arg.name, ": expected the last dimension contiguous (stride 1), got strides ",
           strides_string(t), " for shape ", shape_string(t));
    int64_t bytes = static_cast<int64_t>(dtype_size(t.dtype)), span = 1;
    bool overflow = false;
    for (int i = 0; i < t.ndim; ++i) {
      int64_t extent = 0;
      overflow |= __builtin_mul_overflow(t.shape[i] - 1, t.stride(i), &extent);
      overflow |= __builtin_add_overflow(span, extent, &span);
    }
    if (overflow || __builtin_mul_overflow(bytes, span, &bytes))
      fail(ErrorCode::kInvalidArgument, arg.name, ": strides ", strides_string(t), " with shape ", shape_string(t),
           " span more bytes than 64 bits count");
  }
}

// The rows of a validated [B, T, H, D] (or [B, T, H]) activation.
RowStrides row_strides(const Tensor& t) {
  if (t.dense()) return {};
  return {false, t.stride(0), t.stride(1), t.stride(2)};
}

// Outputs may not overlap an input or each other, except as the exact aliases the kernels
// support: out in place of q, k or g (read only by the token-parallel pass, before any output
// row is written), final_state in place of initial_state (each slice is read before it is
// written). v is not among them: the state pass streams v rows while other blocks of the same
// head write out.
void check_overlaps(const ForwardArgs& a) {
  const std::pair<std::string_view, std::string_view> exact_aliases[] = {
      {"out", "q"}, {"out", "k"}, {"out", "g"}, {"final_state", "initial_state"}};
  for (const TensorArgument& output : kTensorArguments) {
    if (!output.output) continue;
    const Extent o = extent_of(output.name, a.*output.member);
    for (const TensorArgument& other : kTensorArguments) {
      const Extent i = extent_of(other.name, a.*other.member);
      if (&other == &output || o.begin == o.end || i.begin == i.end) continue;
      if (o.begin >= i.end || i.begin >= o.end) continue;
      // Two outputs meet twice in this loop: report the pair once, at the later one.
      if (other.output && &other > &output) continue;
      const bool exact = o.begin == i.begin && o.end == i.end;
      bool allowed = false;
      for (const auto& [out_name, in_name] : exact_aliases) allowed |= exact && o.name == out_name && i.name == in_name;
      if (allowed) continue;
      fail(ErrorCode::kInvalidArgument, o.name, ": overlaps ", i.name, " (", o.name, " spans [0x", std::hex, o.begin,
           ", 0x", o.end, "), ", i.name, " [0x", i.begin, ", 0x", i.end, std::dec, ")); ",
           exact ? "this aliasing is not supported (only out = q, k or g and final_state = initial_state are)"
                 : "outputs may not partially overlap another tensor",
           "; pass a separate buffer");
    }
  }
}

}  // namespace

std::string shape_string(const Tensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim && i < kMaxDims; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

Problem validate_forward(const ForwardArgs& a) {
  check_presence_and_dtypes(a);
  check_ndim("q", a.q, 4, "[B, T, H, K]");
  const int64_t B = a.q.shape[0], T = a.q.shape[1], H = a.q.shape[2], K = a.q.shape[3];
  if (H < 1) fail(ErrorCode::kInvalidArgument, "q: expected at least one head (H >= 1), got H = ", H);
  check_head_dim("q", "K", K);
  check_data("q", a.q, kActivationAlignment);

  check_tensor("k", a.k, {B, T, H, K}, "[B, T, H, K] (same as q)", kActivationAlignment);

  check_ndim("v", a.v, 4, "[B, T, H, V]");
  if (a.v.shape[0] != B || a.v.shape[1] != T || a.v.shape[2] != H)
    fail(ErrorCode::kInvalidArgument, "v: expected shape [", B, ", ", T, ", ", H, ", V] matching q's [B, T, H], got ",
         shape_string(a.v));
  const int64_t V = a.v.shape[3];
  check_head_dim("v", "V", V);
  check_data("v", a.v, kActivationAlignment);

  check_tensor("g", a.g, {B, T, H, K}, "[B, T, H, K] (same as q)", kActivationAlignment);
  check_tensor("beta", a.beta, {B, T, H}, "[B, T, H]", 2);

  check_tensor("A_log", a.A_log, {H}, "[H]", 4);
  check_tensor("dt_bias", a.dt_bias, {H, K}, "[H, K]", 4);

  check_tensor("out", a.out, {B, T, H, V}, "[B, T, H, V]", kActivationAlignment);

  int64_t N = B;
  if (a.cu_seqlens.given()) {
    check_ndim("cu_seqlens", a.cu_seqlens, 1, "[N + 1]");
    if (a.cu_seqlens.shape[0] < 2)
      fail(ErrorCode::kInvalidArgument, "cu_seqlens: expected at least 2 entries [N + 1] for N >= 1 sequences, got ",
           a.cu_seqlens.shape[0]);
    if (B != 1)
      fail(ErrorCode::kInvalidArgument, "cu_seqlens: packed sequences need batch size B = 1 in q [B, T, H, K], got B = ", B);
    check_data("cu_seqlens", a.cu_seqlens, dtype_size(a.cu_seqlens.dtype));
    N = a.cu_seqlens.shape[0] - 1;
  }

  // States: [N, H, V, K], or pools of any number of slots with state_indices; K-major swaps V, K.
  if (a.state_layout != StateLayout::kVK && a.state_layout != StateLayout::kKV)
    fail(ErrorCode::kInvalidArgument, "state_layout: expected kVK (0) or kKV (1), got ", static_cast<int>(a.state_layout));
  const bool pools = a.state_indices.given(), k_major = a.state_layout == StateLayout::kKV;
  if (a.final_state_indices.given() && !pools)
    fail(ErrorCode::kInvalidArgument, "final_state_indices: given without state_indices; pass state_indices [N] too "
         "(the slots the sequences start from)");
  if (pools) {
    check_tensor("state_indices", a.state_indices, {N}, "[N]", dtype_size(a.state_indices.dtype));
    if (a.final_state_indices.given())
      check_tensor("final_state_indices", a.final_state_indices, {N}, "[N]", dtype_size(a.final_state_indices.dtype));
    if (!a.initial_state.given() && !a.final_state.given())
      fail(ErrorCode::kInvalidArgument, "state_indices: given without initial_state or final_state: there is no pool "
           "to index");
  }
  int64_t token_state_columns = 0;
  if (a.token_state_indices.given()) {
    if (!pools || !a.final_state.given())
      fail(ErrorCode::kInvalidArgument, "token_state_indices: per-token states go to slots of a final_state pool; "
           "pass state_indices [N] and final_state [P, H, V, K] too");
    check_ndim("token_state_indices", a.token_state_indices, 2, "[N, T_max]");
    token_state_columns = a.token_state_indices.shape[1];
    check_tensor("token_state_indices", a.token_state_indices, {N, token_state_columns}, "[N, T_max]",
                 dtype_size(a.token_state_indices.dtype));
  }
  const char* state_layout = pools ? (k_major ? "[P, H, K, V]" : "[P, H, V, K]") : (k_major ? "[N, H, K, V]" : "[N, H, V, K]");
  auto check_state = [&](const char* name, const Tensor& t) {
    const int64_t slots = pools ? (t.ndim == 4 ? t.shape[0] : 0) : N;
    check_tensor(name, t, {slots, H, k_major ? K : V, k_major ? V : K}, state_layout, kActivationAlignment);
  };
  if (a.initial_state.given()) check_state("initial_state", a.initial_state);
  if (a.final_state.given()) {
    check_state("final_state", a.final_state);
    if (a.initial_state.given() && a.final_state.dtype != a.initial_state.dtype)
      fail(ErrorCode::kInvalidArgument, "final_state: dtype ", dtype_name(a.final_state.dtype),
           " differs from initial_state's ", dtype_name(a.initial_state.dtype),
           "; give both states the same dtype");
  }

  // Checkpoints: offsets [N, C] and the states [N, C, H, V, K] (in the state layout) come together.
  if (a.checkpoint_offsets.given() != a.checkpoint_state.given())
    fail(ErrorCode::kInvalidArgument, a.checkpoint_offsets.given() ? "checkpoint_offsets: given without checkpoint_state"
                                                                   : "checkpoint_state: given without checkpoint_offsets",
         "; pass both (the offsets [N, C] and the states [N, C, H, V, K] they fill)");
  int64_t checkpoints = 0;
  if (a.checkpoint_offsets.given()) {
    check_ndim("checkpoint_offsets", a.checkpoint_offsets, 2, "[N, C]");
    checkpoints = a.checkpoint_offsets.shape[1];
    check_tensor("checkpoint_offsets", a.checkpoint_offsets, {N, checkpoints}, "[N, C]",
                 dtype_size(a.checkpoint_offsets.dtype));
    check_tensor("checkpoint_state", a.checkpoint_state, {N, checkpoints, H, k_major ? K : V, k_major ? V : K},
                 k_major ? "[N, C, H, K, V]" : "[N, C, H, V, K]", kActivationAlignment);
  }

  if (a.gate != Gate::kSafe && a.gate != Gate::kSoftplus)
    fail(ErrorCode::kInvalidArgument, "gate: expected safe (0) or softplus (1), got ", static_cast<int>(a.gate));
  if (a.gate == Gate::kSafe && !(a.lower_bound >= -5.0f && a.lower_bound < 0.0f))
    fail(ErrorCode::kInvalidArgument, "lower_bound: expected a value in [-5, 0) for the safe gate, got ", a.lower_bound);
  if (!std::isfinite(a.scale) || !(a.scale > 0.0f))
    fail(ErrorCode::kInvalidArgument, "scale: expected a finite number > 0 (usually K^-0.5), got ", a.scale);
  if (a.seqlen_check != SeqlenCheck::kHost && a.seqlen_check != SeqlenCheck::kDeviceGuardsOnly)
    fail(ErrorCode::kInvalidArgument, "seqlen_check: expected kHost (0) or kDeviceGuardsOnly (1), got ",
         static_cast<int>(a.seqlen_check));

  check_strides(a);
  check_overlaps(a);

  Problem p;
  p.B = B, p.T = T, p.H = H, p.K = K, p.V = V, p.N = N;
  p.total_tokens = B * T;
  p.q = static_cast<const uint16_t*>(a.q.data);
  p.k = static_cast<const uint16_t*>(a.k.data);
  p.v = static_cast<const uint16_t*>(a.v.data);
  p.g = static_cast<const uint16_t*>(a.g.data);
  p.beta = static_cast<const uint16_t*>(a.beta.data);
  p.q_rows = row_strides(a.q), p.k_rows = row_strides(a.k), p.v_rows = row_strides(a.v);
  p.g_rows = row_strides(a.g), p.beta_rows = row_strides(a.beta);
  p.A_log = static_cast<const float*>(a.A_log.data);
  p.dt_bias = static_cast<const float*>(a.dt_bias.data);
  p.initial_state = a.initial_state.data;
  p.initial_state_dtype = a.initial_state.dtype;
  p.final_state = a.final_state.data;
  p.final_state_dtype = a.final_state.dtype;
  p.cu_seqlens = a.cu_seqlens.data;
  p.cu_seqlens_dtype = a.cu_seqlens.dtype;
  p.state_layout = a.state_layout;
  p.state_indices = a.state_indices.data;
  p.state_indices_dtype = a.state_indices.dtype;
  p.final_state_indices = a.final_state_indices.data;
  p.final_state_indices_dtype = a.final_state_indices.dtype;
  p.initial_slots = a.initial_state.given() ? a.initial_state.shape[0] : 0;
  p.checkpoint_offsets = a.checkpoint_offsets.data;
  p.checkpoint_offsets_dtype = a.checkpoint_offsets.dtype;
  p.checkpoint_state = static_cast<float*>(a.checkpoint_state.data);
  p.checkpoints = checkpoints;
  p.token_state_indices = a.token_state_indices.data;
  p.token_state_indices_dtype = a.token_state_indices.dtype;
  p.token_state_columns = token_state_columns;
  p.final_slots = a.final_state.given() ? a.final_state.shape[0] : 0;
  p.out = static_cast<uint16_t*>(a.out.data);
  p.lower_bound = a.lower_bound;
  p.scale = a.scale;
  p.gate = a.gate;
  return p;
}

void validate_sequence_offsets(const std::vector<int64_t>& offsets, int64_t total_tokens) {
  if (offsets.front() != 0)
    fail(ErrorCode::kInvalidArgument, "cu_seqlens: expected cu_seqlens[0] = 0, got ", offsets.front());
  for (size_t i = 1; i < offsets.size(); ++i)
    if (offsets[i] < offsets[i - 1])
      fail(ErrorCode::kInvalidArgument, "cu_seqlens: expected non-decreasing values, got cu_seqlens[", i - 1,
           "] = ", offsets[i - 1], " > cu_seqlens[", i, "] = ", offsets[i]);
  if (offsets.back() != total_tokens)
    fail(ErrorCode::kInvalidArgument, "cu_seqlens: expected the last entry cu_seqlens[", offsets.size() - 1,
         "] to equal the number of tokens T = ", total_tokens, ", got ", offsets.back());
}

void validate_state_slots(const Problem& p, const std::vector<int64_t>& offsets) {
  if (!p.state_indices) return;
  const StateSlots slots(p);
  // The sequence that writes each slot of final_state, -1 for none.
  std::vector<int64_t> writer(static_cast<size_t>(p.final_state ? p.final_slots : 0), -1);
  auto claim = [&](const char* name, const std::string& entry, int64_t slot, int64_t n) {
    if (slot >= p.final_slots)
      fail(ErrorCode::kInvalidArgument, name, ": ", entry, " = ", slot, " is outside final_state's pool of ",
           p.final_slots, " slots");
    if (writer[slot] >= 0)
      fail(ErrorCode::kInvalidArgument, name, ": ", writer[slot] == n ? "sequence " + std::to_string(n) + " writes slot "
                                                                       : "sequences " + std::to_string(writer[slot]) +
                                                                             " and " + std::to_string(n) + " both write slot ",
           slot, writer[slot] == n ? " twice" : "", "; each slot may take one state a call");
    writer[slot] = n;
  };
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t s = slots.initial(n);
    if (s < 0) continue;  // padding
    if (p.initial_state && s >= p.initial_slots)
      fail(ErrorCode::kInvalidArgument, "state_indices: state_indices[", n, "] = ", s, " is outside initial_state's pool of ",
           p.initial_slots, " slots");
    if (!p.final_state) continue;
    if (p.token_state_indices) {
      const int64_t length = offsets[n + 1] - offsets[n];
      if (length > p.token_state_columns)
        fail(ErrorCode::kInvalidArgument, "token_state_indices: sequence ", n, " has ", length, " tokens, more than its ",
             p.token_state_columns, " columns");
      for (int64_t t = 0; t < length; ++t)
        if (const int64_t slot = slots.token(n, t); slot >= 0)
          claim("token_state_indices", "token_state_indices[" + std::to_string(n) + ", " + std::to_string(t) + "]", slot, n);
    }
    const int64_t f = slots.final(n);
    if (f < 0) continue;  // not written
    const char* name = p.final_state_indices ? "final_state_indices" : "state_indices";
    claim(name, std::string(name) + "[" + std::to_string(n) + "]", f, n);
  }
  // One buffer for both pools: a slot written by one sequence may not be another's start.
  if (!p.initial_state || p.initial_state != p.final_state) return;
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t s = slots.initial(n);
    if (s >= 0 && s < p.final_slots && writer[s] >= 0 && writer[s] != n)
      fail(ErrorCode::kInvalidArgument, p.token_state_indices ? "token_state_indices" : "final_state_indices",
           ": sequence ", writer[s], " writes slot ", s, ", which sequence ", n,
           " starts from in the same buffer: the result would depend on the order; write to other slots, or use "
           "separate pools");
  }
}

void validate_checkpoint_offsets(const Problem& p, const std::vector<int64_t>& offsets) {
  if (!p.checkpoint_offsets) return;
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t length = offsets[n + 1] - offsets[n];
    int64_t previous = -1, previous_c = -1;
    for (int64_t c = 0; c < p.checkpoints; ++c) {
      const int64_t t = host_checkpoint_offset(p, n, c);
      if (t < 0) continue;  // an unused entry
      if (t % 16 != 0)
        fail(ErrorCode::kInvalidArgument, "checkpoint_offsets: checkpoint_offsets[", n, ", ", c, "] = ", t,
             " is not a multiple of 16");
      if (t > length)
        fail(ErrorCode::kInvalidArgument, "checkpoint_offsets: checkpoint_offsets[", n, ", ", c, "] = ", t,
             " is past the end of sequence ", n, " (", length, " tokens)");
      if (t < previous)
        fail(ErrorCode::kInvalidArgument, "checkpoint_offsets: offsets of sequence ", n, " decrease: [", n, ", ", c,
             "] = ", t, " after [", n, ", ", previous_c, "] = ", previous);
      previous = t, previous_c = c;
    }
  }
}

}  // namespace flashkda
