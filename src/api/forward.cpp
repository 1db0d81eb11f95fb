// forward(): validate, find where the tensors live, check the index arrays, run the backend.
#include <vector>

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

// The index arrays forward() checks on the host: cu_seqlens, the state indices, the checkpoint
// offsets. On the CUDA path they are copied to the host (one synchronisation for all of them),
// except with SeqlenCheck::kDeviceGuardsOnly or while the stream is captured into a CUDA graph,
// where only the kernels' guards apply (bad values never reach outside a tensor).
void check_indices(const Problem& p, bool on_device, SeqlenCheck mode, cudaStream_t stream) {
  const bool any = p.cu_seqlens || p.state_indices || p.checkpoint_offsets;
  if (on_device && (!any || mode == SeqlenCheck::kDeviceGuardsOnly || gpu::stream_is_capturing(stream))) return;
  Problem host = p;
  std::vector<std::vector<unsigned char>> buffers;  // an inner vector's data stays put when the outer one grows
  if (on_device) {
    std::vector<gpu::HostCopy> copies;
    auto to_host = [&](const void*& field, DType dtype, int64_t count) {
      if (!field) return;
      buffers.emplace_back(static_cast<size_t>(count) * dtype_size(dtype));
      copies.push_back({buffers.back().data(), field, buffers.back().size()});
      field = buffers.back().data();
    };
    to_host(host.cu_seqlens, p.cu_seqlens_dtype, p.N + 1);
    to_host(host.state_indices, p.state_indices_dtype, p.N);
    to_host(host.final_state_indices, p.final_state_indices_dtype, p.N);
    to_host(host.token_state_indices, p.token_state_indices_dtype, p.N * p.token_state_columns);
    to_host(host.checkpoint_offsets, p.checkpoint_offsets_dtype, p.N * p.checkpoints);
    gpu::copy_to_host_sync(copies, stream);
  }
  const std::vector<int64_t> offsets = host_sequence_offsets(host);
  if (host.cu_seqlens) validate_sequence_offsets(offsets, p.total_tokens);
  validate_state_slots(host, offsets);
  validate_checkpoint_offsets(host, offsets);
}

}  // namespace

Backend backend_for(const ForwardArgs& args) { return locate_all(args); }

size_t forward_workspace_size(const ForwardArgs& args) {
  const Problem p = validate_forward(args);
  return locate_all(args) == Backend::kCpu ? 0 : gpu::plan_cuda(p).workspace_bytes();
}

void forward(const ForwardArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const Problem p = validate_forward(args);
  if (locate_all(args) == Backend::kCpu) {
    check_indices(p, false, args.seqlen_check, stream);
    cpu_forward(p);
    return;
  }
  const gpu::CudaPlan plan = gpu::plan_cuda(p);  // args are validated and located already
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
  check_indices(p, true, args.seqlen_check, stream);
  gpu::cuda_forward(p, plan, workspace, stream);
}

}  // namespace flashkda
