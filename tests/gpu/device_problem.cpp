#include "device_problem.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>
#include <string>

namespace flashkda::testing {
namespace {

constexpr size_t kGuardBytes = 256;
constexpr uint8_t kGuardPattern = 0x5A;

}  // namespace

void check_cuda(int err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(static_cast<cudaError_t>(err)));
}

DeviceProblem::DeviceProblem(const RandomProblem& host) {
  const Problem& h = host.problem();
  p_ = h;
  const size_t tokens = static_cast<size_t>(h.total_tokens), H = static_cast<size_t>(h.H);
  const size_t qk_bytes = tokens * H * h.K * 2, v_bytes = tokens * H * h.V * 2;
  const size_t state_elems = static_cast<size_t>(h.N) * H * h.V * h.K;
  p_.q = static_cast<const uint16_t*>(upload(h.q, qk_bytes));
  p_.k = static_cast<const uint16_t*>(upload(h.k, qk_bytes));
  p_.v = static_cast<const uint16_t*>(upload(h.v, v_bytes));
  p_.g = static_cast<const uint16_t*>(upload(h.g, qk_bytes));
  p_.beta = static_cast<const uint16_t*>(upload(h.beta, tokens * H * 2));
  p_.A_log = static_cast<const float*>(upload(h.A_log, H * 4));
  p_.dt_bias = static_cast<const float*>(upload(h.dt_bias, H * h.K * 4));
  if (h.initial_state)
    p_.initial_state = upload(h.initial_state, state_elems * dtype_size(h.initial_state_dtype));
  if (h.cu_seqlens)
    p_.cu_seqlens = upload(h.cu_seqlens, static_cast<size_t>(h.N + 1) * dtype_size(h.cu_seqlens_dtype));
  out_bytes_ = v_bytes;
  p_.out = static_cast<uint16_t*>(alloc_guarded(out_bytes_));
  if (h.final_state) {
    final_bytes_ = state_elems * dtype_size(h.final_state_dtype);
    p_.final_state = alloc_guarded(final_bytes_);
  }
}

DeviceProblem::~DeviceProblem() {
  for (void* ptr : allocations_) cudaFree(ptr);
  cudaFree(workspace_);
}

void* DeviceProblem::upload(const void* host, size_t bytes) {
  void* dev = nullptr;
  check_cuda(cudaMalloc(&dev, bytes + 16), "cudaMalloc input");
  allocations_.push_back(dev);
  if (bytes) check_cuda(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy input");
  return dev;
}

void* DeviceProblem::alloc_guarded(size_t bytes) {
  void* dev = nullptr;
  check_cuda(cudaMalloc(&dev, bytes + kGuardBytes), "cudaMalloc output");
  allocations_.push_back(dev);
  return dev;
}

void DeviceProblem::poison_outputs() {
  check_cuda(cudaMemset(p_.out, 0xFF, out_bytes_), "poison out");
  check_cuda(cudaMemset(static_cast<uint8_t*>(static_cast<void*>(p_.out)) + out_bytes_, kGuardPattern, kGuardBytes),
             "guard out");
  if (p_.final_state) {
    check_cuda(cudaMemset(p_.final_state, 0xFF, final_bytes_), "poison final_state");
    check_cuda(cudaMemset(static_cast<uint8_t*>(p_.final_state) + final_bytes_, kGuardPattern, kGuardBytes),
               "guard final_state");
  }
}

DeviceProblem::Outputs DeviceProblem::run_fresh(cudaStream_t stream) {
  poison_outputs();
  run(stream);
  return {out(), final_state()};
}

void DeviceProblem::run(cudaStream_t stream) {
  const ForwardArgs a = args();
  const size_t need = forward_workspace_size(a);
  if (need > workspace_bytes_) {
    cudaFree(workspace_);
    workspace_ = nullptr;
    check_cuda(cudaMalloc(&workspace_, need), "cudaMalloc workspace");
    workspace_bytes_ = need;
  }
  forward(a, workspace_, workspace_bytes_, stream);
  check_cuda(cudaStreamSynchronize(stream), "forward");
}

bool DeviceProblem::guards_intact() const {
  auto intact = [](const void* end) {
    std::vector<uint8_t> guard(kGuardBytes);
    check_cuda(cudaMemcpy(guard.data(), end, kGuardBytes, cudaMemcpyDeviceToHost), "read guard");
    for (uint8_t b : guard)
      if (b != kGuardPattern) return false;
    return true;
  };
  bool ok = intact(reinterpret_cast<const uint8_t*>(p_.out) + out_bytes_);
  if (p_.final_state) ok = ok && intact(static_cast<const uint8_t*>(p_.final_state) + final_bytes_);
  return ok;
}

std::vector<uint16_t> DeviceProblem::out() const {
  std::vector<uint16_t> host(out_bytes_ / 2);
  check_cuda(cudaMemcpy(host.data(), p_.out, out_bytes_, cudaMemcpyDeviceToHost), "read out");
  return host;
}

std::vector<uint8_t> DeviceProblem::final_state() const {
  std::vector<uint8_t> host(final_bytes_);
  if (final_bytes_)
    check_cuda(cudaMemcpy(host.data(), p_.final_state, final_bytes_, cudaMemcpyDeviceToHost), "read final_state");
  return host;
}

}  // namespace flashkda::testing
