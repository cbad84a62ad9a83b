// Stage 8 — attention backward: FlashAttention-2's backward pass on tensor cores.
//
// Given the forward's O and LSE and the gradient dO, compute dQ, dK and dV without ever storing
// the Sq × Skv matrix P: each block owns one tile of BLOCK_N keys of one (batch, head), keeps its
// dK and dV in fp32 registers, and walks every tile of BLOCK_M queries that sees those keys,
// recomputing P from Q, K and the LSE. Per query tile, five products (scale = 1/√D):
//
//     Sᵀ  = K Qᵀ                      (BLOCK_N × BLOCK_M)   recompute the scores
//     Pᵀ  = exp(scale·Sᵀ − LSE)                             ... and the probabilities
//     dV += Pᵀ dO                     (BLOCK_N × D)
//     dPᵀ = V dOᵀ                     (BLOCK_N × BLOCK_M)
//     dSᵀ = Pᵀ ∘ (dPᵀ − Δ)            Δ_i = rowsum(dO_i ∘ O_i), computed once by the preprocess
//     dK += scale · dSᵀ Q             (BLOCK_N × D)
//     dQ += scale · dS K              (BLOCK_M × D)  -- summed over every key tile: fp32 atomics
//
// The block computes the transposed products (keys as rows): each warp owns 16 keys, so Pᵀ comes out
// of the mma accumulators already in the layout of the A operand of dV += Pᵀ dO (mma.cuh,
// p_as_a_operand): no shuffle. dSᵀ goes through shared memory: dQ needs it the other way round, with
// queries as rows (ldmatrix.trans reads it back transposed), and dK += dSᵀ Q reads it back too, tiled
// over the warps as 32 keys × D/2 each, so that each fragment of Q feeds two m16 tiles instead of one.
//
// The kernels: attention_bwd_preprocess (Δ, the LSE in log2 units, a zeroed fp32 dQ), attention_bwd
// (the loop above, a key tile per block), attention_bwd_tail (the same loop for the last wave's key tiles,
// split evenly over the SMs; see "The tail" below) with attention_bwd_dkv_tail (their dK and dV from fp32
// sums), and attention_bwd_dq (the fp32 dQ scaled and rounded to elem_t). Tensors are [B, H, S, D],
// contiguous. Causal masking is top-left aligned, as in PyTorch: query i sees keys j <= i.
#include "mma.cuh"
#include "cp_async.cuh"
#include "swizzle.cuh"  // stage 3's swizzle<ROW_BYTES> and cp.async copies of a tile
#include "attention_backward.cuh"  // the preprocess and the dQ conversion, shared with stage 9

// The tile configuration, per head dimension.
//   Keys: 8 warps × 16 = 128 per block, the block's dK and dV in registers for the whole loop:
//         2 × D/2 fp32 registers per thread (64 at D = 64, 128 at D = 128).
//   Queries: tiles of 64, double-buffered (Q, dO, LSE and Δ of tile i+1 load during tile i).
//   Sᵀ and dPᵀ of one query tile: 2 × 32 fp32 registers per thread.
// At D = 64 the warp's K and V rows (the A operands of Sᵀ and dPᵀ) stay in registers too (16 each);
// at D = 128 they would not fit beside 192 registers of accumulators and are re-read from shared
// memory, one k-step at a time.
constexpr int NUM_WARPS = 8;
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int BLOCK_N = 16 * NUM_WARPS;             // keys per block
constexpr int BLOCK_M = 64;                         // queries per step of the loop
constexpr int Q_STAGES = 2;                         // buffers of the query-side tiles
constexpr bool KV_IN_REGISTERS = HEAD_DIM == 64;
constexpr int KV_HELD_STEPS = KV_IN_REGISTERS ? HEAD_DIM / 16 : 1;
constexpr int D_STEPS = HEAD_DIM / 16;              // k-steps of a product over d
constexpr int D_FRAGS = HEAD_DIM / 8;               // n8 fragments of a 16 × D accumulator
constexpr int M_STEPS = BLOCK_M / 16;               // k-steps of a product over the query tile
constexpr int M_FRAGS = BLOCK_M / 8;                // n8 fragments of a warp's 16 × BLOCK_M scores
// dQ = dS K: the BLOCK_M × D product is tiled over the warps, DQ_ROWS queries × DQ_COLS = 32 d columns
// each (a staged row of fp32 is one 128-byte line, add_to_dq): 32 × 32 at D = 128, 16 × 32 at D = 64.
// Per k-step of 16 keys a warp reads DQ_ROWS / 16 A and DQ_COLS / 16 B fragments for DQ_ROWS·DQ_COLS / 128
// mma: at D = 128, 2 + 2 ldmatrix for 8 mma, where 16 × 64 took 1 + 4 (32 per tile instead of 40);
// at D = 64 either shape takes 1 + 2 (32 × 16: 2 + 1).
constexpr int DQ_COLS = 32;
constexpr int DQ_ROWS = BLOCK_M * HEAD_DIM / (DQ_COLS * NUM_WARPS);
constexpr int DQ_M_TILES = DQ_ROWS / 16;
constexpr int DQ_FRAGS = DQ_COLS / 8;
constexpr int DQ_WARPS_M = BLOCK_M / DQ_ROWS;       // warps along the queries
// dK += dSᵀ Q after the barrier that publishes dSᵀ, tiled 2-D as FlashAttention-2 tiles it: 4 warps along
// the keys (DK_ROWS = 32 each) × 2 along d (DK_COLS = D/2 each). Per k-step of 16 queries a warp reads 2 A
// fragments of dSᵀ and DK_COLS / 16 of Q for 2·DK_COLS / 8 mma: at D = 128, 24 ldmatrix a tile where a
// warp's own 16 keys × D took 32 (at D = 64, 16 either way).
constexpr int DK_WARPS_N = 4;
constexpr int DK_ROWS = BLOCK_N / DK_WARPS_N;
constexpr int DK_COLS = HEAD_DIM * DK_WARPS_N / NUM_WARPS;
constexpr int DK_M_TILES = DK_ROWS / 16;
constexpr int DK_FRAGS = DK_COLS / 8;
using DkAccumulator = float[DK_M_TILES][DK_FRAGS][4];  // a warp's DK_ROWS × DK_COLS of dK
using DvAccumulator = float[1][D_FRAGS][4];           // a warp's 16 keys × D of dV
// dQ is staged in fp32 one m16 tile of the warp's part at a time (add_to_dq): 2 KB per warp, 16 KB for the
// block, in a buffer no warp reads after the barrier: this tile's dO at D = 128, the V tile at D = 64
// (whose V is held in registers).
constexpr int STAGING_ROWS = 16;
constexpr int STAGING_BYTES = STAGING_ROWS * DQ_COLS * 4;
// After the barrier, dK += dSᵀ Q then dQ += dS K at D = 128 (measured faster than the other order, H100);
// dQ first at D = 64 (dK first spills there).
constexpr bool DK_BEFORE_DQ = HEAD_DIM == 128;
// Shared memory: [K][V][Q ring][dO ring][dSᵀ][LSE ring][Δ ring], all tiles swizzled (see stage 3).
constexpr int ROW_BYTES = HEAD_DIM * 2;
constexpr int KV_TILE_BYTES = BLOCK_N * ROW_BYTES;
constexpr int Q_TILE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int DS_ROW_BYTES = BLOCK_M * 2;           // dSᵀ: a row per key, BLOCK_M queries
constexpr int DS_TILE_BYTES = BLOCK_N * DS_ROW_BYTES;
constexpr int VECTOR_BYTES = BLOCK_M * 4;           // the LSE or Δ of a query tile, fp32
constexpr int SHARED_BYTES = 2 * KV_TILE_BYTES + 2 * Q_STAGES * Q_TILE_BYTES + DS_TILE_BYTES +
                             2 * Q_STAGES * VECTOR_BYTES;
static_assert(sizeof(elem_t) == 2, "ldmatrix and the chunk arithmetic assume 16-bit elements");
static_assert(DQ_ROWS % 16 == 0 && BLOCK_M % DQ_ROWS == 0 && DQ_WARPS_M * (HEAD_DIM / DQ_COLS) == NUM_WARPS,
              "dQ's tiles divide among the warps");
static_assert(NUM_WARPS * STAGING_BYTES <= (KV_IN_REGISTERS ? KV_TILE_BYTES : Q_TILE_BYTES), "dQ's staging fits");
static_assert(DK_ROWS % 16 == 0 && DK_COLS % 16 == 0, "dK's warp tiles are whole 16 × 16 blocks");

// The thread index, read through a volatile asm: a value ptxas cannot hoist out of the loop, so that
// per-warp and per-lane addresses made from it (the dQ and dK products', the K and V fragments') are
// recomputed by a few integer instructions per tile instead of being held across the loop (held, the
// kernel spills at D = 128; load_tile_from_base, in swizzle.cuh, does the same). Unsigned and bounded, so
// that lane = thread % 32 and warp = thread / 32 are a mask and a shift, not signed divisions.
__device__ __forceinline__ unsigned unhoisted_thread() {
    unsigned thread;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(thread));
    __builtin_assume(thread < NUM_THREADS);
    return thread;
}

// Register allocation: ptxas fills all 255 registers of __launch_bounds__(256, 1) whatever the code, and
// spills come and go with equivalent formulations of the same arithmetic; which ones it allocates without
// spilling differs by head dimension and architecture (every combination compiled with NVRTC 13.0 and
// 13.5: docs/notebook/stage8.md). Two choices are made per (D, architecture):
//   MASK_AGAINST_CONSTANTS: the causal test compares one per-thread term with immediates (probabilities,
//     attention_backward.cuh): fewer instructions at D = 128, more at D = 64;
//   QUERY_LANE_UNHOISTED: the query tiles' ldmatrix addresses made from unhoisted_thread(), so that ptxas
//     recomputes them instead of holding them: needed at D = 128 on sm_80, 80 more instructions a tile on sm_90.
constexpr bool MASK_AGAINST_CONSTANTS = HEAD_DIM == 128;
#if __CUDA_ARCH__ >= 900
constexpr bool QUERY_LANE_UNHOISTED = false;
#else
constexpr bool QUERY_LANE_UNHOISTED = HEAD_DIM == 128;
#endif

// The addresses of swizzle<ROW> (swizzle.cuh: stage 3's swizzle; rows of 128 or 256 bytes here) for
// ldmatrix, in two parts. A lane reads row lane_row + R, chunk lane_chunk + C of a tile, with R a
// multiple of 8 and C even (a 16 × 16 block at rows R, columns 8C); since C + lane_chunk = C ^ lane_chunk
// and row % 8 = lane_row % 8,
//     swizzle(R + lane_row, C + lane_chunk) = (swizzle(lane_row, lane_chunk) ^ 16·C) + R·ROW
// (the XOR reaches no bit of R·ROW, nor of the tile's address: tiles start at multiples of ROW). So
// each lane computes its address once per tile and order (lane_address), and every ldmatrix is one
// XOR and an immediate offset: without this, ptxas holds dozens of per-block addresses in registers.
template <int ROW>
__device__ __forceinline__ unsigned lane_address(unsigned tile, int lane_row, int lane_chunk) {
    return tile + swizzle<ROW>(lane_row, lane_chunk);
}

template <int ROW>
__device__ __forceinline__ unsigned block_address(unsigned lane_base, int row, int chunk) {
    return (lane_base ^ (16 * chunk)) + row * ROW;
}

// The cp.async copies of a Q, dO, K or V tile into its swizzled buffer (swizzle.cuh), every copy's
// row tested (zero-filled past `rows`).
template <int TILE_ROWS>
__device__ __forceinline__ void load_tile_async(unsigned tile, const elem_t* source, int rows) {
    load_tile_from_base<TILE_ROWS, HEAD_DIM, NUM_THREADS, /*UNPREDICATED_WHOLE_TILES=*/false>(tile, source, rows);
}

// The BLOCK_M fp32 values of a query tile (the LSE or Δ; the preprocess padded them to whole tiles).
__device__ __forceinline__ void load_vector_async(unsigned destination, const float* source) {
    if (threadIdx.x < VECTOR_BYTES / 16) cp_async_16(destination + 16 * threadIdx.x, source + 4 * threadIdx.x, true);
}

struct QueryTile {  // the shared addresses of one buffer of the query-side ring
    unsigned q, d_o, lse, delta;
};

__device__ __forceinline__ QueryTile query_buffer(unsigned q_ring, unsigned do_ring, unsigned lse_ring,
                                                  unsigned delta_ring, int tile) {
    const int b = tile % Q_STAGES;
    return {q_ring + b * Q_TILE_BYTES, do_ring + b * Q_TILE_BYTES, lse_ring + b * VECTOR_BYTES,
            delta_ring + b * VECTOR_BYTES};
}

__device__ __forceinline__ void load_query_tile_async(const QueryTile& to, const elem_t* q_head, const elem_t* do_head,
                                                      const float* lse_head, const float* delta_head, int m0,
                                                      int seq_q) {
    load_tile_async<BLOCK_M>(to.q, q_head + (size_t)m0 * HEAD_DIM, seq_q - m0);
    load_tile_async<BLOCK_M>(to.d_o, do_head + (size_t)m0 * HEAD_DIM, seq_q - m0);
    load_vector_async(to.lse, lse_head + m0);
    load_vector_async(to.delta, delta_head + m0);
}

// The A operand of k-step kk (d columns 16·kk ..) of the warp's 16 rows of a K or V tile.
__device__ __forceinline__ void load_row_fragment(unsigned (&a)[4], unsigned tile, int row0, int kk) {
    const int lane = (int)(unhoisted_thread() % 32);
    ldmatrix_x4(a, block_address<ROW_BYTES>(lane_address<ROW_BYTES>(tile, a_order_row(lane), a_order_chunk(lane)), row0,
                                            2 * kk));
}

// acc[16 × BLOCK_M] = (the warp's 16 rows of K or V) · (the query tile of Q or dO)ᵀ: Sᵀ or dPᵀ.
// The A operands come from `held` (KV_IN_REGISTERS) or are read from `rows_tile` one k-step at a
// time; the query tile is the B operand, [query][d] = [n][k], read in ldmatrix's B order.
__device__ __forceinline__ void warp_rows_times_queries(float (&acc)[M_FRAGS][4],
                                                        const unsigned (&held)[KV_HELD_STEPS][4], unsigned rows_tile,
                                                        int row0, unsigned query_tile, int lane) {
#pragma unroll
    for (int n = 0; n < M_FRAGS; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    if (QUERY_LANE_UNHOISTED) lane = (int)(unhoisted_thread() % 32);
    const unsigned b_base = lane_address<ROW_BYTES>(query_tile, b_order_row(lane), b_order_chunk(lane));
#pragma unroll
    for (int kk = 0; kk < D_STEPS; ++kk) {
        unsigned read[4];
        if (!KV_IN_REGISTERS) load_row_fragment(read, rows_tile, row0, kk);
        const unsigned (&a)[4] = *(KV_IN_REGISTERS ? &held[kk % KV_HELD_STEPS] : &read);
#pragma unroll
        for (int m16 = 0; m16 < M_STEPS; ++m16) {
            unsigned b[4];  // b[0], b[1] of queries 16·m16 + 0..7, then of + 8..15
            ldmatrix_x4(b, block_address<ROW_BYTES>(b_base, 16 * m16, 2 * kk));
            mma_m16n8k16<elem_t>(acc[2 * m16], a, b[0], b[1]);
            mma_m16n8k16<elem_t>(acc[2 * m16 + 1], a, b[2], b[3]);
        }
    }
}

// acc[16 × D] += xᵀ-rows · (a query tile): dV += Pᵀ dO. x holds the warp's 16 keys × BLOCK_M queries as
// mma accumulators, which are, pairwise, the A operand over the queries (p_as_a_operand); the query tile
// is the B operand, [query][d] = [k][n], read with ldmatrix.trans.
__device__ __forceinline__ void warp_accumulate(float (&acc)[D_FRAGS][4], const float (&x)[M_FRAGS][4],
                                                unsigned query_tile, int lane) {
    if (QUERY_LANE_UNHOISTED) lane = (int)(unhoisted_thread() % 32);
    const unsigned b_base = lane_address<ROW_BYTES>(query_tile, a_order_row(lane), a_order_chunk(lane));
#pragma unroll
    for (int k16 = 0; k16 < M_STEPS; ++k16) {
        unsigned a[4];
        p_as_a_operand(x, k16, a);
#pragma unroll
        for (int d16 = 0; d16 < D_STEPS; ++d16) {
            unsigned b[4];
            ldmatrix_x4_trans(b, block_address<ROW_BYTES>(b_base, 16 * k16, 2 * d16));
            mma_m16n8k16<elem_t>(acc[2 * d16], a, b[0], b[1]);
            mma_m16n8k16<elem_t>(acc[2 * d16 + 1], a, b[2], b[3]);
        }
    }
}

// Pᵀ = exp(scale·Sᵀ − LSE): probabilities(), in attention_backward.cuh (shared with stage 9).

// dSᵀ = Pᵀ ∘ (dPᵀ − Δ), in place in dp (same layout as probabilities' s).
__device__ __forceinline__ void score_gradients(float (&dp)[M_FRAGS][4], const float (&p)[M_FRAGS][4],
                                                const float* delta, int lane) {
#pragma unroll
    for (int n = 0; n < M_FRAGS; ++n) {
        const float2 d = *reinterpret_cast<const float2*>(delta + 8 * n + 2 * (lane % 4));
        // EXERCISE: the gradient of the scores. dP = dO Vᵀ is the gradient of P; the softmax turns it
        // into dS = P ∘ (dP − Δ), with Δ_i = Σ_j P_ij dP_ij = rowsum(dO_i ∘ O_i) of query row i (the
        // preprocess computed it: `d` holds Δ of this thread's two columns, d.x for c[0] and c[2],
        // d.y for c[1] and c[3]). Overwrite dp[n][c] with dS for c = 0..3.
        // STUB: (void)d;  // dp is left as dP: dK and dQ come out wrong
        dp[n][0] = p[n][0] * (dp[n][0] - d.x);
        dp[n][1] = p[n][1] * (dp[n][1] - d.y);
        dp[n][2] = p[n][2] * (dp[n][2] - d.x);
        dp[n][3] = p[n][3] * (dp[n][3] - d.y);
        // END EXERCISE
    }
}

// dSᵀ into shared memory, rounded to elem_t, for dQ = dS K and dK += dSᵀ Q: row = key, 16-byte chunks of
// 8 queries. swizzle(row, n) = row·DS_ROW + (16n ^ 16(row % 8)), and 16(row % 8) are the only bits 4-6 of
// the lane's address of chunk 0 (ds_tile is a multiple of 1024, 4·(lane % 4) < 16): chunk n is that
// address XOR 16n, and row + 8 (the same row % 8) is 8·DS_ROW bytes on. One address per lane.
__device__ __forceinline__ void store_score_gradients(unsigned ds_tile, const float (&ds)[M_FRAGS][4], int row0,
                                                      int lane) {
    const unsigned lane_base = ds_tile + swizzle<DS_ROW_BYTES>(row0 + lane / 4, 0) + 4 * (lane % 4);
#pragma unroll
    for (int n = 0; n < M_FRAGS; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const unsigned pair = pack_pair<elem_t>(ds[n][2 * r], ds[n][2 * r + 1]);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"((lane_base ^ (16 * n)) + 8 * r * DS_ROW_BYTES), "r"(pair)
                         : "memory");
        }
}

// Where chunk `chunk` (4 floats) of row `row` of a warp's staged dQ lies: rows of DQ_COLS fp32 (128
// bytes), the chunks of row r permuted by XOR with 2·(r % 4). add_to_dq writes 8 bytes per lane, columns
// 8n + 2t of rows g (and g + 8): chunk 2n + t/2; a half-warp's 4 rows g then write the chunk pairs
// {2n, 2n + 1} ^ 2g, 4 different pairs, all 32 banks (with stage 3's XOR by r % 8, rows 2i and 2i + 1 hit
// the same pair: 2-way conflicts). It reads back whole rows, 8 lanes a row: any permutation is conflict-free.
__device__ __forceinline__ unsigned staging_offset(int row, int chunk) {
    static_assert(DQ_COLS * 4 == 128, "a staged row is one 128-byte line");
    return row * 128 + ((chunk ^ (2 * row % 8)) * 16);
}

// The warp's DQ_ROWS × DQ_COLS part of dQ, `acc` (mma accumulators, m16 tile mt in acc[mt]), added to the
// fp32 dQ at `dq_block` (row stride HEAD_DIM; whole tiles: the accumulator's padding rows take the padded
// queries' sums, which are never read, so no row is tested and no add branches). Every key tile's block
// adds to the same dQ, so the additions are atomic (in the L2). In the accumulator layout a thread holds
// pairs of columns of 2 rows, and a warp's atomics would touch 8 rows' lines at a time, 8 bytes of each
// per lane pair; so each m16 tile goes through shared memory first (`staging`, STAGING_BYTES, at a multiple
// of 128) and is read back as 16-byte pieces of whole rows: each instruction of the warp adds to 4 whole
// 128-byte lines. On sm_90 one red.global.add.v4.f32 adds the 4 floats (a `red` is an atomic that returns
// nothing); before, 4 atomicAdd. As for ldmatrix (lane_address), each lane computes one address for its
// stores, one for its loads and one pointer for its reds, and every access is an XOR and an immediate
// offset away: chunk 2n + t/2 of row g + 8r is the lane's chunk t/2 of row g with 32n XORed in
// (2n ^ 2(g % 4) = 2(n ^ g % 4)), 128·8r on.
__device__ __forceinline__ void add_to_dq(float* dq_block, const float (&acc)[DQ_M_TILES][DQ_FRAGS][4],
                                          unsigned staging, int lane) {
    constexpr int CHUNKS = DQ_COLS / 4, ROWS_PER_READ = 32 / CHUNKS;  // 16-byte chunks of a row; rows per load
    const unsigned to_stage = staging + staging_offset(lane / 4, lane % 4 / 2) + 8 * (lane % 2);
    const unsigned from_stage = staging + staging_offset(lane / CHUNKS, lane % CHUNKS);
    float* const lane_dq = dq_block + (unsigned)((lane / CHUNKS) * HEAD_DIM + 4 * (lane % CHUNKS));
#pragma unroll
    for (int mt = 0; mt < DQ_M_TILES; ++mt) {
        if (mt > 0) __syncwarp();  // every lane has read the last tile back before it is overwritten
#pragma unroll
        for (int n = 0; n < DQ_FRAGS; ++n)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"((to_stage ^ (32 * n)) + 128 * 8 * r),
                             "f"(acc[mt][n][2 * r]), "f"(acc[mt][n][2 * r + 1])
                             : "memory");
        __syncwarp();
#pragma unroll
        for (int first = 0; first < STAGING_ROWS; first += ROWS_PER_READ) {
            float4 x;
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                         : "r"(from_stage + 128 * first)  // row % 4 = lane / CHUNKS % 4: first is a multiple of 4
                         : "memory");
            float* to = lane_dq + (16 * mt + first) * HEAD_DIM;
#if __CUDA_ARCH__ >= 900
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(to), "f"(x.x), "f"(x.y), "f"(x.z),
                         "f"(x.w)
                         : "memory");
#else
            atomicAdd(to, x.x);
            atomicAdd(to + 1, x.y);
            atomicAdd(to + 2, x.z);
            atomicAdd(to + 3, x.w);
#endif
        }
    }
}

// dQ of the query tile += dS K for the warp's share (queries from `row0`, d columns from `col0`), added to
// the fp32 accumulator in global memory: every key tile's block adds its part, hence the atomics.
__device__ __forceinline__ void accumulate_dq(float* dq_head, unsigned ds_tile, unsigned k_tile,
                                              const QueryTile& buffer, int m0) {
    const unsigned thread = unhoisted_thread();
    const int lane = (int)(thread % 32), warp = (int)(thread / 32);
    const int row0 = (warp % DQ_WARPS_M) * DQ_ROWS, col0 = (warp / DQ_WARPS_M) * DQ_COLS;  // the warp's share
    // Its staging area: an eighth of a buffer that no warp reads after the barrier (STAGING_BYTES).
    const unsigned v_tile = k_tile + KV_TILE_BYTES;
    const unsigned staging = (KV_IN_REGISTERS ? v_tile : buffer.d_o) + warp * STAGING_BYTES;
    float acc[DQ_M_TILES][DQ_FRAGS][4] = {};
    const unsigned a_base = lane_address<DS_ROW_BYTES>(ds_tile, b_order_row(lane), b_order_chunk(lane));
    const unsigned b_base = lane_address<ROW_BYTES>(k_tile, a_order_row(lane), a_order_chunk(lane));
#pragma unroll
    for (int k16 = 0; k16 < BLOCK_N / 16; ++k16) {
        unsigned a[DQ_M_TILES][4];  // dS [query][key] from dSᵀ [key][query]: .trans in B order gives the A operand
#pragma unroll
        for (int mt = 0; mt < DQ_M_TILES; ++mt)
            ldmatrix_x4_trans(a[mt], block_address<DS_ROW_BYTES>(a_base, 16 * k16, (row0 + 16 * mt) / 8));
#pragma unroll
        for (int d16 = 0; d16 < DQ_COLS / 16; ++d16) {
            unsigned b[4];  // K [key][d] = [k][n]
            ldmatrix_x4_trans(b, block_address<ROW_BYTES>(b_base, 16 * k16, col0 / 8 + 2 * d16));
#pragma unroll
            for (int mt = 0; mt < DQ_M_TILES; ++mt) {
                mma_m16n8k16<elem_t>(acc[mt][2 * d16], a[mt], b[0], b[1]);
                mma_m16n8k16<elem_t>(acc[mt][2 * d16 + 1], a[mt], b[2], b[3]);
            }
        }
    }
    add_to_dq(dq_head + (size_t)(m0 + row0) * HEAD_DIM + col0, acc, staging, lane);
}

// dK += dSᵀ Q for the warp's DK_ROWS keys (from DK_ROWS·(warp % DK_WARPS_N)) × DK_COLS d columns (from
// DK_COLS·(warp / DK_WARPS_N)), after the barrier that publishes dSᵀ. A = dSᵀ [key][query] = [m][k]:
// ldmatrix in A order; B = Q [query][d] = [k][n]: ldmatrix.trans (as warp_accumulate reads dO). The warp's
// offsets are folded into the lane bases (its first key a multiple of 8 rows; col0 / 8 + 2·d16 =
// col0 / 8 ^ 2·d16), so every ldmatrix is one XOR and an immediate.
__device__ __forceinline__ void accumulate_dk(DkAccumulator& acc, unsigned ds_tile, unsigned q_tile) {
    const unsigned thread = unhoisted_thread();
    const int lane = (int)(thread % 32), warp = (int)(thread / 32);
    const int key_row0 = (warp % DK_WARPS_N) * DK_ROWS, col0 = (warp / DK_WARPS_N) * DK_COLS;
    const unsigned a_base = lane_address<DS_ROW_BYTES>(ds_tile + key_row0 * DS_ROW_BYTES, a_order_row(lane),
                                                       a_order_chunk(lane));
    const unsigned b_base = lane_address<ROW_BYTES>(q_tile, a_order_row(lane), a_order_chunk(lane)) ^ (2 * col0);
#pragma unroll
    for (int k16 = 0; k16 < M_STEPS; ++k16) {
        unsigned a[DK_M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < DK_M_TILES; ++mt)
            ldmatrix_x4(a[mt], block_address<DS_ROW_BYTES>(a_base, 16 * mt, 2 * k16));
#pragma unroll
        for (int d16 = 0; d16 < DK_COLS / 16; ++d16) {
            unsigned b[4];
            ldmatrix_x4_trans(b, block_address<ROW_BYTES>(b_base, 16 * k16, 2 * d16));
#pragma unroll
            for (int mt = 0; mt < DK_M_TILES; ++mt) {
                mma_m16n8k16<elem_t>(acc[mt][2 * d16], a[mt], b[0], b[1]);
                mma_m16n8k16<elem_t>(acc[mt][2 * d16 + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// A warp's M_TILES × 16 rows of dK or dV from row `key0`, FRAGS × 8 columns from `col0` (mma accumulators,
// times `factor`), rounded to elem_t; rows >= seq_kv are not written.
template <int M_TILES, int FRAGS>
__device__ __forceinline__ void write_rows(elem_t* head, const float (&acc)[M_TILES][FRAGS][4], float factor, int key0,
                                           int col0, int seq_kv, int lane) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 16 * mt + lane / 4 + 8 * r;
            if (key >= seq_kv) continue;
            elem_t* row = head + (size_t)key * HEAD_DIM + col0 + 2 * (lane % 4);
#pragma unroll
            for (int n = 0; n < FRAGS; ++n)
                *reinterpret_cast<unsigned*>(row + 8 * n) =
                    pack_pair<elem_t>(acc[mt][n][2 * r] * factor, acc[mt][n][2 * r + 1] * factor);
        }
}

// The same rows added to the fp32 sums of a tail tile (`tile`: BLOCK_N rows of HEAD_DIM, whole: no row is
// tested), two floats per reduction, in the L2 as dQ's are.
template <int M_TILES, int FRAGS>
__device__ __forceinline__ void add_rows(float* tile, const float (&acc)[M_TILES][FRAGS][4], float factor, int row0,
                                         int col0, int lane) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float* row = tile + (row0 + 16 * mt + lane / 4 + 8 * r) * HEAD_DIM + col0 + 2 * (lane % 4);
#pragma unroll
            for (int n = 0; n < FRAGS; ++n) {
                const float x = acc[mt][n][2 * r] * factor, y = acc[mt][n][2 * r + 1] * factor;
#if __CUDA_ARCH__ >= 900
                asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(row + 8 * n), "f"(x), "f"(y) : "memory");
#else
                atomicAdd(row + 8 * n, x);
                atomicAdd(row + 8 * n + 1, y);
#endif
            }
        }
}

// The kernel's arguments that every key tile uses.
struct Tensors {
    const elem_t *q, *k, *v, *d_o;
    const float *lse_log2, *delta;
    float* dq_accum;
    int seq_q, seq_kv, seq_q_padded;
    float scale;
    int causal;
};

// One key tile's part of the backward: the tile of BLOCK_N keys from n0 of (batch, head) pair `head`,
// against its query tiles first_tile .. end_tile - 1 (the loop of the header comment). What becomes of
// its dK and dV is the caller's: finish(dk_acc, dv_acc), in accumulate_dk's and the warp's own layouts.
template <typename Finish>
__device__ __forceinline__ void key_tile_backward(const Tensors& x, size_t head, int n0, int first_tile, int end_tile,
                                                  Finish finish) {
    extern __shared__ __align__(1024) unsigned char shared_bytes[];  // tiles at multiples of their row size
    const unsigned k_tile = shared_address(shared_bytes);
    const unsigned v_tile = k_tile + KV_TILE_BYTES;
    const unsigned q_ring = v_tile + KV_TILE_BYTES;
    const unsigned do_ring = q_ring + Q_STAGES * Q_TILE_BYTES;
    const unsigned ds_tile = do_ring + Q_STAGES * Q_TILE_BYTES;
    const unsigned lse_ring = ds_tile + DS_TILE_BYTES;
    const unsigned delta_ring = lse_ring + Q_STAGES * VECTOR_BYTES;
    const float* lse_shared = reinterpret_cast<const float*>(shared_bytes + (lse_ring - k_tile));
    const float* delta_shared = reinterpret_cast<const float*>(shared_bytes + (delta_ring - k_tile));

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row0 = 16 * warp;              // the warp's first key in the tile
    const elem_t* q_head = x.q + head * x.seq_q * HEAD_DIM;
    const elem_t* do_head = x.d_o + head * x.seq_q * HEAD_DIM;
    const float* lse_head = x.lse_log2 + head * x.seq_q_padded;
    const float* delta_head = x.delta + head * x.seq_q_padded;
    float* dq_head = x.dq_accum + head * x.seq_q_padded * HEAD_DIM;  // whole query tiles

    // Prologue: K and V, and the first query tile, in one commit group.
    load_tile_async<BLOCK_N>(k_tile, x.k + (head * x.seq_kv + n0) * HEAD_DIM, x.seq_kv - n0);
    load_tile_async<BLOCK_N>(v_tile, x.v + (head * x.seq_kv + n0) * HEAD_DIM, x.seq_kv - n0);
    if (first_tile < end_tile)
        load_query_tile_async(query_buffer(q_ring, do_ring, lse_ring, delta_ring, first_tile), q_head, do_head,
                              lse_head, delta_head, first_tile * BLOCK_M, x.seq_q);
    cp_async_commit();

    unsigned k_held[KV_HELD_STEPS][4], v_held[KV_HELD_STEPS][4];
    if (KV_IN_REGISTERS) {
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < KV_HELD_STEPS; ++kk) {
            load_row_fragment(k_held[kk], k_tile, row0, kk);
            load_row_fragment(v_held[kk], v_tile, row0, kk);
        }
    }

    DkAccumulator dk_acc = {};  // accumulate_dk's tile
    DvAccumulator dv_acc = {};  // the warp's 16 keys × D
    const float scale_log2 = x.scale * LOG2E;

    for (int tile = first_tile; tile < end_tile; ++tile) {
        cp_async_wait<0>();  // this tile's copies have landed (issued during the last iteration)
        __syncthreads();     // ... every thread's; and every warp is done with the last iteration
        // Refill: tile + 1 goes into the buffer of tile - 1, which no warp reads any more (not even
        // as accumulate_dq's staging area).
        if (tile + 1 < end_tile)
            load_query_tile_async(query_buffer(q_ring, do_ring, lse_ring, delta_ring, tile + 1), q_head, do_head,
                                  lse_head, delta_head, (tile + 1) * BLOCK_M, x.seq_q);
        cp_async_commit();

        const QueryTile buffer = query_buffer(q_ring, do_ring, lse_ring, delta_ring, tile);
        const int m0 = tile * BLOCK_M;
        const int lse_offset = (tile % Q_STAGES) * BLOCK_M;
        float s[M_FRAGS][4];
        warp_rows_times_queries(s, k_held, k_tile, row0, buffer.q, lane);                       // Sᵀ = K Qᵀ
        const bool on_diagonal = x.causal && m0 < n0 + row0 + 15;  // some key of the warp after some query
        probabilities<M_FRAGS, MASK_AGAINST_CONSTANTS>(s, lse_shared + lse_offset, scale_log2, on_diagonal,
                                                       n0 + row0, m0, lane);                    // Pᵀ
        warp_accumulate(dv_acc[0], s, buffer.d_o, lane);                                        // dV += Pᵀ dO
        float dp[M_FRAGS][4];
        warp_rows_times_queries(dp, v_held, v_tile, row0, buffer.d_o, lane);                    // dPᵀ = V dOᵀ
        score_gradients(dp, s, delta_shared + lse_offset, lane);                                // dSᵀ
        store_score_gradients(ds_tile, dp, row0, lane);
        __syncthreads();  // dSᵀ of every warp is in shared memory
        if (DK_BEFORE_DQ) accumulate_dk(dk_acc, ds_tile, buffer.q);                              // dK += dSᵀ Q
        accumulate_dq(dq_head, ds_tile, k_tile, buffer, m0);                                    // dQ += dS K
        if (!DK_BEFORE_DQ) accumulate_dk(dk_acc, ds_tile, buffer.q);
    }

    finish(dk_acc, dv_acc);
}

// What becomes of a whole key tile's dK and dV (key_tile_backward's finish): rounded to elem_t and written
// (rows past seq_kv are not); dk and dv point at the block's (batch, head) pair.
struct WriteRows {
    elem_t *dk, *dv;
    float scale;
    int n0, seq_kv;
    __device__ void operator()(const DkAccumulator& dk_acc, const DvAccumulator& dv_acc) const {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        write_rows(dk, dk_acc, scale, n0 + (warp % DK_WARPS_N) * DK_ROWS, (warp / DK_WARPS_N) * DK_COLS, seq_kv, lane);
        write_rows(dv, dv_acc, 1.0f, n0 + 16 * warp, 0, seq_kv, lane);
    }
};

// The parameters of attention_bwd and of attention_bwd_tail, one struct for both (__init__.py's BackwardParams
// packs it): Tensors' fields, then where each kernel's dK and dV go -- attention_bwd's rows of dk and dv,
// the tail's fp32 sums in dkv_tail (null without a tail) -- and how the launch's key tiles are shared out.
struct BackwardParams {
    const elem_t *q, *k, *v, *d_o;
    const float *lse_log2, *delta;
    float* dq_accum;
    elem_t *dk, *dv;
    float* dkv_tail;
    int seq_q, seq_kv, seq_q_padded;
    float scale;
    int causal, full_tiles, tail_tiles;
};

// A whole key tile per block: blockIdx.x the key tile, blockIdx.y the (batch, head) pair. The key tiles
// from full_tiles on (numbered t = pair · gridDim.x + key tile) are attention_bwd_tail's.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
attention_bwd(const __grid_constant__ BackwardParams p) {
    if (blockIdx.y * gridDim.x + blockIdx.x >= p.full_tiles) return;
    const Tensors x{p.q, p.k, p.v, p.d_o, p.lse_log2, p.delta, p.dq_accum, p.seq_q, p.seq_kv, p.seq_q_padded, p.scale,
                    p.causal};
    const int n0 = blockIdx.x * BLOCK_N;
    const size_t head = blockIdx.y;
    // Causal: queries before n0 see none of the block's keys; their tiles are skipped.
    key_tile_backward(x, head, n0, p.causal ? n0 / BLOCK_M : 0, (p.seq_q + BLOCK_M - 1) / BLOCK_M,
                      WriteRows{p.dk + head * p.seq_kv * HEAD_DIM, p.dv + head * p.seq_kv * HEAD_DIM, p.scale, n0,
                                p.seq_kv});
}

// The tail. One block per SM, `tiles` blocks of equally long key tiles (a non-causal launch) run in
// ceil(tiles / SMs) waves, the last one nearly empty when tiles is a little over a multiple of the SMs:
// 4,096 tiles on 132 SMs are 31 full waves and 4 blocks, a 32nd wave for 3% of the work. So the launch
// gives whole key tiles to the first full_tiles blocks of attention_bwd, whole waves of them but one, and
// leaves the last wave's tiles and the partial one's to attention_bwd_tail: one wave of blocks that share
// their units (a key tile against one query tile) evenly, stream-K style (as CUTLASS splits a GEMM's k loop
// over the SMs). A tail block's run of units may start and end inside key tiles; it adds each key tile's
// dK and dV to fp32 sums, converted by attention_bwd_dkv_tail. (Causal launches keep whole tiles: their
// tiles' lengths differ, so their blocks end raggedly anyway, and a tail launch waits for the last one.)

// A tail block's key tile of the moment, in shared memory: the block's loop reads these values after each
// key tile (read_shared) instead of holding them in registers across the loop over query tiles.
struct TailTile {
    int head, n0;                // its (batch, head) pair and first key
    int first_m, end_m;          // its query tiles, first_m .. end_m - 1
    int t, last, run_end_m;      // its number in the launch; the run's last key tile and the query tile it ends at
    int key_tiles, query_tiles;  // per head
};

// A tail block's first key tile. Its run is units [begin, end) of the launch's, numbered key tile by key
// tile (unit u is query tile u % query_tiles of key tile u / query_tiles); `last` < `t` when the run is
// empty (more tail blocks than units).
__device__ __forceinline__ TailTile first_tail_tile(const Tensors& x, int full_tiles, int tail_tiles) {
    const int key_tiles = (x.seq_kv + BLOCK_N - 1) / BLOCK_N, query_tiles = (x.seq_q + BLOCK_M - 1) / BLOCK_M;
    const long long units = (long long)tail_tiles * query_tiles, base = (long long)full_tiles * query_tiles;
    const long long begin = base + units * blockIdx.x / gridDim.x, end = base + units * (blockIdx.x + 1) / gridDim.x;
    const int t = (int)(begin / query_tiles), last = (int)((end - 1) / query_tiles);
    const int run_end_m = (int)(end - (long long)last * query_tiles);
    return {t / key_tiles, t % key_tiles * BLOCK_N, (int)(begin % query_tiles), t == last ? run_end_m : query_tiles,
            t, begin < end ? last : t - 1, run_end_m, key_tiles, query_tiles};
}

__device__ __forceinline__ TailTile next_tail_tile(const TailTile& now) {
    const int t = now.t + 1;
    return {t / now.key_tiles, t % now.key_tiles * BLOCK_N, 0, t == now.last ? now.run_end_m : now.query_tiles, t,
            now.last, now.run_end_m, now.key_tiles, now.query_tiles};
}

// A volatile read: ptxas neither hoists it out of a loop nor keeps its value in a register across one.
__device__ __forceinline__ int read_shared(const int& value) {
    return *static_cast<const volatile int*>(&value);
}

// The same, broadcast from lane 0: ptxas then knows the value is the same in every lane (as CUTLASS's
// canonical_warp_idx_sync does for the warp index) and may hold it in a uniform register, which the
// 255 vector registers of the loop over query tiles do not pay for.
__device__ __forceinline__ int read_uniform(const int& value) {
    return __shfl_sync(0xffffffffu, read_shared(value), 0);
}

// ... and a tail block's part of one: added to the tile's fp32 sums in dkv_tail ([2][tail_tiles][BLOCK_N][HEAD_DIM]:
// dK's, then dV's), which the blocks sharing the tile add to. Everything is read or made here, after the loop,
// so that nothing is held in registers across it (held, the tail kernel spills at D = 128).
struct AddToTail {
    float* dkv_tail;
    const TailTile* tile;
    int full_tiles, tail_tiles;
    float scale;
    __device__ void operator()(const DkAccumulator& dk_acc, const DvAccumulator& dv_acc) const {
        const unsigned thread = unhoisted_thread();
        const int lane = (int)(thread % 32), warp = (int)(thread / 32);
        float* dk_sums = dkv_tail + (size_t)(read_shared(tile->t) - full_tiles) * BLOCK_N * HEAD_DIM;
        add_rows(dk_sums, dk_acc, scale, (warp % DK_WARPS_N) * DK_ROWS, (warp / DK_WARPS_N) * DK_COLS, lane);
        add_rows(dk_sums + (size_t)tail_tiles * BLOCK_N * HEAD_DIM, dv_acc, 1.0f, 16 * warp, 0, lane);
    }
};

// The tail's blocks, gridDim.x of them, each on its run of key tiles full_tiles .. full_tiles + tail_tiles - 1
// (non-causal), adding each tile's dK and dV to dkv_tail.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
attention_bwd_tail(const __grid_constant__ BackwardParams p) {
    const Tensors x{p.q, p.k, p.v, p.d_o, p.lse_log2, p.delta, p.dq_accum, p.seq_q, p.seq_kv, p.seq_q_padded, p.scale,
                    /*causal=*/0};
    __shared__ TailTile tile;
    if (threadIdx.x == 0) tile = first_tail_tile(x, p.full_tiles, p.tail_tiles);
    __syncthreads();
    while (read_shared(tile.t) <= read_shared(tile.last)) {
        const int first_m = read_uniform(tile.first_m), end_m = read_uniform(tile.end_m);
        if (first_m < end_m)
            key_tile_backward(x, read_uniform(tile.head), read_uniform(tile.n0), first_m, end_m,
                              AddToTail{p.dkv_tail, &tile, p.full_tiles, p.tail_tiles, p.scale});
        __syncthreads();  // every warp is done with this key tile: its K, V, query buffers and `tile`
        if (threadIdx.x == 0) tile = next_tail_tile(tile);
        __syncthreads();
    }
}

// dK and dV of the tail's key tiles from their fp32 sums (attention_bwd_tail's dkv_tail, scaled already),
// rounded to elem_t: 8 elements per thread, `groups` of 8 in dK's sums then as many in dV's; rows past
// seq_kv are not written. Tile s of the tail is key tile full_tiles + s of the launch.
extern "C" __global__ void __launch_bounds__(CONVERT_THREADS)
attention_bwd_dkv_tail(const float* __restrict__ dkv_tail, elem_t* __restrict__ dk, elem_t* __restrict__ dv,
                       int groups, int full_tiles, int seq_kv) {
    constexpr int GROUPS_PER_ROW = HEAD_DIM / 8;
    const int group = blockIdx.x * CONVERT_THREADS + threadIdx.x;
    if (group >= 2 * groups) return;
    const int in_dk = group % groups;  // the same group of dK's sums
    const int tail_row = in_dk / GROUPS_PER_ROW, part = in_dk % GROUPS_PER_ROW;
    const long long t = full_tiles + tail_row / BLOCK_N;
    const int key_tiles = (seq_kv + BLOCK_N - 1) / BLOCK_N;
    const long long head = t / key_tiles;
    const int key = (int)(t % key_tiles) * BLOCK_N + tail_row % BLOCK_N;
    if (key >= seq_kv) return;
    const float4* from = reinterpret_cast<const float4*>(dkv_tail + (size_t)group * 8);
    const float4 a = from[0], b = from[1];
    const uint4 packed = {pack_pair<elem_t>(a.x, a.y), pack_pair<elem_t>(a.z, a.w), pack_pair<elem_t>(b.x, b.y),
                          pack_pair<elem_t>(b.z, b.w)};
    elem_t* to = group < groups ? dk : dv;
    *reinterpret_cast<uint4*>(to + ((size_t)head * seq_kv + key) * HEAD_DIM + 8 * part) = packed;
}
