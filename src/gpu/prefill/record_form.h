// Which layout the chunk records take (chunk_record.cuh): the prep kernel writes one form, the
// state pass that reads it was chosen with it (PrefillPlan::records). A plain header: the host
// plan holds the choice.
#pragma once

#include <cstdint>

namespace flashkda::gpu {

enum class RecordForm : int32_t {
  kTf32,   // ChunkRecord: the mma.sync passes' tf32 step (state_step.cuh)
  kWgmma,  // WgmmaRecord: the experimental wgmma pass (state_wgmma_step.cuh)
  kF16,    // F16Record: the 8x1, 4x1 and persistent passes' fp16 step (state_step_f16.cuh)
};

}  // namespace flashkda::gpu
