// The consumer side of a Hopper attention forward (stage 4's pieces, as templates): the two wgmma
// products of a K/V tile, the online softmax split around the P·V product still in flight, and an
// epilogue for rows that may see no key; and the steps of a consumer's rounds in stage 4's pipeline
// (ping-pong turns, S_j issued beside P_{j-1}·V_{j-1}). Also the parameter struct of stage 4's kernel and
// of its ladder's rungs (ForwardParams). Stage 4, its ladder's rungs and stage 12 include it.
//
// Tiles are laid out as tma.cuh's load_tile leaves them: column block b (64 elements, 128 bytes
// swizzled) of a ROWS-row tile at tile + b·ROWS·128.
#pragma once
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// The parameters of stage 4's attention_fwd and of its ladder's rungs, besides Q, K and V (attention.py's
// ForwardParams packs them): O as HeadRows take it, for `heads` query heads; the LSE [B, H, seq_q]; `group`
// query heads per KV head. `causal` is the rungs' mask (stage 4 compiles its own in: CAUSAL); `batch_heads`
// (B·H) and `persistent` are stage 4's schedule (the rungs launch a block per query tile).
struct ForwardParams {
    elem_t* o;
    long long o_batch_stride, o_head_stride;
    int o_row_stride;
    int heads;
    float* lse;
    int seq_q, seq_kv;
    float scale;
    int causal, group, batch_heads, persistent;
};

// --8<-- [start:wgmma]
// S[64 × BLOCK_N] = Q[64 × D] · Kᵀ for the 64 rows of consumer warpgroup `consumer` of a BLOCK_M-row
// Q tile: D/16 wgmmas, both operands K-major. Step kk covers d = 16kk .. 16kk+15: column block kk / 4,
// 32 bytes further into the 128-byte swizzled row per step inside it (the hardware applies the XOR on
// the address).
template <int BLOCK_M, int BLOCK_N, int DIM>
__device__ __forceinline__ void wgmma_scores(float (&s)[BLOCK_N / 8][4], unsigned q_tile, unsigned k_tile,
                                             int consumer) {
#pragma unroll
    for (int kk = 0; kk < DIM / 16; ++kk) {
        const unsigned column = kk / 4, offset = (kk % 4) * 32;
        const u64 a = make_smem_desc(q_tile + column * BLOCK_M * SWIZZLE_BYTES + consumer * 64 * SWIZZLE_BYTES + offset,
                                     16, SWIZZLE_ATOM_BYTES);
        const u64 b = make_smem_desc(k_tile + column * BLOCK_N * SWIZZLE_BYTES + offset, 16, SWIZZLE_ATOM_BYTES);
        wgmma_ss<elem_t, BLOCK_N, K_MAJOR>(s, a, b, kk > 0);
    }
}

// O[64 × D] += P[64 × BLOCK_N] · V[BLOCK_N × D], P from registers, V MN-major (d contiguous in a row
// of keys): step ks covers keys 16ks .. 16ks+15 = two 8-row groups (SBO = 1024 bytes apart) starting
// 16·128 bytes further down; the 64-column blocks of d are LBO = BLOCK_N·128 bytes apart.
template <int BLOCK_N, int DIM>
__device__ __forceinline__ void wgmma_pv(float (&o)[DIM / 8][4], const unsigned (&p)[BLOCK_N / 16][4],
                                         unsigned v_tile) {
#pragma unroll
    for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
        const u64 b = make_smem_desc(v_tile + ks * 16 * SWIZZLE_BYTES, BLOCK_N * SWIZZLE_BYTES, SWIZZLE_ATOM_BYTES);
        wgmma_rs<elem_t, DIM, MN_MAJOR>(o, p[ks], b, 1);
    }
}
// --8<-- [end:wgmma]

// The online softmax of mma.cuh, split in two: this half turns the scores into P and returns in
// `correction` the factor O must be rescaled by once the P·V product still accumulating into it
// (intra-warpgroup overlap) has completed (rescale_accumulator).
// The row max and the row sum run in CHAINS independent chains, combined at the end. mma.cuh's
// tile_row_max is one running max: a chain of 2·N_FRAGS dependent FMNMX, each waiting ~4 cycles for
// the one before. Where many warps share a scheduler (stages 2 and 3) others fill those cycles, and
// one chain saves the registers (stage 3 at D = 64 spills with 4 on sm_80-89); here only the two
// consumer warpgroups do, and 4 chains cut the chain to a quarter.
template <int N_FRAGS>
__device__ __forceinline__ void softmax_to_p(float (&s)[N_FRAGS][4], float (&row_max)[2], float (&row_sum)[2],
                                             float (&correction)[2], float scale_log2) {
    constexpr int CHAINS = 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float m[CHAINS], sum[CHAINS];
#pragma unroll
        for (int i = 0; i < CHAINS; ++i) m[i] = -INFINITY, sum[i] = 0.0f;
#pragma unroll
        for (int n = 0; n < N_FRAGS; ++n) m[n % CHAINS] = fmaxf(m[n % CHAINS], fmaxf(s[n][2 * r], s[n][2 * r + 1]));
#pragma unroll
        for (int i = 1; i < CHAINS; ++i) m[0] = fmaxf(m[0], m[i]);
        const float new_max = fmaxf(row_max[r], quad_max(m[0]));
        const float max_scaled = scaled_max(new_max, scale_log2);  // 0 while the row has seen no key: no NaN
        correction[r] = fast_exp2(row_max[r] * scale_log2 - max_scaled);
        row_max[r] = new_max;
#pragma unroll
        for (int n = 0; n < N_FRAGS; ++n)
#pragma unroll
            for (int c = 2 * r; c < 2 * r + 2; ++c) {
                s[n][c] = fast_exp2(s[n][c] * scale_log2 - max_scaled);
                sum[n % CHAINS] += s[n][c];
            }
#pragma unroll
        for (int i = 1; i < CHAINS; ++i) sum[0] += sum[i];
        row_sum[r] = row_sum[r] * correction[r] + sum[0];
    }
}

template <int D_FRAGS>
__device__ __forceinline__ void rescale_accumulator(float (&o)[D_FRAGS][4], const float (&correction)[2]) {
#pragma unroll
    for (int d = 0; d < D_FRAGS; ++d) {
        o[d][0] *= correction[0];
        o[d][1] *= correction[0];
        o[d][2] *= correction[1];
        o[d][3] *= correction[1];
    }
}

// P (fp32, in the registers of S) -> the 16-bit A operands of P·V's wgmmas.
template <int N_FRAGS>
__device__ __forceinline__ void p_operands(const float (&s)[N_FRAGS][4], unsigned (&p)[N_FRAGS / 2][4]) {
#pragma unroll
    for (int ks = 0; ks < N_FRAGS / 2; ++ks) p_as_a_operand(s, ks, p[ks]);
}

// --8<-- [start:rounds]
// The steps of a consumer warpgroup's rounds in stage 4's pipeline (stage 12 runs the same rounds over
// its listed tiles). The stage waits for its tiles (the ring's full barriers and their parities); these
// issue the products in the consumer's turn, wait for them, and give each buffer back to the producer
// once it is read: `shared`, the stage's shared-memory layout, names the barriers that say so
// (q_empty(), k_empty(slot), v_empty(slot) for ring slot `slot`).

// The ping-pong: consumer c's turn on the tensor cores is named barrier first + c, which the other
// consumer's arrival completes; a consumer takes its turn, issues its products, and passes the turn on.
// THREADS: both consumer warpgroups' threads.
template <int THREADS>
struct Turns {
    int mine, other;
    __device__ Turns(int first, int consumer) : mine(first + consumer), other(first + 1 - consumer) {}
    __device__ void take() const { named_barrier_sync(mine, THREADS); }
    __device__ void pass() const { named_barrier_arrive(other, THREADS); }
};

// Round 0 in this consumer's turn: S_0 = Q·K_0ᵀ alone.
template <int BLOCK_M, int BLOCK_N, int DIM, int THREADS>
__device__ __forceinline__ void issue_scores(float (&s)[BLOCK_N / 8][4], unsigned q_tile, unsigned k_tile,
                                             int consumer, const Turns<THREADS>& turns) {
    turns.take();
    wgmma_fence();
    wgmma_scores<BLOCK_M, BLOCK_N, DIM>(s, q_tile, k_tile, consumer);
    wgmma_commit();
    turns.pass();
}

// Round j >= 1 in this consumer's turn: S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1}, two commit groups, so
// that S_j can be waited for while P·V still runs.
template <int BLOCK_M, int BLOCK_N, int DIM, int THREADS>
__device__ __forceinline__ void issue_scores_and_pv(float (&s)[BLOCK_N / 8][4], float (&o)[DIM / 8][4],
                                                    const unsigned (&p)[BLOCK_N / 16][4], unsigned q_tile,
                                                    unsigned k_tile, unsigned v_tile, int consumer,
                                                    const Turns<THREADS>& turns) {
    turns.take();
    wgmma_fence();
    wgmma_scores<BLOCK_M, BLOCK_N, DIM>(s, q_tile, k_tile, consumer);
    wgmma_commit();
    wgmma_pv<BLOCK_N, DIM>(o, p, v_tile);
    wgmma_commit();
    turns.pass();
}

// S is ready once at most PENDING commit groups still run (1: round j's P·V): K's ring slot goes back
// to the producer, and Q too after the query tile's last Q·Kᵀ (the producer may load the next Q).
template <int PENDING, int N_FRAGS, class Shared>
__device__ __forceinline__ void wait_scores(float (&s)[N_FRAGS][4], const Shared& shared, int slot,
                                            bool last_tile) {
    wgmma_wait<PENDING>();
    fence_registers(s);
    mbarrier_arrive(shared.k_empty(slot));
    if (last_tile) mbarrier_arrive(shared.q_empty());
}

// Every product issued is done: O may be rescaled or written, P overwritten, and V's ring slot goes
// back to the producer.
template <int D_FRAGS, int P_FRAGS, class Shared>
__device__ __forceinline__ void wait_pv(float (&o)[D_FRAGS][4], unsigned (&p)[P_FRAGS][4], const Shared& shared,
                                        int slot) {
    wgmma_wait<0>();
    fence_registers(o);
    fence_registers(p);
    mbarrier_arrive(shared.v_empty(slot));
}

// The last round in this consumer's turn: O += P·V of the query tile's last K/V tile. The caller
// passes the turn on (or not: stage 4's block's last turn).
template <int BLOCK_N, int DIM, int THREADS>
__device__ __forceinline__ void issue_last_pv(float (&o)[DIM / 8][4], const unsigned (&p)[BLOCK_N / 16][4],
                                              unsigned v_tile, const Turns<THREADS>& turns) {
    turns.take();
    wgmma_fence();
    wgmma_pv<BLOCK_N, DIM>(o, p, v_tile);
    wgmma_commit();
}
// --8<-- [end:rounds]

// mma.cuh's write_output for rows that may have seen no key at all (a sparse mask's): such a row's sum
// is 0, and it gets O = 0 and LSE = -inf (FlexAttention's convention) instead of 0/0.
template <int D_FRAGS>
__device__ __forceinline__ void write_output_or_empty(const float (&o)[D_FRAGS][4], const float (&row_max)[2],
                                                      const float (&row_sum)[2], float scale, elem_t* o_head,
                                                      float* lse_head, int first_row, int seq_q, int lane,
                                                      int o_row_stride) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float sum = quad_sum(row_sum[r]);
        const int row = first_row + lane / 4 + 8 * r;
        if (row >= seq_q) continue;
        const bool empty = sum == 0.0f;
        const float inv_sum = empty ? 0.0f : 1.0f / sum;
        elem_t* o_row = o_head + (size_t)row * o_row_stride + 2 * (lane % 4);
#pragma unroll
        for (int d = 0; d < D_FRAGS; ++d)
            *reinterpret_cast<unsigned*>(o_row + 8 * d) =
                pack_pair<elem_t>(o[d][2 * r] * inv_sum, o[d][2 * r + 1] * inv_sum);
        if (lane % 4 == 0) lse_head[row] = empty ? -INFINITY : row_max[r] * scale + logf(sum);
    }
}
