// Stage 4's ladder, rung 1 — FlashAttention-2's forward with wgmma. sm_90a only.
//
// Stage 3's block, one query tile of 128 rows, with Hopper's warpgroup-wide multiply in place of
// mma.sync: two warpgroups of 64 rows each issue S = Q·Kᵀ with wgmma.m64nNk16, both operands read
// from shared memory through matrix descriptors (no ldmatrix, no fragments of Q or K in registers),
// then the online softmax on the accumulator, then O += P·V with P from registers and V from shared
// memory (forward.cuh, the products of attention.cu). The loads are stage 3's: every thread issues
// cp.async copies of 16 bytes, into a double buffer of K/V tiles -- tile j + 1 loads while tile j is
// multiplied -- and the block syncs between tiles: the tiles are ready for everyone, and everyone is
// done with the buffer the next copies overwrite.
//
// wgmma reads shared memory as TMA writes it: 128-byte rows swizzled (16-byte chunk c of row r at
// position c ^ (r % 8), stage 3's swizzle on 128-byte lines), a D = 128 row split into two 64-column
// blocks, the second ROWS·128 bytes after the first. So the copies write that layout themselves
// (tile_offset), and then make their writes visible to wgmma, which reads through the "async proxy" of
// the memory system, with a fence.
//
// 256 threads, one block per SM: S, P and O take some 180 registers per thread at D = 64, and ptxas
// gives the kernel 218 (221 at D = 128; the TMA rung, with no copies to address, 167 and 158), no
// spills. Shared memory: Q 128·D·2 + 2 buffers × (K + V) BLOCK_N·D·2 bytes (+ 1 KB to align):
// D = 64: 16 + 96 KB; D = 128: 32 + 128 KB.
#include "cp_async.cuh"
#include "swizzle.cuh"
#include "forward.cuh"

constexpr int SLOTS = 2;  // K/V tiles in shared memory: the one multiplied, the one loading
constexpr int NUM_THREADS = COMPUTE_THREADS;
constexpr int SHARED_BYTES = TILES_BYTES<SLOTS> + SWIZZLE_ATOM_BYTES;  // + room to align the base to an atom
static_assert(SHARED_BYTES <= 227 * 1024, "an H100 block has at most 227 KB of shared memory");

// --8<-- [start:copy]
// Where 16-byte chunk `chunk` (elements 8·chunk .. 8·chunk + 7) of row `row` of a ROWS-row tile goes:
// the layout tma.cuh's load_tile leaves, column block chunk / 8 (64 elements) at chunk / 8 · ROWS · 128,
// each an array of 128-byte rows with stage 3's swizzle.
template <int ROWS>
__device__ __forceinline__ unsigned tile_offset(int row, int chunk) {
    return (chunk / 8) * ROWS * SWIZZLE_BYTES + swizzle<SWIZZLE_BYTES>(row, chunk % 8);
}

// Every thread's cp.async copies of rows row0 .. row0 + ROWS - 1 of a dense [rows, D] head into `tile`;
// rows past `rows` are zero-filled (a key row of zeros meets p = 0 in P·V, where garbage could be NaN).
// Neighbouring threads copy neighbouring chunks of a row.
template <int ROWS>
__device__ __forceinline__ void copy_tile(unsigned tile, const elem_t* head, int row0, int rows) {
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks of a row
    static_assert(ROWS * CHUNKS % NUM_THREADS == 0, "every thread copies as many chunks");
#pragma unroll
    for (int step = 0; step < ROWS * CHUNKS / NUM_THREADS; ++step) {
        const int i = step * NUM_THREADS + threadIdx.x, row = i / CHUNKS, chunk = i % CHUNKS;
        const bool valid = row0 + row < rows;
        const elem_t* from = head + (size_t)(valid ? row0 + row : 0) * HEAD_DIM + chunk * 8;  // row 0 exists
        cp_async_16(tile + tile_offset<ROWS>(row, chunk), from, valid);
    }
}
// --8<-- [end:copy]

// The copies of K/V tile `tile` into buffer tile % SLOTS.
__device__ __forceinline__ void copy_kv(const SharedTiles<SLOTS>& shared, const elem_t* k_head, const elem_t* v_head,
                                        int tile, int seq_kv) {
    copy_tile<BLOCK_N>(shared.k_slot(tile % SLOTS), k_head, tile * BLOCK_N, seq_kv);
    copy_tile<BLOCK_N>(shared.v_slot(tile % SLOTS), v_head, tile * BLOCK_N, seq_kv);
}

// Q [B, H, S_q, D], K and V [B, H / group, S_kv, D], dense; O at its strides.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
attention_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
              const __grid_constant__ ForwardParams p) {
    extern __shared__ __align__(SWIZZLE_ATOM_BYTES) unsigned char shared_raw[];
    const SharedTiles<SLOTS> shared = shared_tiles<SLOTS>(shared_raw);
    const QueryTile query(p.seq_q, p.heads, p.group);
    const elem_t* k_head = k + (size_t)query.kv_pair * p.seq_kv * HEAD_DIM;
    const elem_t* v_head = v + (size_t)query.kv_pair * p.seq_kv * HEAD_DIM;
    const int num_tiles = kv_tiles(query.m0, p.seq_kv, p.causal), warpgroup = threadIdx.x / WARPGROUP_THREADS;
    Rows rows(query.m0 + warpgroup * WARPGROUP_ROWS + threadIdx.x / 32 % 4 * 16);
    unsigned probs[P_STEPS][4];  // P, as the A operands of P·V

    // --8<-- [start:loop]
    copy_tile<BLOCK_M>(shared.q_tile(), q + (size_t)query.pair * p.seq_q * HEAD_DIM, query.m0, p.seq_q);
    copy_kv(shared, k_head, v_head, 0, p.seq_kv);
    cp_async_commit();
    for (int tile = 0; tile < num_tiles; ++tile) {
        // The next tile's copies go into the buffer every thread finished with at the end of the last round.
        if (tile + 1 < num_tiles) copy_kv(shared, k_head, v_head, tile + 1, p.seq_kv);
        cp_async_commit();       // (an empty group after the last tile: one wait for every round)
        cp_async_wait<1>();      // this thread's copies of Q and of this tile have landed
        fence_async_shared();    // ... and are visible to wgmma
        __syncthreads();         // ... and so are everyone else's
        scores_to_p(rows, probs, shared.q_tile(), shared.k_slot(tile % SLOTS), warpgroup, tile, p.seq_kv, p.causal,
                    p.scale * LOG2E);
        accumulate_pv(rows, probs, shared.v_slot(tile % SLOTS));
        __syncthreads();         // both warpgroups are done with this buffer: the next round's copies refill it
    }
    // --8<-- [end:loop]
    write_rows(rows, p, query);
}
