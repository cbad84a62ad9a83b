// Stage 14 — the MoE layer's backward on Hopper, from what the forward saved (TMA + wgmma). sm_90a only.
//
// The forward (stage 7) ran, for each expert e over its rows of the permuted token-slots,
//   h1 = x·W1[e] = [G U],  h = silu(G) * U,  y = h·W2[e],  out[t] = Σ_j w[t, j] · y[row of (t, j)]
// and kept h1, the routing and the permutation. From dY the backward needs four products -- each forward
// product has a data side and a weight side -- and nothing recomputed:
//   dA = dY·W2[e]ᵀ         [rows, inter]    data side of y = h·W2 (unweighted: w enters below)
//   dX = [dG dU]·W1[e]ᵀ    [rows, hidden]   data side of h1 = x·W1
//   dW2[e] = (w·h)ᵀ·dY      [inter, hidden]  weight sides: sums over expert e's rows
//   dW1[e] = xᵀ·[dG dU]     [hidden, 2·inter]
// where SwiGLU's backward turns dA into [dG dU] row by row (dh = w·dA):
//   dG = dh · U · silu'(G),  silu'(G) = s·(1 + G·(1 − s)), s = sigmoid(G)      dU = dh · silu(G)
// and the top-k weight's gradient is a row reduction of the same tile: g = dY·y = dY·(h·W2) = dA·h.
//
// New here, on stage 6's persistent grouped GEMM (its ring, producer warp and tile scheduler):
//   expert_grad_swiglu  dA's tile never reaches memory: the epilogue reads G and U of the same rows and
//            columns from h1, writes dG, dU and w·h (dW2's A operand), and sums dA·h along its columns
//            into one partial g per row and column tile (no atomics: the router's backward adds the
//            partials in a fixed order).
//   expert_grad_data    the weight read TRANSPOSED: B[e] is [n][k] in memory (W1[e] is [hidden][2·inter]
//            and dX's k is 2·inter), so its TMA boxes are 64 n-rows × 64 k-columns, the layout of a
//            K-major operand, and the wgmma takes B K-major (imm-trans-b = 0).
//   expert_grad_weight  a grouped GEMM whose REDUCTION runs over the groups: dW[e] = A_eᵀ·B_e, A_e and
//            B_e expert e's rows of [rows, M] and [rows, N]. K is the expert's row count, different for
//            every expert and known on the device only. The output tiles are fixed (E × M/128 × N/256,
//            whatever the routing); each tile's main loop runs over its expert's rows, 64 at a time. A is
//            read transposed: a TMA box of 64 rows × 64 m-columns is, in shared memory, [k][m] with m
//            contiguous -- an MN-major A, which wgmma takes with imm-trans-a = 1 (wgmma_grad.cuh). An
//            expert with no rows has no k-step: its tiles store zeros (dW[e] = 0, written).
//   gather_gradient_rows, router_backward, router_weight_grad + router_weight_sum, combine_gradients
//            the permutation both ways and the router, small kernels around the GEMMs.
// The padding rows of each expert's segment add nothing to the weights' gradients: their top-k weight is
// 0, so dG, dU and w·h are 0 there (selected, whatever h1 holds in them).
#define GROUPED_GEMM_MACHINERY_ONLY  // stage 6's device code without its kernels
#include "stage6_grouped_gemm/experts.cu"  // stage 6: BLOCK_*, the ring's layout, Scheduler, stage_tile
#include "wgmma_grad.cuh"  // stage 14: wgmma m64n256k16 with B K-major, and with A and B MN-major

constexpr int A_BOX_BYTES = 64 * BOX_COLS * 2;  // expert_grad_weight: a 64-row × 64-column box of A, 8 KB
static_assert(CONSUMERS * A_BOX_BYTES == A_BYTES, "the weight kernel's A stage is one box per consumer");
constexpr int GATHER_THREADS = 128;           // gather_gradient_rows and combine_gradients: a block per row
constexpr int ROUTER_BACKWARD_THREADS = 256;  // router_backward: a warp per token, 8 warps a block
constexpr int RWG_THREADS = 256, RWG_COLS = 64, RWG_TOKENS = 32;  // router_weight_grad's block and tile
constexpr int RWG_MAX_EXPERT_BLOCK = 64;   // router_weight_grad: experts a block at most

enum GradKind { DATA = 0, WEIGHT = 1, SWIGLU_DATA = 2 };

// What expert_grad_swiglu's epilogue reads and writes besides the accumulator.
struct SwigluGrad {
    const elem_t* h1;          // [rows, 2·inter], the forward's [G U]
    const float* row_weight;   // [rows], the row's top-k weight w, 0 on padding rows (read with __ldg)
    elem_t* dgu;               // [rows, 2·inter], [dG dU]
    elem_t* hw;                // [rows, inter], w·h
    float* g_partial;          // [column tiles, rows], Σ dA·h over one tile's columns
    int inter, rows;
};

// expert_grad_swiglu's parameters besides its tensor maps (__init__.py's SwigluGradParams packs them):
// SwigluGrad's fields, each expert's first row and the GEMM's sizes. `rows`: the length of the permuted
// buffers, g_partial's stride.
struct SwigluGradParams {
    const elem_t* h1;
    const float* row_weight;
    elem_t *dgu, *hw;
    float* g_partial;
    const int* offsets;  // [E + 1]
    int experts, inter, hidden, rows;
};

// expert_grad_data's parameters besides its tensor maps (__init__.py's DataGradParams packs them).
struct DataGradParams {
    const int* offsets;  // [E + 1], each expert's first row
    int experts, n_out, k;
};

// expert_grad_weight's parameters besides its tensor maps (__init__.py's WeightGradParams packs them).
struct WeightGradParams {
    const int *offsets, *counts;  // [E + 1] and [E]: each expert's first row and its token-slots
    int experts, m_out, n_out;
};

// An expert without rows: its tiles of dW are zeros, staged straight into the consumer's output
// buffer (zeroing the accumulator instead, on a path beside the wgmmas', made ptxas spill it).
__device__ __forceinline__ void stage_zeros(unsigned char* buffer) {
    uint4* out = reinterpret_cast<uint4*>(buffer);
    for (int i = threadIdx.x % WARPGROUP_THREADS; i < EPILOGUE_BYTES / 16; i += WARPGROUP_THREADS)
        out[i] = make_uint4(0, 0, 0, 0);
}

// A tile of any kind: the expert, the output's row tile (DATA: the first permuted row; WEIGHT: m, in
// 128-row tiles of dW[e]), its 256-column tile n, and the k-steps of its main loop.
struct GradTile {
    int expert, row0, n, k_blocks;
};

// --8<-- [start:weight_tile]
// expert_grad_weight's tile t: experts one after the other, inside an expert the m-tiles fastest
// (stage 6's order); the reduction runs over the expert's rows, 64 per k-step, to the k-step holding
// its last token-slot: the padding rows after it add zeros (their w is 0). Skipping them saves a k-step
// wherever an expert's last 128-row tile holds 64 rows or fewer: one of 2 to 4 at 128 rows an expert.
__device__ __forceinline__ GradTile weight_tile(const int* offsets, const int* counts, int t, int m_tiles,
                                                int n_tiles) {
    const int per_expert = m_tiles * n_tiles, e = t / per_expert, local = t % per_expert;
    return {e, (local % m_tiles) * BLOCK_M, local / m_tiles, (__ldg(counts + e) + BLOCK_K - 1) / BLOCK_K};
}
// --8<-- [end:weight_tile]

// --8<-- [start:mainloop]
// stage 6's main loop with the operands' layouts of KIND: DATA and SWIGLU_DATA, A K-major (as stage 6)
// and B K-major (n-rows of 128 bytes, 8-row groups 1024 bytes apart, k stepped 32 bytes along the rows);
// WEIGHT, A MN-major (this consumer's 64 m-columns are one box: k runs down its 128-byte rows, 16 k =
// 2048 bytes) and B MN-major (as stage 6). At least one k-step (the caller stages zeros without).
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
            if (KIND == WEIGHT) {
                const u64 a = make_smem_desc(a_tile + consumer * A_BOX_BYTES + kk * 16 * SWIZZLE_BYTES, A_BOX_BYTES,
                                             SWIZZLE_ATOM_BYTES);
                const u64 b = make_smem_desc(b_tile + kk * 16 * SWIZZLE_BYTES, B_BOX_BYTES, SWIZZLE_ATOM_BYTES);
                wgmma_ss_a_mn<elem_t, BLOCK_N, MN_MAJOR>(acc, a, b, kb > 0 || kk > 0);
            } else {
                const u64 a = make_smem_desc(a_tile + consumer * CONSUMER_ROWS * SWIZZLE_BYTES + kk * 32, 16,
                                             SWIZZLE_ATOM_BYTES);
                const u64 b = make_smem_desc(b_tile + kk * 32, 16, SWIZZLE_ATOM_BYTES);
                wgmma_ss<elem_t, BLOCK_N, K_MAJOR>(acc, a, b, kb > 0 || kk > 0);
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

// --8<-- [start:swiglu_epilogue]
// The epilogue needs G and U of the tile's rows and columns from h1. Read from memory at the end of the
// tile, the loads' round trips stood between the main loop and the next one (with the accumulator in the
// registers, few loads fit in flight: Nsight Compute put 42% of the kernel's stalls on them, and the
// product ran at 0.62x its speed without the epilogue). So they come by cp.async into the consumer's
// shared-memory buffer, a 64-column box of G and of U at a time in two slots: the first two boxes while
// the tile's main loop runs, each later box while the box before it is worked on.
constexpr int GU_BOXES = BLOCK_N / BOX_COLS;             // a tile's 64-column boxes of G (and of U)
constexpr int GU_BOX_BYTES = CONSUMER_ROWS * BOX_COLS * 2;  // 64 rows × 64 columns: 8 KB
constexpr int GU_SLOT_BYTES = 2 * GU_BOX_BYTES;           // a box of G, then the same box of U
static_assert(2 * GU_SLOT_BYTES == EPILOGUE_BYTES, "two slots fill a consumer's epilogue buffer");
// Each consumer's box of w·h on its way out, past stage 6's layout (dG and dU take G's and U's places).
constexpr int HW_STAGING = (BARRIERS + 8 * 2 * STAGES + SWIZZLE_BYTES - 1) / SWIZZLE_BYTES * SWIZZLE_BYTES;
constexpr int SWIGLU_SHARED_BYTES = HW_STAGING + CONSUMERS * GU_BOX_BYTES + SWIZZLE_ATOM_BYTES;  // + room to align the base
static_assert(SWIGLU_SHARED_BYTES <= 227 * 1024, "an H100 block has at most 227 KB of shared memory");

// Box `box` of G and U for this consumer's 64 rows, into slot box % 2 (rows of 128 bytes, swizzled), as
// one cp.async group: 8 chunks of 16 bytes per thread. Columns past inter are zero-filled.
__device__ __forceinline__ void load_gate_up(const SwigluGrad& p, unsigned char* buffer, int row0, int n, int box) {
    const unsigned slot = shared_address(buffer) + (box % 2) * GU_SLOT_BYTES;
    const int col0 = n * BLOCK_N + box * BOX_COLS;
    for (int i = threadIdx.x % WARPGROUP_THREADS; i < 2 * CONSUMER_ROWS * 8; i += WARPGROUP_THREADS) {
        const int half = i / (CONSUMER_ROWS * 8), row = i / 8 % CONSUMER_ROWS, chunk = i % 8;  // half 0: G, 1: U
        const int col = col0 + 8 * chunk;
        const elem_t* from = p.h1 + (size_t)(row0 + row) * 2 * p.inter + half * p.inter + col;
        cp_async_16(slot + half * GU_BOX_BYTES + swizzle<SWIZZLE_BYTES>(row, chunk), from, col < p.inter);
    }
    cp_async_commit();
}

// One consumer's 64 × 256 tile of dA (rows row0.., columns 256·n.. of inter), through SwiGLU's backward
// into dG, dU and w·h, and its rows' sums of dA·h. Entry j of a warp's float[32][4] is rows r, r + 8 ×
// columns 8j + 2·(lane % 4), +1 (r = 16·warp + lane / 4), so fragment j is chunk j % 8 of box j / 8: the
// 8 rows of a warp's read lie in 8 different chunk positions, conflict-free. dG and dU take G's and U's
// places, w·h the staging box, and store_box copies the box out; the 4 lanes of a quad share a row, and
// their sums of dA·h meet by two shuffles. The sigmoid takes the fast reciprocal (2 ulp): the outputs are
// 16-bit, and g's sum over a row is far coarser than that.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// A box's dG, dU (in G's and U's places in the slot) and w·h (in `staging`) out to memory: 16 bytes a
// thread and step, a warp's stores 4 rows × 128 bytes, whole sectors (stored from the accumulator's layout,
// 8 rows × 16 bytes a warp, the tile's stores took longer than its main loop).
template <bool FULL>
__device__ __forceinline__ void store_box(const SwigluGrad& p, const unsigned char* slot, const unsigned char* staging,
                                          int row0, int col) {
#pragma unroll 1  // the accumulator holds the other boxes' values: no registers for more loads in flight
    for (int i = threadIdx.x % WARPGROUP_THREADS; i < 3 * CONSUMER_ROWS * 8; i += WARPGROUP_THREADS) {
        const int which = i / (CONSUMER_ROWS * 8), row = i / 8 % CONSUMER_ROWS, chunk = i % 8;  // dG, dU, w·h
        const int at = col + 8 * chunk;
        if (!FULL && at >= p.inter) continue;
        const unsigned char* from = (which < 2 ? slot + which * GU_BOX_BYTES : staging) +
                                   swizzle<SWIZZLE_BYTES>(row, chunk);
        elem_t* to = which < 2 ? p.dgu + (size_t)(row0 + row) * 2 * p.inter + which * p.inter + at
                               : p.hw + (size_t)(row0 + row) * p.inter + at;
        *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
    }
}

template <bool FULL>  // all 256 columns inside inter (every tile at the benchmark shapes): no test at all
__device__ __forceinline__ void swiglu_grad_tile(const float (&acc)[ACC_FRAGS][4], const SwigluGrad& p,
                                                 unsigned char* buffer, unsigned char* staging, int row0, int n,
                                                 int my_barrier) {
    const int lane = threadIdx.x % 32, warp_in_group = threadIdx.x / 32 % 4;
    const int local_rows[2] = {warp_in_group * 16 + lane / 4, warp_in_group * 16 + lane / 4 + 8};
    float w[2], g[2] = {0.0f, 0.0f};
#pragma unroll
    for (int half = 0; half < 2; ++half) w[half] = __ldg(p.row_weight + row0 + local_rows[half]);
#pragma unroll
    for (int box = 0; box < GU_BOXES; ++box) {
        if (box + 1 < GU_BOXES) cp_async_wait<1>();  // this box's group is in; the next may still load
        else cp_async_wait<0>();
        named_barrier_sync(my_barrier, WARPGROUP_THREADS);  // ... and every thread's copies of it
        unsigned char* slot = buffer + (box % 2) * GU_SLOT_BYTES;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const bool padding = w[half] == 0.0f;  // h1 may hold anything there: zeros selected, not multiplied
#pragma unroll
            for (int chunk = 0; chunk < 8; ++chunk) {
                // Columns past inter hold zeros (load_gate_up's): computed harmlessly, not stored. No branch
                // around the arithmetic, so that the compiler can interleave many elements' latencies.
                const int j = box * 8 + chunk, place = swizzle<SWIZZLE_BYTES>(local_rows[half], chunk) + (lane % 4) * 4;
                unsigned char* at = slot + place;
                const unsigned gate_bits = *reinterpret_cast<const unsigned*>(at);
                const unsigned up_bits = *reinterpret_cast<const unsigned*>(at + GU_BOX_BYTES);
                float dg[2], du[2], hw[2];
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    // EXERCISE: SwiGLU's backward for element c of the pair. Its gate and up: the low 16 bits
                    // of gate_bits and up_bits for c = 0, the high for c = 1 (bits_to_float<elem_t>); its dA:
                    // acc[j][2·half + c], without the top-k weight w[half]. With s = sigmoid(gate) (the function above),
                    // silu(gate) = gate·s and h = silu(gate)·up: add dA·h to g[half] (the top-k weight's
                    // gradient, unweighted: dY·y = dA·h); then dh = w·dA, dg[c] = dh·up·silu'(gate) with
                    // silu'(x) = s + silu(x)·(1 − s), du[c] = dh·silu(gate), and hw[c] = w·h. Left as they
                    // are, dG, dU, w·h and g are all zero.
                    // STUB: (void)gate_bits; (void)up_bits; (void)j;
                    // STUB: dg[c] = du[c] = hw[c] = 0.0f;
                    const float gate = bits_to_float<elem_t>(c ? gate_bits >> 16 : gate_bits & 0xffffu);
                    const float up = bits_to_float<elem_t>(c ? up_bits >> 16 : up_bits & 0xffffu);
                    const float da = acc[j][2 * half + c];
                    const float s = sigmoid(gate), silu_gate = gate * s, h = silu_gate * up;
                    g[half] += da * h;  // the top-k weight's gradient, unweighted: dY·y = dA·h
                    const float dh = w[half] * da;
                    dg[c] = dh * up * (s + silu_gate * (1.0f - s));
                    du[c] = dh * silu_gate;
                    hw[c] = w[half] * h;
                    // END EXERCISE
                }
                *reinterpret_cast<unsigned*>(at) = padding ? 0u : pack_pair<elem_t>(dg[0], dg[1]);
                *reinterpret_cast<unsigned*>(at + GU_BOX_BYTES) = padding ? 0u : pack_pair<elem_t>(du[0], du[1]);
                *reinterpret_cast<unsigned*>(staging + place) = padding ? 0u : pack_pair<elem_t>(hw[0], hw[1]);
            }
        }
        named_barrier_sync(my_barrier, WARPGROUP_THREADS);  // the box's outputs are staged
        store_box<FULL>(p, slot, staging, row0, n * BLOCK_N + box * BOX_COLS);
        named_barrier_sync(my_barrier, WARPGROUP_THREADS);  // the slot and staging are read: box + 2 may load into the slot
        if (box + 2 < GU_BOXES) load_gate_up(p, buffer, row0, n, box + 2);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        g[half] += __shfl_xor_sync(FULL_MASK, g[half], 1);
        g[half] += __shfl_xor_sync(FULL_MASK, g[half], 2);
        if (lane % 4 == 0) p.g_partial[(size_t)n * p.rows + row0 + local_rows[half]] = g[half];
    }
}
// --8<-- [end:swiglu_epilogue]

// DATA, SWIGLU_DATA: out[rows of e, n_out] = A[rows of e, k] · B[e]ᵀ, B[e] as [n_out, k] (a_map: [1, rows,
//   k], boxes 1 × 128 × 64; b_map: [E, n_out, k], boxes 1 × 64 × 64; out_map: [1, rows, n_out], unused by
//   SWIGLU_DATA, whose epilogue writes `swiglu`'s outputs).
// WEIGHT: out[e][m_out, n_out] = A[rows of e, m_out]ᵀ · B[rows of e, n_out] (a_map: [1, rows, m_out],
//   boxes 1 × 64 × 64; b_map: [1, rows, n_out], boxes 1 × 64 × 64; out_map: [E, m_out, n_out]).
// `k` is DATA's K; WEIGHT's is the rows, and `k` is m_out. Out-boxes 1 × 64 × 64; all 128-byte swizzled.
// offsets and counts come from a parameter struct: they are read with __ldg.
template <int KIND>
__device__ void grad_gemm(const TmaMap& a_map, const TmaMap& b_map, const TmaMap& out_map, const SwigluGrad& swiglu,
                          const int* offsets, const int* counts, int experts, int n_out, int k) {
    extern __shared__ __align__(SWIZZLE_ATOM_BYTES) unsigned char shared_raw[];
    const unsigned base = atom_aligned(shared_address(shared_raw));
    unsigned char* aligned = shared_raw + (base - shared_address(shared_raw));
    int* expert_offsets = reinterpret_cast<int*>(aligned + OFFSETS);
    auto barrier = [&](int index) { return base + BARRIERS + 8 * index; };

    for (int e = threadIdx.x; e <= experts; e += NUM_THREADS) expert_offsets[e] = __ldg(offsets + e);
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
    const int num_tiles = KIND == WEIGHT ? experts * m_tiles * n_tiles : scheduler.num_tiles();
    auto tile_of = [&](int t) -> GradTile {
        if (KIND == WEIGHT) return weight_tile(expert_offsets, counts, t, m_tiles, n_tiles);
        const Tile tile = scheduler.tile(t);
        return {tile.expert, tile.row0, tile.n, (k + BLOCK_K - 1) / BLOCK_K};
    };
    const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
    int it = 0;

    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        tma_prefetch_map(a_map);
        tma_prefetch_map(b_map);
        if (KIND != SWIGLU_DATA) tma_prefetch_map(out_map);
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const GradTile tile = tile_of(t);
            for (int kb = 0; kb < tile.k_blocks; ++kb, ++it) {
                const int stage = it % STAGES;
                const unsigned a_tile = base + stage * STAGE_BYTES, b_tile = a_tile + A_BYTES;
                mbarrier_wait(barrier(EMPTY + stage), ((it / STAGES) & 1) ^ 1);
                mbarrier_arrive_expect_tx(barrier(FULL + stage), STAGE_BYTES);
                if (KIND != WEIGHT) {
                    tma_load_3d(a_tile, a_map, barrier(FULL + stage), kb * BLOCK_K, tile.row0, 0);
#pragma unroll
                    for (int box = 0; box < B_BOXES; ++box)  // 64 n-rows of B[e] each, k-columns kb·64 ...
                        tma_load_3d(b_tile + box * B_BOX_BYTES, b_map, barrier(FULL + stage), kb * BLOCK_K,
                                    tile.n * BLOCK_N + box * 64, tile.expert);
                } else {
                    // The reduction of dW[e] runs over expert e's own rows, 64 per k-step.
                    const int row = expert_offsets[tile.expert] + kb * BLOCK_K;
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
        const bool storer = threadIdx.x % WARPGROUP_THREADS == 0;
        const int my_barrier = 1 + consumer;
        unsigned char* buffer = aligned + EPILOGUE + consumer * EPILOGUE_BYTES;
        float acc[ACC_FRAGS][4];
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const GradTile tile = tile_of(t);
            const int out_row = tile.row0 + consumer * CONSUMER_ROWS;
            if (KIND == SWIGLU_DATA) {  // the epilogue's first two boxes of G and U load during the main loop
                load_gate_up(swiglu, buffer, out_row, tile.n, 0);
                load_gate_up(swiglu, buffer, out_row, tile.n, 1);
            }
            if (tile.k_blocks > 0) grad_mainloop<KIND>(acc, base, consumer, tile.k_blocks, it);
            if (KIND == SWIGLU_DATA) {
                unsigned char* staging = aligned + HW_STAGING + consumer * GU_BOX_BYTES;
                if ((tile.n + 1) * BLOCK_N <= swiglu.inter)
                    swiglu_grad_tile<true>(acc, swiglu, buffer, staging, out_row, tile.n, my_barrier);
                else
                    swiglu_grad_tile<false>(acc, swiglu, buffer, staging, out_row, tile.n, my_barrier);
                continue;
            }
            if (storer) tma_store_wait_read();
            named_barrier_sync(my_barrier, WARPGROUP_THREADS);
            if (tile.k_blocks > 0) stage_tile<false>(acc, buffer, warp_in_group, lane);
            else stage_zeros(buffer);
            fence_async_shared();
            named_barrier_sync(my_barrier, WARPGROUP_THREADS);
            if (storer) {
                // DATA: rows row0 + 64·consumer of the permuted output; WEIGHT: rows of dW[e].
                const int out_batch = KIND == DATA ? 0 : tile.expert;
                for (int box = 0; box < B_BOXES; ++box)
                    tma_store_3d(out_map, base + EPILOGUE + consumer * EPILOGUE_BYTES + box * OUT_BOX_BYTES,
                                 tile.n * BLOCK_N + box * BOX_COLS, out_row, out_batch);
                tma_store_commit();
            }
        }
        if (KIND != SWIGLU_DATA && storer) tma_store_wait_read();
    }
}

// dA = dY·W2ᵀ over each expert's rows (B = W2 [E, inter, hidden], n_out = inter, k = hidden), and from it
// through SwiGLU's backward dG, dU, w·h and g's partials.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_grad_swiglu(const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap b_map,
                   const __grid_constant__ SwigluGradParams p) {
    // The epilogue's fields copied out of the parameter: read through its address, they were loaded again
    // after every store of the epilogue (the compiler cannot tell that a store leaves them be).
    const SwigluGrad swiglu{p.h1, p.row_weight, p.dgu, p.hw, p.g_partial, p.inter, p.rows};
    grad_gemm<SWIGLU_DATA>(a_map, b_map, a_map, swiglu, p.offsets, nullptr, p.experts, p.inter, p.hidden);
}

// dX_perm = [dG dU]·W1ᵀ (B = W1 [E, hidden, 2·inter], n_out = hidden, k = 2·inter).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_grad_data(const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap b_map,
                 const __grid_constant__ TmaMap out_map, const __grid_constant__ DataGradParams p) {
    grad_gemm<DATA>(a_map, b_map, out_map, SwigluGrad{}, p.offsets, nullptr, p.experts, p.n_out, p.k);
}

// dW[e] = A_eᵀ · B_e over each expert's rows: dW1 (A = x, B = [dG dU]: m_out = hidden, n_out = 2·inter)
// and dW2 (A = w·h, B = dY: m_out = inter, n_out = hidden). Every expert's dW[e] is written.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_grad_weight(const __grid_constant__ TmaMap a_map, const __grid_constant__ TmaMap b_map,
                   const __grid_constant__ TmaMap out_map, const __grid_constant__ WeightGradParams p) {
    grad_gemm<WEIGHT>(a_map, b_map, out_map, SwigluGrad{}, p.offsets, p.counts, p.experts, p.n_out, p.m_out);
}

// --8<-- [start:gather]
// gather_gradient_rows' parameters (__init__.py's GatherParams packs them): the saved routing and permutation
// of stage 7's layer, the permuted rows and their weights out. Its inputs are read with __ldg.
struct GatherParams {
    const elem_t *x, *dy;  // [T, hidden]
    const int *source_token, *dest;
    const float* topk_weights;
    const int* expert_offsets;
    int experts, slots, hidden;  // slots: T·k
    elem_t *x_perm, *dy_perm;
    float* row_weight;
};

// The permutation, forward again: row r of x_perm and dy_perm is its token's x and dY, and row_weight[r]
// its top-k weight (0 on a padding row, which copies its segment's first token: stage 7's gather_rows,
// whose reason holds for the GEMMs here too). A block per row of the capacity; block s < T·k also places
// token-slot s's weight at its row, dest[s].
extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
gather_gradient_rows(const __grid_constant__ GatherParams p) {
    const int row = blockIdx.x;
    if (row < p.slots && threadIdx.x == 0) p.row_weight[__ldg(p.dest + row)] = __ldg(p.topk_weights + row);
    if (row >= __ldg(p.expert_offsets + p.experts)) return;
    int token = __ldg(p.source_token + row);
    if (token < 0) {
        if (threadIdx.x == 0) p.row_weight[row] = 0.0f;
        int lo = 0, hi = p.experts - 1;  // the last e with expert_offsets[e] <= row (empty segments skipped)
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (__ldg(p.expert_offsets + mid) <= row) lo = mid;
            else hi = mid - 1;
        }
        token = __ldg(p.source_token + __ldg(p.expert_offsets + lo));
    }
    const size_t to = (size_t)row * p.hidden, from = (size_t)token * p.hidden;
    for (int v = threadIdx.x; v < p.hidden / 8; v += blockDim.x) {
        reinterpret_cast<uint4*>(p.x_perm + to)[v] = __ldg(reinterpret_cast<const uint4*>(p.x + from) + v);
        reinterpret_cast<uint4*>(p.dy_perm + to)[v] = __ldg(reinterpret_cast<const uint4*>(p.dy + from) + v);
    }
}
// --8<-- [end:gather]

// --8<-- [start:router]
// The router's backward, a warp per token (lane l holds experts l, l + 32, ...), in fp64 from the saved
// fp32 logits (the balance term subtracts nearly equal values: dp_i − Σ_l dp_l·p_l is small where the
// experts' loads are even, and in fp32 its rounding, summed over T tokens into dBias, went past twice the
// library's error on the H200; a few thousand fp64 operations per token):
//   top-k term     the softmax over the chosen logits: dlogits[ids[j]] += w_j · (g_j − Σ_l w_l·g_l), with
//                  g_j = Σ over column tiles of g_partial at the token-slot's row
//   balance term   the loss α·E·Σ_i f_i·P_i through the full softmax p: dp_i = (α·E · f_i) / T,
//                  dlogits[i] += p_i · (dp_i − Σ_l dp_l·p_l)
// dlogits goes out in fp32, for dWr = xᵀ·dlogits (router_weight_grad), and in the dtype, for the data side
// dlogits·Wrᵀ (PyTorch's product: rounded, its terms are small beside the experts' in dX; in fp16 a
// balance-loss-only dlogits of 1e-6 is subnormal, which dWr could not take). dBias, Σ_t dlogits[t], is
// summed beside dWr (router_weight_grad).
//
// Its parameters (__init__.py's RouterBackwardParams packs them): the saved routing, g's partials
// [g_tiles, rows] (expert_grad_swiglu's), the balance loss's α·E (aux_scale), dlogits out. Its inputs are
// read with __ldg.
struct RouterBackwardParams {
    const float* logits;  // [T, E], fp32
    const int* topk_ids;
    const float* topk_weights;
    const int* dest;
    const float* g_partial;
    int g_tiles, rows;
    const int* expert_counts;
    float aux_scale;
    int tokens, experts, top_k;
    float* dlogits;
    elem_t* dlogits_rounded;
};

extern "C" __global__ void __launch_bounds__(ROUTER_BACKWARD_THREADS)
router_backward(const __grid_constant__ RouterBackwardParams p) {
    constexpr int PER_LANE = MAX_EXPERTS / 32;
    const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
    const double per_slot_and_token = __drcp_rn((double)p.tokens * p.top_k * p.tokens);  // (no division's slow path)
    for (int t = blockIdx.x * warps + threadIdx.x / 32; t < p.tokens; t += gridDim.x * warps) {
        double prob[PER_LANE], dp[PER_LANE];  // the softmax p; dp: the balance loss's gradient in p, α·E·f_i / T
        double top = -INFINITY;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int e = lane + 32 * i;
            prob[i] = e < p.experts ? __ldg(p.logits + (size_t)t * p.experts + e) : -INFINITY;
            top = fmax(top, prob[i]);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) top = fmax(top, __shfl_xor_sync(FULL_MASK, top, offset));
        double sum = 0.0;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            prob[i] = lane + 32 * i < p.experts ? exp(prob[i] - top) : 0.0;
            sum += prob[i];
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, offset);
        const double inverse = __drcp_rn(sum);
        double dot = 0.0;  // Σ_l dp_l·p_l
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int e = lane + 32 * i;
            dp[i] = e < p.experts ? (double)p.aux_scale * __ldg(p.expert_counts + e) * per_slot_and_token : 0.0;
            prob[i] *= inverse;
            dot += dp[i] * prob[i];
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(FULL_MASK, dot, offset);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) prob[i] *= dp[i] - dot;  // now the balance term of dlogits

        // The top-k term: every lane computes the k values (broadcast loads), the owner of id_j adds it.
        float g[MAX_TOP_K], w[MAX_TOP_K];
        double weighted = 0.0;
#pragma unroll
        for (int j = 0; j < MAX_TOP_K; ++j) {
            g[j] = 0.0f;
            w[j] = j < p.top_k ? __ldg(p.topk_weights + t * p.top_k + j) : 0.0f;
            if (j < p.top_k) {
                const int row = __ldg(p.dest + t * p.top_k + j);
                for (int n = 0; n < p.g_tiles; ++n) g[j] += __ldg(p.g_partial + (size_t)n * p.rows + row);
            }
            weighted += (double)w[j] * g[j];
        }
#pragma unroll
        for (int j = 0; j < MAX_TOP_K; ++j) {
            const int id = j < p.top_k ? __ldg(p.topk_ids + t * p.top_k + j) : -1;
            const double term = w[j] * (g[j] - weighted);
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i)  // added as a select (a branch made the compiler index prob in memory)
                prob[i] += id >= 0 && id == lane + 32 * i ? term : 0.0;
        }
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (e < p.experts) {
                p.dlogits[(size_t)t * p.experts + e] = (float)prob[i];
                p.dlogits_rounded[(size_t)t * p.experts + e] = from_float<elem_t>((float)prob[i]);
            }
        }
    }
}
// --8<-- [end:router]

// --8<-- [start:router_weight]
// dWr = xᵀ·dlogits [hidden, E] on the tensor cores in TF32 (mma.sync m16n8k8): a thin product (E columns,
// K = T), 2·T·hidden·E flops (8.6 G at 32K tokens × 4096 × 32 experts). x's 16-bit values are exact in
// TF32; dlogits is rounded to TF32's 10-bit mantissa but keeps fp32's exponent (in a 16-bit product a
// balance-loss-only dlogits of 1e-6, subnormal in fp16, missed the library's error 42-fold). Block
// (b, s, z) takes columns 64b .. 64b+63 of x × experts z·EB .. z·EB + EB-1 (EB = experts_per_block) over
// the tokens of split s, 32 at a time through shared memory, the next 32 loaded into registers while
// these are multiplied. Warp w holds columns 16·(w % 4) .. +15 × its half of the block's experts, NT
// tiles of 8. Each split's sums go to its own slice of `partial`; router_weight_sum adds the slices in a
// fixed order. The blocks of column block 0 also sum dBias = Σ_t dlogits[t] over their split, thread e
// for expert e, in fp64 from the unrounded dlogits: with one expert per token dBias is the balance loss's
// term alone, T terms of one sign, and fp32 sums in the order of atomics missed the library's error
// (1.2e-7 of it) twice over on the H200.
//
// The parameters of router_weight_grad and router_weight_sum, one struct for both (__init__.py's
// RouterWeightParams packs it): x [T, hidden] and dlogits [T, E] in, each split's sums in partial [splits,
// hidden, E] and bias_partial [splits, E], dWr [hidden, E] and dBias [E] out.
struct RouterWeightParams {
    const elem_t* x;
    const float* dlogits;
    int tokens, hidden, experts, experts_per_block, per_split, splits;
    float* partial;
    double* bias_partial;
    elem_t* dwr;
    float* dbias;
};

constexpr int RWG_X_STRIDE = RWG_COLS + 8;             // floats a row of xs: 8 banks on per row, so a
constexpr int RWG_D_STRIDE = RWG_MAX_EXPERT_BLOCK + 8;  // fragment's 4 rows × 8 columns meet 32 banks
struct __align__(16) RouterWeightShared {
    float xs[RWG_TOKENS * RWG_X_STRIDE];  // 32 tokens × 64 columns of x, as floats
    float ds[RWG_TOKENS * RWG_D_STRIDE];  // the same tokens' dlogits for the block's experts
};

__device__ __forceinline__ unsigned to_tf32(float value) {
    unsigned bits;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(value));
    return bits;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One chunk of 32 tokens from memory into registers: 8 values of x and 2·NT of dlogits a thread
// (zeros past the split's end and past the experts), read with __ldg.
template <int NT>
struct RouterWeightChunk {
    float x[8], d[2 * NT];

    __device__ __forceinline__ void load(const RouterWeightParams& p, int t0, int end, int col0, int expert0) {
        const int tok = threadIdx.x / 8, col = col0 + 8 * (threadIdx.x % 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = 0.0f;
        if (t0 + tok < end && col < p.hidden) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p.x + (size_t)(t0 + tok) * p.hidden + col));
            load8(reinterpret_cast<const elem_t*>(&raw), x);  // the 8 elements, from registers
        }
#pragma unroll
        for (int i = 0; i < 2 * NT; ++i) {
            const int at = threadIdx.x + RWG_THREADS * i, t = at / (16 * NT), e = expert0 + at % (16 * NT);
            d[i] = t0 + t < end && e < p.experts ? __ldg(p.dlogits + (size_t)(t0 + t) * p.experts + e) : 0.0f;
        }
    }

    __device__ __forceinline__ void store(RouterWeightShared& sh) const {
        const int tok = threadIdx.x / 8, col = 8 * (threadIdx.x % 8);
        float4* to = reinterpret_cast<float4*>(sh.xs + tok * RWG_X_STRIDE + col);
        to[0] = make_float4(x[0], x[1], x[2], x[3]);
        to[1] = make_float4(x[4], x[5], x[6], x[7]);
#pragma unroll
        for (int i = 0; i < 2 * NT; ++i) {
            const int at = threadIdx.x + RWG_THREADS * i;
            sh.ds[at / (16 * NT) * RWG_D_STRIDE + at % (16 * NT)] = d[i];
        }
    }
};

template <int NT>  // 8-expert tiles a warp: the block's experts are 16·NT
__device__ void router_weight_tile(const RouterWeightParams& p, RouterWeightShared& sh) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, group = lane / 4, quad = lane % 4;
    const int col0 = blockIdx.x * RWG_COLS, expert0 = blockIdx.z * 16 * NT;
    const int m0 = 16 * (warp % 4), n0 = 8 * NT * (warp / 4);  // the warp's columns and experts in the block
    const int begin = blockIdx.y * p.per_split, end = min(p.tokens, begin + p.per_split);
    const bool sums_bias = blockIdx.x == 0 && threadIdx.x < 16 * NT && expert0 + threadIdx.x < p.experts;
    float acc[NT][4] = {};
    double bias = 0.0;
    RouterWeightChunk<NT> chunk;
    chunk.load(p, begin, end, col0, expert0);
    for (int t0 = begin; t0 < end; t0 += RWG_TOKENS) {
        __syncthreads();  // the last chunk is read
        chunk.store(sh);
        __syncthreads();
        if (t0 + RWG_TOKENS < end) chunk.load(p, t0 + RWG_TOKENS, end, col0, expert0);
        if (sums_bias)
            for (int tok = 0; tok < RWG_TOKENS; ++tok) bias += sh.ds[tok * RWG_D_STRIDE + threadIdx.x];
#pragma unroll
        for (int k0 = 0; k0 < RWG_TOKENS; k0 += 8) {
            // A = xᵀ (16 columns × 8 tokens), B = dlogits (8 tokens × 8 experts), the PTX fragments' layout.
            const float* xk = sh.xs + (k0 + quad) * RWG_X_STRIDE + m0 + group;
            const unsigned a[4] = {__float_as_uint(xk[0]), __float_as_uint(xk[8]),
                                   __float_as_uint(xk[4 * RWG_X_STRIDE]), __float_as_uint(xk[4 * RWG_X_STRIDE + 8])};
            const float* dk = sh.ds + (k0 + quad) * RWG_D_STRIDE + n0 + group;
#pragma unroll
            for (int j = 0; j < NT; ++j) mma_tf32(acc[j], a, to_tf32(dk[8 * j]), to_tf32(dk[4 * RWG_D_STRIDE + 8 * j]));
        }
    }
    if (sums_bias) p.bias_partial[blockIdx.y * p.experts + expert0 + threadIdx.x] = bias;
    float* out = p.partial + (size_t)blockIdx.y * p.hidden * p.experts;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // c0, c1: row `group`, columns 2·quad, +1; c2, c3: row group + 8
            const int col = col0 + m0 + group + 8 * (i / 2), e = expert0 + n0 + 8 * j + 2 * quad + i % 2;
            if (col < p.hidden && e < p.experts) out[(size_t)col * p.experts + e] = acc[j][i];
        }
}

extern "C" __global__ void __launch_bounds__(RWG_THREADS)
router_weight_grad(const __grid_constant__ RouterWeightParams p) {
    __shared__ RouterWeightShared sh;  // static: one for every variant below
    switch (p.experts_per_block) {
        case 16: router_weight_tile<1>(p, sh); break;
        case 32: router_weight_tile<2>(p, sh); break;
        default: router_weight_tile<4>(p, sh);
    }
}

// dwr[i] = the splits' partial sums of element i, added in order, rounded once; dbias likewise from the
// splits' fp64 sums. A thread per element.
extern "C" __global__ void router_weight_sum(const __grid_constant__ RouterWeightParams p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, count = p.hidden * p.experts;
    if (i < p.experts) {
        double bias = 0.0;
        for (int s = 0; s < p.splits; ++s) bias += __ldg(p.bias_partial + s * p.experts + i);
        p.dbias[i] = (float)bias;
    }
    if (i >= count) return;
    float sum = 0.0f;
    for (int s = 0; s < p.splits; ++s) sum += __ldg(p.partial + (size_t)s * count + i);
    p.dwr[i] = from_float<elem_t>(sum);
}
// --8<-- [end:router_weight]

// --8<-- [start:combine]
// The permutation backward, without a sort: dx[t] = Σ_j dX_perm[dest[t, j]] + router[t] (router: the
// router's data side dlogits·Wrᵀ), fp32 sums, one rounding. A block per token, 8 columns per thread
// and step, its k + 1 loads in flight together.
extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
combine_gradients(const elem_t* __restrict__ dx_perm, const int* __restrict__ dest, const elem_t* __restrict__ router,
                  elem_t* __restrict__ dx, int top_k, int hidden) {
    const int token = blockIdx.x;
    int row[MAX_TOP_K];
#pragma unroll
    for (int j = 0; j < MAX_TOP_K; ++j) row[j] = j < top_k ? dest[token * top_k + j] : 0;
    for (int c = 8 * threadIdx.x; c < hidden; c += 8 * blockDim.x) {
        float sum[8], part[8];
        load8(router + (size_t)token * hidden + c, sum);
#pragma unroll
        for (int j = 0; j < MAX_TOP_K; ++j) {
            if (j < top_k) {
                load8(dx_perm + (size_t)row[j] * hidden + c, part);
#pragma unroll
                for (int i = 0; i < 8; ++i) sum[i] += part[i];
            }
        }
        store8(dx + (size_t)token * hidden + c, sum);
    }
}
// --8<-- [end:combine]
