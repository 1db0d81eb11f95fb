// wgmma (sm_90a warpgroup MMA) with fp16 operands and fp32 accumulators, A from registers:
// one instruction each (see wgmma.cuh for the fences, commits, waits and descriptors).
//
// Layouts (m64nNk16, f16; g = lane / 4, t = lane % 4; warp w of the warpgroup owns rows
// 16 w .. 16 w + 15, the fragments within them those of mma.m16n8k16, see mma.cuh):
//   A  a[0] (row g, k 2t, 2t+1)  a[1] (row g+8, k 2t, 2t+1)  a[2] (row g, k 2t+8, 2t+9)
//      a[3] (row g+8, k 2t+8, 2t+9), the lower k in the low half
//   D  d[4 j + 0..1] (row g, cols 8 j + 2t, +1)  d[4 j + 2..3] (row g+8, same cols), j < N / 8;
//      so the D columns 16 s .. 16 s + 15 packed in pairs, (d[8s], d[8s+1]) (d[8s+2], d[8s+3])
//      (d[8s+4], d[8s+5]) (d[8s+6], d[8s+7]), are the A fragment of k-step s as they stand
//   B  [N rows][16] K-major in shared memory, no swizzle (B not transposed): core matrices of
//      8 rows x 16 bytes (8 fp16), each 128 contiguous bytes (row r at 16 r); the two core
//      matrices of a k-step are `lbo` bytes apart, N-adjacent ones `sbo` bytes apart (as for tf32).
#pragma once

#include <cstdint>

#include "gpu/ptx/convert.cuh"
#include "gpu/ptx/wgmma.cuh"

namespace flashkda::ptx {

// D = A B^T (+ D when `accumulate`) for D [64 x N], A [64 x 16] fp16 in registers, B [N x 16] fp16
// through `b_desc`; with `negate_a`, D = -A B^T (+ D) (the instruction's A scale of -1: a difference
// accumulated in one accumulator). `accumulate` is a predicate operand, `negate_a` an immediate:
// pass a constant. Issued asynchronously: wgmma_commit, then wgmma_wait, before D is read.
template <int N>
__device__ void wgmma_f16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc, bool accumulate, bool negate_a = false);

// The A fragments of KS k-steps from a D accumulator's first 8 KS values (the pairing above):
// a result fed straight into the next product, rounded to fp16.
template <int KS>
__device__ __forceinline__ void f16_a_from_d(const float* d, uint32_t (&a)[KS][4]) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[ks][i] = pack_f16x2(d[8 * ks + 2 * i], d[8 * ks + 2 * i + 1]);
}

template <>
__device__ __forceinline__ void wgmma_f16<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc, bool accumulate, bool negate_a) {
  if (negate_a) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %38, 0;\n .reg .b64 desc;\n mov.b64 desc, {%36, %37};\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, desc, p, -1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<uint32_t>(b_desc)), "r"(static_cast<uint32_t>(b_desc >> 32)),
          "r"(static_cast<uint32_t>(accumulate))
        : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %38, 0;\n .reg .b64 desc;\n mov.b64 desc, {%36, %37};\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, desc, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<uint32_t>(b_desc)), "r"(static_cast<uint32_t>(b_desc >> 32)),
          "r"(static_cast<uint32_t>(accumulate))
        : "memory");
  }
}

template <>
__device__ __forceinline__ void wgmma_f16<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t b_desc, bool accumulate, bool negate_a) {
  if (negate_a) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %70, 0;\n .reg .b64 desc;\n mov.b64 desc, {%68, %69};\n"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, desc, p, -1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<uint32_t>(b_desc)), "r"(static_cast<uint32_t>(b_desc >> 32)),
          "r"(static_cast<uint32_t>(accumulate))
        : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %70, 0;\n .reg .b64 desc;\n mov.b64 desc, {%68, %69};\n"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, desc, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<uint32_t>(b_desc)), "r"(static_cast<uint32_t>(b_desc >> 32)),
          "r"(static_cast<uint32_t>(accumulate))
        : "memory");
  }
}

}  // namespace flashkda::ptx
