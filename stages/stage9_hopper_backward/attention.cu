// Stage 9 — Hopper attention backward: wgmma, TMA and warp specialization (FlashAttention-3 style).
// sm_90a only.
//
// Stage 8's algorithm (a block per tile of keys keeps dK and dV while it walks the query tiles,
// recomputing P; five products per tile; dQ summed over key tiles with fp32 atomics), on stage 4's
// machinery, with grouped-query attention in the kernel: a block owns 128 keys of one KV head and walks
// the query tiles of every query head of its group, so dK and dV -- sums over the group -- never leave
// its registers (no K, V repeated per query head, no sum afterwards):
//   TMA      a producer thread copies K and V once, then per query tile Q and dO (boxes of the
//            tensor maps built by the launch) and the tile's LSE and Δ (plain bulk copies), into
//            128-byte-swizzled shared memory; every copy counts its bytes on an mbarrier.
//   ring     Q_STAGES buffers of (Q, dO, LSE, Δ), each with a full and an empty mbarrier.
//   wgmma    the five products, accumulators in registers:
//              Sᵀ  = K Qᵀ     [64 keys × M queries]    A = K  (smem, K-major),  B = Q  (smem, K-major)
//              dPᵀ = V dOᵀ    [64 keys × M queries]    A = V  (smem, K-major),  B = dO (smem, K-major)
//              dV += Pᵀ dO    [64 keys × D]            A = Pᵀ (registers),      B = dO (smem, MN-major)
//              dK += dSᵀ Q    [64 keys × D]            A = dSᵀ (registers),     B = Q  (smem, MN-major)
//              dQ  = dS K     [64 queries × 64 of D]   A = dSᵀ (smem, MN-major: dS transposed), B = K (MN-major)
//            with M = BLOCK_M queries per tile: 64 at D = 128, 128 at D = 64 (FlashAttention-3's tiles:
//            at D = 64 the registers allow twice the queries, which halves the K and V operand reads
//            per query and the dQ tiles -- 0.77 -> 0.99× cuDNN's speed on the H100, docs/stages/stage9.md).
//            Pᵀ and dSᵀ come out of the first two products in the accumulator layout, which is the A
//            operand's register layout (p_as_a_operand): no shuffle, as in stage 8. dQ needs dS with
//            queries as rows: dSᵀ goes through shared memory once, and wgmma reads it transposed
//            (imm-trans-a), where stage 8 used ldmatrix.trans.
//   warp specialization  a producer warpgroup (24 registers: setmaxnreg) and two consumer warpgroups
//            (240), consumer c owning keys 64c .. 64c+63 of the block's 128 and their dK and dV. In the
//            producer warpgroup, thread 0 issues the loads and thread 32 (the next warp) dQ's bulk adds.
//
// Per query tile, the schedule of a consumer warpgroup (both run it side by side), the softmax under
// the products as FlashAttention-3 overlaps it: what the threads do, and beneath, what the tensor
// cores run meanwhile:
//
//   threads:      wait Q_FULL | issue Sᵀ, dPᵀ | wait Sᵀ | P | issue dV | wait dPᵀ | dS, dSᵀ -> smem | issue dK ...
//   tensor cores:               Sᵀ ........... dPᵀ ................... dV ....................... dK ...
//   (at D = 64, dV is issued with dK instead, after dS: with 128-query tiles Pᵀ as A fragments would not
//   fit in the registers beside Sᵀ and dPᵀ while dS is computed)
//   threads:      ... bar DS_READY (both consumers' dSᵀ are in) | issue dQ | wait all | arrive Q_EMPTY ...
//                 ... wait DQ_EMPTY | dQ -> smem | arrive DQ_FULL
//   producer, thread 0:  | K V | Q0 dO0 | Q1 dO1 | (wait Q_EMPTY of slot 0) Q2 dO2 | ...
//   producer, thread 32: (wait DQ_FULL) bulk reduce-add of dQ0 | wait until read | arrive DQ_EMPTY | ...
//
// dQ: each consumer computes a 64 × 64 part of the tile's dQ over all 128 keys (so both consumers' dSᵀ
// must be in shared memory: the named barrier DS_READY): at D = 128 (64 queries) columns 64c .. 64c+63,
// at D = 64 (128 queries) queries 64c .. 64c+63. Either way a consumer's dQ accumulator is 64 × 64 (32
// registers) and one wgmma shape serves. The fp32 dQ is summed over the key tiles in global
// memory, FlashAttention-3's way: the consumers store the tile's dQ in shared memory, and one thread adds the
// whole tile to global memory with one bulk reduce-add (cp.reduce.async.bulk .add.f32), the copy
// engine's, while the consumers go on with the next tile in the other of DQ_STAGES buffers. It replaced
// red.global.add.v2.f32 straight from the accumulators (the consumers' own LSU instructions, 1,024
// sector-sized atomics into L2 per query tile, the two consumers together): on the H100 that took
// the backward from 0.70× to 0.91× cuDNN's speed at D = 128 (docs/stages/stage9.md).
//
// Registers per consumer thread: dK and dV D/2 each (64 at D = 128), Sᵀ and dPᵀ M/2 each, Pᵀ and dSᵀ
// as A operands M/4 each, dQ 32.
// Shared memory: K, V 128·D·2 each; Q, dO Q_STAGES·M·D·2 each; dSᵀ 2 × 128·M·2 (double-buffered,
// so that one named barrier per tile suffices: see finish_tile()); dQ DQ_STAGES × M·D·4; LSE, Δ
// Q_STAGES·M·4 bytes each; barriers; 1 KB to align to 1024. D = 128: 226 KB (of the 227 a block may
// have); D = 64: 195 KB. One block per SM.
//
// Tensors are [B, H, S, D], D contiguous (K, V, dK, dV: [B, H_kv, S, D]); 4-D tensor maps with their
// strides, so boxes never cross into the next head (rows past S read as zeros). Causal masking is
// top-left aligned: query i sees keys j <= i.
#include "wgmma_attention_backward.cuh"  // the tiles, the products, dSᵀ and dQ through shared memory

// What a block computes: the BLOCK_N keys of key tile n_block of KV pair kv_pair (b·H_kv + h_kv) against
// the query tiles [first_tile, end_tile) of each query head of its group: query pairs kv_pair·group + g,
// g = 0 .. group - 1 (= b·H + h_kv·group + g, the heads that share KV head h_kv). Producer, dQ writer and
// consumers walk them in the same order, head by head, counting the tiles (i) for the ring's slots and
// phases.
struct BlockWork {
    int kv_pair, kv_heads, n_block, group, first_tile, end_tile;
    __device__ int n0() const { return n_block * BLOCK_N; }
    __device__ int query_pair(int g) const { return kv_pair * group + g; }  // in the dense LSE, Δ and dQ sums
    __device__ int batch() const { return kv_pair / kv_heads; }             // the tensor maps' coordinates
    __device__ int kv_head() const { return kv_pair % kv_heads; }
    __device__ int query_head(int g) const { return kv_head() * group + g; }
};

// --8<-- [start:producer]
// The producer: one thread issues every copy -- K and V once, then each query tile's Q, dO, LSE and
// Δ into ring slot i % Q_STAGES, once the consumers have released it.
__device__ __forceinline__ void produce(const SharedMemory& shared, const BlockWork& work, const TmaMap& q_map,
                                        const TmaMap& k_map, const TmaMap& v_map, const TmaMap& do_map,
                                        const float* lse_log2, const float* delta, int seq_q_padded) {
    load_keys_values(shared, work, q_map, k_map, v_map, do_map);
    int i = 0;  // query tiles issued so far
    for (int g = 0; g < work.group; ++g)
        for (int tile = work.first_tile; tile < work.end_tile; ++tile, ++i)
            load_query_tile(shared, work, i, g, tile * BLOCK_M, q_map, do_map, lse_log2, delta, seq_q_padded);
}
// --8<-- [end:producer]

// dQ's way to global memory: one thread adds each query tile's dQ to the fp32 sums, in the walk's order,
// with one bulk reduce-add a tile (add_dq_tile).
__device__ __forceinline__ void add_dq_tiles(const SharedMemory& shared, const BlockWork& work, float* dq_accum,
                                             int seq_q_padded) {
    int i = 0;  // query tiles added so far
    for (int g = 0; g < work.group; ++g)
        for (int tile = work.first_tile; tile < work.end_tile; ++tile, ++i)
            add_dq_tile(shared, work, i, g, tile * BLOCK_M, dq_accum, seq_q_padded);
}

// dq[64 queries × 64 columns] = dS K for consumer `consumer`'s share over all 128 keys (see the header:
// at D = 128 the columns 64·consumer .., at D = 64 the queries 64·consumer ..).
__device__ __forceinline__ void issue_dq(float (&dq)[DQ_FRAGS][4], unsigned ds_tile, unsigned k_tile, int consumer) {
    const unsigned ds_queries = ds_tile + (DQ_SPLIT_BY_QUERIES ? consumer : 0) * BLOCK_N * SWIZZLE_BYTES;  // its column block of dSᵀ
    const unsigned k_columns = k_tile + (DQ_SPLIT_BY_QUERIES ? 0 : consumer) * BLOCK_N * SWIZZLE_BYTES;    // its column block of K
    // EXERCISE: issue dQ = dS K, BLOCK_N / 16 wgmmas of 16 keys each. Shared memory holds dSᵀ --
    // [key][query], column blocks of 64 queries, a 128-byte row per key -- so the A operand dS
    // [query][key] is MN-major: wgmma_ss_a_mn reads it transposed, from the column block at ds_queries.
    // B is K [key][d] = [k][n], MN-major too, its column block at k_columns. For both, 16 keys are two
    // 8-row groups of the swizzle (SBO = 1024 bytes) starting 16·128 bytes further down per step; the
    // LBO (the next 64 columns) is never used with 64 columns: BLOCK_N·128, as for V in stage 4. The
    // first step overwrites dq (accumulate = 0).
    // STUB: for (auto& f : dq) f[0] = f[1] = f[2] = f[3] = 0.0f;  // dQ comes out 0; dK and dV stay right
#pragma unroll
    for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
        const int row = 16 * ks * SWIZZLE_BYTES;
        const u64 ds = make_smem_desc(ds_queries + row, BLOCK_N * SWIZZLE_BYTES, SWIZZLE_ATOM_BYTES);
        const u64 k = make_smem_desc(k_columns + row, BLOCK_N * SWIZZLE_BYTES, SWIZZLE_ATOM_BYTES);
        wgmma_ss_a_mn<elem_t, DQ_COLS, MN_MAJOR>(dq, ds, k, ks > 0);
    }
    // END EXERCISE
}

// --8<-- [start:consumer]
// Consumer `consumer` (0 or 1): keys 64·consumer .. of the block, their dK and dV in registers for
// the whole walk (every query tile of every query head of the group), each tile in the two steps of
// wgmma_attention_backward.cuh (start_tile, finish_tile: the schedule of the header's diagram) with Pᵀ
// between them, masked on the causal diagonal.
__device__ __forceinline__ void consume(const SharedMemory& shared, const BlockWork& work, int consumer,
                                        const HeadRows<elem_t>& dk_rows, const HeadRows<elem_t>& dv_rows, int seq_kv,
                                        float scale, int causal) {
    const int lane = threadIdx.x % 32, warp_in_group = threadIdx.x / 32 % 4;
    const int row0 = consumer * CONSUMER_KEYS + warp_in_group * 16;  // the warp's first key in the block
    const int key0 = work.n0() + row0;
    const unsigned k_rows = shared.k_tile() + consumer * CONSUMER_KEYS * SWIZZLE_BYTES;  // this consumer's keys
    const unsigned v_rows = shared.v_tile() + consumer * CONSUMER_KEYS * SWIZZLE_BYTES;
    const float scale_log2 = scale * LOG2E;
    float dk[D_FRAGS][4], dv[D_FRAGS][4];
#pragma unroll
    for (int n = 0; n < D_FRAGS; ++n) dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;

    mbarrier_wait(shared.barrier(KV_FULL), 0);  // also when there is no query tile: no copy outlives the block
    int i = 0;  // query tiles consumed so far
    for (int g = 0; g < work.group; ++g) {
        for (int tile = work.first_tile; tile < work.end_tile; ++tile, ++i) {
            const int m0 = tile * BLOCK_M;
            float s[M_FRAGS][4], dp[M_FRAGS][4];
            const TileBuffers buffers = start_tile(shared, i, k_rows, v_rows, s, dp);  // Sᵀ; dPᵀ under way
            const bool on_diagonal = causal && m0 < key0 + 15;  // some key of the warp after some query
            probabilities(s, shared.floats(shared.lse_slot(buffers.slot)), scale_log2, on_diagonal, key0, m0, lane);  // Pᵀ
            finish_tile(shared, buffers, i, consumer, warp_in_group, lane, row0, s, dp, dk, dv);
        }
    }

    write_rows(dk_rows, work.kv_pair, dk, scale, key0, seq_kv, lane);
    write_rows(dv_rows, work.kv_pair, dv, 1.0f, key0, seq_kv, lane);
}
// --8<-- [end:consumer]

// --8<-- [start:kernel]
// The block that blockIdx.x = `block` is: (its key tile, its KV pair). The GPU starts blocks in the order of
// blockIdx.x, so this is the schedule: chunks of chunk_pairs KV pairs, each chunk key tile by key tile. Under
// the causal mask key tile 0 meets every query tile and the last key tile one, so each wave starts the
// longest blocks left and the last wave's are short; pair by pair instead, the last pairs' long blocks would
// start last and run alone (at B2 H_kv 8 S2048, GQA 4: ~1.6x the balanced time, counted). The launch sizes a
// chunk to fill the SMs, so that the blocks running together share few pairs' Q and dO in L2.
__device__ __forceinline__ int2 key_tile_and_pair(int block, int key_tiles, int kv_pairs, int chunk_pairs) {
    const int first_pair = block / (chunk_pairs * key_tiles) * chunk_pairs;
    const int pairs = min(chunk_pairs, kv_pairs - first_pair);  // the last chunk may hold fewer
    const int in_chunk = block - first_pair * key_tiles;
    return make_int2(in_chunk / pairs, first_pair + in_chunk % pairs);
}

// The kernel's parameters besides its tensor maps (__init__.py's BackwardParams packs them): the preprocess's
// LSE in log2 units and Δ, dQ's fp32 sums ([B, H, seq_q_padded(, D)]), dK and dV as HeadRows take them.
struct BackwardParams {
    const float *lse_log2, *delta;
    float* dq_accum;
    elem_t* dk;
    long long dk_batch_stride, dk_head_stride;
    int dk_row_stride;
    elem_t* dv;
    long long dv_batch_stride, dv_head_stride;
    int dv_row_stride;
    int kv_heads, seq_q, seq_kv, seq_q_padded;
    float scale;
    int causal, group, kv_pairs, chunk_pairs;
};

// A block per (tile of 128 keys, KV pair), in key_tile_and_pair's order: a producer warpgroup that gives its
// registers away and copies (tiles in, dQ out), two consumer warpgroups that take them and compute. `group` query heads
// share each KV head (1 without GQA). The tensor maps and dK, dV carry their tensors' strides: a model's
// [B, S, H, D] views are read and written where they lie.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
attention_bwd(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
              const __grid_constant__ TmaMap v_map, const __grid_constant__ TmaMap do_map,
              const __grid_constant__ BackwardParams p) {
    extern __shared__ __align__(SWIZZLE_ATOM_BYTES) unsigned char shared_raw[];
    // TMA's 128-byte swizzle and the descriptors' base offset 0 assume 1024-byte-aligned tiles.
    const unsigned raw = shared_address(shared_raw), base = atom_aligned(raw);
    const SharedMemory shared{base, shared_raw + (base - raw)};
    const int2 tile_and_pair = key_tile_and_pair(blockIdx.x, (p.seq_kv + BLOCK_N - 1) / BLOCK_N, p.kv_pairs,
                                                 p.chunk_pairs);
    const int n0 = tile_and_pair.x * BLOCK_N;  // the block's first key
    // Causal: queries before n0 see none of the block's keys; their tiles are skipped (in every head).
    const BlockWork work{tile_and_pair.y, p.kv_heads, tile_and_pair.x, p.group, p.causal ? n0 / BLOCK_M : 0,
                         (p.seq_q + BLOCK_M - 1) / BLOCK_M};
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
        consume(shared, work, warpgroup - 1, dk_rows, dv_rows, p.seq_kv, p.scale, p.causal);
    }
}
// --8<-- [end:kernel]
