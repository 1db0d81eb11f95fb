// The WgmmaRecord layout (gpu/prefill/chunk_record.cuh) on the host, no device needed: every
// field's element offsets fill the field exactly once, in the record and in a stage, and each
// element sits where the wgmma state pass reads it. The pass reads B tile k-step st of a field as
// [rows][8 slots] through a descriptor (leading offset 128 bytes along the slots, stride 256
// along the rows, or kGroupBytes for Wk and Qe: checked on the device by test_wgmma_gpu and
// test_wgmma_step_gpu), and slot s stands for k-step element s (an A operand loaded in order: V^T
// against W) or for element 2 s / 2 (s - 4) + 1 (an A operand taken from a D fragment: S^T
// against Wk and Qe, U^T against Kr, WV^T against M).
#include <gtest/gtest.h>

#include <set>

#include "gpu/prefill/chunk_record.cuh"

namespace flashkda::testing {
namespace {

using gpu::WgmmaRecord;

constexpr int kT = 16, kD = 128;

int element_of_slot(int s) { return s < 4 ? 2 * s : 2 * (s - 4) + 1; }  // the D -> A order (mma.cuh)

// Offset of (row, slot) of k-step st of a field at `base` whose tiles are `tile_bytes` apart.
uint32_t read_offset(uint32_t base, uint32_t tile_bytes, int st, int row, int slot) {
  return base + st * tile_bytes + gpu::wgmma_tile_offset(row, slot);
}

TEST(WgmmaRecord, PermutedSlotsInvertTheAOrder) {
  for (int s = 0; s < 8; ++s) EXPECT_EQ(gpu::permuted_slot(element_of_slot(s)), s);
}

TEST(WgmmaRecord, EveryFieldIsFilledOnceInsideItsRange) {
  struct Field {
    const char* name;
    uint32_t begin, end;
    std::vector<uint32_t> offsets;
    uint32_t element_bytes = 4;
  };
  std::vector<Field> fields = {{"wk", WgmmaRecord::kWk, WgmmaRecord::kKr, {}},
                               {"kr", WgmmaRecord::kKr, WgmmaRecord::kW, {}},
                               {"w", WgmmaRecord::kW, WgmmaRecord::kM, {}},
                               {"m", WgmmaRecord::kM, WgmmaRecord::kDecay, {}},
                               {"qe (bf16)", WgmmaRecord::kQe, WgmmaRecord::kBytes, {}, 2},
                               {"qe in a stage (fp32)", WgmmaRecord::kStageQe,
                                WgmmaRecord::kStageQe + WgmmaRecord::kStageShift, {}}};
  for (int t = 0; t < kT; ++t)
    for (int k = 0; k < kD; ++k) {
      fields[0].offsets.push_back(WgmmaRecord::wk(t, k));
      fields[1].offsets.push_back(WgmmaRecord::kr(t, k));
      fields[4].offsets.push_back(WgmmaRecord::qe(t, k));
      fields[5].offsets.push_back(WgmmaRecord::stage_qe(t, k));
    }
  for (int t = 0; t < kT; ++t)
    for (int tp = 0; tp < kT; ++tp) {
      fields[2].offsets.push_back(WgmmaRecord::w(0, t, tp));
      fields[2].offsets.push_back(WgmmaRecord::w(1, t, tp));
      fields[3].offsets.push_back(WgmmaRecord::m(t, tp));
    }
  for (const Field& f : fields) {
    SCOPED_TRACE(f.name);
    const std::set<uint32_t> unique(f.offsets.begin(), f.offsets.end());
    EXPECT_EQ(unique.size(), f.offsets.size()) << "two elements share a place";
    EXPECT_EQ(f.offsets.size() * f.element_bytes, f.end - f.begin) << "the field is not filled exactly";
    for (uint32_t o : f.offsets) {
      EXPECT_EQ(o % f.element_bytes, 0u);
      EXPECT_GE(o, f.begin);
      EXPECT_LT(o, f.end);
    }
  }
}

TEST(WgmmaRecord, ElementsSitWhereThePassReadsThem) {
  // [Wk | Qe] in a stage: one B operand of 32 rows a k-step over k, permuted (A = S^T), its 8-row
  // groups kGroupBytes apart (the descriptor's stride), Wk's two then Qe's two
  auto xo_read = [](int st, int row, int slot) {
    return 256u * st + (row / 8) * WgmmaRecord::kGroupBytes + gpu::wgmma_tile_offset(row % 8, slot);
  };
  for (int st = 0; st < kD / 8; ++st)
    for (int t = 0; t < kT; ++t)
      for (int s = 0; s < 8; ++s) {
        ASSERT_EQ(WgmmaRecord::in_stage(WgmmaRecord::wk(t, 8 * st + element_of_slot(s))), xo_read(st, t, s));
        ASSERT_EQ(WgmmaRecord::stage_qe(t, 8 * st + element_of_slot(s)), xo_read(st, kT + t, s));
      }
  for (int st = 0; st < 2; ++st)  // Kr: rows k, k-steps over tokens, permuted (A = U^T)
    for (int k = 0; k < kD; ++k)
      for (int s = 0; s < 8; ++s)
        ASSERT_EQ(WgmmaRecord::kr(8 * st + element_of_slot(s), k), read_offset(WgmmaRecord::kKr, WgmmaRecord::kChannelTile, st, k, s));
  for (int st = 0; st < 2; ++st)  // W: rows t, k-steps over t' in order (A = V^T, loaded); M permuted (A = WV^T)
    for (int t = 0; t < kT; ++t)
      for (int s = 0; s < 8; ++s) {
        ASSERT_EQ(WgmmaRecord::w(0, t, 8 * st + s), read_offset(WgmmaRecord::kW, WgmmaRecord::kTokenTile, st, t, s));
        ASSERT_EQ(WgmmaRecord::w(1, t, 8 * st + s), read_offset(WgmmaRecord::kW + 2 * WgmmaRecord::kTokenTile, WgmmaRecord::kTokenTile, st, t, s));
        ASSERT_EQ(WgmmaRecord::m(t, 8 * st + element_of_slot(s)), read_offset(WgmmaRecord::kM, WgmmaRecord::kTokenTile, st, t, s));
      }
}

// In a stage the record's fields from Kr on sit past the room for Qe in fp32, in their order.
TEST(WgmmaRecord, StageKeepsTheRecordAroundQesRoom) {
  EXPECT_EQ(WgmmaRecord::in_stage(WgmmaRecord::wk(kT - 1, kD - 1)), WgmmaRecord::wk(kT - 1, kD - 1));
  EXPECT_EQ(WgmmaRecord::in_stage(WgmmaRecord::kKr), WgmmaRecord::kStageQe + WgmmaRecord::kStageShift);
  EXPECT_EQ(WgmmaRecord::in_stage(WgmmaRecord::kBytes), WgmmaRecord::kStageBytes);
  EXPECT_EQ(WgmmaRecord::kStageQe, WgmmaRecord::kGroups * WgmmaRecord::kGroupBytes);  // Qe's groups follow Wk's
}

// Qe's widening reads a k-step's 8 channels of one token as 16 bytes, the 8 tokens of a group
// 128 contiguous bytes, and writes the even channels' fp32 as one float4, the odd ones' 128
// bytes on.
TEST(WgmmaRecord, QeRunsForTheWidening) {
  for (int t = 0; t < kT; ++t)
    for (int st = 0; st < kD / 8; ++st) {
      for (int e = 0; e < 8; ++e) {
        ASSERT_EQ(WgmmaRecord::qe(t, 8 * st + e), WgmmaRecord::qe(t, 8 * st) + 2 * e);
        ASSERT_EQ(WgmmaRecord::stage_qe(t, 8 * st + e), WgmmaRecord::stage_qe(t, 8 * st) + 128 * (e % 2) + 4 * (e / 2));
      }
      ASSERT_EQ(WgmmaRecord::qe(t, 8 * st), WgmmaRecord::qe(t - t % 8, 8 * st) + 16 * (t % 8));
      ASSERT_EQ(WgmmaRecord::stage_qe(t, 8 * st), WgmmaRecord::stage_qe(t - t % 8, 8 * st) + 16 * (t % 8));
      ASSERT_EQ(WgmmaRecord::qe(t, 8 * st) % 16, 0u);
    }
}

// The prep kernel stores Kr a channel's 4 even and 4 odd tokens of a step as two float4s.
TEST(WgmmaRecord, KrRunsAreContiguousForTheVectorStores) {
  for (int k = 0; k < kD; ++k)
    for (int st = 0; st < 2; ++st)
      for (int odd = 0; odd < 2; ++odd)
        for (int i = 0; i < 4; ++i)
          ASSERT_EQ(WgmmaRecord::kr(8 * st + 2 * i + odd, k), WgmmaRecord::kr(8 * st, k) + 128 * odd + 4 * i);
  EXPECT_EQ(WgmmaRecord::kr(0, 0) % 16, 0u);
}

}  // namespace
}  // namespace flashkda::testing
