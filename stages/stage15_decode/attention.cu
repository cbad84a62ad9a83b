// Stage 15 — decode attention over a paged KV cache: split-KV (FlashDecoding) on the tensor cores, and an
// LSE combine by the last split to finish.
//
//   O = softmax(scale · Q Kᵀ [causal among the new tokens]) V, for each sequence over its whole cache
//
// A decode step has 1 to 8 new tokens a sequence: each key and value of the cache is used by the few
// query rows of its KV head and then never again, so the step is a read of the cache, bound by memory
// bandwidth. One kernel, in two steps:
//
// 1. decode_split    one block for each (sequence, KV head, row chunk, split of the keys). Its ROWS = 16
//                    rows are the query rows that read this KV head (the group's H / H_kv heads × the Sq
//                    new tokens), zero-padded to the 16 rows of mma.sync's A operand, so K and V are read
//                    once per KV head. It walks its split's keys in tiles of BLOCK_N, each warp its own
//                    KEYS_PER_WARP keys of every tile: it copies them with cp.async through the block
//                    table into its rows of a ring of KV_STAGES tiles, and runs the online softmax on them
//                    alone (stage 3's warp-level math: S = Q·Kᵀ, P rounded to 16 bits in registers,
//                    O += P·V). A warp reads only what it copied, so the warps never wait for each other
//                    inside the loop. At the end their (max, sum, O) are merged through shared memory into
//                    the split's partial O (normalized) and LSE, or O = 0 and LSE = -inf where the split
//                    holds no key of a row. A lone split (splits = 1) writes the row's O and LSE instead.
// 2. the combine     where there are splits, the last of a (sequence, KV head, row chunk)'s to finish (a
//                    counter of arrivals says which) combines their partials, a warp per output row:
//                    O = Σ_s w_s O_s / Σ_s w_s, w_s = exp(lse_s - max lse), and the row's LSE = max + log Σ w_s.
//                    No second kernel: its launch and its wait for the first were a tenth of the time at
//                    the shortest shapes.
//
// The count, per key of a KV head (fp16 or bf16, D the head dimension):
//   memory     K and V, 2 · D · 2 bytes (512 at D = 128), read once from HBM; cp.async writes them to
//              shared memory once and ldmatrix reads them once (each key is one warp's): 2 bytes of
//              shared-memory traffic a byte of cache.
//   math       two products of the 16 padded rows, 2 · 2 · 16 · D FLOPs: 16 a byte of cache, at any D;
//              16 exponentials.
// At an H200's 4.8 TB/s that asks for 77 TFLOP/s of tensor-core math (under a tenth of its ~990 TFLOP/s
// of dense fp16) and 9.6 TB/s of shared memory (under a third of 132 SMs × 128 bytes a clock at ~2 GHz):
// the kernel stays bound by HBM with room to spare, whatever the padding costs (4 of the 16 rows are real
// at Llama-3-8B's 4 query heads a KV head and one new token).
// Bytes in flight: an SM has to keep bandwidth × latency in flight, 4.8 TB/s / 132 SMs × about 1 µs ≈
// 36 KB. The ring holds 3 tiles and keeps two in flight while the third is computed: at D = 128 a tile of
// 64 keys (4 warps) is 32 KB, a block 96 KB, an H200's SM (228 KB) holds 2 blocks: 128 KB in flight; at
// D = 64 a tile of 128 keys (8 warps) is 32 KB too, and so is the rest. (An A100's SM, 164 KB, holds one
// block.) D = 64 takes 8 warps rather than 4 warps and 4 blocks an SM: half the blocks, so that a batch of
// 32 sequences fills the GPU with one split each, no combine.
// Precision: Q enters the products as given, and scale · log2(e) multiplies the fp32 scores (stages 2 and
// 3 do the same); P is rounded to 16 bits for P·V, as FlashAttention does, which the check's tolerance
// allows for. A scaled Q rounded back to 16 bits would add an error of its own to every score.
//
// Tensors: q and o [B, H, Sq, D] contiguous; k_cache, v_cache [num_pages, page_size, H_kv, D]; block_table
// [B, max_pages] int32; seq_lens [B] int32 (the new tokens included); lse [B, H, Sq] fp32. Query row
// r of a KV head's group is head kv_head · group + r / Sq, new token r % Sq, at position
// seq_len - Sq + r % Sq, which sees keys 0 .. position: the group's rows are contiguous in q and o.
#include "mma.cuh"
#include "cp_async.cuh"
#include "swizzle.cuh"

constexpr int ROWS = 16;                              // query rows per block: mma.m16n8k16's M
constexpr int KEYS_PER_WARP = 16;                     // a warp's keys of each tile: P·V's k
constexpr int NUM_WARPS = HEAD_DIM == 64 ? 8 : 4;    // a tile of 32 KB either way
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int BLOCK_N = NUM_WARPS * KEYS_PER_WARP;    // keys per tile
constexpr int KV_STAGES = 3;                          // tiles in the ring: two load while one is computed
constexpr int MIN_BLOCKS_PER_SM = 2;                  // what an H200's SM holds (shared memory)
constexpr int ROW_BYTES = HEAD_DIM * 2;               // a key's K (or V) row; unpadded, swizzled
constexpr int CHUNKS_PER_ROW = ROW_BYTES / 16;        // 16-byte copies per row
constexpr int KV_TILE_BYTES = BLOCK_N * ROW_BYTES;
constexpr int RING_BYTES = 2 * KV_STAGES * KV_TILE_BYTES;    // the K ring, then the V ring
constexpr int SHARED_BYTES = RING_BYTES + 2 * NUM_WARPS * ROWS * 4;  // then each warp's row max and sum
constexpr int KEYS_PER_PASS = 32 / CHUNKS_PER_ROW;    // keys a warp's copies cover at a time
constexpr int COPY_PASSES = KEYS_PER_WARP / KEYS_PER_PASS;
constexpr int D_STEPS = HEAD_DIM / 16;                // k-steps of Q·Kᵀ (16 columns of d each)
constexpr int S_FRAGS = KEYS_PER_WARP / 8;            // n8 fragments of a warp's 16 × 16 scores
constexpr int O_FRAGS = HEAD_DIM / 8;                 // n8 fragments of its 16 × D output
constexpr int MERGE_STRIDE = HEAD_DIM + 8;            // floats between rows of a warp's O in the merge
static_assert(sizeof(elem_t) == 2, "ldmatrix, mma and the chunk arithmetic assume 16-bit elements");
static_assert(COPY_PASSES * KEYS_PER_PASS == KEYS_PER_WARP && KEYS_PER_WARP <= 32, "a lane looks up a key");
static_assert(NUM_WARPS * ROWS * MERGE_STRIDE * 4 <= RING_BYTES, "the merge fits in the ring");

// --8<-- [start:copies]
// Where key `key` lies in the cache: its slot among the num_pages · page_size token slots, through the
// block table (its page), and `key % page_size` (its slot in the page). Unsigned: a key is never negative,
// and an unsigned division by a number known only at run time takes fewer instructions. The table is read
// with __ldg, the read-only loads (the kernel's parameter struct cannot say __restrict__).
__device__ __forceinline__ unsigned cache_slot(const int* pages, unsigned key, unsigned page_size) {
    const unsigned page = key / page_size;
    return __ldg(pages + page) * page_size + (key - page * page_size);
}

// Lane j's key of a warp's KEYS_PER_WARP keys first_key .. : its slot, read from the block table. Keys
// past the table's row (table_keys of them) read its last entry instead; past the sequence's end the
// entry may be -1 (no page), and load_warp_keys copies nothing from such a key.
__device__ __forceinline__ unsigned lane_key_slot(const int* pages, int first_key, int table_keys, int page_size,
                                                  int lane) {
    return cache_slot(pages, min(first_key + lane % KEYS_PER_WARP, table_keys - 1), page_size);
}

// Issues a warp's copies of K and V of its keys first_key .. first_key + KEYS_PER_WARP - 1 into rows
// key_row0 .. of the swizzled tiles, lane j's `slot` that of key first_key + j (lane_key_slot): the lanes
// that copy a key's row take its slot by a shuffle, and a pass copies KEYS_PER_PASS whole rows (2 of 256
// bytes at D = 128, 4 of 128 at D = 64), contiguous in the cache. Keys at or past key_end are zero-filled
// (a copy of source size 0 reads nothing) from the cache's first row, an address that exists.
__device__ __forceinline__ void load_warp_keys(unsigned k_tile, unsigned v_tile, const elem_t* k_cache,
                                               const elem_t* v_cache, unsigned slot, int first_key, int key_end,
                                               int kv_heads, int kv_head, int key_row0, int lane) {
    const int chunk = lane % CHUNKS_PER_ROW;
#pragma unroll
    for (int pass = 0; pass < COPY_PASSES; ++pass) {
        const int key = pass * KEYS_PER_PASS + lane / CHUNKS_PER_ROW;  // of the warp's: a chunk of its row
        const unsigned key_slot = __shfl_sync(0xffffffffu, slot, key);
        const bool valid = first_key + key < key_end;
        const size_t from = valid ? ((size_t)key_slot * kv_heads + kv_head) * HEAD_DIM + chunk * 8 : 0;
        const unsigned to = swizzle<ROW_BYTES>(key_row0 + key, chunk);
        cp_async_16(k_tile + to, k_cache + from, valid);
        cp_async_16(v_tile + to, v_cache + from, valid);
    }
}
// --8<-- [end:copies]

// --8<-- [start:warp_math]
// The A operands of the block's 16 rows for the D_STEPS k-steps of Q·Kᵀ, read once from global memory
// (q_rows: the block's first row; read-only loads) into registers for the whole split; rows at or past
// `rows` are zeros.
__device__ __forceinline__ void load_q_fragments(unsigned (&q_frag)[D_STEPS][4], const elem_t* q_rows, int rows,
                                                 int lane) {
#pragma unroll
    for (int kk = 0; kk < D_STEPS; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // a[i]: row g + 8 (i % 2), columns 2t, 2t + 1 (+ 8 for i >= 2)
            const int row = lane / 4 + 8 * (i % 2), column = 16 * kk + 8 * (i / 2) + 2 * (lane % 4);
            const unsigned* pair = reinterpret_cast<const unsigned*>(q_rows + row * HEAD_DIM + column);
            q_frag[kk][i] = row < rows ? __ldg(pair) : 0u;  // columns `column` and `column + 1`
        }
    }
}

// S[16 rows × the warp's 16 keys] = Q · Kᵀ: a k-step is one ldmatrix.x4 of K (b[0], b[1] of keys 0-7,
// then of keys 8-15) and two mma. `key_row0`: the warp's first key in the tile.
__device__ __forceinline__ void warp_scores(float (&s)[S_FRAGS][4], const unsigned (&q_frag)[D_STEPS][4],
                                            unsigned k_tile, int key_row0, int lane) {
#pragma unroll
    for (int n = 0; n < S_FRAGS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D_STEPS; ++kk) {
        unsigned k_frag[4];
        ldmatrix_x4(k_frag, k_tile + swizzle<ROW_BYTES>(key_row0 + b_order_row(lane), 2 * kk + b_order_chunk(lane)));
        mma_m16n8k16<elem_t>(s[0], q_frag[kk], k_frag[0], k_frag[1]);
        mma_m16n8k16<elem_t>(s[1], q_frag[kk], k_frag[2], k_frag[3]);
    }
}

// -inf for the scores a row may not see: keys at or past key_end, and keys after the row's new token
// (rows g and g + 8 of the thread sit at position[0] and position[1]).
__device__ __forceinline__ void mask_scores(float (&s)[S_FRAGS][4], int first_key, int key_end,
                                            const int (&position)[2], int lane) {
#pragma unroll
    for (int n = 0; n < S_FRAGS; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int key = first_key + 8 * n + 2 * (lane % 4) + c % 2;
            if (key >= key_end || key > position[c / 2]) s[n][c] = -INFINITY;
        }
    }
}

// O[16 × D] += P · V over the warp's 16 keys: P's A operand straight from the registers of S (mma.cuh's
// p_as_a_operand), V's B operands by ldmatrix.trans, two d-fragments per ldmatrix.x4.
__device__ __forceinline__ void warp_pv(float (&o)[O_FRAGS][4], const float (&p)[S_FRAGS][4], unsigned v_tile,
                                        int key_row0, int lane) {
    unsigned p_frag[4];
    p_as_a_operand(p, 0, p_frag);
#pragma unroll
    for (int d16 = 0; d16 < D_STEPS; ++d16) {
        unsigned v_frag[4];
        ldmatrix_x4_trans(v_frag, v_tile + swizzle<ROW_BYTES>(key_row0 + a_order_row(lane), 2 * d16 + a_order_chunk(lane)));
        mma_m16n8k16<elem_t>(o[2 * d16], p_frag, v_frag[0], v_frag[1]);
        mma_m16n8k16<elem_t>(o[2 * d16 + 1], p_frag, v_frag[2], v_frag[3]);
    }
}
// --8<-- [end:warp_math]

// --8<-- [start:merge]
// The split's result from its warps', each over its own keys with its own running max m_w and sum l_w
// (published in max_s, sum_s). Per row: M = max_w m_w, the weights 2^((m_w - M) · scale_log2) (0 for a
// warp that saw no key, m_w = -inf), L = Σ_w weight_w · l_w, O = Σ_w weight_w · O_w / L and
// LSE = M · scale + ln L; where no warp saw a key (M = -inf, L = 0): O = 0 and LSE = -inf. The warps'
// weighted O go through o_s (the ring, free by now), rows MERGE_STRIDE floats apart: a half-warp's float2
// stores then fall in 4 rows × 8 distinct banks.
__device__ __forceinline__ float warp_weight(float warp_max, float merged_max, float scale_log2) {
    return merged_max == -INFINITY ? 0.0f : fast_exp2((warp_max - merged_max) * scale_log2);
}

__device__ __forceinline__ void write_split(const float (&o_acc)[O_FRAGS][4], const float (&row_max)[2],
                                            const float (*max_s)[ROWS], const float (*sum_s)[ROWS], float* o_s,
                                            float* o_partial, float* lse_partial, elem_t* o, float* lse,
                                            long long first_out, int rows, int splits, int split, float scale) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float scale_log2 = scale * LOG2E;
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // rows g and g + 8
        const int row = lane / 4 + 8 * r;
        float merged_max = -INFINITY, merged_sum = 0.0f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) merged_max = fmaxf(merged_max, max_s[w][row]);
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) merged_sum += warp_weight(max_s[w][row], merged_max, scale_log2) * sum_s[w][row];
        const float mine = merged_sum > 0.0f ? warp_weight(row_max[r], merged_max, scale_log2) / merged_sum : 0.0f;
        float* o_row = o_s + (warp * ROWS + row) * MERGE_STRIDE + 2 * (lane % 4);
#pragma unroll
        for (int d = 0; d < O_FRAGS; ++d)
            *reinterpret_cast<float2*>(o_row + 8 * d) = make_float2(o_acc[d][2 * r] * mine, o_acc[d][2 * r + 1] * mine);
        if (warp == 0 && lane % 4 == 0 && row < rows) {
            const float row_lse = merged_sum > 0.0f ? merged_max * scale + logf(merged_sum) : -INFINITY;
            if (splits == 1) lse[first_out + row] = row_lse;
            else lse_partial[(first_out + row) * splits + split] = row_lse;
        }
    }
    __syncthreads();
    // The sum over the warps, 4 columns a thread, rows past `rows` (the padding) not written.
    for (int e = 4 * threadIdx.x; e < ROWS * HEAD_DIM; e += 4 * NUM_THREADS) {
        const int row = e / HEAD_DIM, column = e % HEAD_DIM;
        if (row >= rows) break;
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float4 part = *reinterpret_cast<const float4*>(o_s + (w * ROWS + row) * MERGE_STRIDE + column);
            sum.x += part.x, sum.y += part.y, sum.z += part.z, sum.w += part.w;
        }
        if (splits == 1) {  // the row's O itself
            elem_t* out = o + (first_out + row) * HEAD_DIM + column;
            out[0] = from_float<elem_t>(sum.x), out[1] = from_float<elem_t>(sum.y);
            out[2] = from_float<elem_t>(sum.z), out[3] = from_float<elem_t>(sum.w);
        } else {
            *reinterpret_cast<float4*>(o_partial + ((first_out + row) * splits + split) * HEAD_DIM + column) = sum;
        }
    }
}
// --8<-- [end:merge]

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

// --8<-- [start:combine]
// One output row from its splits' partials, by one warp. Other blocks wrote most of them: they are read
// from L2 (__ldcg), where their writes are, never from this SM's L1. Lane j holds the weight of split
// first + j, and each lane takes the others' by a shuffle: no load of a partial row waits for another
// load, so the warp keeps many in flight (a walk that read each split's LSE before its row would wait
// on L2 twice a split, 33 splits in a row at B1 S65536).
__device__ __forceinline__ void combine_row(const float* o_partial, const float* lse_partial, elem_t* o, float* lse,
                                            long long row, int splits, int lane) {
    const float* lses = lse_partial + row * splits;
    const float* parts = o_partial + row * splits * HEAD_DIM;
    // EXERCISE: combine the splits' partial rows into the row's O and LSE. Split s holds
    // O_s = Σ_j p_j v_j / Σ_j p_j over its keys (in parts[s · HEAD_DIM + d]; zeros where it saw no key)
    // and lse_s = log Σ_j p_j (in lses[s]; -inf where it saw no key). Weigh each O_s by
    // exp(lse_s - max_s lse_s), divide by the weights' sum, and write o[row · HEAD_DIM + d] (each lane the
    // columns lane, lane + 32, ...) and lse[row] = max + log(sum). A row no split saw: O = 0, LSE = -inf.
    // Read them with __ldcg, and let no load wait on another: lane j computes split j's weight, the
    // others take it with __shfl_sync.
    // STUB: (void)lses; (void)parts; (void)lane;
    float m = -INFINITY;
    for (int s = lane; s < splits; s += 32) m = fmaxf(m, __ldcg(lses + s));
    m = warp_max(m);
    float acc[HEAD_DIM / 32] = {}, total = 0.0f;
    for (int first = 0; first < splits; first += 32) {
        const float lse_s = first + lane < splits ? __ldcg(lses + first + lane) : -INFINITY;
        const float weight = lse_s == -INFINITY ? 0.0f : exp2f((lse_s - m) * LOG2E);  // of split first + lane
        total += weight;
        const float* part = parts + first * HEAD_DIM + lane;
#pragma unroll 8
        for (int j = 0; j < min(32, splits - first); ++j) {
            const float w = __shfl_sync(0xffffffffu, weight, j);
#pragma unroll
            for (int e = 0; e < HEAD_DIM / 32; ++e) acc[e] += w * __ldcg(part + j * HEAD_DIM + 32 * e);
        }
    }
    total = warp_sum(total);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
#pragma unroll
    for (int e = 0; e < HEAD_DIM / 32; ++e) o[row * HEAD_DIM + lane + 32 * e] = from_float<elem_t>(acc[e] * inv);
    if (lane == 0) lse[row] = total > 0.0f ? m + logf(total) : -INFINITY;
    // END EXERCISE
}

// Whether this block is the last of its unit's `splits` blocks to have written its partials: each thread's
// writes are made visible to the whole GPU first (__threadfence), then one thread counts the block in.
// The last one sets the counter back to 0 for the next launch (a CUDA graph's next replay too).
__device__ __forceinline__ bool last_to_finish(int* arrival, int splits, int* flag_s) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *flag_s = atomicAdd(arrival, 1) == splits - 1;
    __syncthreads();
    const bool last = *flag_s;
    if (last) {
        __threadfence();  // the other blocks' partials, counted in before this block's arrival, are seen
        if (threadIdx.x == 0) *arrival = 0;
    }
    return last;
}
// --8<-- [end:combine]

// --8<-- [start:split]
// The kernel's parameters (__init__.py's DecodeParams packs them): the tensors (this file's head says their
// shapes), the splits' partial rows o_partial [B·H·Sq, splits, D] and lse_partial [B·H·Sq, splits], a
// counter of arrived splits per row chunk, and the launch's sizes and split of the keys.
struct DecodeParams {
    const elem_t *q, *k_cache, *v_cache;
    const int *block_table, *seq_lens;
    float *o_partial, *lse_partial;
    int* arrivals;
    elem_t* o;
    float* lse;
    int heads, kv_heads, seq_q, page_size, max_pages, keys_per_split, splits, chunks;
    float scale;
};

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_PER_SM)
decode_split(const __grid_constant__ DecodeParams p) {
    // [K ring: KV_STAGES tiles][V ring: KV_STAGES tiles], swizzled (tiles of 128-byte multiples), then
    // each warp's running max and sum per row; after the loop, the merge's o_s over the rings. All of it
    // dynamic, one amount: the launch's SHARED_BYTES.
    extern __shared__ __align__(SWIZZLE_BYTES) unsigned char shared_bytes[];
    float (*max_s)[ROWS] = reinterpret_cast<float (*)[ROWS]>(shared_bytes + RING_BYTES);
    float (*sum_s)[ROWS] = max_s + NUM_WARPS;
    const unsigned k_ring = shared_address(shared_bytes), v_ring = k_ring + KV_STAGES * KV_TILE_BYTES;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    // blockIdx.x walks (pair, chunk, split), split fastest: B · H_kv · chunks · splits may pass 65,535
    const int split = blockIdx.x % p.splits, chunk = (blockIdx.x / p.splits) % p.chunks;
    const int pair = blockIdx.x / p.splits / p.chunks, b = pair / p.kv_heads, kv_head = pair % p.kv_heads;
    const int group = p.heads / p.kv_heads, first_row = chunk * ROWS;
    const int rows = min(ROWS, group * p.seq_q - first_row);
    const int key_begin = split * p.keys_per_split, key_row0 = warp * KEYS_PER_WARP;  // the warp's rows of a tile
    const int* pages = p.block_table + (long long)b * p.max_pages;
    auto slot_of = [&](int tile) {  // this lane's slot of the warp's keys of `tile`
        return lane_key_slot(pages, key_begin + tile * BLOCK_N + key_row0, p.max_pages * p.page_size, p.page_size,
                             lane);
    };
    // The first tiles' entries of the block table are read before the sequence's length is known, so
    // that the two reads from memory overlap instead of following one another.
    unsigned first_slots[KV_STAGES - 1];
#pragma unroll
    for (int tile = 0; tile < KV_STAGES - 1; ++tile) first_slots[tile] = slot_of(tile);
    const int seq_len = __ldg(p.seq_lens + b);
    const int key_end = min(seq_len, key_begin + p.keys_per_split);
    const int num_tiles = key_end > key_begin ? (key_end - key_begin + BLOCK_N - 1) / BLOCK_N : 0;
    // Row r of the block is row first_row + r of the group's: row first_out + r of q, o and the LSE.
    const long long first_out = ((long long)b * p.heads + kv_head * group) * p.seq_q + first_row;
    auto load_tile = [&](int tile, unsigned slot) {  // the warp's keys of `tile`, into ring buffer tile % KV_STAGES
        const int first_key = key_begin + tile * BLOCK_N + key_row0;
        const unsigned buffer = (tile % KV_STAGES) * KV_TILE_BYTES;
        if (first_key < key_end)
            load_warp_keys(k_ring + buffer, v_ring + buffer, p.k_cache, p.v_cache, slot, first_key, key_end,
                           p.kv_heads, kv_head, key_row0, lane);
    };

    // Prologue: the first KV_STAGES - 1 tiles, each its own commit group (empty ones too, so that the
    // count of groups in flight stays uniform). Q goes to registers meanwhile.
#pragma unroll
    for (int tile = 0; tile < KV_STAGES - 1; ++tile) {
        if (tile < num_tiles) load_tile(tile, first_slots[tile]);
        cp_async_commit();
    }
    unsigned q_frag[D_STEPS][4];
    load_q_fragments(q_frag, p.q + first_out * HEAD_DIM, rows, lane);
    int position[2];  // the new token of the thread's rows g and g + 8: they see keys 0 .. position
#pragma unroll
    for (int r = 0; r < 2; ++r) position[r] = seq_len - p.seq_q + (first_row + lane / 4 + 8 * r) % p.seq_q;
    const int seen_by_all = min(key_end, seq_len - p.seq_q + 1);  // keys below it need no mask

    float o_acc[O_FRAGS][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};  // of rows g and g + 8
    const float scale_log2 = p.scale * LOG2E;
    for (int tile = 0; tile < num_tiles; ++tile) {
        cp_async_wait<KV_STAGES - 2>();  // this lane's copies of `tile` have landed ...
        __syncwarp();                    // ... and the warp's; the warp is done with tile - 1's buffer
        const int next = tile + KV_STAGES - 1;  // into that buffer
        if (next < num_tiles) load_tile(next, slot_of(next));
        cp_async_commit();

        const int first_key = key_begin + tile * BLOCK_N + key_row0;
        if (first_key >= key_end) continue;  // past the split's end: no key to add
        const unsigned buffer = (tile % KV_STAGES) * KV_TILE_BYTES;
        float s[S_FRAGS][4];
        warp_scores(s, q_frag, k_ring + buffer, key_row0, lane);
        if (first_key + KEYS_PER_WARP > seen_by_all) mask_scores(s, first_key, key_end, position, lane);
        // A row with no visible key so far keeps max = -inf, sum = 0: its p are exp2(-inf) = 0 (mma.cuh).
        online_softmax(s, o_acc, row_max, row_sum, scale_log2);
        warp_pv(o_acc, s, v_ring + buffer, key_row0, lane);
    }

    // Each warp publishes its rows' max and sum (the sum of its quad's four partial sums), then the merge.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float sum = quad_sum(row_sum[r]);
        if (lane % 4 == 0) {
            max_s[warp][lane / 4 + 8 * r] = row_max[r];
            sum_s[warp][lane / 4 + 8 * r] = sum;
        }
    }
    cp_async_wait<0>();  // no copy still writes the ring (the last groups are empty) ...
    __syncthreads();     // ... and every warp is done with it and has published its rows
    write_split(o_acc, row_max, max_s, sum_s, reinterpret_cast<float*>(shared_bytes), p.o_partial, p.lse_partial, p.o,
                p.lse, first_out, rows, p.splits, split, p.scale);

    // The unit's last split to finish combines every split's partial rows (the warps' maxes, read by now,
    // give their first slot for the flag). A lone split has written O and the LSE already.
    if (p.splits == 1 || !last_to_finish(p.arrivals + blockIdx.x / p.splits, p.splits, reinterpret_cast<int*>(max_s)))
        return;
    for (int r = warp; r < rows; r += NUM_WARPS)
        combine_row(p.o_partial, p.lse_partial, p.o, p.lse, first_out + r, p.splits, lane);
}
// --8<-- [end:split]
