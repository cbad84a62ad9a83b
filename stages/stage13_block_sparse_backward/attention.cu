// Stage 13 — block-sparse attention backward on Hopper. sm_90a only.
//
// Stage 9's backward (a block per 128 keys of a KV pair keeps dK and dV in registers while it walks
// query tiles: TMA producer warpgroup, two wgmma consumer warpgroups, the five products, dQ summed in
// fp32 by one bulk reduce-add per tile) walking a FlexAttention block mask instead of every query:
//   lists     key block n's query tiles are the query blocks whose lists name n -- the transposed
//             BlockMask (FlexAttention's full_q_num_blocks/full_q_indices, then q_num_blocks/q_indices;
//             the launch computes them from the forward's kv lists with a few torch ops): full blocks
//             first, then partial ones, for each query head of the KV head's group. Absent blocks cost
//             nothing. A query block is BLOCK / BLOCK_M query tiles (1 at D = 64, 2 at D = 128).
//   masks     full blocks are used as they are; partial blocks apply the element mask in registers on
//             Pᵀ (causal, documents, sliding window: -DELEMENT_MASK, block_mask.cuh), so that a mask of
//             full blocks only carries no masking code.
//   empty     a key block no list names loads no query tile and writes dK = dV = 0; a query row that
//             sees no key (LSE = -inf) gets P = 0, not exp(S + inf) (the guard in block_probabilities):
//             its dQ stays the zero the preprocess wrote, and it adds nothing to dK and dV.
// Keys past S (TMA zero-fills K and V) need no mask: their dK and dV rows are not written, and their
// dS meets K's zero rows in dQ += dS K (stage 9's argument). Queries past S have LSE = +inf (the
// preprocess's padding): P = 0.
//
// Everything else is stage 9's, unchanged: its products, dSᵀ through shared memory, dQ's bulk adds,
// the shared-memory layout (D = 64: 195 KB; D = 128: 226 KB) (wgmma_attention_backward.cuh), the
// preprocess and the dQ conversion (attention_backward.cuh). The workspace is padded to whole mask blocks of 128 query rows (the
// launch), so that every query tile of a listed block lies inside it at both head dimensions.
#include "wgmma_attention_backward.cuh"  // stage 9's tiles, products, dSᵀ and dQ through shared memory
#include "block_mask.cuh"                 // the element mask: MASK, element_visible

constexpr int BLOCK = 128;                            // the block mask's block, queries and keys
constexpr int SUBTILES = BLOCK / BLOCK_M;             // query tiles per query block of the mask
static_assert(BLOCK == BLOCK_N, "a key tile is a block of the mask");
static_assert(BLOCK % BLOCK_M == 0, "a query block of the mask is whole query tiles");

// The transposed block mask, as the kernel receives it: for key block n, the query blocks whose lists
// name it -- full ones, full_indices[n][0 .. full_num[n]), then partial ones, indices[n][0 .. num[n]).
struct QueryLists {
    const int *num, *indices, *full_num, *full_indices;  // [KVb] and [KVb, Qb]
    int q_blocks;                                       // Qb: the indices' row length
};

// The element mask's parameters (block_mask.cuh decides what it hides). The documents are read with __ldg,
// through the read-only path: the pointer comes from the kernel's parameter struct, where it cannot be
// __restrict__ (which would tell the compiler so).
struct ElementMask {
    int window;                // sliding_window
    const int* document_ids;   // [S], document
    int seq;
};

// Query tile i of a block's walk: query pair `g` of the group, first row m0, in a partial block or not.
struct QueryTile {
    int g, m0;
    bool partial;
};

// What a block computes: the BLOCK_N keys of key block n_block of KV pair kv_pair (b·H_kv + h_kv)
// against the query tiles of the blocks its lists name, for each query head of its group (query pairs
// kv_pair·group + g, g = 0 .. group - 1). Producer, dQ writer and consumers walk the same `tiles()`
// steps in the same order: head by head, each head's full blocks then its partial ones, each block's
// SUBTILES tiles in row order.
struct BlockWork {
    int kv_pair, kv_heads, n_block, group;
    int full, listed;  // key block n_block's full query blocks, and all its listed ones
    QueryLists lists;
    __device__ int n0() const { return n_block * BLOCK_N; }
    __device__ int query_pair(int g) const { return kv_pair * group + g; }  // in the dense LSE, Δ and dQ sums
    __device__ int batch() const { return kv_pair / kv_heads; }             // the tensor maps' coordinates
    __device__ int kv_head() const { return kv_pair % kv_heads; }
    __device__ int query_head(int g) const { return kv_head() * group + g; }
    __device__ int tiles() const { return group * listed * SUBTILES; }
    // --8<-- [start:walk]
    __device__ QueryTile tile(int i) const {
        const int per_head = listed * SUBTILES;
        const int g = i / per_head, t = i % per_head / SUBTILES, sub = i % SUBTILES;
        // EXERCISE: step i is sub-tile `sub` of the t-th query block that names key block n_block: its
        // full blocks first (lists.full_indices, row n_block of length lists.q_blocks, `full` of them),
        // then its partial ones (lists.indices, from 0 again). Return that block's first row plus `sub`
        // tiles of BLOCK_M, and whether the block is partial (only those apply the element mask).
        // STUB: return {g, t * BLOCK + sub * BLOCK_M, true};  // the first query blocks, not the listed ones
        const size_t row = (size_t)n_block * lists.q_blocks;
        const bool partial = t >= full;
        const int m_block = partial ? lists.indices[row + t - full] : lists.full_indices[row + t];
        return {g, m_block * BLOCK + sub * BLOCK_M, partial};
        // END EXERCISE
    }
    // --8<-- [end:walk]
};

// --8<-- [start:producer]
// The producer: one thread issues every copy -- K and V once, then each listed query tile's Q, dO,
// LSE and Δ into ring slot i % Q_STAGES, once the consumers have released it (stage 9's steps, over the walk).
__device__ __forceinline__ void produce(const SharedMemory& shared, const BlockWork& work, const TmaMap& q_map,
                                        const TmaMap& k_map, const TmaMap& v_map, const TmaMap& do_map,
                                        const float* lse_log2, const float* delta, int seq_q_padded) {
    load_keys_values(shared, work, q_map, k_map, v_map, do_map);
    const int tiles = work.tiles();
    for (int i = 0; i < tiles; ++i) {
        const QueryTile tile = work.tile(i);
        load_query_tile(shared, work, i, tile.g, tile.m0, q_map, do_map, lse_log2, delta, seq_q_padded);
    }
}
// --8<-- [end:producer]

// dQ's way to global memory (stage 9's): one thread adds each query tile's dQ to the fp32 sums, in the
// walk's order, with one bulk reduce-add a tile (add_dq_tile).
__device__ __forceinline__ void add_dq_tiles(const SharedMemory& shared, const BlockWork& work, float* dq_accum,
                                             int seq_q_padded) {
    const int tiles = work.tiles();
    for (int i = 0; i < tiles; ++i) {
        const QueryTile tile = work.tile(i);
        add_dq_tile(shared, work, i, tile.g, tile.m0, dq_accum, seq_q_padded);
    }
}

// dq[64 queries × 64 columns] = dS K for consumer `consumer`'s share over all 128 keys (see the header:
// at D = 128 the columns 64·consumer .., at D = 64 the queries 64·consumer ..).
__device__ __forceinline__ void issue_dq(float (&dq)[DQ_FRAGS][4], unsigned ds_tile, unsigned k_tile, int consumer) {
    const unsigned ds_queries = ds_tile + (DQ_SPLIT_BY_QUERIES ? consumer : 0) * BLOCK_N * SWIZZLE_BYTES;  // its column block of dSᵀ
    const unsigned k_columns = k_tile + (DQ_SPLIT_BY_QUERIES ? 0 : consumer) * BLOCK_N * SWIZZLE_BYTES;    // its column block of K
    // dS is MN-major in shared memory (dSᵀ [key][query]: wgmma_ss_a_mn reads it transposed), K too;
    // 16 keys a step, 16·128 bytes further down (stage 9's exercise).
#pragma unroll
    for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
        const int row = 16 * ks * SWIZZLE_BYTES;
        const u64 ds = make_smem_desc(ds_queries + row, BLOCK_N * SWIZZLE_BYTES, SWIZZLE_ATOM_BYTES);
        const u64 k = make_smem_desc(k_columns + row, BLOCK_N * SWIZZLE_BYTES, SWIZZLE_ATOM_BYTES);
        wgmma_ss_a_mn<elem_t, DQ_COLS, MN_MAJOR>(dq, ds, k, ks > 0);
    }
}

// --8<-- [start:mask]
// Pᵀ = exp(scale·Sᵀ − LSE) in place, as attention_backward.cuh's probabilities() (the exponent capped
// at 0), with the block mask's two additions: a row whose LSE is -inf (it sees no key) gets P = 0 --
// its LSE taken as +inf, as the preprocess's padding rows have it -- where exp(S + inf) would be inf,
// capped to 1; and in a partial block the element mask in registers. s holds the warp's 16 keys (rows
// key0 + lane/4, + 8: c / 2) against the tile's queries (columns m0 + 8n + 2(lane % 4) + c % 2);
// key_docs: the documents of the thread's two keys (document masks only).
__device__ __forceinline__ void block_probabilities(float (&s)[M_FRAGS][4], const float* lse_log2, float scale_log2,
                                              bool partial, int key0, int m0, const ElementMask& mask,
                                              const int (&key_docs)[2], int lane) {
    const bool element = MASK != element_mask::none && partial;  // one test a tile, the same in every thread
#pragma unroll
    for (int n = 0; n < M_FRAGS; ++n) {
        const float2 lse = *reinterpret_cast<const float2*>(lse_log2 + 8 * n + 2 * (lane % 4));
        const float lse_x = lse.x == -INFINITY ? INFINITY : lse.x, lse_y = lse.y == -INFINITY ? INFINITY : lse.y;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float p = fast_exp2(fminf(s[n][c] * scale_log2 - (c % 2 ? lse_y : lse_x), 0.0f));
            // Selected, not branched to: the query's document is read whatever the test says (its index
            // clamped inside S; a query past S gets none, -2), so no load waits behind a test.
            const int key = key0 + lane / 4 + 8 * (c / 2), query = m0 + 8 * n + 2 * (lane % 4) + c % 2;
            int query_doc = 0;
            if (MASK == element_mask::document)
                query_doc = query < mask.seq ? __ldg(mask.document_ids + min(query, mask.seq - 1)) : -2;
            const bool hidden = element & !element_visible(key, query, mask.window, key_docs[c / 2], query_doc);
            s[n][c] = hidden ? 0.0f : p;
        }
    }
}
// --8<-- [end:mask]

// --8<-- [start:consumer]
// Consumer `consumer` (0 or 1): keys 64·consumer .. of the block, their dK and dV in registers for
// the whole walk; stage 9's schedule per query tile (start_tile, finish_tile), Pᵀ between its two steps with
// the element mask applied in partial blocks.
__device__ __forceinline__ void consume(const SharedMemory& shared, const BlockWork& work, int consumer,
                                        const HeadRows<elem_t>& dk_rows, const HeadRows<elem_t>& dv_rows,
                                        const ElementMask& mask, float scale) {
    const int lane = threadIdx.x % 32, warp_in_group = threadIdx.x / 32 % 4;
    const int row0 = consumer * CONSUMER_KEYS + warp_in_group * 16;  // the warp's first key in the block
    const int key0 = work.n0() + row0;
    const unsigned k_rows = shared.k_tile() + consumer * CONSUMER_KEYS * SWIZZLE_BYTES;  // this consumer's keys
    const unsigned v_rows = shared.v_tile() + consumer * CONSUMER_KEYS * SWIZZLE_BYTES;
    const float scale_log2 = scale * LOG2E;
    int key_docs[2] = {0, 0};  // the documents of the thread's two keys (-1: past S)
    if (MASK == element_mask::document)
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + lane / 4 + 8 * r;
            key_docs[r] = key < mask.seq ? __ldg(mask.document_ids + key) : -1;
        }
    float dk[D_FRAGS][4], dv[D_FRAGS][4];
#pragma unroll
    for (int n = 0; n < D_FRAGS; ++n) dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;

    mbarrier_wait(shared.barrier(KV_FULL), 0);  // also when no list names the block: no copy outlives it
    const int tiles = work.tiles();
    for (int i = 0; i < tiles; ++i) {
        const QueryTile tile = work.tile(i);
        float s[M_FRAGS][4], dp[M_FRAGS][4];
        const TileBuffers buffers = start_tile(shared, i, k_rows, v_rows, s, dp);  // Sᵀ; dPᵀ under way
        block_probabilities(s, shared.floats(shared.lse_slot(buffers.slot)), scale_log2, tile.partial, key0, tile.m0,
                            mask, key_docs, lane);  // Pᵀ
        finish_tile(shared, buffers, i, consumer, warp_in_group, lane, row0, s, dp, dk, dv);
    }

    write_rows(dk_rows, work.kv_pair, dk, scale, key0, mask.seq, lane);  // zeros where no list names the block
    write_rows(dv_rows, work.kv_pair, dv, 1.0f, key0, mask.seq, lane);
}
// --8<-- [end:consumer]

// --8<-- [start:kernel]
// The kernel's parameters besides its tensor maps (__init__.py's BlockSparseBackwardParams packs them): stage
// 9's (the preprocess's LSE in log2 units and Δ, dQ's fp32 sums, dK and dV as HeadRows take them), the first
// KV pair of the launch, the transposed lists (QueryLists) and the element mask's (ElementMask).
struct BlockSparseBackwardParams {
    const float *lse_log2, *delta;
    float* dq_accum;
    elem_t* dk;
    long long dk_batch_stride, dk_head_stride;
    int dk_row_stride;
    elem_t* dv;
    long long dv_batch_stride, dv_head_stride;
    int dv_row_stride;
    int kv_heads, seq, seq_q_padded;
    float scale;
    int group, kv_pair0;
    const int *q_num, *q_indices, *full_q_num, *full_q_indices;
    int q_blocks, window;
    const int* document_ids;
};

// A block per (key block blockIdx.x, KV pair kv_pair0 + blockIdx.y): stage 9's warp specialization over
// the query tiles the transposed lists name. `group` query heads share each KV head; a launch covers at
// most 65,535 KV pairs (grid.y), from kv_pair0. dK and dV carry their tensors' strides.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
block_sparse_attention_bwd(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
                           const __grid_constant__ TmaMap v_map, const __grid_constant__ TmaMap do_map,
                           const __grid_constant__ BlockSparseBackwardParams p) {
    extern __shared__ __align__(SWIZZLE_ATOM_BYTES) unsigned char shared_raw[];
    // TMA's 128-byte swizzle and the descriptors' base offset 0 assume 1024-byte-aligned tiles.
    const unsigned raw = shared_address(shared_raw), base = atom_aligned(raw);
    const SharedMemory shared{base, shared_raw + (base - raw)};
    const int n_block = blockIdx.x, full = p.full_q_num[n_block];
    const QueryLists lists{p.q_num, p.q_indices, p.full_q_num, p.full_q_indices, p.q_blocks};
    const BlockWork work{p.kv_pair0 + (int)blockIdx.y, p.kv_heads, n_block, p.group, full, full + p.q_num[n_block],
                         lists};
    if (threadIdx.x == 0) init_barriers(shared);
    __syncthreads();

    const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) produce(shared, work, q_map, k_map, v_map, do_map, p.lse_log2, p.delta, p.seq_q_padded);
        if (threadIdx.x == 32) add_dq_tiles(shared, work, p.dq_accum, p.seq_q_padded);
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const HeadRows<elem_t> dk_rows{p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, p.kv_heads};
        const HeadRows<elem_t> dv_rows{p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, p.kv_heads};
        consume(shared, work, warpgroup - 1, dk_rows, dv_rows, ElementMask{p.window, p.document_ids, p.seq}, p.scale);
    }
}
// --8<-- [end:kernel]
