// The two wgmma shapes of stage 14 that wgmma.cuh lacks, as gen_wgmma.py writes them (its `wrapper`
// for these SHAPES rows; kept apart so that the headers of stages 4-12 stay as they are):
//   ("ss", 256, "K_MAJOR")       dH = dY·W2ᵀ and dX = [dG dU]·W1ᵀ: B is a weight read transposed, [n][k]
//                                with k contiguous (W2[e] is [inter][hidden]: n = inter, k = hidden)
//   ("ss_a_mn", 256, "MN_MAJOR") dW = Aᵀ·B over an expert's rows: A is [k = row][m], m contiguous
//                                (imm-trans-a = 1), B is [k = row][n], n contiguous (imm-trans-b = 1)
#pragma once
#include "wgmma.cuh"

#define ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define DEFINE_WGMMA_GRAD_WRAPPERS(T, PTX) \
template <> __device__ __forceinline__ void wgmma_ss<T, 256, K_MAJOR>(float (&d)[32][4], u64 desc_a, u64 desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX "." PTX " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n" \
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7), ACC4(8), ACC4(9), ACC4(10), ACC4(11), ACC4(12), ACC4(13), ACC4(14), ACC4(15), ACC4(16), ACC4(17), ACC4(18), ACC4(19), ACC4(20), ACC4(21), ACC4(22), ACC4(23), ACC4(24), ACC4(25), ACC4(26), ACC4(27), ACC4(28), ACC4(29), ACC4(30), ACC4(31) \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
} \
template <> __device__ __forceinline__ void wgmma_ss_a_mn<T, 256, MN_MAJOR>(float (&d)[32][4], u64 desc_a, u64 desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX "." PTX " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 1, 1;\n}\n" \
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7), ACC4(8), ACC4(9), ACC4(10), ACC4(11), ACC4(12), ACC4(13), ACC4(14), ACC4(15), ACC4(16), ACC4(17), ACC4(18), ACC4(19), ACC4(20), ACC4(21), ACC4(22), ACC4(23), ACC4(24), ACC4(25), ACC4(26), ACC4(27), ACC4(28), ACC4(29), ACC4(30), ACC4(31) \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
}

DEFINE_WGMMA_GRAD_WRAPPERS(__half, "f16")
DEFINE_WGMMA_GRAD_WRAPPERS(__nv_bfloat16, "bf16")
#undef DEFINE_WGMMA_GRAD_WRAPPERS
#undef ACC4
