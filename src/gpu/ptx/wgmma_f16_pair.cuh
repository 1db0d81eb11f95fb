// wgmma m64nNk16 (fp16 operands, fp32 accumulators, A from registers) whose D is two accumulators
// side by side: columns 0 .. N1 - 1 in d1, N1 .. N1 + N2 - 1 in d2, each in wgmma_f16.cuh's D
// layout of its own width. One instruction where two products share their A operand and their B
// tiles lie one after the other in shared memory (rows N1 .. of the B tile continue d1's), and
// the register arrays stay apart for the code around them. Always accumulates (D += A B^T); zero
// an accumulator to start one.
// Issued asynchronously: wgmma_commit, then wgmma_wait, before d1 or d2 is read.
#pragma once

#include <cstdint>

#include "gpu/ptx/wgmma.cuh"

namespace flashkda::ptx {

template <int N1, int N2>
__device__ void wgmma_f16_pair(float (&d1)[N1 / 2], float (&d2)[N2 / 2], const uint32_t (&a)[4], uint64_t b_desc);

template <>
__device__ __forceinline__ void wgmma_f16_pair<64, 128>(float (&d1)[32], float (&d2)[64], const uint32_t (&a)[4], uint64_t b_desc) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, 1, 0;\n .reg .b64 desc;\n mov.b64 desc, {%100, %101};\n"
      " wgmma.mma_async.sync.aligned.m64n192k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, {%96, %97, %98, %99}, desc, p, 1, 1, 0;\n}\n"
      : "+f"(d1[0]), "+f"(d1[1]), "+f"(d1[2]), "+f"(d1[3]), "+f"(d1[4]), "+f"(d1[5]), "+f"(d1[6]), "+f"(d1[7]), "+f"(d1[8]), "+f"(d1[9]), "+f"(d1[10]), "+f"(d1[11]), "+f"(d1[12]), "+f"(d1[13]), "+f"(d1[14]), "+f"(d1[15]), "+f"(d1[16]), "+f"(d1[17]), "+f"(d1[18]), "+f"(d1[19]), "+f"(d1[20]), "+f"(d1[21]), "+f"(d1[22]), "+f"(d1[23]), "+f"(d1[24]), "+f"(d1[25]), "+f"(d1[26]), "+f"(d1[27]), "+f"(d1[28]), "+f"(d1[29]), "+f"(d1[30]), "+f"(d1[31]), "+f"(d2[0]), "+f"(d2[1]), "+f"(d2[2]), "+f"(d2[3]), "+f"(d2[4]), "+f"(d2[5]), "+f"(d2[6]), "+f"(d2[7]), "+f"(d2[8]), "+f"(d2[9]), "+f"(d2[10]), "+f"(d2[11]), "+f"(d2[12]), "+f"(d2[13]), "+f"(d2[14]), "+f"(d2[15]), "+f"(d2[16]), "+f"(d2[17]), "+f"(d2[18]), "+f"(d2[19]), "+f"(d2[20]), "+f"(d2[21]), "+f"(d2[22]), "+f"(d2[23]), "+f"(d2[24]), "+f"(d2[25]), "+f"(d2[26]), "+f"(d2[27]), "+f"(d2[28]), "+f"(d2[29]), "+f"(d2[30]), "+f"(d2[31]), "+f"(d2[32]), "+f"(d2[33]), "+f"(d2[34]), "+f"(d2[35]), "+f"(d2[36]), "+f"(d2[37]), "+f"(d2[38]), "+f"(d2[39]), "+f"(d2[40]), "+f"(d2[41]), "+f"(d2[42]), "+f"(d2[43]), "+f"(d2[44]), "+f"(d2[45]), "+f"(d2[46]), "+f"(d2[47]), "+f"(d2[48]), "+f"(d2[49]), "+f"(d2[50]), "+f"(d2[51]), "+f"(d2[52]), "+f"(d2[53]), "+f"(d2[54]), "+f"(d2[55]), "+f"(d2[56]), "+f"(d2[57]), "+f"(d2[58]), "+f"(d2[59]), "+f"(d2[60]), "+f"(d2[61]), "+f"(d2[62]), "+f"(d2[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(static_cast<uint32_t>(b_desc)), "r"(static_cast<uint32_t>(b_desc >> 32))
      : "memory");
}

}  // namespace flashkda::ptx
