// wgmma, Hopper's warpgroup-wide tensor-core instruction (sm_90a; stages 4 and 6).
//
// wgmma.mma_async: a warpgroup (4 warps, 128 threads) multiplies a 64 × N tile, its operands read
// straight from shared memory through 64-bit "matrix descriptors" (or A from registers), its fp32
// accumulators in registers -- asynchronously: the warps go on while the tensor cores work.
//
// Fragment layout of a wgmma.m64nNk16 accumulator (PTX ISA, "Register Fragments" of wgmma): warp
// w = warp % 4 of the warpgroup owns rows 16w .. 16w+15, and inside those 16 rows the layout is the
// one of mma.m16n8k16 (mma.cuh), repeated for every 8 columns: d[j][0..3] of lane 4g + t are
// rows g, g+8 × columns 8j + 2t, 8j + 2t + 1. So a warp's slice of the accumulator is exactly stage
// 2's float s[N/8][4], and an A operand in registers (4 × 32 bits) is stage 2's A fragment: the
// online softmax, P as the A operand and the epilogue of mma.cuh work unchanged.
#pragma once
#include "attention.cuh"  // the element types

typedef unsigned long long u64;

constexpr int WARPGROUP_THREADS = 128;  // 4 warps: the threads that issue one wgmma together

// --8<-- [start:wgmma_ptx]
// A shared-memory operand of wgmma is a 64-bit matrix descriptor (PTX ISA, "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4
//   bits 16-29  leading dimension byte offset (LBO) >> 4
//   bits 32-45  stride dimension byte offset (SBO) >> 4
//   bits 49-51  base offset (0: the tile starts on a 1024-byte boundary, as ours do)
//   bits 62-63  swizzle: 1 = 128-byte swizzle, the pattern TMA writes with CU_TENSOR_MAP_SWIZZLE_128B
// With the 128-byte swizzle the unit of layout is an "atom" of 8 rows × 128 bytes (64 elements),
// rows 128 bytes apart, whose 16-byte chunk c of row r sits at position c ^ r (stage 3's swizzle).
//   K-major operand (Q, K: [row][k], k contiguous): rows of the M or N dimension, 8-row groups SBO
//     = 1024 bytes apart; LBO unused (1). Step k by 16 elements inside an atom: start + 32 bytes.
//   MN-major operand (V as B of P·V: [k][n], n contiguous): k runs down the rows, 8-row groups SBO
//     = 1024 bytes apart; LBO = distance to the next 64 columns of n (the next atom column).
__device__ __forceinline__ u64 make_smem_desc(unsigned address, unsigned lbo, unsigned sbo) {
    return (u64)((address & 0x3FFFF) >> 4) | ((u64)((lbo & 0x3FFFF) >> 4) << 16) |
           ((u64)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// wgmma.fence before the first wgmma of a batch (and whenever its registers were touched since);
// commit_group closes the batch; wait_group<N> waits until at most N batches are in flight.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

// The compiler does not know that a wgmma in flight still reads and writes its registers: this
// empty asm "redefines" a register after wgmma_wait, so no use of it moves above the wait.
template <int N> __device__ __forceinline__ void fence_registers(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) asm volatile("" : "+f"(r[i][c]) :: "memory");
}
template <int N> __device__ __forceinline__ void fence_registers(unsigned (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) asm volatile("" : "+r"(r[i][c]) :: "memory");
}

// How B lies in shared memory, wgmma's imm-trans-b (A is K-major throughout the course):
//   K_MAJOR   [n][k], k contiguous: K in S = Q·Kᵀ
//   MN_MAJOR  [k][n], n contiguous: V in O += P·V, the weights W [K][N] of the grouped GEMM
enum Major { K_MAJOR = 0, MN_MAJOR = 1 };

// d[64 × N] (+)= A[64 × 16] · B[16 × N], fp32 accumulators, d as the warp's float[N/8][4].
//   wgmma_ss: A and B from shared memory, A K-major
//   wgmma_rs: A from registers (4 per thread, the layout of an mma.m16n8k16 A fragment)
//   wgmma_ss_a_mn: A and B from shared memory, A MN-major ([k][m], m contiguous: imm-trans-a = 1)
// `accumulate` = 0 ignores the old d (scale-d false): the first k-step needs no zeroed registers.
// Defined below for the shapes the course uses (gen_wgmma.py's SHAPES), fp16 and bf16.
template <typename T, int N, Major B>
__device__ void wgmma_ss(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int accumulate);
template <typename T, int N, Major B>
__device__ void wgmma_ss_a_mn(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int accumulate);
template <typename T, int N, Major B>
__device__ void wgmma_rs(float (&d)[N / 8][4], const unsigned (&a)[4], u64 desc_b, int accumulate);
// --8<-- [end:wgmma_ptx]

// ---- written by gen_wgmma.py from here on: add a shape to its SHAPES, then run it ----
#define ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define DEFINE_WGMMA_WRAPPERS(T, PTX) \
template <> __device__ __forceinline__ void wgmma_ss<T, 64, K_MAJOR>(float (&d)[8][4], u64 desc_a, u64 desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7) \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
} \
template <> __device__ __forceinline__ void wgmma_ss<T, 128, K_MAJOR>(float (&d)[16][4], u64 desc_a, u64 desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7), ACC4(8), ACC4(9), ACC4(10), ACC4(11), ACC4(12), ACC4(13), ACC4(14), ACC4(15) \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
} \
template <> __device__ __forceinline__ void wgmma_ss<T, 192, K_MAJOR>(float (&d)[24][4], u64 desc_a, u64 desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32." PTX "." PTX " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 0, 0;\n}\n" \
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7), ACC4(8), ACC4(9), ACC4(10), ACC4(11), ACC4(12), ACC4(13), ACC4(14), ACC4(15), ACC4(16), ACC4(17), ACC4(18), ACC4(19), ACC4(20), ACC4(21), ACC4(22), ACC4(23) \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
} \
template <> __device__ __forceinline__ void wgmma_ss<T, 256, MN_MAJOR>(float (&d)[32][4], u64 desc_a, u64 desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX "." PTX " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n" \
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7), ACC4(8), ACC4(9), ACC4(10), ACC4(11), ACC4(12), ACC4(13), ACC4(14), ACC4(15), ACC4(16), ACC4(17), ACC4(18), ACC4(19), ACC4(20), ACC4(21), ACC4(22), ACC4(23), ACC4(24), ACC4(25), ACC4(26), ACC4(27), ACC4(28), ACC4(29), ACC4(30), ACC4(31) \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
} \
template <> __device__ __forceinline__ void wgmma_rs<T, 64, MN_MAJOR>(float (&d)[8][4], const unsigned (&a)[4], u64 desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)); \
} \
template <> __device__ __forceinline__ void wgmma_rs<T, 128, MN_MAJOR>(float (&d)[16][4], const unsigned (&a)[4], u64 desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7), ACC4(8), ACC4(9), ACC4(10), ACC4(11), ACC4(12), ACC4(13), ACC4(14), ACC4(15) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)); \
} \
template <> __device__ __forceinline__ void wgmma_ss_a_mn<T, 64, MN_MAJOR>(float (&d)[8][4], u64 desc_a, u64 desc_b, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n" \
                 : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7) \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate)); \
}

DEFINE_WGMMA_WRAPPERS(__half, "f16")
DEFINE_WGMMA_WRAPPERS(__nv_bfloat16, "bf16")
#undef DEFINE_WGMMA_WRAPPERS
#undef ACC4
