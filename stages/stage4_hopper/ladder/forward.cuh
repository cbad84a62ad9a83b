// What the three lower rungs of stage 4's ladder share (wgmma.cu, tma.cu, warp_specialized.cu).
//
// Each computes what attention.cu computes -- O and the LSE of every query row, causal or not, any
// lengths, grouped-query heads, O at any strides -- on attention.cu's tiles: 128 query rows per block,
// K/V tiles of BLOCK_N keys (192 at D = 64, 128 at D = 128), laid out in shared memory as TMA's
// 128-byte swizzle lays them (tma.cuh's load_tile), multiplied by two warpgroups of 64 query rows
// each with stage 4's wgmma products (wgmma_attention.cuh: the same instructions, as templates).
// They differ in how the tiles get into shared memory and in who waits for whom:
//   wgmma.cu             every thread copies with cp.async; the block syncs between K/V tiles
//   tma.cu               one thread copies with TMA, tiles land on mbarriers; the block syncs between tiles
//   warp_specialized.cu  a producer warpgroup copies, two consumer warpgroups compute: mbarriers both ways
// All three are one block per query tile, and in each a warpgroup waits for every product before it
// goes on: attention.cu adds the persistent grid, the ping-pong between the consumers, and S_j issued
// beside P_{j-1}·V_{j-1}.
//
// What is here: the tile geometry, the shared-memory layout, the block's query tile, a warpgroup's two
// steps per K/V tile (S = Q·Kᵀ into P; O += P·V), and the epilogue's output rows.
#pragma once
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma_attention.cuh"

constexpr int BLOCK_M = 128;                          // query rows per block: 2 warpgroups × 64
constexpr int BLOCK_N = HEAD_DIM == 64 ? 192 : 128;   // keys per K/V tile, attention.cu's
constexpr int WARPGROUP_ROWS = 64;                    // the M of wgmma.m64nNk16
constexpr int COMPUTE_THREADS = BLOCK_M / WARPGROUP_ROWS * WARPGROUP_THREADS;  // the two warpgroups that multiply
constexpr int Q_TILE_BYTES = BLOCK_M * HEAD_DIM * 2;
constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
constexpr int S_FRAGS = BLOCK_N / 8;                  // n8 fragments of a warp's 16 × BLOCK_N scores
constexpr int O_FRAGS = HEAD_DIM / 8;                 // n8 fragments of a warp's 16 × D output
constexpr int P_STEPS = BLOCK_N / 16;                 // k-steps of P·V (16 keys each)
static_assert(sizeof(elem_t) == 2, "16-bit elements");
static_assert(HEAD_DIM % ATOM_COLS == 0, "D is a whole number of 128-byte swizzle rows");

// The Q tile, then a ring of SLOTS K tiles and one of SLOTS V tiles, from a 1024-byte-aligned base
// (the 128-byte swizzle repeats every 1024 bytes), then the mbarriers of the rungs that have them:
// Q's, each slot's K and V "full" barriers, then their "empty" ones (warp_specialized.cu only).
template <int SLOTS>
constexpr int TILES_BYTES = Q_TILE_BYTES + 2 * SLOTS * KV_TILE_BYTES;

template <int SLOTS>
struct SharedTiles {
    unsigned base;
    __device__ unsigned q_tile() const { return base; }
    __device__ unsigned k_slot(int slot) const { return base + Q_TILE_BYTES + slot * KV_TILE_BYTES; }
    __device__ unsigned v_slot(int slot) const { return base + Q_TILE_BYTES + (SLOTS + slot) * KV_TILE_BYTES; }
    __device__ unsigned barrier(int index) const { return base + TILES_BYTES<SLOTS> + 8 * index; }
    __device__ unsigned q_full() const { return barrier(0); }
    __device__ unsigned k_full(int slot) const { return barrier(1 + slot); }
    __device__ unsigned v_full(int slot) const { return barrier(1 + SLOTS + slot); }
    __device__ unsigned k_empty(int slot) const { return barrier(1 + 2 * SLOTS + slot); }
    __device__ unsigned v_empty(int slot) const { return barrier(1 + 3 * SLOTS + slot); }
};

// The block's dynamic shared memory, its base rounded up to 1024 bytes (SHARED_BYTES has 1 KB for it).
template <int SLOTS>
__device__ __forceinline__ SharedTiles<SLOTS> shared_tiles(unsigned char* shared_raw) {
    return {atom_aligned(shared_address(shared_raw))};
}

// The block's query tile: rows m0 .. m0 + 127 of (batch, head) pair `pair` = b·H + h, and K/V pair
// pair / group (grouped-query attention: group query heads share a KV head). One block per query tile,
// numbered head-major and inside a head the heaviest first, as attention.cu numbers them with
// persistent = 0, so that the causal blocks that see the most keys start first.
struct QueryTile {
    int pair, kv_pair, batch, head, kv_head, m0;
    __device__ QueryTile(int seq_q, int heads, int group) {
        const int m_blocks = (seq_q + BLOCK_M - 1) / BLOCK_M;
        pair = blockIdx.x / m_blocks;
        m0 = (m_blocks - 1 - blockIdx.x % m_blocks) * BLOCK_M;
        kv_pair = pair / group;
        batch = pair / heads;
        head = pair % heads;
        kv_head = head / group;
    }
};

// The K/V tiles query rows m0.. need: keys past kv_end are masked for every row of them.
__device__ __forceinline__ int kv_tiles(int m0, int seq_kv, int causal) {
    const int kv_end = causal ? min(seq_kv, m0 + BLOCK_M) : seq_kv;
    return (kv_end + BLOCK_N - 1) / BLOCK_N;  // >= 1: key 0 is seen by every row
}

// A thread's part of a warpgroup's 64 rows: the output accumulator and, for each of its two rows, the
// online softmax's running max and sum (mma.cuh's notation); `first_row` is its warp's first query row.
struct Rows {
    float o[O_FRAGS][4];
    float max[2], sum[2];
    int first_row;
    __device__ explicit Rows(int warp_m0) : o{}, max{-INFINITY, -INFINITY}, sum{0.0f, 0.0f}, first_row(warp_m0) {}
};

// --8<-- [start:steps]
// A warpgroup's first step on K/V tile `tile`: S = Q·Kᵀ for its 64 rows (`warpgroup` 0 or 1 of the Q
// tile), waited for; the mask where the tile reaches past the last key or the diagonal; the online
// softmax; O rescaled to the new running max; P as the A operands of P·V. K is read by then.
__device__ __forceinline__ void scores_to_p(Rows& rows, unsigned (&p)[P_STEPS][4], unsigned q_tile, unsigned k_tile,
                                            int warpgroup, int tile, int seq_kv, int causal, float scale_log2) {
    float s[S_FRAGS][4], correction[2];
    wgmma_fence();
    wgmma_scores<BLOCK_M, BLOCK_N, HEAD_DIM>(s, q_tile, k_tile, warpgroup);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(s);
    const int n0 = tile * BLOCK_N, lane = threadIdx.x % 32;
    if (n0 + BLOCK_N > seq_kv || (causal && n0 + BLOCK_N - 1 > rows.first_row))
        apply_mask(s, n0, rows.first_row + lane / 4, seq_kv, causal, lane);
    softmax_to_p(s, rows.max, rows.sum, correction, scale_log2);
    rescale_accumulator(rows.o, correction);
    p_operands(s, p);
}

// Its second: O += P·V, waited for (V is read by then, and P's registers may be overwritten).
__device__ __forceinline__ void accumulate_pv(Rows& rows, unsigned (&p)[P_STEPS][4], unsigned v_tile) {
    wgmma_fence();  // O and P were written by the threads since the last wgmma
    wgmma_pv<BLOCK_N, HEAD_DIM>(rows.o, p, v_tile);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(rows.o);
    fence_registers(p);
}
// --8<-- [end:steps]

// O = accumulator / row sum and the LSE of the thread's rows, at O's strides (a dense [B, H, S, D], or
// a model's [B, S, H, D] buffer: attention.cu's Output).
__device__ __forceinline__ void write_rows(const Rows& rows, const ForwardParams& p, const QueryTile& tile) {
    elem_t* o_head = p.o + tile.batch * p.o_batch_stride + tile.head * p.o_head_stride;  // the head's row 0
    write_output(rows.o, rows.max, rows.sum, p.scale, o_head, p.lse + (size_t)tile.pair * p.seq_q, rows.first_row,
                 p.seq_q, threadIdx.x % 32, p.o_row_stride);
}
