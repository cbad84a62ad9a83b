// Stage 0 — naive attention, in three kernels.
//
//   O = softmax(scale · Q Kᵀ) V,   for every (batch, head), Q: [Sq, D], K and V: [Skv, D]
//
// 1. attention_scores  writes every score s_ij = scale · q_i · k_j into a [Sq, Skv] fp32 matrix
//                      in global memory (masked scores become -inf);
// 2. attention_softmax turns each row of scores into probabilities, in place, and writes the
//                      row's log-sum-exp (LSE), which the backward pass needs;
// 3. attention_pv      multiplies the probabilities by V.
//
// Simple and correct, and slow for the reason the next stage removes: the score matrix is
// Sq × Skv floats per head (16 GiB for B4 H16 S8192), written once and read twice.
//
// Tensors are [B, H, S, D], contiguous; blockIdx.z walks the B·H (batch, head) pairs.
// Causal masking is top-left aligned, as in PyTorch: query i sees keys j <= i.
#include "attention.cuh"

// --8<-- [start:scores]
// One thread per score. Neighbouring threads take neighbouring keys j, so their writes to
// scores[i][j] are contiguous (coalesced); every thread of a row re-reads the same q_i.
extern "C" __global__ void attention_scores(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                                            float* __restrict__ scores, int seq_q, int seq_kv,
                                            float scale, int causal) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;  // key
    const int i = blockIdx.y * blockDim.y + threadIdx.y;  // query
    if (i >= seq_q || j >= seq_kv) return;

    const elem_t* q_row = q + ((size_t)blockIdx.z * seq_q + i) * HEAD_DIM;
    const elem_t* k_row = k + ((size_t)blockIdx.z * seq_kv + j) * HEAD_DIM;
    float dot = 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) dot += to_float(q_row[d]) * to_float(k_row[d]);

    const bool masked = causal && j > i;
    scores[((size_t)blockIdx.z * seq_q + i) * seq_kv + j] = masked ? -INFINITY : dot * scale;
}
// --8<-- [end:scores]

// --8<-- [start:softmax]
// One block per row of scores. softmax(x)_j = exp(x_j - m) / Σ exp(x_k - m) for any m; taking
// m = max_k x_k keeps every exp() <= 1, so large scores cannot overflow to inf.
__device__ float block_reduce(float value, bool take_max) {
    __shared__ float partial[32];  // one slot per warp (at most 1024 threads)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) {  // reduce within the warp
        const float other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = take_max ? fmaxf(value, other) : value + other;
    }
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    const int num_warps = blockDim.x / 32;
    value = lane < num_warps ? partial[lane] : (take_max ? -INFINITY : 0.0f);
    for (int offset = 16; offset > 0; offset /= 2) {  // then across the warps' results
        const float other = __shfl_xor_sync(0xffffffffu, value, offset);
        value = take_max ? fmaxf(value, other) : value + other;
    }
    __syncthreads();  // `partial` is reused by the next call
    return value;
}

extern "C" __global__ void attention_softmax(float* __restrict__ scores, float* __restrict__ lse, int seq_kv) {
    float* row = scores + (size_t)blockIdx.x * seq_kv;

    // EXERCISE: make the softmax numerically safe. Find the row's maximum `row_max` (use
    // block_reduce(..., true)), subtract it inside every exp(), and add it back in the LSE.
    // STUB: const float row_max = 0.0f;
    float row_max = -INFINITY;
    for (int j = threadIdx.x; j < seq_kv; j += blockDim.x) row_max = fmaxf(row_max, row[j]);
    row_max = block_reduce(row_max, true);
    // END EXERCISE

    float row_sum = 0.0f;
    for (int j = threadIdx.x; j < seq_kv; j += blockDim.x) {
        const float p = expf(row[j] - row_max);  // masked scores (-inf) give exactly 0
        row[j] = p;
        row_sum += p;
    }
    row_sum = block_reduce(row_sum, false);

    const float inv_sum = 1.0f / row_sum;
    for (int j = threadIdx.x; j < seq_kv; j += blockDim.x) row[j] *= inv_sum;
    if (threadIdx.x == 0) lse[blockIdx.x] = row_max + logf(row_sum);
}
// --8<-- [end:softmax]

// --8<-- [start:pv]
// One block per query row, one thread per output column d: o_id = Σ_j p_ij · v_jd.
// All threads read the same p_ij (a broadcast) and neighbouring v_jd (coalesced).
extern "C" __global__ void attention_pv(const float* __restrict__ probs, const elem_t* __restrict__ v,
                                        elem_t* __restrict__ o, int seq_q, int seq_kv) {
    const int row = blockIdx.x;                 // in [0, B·H·Sq)
    const size_t head = row / seq_q;            // which (batch, head)
    const float* p_row = probs + (size_t)row * seq_kv;
    const elem_t* v_head = v + head * seq_kv * HEAD_DIM;

    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < seq_kv; ++j) acc += p_row[j] * to_float(v_head[(size_t)j * HEAD_DIM + d]);
        o[(size_t)row * HEAD_DIM + d] = from_float<elem_t>(acc);
    }
}
// --8<-- [end:pv]
