// TMA and the barriers of a warp-specialized kernel (sm_90a; stages 4 and 6).
//
// Thin wrappers around PTX instructions that only sm_90a has:
//   cp.async.bulk.tensor   TMA: one thread copies a whole tile between global and shared memory,
//                          described by a tensor map (built on the host); a load completes on an mbarrier
//   mbarrier               shared-memory barriers with a phase bit and a transaction-byte count:
//                          "full" barriers say a tile has landed, "empty" barriers that it may be refilled
//   setmaxnreg, bar.sync   hand registers from the producer warpgroup to the consumers; named barriers
#pragma once
#include "swizzle.cuh"  // SWIZZLE_BYTES: the rows of the tiles TMA writes with the 128-byte swizzle

// --8<-- [start:tensor_map]
// The 128-byte, 64-byte-aligned opaque tensor map (the driver's CUtensorMap, which NVRTC does not
// see: it lives in cuda.h). The kernel receives it by value as a `const __grid_constant__`
// parameter, so it stays in parameter memory where the TMA unit can read it.
struct alignas(64) TmaMap {
    unsigned long long opaque[16];
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

// ---- TMA loads ----------------------------------------------------------------------------------
// --8<-- [start:tma_ptx]
// Copies the box at coordinates (c0, c1, c2) -- innermost first: column, row, (batch·head) -- of
// the 3-D tensor `map` describes into shared memory at `dst`, and counts its bytes on the mbarrier
// `bar`. Elements outside the tensor are written as zeros (and still counted). With the map's
// 128-byte swizzle, `dst` must be 1024-byte aligned.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TmaMap& map, unsigned bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// The same for a 4-D tensor: (column, row, head, batch) of attention's [B, H, S, D] tensors, whose
// tensor maps carry each dimension's stride, so that a model's [B, S, H, D] views need no copy.
__device__ __forceinline__ void tma_load_4d(unsigned dst, const TmaMap& map, unsigned bar, int c0, int c1, int c2,
                                            int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const TmaMap& map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(reinterpret_cast<unsigned long long>(&map)) : "memory");
}
// --8<-- [end:tma_ptx]

// --8<-- [start:tile]
// A tile of rows [row0, row0 + ROWS) × COLUMNS elements of (batch, head) of a [batch, heads, rows,
// columns] tensor of any strides (attention's Q, K, V, dO; stages 4 and 9) into shared memory at
// `tile`: column block b (64 elements, the 128 bytes a 128-byte-swizzled box may be wide) at
// tile + b·ROWS·128, so that every block is an array of swizzle atoms (8 rows × 128 bytes, 1024-byte
// aligned) -- the layout wgmma's descriptors describe. Each block is copied as boxes of TILE_BOX_ROWS
// rows, one after the other (the swizzle depends on the address only, so they compose into the layout
// one box would make), which keeps a tensor map's box no longer than a short head's rows.
constexpr int TILE_BOX_ROWS = 64;  // the rows of the tensor maps' boxes, which the launches build
constexpr int ATOM_COLS = SWIZZLE_BYTES / 2;  // their columns: the 16-bit elements of a 128-byte swizzle row

template <int ROWS, int COLUMNS>
__device__ __forceinline__ void load_tile(unsigned tile, const TmaMap& map, unsigned full_barrier, int row0, int head,
                                          int batch) {
    static_assert(ROWS % TILE_BOX_ROWS == 0 && COLUMNS % ATOM_COLS == 0, "a tile is whole boxes");
#pragma unroll
    for (int b = 0; b < COLUMNS / ATOM_COLS; ++b)
#pragma unroll
        for (int r = 0; r < ROWS / TILE_BOX_ROWS; ++r)
            tma_load_4d(tile + (b * ROWS + r * TILE_BOX_ROWS) * SWIZZLE_BYTES, map, full_barrier, b * ATOM_COLS,
                        row0 + r * TILE_BOX_ROWS, head, batch);
}
// --8<-- [end:tile]

// ---- TMA stores (stage 6) -----------------------------------------------------------------------
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
                 :: "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(src) : "memory");
}

__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until at most PENDING of this thread's committed bulk groups have still to read their shared
// memory (the buffers of the others are free).
template <int PENDING = 0>
__device__ __forceinline__ void tma_store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(PENDING) : "memory");
}
// --8<-- [end:tma_store]

// ---- warp specialization ------------------------------------------------------------------------
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

// ---- bulk copies without a tensor map (stage 9) -------------------------------------------------
// Copies `bytes` (a multiple of 16) contiguous bytes from global `source` to shared `destination`
// (both 16-byte aligned) and counts them on the mbarrier `bar`, as tma_load_3d does: for the small
// vectors (a query tile's LSE and Δ) that ride along with the tiles.
__device__ __forceinline__ void bulk_load(unsigned destination, const void* source, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(destination), "l"(reinterpret_cast<unsigned long long>(source)), "r"(bytes), "r"(bar)
                 : "memory");
}

// Adds `bytes` (a multiple of 16) of fp32 values at shared `source` to those at global `destination`
// (both 16-byte aligned), element by element, atomically: a whole tile of red.add in one instruction.
// It belongs to the bulk group of tma_store_commit(), and tma_store_wait_read() frees its buffer.
__device__ __forceinline__ void bulk_reduce_add_f32(float* destination, unsigned source, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(reinterpret_cast<unsigned long long>(destination)), "r"(source), "r"(bytes) : "memory");
}
