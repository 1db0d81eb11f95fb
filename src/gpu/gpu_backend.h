// What the host-side dispatch needs from the CUDA side. Implemented by gpu/launch/*.cu when the
// library is built with CUDA, and by api/no_cuda.cpp otherwise (no device, clear errors).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "common/problem.h"
#include "gpu/prefill/record_form.h"

namespace flashkda::gpu {

struct PointerInfo {
  bool on_device = false;  // device (or managed) memory
  int device = -1;         // its CUDA device when on_device
};

PointerInfo locate(const void* ptr);
int device_count();
int current_device();
std::string device_name();
bool stream_is_capturing(cudaStream_t stream);
// Copies each `bytes` from device memory to the host and waits for them all, once (ordered after
// `stream`).
struct HostCopy {
  void* dst;
  const void* src;
  size_t bytes;
};
void copy_to_host_sync(const std::vector<HostCopy>& copies, cudaStream_t stream);

// What the CUDA prefill runs for one problem: every launcher decision (state-pass form and
// layout, the FLASHKDA_* overrides read once, the workspace layout), made once per call by
// plan_prefill() and then only read. Throws kUnsupported for problems the kernels do not take.
struct PrefillPlan {
  enum class Pass : int32_t {
    kPerItem,     // one block per (sequence, head, value slices) (state_kernel.cu)
    kPersistent,  // a block per multiprocessor taking (sequence, head) items (state_persistent_kernel.cu)
    kSplit,       // one long sequence cut in S segments, then stitched (stitch_kernel.cu)
    kWgmma,       // experimental, FLASHKDA_STATE_WGMMA=1 only: per item on wgmma (state_wgmma_kernel.cu)
    kFused,       // prep and chain in one chunk-64 kernel, a block a (sequence, head) (fused_kernel.cu)
  };
  Pass pass = Pass::kPerItem;
  int value_slices = 8, key_parts = 1;  // state-pass layout (StateConfig in prefill/kernels.h)
  int multiprocessors = 0;
  int split_segments = 0;        // kSplit: S segments, 2S - 1 runs at once
  bool split_compact = false;    // kSplit: 3-stage blocks, two a multiprocessor
  bool split_wgmma = false;      // kSplit: the runs on the wgmma pass, a block a head and run
  // kSplit: the runs on the fused prefill instead, a block a head and run, chunks of 64 tokens
  // (FusedParams::split_runs; no prep kernel, no records; FLASHKDA_SPLIT_FUSED=0: the wgmma runs)
  bool split_fused = false;
  // kSplit, split_fused: a segment's two runs as a cluster that prepares each chunk once
  // (FusedParams::split_shared; S with 2 S H blocks in one wave; FLASHKDA_SPLIT_SHARED=1, not yet run on a GPU)
  bool split_shared = false;
  // kSplit: the segment states chained in one launch (StitchChain; FLASHKDA_STITCH_CHAIN=0: one
  // launch a step instead)
  bool stitch_chain_launch = true;
  // kSplit: the out rows by at most a block a multiprocessor keeping M across tiles
  // (launch_stitch_rows; FLASHKDA_STITCH_ROWS=0: a block a tile instead)
  bool stitch_rows_kept = true;
  // kSplit: the out rows' products in 3xTF32 (FLASHKDA_STITCH_3XTF32=1), else 2xTF32 (out_a
  // rounded to tf32 once; StitchParams::x_split)
  bool stitch_rows_3xtf32 = false;
  // kSplit, kept rows in 2xTF32: the products on wgmma (StitchParams::rows_wgmma;
  // FLASHKDA_STITCH_ROWS_WGMMA=0: on mma.sync, bit for bit the one-tile blocks' results)
  bool stitch_rows_wgmma = true;
  // kFused: the elementwise pass's channel groups (of 16) taken by the prep warpgroup beside the
  // step, then by the first math warpgroup's end (FusedParams::split; FLASHKDA_FUSED_SPLIT=a:b).
  // 8, 4, 4: the prep warpgroup's share runs beside the step, the math warpgroups' after it
  // (docs/perf-notes.md, "Reads before stores": 1.4-1.6% under 6:11 at P1, P3, P6 on an H100, fc8f924).
  int fused_split[2] = {8, 12};
  bool fused_longest_first = false;  // kFused: blocks take the sequences longest first (FusedParams)
  bool fused_pair = false;           // kFused: two blocks an item (FusedParams::pair; FLASHKDA_FUSED_PAIR=0 / 1)
  bool fused_pair_prefetch = false;  // kFused pair: inputs into the L2 a chunk ahead (FLASHKDA_FUSED_PAIR_PREFETCH=1; measured no better)
  int prep_blocks_per_sm = 0;    // FLASHKDA_PREP_BLOCKS_PER_SM (an occupancy experiment; 0: unrestricted)
  // kPerItem on 8x1, kSplit on wgmma (one sequence): the prep tail (PrepTail in prefill/kernels.h)
  // takes the last tail_per_segment chunks of the sequence (kSplit: of each segment) on tail_sms
  // multiprocessors the state grid leaves idle; 0: no tail.
  int tail_per_segment = 0;
  int tail_sms = 0;
  // The state pass starts programmatically after the prep grid (StateParams::after_prep;
  // starts_after_prep in prefill_launch.cu says where). FLASHKDA_STATE_PDL=0: never.
  bool state_after_prep = false;
  // The 8x1 and 4x1 per-item (with or without the prep tail or serving features) and persistent
  // passes on the fp16 step (F16Records, state_step_f16.cuh); FLASHKDA_STATE_F16=0: the tf32 step
  // (ChunkRecords).
  bool state_f16 = false;
  // Workspace, in this order: chunk records, then the persistent pass's item counter or the
  // split pass's fp32 buffers (3 (S - 1) [H, 128, 128] states, two [total, H, 128] row sets),
  // then the prep tail's hand-off (tail_offset()).
  // counter_bytes: the persistent pass's item counter (128 bytes), then its sequence order ([N] int32, or none)
  // tail_bytes: the prep tail's counters and ready flags
  size_t record_bytes = 0, counter_bytes = 0, split_state_bytes = 0, split_row_bytes = 0, tail_bytes = 0;

  // The records in WgmmaRecord's layout (the wgmma state pass reads them), else ChunkRecord's.
  bool wgmma_records() const { return pass == Pass::kWgmma || split_wgmma; }
  // The layout the prep kernel writes and the state pass reads.
  RecordForm records() const { return wgmma_records() ? RecordForm::kWgmma : state_f16 ? RecordForm::kF16 : RecordForm::kTf32; }

  size_t workspace_bytes() const {
    const size_t states = split_segments > 0 ? 3 * static_cast<size_t>(split_segments - 1) : 0;
    return record_bytes + counter_bytes + states * split_state_bytes + 2 * split_row_bytes + tail_bytes;
  }
  // The prep tail's region: the workspace's last bytes, after the split pass's buffers, which its
  // runs write while the tail still takes chunks (128-byte aligned: every region before it is).
  size_t tail_offset() const { return workspace_bytes() - tail_bytes; }
};

// The chunked prefill kernels (K = V = 128, safe gate, V-major [N, H, V, K] states, dense inputs).
PrefillPlan plan_prefill(const Problem& p);
// The same decisions for a GPU of `multiprocessors` multiprocessors, with no device needed (the
// plan reads shapes, flags and FLASHKDA_* overrides only): tests/gpu/test_prefill_plan.cpp pins
// the benchmark cases' choices on the H200's 132.
PrefillPlan plan_prefill(const Problem& p, int multiprocessors);
void prefill_forward(const Problem& p, const PrefillPlan& plan, void* workspace, cudaStream_t stream);

// The recurrent kernel (gpu/decode/): the per-token definition with the state in registers, one
// pass over each state. Takes everything the contract allows (pools in either layout and dtype,
// per-token states, checkpoints, strided inputs, both gates); needs no workspace.
void recurrent_forward(const Problem& p, cudaStream_t stream);

// Which CUDA kernels run a problem, decided once per call from its shapes and the features it
// uses, never from device data: forward_workspace_size() agrees with forward(), and a call being
// captured into a CUDA graph takes the same kernels as one that is not.
struct CudaPlan {
  enum class Kernels : int32_t {
    kChunkedPrefill,  // prompts: prep + state pass (gpu/prefill/)
    kRecurrent,       // decode-shaped calls, and the features the chunked prefill does not take yet
  };
  Kernels kernels = Kernels::kChunkedPrefill;
  PrefillPlan prefill;  // kChunkedPrefill only

  size_t workspace_bytes() const { return kernels == Kernels::kRecurrent ? 0 : prefill.workspace_bytes(); }
};
CudaPlan plan_cuda(const Problem& p);
void cuda_forward(const Problem& p, const CudaPlan& plan, void* workspace, cudaStream_t stream);

}  // namespace flashkda::gpu
