// Tensor maps (the copy engine's descriptors of strided tiles), encoded through the driver
// entry point so the library needs no link-time dependency on the driver library.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace flashkda::gpu {

// [tokens, heads, 128] bf16 (or fp32 with f32) rows, token r of head h at element r * token_stride
// + h * head_stride (16-byte strides); a box is `box_tokens` consecutive tokens of one head,
// landing in shared memory as [box_tokens][box_row] (box_row >= 128, a multiple of 8: elements
// 128.. of each row, past the tensor, arrive as zeros: padding that moves shared-memory banks).
// Rows past `tokens` read as zeros.
CUtensorMap encode_token_rows_map(const void* base, int64_t tokens, int64_t heads, int64_t token_stride,
                                  int64_t head_stride, int box_tokens, int box_row, bool f32 = false);

// The same rows as [64-token][64-column] boxes with the 128-byte swizzle (two a [tokens][128]
// tile; 16-byte chunk j of row r at j ^ (r % 8), the destination 1024-byte aligned): the fused
// prefill's q, k, g, v tiles (fused_config.h's swizzled_offset). Rows past `tokens` read as zeros.
CUtensorMap encode_token_tiles_map(const void* base, int64_t tokens, int64_t heads, int64_t token_stride,
                                   int64_t head_stride, int box_tokens);

// Dense V-major states [slot_heads][128 rows][128] (bf16, or fp32 with f32): a box is the 128 rows
// of one (slot, head) by 128 bytes of columns (64 bf16 or 32 fp32; 2 or 4 boxes a state), landing
// in shared memory with the 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8); the
// destination 1024-byte aligned).
CUtensorMap encode_state_rows_map(const void* base, bool f32, int64_t slot_heads);

}  // namespace flashkda::gpu
