// Hopper (sm_90a) building blocks for stage 4: TMA, mbarriers, wgmma, warp specialization.
//
// Thin wrappers around PTX instructions that only sm_90a has:
//   cp.async.bulk.tensor   TMA: one thread copies a whole tile global -> shared memory, described by a
//                          tensor map (built on the host) and completing on an mbarrier
//   mbarrier               shared-memory barriers with a phase bit and a transaction-byte count:
//                          "full" barriers say a tile has landed, "empty" barriers that it may be refilled
//   wgmma.mma_async        a warpgroup (4 warps, 128 threads) multiplies a 64 × N tile, operands read
//                          straight from shared memory through 64-bit "matrix descriptors"
//   setmaxnreg, bar.sync   hand registers from the producer warpgroup to the consumers; named barriers
//
// Fragment layout of a wgmma.m64nNk16 accumulator (PTX ISA, "Register Fragments" of wgmma): warp
// w = warp % 4 of the warpgroup owns rows 16w .. 16w+15, and inside those 16 rows the layout is the
// one of mma.m16n8k16 (mma.cuh), repeated for every 8 columns: d[j][0..3] of lane 4g + t are
// rows g, g+8 × columns 8j + 2t, 8j + 2t + 1. So a warp's slice of the accumulator is exactly stage
// 2's float s[N/8][4], and an A operand in registers (4 × 32 bits) is stage 2's A fragment: the
// online softmax, P as the A operand and the epilogue of mma.cuh work unchanged.
#pragma once
#include "mma.cuh"

typedef unsigned long long u64;

// --8<-- [start:tensor_map]
// The 128-byte, 64-byte-aligned opaque tensor map (the driver's CUtensorMap, which NVRTC does not
// see: it lives in cuda.h). The kernel receives it by value as a `const __grid_constant__`
// parameter, so it stays in parameter memory where the TMA unit can read it.
struct alignas(64) TmaMap {
    u64 opaque[16];
};
static_assert(sizeof(TmaMap) == 128, "CUtensorMap is 128 bytes");
// --8<-- [end:tensor_map]

// ---- mbarrier -----------------------------------------------------------------------------------
// --8<-- [start:mbarrier]
// An mbarrier is 8 bytes of shared memory: a count of pending arrivals, a count of pending
// transaction bytes and a phase bit. A phase completes when both counts reach zero; the barrier
// then flips its phase and rearms with the count it was initialized with. Waiters wait for the
// phase with a given parity to complete: a ring slot used for the i-th time waits for parity i % 2.
__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

// Makes the initializations visible to the other threads and to the async proxy (TMA) -- before
// the __syncthreads() that publishes them.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival, and `bytes` more transaction bytes to wait for (the producer, before its TMA copies).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}

// One arrival (a consumer thread done with a buffer).
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

// Spins until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// --8<-- [end:mbarrier]

// ---- TMA ------------------------------------------------------------------------------------------
// --8<-- [start:tma_ptx]
// Copies the box at coordinates (c0, c1, c2) -- innermost first: column, row, (batch·head) -- of
// the 3-D tensor `map` describes into shared memory at `dst`, and counts its bytes on the mbarrier
// `bar`. Elements outside the tensor are written as zeros (and still counted). With the map's
// 128-byte swizzle, `dst` must be 1024-byte aligned.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaMap& map, unsigned bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        :: "r"(dst), "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const TmaMap& map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<u64>(&map)) : "memory");
}
// --8<-- [end:tma_ptx]

// ---- warp specialization ---------------------------------------------------------------------------
// setmaxnreg: the warpgroup executing it gives back registers (dec) or claims them (inc), so that
// the producer runs on few and the consumers on many. Every warp of the warpgroup executes it.
template <int REGS> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS));
}
template <int REGS> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS));
}

// Named barriers 1..15 (0 is __syncthreads): bar.sync waits until `threads` threads have arrived
// (itself included); bar.arrive counts this thread and goes on.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// ---- wgmma ------------------------------------------------------------------------------------------
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

// d[64 × N] (+)= A[64 × 16] · B[16 × N], fp32 accumulators, d as the warp's float[N/8][4].
//   wgmma_ss: A and B from shared memory, both K-major (no transpose): S = Q·Kᵀ (N = 128 or 192)
//   wgmma_rs: A from registers (4 per thread, the layout of an mma.m16n8k16 A fragment), B from
//             shared memory MN-major (imm-trans-b = 1): O += P·V with V stored [key][d]
// `accumulate` = 0 ignores the old d (scale-d false): the first k-step needs no zeroed registers.
template <typename T, int N>
__device__ void wgmma_ss(float (&d)[N / 8][4], u64 desc_a, u64 desc_b, int accumulate);
template <typename T, int N>
__device__ void wgmma_rs(float (&d)[N / 8][4], const unsigned (&a)[4], u64 desc_b, int accumulate);

// Written out by a script (96, 64 or 32 accumulator operands each), once for both element types:
// T is the C type, PTX its name in the instruction ("f16", "bf16").
#define DEFINE_WGMMA_WRAPPERS(T, PTX) \
template <>                                                                                                                                                                                                                                                                                                                                                                   \
__device__ __forceinline__ void wgmma_ss<T, 128>(float (&d)[16][4], u64 desc_a, u64 desc_b, int accumulate) {                                                                                                                                                                                                                                                                 \
    asm volatile(                                                                                                                                                                                                                                                                                                                                                             \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                                                                                                                                                                                                                                                                                          \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " "                                                                                                                                                                                                                                                                                                        \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"               \
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),                                                                                                                                                                                                                                             \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),                                                                                                                                                                                                                                             \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),                                                                                                                                                                                                                                             \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),                                                                                                                                                                                                                                             \
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),                                                                                                                                                                                                                                             \
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),                                                                                                                                                                                                                                     \
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),                                                                                                                                                                                                                                     \
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                                                                                                                                                                                                                                      \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                                                                                                                                                                                                                                                                                         \
}                                                                                                                                                                                                                                                                                                                                                                             \
                                                                                                                                                                                                                                                                                                                                                                              \
template <>                                                                                                                                                                                                                                                                                                                                                                   \
__device__ __forceinline__ void wgmma_ss<T, 192>(float (&d)[24][4], u64 desc_a, u64 desc_b, int accumulate) {                                                                                                                                                                                                                                                                 \
    asm volatile(                                                                                                                                                                                                                                                                                                                                                             \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"                                                                                                                                                                                                                                                                                                                          \
        "wgmma.mma_async.sync.aligned.m64n192k16.f32." PTX "." PTX " "                                                                                                                                                                                                                                                                                                        \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 0, 0;\n}\n"\
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),                                                                                                                                                                                                                                             \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),                                                                                                                                                                                                                                             \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),                                                                                                                                                                                                                                             \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),                                                                                                                                                                                                                                             \
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),                                                                                                                                                                                                                                             \
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),                                                                                                                                                                                                                                     \
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),                                                                                                                                                                                                                                     \
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]),                                                                                                                                                                                                                                     \
          "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]),                                                                                                                                                                                                                                     \
          "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]),                                                                                                                                                                                                                                     \
          "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]),                                                                                                                                                                                                                                     \
          "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3])                                                                                                                                                                                                                                      \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                                                                                                                                                                                                                                                                                         \
}                                                                                                                                                                                                                                                                                                                                                                             \
                                                                                                                                                                                                                                                                                                                                                                              \
template <>                                                                                                                                                                                                                                                                                                                                                                   \
__device__ __forceinline__ void wgmma_rs<T, 64>(float (&d)[8][4], const unsigned (&a)[4], u64 desc_b, int accumulate) {                                                                                                                                                                                                                                                       \
    asm volatile(                                                                                                                                                                                                                                                                                                                                                             \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                                                                                                                                                                                                                                                                                          \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " "                                                                                                                                                                                                                                                                                                         \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                                                                                                                                                 \
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),                                                                                                                                                                                                                                             \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),                                                                                                                                                                                                                                             \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),                                                                                                                                                                                                                                             \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])                                                                                                                                                                                                                                              \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));                                                                                                                                                                                                                                                                                          \
}                                                                                                                                                                                                                                                                                                                                                                             \
                                                                                                                                                                                                                                                                                                                                                                              \
template <>                                                                                                                                                                                                                                                                                                                                                                   \
__device__ __forceinline__ void wgmma_rs<T, 128>(float (&d)[16][4], const unsigned (&a)[4], u64 desc_b, int accumulate) {                                                                                                                                                                                                                                                     \
    asm volatile(                                                                                                                                                                                                                                                                                                                                                             \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                                                                                                                                                                                                                                                                                          \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " "                                                                                                                                                                                                                                                                                                        \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),                                                                                                                                                                                                                                             \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),                                                                                                                                                                                                                                             \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),                                                                                                                                                                                                                                             \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),                                                                                                                                                                                                                                             \
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),                                                                                                                                                                                                                                             \
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),                                                                                                                                                                                                                                     \
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),                                                                                                                                                                                                                                     \
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                                                                                                                                                                                                                                      \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));                                                                                                                                                                                                                                                                                          \
}

DEFINE_WGMMA_WRAPPERS(__half, "f16")
DEFINE_WGMMA_WRAPPERS(__nv_bfloat16, "bf16")
#undef DEFINE_WGMMA_WRAPPERS
// --8<-- [end:wgmma_ptx]
