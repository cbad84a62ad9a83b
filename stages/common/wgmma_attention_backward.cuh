// Stage 9's Hopper attention backward, all of it but the walk, shared with stage 13 (which walks a block
// mask's lists instead of every query tile): the tiles and the shared-memory layout, the mbarriers, the
// wgmma products but dQ's, the ways of dSᵀ and dQ through shared memory, and the steps of each walk --
// the producer's copies of K and V and of a query tile (load_keys_values, load_query_tile), dQ's writer's
// bulk add of a tile (add_dq_tile), a consumer's schedule for a tile (start_tile, finish_tile). Each stage
// keeps its walk (which query tiles, in which order: the loops around those steps), its masking of Pᵀ
// (between start_tile and finish_tile) and issue_dq (dQ = dS K, stage 9's exercise). The steps are
// __forceinline__. The schedule is two steps rather than one that takes the masking as a function: with
// one, NVRTC 13.5 hoisted the tile's shared-memory addresses out of the loop, and the kernel, at its
// 168-register limit, spilled at D = 64.
// stages/stage9_hopper_backward/attention.cu's header explains the design.
#pragma once
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "swizzle.cuh"             // swizzle<SWIZZLE_BYTES>: TMA's 128-byte swizzle, for the dSᵀ stores
#include "attention_backward.cuh"  // the preprocess, the dQ conversion, probabilities()

constexpr int BLOCK_N = 128;                          // keys per block
constexpr int BLOCK_M = HEAD_DIM == 64 ? 128 : 64;   // queries per tile of the loop (stage 9's header says why)
constexpr int CONSUMERS = 2;                          // consumer warpgroups, 64 keys each
constexpr int CONSUMER_KEYS = BLOCK_N / CONSUMERS;    // = wgmma's M
constexpr int Q_STAGES = 2;                           // buffers of the query-side ring
constexpr int DS_STAGES = 2;                          // buffers of dSᵀ
constexpr int DQ_STAGES = BLOCK_M == 64 ? 2 : 1;      // buffers of a query tile's fp32 dQ (1 of 32 KB at D = 64)
constexpr int NUM_THREADS = (1 + CONSUMERS) * WARPGROUP_THREADS;  // + the producer warpgroup
constexpr int CONSUMER_THREADS = CONSUMERS * WARPGROUP_THREADS;
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
constexpr int Q_TILE_BYTES = BLOCK_M * HEAD_DIM * 2;
constexpr int DS_TILE_BYTES = BLOCK_N * BLOCK_M * 2;  // dSᵀ [key][query]: column blocks of 64 queries, 128-byte rows
constexpr int VECTOR_BYTES = BLOCK_M * 4;             // the LSE or Δ of a query tile, fp32
constexpr int DQ_TILE_BYTES = BLOCK_M * HEAD_DIM * 4; // a query tile's dQ, fp32 rows as in global memory
constexpr int M_FRAGS = BLOCK_M / 8;                  // n8 fragments of a warp's 16 keys × BLOCK_M queries
constexpr int M_STEPS = BLOCK_M / 16;                 // k-steps of dV and dK (16 queries each)
constexpr int D_FRAGS = HEAD_DIM / 8;                 // n8 fragments of a warp's 16 keys × D
constexpr int DQ_COLS = 64;                           // columns of dQ per consumer
constexpr int DQ_FRAGS = DQ_COLS / 8;
constexpr bool DQ_SPLIT_BY_QUERIES = BLOCK_M == 128;  // consumer c's dQ: queries 64c .. (else columns 64c ..)
constexpr bool DV_BEFORE_DS = BLOCK_M == 64;          // dV issued under dS (registers allow it at 64 queries)
constexpr int DS_READY = 1;                           // named barrier: both consumers' dSᵀ are stored
// Layout of the dynamic shared memory, from a 1024-byte-aligned base.
constexpr int K_TILE = 0;
constexpr int V_TILE = K_TILE + KV_TILE_BYTES;
constexpr int Q_RING = V_TILE + KV_TILE_BYTES;
constexpr int DO_RING = Q_RING + Q_STAGES * Q_TILE_BYTES;
constexpr int DS_RING = DO_RING + Q_STAGES * Q_TILE_BYTES;
constexpr int DQ_RING = DS_RING + DS_STAGES * DS_TILE_BYTES;
constexpr int LSE_RING = DQ_RING + DQ_STAGES * DQ_TILE_BYTES;
constexpr int DELTA_RING = LSE_RING + Q_STAGES * VECTOR_BYTES;
constexpr int BARRIERS = DELTA_RING + Q_STAGES * VECTOR_BYTES;  // then 8-byte mbarriers:
constexpr int KV_FULL = 0, Q_FULL = 1, Q_EMPTY = Q_FULL + Q_STAGES, DQ_FULL = Q_EMPTY + Q_STAGES,
              DQ_EMPTY = DQ_FULL + DQ_STAGES, NUM_BARRIERS = DQ_EMPTY + DQ_STAGES;
constexpr int SHARED_BYTES = BARRIERS + 8 * NUM_BARRIERS + SWIZZLE_ATOM_BYTES;  // + room to align the base to an atom
static_assert(SHARED_BYTES <= 227 * 1024, "an H100 block has at most 227 KB of shared memory");
static_assert(DQ_TILE_BYTES % 16 == 0 && (HEAD_DIM * 4) % 16 == 0, "bulk copies move whole 16-byte units");
static_assert(sizeof(elem_t) == 2, "16-bit elements");
static_assert(HEAD_DIM % ATOM_COLS == 0, "D is a whole number of 128-byte column blocks");
static_assert(CONSUMERS * 64 * DQ_COLS == BLOCK_M * HEAD_DIM, "the consumers' 64 × 64 dQ parts cover the tile");
static_assert(BLOCK_M % ATOM_COLS == 0 && Q_TILE_BYTES % SWIZZLE_ATOM_BYTES == 0 &&
                  DS_TILE_BYTES % SWIZZLE_ATOM_BYTES == 0,
              "dSᵀ rows are whole 128-byte swizzle rows; every tile starts on a 1024-byte boundary");

// The block's dynamic shared memory from its 1024-byte-aligned base, as shared addresses, and the
// same base as a generic pointer (for the LSE and Δ, read as floats).
struct SharedMemory {
    unsigned base;
    const unsigned char* generic;
    __device__ unsigned k_tile() const { return base + K_TILE; }
    __device__ unsigned v_tile() const { return base + V_TILE; }
    __device__ unsigned q_slot(int slot) const { return base + Q_RING + slot * Q_TILE_BYTES; }
    __device__ unsigned do_slot(int slot) const { return base + DO_RING + slot * Q_TILE_BYTES; }
    __device__ unsigned ds_slot(int slot) const { return base + DS_RING + slot * DS_TILE_BYTES; }
    __device__ unsigned dq_slot(int slot) const { return base + DQ_RING + slot * DQ_TILE_BYTES; }
    __device__ unsigned lse_slot(int slot) const { return base + LSE_RING + slot * VECTOR_BYTES; }
    __device__ unsigned delta_slot(int slot) const { return base + DELTA_RING + slot * VECTOR_BYTES; }
    __device__ const float* floats(unsigned address) const {
        return reinterpret_cast<const float*>(generic + (address - base));
    }
    __device__ unsigned barrier(int index) const { return base + BARRIERS + 8 * index; }
};

__device__ __forceinline__ void init_barriers(const SharedMemory& shared) {
    mbarrier_init(shared.barrier(KV_FULL), 1);
    for (int s = 0; s < Q_STAGES; ++s) {
        mbarrier_init(shared.barrier(Q_FULL + s), 1);                  // the producer's arrive.expect_tx
        mbarrier_init(shared.barrier(Q_EMPTY + s), CONSUMER_THREADS);  // every consumer thread releases
    }
    for (int s = 0; s < DQ_STAGES; ++s) {
        mbarrier_init(shared.barrier(DQ_FULL + s), CONSUMER_THREADS);  // every consumer thread has stored
        mbarrier_init(shared.barrier(DQ_EMPTY + s), 1);                // the bulk add has read the buffer
    }
    mbarrier_init_fence();
}

// The producer's first copies: K and V of the block, once (the BLOCK_N keys from work.n0() of its KV
// head), after prefetching the four tensor maps' descriptors. Work: the stage's BlockWork.
template <typename Work>
__device__ __forceinline__ void load_keys_values(const SharedMemory& shared, const Work& work, const TmaMap& q_map,
                                                 const TmaMap& k_map, const TmaMap& v_map, const TmaMap& do_map) {
    tma_prefetch_map(q_map);
    tma_prefetch_map(k_map);
    tma_prefetch_map(v_map);
    tma_prefetch_map(do_map);
    mbarrier_arrive_expect_tx(shared.barrier(KV_FULL), 2 * KV_TILE_BYTES);
    load_tile<BLOCK_N, HEAD_DIM>(shared.k_tile(), k_map, shared.barrier(KV_FULL), work.n0(), work.kv_head(), work.batch());
    load_tile<BLOCK_N, HEAD_DIM>(shared.v_tile(), v_map, shared.barrier(KV_FULL), work.n0(), work.kv_head(), work.batch());
}

// The producer's copies of tile i of the walk -- the BLOCK_M queries from m0 of the group's query head g --
// into ring slot i % Q_STAGES, once the consumers have released it: its Q and dO, its LSE and Δ.
template <typename Work>
__device__ __forceinline__ void load_query_tile(const SharedMemory& shared, const Work& work, int i, int g, int m0,
                                                const TmaMap& q_map, const TmaMap& do_map, const float* lse_log2,
                                                const float* delta, int seq_q_padded) {
    const int slot = i % Q_STAGES, pair = work.query_pair(g), head = work.query_head(g);
    const unsigned parity = (i / Q_STAGES) & 1;  // which use of this slot
    const unsigned full = shared.barrier(Q_FULL + slot);
    mbarrier_wait(shared.barrier(Q_EMPTY + slot), parity ^ 1);  // slot free (a fresh barrier: at once)
    // Rows past seq_q are zero-filled and counted; the LSE and Δ are padded (the launch's workspace).
    mbarrier_arrive_expect_tx(full, 2 * Q_TILE_BYTES + 2 * VECTOR_BYTES);
    load_tile<BLOCK_M, HEAD_DIM>(shared.q_slot(slot), q_map, full, m0, head, work.batch());
    load_tile<BLOCK_M, HEAD_DIM>(shared.do_slot(slot), do_map, full, m0, head, work.batch());
    bulk_load(shared.lse_slot(slot), lse_log2 + (size_t)pair * seq_q_padded + m0, VECTOR_BYTES, full);
    bulk_load(shared.delta_slot(slot), delta + (size_t)pair * seq_q_padded + m0, VECTOR_BYTES, full);
}

// dQ's way to global memory, tile i of the walk (queries m0 .. of the group's query head g): once both
// consumers have stored its dQ in buffer i % DQ_STAGES, one thread adds the whole tile to the fp32 sums
// with one bulk reduce-add (the rows of a tile are contiguous in the accumulator, [B, H, seq_q_padded, D]:
// one copy of BLOCK_M·D·4 bytes; the padding rows' sums are never read), then hands the buffer back as
// soon as the copy has read it. Waiting for that at once costs nothing: the consumers fill the other
// buffer meanwhile.
template <typename Work>
__device__ __forceinline__ void add_dq_tile(const SharedMemory& shared, const Work& work, int i, int g, int m0,
                                            float* dq_accum, int seq_q_padded) {
    const int slot = i % DQ_STAGES;
    float* dq_rows = dq_accum + ((size_t)work.query_pair(g) * seq_q_padded + m0) * HEAD_DIM;
    mbarrier_wait(shared.barrier(DQ_FULL + slot), (i / DQ_STAGES) & 1);
    bulk_reduce_add_f32(dq_rows, shared.dq_slot(slot), BLOCK_M * HEAD_DIM * 4);
    tma_store_commit();
    tma_store_wait_read<0>();
    mbarrier_arrive(shared.barrier(DQ_EMPTY + slot));
}

// acc[64 keys × BLOCK_M queries] = rows · queryᵀ: Sᵀ = K Qᵀ (rows = the consumer's 64 keys of K) or
// dPᵀ = V dOᵀ. Both operands K-major (d contiguous): step kk covers d = 16kk .. 16kk+15, column block
// kk / 4, 32 bytes further into the swizzled row per step inside it (stage 4's wgmma_scores).
__device__ __forceinline__ void issue_rows_times_queries(float (&acc)[M_FRAGS][4], unsigned rows, unsigned queries) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const unsigned column = kk / 4, offset = (kk % 4) * 32;
        const u64 a = make_smem_desc(rows + column * BLOCK_N * SWIZZLE_BYTES + offset, 16, SWIZZLE_ATOM_BYTES);
        const u64 b = make_smem_desc(queries + column * BLOCK_M * SWIZZLE_BYTES + offset, 16, SWIZZLE_ATOM_BYTES);
        wgmma_ss<elem_t, BLOCK_M, K_MAJOR>(acc, a, b, kk > 0);
    }
}

// acc[64 keys × D] += x · (a query tile of Q or dO): dV += Pᵀ dO, dK += dSᵀ Q. x from registers (the A
// fragments of M_STEPS k-steps of 16 queries); the query tile is [query][d] = [k][n], MN-major: step
// ks covers queries 16ks .. 16ks+15, 16·128 bytes further down; the 64-column blocks of d are LBO =
// BLOCK_M·128 bytes apart (stage 4's wgmma_pv).
__device__ __forceinline__ void issue_accumulate(float (&acc)[D_FRAGS][4], const unsigned (&x)[M_STEPS][4],
                                                 unsigned queries) {
#pragma unroll
    for (int ks = 0; ks < M_STEPS; ++ks) {
        const u64 b = make_smem_desc(queries + ks * 16 * SWIZZLE_BYTES, BLOCK_M * SWIZZLE_BYTES, SWIZZLE_ATOM_BYTES);
        wgmma_rs<elem_t, HEAD_DIM, MN_MAJOR>(acc, x[ks], b, 1);
    }
}


// dSᵀ = Pᵀ ∘ (dPᵀ − Δ) in place in dp (stage 8's score_gradients: its exercise there).
__device__ __forceinline__ void score_gradients(float (&dp)[M_FRAGS][4], const float (&p)[M_FRAGS][4],
                                                const float* delta, int lane) {
#pragma unroll
    for (int n = 0; n < M_FRAGS; ++n) {
        const float2 d = *reinterpret_cast<const float2*>(delta + 8 * n + 2 * (lane % 4));
        dp[n][0] = p[n][0] * (dp[n][0] - d.x);
        dp[n][1] = p[n][1] * (dp[n][1] - d.y);
        dp[n][2] = p[n][2] * (dp[n][2] - d.x);
        dp[n][3] = p[n][3] * (dp[n][3] - d.y);
    }
}

// The warp's 16 rows of dSᵀ (keys row0 .. row0+15 of the block) into the dSᵀ tile, rounded to elem_t:
// column blocks of 64 queries (BLOCK_N rows of 128 bytes each), in a block row = key, 16-byte chunk c
// at c ^ (row % 8) -- the 128-byte swizzle that TMA writes and the wgmma descriptor describes (the tile
// is 1024-byte aligned), stage 3's swizzle<SWIZZLE_BYTES>. Fragment n holds queries 8n .. 8n+7.
__device__ __forceinline__ void store_score_gradients(unsigned ds_tile, const float (&ds)[M_FRAGS][4], int row0,
                                                      int lane) {
#pragma unroll
    for (int n = 0; n < M_FRAGS; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + lane / 4 + 8 * r;
            const unsigned pair = pack_pair<elem_t>(ds[n][2 * r], ds[n][2 * r + 1]);
            const unsigned block = ds_tile + (n / 8) * BLOCK_N * SWIZZLE_BYTES;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(block + swizzle<SWIZZLE_BYTES>(row, n % 8) + 4 * (lane % 4)),
                         "r"(pair)
                         : "memory");
        }
}

// acc[n] <- acc[n ^ x] for every fragment n, x = 0 .. 3 per thread: two rounds of conditional swaps
// with selects, since registers cannot be indexed at run time.
__device__ __forceinline__ void swap_fragments(float (&acc)[DQ_FRAGS][4], int x) {
#pragma unroll
    for (int bit = 1; bit < 4; bit *= 2) {
        const bool swap = x & bit;
#pragma unroll
        for (int n = 0; n < DQ_FRAGS; ++n) {
            if (n & bit) continue;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const float low = acc[n][c], high = acc[n ^ bit][c];
                acc[n][c] = swap ? high : low;
                acc[n ^ bit][c] = swap ? low : high;
            }
        }
    }
}

// The warp's 16 query rows (row0 ..) × DQ_COLS columns from col0 of dQ into the tile's buffer in shared
// memory -- fp32 rows of HEAD_DIM, as in global memory. Every
// row starts on bank 0 (rows are 4·HEAD_DIM bytes apart), so the eight row quads of a warp storing
// fragment n (columns 8n .. 8n+7) would all hit banks 8(n % 4) .. +7: four ways conflicted in each
// half-warp. Quad g handles fragment n ^ (g % 4) at step n instead: the four quads of a half-warp cover
// the 32 banks, and each v2 access takes the fewest wavefronts, 2 (64 selects a thread buy that).
__device__ __forceinline__ void store_dq(unsigned dq_tile, float (&acc)[DQ_FRAGS][4], int row0, int col0, int lane) {
    const int x = lane / 4 % 4;
    swap_fragments(acc, x);
    // Fragment n ^ x lies 32·(n ^ x) = 128·(n / 4) + 32·(n % 4 ^ x) bytes into the row: four addresses
    // a thread, the rest immediate offsets.
    const unsigned row = dq_tile + (row0 + lane / 4) * HEAD_DIM * 4 + (col0 + 2 * (lane % 4)) * 4;
    unsigned quarter[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) quarter[k] = row + 32 * (k ^ x);
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int n = 0; n < DQ_FRAGS; ++n) {
            const unsigned at = quarter[n % 4] + 128 * (n / 4) + r * 8 * HEAD_DIM * 4;
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(acc[n][2 * r]), "f"(acc[n][2 * r + 1]) : "memory");
        }
}

// The consumers' side of dQ's way out (add_dq_tiles is the other): wait until the buffer of tile i is
// free (the bulk add of tile i - DQ_STAGES has read it), store the warp's 16 rows of the consumer's
// 64 × 64 part, make them visible to the bulk copy (the async proxy), arrive on the buffer's full barrier.
__device__ __forceinline__ void hand_over_dq(const SharedMemory& shared, float (&dq)[DQ_FRAGS][4], int i, int consumer,
                                             int warp_in_group, int lane) {
    const int slot = i % DQ_STAGES;
    mbarrier_wait(shared.barrier(DQ_EMPTY + slot), ((i / DQ_STAGES) & 1) ^ 1);  // a fresh barrier: at once
    const int row0 = (DQ_SPLIT_BY_QUERIES ? consumer * 64 : 0) + warp_in_group * 16;
    store_dq(shared.dq_slot(slot), dq, row0, DQ_SPLIT_BY_QUERIES ? 0 : consumer * DQ_COLS, lane);
    fence_async_shared();
    mbarrier_arrive(shared.barrier(DQ_FULL + slot));
}

// dq[64 queries × 64 columns] = dS K for consumer `consumer`'s share over all 128 keys: each stage's own
// (stage 9's exercise), defined in its attention.cu.
__device__ __forceinline__ void issue_dq(float (&dq)[DQ_FRAGS][4], unsigned ds_tile, unsigned k_tile, int consumer);

// A consumer's query tile i, as each stage's walk reaches it, is stage 9's schedule (its header's diagram)
// in two steps: start_tile, the stage's masking of Sᵀ into Pᵀ (its `probabilities`), finish_tile. The
// softmax runs under the products (FlashAttention-3 overlaps P with dPᵀ; issuing dV before dS is one step
// further, where the registers allow it): Sᵀ and dPᵀ in two commit groups, so that P is computed while dPᵀ
// still runs; at 64 queries dV += Pᵀ dO is queued behind dPᵀ at once, and dS is computed while dV runs.
// Measured against the softmax between the products: +1.5 to 2.5 % at D = 128 (docs/stages/stage9.md).

// Where tile i lies: its slot of the query-side ring (Q, dO, LSE, Δ) and its buffer of dSᵀ.
struct TileBuffers {
    int slot;
    unsigned q, d_o, ds;
};

// Tile i's first step: wait until the producer has filled its slot, issue Sᵀ = K Qᵀ and dPᵀ = V dOᵀ
// (k_rows, v_rows: the consumer's 64 keys of K and V) and wait for Sᵀ; dPᵀ may still run.
__device__ __forceinline__ TileBuffers start_tile(const SharedMemory& shared, int i, unsigned k_rows, unsigned v_rows,
                                                  float (&s)[M_FRAGS][4], float (&dp)[M_FRAGS][4]) {
    const int slot = i % Q_STAGES;
    const TileBuffers tile{slot, shared.q_slot(slot), shared.do_slot(slot), shared.ds_slot(i % DS_STAGES)};
    mbarrier_wait(shared.barrier(Q_FULL + slot), (i / Q_STAGES) & 1);
    wgmma_fence();
    issue_rows_times_queries(s, k_rows, tile.q);     // Sᵀ = K Qᵀ
    wgmma_commit();
    issue_rows_times_queries(dp, v_rows, tile.d_o);  // dPᵀ = V dOᵀ
    wgmma_commit();
    wgmma_wait<1>();  // Sᵀ done; dPᵀ may still run
    fence_registers(s);
    return tile;
}

// Tile i's last step, once s holds Pᵀ: dV += Pᵀ dO, dSᵀ through shared memory, dK += dSᵀ Q, dQ = dS K
// handed to the producer's thread 32, the slot released (row0: the warp's first key in the block). dSᵀ is
// double-buffered: a consumer writes buffer i % 2 at tile i only after passing DS_READY of tile i - 1,
// which the other consumer reached only after its dQ of tile i - 2 -- the last reader of that buffer --
// had completed (wgmma_wait<0> before it). So one barrier per tile suffices.
__device__ __forceinline__ void finish_tile(const SharedMemory& shared, const TileBuffers& tile, int i, int consumer,
                                            int warp_in_group, int lane, int row0, float (&s)[M_FRAGS][4],
                                            float (&dp)[M_FRAGS][4], float (&dk)[D_FRAGS][4], float (&dv)[D_FRAGS][4]) {
    unsigned p_a[M_STEPS][4], ds_a[M_STEPS][4];
    if constexpr (DV_BEFORE_DS) {
#pragma unroll
        for (int ks = 0; ks < M_STEPS; ++ks) p_as_a_operand(s, ks, p_a[ks]);
        wgmma_fence();
        issue_accumulate(dv, p_a, tile.d_o);  // dV += Pᵀ dO, queued behind dPᵀ
        wgmma_commit();
        wgmma_wait<1>();  // dPᵀ done; dV runs on while dS is computed
    } else {
        wgmma_wait<0>();  // dPᵀ done
    }
    fence_registers(dp);
    score_gradients(dp, s, shared.floats(shared.delta_slot(tile.slot)), lane);  // dSᵀ
#pragma unroll
    for (int ks = 0; ks < M_STEPS; ++ks) p_as_a_operand(dp, ks, ds_a[ks]);
    store_score_gradients(tile.ds, dp, row0, lane);
    fence_async_shared();  // the stores, visible to wgmma (the async proxy)

    if constexpr (!DV_BEFORE_DS) {
#pragma unroll
        for (int ks = 0; ks < M_STEPS; ++ks) p_as_a_operand(s, ks, p_a[ks]);
    }
    wgmma_fence();
    if constexpr (!DV_BEFORE_DS) issue_accumulate(dv, p_a, tile.d_o);  // dV += Pᵀ dO
    issue_accumulate(dk, ds_a, tile.q);  // dK += dSᵀ Q
    wgmma_commit();
    named_barrier_sync(DS_READY, CONSUMER_THREADS);  // both consumers' dSᵀ are stored
    float dq[DQ_FRAGS][4];
    wgmma_fence();
    issue_dq(dq, tile.ds, shared.k_tile(), consumer);  // dQ (a part) = dS K
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(dv);
    fence_registers(dk);
    fence_registers(dq);
    fence_registers(p_a);
    fence_registers(ds_a);
    mbarrier_arrive(shared.barrier(Q_EMPTY + tile.slot));  // Q, dO, LSE and Δ of this slot: read
    hand_over_dq(shared, dq, i, consumer, warp_in_group, lane);  // added to dQ by the producer's thread 32
}

// The warp's 16 rows of dK or dV (times `factor`) of KV pair kv_pair, rounded to elem_t; rows >= seq_kv are
// not written.
__device__ __forceinline__ void write_rows(const HeadRows<elem_t>& rows, int kv_pair, const float (&acc)[D_FRAGS][4],
                                           float factor, int key0, int seq_kv, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + lane / 4 + 8 * r;
        if (key >= seq_kv) continue;
        elem_t* row = rows.row(kv_pair, key) + 2 * (lane % 4);
#pragma unroll
        for (int n = 0; n < D_FRAGS; ++n)
            *reinterpret_cast<unsigned*>(row + 8 * n) = pack_pair<elem_t>(acc[n][2 * r] * factor, acc[n][2 * r + 1] * factor);
    }
}
