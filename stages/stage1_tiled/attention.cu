// Stage 1 — FlashAttention on CUDA cores: tiled attention with an online softmax.
//
//   O = softmax(scale · Q Kᵀ) V,   lse_i = log Σ_j exp(scale · q_i · k_j),   per (batch, head)
//
// Stage 0 wrote the whole S_q × S_kv score matrix to global memory. This kernel never does. A
// block owns BLOCK_M query rows of one (batch, head); it walks over K and V in tiles of BLOCK_N
// keys, staged in shared memory, and keeps for each row only a running max, a running sum and an
// fp32 output accumulator: the *online softmax*. Extra global memory: none.
//
// What one tile costs (a block, BLOCK_M = 64 rows × BLOCK_N = 64 keys, D = HEAD_DIM):
//   FLOPs   4 · 64 · 64 · D: 2·64·64·D for the scores Q Kᵀ and as many for P V (1 MFLOP at D = 64),
//           plus 4096 exp2. About 4·D FLOPs per score against ~10 for the softmax bookkeeping.
//   global  the K and V tiles, 2 · 64 · D · 2 bytes (16 KiB at D = 64), mostly L2 hits: 64 FLOPs
//           per byte, far above the ~20 an H100 needs to keep its CUDA cores busy. Not memory-bound.
//   shared  every FMA takes its operands from shared memory. A thread that computes an 8 × 8 block
//           of results loads 8 + 8 floats for 64 FMAs: 1 float per 4 FMAs. An SM does 128 fp32
//           FMAs per clock and returns 128 bytes (32 floats) of shared memory per clock: exactly
//           4 FMAs per float, so shared memory just keeps up (register tiling is what makes it so:
//           one score per thread would need 2 floats per FMA, 8× too many).
// So the bound is the CUDA cores' fp32 FMA rate, ~67 TFLOP/s on an H100 SXM, with shared memory
// running alongside at full speed; syncs, the softmax and the tile loads take their share of it.
// Each block has only 4 warps (2 blocks per SM at D = 128), so a tile load that the block waits
// for idles the SM: the next tile's loads are issued before P · V and land while it runs. At
// D = 128 the S = Q Kᵀ half runs at most at 2/3 speed (an 8 × 4 block per thread, see below).
// Tensor cores (next stages) do far better. (Predictions and measurements: docs/notebook/stage1.md.)
//
// Tensors are [B, H, S, D], K and V [B, H_kv, S, D], contiguous (grouped-query attention: H / H_kv
// query heads read one KV head); blockIdx.z walks the B·H_kv KV (batch, head) pairs, blockIdx.y the
// gridDim.y = H / H_kv query heads of each: query pair blockIdx.z · gridDim.y + blockIdx.y, blockIdx.x
// the tiles of BLOCK_M query rows. Causal masking is top-left aligned, as in PyTorch: query i
// sees keys j <= i.
#include "attention.cuh"

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "this stage is tuned for HEAD_DIM 64 or 128");

// ---- Tile sizes and the work split ----
// (The launch, in __init__.py, uses BLOCK_M, NUM_THREADS and SHARED_BYTES: the grader checks the
// values it launches with against these.)
//
// The block's threads form a ROW_GROUPS × COL_GROUPS grid. Thread (row_group, col_group) owns
//   rows  row_group + ROW_GROUPS · r,  r < ROWS_PER_THREAD   of the Q tile, of S and of O;
//   keys  col_group + COL_GROUPS · c,  c < KEYS_PER_THREAD   of the K tile: columns of S;
//   dims  4·col_group + 4·COL_GROUPS · h, +1, +2, +3          columns of O (DIMS_PER_THREAD in all).
// So each thread computes an 8 × KEYS_PER_THREAD block of scores and an 8 × 8 block of O from
// registers. The COL_GROUPS threads of a row are neighbouring lanes of one warp: a row's max and
// sum are combined with warp shuffles, no shared memory.
constexpr int BLOCK_M = 64;                              // query rows per block
constexpr int BLOCK_N = 64;                              // keys per K/V tile
constexpr int ROW_GROUPS = 8;
constexpr int COL_GROUPS = HEAD_DIM == 64 ? 8 : 16;      // D = 128: twice the threads, same 8 × 8 of O each
constexpr int NUM_THREADS = ROW_GROUPS * COL_GROUPS;     // 64 or 128
constexpr int ROWS_PER_THREAD = BLOCK_M / ROW_GROUPS;    // 8
constexpr int KEYS_PER_THREAD = BLOCK_N / COL_GROUPS;    // 8 (D = 64) or 4 (D = 128)
constexpr int DIMS_PER_THREAD = HEAD_DIM / COL_GROUPS;   // 8
static_assert(DIMS_PER_THREAD % 4 == 0 && 32 % COL_GROUPS == 0, "float4 columns, rows inside a warp");

// Shared memory holds fp32 tiles (converted once on load, not in the inner loops). Row strides,
// in floats, chosen so that the inner loops' loads hit 32 different banks:
constexpr int Q_STRIDE = HEAD_DIM;             // read as broadcasts (a row's threads read the same float4)
constexpr int K_STRIDE = HEAD_DIM + 4;         // 8 threads read float4s of 8 consecutive keys: pad by 4
constexpr int V_STRIDE = HEAD_DIM;             // threads read consecutive float4s of one row
constexpr int P_STRIDE = BLOCK_N + COL_GROUPS; // a warp writes P to 32 / COL_GROUPS rows at once: shift each
                                               // row by COL_GROUPS banks so that they do not collide
constexpr int K_FLOATS = BLOCK_N * K_STRIDE, P_FLOATS = BLOCK_M * P_STRIDE;
constexpr int KP_FLOATS = K_FLOATS > P_FLOATS ? K_FLOATS : P_FLOATS;  // K and P share one buffer
constexpr int SHARED_FLOATS = BLOCK_M * Q_STRIDE + KP_FLOATS + BLOCK_N * V_STRIDE;
constexpr int SHARED_BYTES = SHARED_FLOATS * sizeof(float);
// = 12800 floats (50 KiB) at D = 64, 24832 (97 KiB) at D = 128: fits the 99 KiB of sm_86/sm_89.

// Scores are kept in log2 units: s = (q · k) · scale · log2(e), so that exp(x) = exp2(x · log2 e)
// becomes a bare exp2f (one MUFU.EX2 instruction). The max, the sum and the output do not care
// which base is used as long as it is used everywhere; only the LSE converts back (× ln 2).
constexpr float LN2 = 0.6931471805599453f;

__device__ __forceinline__ int tile_row(int row_group, int r) { return row_group + ROW_GROUPS * r; }
__device__ __forceinline__ int tile_key(int col_group, int c) { return col_group + COL_GROUPS * c; }
__device__ __forceinline__ int tile_dim(int col_group, int h) { return 4 * col_group + 4 * COL_GROUPS * h; }

// acc + a · b over the 4 lanes of a float4, as 4 fused multiply-adds.
__device__ __forceinline__ float fma4(float4 a, float4 b, float acc) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    return fmaf(a.w, b.w, acc);
}

__device__ __forceinline__ float component(float4 a, int i) {  // i is a compile-time constant
    return i == 0 ? a.x : i == 1 ? a.y : i == 2 ? a.z : a.w;
}

// --8<-- [start:load_tiles]
// Tiles come from global memory in two steps, so that a load can be in flight while the thread
// computes. fetch_tile issues the loads into registers: 16 bytes (8 elements) at a time, the
// widest load there is, neighbouring threads taking neighbouring 16-byte pieces, so that a warp
// reads 512 contiguous bytes. store_tile, later, converts the elements to floats and writes them
// to a shared tile (row stride STRIDE). In between, the loads take their ~1 µs from L2 while the
// thread works: the main loop fetches the next K and V tiles before P · V and stores them after it.
// Rows at or past `valid_rows` (the end of the sequence) are not read but filled with zeros:
// their scores are masked, but 0 × garbage could be NaN in P · V. (8 neighbouring threads' float4
// stores land 8 floats apart and span 64 floats: a 2-way bank conflict, cheap once per tile.)
template <int ROWS>
struct TileInFlight {  // one thread's share of a [ROWS, HEAD_DIM] tile, as loaded
    static constexpr int PER_LOAD = 16 / sizeof(elem_t);  // 8 elements
    static constexpr int LOADS_PER_ROW = HEAD_DIM / PER_LOAD;
    static constexpr int LOADS_PER_THREAD = ROWS * LOADS_PER_ROW / NUM_THREADS;
    static constexpr int ROWS_PER_LOAD = NUM_THREADS / LOADS_PER_ROW;  // piece i + 1 is this many rows below piece i
    static_assert(ROWS * LOADS_PER_ROW % NUM_THREADS == 0, "the threads split the tile evenly");
    uint4 piece[LOADS_PER_THREAD];
    __device__ static int first_row() { return threadIdx.x / LOADS_PER_ROW; }
    __device__ static int col() { return threadIdx.x % LOADS_PER_ROW * PER_LOAD; }
};

template <int ROWS>
__device__ __forceinline__ void fetch_tile(TileInFlight<ROWS>& t, const elem_t* __restrict__ src, int valid_rows) {
    using Tile = TileInFlight<ROWS>;
    // One pointer for all the pieces: piece i is a constant offset from it, which the load
    // instruction carries (no 64-bit address per piece to compute and keep in registers).
    const uint4* from = reinterpret_cast<const uint4*>(src + Tile::first_row() * HEAD_DIM + Tile::col());
#pragma unroll
    for (int i = 0; i < Tile::LOADS_PER_THREAD; ++i)
        t.piece[i] = Tile::first_row() + i * Tile::ROWS_PER_LOAD < valid_rows
                         ? from[i * Tile::ROWS_PER_LOAD * HEAD_DIM / Tile::PER_LOAD]
                         : make_uint4(0, 0, 0, 0);  // the bits of 0.0 in fp16 and bf16
}

template <int ROWS, int STRIDE>
__device__ __forceinline__ void store_tile(float* tile, const TileInFlight<ROWS>& t) {
    using Tile = TileInFlight<ROWS>;
#pragma unroll
    for (int i = 0; i < Tile::LOADS_PER_THREAD; ++i) {
        const elem_t* e = reinterpret_cast<const elem_t*>(&t.piece[i]);
        float* dst = tile + (Tile::first_row() + i * Tile::ROWS_PER_LOAD) * STRIDE + Tile::col();
        *reinterpret_cast<float4*>(dst) = make_float4(to_float(e[0]), to_float(e[1]), to_float(e[2]), to_float(e[3]));
        *reinterpret_cast<float4*>(dst + 4) = make_float4(to_float(e[4]), to_float(e[5]), to_float(e[6]), to_float(e[7]));
    }
}

// Q is loaded once, with nothing to overlap: fetch and store at once.
template <int ROWS, int STRIDE>
__device__ __forceinline__ void load_tile(float* tile, const elem_t* __restrict__ src, int valid_rows) {
    TileInFlight<ROWS> t;
    fetch_tile(t, src, valid_rows);
    store_tile<ROWS, STRIDE>(tile, t);
}
// --8<-- [end:load_tiles]

// s[r][c] = q_row(r) · k_key(c): a register-tiled matrix product. Per step of 4 dims a thread loads
// KEYS_PER_THREAD float4s of K and ROWS_PER_THREAD float4s of Q and does 4 · 8 · KEYS_PER_THREAD FMAs.
__device__ __forceinline__ void compute_scores(float (&s)[ROWS_PER_THREAD][KEYS_PER_THREAD],
                                               const float* q_tile, const float* k_tile,
                                               int row_group, int col_group) {
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; ++r)
#pragma unroll
        for (int c = 0; c < KEYS_PER_THREAD; ++c) s[r][c] = 0.0f;

#pragma unroll 2
    for (int d = 0; d < HEAD_DIM; d += 4) {
        float4 k4[KEYS_PER_THREAD];
#pragma unroll
        for (int c = 0; c < KEYS_PER_THREAD; ++c)
            k4[c] = *reinterpret_cast<const float4*>(k_tile + tile_key(col_group, c) * K_STRIDE + d);
#pragma unroll
        for (int r = 0; r < ROWS_PER_THREAD; ++r) {
            const float4 q4 = *reinterpret_cast<const float4*>(q_tile + tile_row(row_group, r) * Q_STRIDE + d);
#pragma unroll
            for (int c = 0; c < KEYS_PER_THREAD; ++c) s[r][c] = fma4(q4, k4[c], s[r][c]);
        }
    }
}

// Scale the scores into log2 units, and set masked ones to -inf (exp2(-inf) = 0 drops them):
// keys past the end of the sequence (the last tile may be partial) and, if causal, keys j > i.
__device__ __forceinline__ void scale_and_mask(float (&s)[ROWS_PER_THREAD][KEYS_PER_THREAD], float score_scale,
                                               int first_row, int kv_start, int seq_kv, int causal,
                                               int row_group, int col_group) {
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
        const int i = first_row + tile_row(row_group, r);
#pragma unroll
        for (int c = 0; c < KEYS_PER_THREAD; ++c) {
            const int j = kv_start + tile_key(col_group, c);
            const bool masked = j >= seq_kv || (causal && j > i);
            s[r][c] = masked ? -INFINITY : s[r][c] * score_scale;
        }
    }
}

// --8<-- [start:online_softmax]
// The largest score of one row of the tile. Each thread takes the max of its own keys; the
// COL_GROUPS threads that share the row (neighbouring lanes) then swap maxima with butterfly
// shuffles, and all of them end up holding the row's max.
__device__ __forceinline__ float tile_row_max(const float (&scores)[KEYS_PER_THREAD]) {
    float m = scores[0];
#pragma unroll
    for (int c = 1; c < KEYS_PER_THREAD; ++c) m = fmaxf(m, scores[c]);
#pragma unroll
    for (int offset = COL_GROUPS / 2; offset > 0; offset /= 2)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    return m;
}

// Online softmax: fold one tile of scores into the running state of each of the thread's rows,
//   row_max  m = the largest score seen so far,
//   row_sum  l = Σ exp2(s_j - m) over the keys seen so far (only this thread's keys: see write_output),
//   acc      o = Σ exp2(s_j - m) · v_j over the keys seen so far (this thread's columns of O),
// and turn the tile's scores into p_j = exp2(s_j - m) for P · V.
// l and o are sums of terms relative to m. When this tile raises the max from m_old to m_new,
// every term so far must become exp2(s - m_new) = exp2(s - m_old) · exp2(m_old - m_new): one
// factor, rescale = exp2(m_old - m_new) <= 1, for the whole sum and the whole row of o. Nothing
// is ever larger than 1 · (number of keys), whatever the scores: no overflow.
__device__ __forceinline__ void online_softmax(float (&s)[ROWS_PER_THREAD][KEYS_PER_THREAD],
                                               float (&row_max)[ROWS_PER_THREAD], float (&row_sum)[ROWS_PER_THREAD],
                                               float (&acc)[ROWS_PER_THREAD][DIMS_PER_THREAD]) {
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
        // EXERCISE: make the softmax online. Raise the running max row_max[r] to include this
        // tile (tile_row_max(s[r]) is the tile's max for row r), scale row_sum[r] and the row's
        // accumulators acc[r][...] by exp2f(old max - new max), then turn each score into
        // exp2f(score - new max) and add it to row_sum[r]. The stub ignores the max: it is
        // right for small scores, and overflows to inf once a score reaches 128.
        // STUB: row_max[r] = 0.0f;
        // STUB: for (int c = 0; c < KEYS_PER_THREAD; ++c) { s[r][c] = exp2f(s[r][c]); row_sum[r] += s[r][c]; }
        const float new_max = fmaxf(row_max[r], tile_row_max(s[r]));
        // Every row sees key 0 in the first tile, so new_max is finite from then on, and on the
        // first tile rescale = exp2(-inf - new_max) = 0 wipes the initial zeros: no special case.
        const float rescale = exp2f(row_max[r] - new_max);
        row_max[r] = new_max;
        row_sum[r] *= rescale;
#pragma unroll
        for (int d = 0; d < DIMS_PER_THREAD; ++d) acc[r][d] *= rescale;
#pragma unroll
        for (int c = 0; c < KEYS_PER_THREAD; ++c) {
            s[r][c] = exp2f(s[r][c] - new_max);  // masked: exp2(-inf) = 0
            row_sum[r] += s[r][c];
        }
        // END EXERCISE
    }
}
// --8<-- [end:online_softmax]

// P goes through shared memory: P · V needs, for each row, the probabilities of all BLOCK_N keys,
// and each thread holds only KEYS_PER_THREAD of them.
__device__ __forceinline__ void store_probabilities(float* p_tile, const float (&p)[ROWS_PER_THREAD][KEYS_PER_THREAD],
                                                    int row_group, int col_group) {
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; ++r)
#pragma unroll
        for (int c = 0; c < KEYS_PER_THREAD; ++c)
            p_tile[tile_row(row_group, r) * P_STRIDE + tile_key(col_group, c)] = p[r][c];
}

// acc[r][d] += Σ_j p[row(r)][j] · v[j][dim(d)]: the same register tiling as the scores. Per 4 keys
// a thread loads ROWS_PER_THREAD float4s of P and 4 · DIMS_PER_THREAD / 4 float4s of V, and does
// 4 · 8 · 8 FMAs.
__device__ __forceinline__ void accumulate_pv(float (&acc)[ROWS_PER_THREAD][DIMS_PER_THREAD],
                                              const float* p_tile, const float* v_tile,
                                              int row_group, int col_group) {
#pragma unroll 2
    for (int j = 0; j < BLOCK_N; j += 4) {
        float4 p4[ROWS_PER_THREAD];
#pragma unroll
        for (int r = 0; r < ROWS_PER_THREAD; ++r)
            p4[r] = *reinterpret_cast<const float4*>(p_tile + tile_row(row_group, r) * P_STRIDE + j);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
            float v_row[DIMS_PER_THREAD];
#pragma unroll
            for (int h = 0; h < DIMS_PER_THREAD / 4; ++h) {
                const float4 v4 = *reinterpret_cast<const float4*>(v_tile + (j + jj) * V_STRIDE + tile_dim(col_group, h));
                v_row[4 * h] = v4.x, v_row[4 * h + 1] = v4.y, v_row[4 * h + 2] = v4.z, v_row[4 * h + 3] = v4.w;
            }
#pragma unroll
            for (int r = 0; r < ROWS_PER_THREAD; ++r) {
                const float p = component(p4[r], jj);
#pragma unroll
                for (int d = 0; d < DIMS_PER_THREAD; ++d) acc[r][d] = fmaf(p, v_row[d], acc[r][d]);
            }
        }
    }
}

// --8<-- [start:write_output]
// After the last tile: O = o / l and LSE = log Σ exp = m · ln 2 + log(l) (m is in log2 units).
// Each thread's row_sum covers only its own keys; every thread of the row rescaled its part by
// the same factors (they share row_max), so the parts add up to the row's l: one shuffle
// reduction here instead of one per tile. Rows past the end of the sequence are not written.
__device__ __forceinline__ void write_output(elem_t* o_head, float* lse_head, int seq_q, int first_row,
                                             const float (&acc)[ROWS_PER_THREAD][DIMS_PER_THREAD],
                                             const float (&row_max)[ROWS_PER_THREAD], const float (&row_sum)[ROWS_PER_THREAD],
                                             int row_group, int col_group) {
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
        float total = row_sum[r];
#pragma unroll
        for (int offset = COL_GROUPS / 2; offset > 0; offset /= 2)  // all lanes, before any `if`
            total += __shfl_xor_sync(0xffffffffu, total, offset);

        const int i = first_row + tile_row(row_group, r);
        if (i >= seq_q) continue;
        const float inv_total = 1.0f / total;  // total >= 1: the max's own term is exp2(0)
        elem_t* o_row = o_head + (size_t)i * HEAD_DIM;
#pragma unroll
        for (int h = 0; h < DIMS_PER_THREAD / 4; ++h) {
            uint2 packed;  // 4 elements, one 8-byte store
            elem_t* e = reinterpret_cast<elem_t*>(&packed);
#pragma unroll
            for (int x = 0; x < 4; ++x) e[x] = from_float<elem_t>(acc[r][4 * h + x] * inv_total);
            *reinterpret_cast<uint2*>(o_row + tile_dim(col_group, h)) = packed;
        }
        if (col_group == 0) lse_head[i] = row_max[r] * LN2 + logf(total);
    }
}
// --8<-- [end:write_output]

// One block: BLOCK_M query rows of one (batch, head). grid = (ceil(S_q / BLOCK_M), H / H_kv, B · H_kv),
// NUM_THREADS threads, SHARED_BYTES of dynamic shared memory.
extern "C" __global__ void __launch_bounds__(NUM_THREADS)
attention_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
              elem_t* __restrict__ o, float* __restrict__ lse, int seq_q, int seq_kv, float scale, int causal) {
    extern __shared__ __align__(16) float shared[];
    float* q_tile = shared;                       // [BLOCK_M][Q_STRIDE]
    float* k_tile = q_tile + BLOCK_M * Q_STRIDE;  // [BLOCK_N][K_STRIDE]
    float* p_tile = k_tile;                       // [BLOCK_M][P_STRIDE]: K is dead once the scores exist
    float* v_tile = k_tile + KP_FLOATS;           // [BLOCK_N][V_STRIDE]

    const size_t head = (size_t)blockIdx.z * gridDim.y + blockIdx.y;  // which query (batch, head)
    const int first_row = blockIdx.x * BLOCK_M;
    const size_t kv_head = blockIdx.z;            // the KV pair it reads, shared by gridDim.y query heads
    const elem_t* k_head = k + kv_head * seq_kv * HEAD_DIM;
    const elem_t* v_head = v + kv_head * seq_kv * HEAD_DIM;
    const int row_group = threadIdx.x / COL_GROUPS, col_group = threadIdx.x % COL_GROUPS;

    load_tile<BLOCK_M, Q_STRIDE>(q_tile, q + (head * seq_q + first_row) * HEAD_DIM, seq_q - first_row);

    float acc[ROWS_PER_THREAD][DIMS_PER_THREAD];
    float row_max[ROWS_PER_THREAD], row_sum[ROWS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < ROWS_PER_THREAD; ++r) {
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
#pragma unroll
        for (int d = 0; d < DIMS_PER_THREAD; ++d) acc[r][d] = 0.0f;
    }

    const float score_scale = scale * LOG2E;
    // Causal: the block's last row, first_row + BLOCK_M - 1, sees no key beyond itself, so the key
    // tiles from first_row + BLOCK_M on are fully masked: skip them (about half the work).
    const int kv_end = (causal && first_row + BLOCK_M < seq_kv) ? first_row + BLOCK_M : seq_kv;
    TileInFlight<BLOCK_N> k_next, v_next;  // the K and V tiles on their way from global memory
    fetch_tile(k_next, k_head, seq_kv);
    fetch_tile(v_next, v_head, seq_kv);
    for (int kv_start = 0; kv_start < kv_end; kv_start += BLOCK_N) {
        __syncthreads();  // the previous tile's P · V is done with p_tile (= k_tile) and v_tile
        store_tile<BLOCK_N, K_STRIDE>(k_tile, k_next);
        store_tile<BLOCK_N, V_STRIDE>(v_tile, v_next);
        __syncthreads();  // K and V (and, the first time, Q) are in shared memory

        float s[ROWS_PER_THREAD][KEYS_PER_THREAD];
        compute_scores(s, q_tile, k_tile, row_group, col_group);
        scale_and_mask(s, score_scale, first_row, kv_start, seq_kv, causal, row_group, col_group);
        online_softmax(s, row_max, row_sum, acc);

        __syncthreads();  // every thread is done reading k_tile: P may overwrite it
        store_probabilities(p_tile, s, row_group, col_group);
        __syncthreads();  // the whole P tile is written

        // The next K and V tiles load while P · V runs (registers are plentiful here, scarce in the
        // scores). After the last tile there is none to load: 0 rows, not an `if`, which would keep
        // these registers' old values alive through the scores of the next tile.
        const int next = kv_start + BLOCK_N, next_rows = next < kv_end ? seq_kv - next : 0;
        fetch_tile(k_next, k_head + (size_t)next * HEAD_DIM, next_rows);
        fetch_tile(v_next, v_head + (size_t)next * HEAD_DIM, next_rows);
        accumulate_pv(acc, p_tile, v_tile, row_group, col_group);
    }

    write_output(o + head * seq_q * HEAD_DIM, lse + head * seq_q, seq_q, first_row, acc, row_max, row_sum,
                 row_group, col_group);
}
