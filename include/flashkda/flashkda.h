// FlashKDA public C++ API: Kimi Delta Attention forward (prefill) over raw pointers.
//
// All tensors are dense, contiguous and row-major. Shapes follow ../docs/architecture.md and
// the contract (docs/contract.md): activations tokens-major [B, T, H, D], state V-major [N, H, V, K].
// Host pointers run on the CPU backend; device pointers on the CUDA path. forward() never
// allocates device memory: query forward_workspace_size() and pass a buffer that large.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

// Same declaration as the CUDA runtime's, so this header needs no CUDA include.
typedef struct CUstream_st* cudaStream_t;

namespace flashkda {

enum class DType : int32_t { kBF16 = 0, kF32 = 1, kI32 = 2, kI64 = 3, kF16 = 4, kF64 = 5 };
enum class Gate : int32_t {
  kSafe = 0,      // a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
  kSoftplus = 1,  // a = -exp(A_log) * softplus(g + dt_bias)
};
enum class Backend : int32_t { kNone = 0, kCpu = 1, kCuda = 2 };
// How a state tensor lays out one head's state: V-major [.., V, K] (this library's and
// flash_kda's) or K-major [.., K, V] (fla's recurrent kernels). Applies to initial_state and
// final_state alike.
enum class StateLayout : int32_t { kVK = 0, kKV = 1 };

constexpr int kMaxDims = 5;  // the most dimensions a tensor argument has (checkpoint_state)

const char* dtype_name(DType t);
size_t dtype_size(DType t);

// A view of a tensor. A default Tensor (no data, no dimensions) means "not given" for optional
// tensors; a tensor with dimensions is given even when it has no elements (an empty framework
// tensor has a null data pointer), and is then checked like any other. Strides are in elements;
// all zero (the default) means dense row-major. q, k, v, g and beta may be strided views (slices
// of a fused projection: the last dimension contiguous, the others any non-negative stride);
// every other argument is dense.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kBF16;
  int32_t ndim = 0;
  int64_t shape[5] = {0, 0, 0, 0, 0};    // up to kMaxDims
  int64_t strides[5] = {0, 0, 0, 0, 0};  // elements; all zero: dense row-major

  bool given() const { return data != nullptr || ndim > 0; }
  bool dense() const;              // no strides given, or exactly the row-major ones
  int64_t stride(int i) const;     // dimension i's stride in elements (the row-major one when dense)
  int64_t numel() const;
};

// Convenience constructors.
Tensor make_tensor(const void* data, DType dtype, int64_t d0);
Tensor make_tensor(const void* data, DType dtype, int64_t d0, int64_t d1);
Tensor make_tensor(const void* data, DType dtype, int64_t d0, int64_t d1, int64_t d2);
Tensor make_tensor(const void* data, DType dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3);
Tensor make_tensor(const void* data, DType dtype, int64_t d0, int64_t d1, int64_t d2, int64_t d3, int64_t d4);
// A strided view: ndim dimensions of the given shape and strides (elements).
Tensor make_strided_tensor(const void* data, DType dtype, int ndim, const int64_t* shape, const int64_t* strides);

// How forward() checks cu_seqlens that live on the device.
enum class SeqlenCheck : int32_t {
  // Copy cu_seqlens to the host and validate (a stream synchronisation), except while the
  // stream is being captured into a CUDA graph, where only the device-side guards apply.
  kHost = 0,
  // No host copy, no synchronisation. Kernels still clamp every sequence to [0, T] so bad
  // values never cause an out-of-bounds access, but the result is then undefined.
  kDeviceGuardsOnly = 1,
};

struct ForwardArgs {
  Tensor q;              // [B, T, H, K] bf16
  Tensor k;              // [B, T, H, K] bf16
  Tensor v;              // [B, T, H, V] bf16
  Tensor g;              // [B, T, H, K] bf16, gate before activation
  Tensor beta;           // [B, T, H]    bf16, logit (sigmoid inside)
  Tensor A_log;          // [H]          f32
  Tensor dt_bias;        // [H, K]       f32
  Tensor initial_state;  // [N, H, V, K] bf16 or f32, optional ([P, H, V, K] pool with state_indices)
  Tensor cu_seqlens;     // [N + 1]      i64 or i32, optional (then B == 1)
  Tensor out;            // [B, T, H, V] bf16, written
  Tensor final_state;    // [N, H, V, K] bf16 or f32, optional, written ([P, H, V, K] pool with state_indices)
  // State pools (optional; the CPU backend so far). With state_indices, initial_state and
  // final_state are pools of slots, [P, H, V, K] (or [P, H, K, V], state_layout), and may be one
  // buffer (updated in place). Sequence n starts from slot state_indices[n] (zero without an
  // initial_state) and its final state goes to slot final_state_indices[n], or to the same slot
  // without final_state_indices. A negative state index marks padding: the sequence is skipped
  // and nothing is written for it (out rows included); a negative final index: its final state
  // is not written. Slots not written are left as they were. Two sequences may not write one
  // slot, nor write a slot another one reads from the same buffer.
  Tensor state_indices;        // [N] i64 or i32
  Tensor final_state_indices;  // [N] i64 or i32, needs state_indices
  StateLayout state_layout = StateLayout::kVK;
  // Prefix checkpoints (optional, together; the CPU backend so far): the state of sequence n after
  // its first checkpoint_offsets[n, c] tokens goes to checkpoint_state[n, c], equal to the final
  // state of a prefill of those tokens from the same initial state. Offsets are multiples of 16,
  // at most the sequence's length, non-decreasing along c; a negative offset is an unused entry
  // (its checkpoint is not written). Written on the way, in the state layout.
  Tensor checkpoint_offsets;   // [N, C] i64 or i32
  Tensor checkpoint_state;     // [N, C, H, V, K] f32, written
  // Per-token states (speculative verify, as the Triton decode kernel writes draft states;
  // optional, with state_indices; the CPU backend so far): the state after token t of sequence n
  // goes to slot token_state_indices[n, t] of final_state (a pool); a negative entry is not
  // written. The sequences' final states are then written only where final_state_indices says.
  // Each sequence has at most T_max tokens.
  Tensor token_state_indices;  // [N, T_max] i64 or i32
  float lower_bound = -5.0f;  // safe gate only, in [-5, 0)
  float scale = 0.0f;         // output scale, usually K^-0.5; must be finite and > 0
  Gate gate = Gate::kSafe;
  SeqlenCheck seqlen_check = SeqlenCheck::kHost;
};

enum class ErrorCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // a tensor or scalar breaks the contract
  kUnsupported = 2,      // valid by the contract, not implemented on this backend yet
  kNoDevice = 3,         // device pointers given but no usable CUDA device / not built with CUDA
  kCudaError = 4,        // a CUDA runtime call failed
  kInternal = 5,
};

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

// Which backend forward() would use for these arguments (host pointers: CPU; device: CUDA).
// Throws Error on mixed or unusable pointer locations.
Backend backend_for(const ForwardArgs& args);

// Bytes of workspace forward() needs for these shapes (0 on the CPU backend). Validates args.
size_t forward_workspace_size(const ForwardArgs& args);

// Runs KDA forward. Validates every argument first and throws Error naming the argument, the
// expectation and the value given. On the CUDA path the work is enqueued on `stream`
// (no device allocation; a host synchronisation only for SeqlenCheck::kHost, see above).
void forward(const ForwardArgs& args, void* workspace, size_t workspace_bytes,
             cudaStream_t stream = nullptr);

// Runtime information.
bool cuda_compiled();          // the library was built with its CUDA kernels
int cuda_device_count();       // usable CUDA devices (0 when none or no driver)
std::string cuda_device_name(); // name of the current device, "" when none
const char* version();

}  // namespace flashkda
