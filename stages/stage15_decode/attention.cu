// Stage 15 — decode attention over a paged KV cache: split-KV (FlashDecoding) and an LSE combine.
//
//   O = softmax(scale · Q Kᵀ [causal among the new tokens]) V, for each sequence over its whole cache
//
// A decode step has 1 to 8 new tokens a sequence: each key and value of the cache is used by the few
// query rows of its KV head and then never again, so the step is a read of the cache, bound by memory
// bandwidth, not by arithmetic. Two kernels:
//
// 1. decode_split    one block for each (sequence, KV head, row chunk, split of the keys). Its rows are the
//                    query rows that read this KV head, packed (the group's H / H_kv heads × the Sq new
//                    tokens, up to ROWS of them), so K and V are read once per KV head, not once per query
//                    head. It walks its split's keys in tiles of BLOCK_N, each key found through the block
//                    table (page, slot) and read with 16-byte loads; the online softmax runs in fp32; it
//                    writes its rows' partial O (normalized) and partial LSE, or O = 0 and LSE = -inf where
//                    the split holds no key of the sequence.
// 2. decode_combine  one warp per output row: O = Σ_s w_s O_s / Σ_s w_s, w_s = exp(lse_s - max lse), and
//                    the row's LSE = max + log Σ w_s.
//
// The launch picks the number of splits so that B · H_kv · splits blocks fill the SMs a few times over:
// a batch of short sequences needs few splits, one long sequence needs many.
//
// Tensors: q and o [B, H, Sq, D] contiguous; k_cache, v_cache [num_pages, page_size, H_kv, D]; block_table
// [B, max_pages] int32; seq_lens [B] int32 (the new tokens included); lse [B, H, Sq] fp32. Query row
// r of a KV head's group is head kv_head · group + r / Sq, new token r % Sq, at position
// seq_len - Sq + r % Sq, which sees keys 0 .. position. The products run on CUDA cores in fp32: with a few
// rows per key, the tensor cores would have little to do (the lesson says why).
#include "attention.cuh"

#define BLOCK_N 64                                 // keys per tile
#define ROWS 16                                    // query rows per block (a group's heads × the new tokens)
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / 32)
#define VEC 8                                      // elements per 16-byte load
#define KV_STRIDE (HEAD_DIM + VEC)                 // a K/V row in shared memory, padded by 16 bytes
#define COL_GROUPS (HEAD_DIM / VEC)                // 16-byte columns of a row
#define ROW_GROUPS (NUM_THREADS / COL_GROUPS)      // P·V: threads per column, each for ROWS / ROW_GROUPS rows
#define PV_ROWS (ROWS / ROW_GROUPS)
#define LOADS (BLOCK_N * COL_GROUPS / NUM_THREADS) // 16-byte loads of K (and of V) per thread per tile
#define SCORE_ROWS (ROWS * BLOCK_N / NUM_THREADS)  // scores per thread per tile: one key, rows r0, r0 + 2, ...
#define SCORE_ROW_STEP (NUM_THREADS / BLOCK_N)
#define SOFTMAX_ROWS (ROWS / NUM_WARPS)            // rows per warp in the softmax
#define COMBINE_ROWS 4                             // decode_combine: output rows per block, a warp each
#define COMBINE_THREADS (COMBINE_ROWS * 32)
#define LN2 0.6931471805599453f

static_assert(LOADS * NUM_THREADS == BLOCK_N * COL_GROUPS, "K/V tile loads split evenly");
static_assert(PV_ROWS * ROW_GROUPS == ROWS && SCORE_ROWS * NUM_THREADS == ROWS * BLOCK_N, "rows split evenly");
static_assert(BLOCK_N == 64 && SOFTMAX_ROWS * NUM_WARPS == ROWS, "the softmax: two keys a lane");

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

__device__ __forceinline__ void unpack(const uint4& packed, float (&out)[VEC]) {
    const elem_t* e = reinterpret_cast<const elem_t*>(&packed);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float(e[i]);
}

// --8<-- [start:split]
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
decode_split(const elem_t* __restrict__ q, const elem_t* __restrict__ k_cache, const elem_t* __restrict__ v_cache,
             const int* __restrict__ block_table, const int* __restrict__ seq_lens, float* __restrict__ o_partial,
             float* __restrict__ lse_partial, int heads, int kv_heads, int seq_q, int page_size, int max_pages,
             int keys_per_split, int splits, int chunks, float scale) {
    __shared__ __align__(16) float q_s[ROWS][HEAD_DIM];          // the rows' queries, times scale · log2(e)
    __shared__ __align__(16) elem_t k_s[BLOCK_N][KV_STRIDE], v_s[BLOCK_N][KV_STRIDE];
    __shared__ float p_s[ROWS][BLOCK_N];                          // scores, then probabilities
    __shared__ float m_s[ROWS], l_s[ROWS], alpha_s[ROWS];         // running max (log2 units), sum, rescale

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // blockIdx.x walks (pair, chunk, split), split fastest: B · H_kv · chunks · splits may pass 65,535
    const int split = blockIdx.x % splits, chunk = (blockIdx.x / splits) % chunks;
    const int pair = blockIdx.x / splits / chunks, b = pair / kv_heads, kv_head = pair % kv_heads;
    const int group = heads / kv_heads, first_row = chunk * ROWS;
    const int rows = min(ROWS, group * seq_q - first_row);
    const int seq_len = seq_lens[b];
    const int key_begin = split * keys_per_split, key_end = min(seq_len, key_begin + keys_per_split);
    const int* pages = block_table + (long long)b * max_pages;

    // Query row r: head kv_head · group + (first_row + r) / seq_q, new token (first_row + r) % seq_q.
    auto out_row = [&](int r) {
        const int row = first_row + r;
        return ((long long)b * heads + kv_head * group + row / seq_q) * seq_q + row % seq_q;
    };
    const float scale_log2 = scale * LOG2E;
    for (int e = tid; e < ROWS * HEAD_DIM; e += NUM_THREADS) {
        const int r = e / HEAD_DIM, d = e % HEAD_DIM;
        q_s[r][d] = r < rows ? to_float(q[out_row(r) * HEAD_DIM + d]) * scale_log2 : 0.0f;
    }
    if (tid < ROWS) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }
    __syncthreads();

    const int col = tid % COL_GROUPS, row_group = tid / COL_GROUPS;  // P·V: columns col·VEC.., rows row_group + ROW_GROUPS·j
    float acc[PV_ROWS][VEC] = {};

    for (int tile = key_begin; tile < key_end; tile += BLOCK_N) {
        // K and V of keys tile .. tile + BLOCK_N - 1 through the block table; keys past the split's end
        // (or the sequence's) are never read: zeros, and their scores are masked below.
        uint4 k_regs[LOADS], v_regs[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int idx = tid + u * NUM_THREADS, n = idx / COL_GROUPS, c = idx % COL_GROUPS, key = tile + n;
            k_regs[u] = v_regs[u] = make_uint4(0, 0, 0, 0);
            if (key < key_end) {
                const long long page = pages[key / page_size];
                const long long at = ((page * page_size + key % page_size) * kv_heads + kv_head) * HEAD_DIM + c * VEC;
                k_regs[u] = *reinterpret_cast<const uint4*>(k_cache + at);
                v_regs[u] = *reinterpret_cast<const uint4*>(v_cache + at);
            }
        }
        __syncthreads();  // every thread is done with the previous tile's k_s, v_s and p_s
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int idx = tid + u * NUM_THREADS, n = idx / COL_GROUPS, c = idx % COL_GROUPS;
            *reinterpret_cast<uint4*>(&k_s[n][c * VEC]) = k_regs[u];
            *reinterpret_cast<uint4*>(&v_s[n][c * VEC]) = v_regs[u];
        }
        __syncthreads();

        // Scores: thread tid takes key n = tid % BLOCK_N and rows r0, r0 + SCORE_ROW_STEP, ... (r0 is the
        // same across a warp, so the row tests do not diverge).
        {
            const int n = tid % BLOCK_N, r0 = tid / BLOCK_N, key = tile + n;
            float s[SCORE_ROWS] = {};
#pragma unroll
            for (int d = 0; d < HEAD_DIM; d += VEC) {
                float kf[VEC];
                unpack(*reinterpret_cast<const uint4*>(&k_s[n][d]), kf);
#pragma unroll
                for (int j = 0; j < SCORE_ROWS; ++j) {
                    const int r = r0 + SCORE_ROW_STEP * j;
                    if (r >= rows) continue;
                    const float4 qa = *reinterpret_cast<const float4*>(&q_s[r][d]);
                    const float4 qb = *reinterpret_cast<const float4*>(&q_s[r][d + 4]);
                    s[j] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3]
                          + qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                }
            }
#pragma unroll
            for (int j = 0; j < SCORE_ROWS; ++j) {
                const int r = r0 + SCORE_ROW_STEP * j;
                const int position = seq_len - seq_q + (first_row + r) % seq_q;  // the row's new token
                const bool visible = r < rows && key < key_end && key <= position;
                p_s[r][n] = visible ? s[j] : -INFINITY;
            }
        }
        __syncthreads();

        // Online softmax, a warp per row, two keys a lane. A row with no visible key so far keeps
        // m = -inf, l = 0: its probabilities are 0 (never exp(-inf - -inf)).
#pragma unroll
        for (int j = 0; j < SOFTMAX_ROWS; ++j) {
            const int r = warp * SOFTMAX_ROWS + j;
            if (r >= rows) break;
            const float x0 = p_s[r][lane], x1 = p_s[r][lane + 32];
            const float m_old = m_s[r], m_new = fmaxf(m_old, warp_max(fmaxf(x0, x1)));
            const float p0 = m_new == -INFINITY ? 0.0f : exp2f(x0 - m_new);
            const float p1 = m_new == -INFINITY ? 0.0f : exp2f(x1 - m_new);
            const float sum = warp_sum(p0 + p1);
            p_s[r][lane] = p0;
            p_s[r][lane + 32] = p1;
            __syncwarp();
            if (lane == 0) {
                const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_old - m_new);
                alpha_s[r] = alpha;
                l_s[r] = l_s[r] * alpha + sum;
                m_s[r] = m_new;
            }
        }
        __syncthreads();

        // O = O · alpha + P · V, each thread VEC columns of PV_ROWS rows.
#pragma unroll
        for (int j = 0; j < PV_ROWS; ++j) {
            const int r = row_group + ROW_GROUPS * j;
            const float alpha = r < rows ? alpha_s[r] : 0.0f;
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[j][e] *= alpha;
        }
#pragma unroll 4
        for (int n = 0; n < BLOCK_N; ++n) {
            float vf[VEC];
            unpack(*reinterpret_cast<const uint4*>(&v_s[n][col * VEC]), vf);
#pragma unroll
            for (int j = 0; j < PV_ROWS; ++j) {
                const int r = row_group + ROW_GROUPS * j;
                const float p = r < rows ? p_s[r][n] : 0.0f;
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[j][e] += p * vf[e];
            }
        }
    }

    // The split's partial O (divided by its own sum) and LSE (natural log); a split that saw no key of
    // the row writes O = 0 and LSE = -inf, which the combine weighs 0.
#pragma unroll
    for (int j = 0; j < PV_ROWS; ++j) {
        const int r = row_group + ROW_GROUPS * j;
        if (r >= rows) continue;
        const long long at = out_row(r) * splits + split;
        const float l = l_s[r], inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* out = o_partial + at * HEAD_DIM + col * VEC;
        *reinterpret_cast<float4*>(out) = make_float4(acc[j][0] * inv, acc[j][1] * inv, acc[j][2] * inv, acc[j][3] * inv);
        *reinterpret_cast<float4*>(out + 4) = make_float4(acc[j][4] * inv, acc[j][5] * inv, acc[j][6] * inv, acc[j][7] * inv);
        if (col == 0) lse_partial[at] = l > 0.0f ? (m_s[r] + log2f(l)) * LN2 : -INFINITY;
    }
}
// --8<-- [end:split]

// --8<-- [start:combine]
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
decode_combine(const float* __restrict__ o_partial, const float* __restrict__ lse_partial, elem_t* __restrict__ o,
               float* __restrict__ lse, int rows, int splits) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * COMBINE_ROWS + threadIdx.x / 32;
    if (row >= rows) return;
    const float* lses = lse_partial + row * splits;
    const float* parts = o_partial + row * splits * HEAD_DIM;
    // EXERCISE: combine the splits' partial rows into the row's O and LSE. Split s holds
    // O_s = Σ_j p_j v_j / Σ_j p_j over its keys (in parts[s · HEAD_DIM + d]) and lse_s = log Σ_j p_j
    // (in lses[s]; -inf where it saw no key). Weigh each O_s by exp(lse_s - max_s lse_s), divide by
    // the weights' sum, and write o[row · HEAD_DIM + d] (each lane the columns lane, lane + 32, ...)
    // and lse[row] = max + log(sum). A row no split saw: O = 0, LSE = -inf.
    // STUB: (void)lses; (void)parts; (void)lane;
    float m = -INFINITY;
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, lses[s]);
    m = warp_max(m);
    float acc[HEAD_DIM / 32] = {}, total = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float w = lses[s] == -INFINITY ? 0.0f : exp2f((lses[s] - m) * LOG2E);
        total += w;
        if (w == 0.0f) continue;
#pragma unroll
        for (int e = 0; e < HEAD_DIM / 32; ++e) acc[e] += w * parts[s * HEAD_DIM + lane + 32 * e];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma unroll
    for (int e = 0; e < HEAD_DIM / 32; ++e) o[row * HEAD_DIM + lane + 32 * e] = from_float<elem_t>(acc[e] * inv);
    if (lane == 0) lse[row] = total > 0.0f ? m + logf(total) : -INFINITY;
    // END EXERCISE
}
// --8<-- [end:combine]
