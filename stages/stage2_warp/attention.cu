// Stage 2 — tensor cores with mma.sync: the FlashAttention-2 split.
//
// New here: both products run on the tensor cores (mma.sync m16n8k16, operands loaded from
// shared memory with ldmatrix), and the work is split the FlashAttention-2 way: each of the
// 4 warps owns 16 query rows outright, so the online softmax needs no other warp -- its row
// max and row sum are shuffles between the 4 lanes that share a row. S and P live only in
// registers: the C fragments of S, exponentiated and packed to 16 bits, are the A operand of
// P·V as they are. Tiles still arrive by plain loads (global -> registers -> shared), with the
// whole block waiting for them; stage 3 overlaps them with the math.
//
// Per block: BLOCK_M = 64 query rows (4 warps × 16), tiles of BLOCK_N = 64 keys.
//   per K/V tile: 4·64·64·D FLOPs (1.05 M at D=64, 2.1 M at D=128) for 2·64·D·2 bytes loaded
//                 (16 KB, 32 KB): 64 FLOPs per byte of K/V
//   registers:    O 16×D fp32 = D/2, Q fragments D/4, S 32, plus K/V fragments in flight:
//                 ptxas uses 128 at D=64 and 220 at D=128 (no spills)
//   shared:       Q, K, V tiles of 64 × (D+8) elements (padded rows): 27 KB at D=64, 51 KB at D=128
//   occupancy:    4 blocks (16 warps) per SM at D=64, 2 (8 warps) at D=128, bound by registers
// Every tile is a load stall that only the other blocks on the SM can hide. (Predictions and
// measurements: docs/notebook/stage2.md.)
//
// Tensors are [B, H, S, D], K and V [B, H_kv, S, D], contiguous (grouped-query attention: H / H_kv
// query heads read one KV head); blockIdx.z walks the B·H_kv KV (batch, head) pairs, blockIdx.y the
// gridDim.y = H / H_kv query heads of each: query pair blockIdx.z · gridDim.y + blockIdx.y.
// Causal masking is top-left aligned, as in PyTorch: query i sees keys j <= i.
#include "mma.cuh"

constexpr int BLOCK_M = 64;                   // query rows per block
constexpr int BLOCK_N = 64;                   // keys per K/V tile
constexpr int NUM_WARPS = BLOCK_M / 16;       // one warp per 16 query rows
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int ROW_STRIDE = HEAD_DIM + 8;      // shared-memory row, in elements (see load_tile)
constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;  // 16-byte chunks in a row of D elements
constexpr int D_STEPS = HEAD_DIM / 16;        // k-steps of Q·Kᵀ (16 columns of d each)
constexpr int S_FRAGS = BLOCK_N / 8;          // n8 fragments of a warp's 16 × BLOCK_N scores
constexpr int O_FRAGS = HEAD_DIM / 8;         // n8 fragments of a warp's 16 × D output
constexpr int SHARED_BYTES = (BLOCK_M + 2 * BLOCK_N) * ROW_STRIDE * sizeof(elem_t);  // the Q, K and V tiles
static_assert(BLOCK_M == BLOCK_N, "load_tile copies tiles of BLOCK_N rows, Q's included");

// Copies rows [0, rows) of a row-major [*, HEAD_DIM] global tile into shared memory, zeros past
// `rows` (a key row of zeros would still meet p = 0 in P·V, but 0 × garbage can be NaN).
// Neighbouring threads copy neighbouring 16-byte chunks of a row: coalesced.
// Rows are padded by 16 bytes: ldmatrix reads 8 rows of one 16-byte column at a time, and with
// a stride of D·2 + 16 bytes those 8 rows start in 8 different groups of 4 banks, not the same.
__device__ __forceinline__ void load_tile(elem_t* tile, const elem_t* source, int rows) {
    static_assert(BLOCK_N * CHUNKS_PER_ROW % NUM_THREADS == 0, "every thread copies as many chunks");
#pragma unroll
    for (int step = 0; step < BLOCK_N * CHUNKS_PER_ROW / NUM_THREADS; ++step) {
        const int i = step * NUM_THREADS + threadIdx.x;
        const int row = i / CHUNKS_PER_ROW, col = i % CHUNKS_PER_ROW * 8;
        uint4 chunk = make_uint4(0, 0, 0, 0);
        if (row < rows) chunk = *reinterpret_cast<const uint4*>(source + (size_t)row * HEAD_DIM + col);
        *reinterpret_cast<uint4*>(tile + row * ROW_STRIDE + col) = chunk;
    }
}

// --8<-- [start:ldmatrix]
// The warp's 16 rows of Q as A operands, one per k-step, loaded once and kept in registers.
// Lane l points ldmatrix at row l % 16, columns 16·kk + 8·(l / 16): the four 8×8 matrices come
// back as a[0..3] (see mma.cuh for the fragment layouts).
__device__ __forceinline__ void load_q_fragments(unsigned (&q_frag)[D_STEPS][4], const elem_t* q_warp, int lane) {
    const elem_t* lane_row = q_warp + a_order_row(lane) * ROW_STRIDE + a_order_chunk(lane) * 8;
#pragma unroll
    for (int kk = 0; kk < D_STEPS; ++kk) ldmatrix_x4(q_frag[kk], shared_address(lane_row + kk * 16));
}
// --8<-- [end:ldmatrix]

// --8<-- [start:mma]
// S[16 × BLOCK_N] = Q[16 × D] · Kᵀ, K tile [BLOCK_N × D] in shared memory. mma's B operand is
// "col" (k-major per column n): a row of K (one key, D contiguous values) is exactly a column of
// Kᵀ, so K is read as it lies, no transpose.
__device__ __forceinline__ void warp_scores(float (&s)[S_FRAGS][4], const unsigned (&q_frag)[D_STEPS][4],
                                            const elem_t* k_tile, int lane) {
#pragma unroll
    for (int n = 0; n < S_FRAGS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    // EXERCISE: compute S = Q·Kᵀ on the tensor cores. For each 16 keys (n16) and each k-step
    // (kk, 16 columns of d): one ldmatrix_x4 brings the B operands of two n8 fragments, keys
    // 16·n16 + 0..7 and + 8..15, from rows 16·n16 + b_order_row(lane), columns
    // 16·kk + 8·b_order_chunk(lane) of k_tile; two mma_m16n8k16<elem_t> add them into
    // s[2·n16] and s[2·n16 + 1] with the A operand q_frag[kk].
    // STUB: (void)q_frag; (void)k_tile; (void)lane;  // S stays 0: every key gets the same weight
    const elem_t* lane_row = k_tile + b_order_row(lane) * ROW_STRIDE + b_order_chunk(lane) * 8;
#pragma unroll
    for (int n16 = 0; n16 < BLOCK_N / 16; ++n16) {
#pragma unroll
        for (int kk = 0; kk < D_STEPS; ++kk) {
            unsigned k_frag[4];  // b[0], b[1] of keys +0..7, then b[0], b[1] of keys +8..15
            ldmatrix_x4(k_frag, shared_address(lane_row + n16 * 16 * ROW_STRIDE + kk * 16));
            mma_m16n8k16<elem_t>(s[2 * n16], q_frag[kk], k_frag[0], k_frag[1]);
            mma_m16n8k16<elem_t>(s[2 * n16 + 1], q_frag[kk], k_frag[2], k_frag[3]);
        }
    }
    // END EXERCISE
}

// O[16 × D] += P[16 × BLOCK_N] · V, V tile [BLOCK_N × D] in shared memory. Here B[k][n] is
// V[key][d]: d is contiguous, so ldmatrix.trans turns each 8 keys × 8 d matrix around.
__device__ __forceinline__ void warp_pv(float (&o)[O_FRAGS][4], const float (&p)[S_FRAGS][4],
                                        const elem_t* v_tile, int lane) {
    const elem_t* lane_row = v_tile + a_order_row(lane) * ROW_STRIDE + a_order_chunk(lane) * 8;
#pragma unroll
    for (int k16 = 0; k16 < BLOCK_N / 16; ++k16) {
        unsigned p_frag[4];
        p_as_a_operand(p, k16, p_frag);  // registers to registers: see mma.cuh
#pragma unroll
        for (int d16 = 0; d16 < D_STEPS; ++d16) {
            unsigned v_frag[4];  // b[0], b[1] of d +0..7, then b[0], b[1] of d +8..15
            ldmatrix_x4_trans(v_frag, shared_address(lane_row + k16 * 16 * ROW_STRIDE + d16 * 16));
            mma_m16n8k16<elem_t>(o[2 * d16], p_frag, v_frag[0], v_frag[1]);
            mma_m16n8k16<elem_t>(o[2 * d16 + 1], p_frag, v_frag[2], v_frag[3]);
        }
    }
}
// --8<-- [end:mma]

extern "C" __global__ void __launch_bounds__(NUM_THREADS)
attention_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
              elem_t* __restrict__ o, float* __restrict__ lse, int seq_q, int seq_kv, float scale, int causal) {
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    elem_t* q_tile = reinterpret_cast<elem_t*>(shared_bytes);
    elem_t* k_tile = q_tile + BLOCK_M * ROW_STRIDE;
    elem_t* v_tile = k_tile + BLOCK_N * ROW_STRIDE;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int m0 = blockIdx.x * BLOCK_M;      // first query row of the block
    const int warp_m0 = m0 + warp * 16;       // first query row of this warp
    const size_t head = (size_t)blockIdx.z * gridDim.y + blockIdx.y;  // the query (batch, head) pair
    const size_t kv_head = blockIdx.z;            // the KV pair it reads, shared by gridDim.y query heads
    const elem_t* k_head = k + kv_head * seq_kv * HEAD_DIM;
    const elem_t* v_head = v + kv_head * seq_kv * HEAD_DIM;

    load_tile(q_tile, q + (head * seq_q + m0) * HEAD_DIM, seq_q - m0);
    __syncthreads();
    unsigned q_frag[D_STEPS][4];
    load_q_fragments(q_frag, q_tile + warp * 16 * ROW_STRIDE, lane);

    float o_acc[O_FRAGS][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    const float scale_log2 = scale * LOG2E;

    // --8<-- [start:causal_skip]
    // Causal: the block's last row is m0 + BLOCK_M - 1, so keys from m0 + BLOCK_M on are masked
    // for all its rows -- those tiles are never loaded. Of the tiles that remain, only the ones
    // that cross the diagonal (or the end of the keys) need a mask at all.
    const int kv_end = causal ? min(seq_kv, m0 + BLOCK_M) : seq_kv;
    for (int n0 = 0; n0 < kv_end; n0 += BLOCK_N) {
        __syncthreads();  // every warp is done with the previous K and V tiles
        load_tile(k_tile, k_head + (size_t)n0 * HEAD_DIM, seq_kv - n0);
        load_tile(v_tile, v_head + (size_t)n0 * HEAD_DIM, seq_kv - n0);
        __syncthreads();  // the new tiles are in shared memory

        float s[S_FRAGS][4];
        warp_scores(s, q_frag, k_tile, lane);
        const bool crosses_end = n0 + BLOCK_N > seq_kv;
        const bool crosses_diagonal = causal && n0 + BLOCK_N - 1 > warp_m0;
        if (crosses_end || crosses_diagonal) apply_mask(s, n0, warp_m0 + lane / 4, seq_kv, causal, lane);
        // --8<-- [end:causal_skip]

        // --8<-- [start:online_softmax]
        // The online softmax on the accumulator fragments (mma.cuh): each thread updates the
        // max and sum of its two rows, g and g+8, and rescales its part of O; the 4 lanes of a
        // quad agree on the max through two __shfl_xor_sync. S becomes P in place.
        online_softmax(s, o_acc, row_max, row_sum, scale_log2);
        // --8<-- [end:online_softmax]
        warp_pv(o_acc, s, v_tile, lane);
    }

    write_output(o_acc, row_max, row_sum, scale, o + head * seq_q * HEAD_DIM, lse + head * seq_q, warp_m0,
                 seq_q, lane);
}
