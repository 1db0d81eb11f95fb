// forward(): validate, find where the tensors live, check cu_seqlens, run the backend.
#include <utility>

#include "api/arguments.h"
#include "api/validate.h"
#include "cpu/cpu_backend.h"
#include "gpu/gpu_backend.h"

namespace flashkda {
namespace {

// All given tensors must live in one place: host memory, or one CUDA device (the current one).
Backend locate_all(const ForwardArgs& a) {
  const char* first_name = nullptr;
  gpu::PointerInfo first;
  for (const TensorArgument& arg : kTensorArguments) {
    const Tensor& t = a.*arg.member;
    if (!t.data) continue;  // absent, or given without elements: nothing to locate
    const gpu::PointerInfo info = gpu::locate(t.data);
    if (!first_name) {
      first_name = arg.name;
      first = info;
      continue;
    }
    if (info.on_device != first.on_device || info.device != first.device) {
      auto where = [](const gpu::PointerInfo& i) {
        return i.on_device ? "CUDA device " + std::to_string(i.device) : std::string("the host");
      };
      fail(ErrorCode::kInvalidArgument, arg.name, ": is on ", where(info), " but ", first_name, " is on ", where(first),
           "; all tensors must be on the same device");
    }
  }
  if (!first.on_device) return Backend::kCpu;
  const int current = gpu::current_device();
  if (first.device != current)
    fail(ErrorCode::kInvalidArgument, first_name, ": tensors are on CUDA device ", first.device,
         " but the current device is ", current, "; make their device current before calling forward");
  return Backend::kCuda;
}

void check_device_sequence_offsets(const Problem& p, SeqlenCheck mode, cudaStream_t stream) {
  if (!p.cu_seqlens || mode == SeqlenCheck::kDeviceGuardsOnly || gpu::stream_is_capturing(stream)) return;
  const size_t bytes = static_cast<size_t>(p.N + 1) * dtype_size(p.cu_seqlens_dtype);
  std::vector<unsigned char> host(bytes);
  gpu::copy_to_host_sync(host.data(), p.cu_seqlens, bytes, stream);
  Problem on_host = p;
  on_host.cu_seqlens = host.data();
  validate_sequence_offsets(host_sequence_offsets(on_host), p.total_tokens);
}

// The CUDA prefill's plan for a validated problem: kernel choice and workspace layout.
gpu::PrefillPlan cuda_plan(const Problem& p) {
  if (p.gate != Gate::kSafe)
    fail(ErrorCode::kUnsupported, "gate: the softplus gate is not supported on the CUDA path yet; "
         "use the safe gate, or host tensors for the CPU backend");
  if (p.state_indices)
    fail(ErrorCode::kUnsupported, "state_indices: state pools are not supported on the CUDA path yet; "
         "pass [N, H, V, K] states, or host tensors for the CPU backend");
  for (const auto& [name, rows] : {std::pair<const char*, const RowStrides&>{"q", p.q_rows}, {"k", p.k_rows},
                                   {"v", p.v_rows}, {"g", p.g_rows}, {"beta", p.beta_rows}})
    if (!rows.dense)
      fail(ErrorCode::kUnsupported, name, ": strided views are not supported on the CUDA path yet; pass a contiguous "
           "tensor, or host tensors for the CPU backend");
  if (p.token_state_indices)
    fail(ErrorCode::kUnsupported, "token_state_indices: per-token states are not supported on the CUDA path yet; "
         "pass host tensors for the CPU backend");
  if (p.checkpoint_offsets)
    fail(ErrorCode::kUnsupported, "checkpoint_offsets: prefix checkpoints are not supported on the CUDA path yet; "
         "pass host tensors for the CPU backend");
  if (p.state_layout != StateLayout::kVK)
    fail(ErrorCode::kUnsupported, "state_layout: the K-major state layout is not supported on the CUDA path yet; "
         "pass V-major [N, H, V, K] states, or host tensors for the CPU backend");
  return gpu::plan_prefill(p);
}

}  // namespace

Backend backend_for(const ForwardArgs& args) { return locate_all(args); }

size_t forward_workspace_size(const ForwardArgs& args) {
  const Problem p = validate_forward(args);
  return locate_all(args) == Backend::kCpu ? 0 : cuda_plan(p).workspace_bytes();
}

void forward(const ForwardArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const Problem p = validate_forward(args);
  if (locate_all(args) == Backend::kCpu) {
    const std::vector<int64_t> offsets = host_sequence_offsets(p);
    if (p.cu_seqlens) validate_sequence_offsets(offsets, p.total_tokens);
    validate_state_slots(p, offsets);
    validate_checkpoint_offsets(p, offsets);
    cpu_forward(p);
    return;
  }
  const gpu::PrefillPlan plan = cuda_plan(p);  // args are validated and located already
  const size_t needed = plan.workspace_bytes();
  if (needed > 0) {
    if (!workspace)
      fail(ErrorCode::kInvalidArgument, "workspace: expected a device buffer of at least ", needed,
           " bytes (see forward_workspace_size), got a null pointer");
    if (workspace_bytes < needed)
      fail(ErrorCode::kInvalidArgument, "workspace: expected at least ", needed, " bytes, got ", workspace_bytes);
    if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
      fail(ErrorCode::kInvalidArgument, "workspace: data pointer must be 256-byte aligned");
    const gpu::PointerInfo info = gpu::locate(workspace);
    if (!info.on_device || info.device != gpu::current_device())
      fail(ErrorCode::kInvalidArgument, "workspace: expected device memory on the current CUDA device");
  }
  check_device_sequence_offsets(p, args.seqlen_check, stream);
  gpu::prefill_forward(p, plan, workspace, stream);
}

}  // namespace flashkda
