// Stage 14 — the MoE layer's backward on Hopper: the grouped GEMMs of the gradients (TMA + wgmma). sm_90a only.
//
// The forward (stage 7) ran two grouped GEMMs per expert e over its rows of the permuted tokens:
//   h1 = x·W1[e] = [G U],  h = silu(G) * U,  y = h·W2[e].
// Its backward runs each product twice more, once for the data and once for the weights:
//   data side    dH = dY·W2[e]ᵀ                [rows, inter]      (dY: the token's dY, per row)
//                dX = [dG dU]·W1[e]ᵀ           [rows, hidden]
//   weight side  dW2[e] = hᵀ·(w·dY)            [inter, hidden]    a sum over expert e's rows
//                dW1[e] = xᵀ·[dG dU]           [hidden, 2·inter]  (w: the row's top-k weight)
// and the forward's h1 = x·W1[e] once more (the backward's inputs hold no activations): stage 6's
// expert_down with W1 as its B (included below, unchanged).
//
// New here:
//   expert_grad_data    stage 6's persistent grouped GEMM with the weight read TRANSPOSED: B[e] is
//            [n][k] in memory (W2[e] is [inter][hidden] and dH's k is hidden), so its TMA boxes are
//            64 n-rows × 64 k-columns, the layout of a K-major operand, and the wgmma takes B K-major
//            (imm-trans-b = 0) -- the same 128-byte-swizzled atoms as A's, 8 n-rows 1024 bytes apart.
//   expert_grad_weight  a grouped GEMM whose REDUCTION runs over the groups: dW[e] = A_eᵀ·B_e, A_e and
//            B_e expert e's rows of [rows, M] and [rows, N]. K is the expert's row count, different
//            for every expert and known on the device only. The output tiles are fixed (E × M/128 ×
//            N/256 of them, whatever the routing); each tile's main loop runs over its expert's rows,
//            64 at a time, offsets[e] .. offsets[e+1]. A is read transposed: a TMA box of 64 rows ×
//            64 m-columns is, in shared memory, [k][m] with m contiguous -- an MN-major A, which wgmma
//            takes with imm-trans-a = 1 (wgmma_grad.cuh), described as stage 6 describes its MN-major B.
//            An expert with no rows has no k-step: its tiles store zeros (dW[e] = 0, written).
// The padding rows of each expert's segment (stage 5 pads segments to 128 rows) are zero in x, dY
// and so in every product: they add nothing to the weight gradients.
//
// Per tile and stage both kernels move what stage 6 moves (A 128 × 64, B 64 × 256: 48 KB) and issue
// the same 4 wgmma.m64n256k16 per consumer; the ring, the producer warp, the epilogue through shared
// memory and TMA stores are stage 6's.
#include "stage6_grouped_gemm/experts.cu"  // stage 6: expert_down, BLOCK_*, the ring's layout, stage_tile
#include "wgmma_grad.cuh"  // stage 14: wgmma m64n256k16 with B K-major, and with A and B MN-major

constexpr int A_BOX_BYTES = 64 * BOX_COLS * 2;  // expert_grad_weight: a 64-row × 64-column box of A, 8 KB
static_assert(CONSUMERS * A_BOX_BYTES == A_BYTES, "the weight kernel's A stage is one box per consumer");

enum GradKind { DATA = 0, WEIGHT = 1 };

// An expert without rows: its tiles of dW are zeros, staged straight into the consumer's output
// buffer (zeroing the accumulator instead, on a path beside the wgmmas', made ptxas spill it).
__device__ __forceinline__ void stage_zeros(unsigned char* buffer) {
    uint4* out = reinterpret_cast<uint4*>(buffer);
    for (int i = threadIdx.x % 128; i < EPILOGUE_BYTES / 16; i += 128) out[i] = make_uint4(0, 0, 0, 0);
}

// A tile of either kernel: the expert, the output's row tile (DATA: the first permuted row; WEIGHT:
// m, in 128-row tiles of dW[e]), its 256-column tile n, and the k-steps of its main loop.
struct GradTile {
    int expert, row0, n, k_blocks;
};

// --8<-- [start:weight_tile]
// expert_grad_weight's tile t: experts one after the other, inside an expert the m-tiles fastest
// (stage 6's order); the reduction runs over the expert's padded rows, 64 per k-step.
__device__ __forceinline__ GradTile weight_tile(const int* offsets, int t, int m_tiles, int n_tiles) {
    const int per_expert = m_tiles * n_tiles, e = t / per_expert, local = t % per_expert;
    return {e, (local % m_tiles) * BLOCK_M, local / m_tiles, (offsets[e + 1] - offsets[e]) / BLOCK_K};
}
// --8<-- [end:weight_tile]

// --8<-- [start:mainloop]
// stage 6's main loop with the operands' layouts of KIND: DATA, A K-major (as stage 6) and B K-major
// (n-rows of 128 bytes, 8-row groups 1024 bytes apart, k stepped 32 bytes along the rows); WEIGHT, A
// MN-major (this consumer's 64 m-columns are one box: k runs down its 128-byte rows, 16 k = 2048
// bytes) and B MN-major (as stage 6). At least one k-step (the caller stages zeros without).
template <int KIND>
__device__ __forceinline__ void grad_mainloop(float (&acc)[ACC_FRAGS][4], unsigned base, int consumer, int k_blocks,
                                              int& it) {
    const bool lane0 = threadIdx.x % 32 == 0;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int stage = it % STAGES;
        const unsigned a_tile = base + stage * STAGE_BYTES, b_tile = a_tile + A_BYTES;
        mbarrier_wait(base + BARRIERS + 8 * (FULL + stage), (it / STAGES) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
            if (KIND == DATA) {
                const u64 a = make_smem_desc(a_tile + consumer * CONSUMER_ROWS * 128 + kk * 32, 16, 1024);
                const u64 b = make_smem_desc(b_tile + kk * 32, 16, 1024);
                wgmma_ss<elem_t, BLOCK_N, K_MAJOR>(acc, a, b, kb > 0 || kk > 0);
            } else {
                const u64 a = make_smem_desc(a_tile + consumer * A_BOX_BYTES + kk * 16 * 128, A_BOX_BYTES, 1024);
                const u64 b = make_smem_desc(b_tile + kk * 16 * 128, B_BOX_BYTES, 1024);
                wgmma_ss_a_mn<elem_t, BLOCK_N, MN_MAJOR>(acc, a, b, kb > 0 || kk > 0);
            }
        }
        wgmma_commit();
        wgmma_wait<1>();
        if (kb > 0 && lane0) mbarrier_arrive(base + BARRIERS + 8 * (EMPTY + (it - 1) % STAGES));
    }
    wgmma_wait<0>();
    fence_registers(acc);
    if (lane0) mbarrier_arrive(base + BARRIERS + 8 * (EMPTY + (it - 1) % STAGES));
}
// --8<-- [end:mainloop]

// DATA: out[rows of e, n_out] = A[rows of e, k] · B[e]ᵀ, B[e] as [n_out, k] (a_map: [1, rows, k],
//   boxes 1 × 128 × 64; b_map: [E, n_out, k], boxes 1 × 64 × 64; out_map: [1, rows, n_out]).
// WEIGHT: out[e][m_out, n_out] = A[rows of e, m_out]ᵀ · B[rows of e, n_out] (a_map: [1, rows, m_out],
//   boxes 1 × 64 × 64; b_map: [1, rows, n_out], boxes 1 × 64 × 64; out_map: [E, m_out, n_out]).
// `k` is DATA's K; WEIGHT's is the rows, and `k` is m_out. Out-boxes 1 × 64 × 64; all 128-byte swizzled.
template <int KIND>
__device__ void grad_gemm(const TmaMap& a_map, const TmaMap& b_map, const TmaMap& out_map,
                          const int* __restrict__ offsets, int experts, int n_out, int k) {
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    const unsigned base = (shared_address(shared_raw) + 1023) & ~1023u;
    unsigned char* aligned = shared_raw + (base - shared_address(shared_raw));
    int* expert_offsets = reinterpret_cast<int*>(aligned + OFFSETS);
    auto barrier = [&](int index) { return base + BARRIERS + 8 * index; };

    for (int e = threadIdx.x; e <= experts; e += NUM_THREADS) expert_offsets[e] = offsets[e];
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(barrier(FULL + s), 1);
            mbarrier_init(barrier(EMPTY + s), CONSUMERS * 4);
        }
        mbarrier_init_fence();
    }
    __syncthreads();

    const int n_tiles = (n_out + BLOCK_N - 1) / BLOCK_N, m_tiles = (k + BLOCK_M - 1) / BLOCK_M;
    const Scheduler scheduler{expert_offsets, experts, n_tiles};
    const int num_tiles = KIND == DATA ? scheduler.num_tiles() : experts * m_tiles * n_tiles;
    auto tile_of = [&](int t) -> GradTile {
        if (KIND == WEIGHT) return weight_tile(expert_offsets, t, m_tiles, n_tiles);
        const Tile tile = scheduler.tile(t);
        return {tile.expert, tile.row0, tile.n, (k + BLOCK_K - 1) / BLOCK_K};
    };
    const int warpgroup = threadIdx.x / 128;
    int it = 0;

    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        tma_prefetch_map(a_map);
        tma_prefetch_map(b_map);
        tma_prefetch_map(out_map);
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const GradTile tile = tile_of(t);
            for (int kb = 0; kb < tile.k_blocks; ++kb, ++it) {
                const int stage = it % STAGES;
                const unsigned a_tile = base + stage * STAGE_BYTES, b_tile = a_tile + A_BYTES;
                mbarrier_wait(barrier(EMPTY + stage), ((it / STAGES) & 1) ^ 1);
                mbarrier_arrive_expect_tx(barrier(FULL + stage), STAGE_BYTES);
                if (KIND == DATA) {
                    tma_load_3d(a_tile, a_map, barrier(FULL + stage), kb * BLOCK_K, tile.row0, 0);
#pragma unroll
                    for (int box = 0; box < B_BOXES; ++box)  // 64 n-rows of B[e] each, k-columns kb·64 ...
                        tma_load_3d(b_tile + box * B_BOX_BYTES, b_map, barrier(FULL + stage), kb * BLOCK_K,
                                    tile.n * BLOCK_N + box * 64, tile.expert);
                } else {
                    // EXERCISE: the first of this k-step's 64 rows: the reduction of dW[e] runs over expert
                    // e's own rows of the permuted buffers, from its segment's start (expert_offsets, in
                    // shared memory) on, 64 rows per k-step kb. Left as it is, every expert sums the first rows.
                    // STUB: const int row = kb * BLOCK_K;
                    const int row = expert_offsets[tile.expert] + kb * BLOCK_K;  // this k-step's 64 rows
                    // END EXERCISE
#pragma unroll
                    for (int c = 0; c < CONSUMERS; ++c)  // each consumer's 64 m-columns of A
                        tma_load_3d(a_tile + c * A_BOX_BYTES, a_map, barrier(FULL + stage),
                                    tile.row0 + c * CONSUMER_ROWS, row, 0);
#pragma unroll
                    for (int box = 0; box < B_BOXES; ++box)
                        tma_load_3d(b_tile + box * B_BOX_BYTES, b_map, barrier(FULL + stage),
                                    tile.n * BLOCK_N + box * BOX_COLS, row, 0);
                }
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int consumer = warpgroup - 1, lane = threadIdx.x % 32, warp_in_group = threadIdx.x / 32 % 4;
        const bool storer = threadIdx.x % 128 == 0;
        const int my_barrier = 1 + consumer;
        unsigned char* buffer = aligned + EPILOGUE + consumer * EPILOGUE_BYTES;
        float acc[ACC_FRAGS][4];
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const GradTile tile = tile_of(t);
            if (tile.k_blocks > 0) grad_mainloop<KIND>(acc, base, consumer, tile.k_blocks, it);
            if (storer) tma_store_wait_read();
            named_barrier_sync(my_barrier, 128);
            if (tile.k_blocks > 0) stage_tile<false>(acc, buffer, warp_in_group, lane);
            else stage_zeros(buffer);
            fence_async_shared();
            named_barrier_sync(my_barrier, 128);
            if (storer) {
                // DATA: rows row0 + 64·consumer of the permuted output; WEIGHT: rows of dW[e].
                const int out_row = tile.row0 + consumer * CONSUMER_ROWS, out_batch = KIND == DATA ? 0 : tile.expert;
                for (int box = 0; box < B_BOXES; ++box)
                    tma_store_3d(out_map, base + EPILOGUE + consumer * EPILOGUE_BYTES + box * OUT_BOX_BYTES,
                                 tile.n * BLOCK_N + box * BOX_COLS, out_row, out_batch);
                tma_store_commit();
            }
        }
        if (storer) tma_store_wait_read();
    }
}

// out = A · B[e]ᵀ over each expert's rows: dH = dY·W2ᵀ (B = W2 [E, inter, hidden], n_out = inter,
// k = hidden) and dX = [dG dU]·W1ᵀ (B = W1 [E, hidden, 2·inter], n_out = hidden, k = 2·inter).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_grad_data(const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap b_map,
                 const __grid_constant__ TmaMap out_map, const int* __restrict__ offsets, int experts, int n_out,
                 int k) {
    grad_gemm<DATA>(a_map, b_map, out_map, offsets, experts, n_out, k);
}

// dW[e] = A_eᵀ · B_e over each expert's rows: dW1 (A = x, B = [dG dU]: m_out = hidden, n_out = 2·inter)
// and dW2 (A = h, B = w·dY: m_out = inter, n_out = hidden). Every expert's dW[e] is written.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_grad_weight(const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap b_map,
                   const __grid_constant__ TmaMap out_map, const int* __restrict__ offsets, int experts, int m_out,
                   int n_out) {
    grad_gemm<WEIGHT>(a_map, b_map, out_map, offsets, experts, n_out, m_out);
}
