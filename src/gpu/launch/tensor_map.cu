#include "gpu/launch/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include "common/fail.h"

namespace flashkda::gpu {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                             cudaEnableDefault, &status);
    return (err == cudaSuccess && status == cudaDriverEntryPointSuccess)
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr)
               : nullptr;
  }();
  if (!fn) fail(ErrorCode::kCudaError, "the CUDA driver does not provide cuTensorMapEncodeTiled");
  return fn;
}

// A 3-D tiled map (dims and boxes innermost first, strides in bytes for dims 1..2, element
// strides 1, 256-byte L2 promotion, no out-of-bounds fill value): the encode and its failure, once
// for every map here; `what` names the map in the error.
CUtensorMap encode_3d(CUtensorMapDataType type, const void* base, const cuuint64_t (&dims)[3],
                      const cuuint64_t (&strides)[2], const cuuint32_t (&box)[3], CUtensorMapSwizzle swizzle,
                      const char* what) {
  CUtensorMap map{};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode_tiled_fn()(&map, type, 3, const_cast<void*>(base), dims, strides, box, element_strides,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) fail(ErrorCode::kCudaError, "encoding ", what, " failed (CUresult ", static_cast<int>(r), ")");
  return map;
}

}  // namespace

CUtensorMap encode_token_rows_map(const void* base, int64_t tokens, int64_t heads, int64_t token_stride,
                                  int64_t head_stride, int box_tokens, int box_row, bool f32) {
  constexpr cuuint64_t kRow = 128;
  const cuuint64_t elem = f32 ? 4 : 2;
  // A problem with no tokens still gets a valid (never used) map: dimensions must be >= 1.
  const cuuint64_t dims[3] = {kRow, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(tokens > 0 ? tokens : 1)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride) * elem,
                                 static_cast<cuuint64_t>(token_stride) * elem};  // bytes, dims 1..2
  if (box_row < static_cast<int>(kRow) || box_row > 256 || box_row % 8 != 0)
    fail(ErrorCode::kInternal, "tensor map: box_row must be a multiple of 8 in [128, 256], got ", box_row);
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_row), 1, static_cast<cuuint32_t>(box_tokens)};
  return encode_3d(f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, base, dims, strides, box,
                   CU_TENSOR_MAP_SWIZZLE_NONE, "a tensor map");
}

CUtensorMap encode_token_tiles_map(const void* base, int64_t tokens, int64_t heads, int64_t token_stride,
                                   int64_t head_stride, int box_tokens) {
  const cuuint64_t dims[3] = {128, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(tokens > 0 ? tokens : 1)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride) * 2, static_cast<cuuint64_t>(token_stride) * 2};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_tokens)};
  return encode_3d(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, base, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                   "a token-tile tensor map");
}

CUtensorMap encode_state_rows_map(const void* base, bool f32, int64_t slot_heads) {
  constexpr cuuint64_t kRows = 128, kCols = 128, kBoxBytes = 128;
  const cuuint64_t elem = f32 ? 4 : 2;
  // No state (or no slot) still gets a valid, never used map: dimensions must be >= 1.
  const cuuint64_t dims[3] = {kCols, kRows, static_cast<cuuint64_t>(slot_heads > 0 ? slot_heads : 1)};
  const cuuint64_t strides[2] = {kCols * elem, kRows * kCols * elem};  // bytes, dims 1..2
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(kBoxBytes / elem), static_cast<cuuint32_t>(kRows), 1};
  return encode_3d(f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, base, dims, strides, box,
                   CU_TENSOR_MAP_SWIZZLE_128B, "the initial state's tensor map");
}

}  // namespace flashkda::gpu
