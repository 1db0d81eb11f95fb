// Where each sequence's state lives on the device: slot tables read by the kernels of both
// jobs (the chunked prefill's state pass and the recurrent kernel).
#pragma once

#include <cstdint>

namespace flashkda::gpu {

// An int32 or int64 index array on the device; null: absent.
struct IndexView {
  const void* data = nullptr;
  bool i32 = false;

  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return i32 ? static_cast<int64_t>(__ldg(static_cast<const int32_t*>(data) + i))
               : static_cast<int64_t>(__ldg(static_cast<const int64_t*>(data) + i));
  }
};

// The slots of the sequences' initial and final states (docs/contract.md, Serving). Without
// indices sequence n uses slot n. A slot outside its pool is never touched: the host checks the
// indices unless told not to (SeqlenCheck::kDeviceGuardsOnly, graph capture), so only unchecked
// bad values reach here, and they must not reach outside a tensor.
struct StateSlotTable {
  IndexView initial;        // [N]: start slots; negative: padding (the sequence is skipped)
  IndexView final;          // [N]: final slots (absent: the start slot); negative: not written
  int64_t initial_slots;    // slots of initial_state (0 when absent)
  int64_t final_slots;      // slots of final_state (0 when absent)

  __device__ __forceinline__ int64_t start(int64_t n) const { return initial.data ? initial[n] : n; }
  // The sequence runs: not padding, and its start slot inside the pool when there is one.
  __device__ __forceinline__ bool runs(int64_t start_slot, bool has_initial) const {
    return start_slot >= 0 && (!has_initial || start_slot < initial_slots);
  }
  // Its final slot, or -1 for none (also for one outside the pool).
  __device__ __forceinline__ int64_t final_slot(int64_t n, int64_t start_slot) const {
    const int64_t f = final.data ? final[n] : start_slot;
    return f >= 0 && f < final_slots ? f : -1;
  }
};

// Prefix checkpoints: entry [n, c] asks for sequence n's state after offsets[n, c] tokens (a
// multiple of 16; negative: unused), written fp32 to states[n, c] in the state layout.
struct CheckpointTable {
  IndexView offsets;  // [N, count]
  int64_t count = 0;  // C; 0: no checkpoints
  float* states = nullptr;  // [N, C, H, 128, 128]

  // The first boundary b of `chunk`-token chunks with c < b <= end that an entry of sequence n
  // asks for (offset b * chunk), else end: a state pass runs chunks c .. b - 1 without a look at
  // the table, then stores the state.
  __device__ __forceinline__ int next_boundary(int64_t n, int c, int end, int chunk) const {
    int stop = end;
    for (int64_t e = 0; e < count; ++e) {
      const int64_t b = offsets[n * count + e] / chunk;  // offsets are multiples of chunk; negative: unused
      if (b > c && b < stop) stop = static_cast<int>(b);
    }
    return stop;
  }

  // Calls store(entry) for every entry of sequence n at `tokens` tokens, entry = n * C + c.
  template <typename Store>
  __device__ __forceinline__ void at(int64_t n, int64_t tokens, Store&& store) const {
    for (int64_t c = 0; c < count; ++c)
      if (offsets[n * count + c] == tokens) store(n * count + c);
  }
};

}  // namespace flashkda::gpu
