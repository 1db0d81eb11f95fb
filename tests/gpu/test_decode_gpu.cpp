// The recurrent kernel on decode-shaped calls (a few tokens a request) against the fp64 oracle:
// the plain [N, T] form for T = 1..8, both gates and state dtypes; a state pool updated in place
// inside a captured CUDA graph, replayed with new slots and inputs; device-side guards for
// indices nobody checked; host checks of device indices; many requests from a pool in both
// layouts. The serving features at every length
// (pools, per-token states, checkpoints, strided inputs) run in test_serving_gpu.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/bf16.h"
#include "cpu/oracle.h"
#include "device_problem.h"

namespace flashkda::testing {
namespace {

class GpuDecode : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0 || !cuda_compiled())
      GTEST_SKIP() << "no CUDA device (or built without CUDA): GPU decode tests skipped";
  }
};

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  check_cuda(cudaMalloc(&d, std::max<size_t>(host.size(), 1) * sizeof(T)), "cudaMalloc");
  check_cuda(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  check_cuda(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return h;
}

// A pool of `elements` N(0, 1) values in `dtype` (float32 or bfloat16), as raw bytes.
std::vector<uint8_t> normal_pool(DType dtype, size_t elements, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  const size_t es = dtype == DType::kF32 ? 4 : 2;
  std::vector<uint8_t> pool(elements * es);
  for (size_t e = 0; e < elements; ++e) {
    const float x = normal(rng);
    if (dtype == DType::kF32) std::memcpy(pool.data() + 4 * e, &x, 4);
    else {
      const uint16_t b = float_to_bf16(x);
      std::memcpy(pool.data() + 2 * e, &b, 2);
    }
  }
  return pool;
}

// `host`'s problem reading its initial states from the host copy of a pool of `slots` slots,
// request n from slot idx[n] (the oracle's view of a pool decode; it points into idx).
Problem pool_reference(Problem ref, const uint8_t* pool, DType dtype, int64_t slots, const std::vector<int32_t>& idx,
                       StateLayout layout) {
  ref.initial_state = pool;
  ref.initial_state_dtype = dtype;
  ref.initial_slots = ref.final_slots = slots;
  ref.state_indices = idx.data();
  ref.state_indices_dtype = DType::kI32;
  ref.state_layout = layout;
  return ref;
}

// Every slot of the pool that no entry of idx addresses keeps its bytes (slot_bytes a slot).
void expect_unaddressed_slots_unchanged(const std::vector<uint8_t>& before, const std::vector<uint8_t>& after,
                                        const std::vector<int32_t>& idx, size_t slot_bytes) {
  for (size_t s = 0; s < before.size() / slot_bytes; ++s)
    if (std::find(idx.begin(), idx.end(), static_cast<int32_t>(s)) == idx.end())
      EXPECT_EQ(0, std::memcmp(before.data() + s * slot_bytes, after.data() + s * slot_bytes, slot_bytes))
          << "slot " << s << " is not addressed but changed";
}

// [N, T] requests of T tokens, fixed batch (no cu_seqlens): the auto plan takes the recurrent
// kernel (decode-shaped); out and the final state against the oracle, two runs bit-identical.
class GpuDecodeTokens : public GpuDecode, public ::testing::WithParamInterface<int> {};

TEST_P(GpuDecodeTokens, MatchesOracle) {
  const int T = GetParam();
  for (const Gate gate : {Gate::kSafe, Gate::kSoftplus})
    for (const DType dtype : {DType::kF32, DType::kBF16}) {
      ProblemSpec spec;
      spec.B = 7, spec.T = T, spec.H = 3;
      spec.gate = gate;
      spec.init = InitState::kNormal;
      spec.init_dtype = spec.final_dtype = dtype;
      spec.seed = 40 + T;
      SCOPED_TRACE(spec.describe());
      RandomProblem host(spec);
      DeviceProblem dev(host);
      const DeviceProblem::Outputs first = dev.run_fresh();
      const std::vector<uint16_t>& out = first.out;
      const std::vector<uint8_t>& state = first.final_state;
      EXPECT_TRUE(dev.guards_intact());
      const DeviceProblem::Outputs second = dev.run_fresh();
      EXPECT_TRUE(second.out == out && second.final_state == state) << "two runs differ";
      const Problem& p = host.problem();
      std::vector<double> ref_out(host.out_size()), ref_state(host.state_size());
      oracle_forward(p, ref_out.data(), ref_state.data());
      const double e_out = rel_error(ref_out.data(), out.data(), out.size());
      const double e_state = rel_error(ref_state.data(), state.data(), dtype, ref_state.size());
      EXPECT_LE(e_out, kBar);
      EXPECT_LE(e_state, kBar);
      std::printf("  [gpu vs oracle] %-70s out %.2e  state %.2e\n", spec.describe().c_str(), e_out, e_state);
    }
}

INSTANTIATE_TEST_SUITE_P(Tokens, GpuDecodeTokens, ::testing::Range(1, 9));

// An engine's decode loop: one captured graph, replayed with new slot indices and new inputs
// copied into the same buffers; each replay matches the oracle, slots not addressed keep their
// bytes. (Capture skips the host check of the indices: the kernel's guards apply.) Both pool
// dtypes: an engine keeps either.
class GpuDecodeGraph : public GpuDecode, public ::testing::WithParamInterface<DType> {};

TEST_P(GpuDecodeGraph, CapturedGraphReplaysWithNewSlotsAndInputs) {
  constexpr int64_t N = 6, H = 2, D = 128, P = 20;
  const DType dtype = GetParam();
  const size_t es = dtype == DType::kF32 ? 4 : 2;  // bytes an element
  ProblemSpec spec;
  spec.B = N, spec.T = 1, spec.H = H;
  spec.init = InitState::kNone;
  spec.final_state = false;
  spec.seed = 70;
  RandomProblem host(spec);
  DeviceProblem dev(host);

  std::mt19937 rng(71);
  std::normal_distribution<float> normal;
  const size_t per_request = static_cast<size_t>(H * D * D);
  std::vector<uint8_t> pool = normal_pool(dtype, static_cast<size_t>(P) * per_request, rng);
  uint8_t* d_pool = to_device(pool);
  std::vector<int32_t> idx(N);
  int32_t* d_idx = to_device(idx);

  ForwardArgs a = dev.args();
  a.initial_state = a.final_state = make_tensor(d_pool, dtype, P, H, D, D);
  a.state_indices = make_tensor(d_idx, DType::kI32, N);
  ASSERT_EQ(forward_workspace_size(a), 0u) << "decode needs no workspace";

  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  forward(a, nullptr, 0, stream);
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(::testing::Message() << "replay " << round << ", " << dtype_name(dtype) << " pool");
    std::vector<int32_t> slots(P);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    idx.assign(slots.begin(), slots.begin() + N);
    idx[static_cast<size_t>(round)] = -1;  // a padding request
    std::generate(host.q.begin(), host.q.end(), [&] { return float_to_bf16(normal(rng)); });
    check_cuda(cudaMemcpy(d_idx, idx.data(), N * sizeof(int32_t), cudaMemcpyHostToDevice), "indices");
    check_cuda(cudaMemcpy(const_cast<uint16_t*>(dev.problem().q), host.q.data(), host.q.size() * 2,
                          cudaMemcpyHostToDevice), "q");
    const std::vector<uint8_t> before = to_host(d_pool, pool.size());
    check_cuda(cudaMemset(dev.problem().out, 0xFF, host.out_size() * 2), "poison out");
    check_cuda(cudaGraphLaunch(exec, stream), "replay");
    check_cuda(cudaStreamSynchronize(stream), "replay");

    const Problem ref = pool_reference(host.problem(), before.data(), dtype, P, idx, StateLayout::kVK);
    std::vector<double> ref_out(host.out_size()), ref_state(static_cast<size_t>(N) * per_request);
    oracle_forward(ref, ref_out.data(), ref_state.data());
    const std::vector<uint16_t> out = to_host(dev.problem().out, host.out_size());
    const std::vector<uint8_t> after = to_host(d_pool, pool.size());
    for (int64_t n = 0; n < N; ++n) {
      const size_t rows = static_cast<size_t>(H * D);
      if (idx[n] < 0) {
        for (size_t e = 0; e < rows; ++e) EXPECT_EQ(out[n * rows + e], 0xFFFF) << "padding request's out written";
        continue;
      }
      std::vector<double> o(ref_out.begin() + n * rows, ref_out.begin() + (n + 1) * rows);
      EXPECT_LE(rel_error(o.data(), out.data() + n * rows, rows), kBar) << "out of request " << n;
      EXPECT_LE(rel_error(ref_state.data() + n * per_request, after.data() + idx[n] * per_request * es, dtype,
                          per_request),
                kBar)
          << "state of request " << n;
    }
    expect_unaddressed_slots_unchanged(before, after, idx, per_request * es);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(d_pool);
  cudaFree(d_idx);
}

INSTANTIATE_TEST_SUITE_P(PoolDtypes, GpuDecodeGraph, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(info.param == DType::kF32 ? "fp32" : "bf16");
                         });

// Many requests from a pool: shuffled slots with padding requests, both pool dtypes and layouts
// (K-major slots compared transposed: the oracle's states are V-major), 1 and 3 tokens a request,
// thousands of blocks; within the bar of the oracle, slots not addressed unchanged.
class GpuDecodePools : public GpuDecode, public ::testing::WithParamInterface<std::tuple<DType, StateLayout>> {};

TEST_P(GpuDecodePools, ManyRequestsMatchTheOracleInBothLayouts) {
  constexpr int64_t N = 160, H = 16, D = 128, P = 2 * N;
  const auto [dtype, layout] = GetParam();
  const size_t es = dtype == DType::kF32 ? 4 : 2;
  const size_t per_request = static_cast<size_t>(H * D * D);
  for (const int64_t T : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << T << " tokens, " << dtype_name(dtype) << " pool");
    ProblemSpec spec;
    spec.B = N, spec.T = T, spec.H = H;
    spec.final_state = false;
    spec.seed = 90 + T;
    RandomProblem host(spec);
    DeviceProblem dev(host);
    std::mt19937 rng(91 + T);
    const std::vector<uint8_t> pool = normal_pool(dtype, static_cast<size_t>(P) * per_request, rng);
    std::vector<int32_t> slots(P);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    std::vector<int32_t> idx(slots.begin(), slots.begin() + N);
    for (int64_t n = 5; n < N; n += 16) idx[n] = -1;  // padding requests
    uint8_t* d_pool = to_device(pool);
    int32_t* d_idx = to_device(idx);
    ForwardArgs a = dev.args();
    a.initial_state = a.final_state = make_tensor(d_pool, dtype, P, H, D, D);
    a.state_indices = make_tensor(d_idx, DType::kI32, N);
    a.state_layout = layout;

    check_cuda(cudaMemset(dev.problem().out, 0xFF, host.out_size() * 2), "poison out");
    forward(a, nullptr, 0, nullptr);
    check_cuda(cudaDeviceSynchronize(), "decode");
    const std::vector<uint16_t> out = to_host(dev.problem().out, host.out_size());
    const std::vector<uint8_t> after = to_host(d_pool, pool.size());

    const Problem ref = pool_reference(host.problem(), pool.data(), dtype, P, idx, layout);
    std::vector<double> ref_out(host.out_size()), ref_state(static_cast<size_t>(N) * per_request);
    oracle_forward(ref, ref_out.data(), ref_state.data());
    const size_t rows = static_cast<size_t>(T * H * D);  // a request's out
    double worst_out = 0, worst_state = 0;
    for (int64_t n = 0; n < N; ++n) {
      if (idx[n] < 0) {
        for (size_t e = 0; e < rows; ++e) ASSERT_EQ(out[n * rows + e], 0xFFFF) << "padding request's out written";
        continue;
      }
      worst_out = std::max(worst_out, rel_error(ref_out.data() + n * rows, out.data() + n * rows, rows));
      // The oracle's states are V-major: a K-major slot is compared transposed.
      std::vector<uint8_t> slot(after.begin() + idx[n] * per_request * es,
                                after.begin() + (idx[n] + 1) * per_request * es);
      if (layout == StateLayout::kKV)
        for (size_t h = 0; h < static_cast<size_t>(H); ++h)
          for (size_t kk = 0; kk < static_cast<size_t>(D); ++kk)
            for (size_t vv = 0; vv < static_cast<size_t>(D); ++vv)
              std::memcpy(slot.data() + ((h * D + vv) * D + kk) * es,
                          after.data() + idx[n] * per_request * es + ((h * D + kk) * D + vv) * es, es);
      worst_state = std::max(worst_state, rel_error(ref_state.data() + n * per_request, slot.data(), dtype, per_request));
    }
    EXPECT_LE(worst_out, kBar);
    EXPECT_LE(worst_state, kBar);
    std::printf("  [gpu vs oracle] pool decode, %lld x %lld tokens, %s pool, %s: out %.2e  state %.2e\n",
                static_cast<long long>(N), static_cast<long long>(T), dtype_name(dtype),
                layout == StateLayout::kVK ? "V-major" : "K-major", worst_out, worst_state);
    expect_unaddressed_slots_unchanged(pool, after, idx, per_request * es);
    cudaFree(d_pool);
    cudaFree(d_idx);
  }
}

INSTANTIATE_TEST_SUITE_P(PoolForms, GpuDecodePools,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(StateLayout::kVK, StateLayout::kKV)),
                         [](const ::testing::TestParamInfo<std::tuple<DType, StateLayout>>& info) {
                           return std::string(std::get<0>(info.param) == DType::kF32 ? "fp32" : "bf16") +
                                  (std::get<1>(info.param) == StateLayout::kVK ? "_VK" : "_KV");
                         });

// Indices nobody checked (SeqlenCheck::kDeviceGuardsOnly): a slot outside the pool is skipped
// in the kernel, never read or written out of bounds (compute-sanitizer runs this); with the
// default check, the same indices are refused before any kernel runs, naming the entry.
TEST_F(GpuDecode, BadDeviceIndicesGuardedOrRefused) {
  constexpr int64_t N = 3, H = 1, D = 128, P = 4;
  ProblemSpec spec;
  spec.B = N, spec.T = 2, spec.H = H;
  spec.final_state = false;
  spec.seed = 80;
  RandomProblem host(spec);
  DeviceProblem dev(host);
  std::vector<float> pool(static_cast<size_t>(P * H * D * D), 0.5f);
  float* d_pool = to_device(pool);
  const std::vector<int64_t> idx = {2, 1000000, 0};
  int64_t* d_idx = to_device(idx);
  ForwardArgs a = dev.args();
  a.initial_state = a.final_state = make_tensor(d_pool, DType::kF32, P, H, D, D);
  a.state_indices = make_tensor(d_idx, DType::kI64, N);
  try {
    forward(a, nullptr, 0, nullptr);
    ADD_FAILURE() << "an index outside the pool was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), ::testing::HasSubstr("state_indices[1] = 1000000 is outside"));
  }
  EXPECT_TRUE(to_host(d_pool, pool.size()) == pool) << "a refused call wrote the pool";
  a.seqlen_check = SeqlenCheck::kDeviceGuardsOnly;
  forward(a, nullptr, 0, nullptr);
  check_cuda(cudaDeviceSynchronize(), "guarded decode");
  const std::vector<float> after = to_host(d_pool, pool.size());
  const size_t per_slot = static_cast<size_t>(H * D * D);
  for (int64_t s : {1, 3})
    EXPECT_EQ(0, std::memcmp(after.data() + s * per_slot, pool.data() + s * per_slot, per_slot * 4)) << "slot " << s;
  EXPECT_NE(0, std::memcmp(after.data() + 2 * per_slot, pool.data() + 2 * per_slot, per_slot * 4))
      << "request 0's slot was not updated";
  cudaFree(d_pool);
  cudaFree(d_idx);
}

}  // namespace
}  // namespace flashkda::testing
