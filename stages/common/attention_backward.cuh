// The two small kernels around an attention backward's main kernel (stages 8 and 9): the preprocess
// (Δ, the LSE in log2 units, a zeroed fp32 dQ accumulator) and the conversion of the fp32 dQ to
// elem_t. Both are memory-bound and architecture-neutral; the main kernels differ (mma.sync, wgmma).
// Needs HEAD_DIM, elem_t (attention.cuh) and pack_pair (mma.cuh).
#pragma once
#include "attention.cuh"
#include "mma.cuh"

// The preprocess and the dQ conversion: 8 elements (16 bytes of elem_t) per thread.
constexpr int PREPROCESS_THREADS = 256;
constexpr int ROWS_PER_PREPROCESS_BLOCK = PREPROCESS_THREADS / (HEAD_DIM / 8);
constexpr int CONVERT_THREADS = 256;

// Pᵀ = exp(scale·Sᵀ − LSE), in place: s holds a warp's 16 keys in mma.sync's (or wgmma's) accumulator
// layout (rows g, g+8 of fragment n: c[0..1], c[2..3]) against the tile's queries (columns 8n + 2t, +1). lse_log2 is the LSE in log2 units,
// +inf for the padding rows past seq_q, whose p is then 0. The exponent is capped at 0 (p <= 1, as
// the exact p is): the zero-filled keys past seq_kv score 0, not -inf, and exp(0 - LSE) would reach
// inf where a row's true scores are all very negative (x10 inputs: LSE = -100), then inf × 0 = NaN
// in dQ += dS K; capped, their p is finite and meets K's zero rows (their dK and dV are not written).
// When `mask`, keys after the query are 0: key0 + g + 8(c/2) > m0 + 8n + 2t + c%2, i.e.
// `ahead` + 8(c/2) - c%2 > 8n, with one per-thread term and compile-time constants (registers are scarce);
// AGAINST_CONSTANTS writes the same test as `ahead` > 8n - 8(c/2) + c%2 (which form ptxas allocates
// better depends on the kernel around it: stage 8's MASK_AGAINST_CONSTANTS).
template <int M_FRAGS, bool AGAINST_CONSTANTS = false>
__device__ __forceinline__ void probabilities(float (&s)[M_FRAGS][4], const float* lse_log2, float scale_log2,
                                              bool mask, int key0, int m0, int lane) {
    const int ahead = key0 + lane / 4 - m0 - 2 * (lane % 4);
#pragma unroll
    for (int n = 0; n < M_FRAGS; ++n) {
        const float2 lse = *reinterpret_cast<const float2*>(lse_log2 + 8 * n + 2 * (lane % 4));
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float p = fast_exp2(fminf(s[n][c] * scale_log2 - (c % 2 ? lse.y : lse.x), 0.0f));
            s[n][c] = mask && (AGAINST_CONSTANTS ? ahead > 8 * n - 8 * (c / 2) + c % 2 : ahead + 8 * (c / 2) - c % 2 > 8 * n)
                          ? 0.0f
                          : p;
        }
    }
}

// The preprocess's parameters (attention_backward.py's PreprocessParams, the launch's copy). O and dO as
// HeadRows take them ([B, H, S, D], any strides with D contiguous); the fp32 vectors are dense, the LSE
// [B, H, seq_q], the others padded to seq_q_padded rows per head; `pairs` = B · H.
// (A pointer in a struct is not __restrict__ to the compiler: what the kernels only read, they read
// with __ldg, the read-only loads a __restrict__ parameter would get.)
struct PreprocessParams {
    const elem_t* o;
    long long o_batch_stride, o_head_stride;
    int o_row_stride;
    const elem_t* d_o;
    long long d_o_batch_stride, d_o_head_stride;
    int d_o_row_stride;
    int heads;
    const float* lse;
    float *lse_log2, *delta, *dq_accum;
    int seq_q, seq_q_padded, pairs;
};

// Per query row: Δ = rowsum(dO ∘ O) in fp32 (the softmax's term of dS), the LSE times log2(e) (the
// main kernel's exponentials are exp2), and a zeroed row of the fp32 dQ accumulator. Rows from
// seq_q to seq_q_padded, the padding of the last query tile, get Δ = 0 and LSE = +inf (p = 0), and
// their dQ rows are zeroed too: the accumulator has whole query tiles, so that the main kernels add
// whole tiles to it without testing rows (the padding rows' sums are never converted).
// HEAD_DIM / 8 threads per row, 8 elements each; a row's threads are consecutive lanes of one warp.
extern "C" __global__ void __launch_bounds__(PREPROCESS_THREADS)
attention_bwd_preprocess(const __grid_constant__ PreprocessParams p) {
    constexpr int THREADS_PER_ROW = HEAD_DIM / 8;
    const size_t padded_row = (size_t)blockIdx.x * ROWS_PER_PREPROCESS_BLOCK + threadIdx.x / THREADS_PER_ROW;
    const int part = threadIdx.x % THREADS_PER_ROW;
    const size_t head = padded_row / p.seq_q_padded;
    const int row = (int)(padded_row % p.seq_q_padded);
    const bool valid = head < (size_t)p.pairs && row < p.seq_q;
    if (head < (size_t)p.pairs) {
        float4* dq8 = reinterpret_cast<float4*>(p.dq_accum + padded_row * HEAD_DIM + 8 * part);
        dq8[0] = dq8[1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float sum = 0.0f;
    if (valid) {
        const HeadRows<const elem_t> o_rows{p.o, p.o_batch_stride, p.o_head_stride, p.o_row_stride, p.heads};
        const HeadRows<const elem_t> do_rows{p.d_o, p.d_o_batch_stride, p.d_o_head_stride, p.d_o_row_stride, p.heads};
        const uint4 o8 = __ldg(reinterpret_cast<const uint4*>(o_rows.row((int)head, row) + 8 * part));
        const uint4 do8 = __ldg(reinterpret_cast<const uint4*>(do_rows.row((int)head, row) + 8 * part));
        const elem_t* os = reinterpret_cast<const elem_t*>(&o8);
        const elem_t* dos = reinterpret_cast<const elem_t*>(&do8);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += to_float(os[i]) * to_float(dos[i]);
    }
#pragma unroll
    for (int offset = THREADS_PER_ROW / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (part == 0 && head < (size_t)p.pairs) {
        p.delta[padded_row] = sum;
        p.lse_log2[padded_row] = row < p.seq_q ? __ldg(p.lse + head * p.seq_q + row) * LOG2E : INFINITY;
    }
}

// The dQ conversion's parameters (attention_backward.py's DqParams): the fp32 accumulator, `groups` of 8
// in it (seq_q_padded rows per head), and dQ as HeadRows take it (any strides).
struct DqParams {
    const float* dq_accum;
    elem_t* dq;
    long long dq_batch_stride, dq_head_stride;
    int dq_row_stride;
    int heads;
    float scale;
    int groups, seq_q, seq_q_padded;
};

// dQ = scale · the fp32 accumulator, rounded to elem_t: 8 elements per thread; the padding rows' groups
// are skipped.
extern "C" __global__ void __launch_bounds__(CONVERT_THREADS)
attention_bwd_dq(const __grid_constant__ DqParams p) {
    constexpr int GROUPS_PER_ROW = HEAD_DIM / 8;
    const int group = blockIdx.x * CONVERT_THREADS + threadIdx.x;
    if (group >= p.groups) return;
    const int padded_row = group / GROUPS_PER_ROW, part = group % GROUPS_PER_ROW;
    const int head = padded_row / p.seq_q_padded, row = padded_row % p.seq_q_padded;
    if (row >= p.seq_q) return;
    const float4* from = reinterpret_cast<const float4*>(p.dq_accum + (size_t)group * 8);
    const float4 a = __ldg(from), b = __ldg(from + 1);
    uint4 packed;
    packed.x = pack_pair<elem_t>(a.x * p.scale, a.y * p.scale);
    packed.y = pack_pair<elem_t>(a.z * p.scale, a.w * p.scale);
    packed.z = pack_pair<elem_t>(b.x * p.scale, b.y * p.scale);
    packed.w = pack_pair<elem_t>(b.z * p.scale, b.w * p.scale);
    const HeadRows<elem_t> dq_rows{p.dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, p.heads};
    *reinterpret_cast<uint4*>(dq_rows.row(head, row) + 8 * part) = packed;
}
