#include "host_args.h"

#include "api/arguments.h"

#include <cstring>

#include "common/bf16.h"

namespace flashkda::api_test {
namespace {

constexpr size_t kAlign = 64, kSlack = 64;

// Deterministic values in [lo, hi): the validation tests need inputs, not particular ones.
struct Lcg {
  uint64_t s;
  double next(double lo, double hi) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * static_cast<double>(s >> 11) * 0x1p-53;
  }
};

void fill_bf16(AlignedBytes& b, Lcg& rng, double lo, double hi) {
  auto* p = reinterpret_cast<uint16_t*>(b.data());
  for (size_t i = 0; i < b.size() / 2; ++i) p[i] = float_to_bf16(static_cast<float>(rng.next(lo, hi)));
}

void fill_f32(AlignedBytes& b, Lcg& rng, double lo, double hi) {
  auto* p = reinterpret_cast<float*>(b.data());
  for (size_t i = 0; i < b.size() / 4; ++i) p[i] = static_cast<float>(rng.next(lo, hi));
}

void fill_state(AlignedBytes& b, DType dtype, Lcg& rng) {
  if (dtype == DType::kF32)
    fill_f32(b, rng, -1, 1);
  else
    fill_bf16(b, rng, -1, 1);
}

size_t state_bytes(int64_t N, const HostSetup& s, DType dtype) {
  const size_t elem = dtype == DType::kF32 ? 4 : 2;
  return static_cast<size_t>(N * s.H * s.V * s.K) * elem;
}

}  // namespace

AlignedBytes::AlignedBytes(size_t bytes) : storage_(bytes + kAlign + kSlack), size_(bytes) {
  const auto address = reinterpret_cast<uintptr_t>(storage_.data());
  offset_ = (kAlign - address % kAlign) % kAlign;
}

unsigned char* AlignedBytes::data() { return storage_.data() + offset_; }
const unsigned char* AlignedBytes::data() const { return storage_.data() + offset_; }
void AlignedBytes::fill(unsigned char byte) { std::memset(storage_.data(), byte, storage_.size()); }
bool AlignedBytes::all_equal(unsigned char byte) const {
  for (unsigned char c : storage_)
    if (c != byte) return false;
  return true;
}

HostProblem::HostProblem(const HostSetup& s) : setup(s) {
  const size_t rows = static_cast<size_t>(s.B * s.T * s.H);
  q = AlignedBytes(rows * s.K * 2);
  k = AlignedBytes(rows * s.K * 2);
  g = AlignedBytes(rows * s.K * 2);
  v = AlignedBytes(rows * s.V * 2);
  out = AlignedBytes(rows * s.V * 2);
  beta = AlignedBytes(rows * 2);
  A_log = AlignedBytes(s.H * 4);
  dt_bias = AlignedBytes(s.H * s.K * 4);
  initial_state = AlignedBytes(s.initial_state ? state_bytes(N(), s, s.initial_state_dtype) : 0);
  final_state = AlignedBytes(s.final_state ? state_bytes(N(), s, s.final_state_dtype) : 0);

  Lcg rng{12345};
  fill_bf16(q, rng, -2, 2);
  fill_bf16(k, rng, -2, 2);
  fill_bf16(v, rng, -2, 2);
  fill_bf16(g, rng, -2, 2);
  fill_bf16(beta, rng, -2, 2);
  fill_f32(A_log, rng, 0, 1);
  fill_f32(dt_bias, rng, 0, 1);
  if (s.initial_state) fill_state(initial_state, s.initial_state_dtype, rng);

  const size_t elem = s.cu_seqlens_dtype == DType::kI32 ? 4 : 8;
  cu_seqlens = AlignedBytes(s.cu_seqlens.size() * elem);
  for (size_t i = 0; i < s.cu_seqlens.size(); ++i) {
    if (elem == 4) {
      const int32_t x = static_cast<int32_t>(s.cu_seqlens[i]);
      std::memcpy(cu_seqlens.data() + 4 * i, &x, 4);
    } else {
      std::memcpy(cu_seqlens.data() + 8 * i, &s.cu_seqlens[i], 8);
    }
  }
  poison_outputs();
}

int64_t HostProblem::N() const {
  return setup.cu_seqlens.empty() ? setup.B : static_cast<int64_t>(setup.cu_seqlens.size()) - 1;
}

ForwardArgs HostProblem::args() {
  const HostSetup& s = setup;
  ForwardArgs a;
  a.q = make_tensor(q.data(), DType::kBF16, s.B, s.T, s.H, s.K);
  a.k = make_tensor(k.data(), DType::kBF16, s.B, s.T, s.H, s.K);
  a.v = make_tensor(v.data(), DType::kBF16, s.B, s.T, s.H, s.V);
  a.g = make_tensor(g.data(), DType::kBF16, s.B, s.T, s.H, s.K);
  a.beta = make_tensor(beta.data(), DType::kBF16, s.B, s.T, s.H);
  a.A_log = make_tensor(A_log.data(), DType::kF32, s.H);
  a.dt_bias = make_tensor(dt_bias.data(), DType::kF32, s.H, s.K);
  if (s.initial_state) a.initial_state = make_tensor(initial_state.data(), s.initial_state_dtype, N(), s.H, s.V, s.K);
  if (s.final_state) a.final_state = make_tensor(final_state.data(), s.final_state_dtype, N(), s.H, s.V, s.K);
  if (!s.cu_seqlens.empty())
    a.cu_seqlens = make_tensor(cu_seqlens.data(), s.cu_seqlens_dtype, static_cast<int64_t>(s.cu_seqlens.size()));
  a.out = make_tensor(out.data(), DType::kBF16, s.B, s.T, s.H, s.V);
  a.lower_bound = -5.0f;
  a.scale = 0.08838834764831845f;
  a.gate = Gate::kSafe;
  return a;
}

void HostProblem::poison_outputs() {
  out.fill(0xAB);
  final_state.fill(0xAB);
}

bool HostProblem::outputs_untouched() const { return out.all_equal(0xAB) && final_state.all_equal(0xAB); }

flashkda_tensor to_c(const Tensor& t) {
  flashkda_tensor c{};
  c.data = t.data;
  c.dtype = static_cast<int32_t>(t.dtype);
  c.ndim = t.ndim;
  for (int i = 0; i < kMaxDims; ++i) c.shape[i] = t.shape[i], c.strides[i] = t.strides[i];
  return c;
}

flashkda_forward_args to_c(const ForwardArgs& a) {
  flashkda_forward_args c{};
  for (const TensorArgument& arg : kTensorArguments) c.*arg.c_member = to_c(a.*arg.member);
  c.lower_bound = a.lower_bound;
  c.scale = a.scale;
  c.gate = static_cast<int32_t>(a.gate);
  c.seqlen_check = static_cast<int32_t>(a.seqlen_check);
  c.state_layout = static_cast<int32_t>(a.state_layout);
  return c;
}

Refusal refuse(HostProblem& problem, const ForwardArgs& args) {
  Refusal r;
  problem.poison_outputs();
  try {
    forward(args, nullptr, 0);
  } catch (const Error& e) {
    r.thrown = true;
    r.code = e.code();
    r.message = e.what();
  }
  r.outputs_untouched = problem.outputs_untouched();

  problem.poison_outputs();
  const flashkda_forward_args c = to_c(args);
  r.c_code = flashkda_forward(&c, nullptr, 0, nullptr);
  r.c_message = flashkda_last_error();
  r.outputs_untouched = r.outputs_untouched && problem.outputs_untouched();
  return r;
}

}  // namespace flashkda::api_test
