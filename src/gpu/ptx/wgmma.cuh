// wgmma (sm_90a warpgroup MMA) wrappers: one instruction each. A warpgroup is 4 consecutive
// warps (128 threads) that all execute the same instruction. The B operand is read from shared
// memory through a matrix descriptor, once for the whole warpgroup (mma.sync reads its B
// fragments once per warp); A comes from registers.
//
// Layouts (m64nNk8, tf32; g = lane / 4, t = lane % 4; warp w of the warpgroup owns rows
// 16 w .. 16 w + 15, and within them the fragments are those of mma.m16n8k8, see mma.cuh):
//   A  a[0] (row g, k t)  a[1] (row g+8, k t)  a[2] (row g, k t+4)  a[3] (row g+8, k t+4)
//   D  d[4 j + 0..1] (row g, cols 8 j + 2t, +1)  d[4 j + 2..3] (row g+8, same cols), j < N / 8
//   B  [N rows][K] K-major in shared memory, no swizzle: core matrices of 8 rows x 16 bytes
//      (4 tf32), each 128 contiguous bytes (row r at 16 r); core matrices adjacent along K are
//      `lbo` bytes apart, along N `sbo` bytes apart (the descriptor's leading and stride byte
//      offsets). tests/gpu/test_wgmma_gpu.cu checks all of this on the device.
#pragma once

#include <cstdint>

#include "gpu/ptx/movmatrix.cuh"  // smem_addr

namespace flashkda::ptx {

// The 64-bit shared-memory matrix descriptor, no swizzle: start address, leading (K) and
// stride (M/N) byte offsets, each stored >> 4 in 14 bits.
__device__ __forceinline__ uint64_t smem_matrix_desc(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr(smem) >> 4) & 0x3FFF) |
         static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16 | static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
}

// The descriptor of the matrix `byte_offset` bytes after the one `desc` describes (a multiple of
// 16): the start address is the low 14 bits in 16-byte units, and shared-memory addresses stay
// under 2^18 bytes, so the add never carries into the offsets above them. One add on a
// descriptor formed once, where forming each one from its address took a conversion, a shift
// and two masks in front of every wgmma (the wgmma state pass: 24 a warpgroup a chunk).
__device__ __forceinline__ uint64_t smem_matrix_desc_advance(uint64_t desc, uint32_t byte_offset) {
  const uint32_t start = static_cast<uint32_t>(desc) + (byte_offset >> 4);  // a 32-bit add: the high word stays
  return (desc & 0xFFFFFFFF00000000ull) | start;
}

// Orders this thread's register writes of A and D before the wgmma that reads them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most `kPending` committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Pins registers for the compiler at this point (no instruction): accumulators and register A
// operands fenced before wgmma_fence and after wgmma_wait keep the compiler from moving their
// reads and writes into a wgmma pipeline stage, where ptxas would serialize the wgmmas.
template <int N>
__device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void fence_operands(uint32_t (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i) fence_operands(r[i]);
}

// Makes shared memory written by ordinary stores visible to wgmma's (async proxy) reads.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// D = A B^T (+ D when `accumulate`) for D [64 x N], A [64 x 8] in registers, B [N x 8] through
// `b_desc` (handed over as two words: its high word, the stride offset, is then one constant
// register pair for every wgmma, and only the start address changes from one to the next); tf32
// inputs (fp32 bit patterns, the low 13 mantissa bits ignored), fp32 D. Issued asynchronously:
// wgmma_commit, then wgmma_wait, before D is read.
template <int N>
__device__ void wgmma_tf32(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b_desc, bool accumulate);

template <>
__device__ __forceinline__ void wgmma_tf32<16>(float (&d)[8], const uint32_t (&a)[4], uint64_t b_desc, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %14, 0;\n .reg .b64 desc;\n mov.b64 desc, {%12, %13};\n"
      " wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, desc, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<uint32_t>(b_desc)), "r"(static_cast<uint32_t>(b_desc >> 32)),
        "r"(static_cast<uint32_t>(accumulate))
      : "memory");
}

template <>
__device__ __forceinline__ void wgmma_tf32<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t b_desc, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %22, 0;\n .reg .b64 desc;\n mov.b64 desc, {%20, %21};\n"
      " wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, desc, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<uint32_t>(b_desc)), "r"(static_cast<uint32_t>(b_desc >> 32)),
        "r"(static_cast<uint32_t>(accumulate))
      : "memory");
}
template <>
__device__ __forceinline__ void wgmma_tf32<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b_desc, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %38, 0;\n .reg .b64 desc;\n mov.b64 desc, {%36, %37};\n"
      " wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, desc, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<uint32_t>(b_desc)), "r"(static_cast<uint32_t>(b_desc >> 32)),
        "r"(static_cast<uint32_t>(accumulate))
      : "memory");
}
template <>
__device__ __forceinline__ void wgmma_tf32<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t b_desc, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %70, 0;\n .reg .b64 desc;\n mov.b64 desc, {%68, %69};\n"
      " wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, desc, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<uint32_t>(b_desc)), "r"(static_cast<uint32_t>(b_desc >> 32)),
        "r"(static_cast<uint32_t>(accumulate))
      : "memory");
}

}  // namespace flashkda::ptx
