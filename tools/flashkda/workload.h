// Workloads for the flashkda tool: the shape of a problem, its random host inputs (the test
// distributions of docs/contract.md), and the ForwardArgs that point at a copy of them (host or device).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "flashkda/flashkda.h"

namespace flashkda::cli {

constexpr int64_t kHeadDim = 128;  // K = V = 128: the size the kernels implement

// Host buffers aligned to 64 bytes (the API wants 16-byte aligned activations and states).
template <typename T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const AlignedAllocator<U>&) const { return true; }
};
template <typename T>
using HostVector = std::vector<T, AlignedAllocator<T>>;

// A host allocation that failed: the message names what was being allocated and how many bytes.
class HostAllocError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "4.29e+12 bytes (4.29 TB)"
std::string format_bytes(double bytes);
// "out of host memory: cannot allocate 4.1e+08 bytes (410 MB) for q ([1, 200000, 8, 128] bf16)"
std::string alloc_failure_message(const std::string& what, double bytes);

// v.resize(n), with a failure (std::bad_alloc, or more elements than a vector can hold) turned
// into a HostAllocError naming `what`.
template <typename Vec>
void resize_or_throw(Vec& v, size_t n, const std::string& what) {
  try {
    v.resize(n);
  } catch (const std::bad_alloc&) {
    throw HostAllocError(alloc_failure_message(what, static_cast<double>(n) * sizeof(typename Vec::value_type)));
  } catch (const std::length_error&) {
    throw HostAllocError(alloc_failure_message(what, static_cast<double>(n) * sizeof(typename Vec::value_type)));
  }
}

enum class StateKind { kNone, kBF16, kF32 };
const char* state_kind_name(StateKind s);

// A state pool (docs/benchmark.md's D cases and pool serving rows): the states live in one pool
// of slots, read and written through int32 indices. The pool holds `index_sets` disjoint sets of
// slots, one per step of the rotation (call i uses set i % index_sets), each naming the N start slots and,
// for speculative verify, N x T more, one per draft token; the slots are shuffled over the pool.
// Without token states the states are updated in place (initial_state == final_state == the
// pool); with them the start slots are only read and the state after token t of sequence n goes
// to its own slot (token_state_indices), with no final state besides.
struct PoolSpec {
  int64_t index_sets = 0;     // 0: no pool, states [N, H, V, K]
  bool token_states = false;  // speculative verify
  bool enabled() const { return index_sets > 0; }
};

// The range of a uniform random parameter, U(lo, hi).
struct UniformRange {
  float lo = 0.0f, hi = 1.0f;
};

struct WorkloadSpec {
  std::vector<int64_t> seq_lens;  // one entry per sequence
  bool batch_form = false;        // equal lengths laid out as [B, T] rows, without cu_seqlens
  int64_t heads = 8;
  Gate gate = Gate::kSafe;
  float lower_bound = -5.0f;
  float scale = 0.08838834764831845f;  // 128^-0.5
  StateKind state = StateKind::kBF16;  // initial state dtype; kNone: no initial state
  bool final_state = true;             // final state written (dtype: the initial state's, bf16 without one)
  DType cu_seqlens_dtype = DType::kI64;
  uint64_t seed = 0;
  PoolSpec pool;  // with a pool: an initial state and final_state are required (token states: batch_form too)
  UniformRange A_log_range, dt_bias_range;  // A_log ~ U(A_log_range), dt_bias ~ U(dt_bias_range)
  // Prefix checkpoints (with a pool): the fp32 state after every `checkpoint_every` tokens of each
  // sequence (a multiple of 16; 0: none), written to checkpoint_state [N, C, H, V, K].
  int64_t checkpoint_every = 0;
};

// The tensor dimensions a spec gives.
struct Shape {
  int64_t B = 0, T = 0, N = 0, H = 0, K = kHeadDim, V = kHeadDim;
  int64_t total_tokens = 0;  // B * T
  bool packed = false;       // cu_seqlens given
  DType state_dtype = DType::kBF16;  // of the final state (and the initial one when given)
  int64_t pool_slots = 0;            // P with a pool (index_sets x slots_per_set), else 0
  int64_t slots_per_set = 0;         // N, or N x (T + 1) with token states
  int64_t written_per_sequence = 0;  // states one call writes per sequence: 1, or T with token states
  int64_t checkpoints = 0;           // C: checkpoint columns (the most any sequence has), else 0
};
Shape shape_of(const WorkloadSpec& spec);

// Bytes of each tensor of a shape. With a pool, initial_state is the whole pool, final_state 0
// (the pool is updated in place), and the index arrays are those of one index set.
struct TensorBytes {
  size_t q = 0, k = 0, v = 0, g = 0, beta = 0, A_log = 0, dt_bias = 0, initial_state = 0, cu_seqlens = 0;
  size_t state_indices = 0, token_state_indices = 0, checkpoint_offsets = 0;
  size_t out = 0, final_state = 0, checkpoint_state = 0;
  size_t slot = 0;  // one slot of the pool (H states), with a pool
  size_t inputs() const {
    return q + k + v + g + beta + A_log + dt_bias + initial_state + cu_seqlens + state_indices + token_state_indices +
           checkpoint_offsets;
  }
  size_t outputs() const { return out + final_state + checkpoint_state; }
};
TensorBytes tensor_bytes(const WorkloadSpec& spec);

// The host memory a run of `spec` holds at its peak, in bytes (doubles: shapes from the command
// line can overflow size_t): the random inputs (q, k, v, g, beta, the initial state, ...) and the
// outputs copied back (out and the final state) throughout; on top of them, first the GPU path's
// staging copy of the outputs, then the fp64 oracle check of `oracle_heads` heads (their inputs,
// and out and the final state in fp64).
struct HostMemory {
  double inputs = 0, outputs = 0, staging = 0, oracle = 0;
  double total() const { return inputs + outputs + (staging > oracle ? staging : oracle); }
};
HostMemory host_memory_needed(const WorkloadSpec& spec, int64_t oracle_heads, bool gpu);

// The host memory available to this process, in bytes (MemAvailable of /proc/meminfo, else the
// physical memory), and where that figure comes from; 0 when unknown.
double host_memory_available(std::string* source);

// Empty when the host can hold a run of `spec`; else the reason, as "the workload needs ... bytes
// of host memory for ... (T = ..., H = ...); ... available".
std::string host_memory_shortfall(const WorkloadSpec& spec, int64_t oracle_heads, bool gpu);

// The bytes a forward must move at least (docs/benchmark.md's floor formula): read q, k, v, g,
// beta and the initial state once, write out and the final state once. With bf16 states in and
// out this is T*H*128*2*5 + T*H*2 + N*H*128*128*2*2. With a pool (s bytes per state element):
// N*H*128*128*s*2 + N*T*H*(128*2*5 + 2), and with token states, which write one state per
// token, N*H*128*128*s*(1 + T) + N*T*H*(128*2*5 + 2). Checkpoints add the fp32 states they
// write, N*C*H*128*128*4.
double floor_bytes(const WorkloadSpec& spec);

// Random host inputs: q, k, v, g ~ N(0,1), beta logit ~ N(0,1), A_log and dt_bias uniform in their
// spec ranges (U(0,1) by default), initial state ~ N(0,1). Deterministic in spec.seed, whatever
// the thread count.
struct HostInputs {
  WorkloadSpec spec;
  Shape shape;
  HostVector<uint16_t> q, k, v, g, beta;  // bf16 bits
  HostVector<float> A_log, dt_bias;
  HostVector<unsigned char> initial_state;  // bf16 or f32, empty without one; with a pool, the pool
  HostVector<unsigned char> cu_seqlens;     // int64 or int32, empty without it
  // With a pool, per index set: the start slots [N] and, with token states, the token slots [N, T].
  std::vector<HostVector<int32_t>> state_indices, token_state_indices;
  // With checkpoints: [N, C], offsets checkpoint_every, 2 x checkpoint_every, ..., -1 (unused)
  // past a sequence's length.
  HostVector<int32_t> checkpoint_offsets;

  // The slots one call on index set `set` writes, in the order [n, t] (the start slots in place,
  // or the token slots); empty without a pool.
  const HostVector<int32_t>& written_slots(int64_t set) const;
};
HostInputs make_host_inputs(const WorkloadSpec& spec);

// The bytes of the slots `slots` of a pool [P, H, V, K] (slot_bytes each), packed one after
// another in the order given: [slots.size(), H, V, K].
HostVector<unsigned char> gather_slots(const unsigned char* pool, const HostVector<int32_t>& slots, size_t slot_bytes);

// Where each tensor of one forward call lives (host or device).
struct TensorPointers {
  const void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
  const void *A_log = nullptr, *dt_bias = nullptr, *initial_state = nullptr, *cu_seqlens = nullptr;
  const void *state_indices = nullptr, *token_state_indices = nullptr;  // with a pool
  const void* checkpoint_offsets = nullptr;                              // with checkpoints
  void* out = nullptr;
  void* checkpoint_state = nullptr;  // with checkpoints
  void* final_state = nullptr;  // with a pool: the pool, the initial state's buffer
};
// The host inputs; with a pool, index set `set`'s indices and the pool as given (not a copy).
TensorPointers host_input_pointers(const HostInputs& in, int64_t set = 0);
ForwardArgs make_forward_args(const WorkloadSpec& spec, const TensorPointers& p);

// "3 sequences [300, 157, 512] (969 tokens)" and the like.
std::string describe_sequences(const std::vector<int64_t>& seq_lens);
std::string join(const std::vector<int64_t>& values, const char* sep = ", ");

// Runs fn(begin, end) over [0, n) split across the machine's hardware threads.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace flashkda::cli
