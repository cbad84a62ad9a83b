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
// Sq × Skv floats per head (16 GiB for B4 H16 S8192), written once and read four times.
// The two matrix products are tiled through shared memory like a textbook matmul (on CUDA cores,
// in fp32): the lesson here is the algorithm, not the arithmetic.
//
// Tensors are [B, H, S, D], contiguous, K and V [B, H_kv, S, D]; blockIdx.z walks the B·H (batch, head)
// pairs. With fewer KV heads (grouped-query attention), `group` = H / H_kv query heads share one: pair p
// reads KV pair p / group.
// Causal masking is top-left aligned, as in PyTorch: query i sees keys j <= i.
#include "attention.cuh"

// --8<-- [start:scores]
// A block of TILE × THREADS_Y threads computes a TILE × TILE block of scores: 32 queries × 32 keys,
// from q and k rows it first copies into shared memory (so each global element is read once per
// block, not once per score). Thread (tx, ty) owns key tx and queries ty, ty+8, ty+16, ty+24: the
// k value it reads is reused four times, and neighbouring threads write neighbouring scores (coalesced).
#define TILE 32
#define THREADS_Y 8
#define ROWS_PER_THREAD (TILE / THREADS_Y)

__device__ void load_rows(float (*tile)[HEAD_DIM + 1], const elem_t* rows, int first, int count) {
    for (int e = threadIdx.y * blockDim.x + threadIdx.x; e < TILE * HEAD_DIM; e += blockDim.x * blockDim.y) {
        const int r = e / HEAD_DIM, d = e % HEAD_DIM;   // consecutive threads: consecutive d
        tile[r][d] = first + r < count ? to_float(rows[(size_t)(first + r) * HEAD_DIM + d]) : 0.0f;
    }
}

extern "C" __global__ void attention_scores(const elem_t* __restrict__ q, const elem_t* __restrict__ k,
                                            float* __restrict__ scores, int seq_q, int seq_kv,
                                            float scale, int causal, int group) {
    // +1 column: k_tile[tx][d] for 32 consecutive tx would otherwise all sit in one bank.
    __shared__ float q_tile[TILE][HEAD_DIM + 1], k_tile[TILE][HEAD_DIM + 1];
    const int first_q = blockIdx.y * TILE, first_k = blockIdx.x * TILE;
    load_rows(q_tile, q + (size_t)blockIdx.z * seq_q * HEAD_DIM, first_q, seq_q);
    load_rows(k_tile, k + (size_t)(blockIdx.z / group) * seq_kv * HEAD_DIM, first_k, seq_kv);
    __syncthreads();

    float dot[ROWS_PER_THREAD] = {};
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float k_value = k_tile[threadIdx.x][d];
        for (int r = 0; r < ROWS_PER_THREAD; ++r) dot[r] += q_tile[threadIdx.y + THREADS_Y * r][d] * k_value;
    }

    const int j = first_k + threadIdx.x;
    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
        const int i = first_q + threadIdx.y + THREADS_Y * r;
        if (i >= seq_q || j >= seq_kv) continue;
        const bool masked = causal && j > i;
        scores[((size_t)blockIdx.z * seq_q + i) * seq_kv + j] = masked ? -INFINITY : dot[r] * scale;
    }
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
    for (int j = threadIdx.x; j < seq_kv; j += blockDim.x) row_sum += expf(row[j] - row_max);  // exp(-inf) = 0
    row_sum = block_reduce(row_sum, false);

    const float inv_sum = 1.0f / row_sum;
    for (int j = threadIdx.x; j < seq_kv; j += blockDim.x) row[j] = expf(row[j] - row_max) * inv_sum;
    if (threadIdx.x == 0) lse[blockIdx.x] = row_max + logf(row_sum);
}
// --8<-- [end:softmax]

// --8<-- [start:pv]
// O = P·V, tiled like the scores: a block computes 32 query rows × all HEAD_DIM columns, walking
// the keys TILE at a time through shared memory. Thread (tx, ty) owns rows ty + 8r and columns
// tx + 32c; a warp reads one p value (a broadcast) and 32 consecutive v values (no bank conflict).
#define COLS_PER_THREAD (HEAD_DIM / TILE)

extern "C" __global__ void attention_pv(const float* __restrict__ probs, const elem_t* __restrict__ v,
                                        elem_t* __restrict__ o, int seq_q, int seq_kv, int group) {
    __shared__ float p_tile[TILE][TILE], v_tile[TILE][HEAD_DIM];
    const int first_q = blockIdx.x * TILE;
    const float* p_head = probs + (size_t)blockIdx.y * seq_q * seq_kv;
    const elem_t* v_head = v + (size_t)(blockIdx.y / group) * seq_kv * HEAD_DIM;
    const int thread = threadIdx.y * blockDim.x + threadIdx.x, threads = blockDim.x * blockDim.y;

    float acc[ROWS_PER_THREAD][COLS_PER_THREAD] = {};
    for (int first_k = 0; first_k < seq_kv; first_k += TILE) {
        for (int e = thread; e < TILE * TILE; e += threads) {      // P tile, zero outside the matrix
            const int r = e / TILE, c = e % TILE;
            const bool inside = first_q + r < seq_q && first_k + c < seq_kv;
            p_tile[r][c] = inside ? p_head[(size_t)(first_q + r) * seq_kv + first_k + c] : 0.0f;
        }
        for (int e = thread; e < TILE * HEAD_DIM; e += threads) {  // V tile
            const int r = e / HEAD_DIM, d = e % HEAD_DIM;
            v_tile[r][d] = first_k + r < seq_kv ? to_float(v_head[(size_t)(first_k + r) * HEAD_DIM + d]) : 0.0f;
        }
        __syncthreads();
        for (int jj = 0; jj < TILE; ++jj)
            for (int r = 0; r < ROWS_PER_THREAD; ++r)
                for (int c = 0; c < COLS_PER_THREAD; ++c)
                    acc[r][c] += p_tile[threadIdx.y + THREADS_Y * r][jj] * v_tile[jj][threadIdx.x + TILE * c];
        __syncthreads();  // before the next tile overwrites what others may still read
    }

    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
        const int i = first_q + threadIdx.y + THREADS_Y * r;
        if (i >= seq_q) continue;
        for (int c = 0; c < COLS_PER_THREAD; ++c)
            o[((size_t)blockIdx.y * seq_q + i) * HEAD_DIM + threadIdx.x + TILE * c] = from_float<elem_t>(acc[r][c]);
    }
}
// --8<-- [end:pv]
