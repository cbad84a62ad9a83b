// Stage 8 — attention backward: FlashAttention-2's backward pass on tensor cores.
//
// Given the forward's O and LSE and the gradient dO, compute dQ, dK and dV without ever storing
// the Sq × Skv matrix P: each block owns one tile of BLOCK_N keys of one (batch, head), keeps its
// dK and dV in fp32 registers, and walks every tile of BLOCK_M queries that sees those keys,
// recomputing P from Q, K and the LSE. Per query tile, five products (scale = 1/√D):
//
//     S   = Q Kᵀ                      (BLOCK_M × BLOCK_N)   recompute the scores
//     P   = exp(scale·S − LSE)                              ... and the probabilities
//     dP  = dO Vᵀ                     (BLOCK_M × BLOCK_N)
//     dS  = P ∘ (dP − Δ)              Δ_i = rowsum(dO_i ∘ O_i), computed once by the preprocess
//     dV += Pᵀ dO                     (BLOCK_N × D)
//     dK += scale · dSᵀ Q             (BLOCK_N × D)
//     dQ += scale · dS K              (BLOCK_M × D)  -- summed over every key tile: fp32 atomics
//
// The eight warps split each product in two dimensions, each warp a 32 × 32 part of S and dP, 32 keys
// × D/2 of dK and dV: with 32 rows a warp's every B fragment (read from shared memory by ldmatrix) feeds
// two m16 tiles, so the warps read a third less shared memory than with 16 rows each. P and dS pass from
// the warps that compute them to those that use them through shared memory, as [query][key] tiles:
// ldmatrix.trans reads them back transposed for Pᵀ dO and dSᵀ Q.
//
// Three kernels: attention_bwd_preprocess (Δ, the LSE in log2 units, a zeroed fp32 dQ), attention_bwd
// (the loop above), attention_bwd_dq (the fp32 dQ scaled and rounded to elem_t). Tensors are
// [B, H, S, D], contiguous; blockIdx.y walks the (batch, head) pairs. Causal masking is top-left
// aligned, as in PyTorch: query i sees keys j <= i.
#include "mma.cuh"
#include "cp_async.cuh"

// The tile configuration, per head dimension.
//   Keys: 128 per block; its dK and dV in registers for the whole loop, a warp's 32 keys × D/2 of each:
//         2 × D/2 fp32 registers per thread (64 at D = 64, 128 at D = 128).
//   Queries: tiles of 64, double-buffered (Q, dO, LSE and Δ of tile i+1 load during tile i).
//   S and dP of one query tile: a warp's 32 × 32 of each, 2 × 32 fp32 registers per thread.
// At D = 64 the warp's K and V fragments (the B operands of S and dP) stay in registers too (32 each);
// at D = 128 they would not fit beside 192 registers of accumulators and are re-read from shared
// memory, one k-step at a time.
constexpr int NUM_WARPS = 8;
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int BLOCK_N = 128;                        // keys per block
constexpr int BLOCK_M = 64;                         // queries per step of the loop
constexpr int Q_STAGES = 2;                         // buffers of the query-side tiles
constexpr bool KV_IN_REGISTERS = HEAD_DIM == 64;
constexpr int KV_HELD_STEPS = KV_IN_REGISTERS ? HEAD_DIM / 16 : 1;
constexpr int D_STEPS = HEAD_DIM / 16;              // k-steps of a product over d
constexpr int KV_COLS = HEAD_DIM / 2;               // a warp's columns of dK and dV
constexpr int KV_FRAGS = KV_COLS / 8;               // ... in n8 fragments
// dQ = dS K: the BLOCK_M × D product is split among the warps, BLOCK_M / 16 m16 tiles × DQ_SPLIT parts of d.
constexpr int DQ_SPLIT = NUM_WARPS / (BLOCK_M / 16);
constexpr int DQ_COLS = HEAD_DIM / DQ_SPLIT;
constexpr int DQ_FRAGS = DQ_COLS / 8;
constexpr int STAGING_BYTES = 16 * DQ_COLS * 4;     // a warp's part of dQ in fp32 (add_to_dq)
// Shared memory: [K][V][Q ring][dO ring][P][dS][LSE ring][Δ ring], all tiles swizzled (see stage 3).
constexpr int ROW_BYTES = HEAD_DIM * 2;
constexpr int KV_TILE_BYTES = BLOCK_N * ROW_BYTES;
constexpr int Q_TILE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int SCORE_ROW_BYTES = BLOCK_N * 2;        // P and dS: a row per query, BLOCK_N keys
constexpr int SCORE_TILE_BYTES = BLOCK_M * SCORE_ROW_BYTES;
constexpr int VECTOR_BYTES = BLOCK_M * 4;           // the LSE or Δ of a query tile, fp32
constexpr int SHARED_BYTES = 2 * KV_TILE_BYTES + 2 * Q_STAGES * Q_TILE_BYTES + 2 * SCORE_TILE_BYTES +
                             2 * Q_STAGES * VECTOR_BYTES;
// The preprocess and the dQ conversion: 8 elements (16 bytes of elem_t) per thread.
constexpr int PREPROCESS_THREADS = 256;
constexpr int ROWS_PER_PREPROCESS_BLOCK = PREPROCESS_THREADS / (HEAD_DIM / 8);
constexpr int CONVERT_THREADS = 256;
static_assert(sizeof(elem_t) == 2, "ldmatrix and the chunk arithmetic assume 16-bit elements");
static_assert(NUM_WARPS == 8 && BLOCK_M == 64 && BLOCK_N == 128, "the warps' parts are written for 2 × 4 of 32 × 32");
static_assert(NUM_WARPS % (BLOCK_M / 16) == 0 && DQ_COLS % 16 == 0, "dQ's tiles divide among the warps");
static_assert(NUM_WARPS * STAGING_BYTES <= 2 * SCORE_TILE_BYTES, "the warps stage dQ in the P and dS tiles");

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of ROW bytes per row: the chunk index
// XOR row % 8, stage 3's swizzle, so that ldmatrix's 8 rows and the stores of a warp hit 8 distinct
// groups of banks. Rows here are 128 or 256 bytes (8 or 16 chunks).
template <int ROW>
__device__ __forceinline__ unsigned swizzle(int row, int chunk) {
    static_assert(ROW % 128 == 0, "the swizzle permutes the 8 chunks of each 128-byte line");
    return row * ROW + ((chunk ^ (row % 8)) * 16);
}

// The same addresses for ldmatrix, in two parts. A lane reads row lane_row + R, chunk lane_chunk + C
// of a tile, with R a multiple of 8 and C even (a 16 × 16 block at rows R, columns 8C); since C + lane_chunk
// = C ^ lane_chunk and row % 8 = lane_row % 8,
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

// cp.async copies of rows [0, rows) of a row-major [*, HEAD_DIM] global tile into a swizzled tile of
// TILE_ROWS rows; rows past `rows` are zero-filled (a zero query or key row adds nothing to any product).
// A thread copies the same chunk of rows row0, row0 + ROWS_PER_STEP, ...: one swizzle term for all (a
// multiple of 8 rows apart), so the addresses are two bases plus compile-time offsets. threadIdx.x is
// read through a volatile asm, which ptxas cannot hoist: it recomputes the bases at each call rather
// than holding a dozen per-copy addresses through the loop (stage 3's load_tile_from_base; held, they
// spill at D = 128).
template <int TILE_ROWS>
__device__ __forceinline__ void load_tile_async(unsigned tile, const elem_t* source, int rows) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
    constexpr int ROWS_PER_STEP = NUM_THREADS / CHUNKS_PER_ROW;
    static_assert(ROWS_PER_STEP % 8 == 0 && TILE_ROWS % ROWS_PER_STEP == 0, "every thread copies as many chunks");
    unsigned thread;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(thread));
    const int row0 = (int)(thread / CHUNKS_PER_ROW), chunk = (int)(thread % CHUNKS_PER_ROW);
    const unsigned to = tile + swizzle<ROW_BYTES>(row0, chunk);
    const elem_t* from = source + row0 * HEAD_DIM + chunk * 8;
#pragma unroll
    for (int step = 0; step < TILE_ROWS / ROWS_PER_STEP; ++step) {
        const bool valid = row0 + step * ROWS_PER_STEP < rows;
        cp_async_16(to + step * ROWS_PER_STEP * ROW_BYTES, valid ? from + step * ROWS_PER_STEP * HEAD_DIM : source,
                    valid);  // an invalid copy reads nothing, but its address must be valid: row 0
    }
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

// The B operands of k-step kk (d columns 16·kk ..) of 32 rows of a K or V tile from row key0: b[n16]
// holds b[0], b[1] of keys 16·n16 + 0..7, then of + 8..15 (ldmatrix's B order on a [key][d] tile).
__device__ __forceinline__ void load_key_fragments(unsigned (&b)[2][4], unsigned tile, int key0, int kk, int lane) {
    const unsigned base = lane_address<ROW_BYTES>(tile, b_order_row(lane), b_order_chunk(lane));
#pragma unroll
    for (int n16 = 0; n16 < 2; ++n16) ldmatrix_x4(b[n16], block_address<ROW_BYTES>(base, key0 + 16 * n16, 2 * kk));
}

// acc[32 × 32] = (32 rows of the query tile of Q or dO) · (32 rows of K or V)ᵀ: the warp's part of S or dP.
// A: the query tile, [query][d] = [m][k], in ldmatrix's A order; B: the key tile, [key][d] = [n][k], in
// B order, from `held` (KV_IN_REGISTERS: read once per block) or from the tile.
__device__ __forceinline__ void warp_scores(float (&acc)[2][4][4], unsigned query_tile, int query0,
                                            const unsigned (&held)[KV_HELD_STEPS][2][4], unsigned key_tile,
                                            int key0, int lane) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < 4; ++n) acc[mt][n][0] = acc[mt][n][1] = acc[mt][n][2] = acc[mt][n][3] = 0.0f;
    const unsigned a_base = lane_address<ROW_BYTES>(query_tile, a_order_row(lane), a_order_chunk(lane));
#pragma unroll
    for (int kk = 0; kk < D_STEPS; ++kk) {
        unsigned a[2][4], read[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(a[mt], block_address<ROW_BYTES>(a_base, query0 + 16 * mt, 2 * kk));
        if (!KV_IN_REGISTERS) load_key_fragments(read, key_tile, key0, kk, lane);
        const unsigned (&b)[2][4] = *(KV_IN_REGISTERS ? &held[kk % KV_HELD_STEPS] : &read);
#pragma unroll
        for (int n16 = 0; n16 < 2; ++n16)
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                mma_m16n8k16<elem_t>(acc[mt][2 * n16], a[mt], b[n16][0], b[n16][1]);
                mma_m16n8k16<elem_t>(acc[mt][2 * n16 + 1], a[mt], b[n16][2], b[n16][3]);
            }
    }
}

// P = exp(scale·S − LSE), in place, for the warp's 32 queries (rows g, g+8 of m-tile mt: c[0..1], c[2..3])
// × 32 keys (columns 8n + 2t, +1). lse_log2: the tile's LSE in log2 units, +inf for the padding rows past
// seq_q, whose p is then 0. The exponent is capped at 0 (p <= 1, as the exact p is): the zero-filled
// keys past seq_kv score 0, not -inf, and exp(0 - LSE) would reach inf where a row's true scores are all
// very negative (x10 inputs: LSE = -100), then inf × 0 = NaN in dQ += dS K; capped, their p is finite and
// meets K's zero rows (their dK and dV are not written). When `mask`, keys after the query are 0:
// key0 + 8n + 2t + c%2 > query0 + 16mt + g + 8(c/2), i.e. `ahead` + 8n + c%2 > 16mt + 8(c/2), with one
// per-thread term and compile-time constants (registers are scarce here).
__device__ __forceinline__ void probabilities(float (&s)[2][4][4], const float* lse_log2, float scale_log2, bool mask,
                                              int query0, int key0, int lane) {
    const int ahead = key0 + 2 * (lane % 4) - query0 - lane / 4;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float lse = lse_log2[16 * mt + lane / 4 + 8 * r];
#pragma unroll
            for (int n = 0; n < 4; ++n)
#pragma unroll
                for (int c = 2 * r; c < 2 * r + 2; ++c) {
                    const float p = fast_exp2(fminf(s[mt][n][c] * scale_log2 - lse, 0.0f));
                    s[mt][n][c] = mask && ahead + 8 * n + c % 2 > 16 * mt + 8 * r ? 0.0f : p;
                }
        }
}

// dS = P ∘ (dP − Δ), in place in dp (the layout of probabilities' s); delta: the tile's Δ, per query row.
__device__ __forceinline__ void score_gradients(float (&dp)[2][4][4], const float (&p)[2][4][4], const float* delta,
                                                int lane) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float d = delta[16 * mt + lane / 4 + 8 * r];
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                // EXERCISE: the gradient of the scores. dP = dO Vᵀ is the gradient of P; the softmax turns
                // it into dS = P ∘ (dP − Δ), with Δ_i = Σ_j P_ij dP_ij = rowsum(dO_i ∘ O_i) of query row i
                // (the preprocess computed it: `d` is Δ of this thread's row g + 8r of m-tile mt, whose
                // elements are c = 2r and 2r + 1 of each fragment). Overwrite dp[mt][n][c] with dS.
                // STUB: (void)d;  // dp is left as dP: dK and dQ come out wrong
                dp[mt][n][2 * r] = p[mt][n][2 * r] * (dp[mt][n][2 * r] - d);
                dp[mt][n][2 * r + 1] = p[mt][n][2 * r + 1] * (dp[mt][n][2 * r + 1] - d);
                // END EXERCISE
            }
        }
}

// The warp's part of P or dS into a [query][key] tile of shared memory, rounded to elem_t.
__device__ __forceinline__ void store_scores(unsigned tile, const float (&x)[2][4][4], int query0, int key0, int lane) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = query0 + 16 * mt + lane / 4 + 8 * r;
                const unsigned pair = pack_pair<elem_t>(x[mt][n][2 * r], x[mt][n][2 * r + 1]);
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(tile + swizzle<SCORE_ROW_BYTES>(row, (key0 + 8 * n) / 8) +
                                                                4 * (lane % 4)),
                             "r"(pair)
                             : "memory");
            }
}

// acc[32 keys × KV_COLS] += (P or dS)ᵀ · (the query tile of dO or Q): the warp's part of dV += Pᵀ dO or
// dK += dSᵀ Q. A: Pᵀ, rows = keys, from the [query][key] tile: ldmatrix.trans in B order gives the A
// operand of the transpose. B: the query tile, [query][d] = [k][n], with ldmatrix.trans in A order.
__device__ __forceinline__ void warp_key_gradients(float (&acc)[2][KV_FRAGS][4], unsigned score_tile, int key0,
                                                   unsigned query_tile, int col0, int lane) {
    const unsigned a_base = lane_address<SCORE_ROW_BYTES>(score_tile, b_order_row(lane), b_order_chunk(lane));
    const unsigned b_base = lane_address<ROW_BYTES>(query_tile, a_order_row(lane), a_order_chunk(lane));
#pragma unroll
    for (int k16 = 0; k16 < BLOCK_M / 16; ++k16) {
        unsigned a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
            ldmatrix_x4_trans(a[mt], block_address<SCORE_ROW_BYTES>(a_base, 16 * k16, (key0 + 16 * mt) / 8));
#pragma unroll
        for (int d16 = 0; d16 < KV_FRAGS / 2; ++d16) {
            unsigned b[4];
            ldmatrix_x4_trans(b, block_address<ROW_BYTES>(b_base, 16 * k16, col0 / 8 + 2 * d16));
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                mma_m16n8k16<elem_t>(acc[mt][2 * d16], a[mt], b[0], b[1]);
                mma_m16n8k16<elem_t>(acc[mt][2 * d16 + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// The warp's 16 × DQ_COLS part of dQ, `acc` (mma accumulators), added to the fp32 dQ at `dq_block`
// (row stride HEAD_DIM), rows < rows only. Every key tile's block adds to the same dQ, so the additions
// are atomic (in the L2). In the accumulator layout a thread holds pairs of columns of 2 rows, and a
// warp's atomics would touch 8 rows' lines at a time, 8 bytes of each per lane pair; so the tile goes
// through shared memory first (`staging`, STAGING_BYTES, swizzled like the tiles) and is read back as
// 16-byte pieces of whole rows: each instruction of the warp adds to whole 128-byte lines. On sm_90 one
// red.global.add.v4.f32 adds the 4 floats (a `red` is an atomic that returns nothing); before, 4 atomicAdd.
__device__ __forceinline__ void add_to_dq(float* dq_block, const float (&acc)[DQ_FRAGS][4], unsigned staging, int rows,
                                          int lane) {
    constexpr int ROW = DQ_COLS * 4, CHUNKS = DQ_COLS / 4;  // bytes and 16-byte chunks of a staged row
#pragma unroll
    for (int n = 0; n < DQ_FRAGS; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = lane / 4 + 8 * r, column = 8 * n + 2 * (lane % 4);
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(staging + swizzle<ROW>(row, column / 4) + 4 * (column % 4)),
                         "f"(acc[n][2 * r]), "f"(acc[n][2 * r + 1])
                         : "memory");
        }
    __syncwarp();
#pragma unroll
    for (int first = 0; first < 16; first += 32 / CHUNKS) {
        const int row = first + lane / CHUNKS, chunk = lane % CHUNKS;
        float4 x;
        asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                     : "r"(staging + swizzle<ROW>(row, chunk))
                     : "memory");
        if (row >= rows) continue;
        float* to = dq_block + (size_t)row * HEAD_DIM + 4 * chunk;
#if __CUDA_ARCH__ >= 900
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(to), "f"(x.x), "f"(x.y), "f"(x.z), "f"(x.w)
                     : "memory");
#else
        atomicAdd(to, x.x);
        atomicAdd(to + 1, x.y);
        atomicAdd(to + 2, x.z);
        atomicAdd(to + 3, x.w);
#endif
    }
}

// dQ of the query tile += dS K for the warp's share (m16 tile `mt`, d columns from `col0`), added to
// the fp32 accumulator in global memory: every key tile's block adds its part, hence the atomics.
// A: dS, [query][key] = [m][k], ldmatrix A order; B: K, [key][d] = [k][n], ldmatrix.trans A order.
__device__ __forceinline__ void accumulate_dq(float (&acc)[DQ_FRAGS][4], unsigned ds_tile, unsigned k_tile, int mt,
                                              int col0, int lane) {
    const unsigned a_base = lane_address<SCORE_ROW_BYTES>(ds_tile, a_order_row(lane), a_order_chunk(lane));
    const unsigned b_base = lane_address<ROW_BYTES>(k_tile, a_order_row(lane), a_order_chunk(lane));
#pragma unroll
    for (int n = 0; n < DQ_FRAGS; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
    for (int k16 = 0; k16 < BLOCK_N / 16; ++k16) {
        unsigned a[4];
        ldmatrix_x4(a, block_address<SCORE_ROW_BYTES>(a_base, 16 * mt, 2 * k16));
#pragma unroll
        for (int d16 = 0; d16 < DQ_COLS / 16; ++d16) {
            unsigned b[4];
            ldmatrix_x4_trans(b, block_address<ROW_BYTES>(b_base, 16 * k16, col0 / 8 + 2 * d16));
            mma_m16n8k16<elem_t>(acc[2 * d16], a, b[0], b[1]);
            mma_m16n8k16<elem_t>(acc[2 * d16 + 1], a, b[2], b[3]);
        }
    }
}

// The warp's 32 rows of dK or dV (times `factor`), columns from col0, rounded to elem_t; rows >= seq_kv
// are not written.
__device__ __forceinline__ void write_rows(elem_t* head, const float (&acc)[2][KV_FRAGS][4], float factor, int key0,
                                           int col0, int seq_kv, int lane) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 16 * mt + lane / 4 + 8 * r;
            if (key >= seq_kv) continue;
            elem_t* row = head + (size_t)key * HEAD_DIM + col0 + 2 * (lane % 4);
#pragma unroll
            for (int n = 0; n < KV_FRAGS; ++n)
                *reinterpret_cast<unsigned*>(row + 8 * n) =
                    pack_pair<elem_t>(acc[mt][n][2 * r] * factor, acc[mt][n][2 * r + 1] * factor);
        }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
attention_bwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
              const elem_t* __restrict__ d_o, const float* __restrict__ lse_log2, const float* __restrict__ delta,
              float* __restrict__ dq_accum, elem_t* __restrict__ dk, elem_t* __restrict__ dv, int seq_q, int seq_kv,
              int seq_q_padded, float scale, int causal) {
    extern __shared__ __align__(1024) unsigned char shared_bytes[];  // tiles at multiples of their row size
    const unsigned k_tile = shared_address(shared_bytes);
    const unsigned v_tile = k_tile + KV_TILE_BYTES;
    const unsigned q_ring = v_tile + KV_TILE_BYTES;
    const unsigned do_ring = q_ring + Q_STAGES * Q_TILE_BYTES;
    const unsigned p_tile = do_ring + Q_STAGES * Q_TILE_BYTES;
    const unsigned ds_tile = p_tile + SCORE_TILE_BYTES;
    const unsigned lse_ring = ds_tile + SCORE_TILE_BYTES;
    const unsigned delta_ring = lse_ring + Q_STAGES * VECTOR_BYTES;
    const float* lse_shared = reinterpret_cast<const float*>(shared_bytes + (lse_ring - k_tile));
    const float* delta_shared = reinterpret_cast<const float*>(shared_bytes + (delta_ring - k_tile));

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = blockIdx.x * BLOCK_N;  // the block's first key
    const size_t head = blockIdx.y;
    const elem_t* q_head = q + head * seq_q * HEAD_DIM;
    const elem_t* do_head = d_o + head * seq_q * HEAD_DIM;
    const float* lse_head = lse_log2 + head * seq_q_padded;
    const float* delta_head = delta + head * seq_q_padded;
    float* dq_head = dq_accum + head * seq_q * HEAD_DIM;
    // The warp's parts: of S and dP, 32 queries × 32 keys; of dK and dV, 32 keys × KV_COLS; of dQ, 16 × DQ_COLS.
    const int s_query0 = 32 * (warp % 2), s_key0 = 32 * (warp / 2);
    const int kv_key0 = 32 * (warp % 4), kv_col0 = KV_COLS * (warp / 4);
    const int dq_mt = warp % (BLOCK_M / 16), dq_col0 = DQ_COLS * (warp / (BLOCK_M / 16));

    // Causal: queries before n0 see none of the block's keys; their tiles are skipped.
    const int first_tile = causal ? n0 / BLOCK_M : 0;
    const int end_tile = (seq_q + BLOCK_M - 1) / BLOCK_M;

    // Prologue: K and V, and the first query tile, in one commit group.
    load_tile_async<BLOCK_N>(k_tile, k + (head * seq_kv + n0) * HEAD_DIM, seq_kv - n0);
    load_tile_async<BLOCK_N>(v_tile, v + (head * seq_kv + n0) * HEAD_DIM, seq_kv - n0);
    if (first_tile < end_tile)
        load_query_tile_async(query_buffer(q_ring, do_ring, lse_ring, delta_ring, first_tile), q_head, do_head,
                              lse_head, delta_head, first_tile * BLOCK_M, seq_q);
    cp_async_commit();

    unsigned k_held[KV_HELD_STEPS][2][4], v_held[KV_HELD_STEPS][2][4];
    if (KV_IN_REGISTERS) {
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < KV_HELD_STEPS; ++kk) {
            load_key_fragments(k_held[kk], k_tile, s_key0, kk, lane);
            load_key_fragments(v_held[kk], v_tile, s_key0, kk, lane);
        }
    }

    float dk_acc[2][KV_FRAGS][4] = {}, dv_acc[2][KV_FRAGS][4] = {};
    const float scale_log2 = scale * LOG2E;

    for (int tile = first_tile; tile < end_tile; ++tile) {
        cp_async_wait<0>();  // this tile's copies have landed (issued during the last iteration)
        __syncthreads();     // ... every thread's; and every warp is done with the last iteration
        // Refill: tile + 1 goes into the buffer of tile - 1, which no warp reads any more.
        if (tile + 1 < end_tile)
            load_query_tile_async(query_buffer(q_ring, do_ring, lse_ring, delta_ring, tile + 1), q_head, do_head,
                                  lse_head, delta_head, (tile + 1) * BLOCK_M, seq_q);
        cp_async_commit();

        const QueryTile buffer = query_buffer(q_ring, do_ring, lse_ring, delta_ring, tile);
        const int m0 = tile * BLOCK_M;
        const int vector_offset = (tile % Q_STAGES) * BLOCK_M;
        {
            float s[2][4][4], dp[2][4][4];
            warp_scores(s, buffer.q, s_query0, k_held, k_tile, s_key0, lane);                           // S = Q Kᵀ
            const bool on_diagonal = causal && m0 + s_query0 < n0 + s_key0 + 31;  // a key after a query
            probabilities(s, lse_shared + vector_offset + s_query0, scale_log2, on_diagonal, m0 + s_query0,
                          n0 + s_key0, lane);                                                           // P
            warp_scores(dp, buffer.d_o, s_query0, v_held, v_tile, s_key0, lane);                        // dP = dO Vᵀ
            score_gradients(dp, s, delta_shared + vector_offset + s_query0, lane);                      // dS
            store_scores(p_tile, s, s_query0, s_key0, lane);
            store_scores(ds_tile, dp, s_query0, s_key0, lane);
        }
        __syncthreads();  // P and dS of every warp are in shared memory
        warp_key_gradients(dv_acc, p_tile, kv_key0, buffer.d_o, kv_col0, lane);                         // dV += Pᵀ dO
        warp_key_gradients(dk_acc, ds_tile, kv_key0, buffer.q, kv_col0, lane);                          // dK += dSᵀ Q
        float dq_acc[DQ_FRAGS][4];
        accumulate_dq(dq_acc, ds_tile, k_tile, dq_mt, dq_col0, lane);                                   // dS K
        __syncthreads();  // every warp is done reading P and dS: their tiles become the warps' staging areas
        add_to_dq(dq_head + (size_t)(m0 + 16 * dq_mt) * HEAD_DIM + dq_col0, dq_acc, p_tile + warp * STAGING_BYTES,
                  seq_q - (m0 + 16 * dq_mt), lane);                                                     // dQ +=
    }

    write_rows(dk + head * seq_kv * HEAD_DIM, dk_acc, scale, n0 + kv_key0, kv_col0, seq_kv, lane);
    write_rows(dv + head * seq_kv * HEAD_DIM, dv_acc, 1.0f, n0 + kv_key0, kv_col0, seq_kv, lane);
}

// Per query row: Δ = rowsum(dO ∘ O) in fp32 (the softmax's term of dS), the LSE times log2(e) (the
// main kernel's exponentials are exp2), and a zeroed row of the fp32 dQ accumulator. Rows from
// seq_q to seq_q_padded, the padding of the last query tile, get Δ = 0 and LSE = +inf (p = 0).
// HEAD_DIM / 8 threads per row, 8 elements each; a row's threads are consecutive lanes of one warp.
extern "C" __global__ void __launch_bounds__(PREPROCESS_THREADS)
attention_bwd_preprocess(const elem_t* __restrict__ o, const elem_t* __restrict__ d_o, const float* __restrict__ lse,
                         float* __restrict__ lse_log2, float* __restrict__ delta, float* __restrict__ dq_accum,
                         int seq_q, int seq_q_padded, int pairs) {
    constexpr int THREADS_PER_ROW = HEAD_DIM / 8;
    const size_t padded_row = (size_t)blockIdx.x * ROWS_PER_PREPROCESS_BLOCK + threadIdx.x / THREADS_PER_ROW;
    const int part = threadIdx.x % THREADS_PER_ROW;
    const size_t head = padded_row / seq_q_padded;
    const int row = (int)(padded_row % seq_q_padded);
    const bool valid = head < (size_t)pairs && row < seq_q;
    const size_t element = (head * seq_q + row) * HEAD_DIM + 8 * part;
    float sum = 0.0f;
    if (valid) {
        const uint4 o8 = *reinterpret_cast<const uint4*>(o + element);
        const uint4 do8 = *reinterpret_cast<const uint4*>(d_o + element);
        const elem_t* os = reinterpret_cast<const elem_t*>(&o8);
        const elem_t* dos = reinterpret_cast<const elem_t*>(&do8);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += to_float(os[i]) * to_float(dos[i]);
        float4* dq8 = reinterpret_cast<float4*>(dq_accum + element);
        dq8[0] = dq8[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int offset = THREADS_PER_ROW / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (part == 0 && head < (size_t)pairs) {
        delta[padded_row] = sum;
        lse_log2[padded_row] = row < seq_q ? lse[head * seq_q + row] * LOG2E : INFINITY;
    }
}

// dQ = scale · the fp32 accumulator, rounded to elem_t: 8 elements per thread.
extern "C" __global__ void __launch_bounds__(CONVERT_THREADS)
attention_bwd_dq(const float* __restrict__ dq_accum, elem_t* __restrict__ dq, float scale, int groups) {
    const int group = blockIdx.x * CONVERT_THREADS + threadIdx.x;  // of 8 elements
    if (group >= groups) return;
    const size_t first = (size_t)group * 8;
    const float4* from = reinterpret_cast<const float4*>(dq_accum + first);
    const float4 a = from[0], b = from[1];
    uint4 packed;
    packed.x = pack_pair<elem_t>(a.x * scale, a.y * scale);
    packed.y = pack_pair<elem_t>(a.z * scale, a.w * scale);
    packed.z = pack_pair<elem_t>(b.x * scale, b.y * scale);
    packed.w = pack_pair<elem_t>(b.z * scale, b.w * scale);
    *reinterpret_cast<uint4*>(dq + first) = packed;
}
