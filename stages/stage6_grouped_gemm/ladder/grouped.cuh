// What the two lower rungs of stage 6's ladder share (simt.cu: CUDA cores; mma_sync.cu: mma.sync).
//
// Both compute what experts.cu computes, with the same kernels, signatures and tile order:
//   expert_up_swiglu   h[rows of e] = silu(x·W1[e][:, :I]) * (x·W1[e][:, I:])    [rows, I]
//   expert_down        y[rows of e] = h · W2[e]                                   [rows, hidden]
// as persistent grids of 256-thread blocks that walk the 128 × 128 output tiles of schedule.cuh's
// scheduler. They differ only in how a block multiplies its tile: each rung defines grouped_gemm,
// which the two kernels at the end of this file call. What is here: the tile geometry, where each
// 16-byte chunk of a tile's operands comes from (with the bounds checks: hidden and inter are
// multiples of 8, so a chunk of 8 elements is wholly inside or wholly outside), where each output
// goes, the persistent loop, and the kernels.
#pragma once
#include "moe.cuh"
#include "stage6_grouped_gemm/schedule.cuh"

constexpr int BLOCK_N = 128;                          // output columns per tile (BLOCK_M = 128 rows)
constexpr int NUM_THREADS = 256;                      // 8 warps
constexpr int OFFSETS_BYTES = 4 * (MAX_EXPERTS + 1);  // the experts' offsets, in shared memory
// Blocks an SM holds at once, the kernels' __launch_bounds__ minimum: the up kernel's threads hold
// twice the accumulators (gate and up) and need the registers of a whole SM; the down kernel's fit two.
template <bool SWIGLU> constexpr int BLOCKS_PER_SM = SWIGLU ? 1 : 2;
static_assert(sizeof(elem_t) == 2, "a 16-byte chunk holds 8 elements");

// One output tile's operands. A: the tile's 128 rows of the activations [rows, k]. B: the expert's
// weights [k, b_cols], of which the tile reads B_COLS columns -- BLOCK_N, or with SwiGLU 2·BLOCK_N:
// the gate columns col0 .. col0 + 127, then the up columns n_out (= inter) further right, so that
// tile columns c and c + BLOCK_N of the product hold the gate and the up value of output column c.
template <bool SWIGLU>
struct TileOperands {
    static constexpr int B_COLS = SWIGLU ? 2 * BLOCK_N : BLOCK_N;
    const elem_t* a;  // row 0 of the tile in A
    const elem_t* b;  // row 0 of the expert's B
    elem_t* out;      // row 0 of the tile in the output [rows, n_out]
    int k, n_out, col0;

    __device__ TileOperands(const Tile& tile, const elem_t* a_all, const elem_t* b_all, elem_t* out_all, int k,
                            int n_out)
        : a(a_all + (size_t)tile.row0 * k),
          b(b_all + (size_t)tile.expert * k * (SWIGLU ? 2 * n_out : n_out)),
          out(out_all + (size_t)tile.row0 * n_out),
          k(k), n_out(n_out), col0(tile.n * BLOCK_N) {}

    // Chunk `chunk` (columns k0 + 8·chunk .. + 7) of tile row `row` of A; null past the end of K.
    __device__ const elem_t* a_chunk(int row, int k0, int chunk) const {
        const int column = k0 + 8 * chunk;
        return column < k ? a + (size_t)row * k + column : nullptr;
    }

    // Chunk `chunk` (tile columns 8·chunk .. + 7) of row k0 + row of B; null past K or past n_out.
    __device__ const elem_t* b_chunk(int row, int k0, int chunk) const {
        const int k_row = k0 + row, column = col0 + 8 * chunk % BLOCK_N;
        if (k_row >= k || column >= n_out) return nullptr;
        const int b_cols = SWIGLU ? 2 * n_out : n_out;
        return b + (size_t)k_row * b_cols + column + (SWIGLU && 8 * chunk >= BLOCK_N ? n_out : 0);
    }

    // Where output (tile row `row`, tile column `col`) goes; null past n_out. Every row of a tile
    // exists (the segments are padded to whole tiles), and n_out is a multiple of 8: a group of
    // 2 or 4 columns starting at an even or a 4-aligned `col` is wholly inside or outside.
    __device__ elem_t* out_at(int row, int col) const {
        return col0 + col < n_out ? out + (size_t)row * n_out + col0 + col : nullptr;
    }
};

// What an output becomes from the fp32 product: the up kernel's silu(gate) * up, the down kernel's y.
template <bool SWIGLU>
__device__ __forceinline__ float output_value(float product, float up_product) {
    return SWIGLU ? silu(product) * up_product : product;
}

// The persistent loop: the offsets into shared memory, then `multiply(tile)` for this block's
// tiles blockIdx.x, + gridDim.x, ... (schedule.cuh). Every thread of the block walks them all.
template <class Multiply>
__device__ __forceinline__ void for_each_tile(int* shared_offsets, const int* offsets, int experts, int n_out,
                                              Multiply&& multiply) {
    for (int e = threadIdx.x; e <= experts; e += NUM_THREADS) shared_offsets[e] = __ldg(offsets + e);
    __syncthreads();
    const Scheduler scheduler{shared_offsets, experts, (n_out + BLOCK_N - 1) / BLOCK_N};
    const int num_tiles = scheduler.num_tiles();
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) multiply(scheduler.tile(t));
}

// out[rows of e, n_out] = A[rows of e, k] · B[e][k, ...] for every expert e with rows, the tiles
// walked by for_each_tile; the up kernel's B is W1 [E, k, 2·n_out], the down kernel's W2 [E, k, n_out].
// Defined by each rung (simt.cu, mma_sync.cu), after this header.
template <bool SWIGLU>
__device__ __forceinline__ void grouped_gemm(const elem_t* a, const elem_t* b, elem_t* out, const int* offsets,
                                             int experts, int n_out, int k);

// The kernels: their operands, then moe.cuh's ExpertParams, one for both (experts.cu's kernels take it too).
// h = silu(x_perm · W1_gate) * (x_perm · W1_up), per expert. W1 is [E, hidden, 2·inter].
extern "C" __global__ void __launch_bounds__(NUM_THREADS, BLOCKS_PER_SM<true>)
expert_up_swiglu(const elem_t* __restrict__ x_perm, const elem_t* __restrict__ w1, elem_t* __restrict__ h,
                 const __grid_constant__ ExpertParams p) {
    grouped_gemm<true>(x_perm, w1, h, p.offsets, p.experts, p.inter, p.hidden);
}

// y = h · W2, per expert. W2 is [E, inter, hidden].
extern "C" __global__ void __launch_bounds__(NUM_THREADS, BLOCKS_PER_SM<false>)
expert_down(const elem_t* __restrict__ h, const elem_t* __restrict__ w2, elem_t* __restrict__ y,
            const __grid_constant__ ExpertParams p) {
    grouped_gemm<false>(h, w2, y, p.offsets, p.experts, p.hidden, p.inter);
}
