// The WgmmaRecord layout (gpu/prefill/chunk_record.cuh) on the host, no device needed: every
// field's element offsets fill the field exactly once, and each element sits where the wgmma
// state pass reads it. The pass reads B tile k-step st of a field as [rows][8 slots] through a
// descriptor (leading offset 128 bytes along the slots, stride 256 along the rows: checked on the
// device by test_wgmma_gpu), and slot s stands for k-step element s (an A operand loaded in
// order: V^T against W) or for element 2 s / 2 (s - 4) + 1 (an A operand taken from a D
// fragment: S^T against Wk and Qe, U^T against Kr, WV^T against M).
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
  };
  std::vector<Field> fields = {{"wk and qe", WgmmaRecord::kWkQe, WgmmaRecord::kKr, {}},
                               {"kr", WgmmaRecord::kKr, WgmmaRecord::kW, {}},
                               {"w", WgmmaRecord::kW, WgmmaRecord::kM, {}},
                               {"m", WgmmaRecord::kM, WgmmaRecord::kDecay, {}}};
  for (int t = 0; t < kT; ++t)
    for (int k = 0; k < kD; ++k) {
      fields[0].offsets.push_back(WgmmaRecord::wk(t, k));
      fields[0].offsets.push_back(WgmmaRecord::qe(t, k));
      fields[1].offsets.push_back(WgmmaRecord::kr(t, k));
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
    EXPECT_EQ(f.offsets.size() * 4, f.end - f.begin) << "the field is not filled exactly";
    for (uint32_t o : f.offsets) {
      EXPECT_EQ(o % 4, 0u);
      EXPECT_GE(o, f.begin);
      EXPECT_LT(o, f.end);
    }
  }
}

TEST(WgmmaRecord, ElementsSitWhereThePassReadsThem) {
  for (int st = 0; st < kD / 8; ++st)  // [Wk | Qe]: one 32-row tile a k-step over k, permuted (A = S^T)
    for (int t = 0; t < kT; ++t)
      for (int s = 0; s < 8; ++s) {
        ASSERT_EQ(WgmmaRecord::wk(t, 8 * st + element_of_slot(s)), read_offset(WgmmaRecord::kWkQe, WgmmaRecord::kPairTile, st, t, s));
        ASSERT_EQ(WgmmaRecord::qe(t, 8 * st + element_of_slot(s)), read_offset(WgmmaRecord::kWkQe, WgmmaRecord::kPairTile, st, kT + t, s));
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
