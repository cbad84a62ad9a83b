// The wgmma shape of the grouped GEMM (stage 6): m64n256k16, both operands from shared memory, B
// MN-major -- the weights are stored [K][N] (N contiguous), as W1 [E, hidden, 2·inter] and
// W2 [E, inter, hidden] are -- so imm-trans-b = 1. The accumulator is a warp's float[32][4]: the
// 16-row slice of the 64 × 256 tile in mma.m16n8k16 layout, 8 columns per entry (hopper.cuh).
#pragma once
#include "hopper.cuh"

template <typename T>
__device__ void wgmma_256_ss_b_mn_major(float (&d)[32][4], u64 desc_a, u64 desc_b, int accumulate);

#define ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define DEFINE_WGMMA_256(T, PTX)                                                                      \
template <>                                                                                           \
__device__ __forceinline__ void wgmma_256_ss_b_mn_major<T>(float (&d)[32][4], u64 desc_a, u64 desc_b, \
                                                           int accumulate) {                          \
    asm volatile(                                                                                     \
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                 \
        "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX "." PTX " {"                                \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "             \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "   \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "   \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "   \
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "   \
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "   \
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "\
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127 "\
        "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                                      \
        : ACC4(0), ACC4(1), ACC4(2), ACC4(3), ACC4(4), ACC4(5), ACC4(6), ACC4(7),                     \
          ACC4(8), ACC4(9), ACC4(10), ACC4(11), ACC4(12), ACC4(13), ACC4(14), ACC4(15),               \
          ACC4(16), ACC4(17), ACC4(18), ACC4(19), ACC4(20), ACC4(21), ACC4(22), ACC4(23),             \
          ACC4(24), ACC4(25), ACC4(26), ACC4(27), ACC4(28), ACC4(29), ACC4(30), ACC4(31)              \
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                     \
}

DEFINE_WGMMA_256(__half, "f16")
DEFINE_WGMMA_256(__nv_bfloat16, "bf16")
#undef DEFINE_WGMMA_256
#undef ACC4

// ---- TMA stores -------------------------------------------------------------------------------------
// --8<-- [start:tma_store]
// The epilogue's way out: the warps write a tile into shared memory with ordinary stores, one thread
// copies it to global memory with TMA (cp.async.bulk.tensor, shared -> global), and the warps go on
// with the next tile while the copy runs. Ordinary stores and TMA are different "proxies" of the
// memory system: fence_async_shared() makes the former visible to the latter. Before the buffer is
// written again, the thread that issued the copies waits until they have finished READING it.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Copies the tile at shared address `src` to the box at (c0, c1, c2) of the tensor `map` describes;
// elements of the box outside the tensor are not written.
__device__ __forceinline__ void tma_store_3d(const TmaMap& map, unsigned src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 :: "l"(reinterpret_cast<u64>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(src) : "memory");
}

__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until this thread's committed stores have read their shared memory (the buffer is free).
__device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// --8<-- [end:tma_store]
