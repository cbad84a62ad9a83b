// Stage 4's ladder, rung 2 — the wgmma rung with its tiles copied by TMA. sm_90a only.
//
// The wgmma rung (wgmma.cu) with one change: the copies. There every thread issued cp.async copies of
// 16 bytes and computed each one's addresses; here one thread asks the tensor memory accelerator for a
// whole tile -- boxes of a tensor map the launch builds on the host, rows past the end of a head read
// as zeros -- and the copy engine writes it, already swizzled, and counts its bytes on an mbarrier of
// the tile's buffer (its "full" barrier). The threads that need the tile wait on that barrier's phase
// instead of cp.async's groups and a block-wide sync; K and V have a barrier each, so S = Q·Kᵀ may
// start before V has landed. Everything else is the wgmma rung's: a double buffer of K/V tiles, both
// warpgroups computing, the block synced at the end of each tile (then thread 0 refills the buffer
// everyone is done with), one block per query tile.
//
// 256 threads, one block per SM; with no copy addresses to keep, ptxas gives it 167 registers at D = 64
// and 158 at D = 128 (the wgmma rung: 218, 221). Shared memory: the wgmma rung's + 5 mbarriers.
#include "forward.cuh"

constexpr int SLOTS = 2;  // K/V tiles in shared memory: the one multiplied, the one loading
constexpr int NUM_THREADS = COMPUTE_THREADS;
constexpr int NUM_BARRIERS = 1 + 2 * SLOTS;  // Q's, and each buffer's K and V full barriers
constexpr int SHARED_BYTES = TILES_BYTES<SLOTS> + 8 * NUM_BARRIERS + SWIZZLE_ATOM_BYTES;  // + room to align the base
static_assert(SHARED_BYTES <= 227 * 1024, "an H100 block has at most 227 KB of shared memory");

// --8<-- [start:load]
// Thread 0: K/V tile `tile` into buffer tile % SLOTS, each of K and V announced on its full barrier (the
// one arrival the barrier waits for, and the bytes the copy will bring: rows past seq_kv count too).
__device__ __forceinline__ void load_kv(const SharedTiles<SLOTS>& shared, const TmaMap& k_map, const TmaMap& v_map,
                                        int tile, const QueryTile& query) {
    const int slot = tile % SLOTS;
    mbarrier_arrive_expect_tx(shared.k_full(slot), KV_TILE_BYTES);
    load_tile<BLOCK_N, HEAD_DIM>(shared.k_slot(slot), k_map, shared.k_full(slot), tile * BLOCK_N, query.kv_head,
                                 query.batch);
    mbarrier_arrive_expect_tx(shared.v_full(slot), KV_TILE_BYTES);
    load_tile<BLOCK_N, HEAD_DIM>(shared.v_slot(slot), v_map, shared.v_full(slot), tile * BLOCK_N, query.kv_head,
                                 query.batch);
}
// --8<-- [end:load]

// Thread 0, before the loop: every barrier, each waiting for one arrival (thread 0's, with the bytes).
__device__ __forceinline__ void init_barriers(const SharedTiles<SLOTS>& shared) {
    for (int b = 0; b < NUM_BARRIERS; ++b) mbarrier_init(shared.barrier(b), 1);
    mbarrier_init_fence();
}

// Thread 0, once the barriers are published: Q and the first K/V tile.
__device__ __forceinline__ void load_first(const SharedTiles<SLOTS>& shared, const TmaMap& q_map, const TmaMap& k_map,
                                           const TmaMap& v_map, const QueryTile& query) {
    tma_prefetch_map(q_map);
    tma_prefetch_map(k_map);
    tma_prefetch_map(v_map);
    mbarrier_arrive_expect_tx(shared.q_full(), Q_TILE_BYTES);
    load_tile<BLOCK_M, HEAD_DIM>(shared.q_tile(), q_map, shared.q_full(), query.m0, query.head, query.batch);
    load_kv(shared, k_map, v_map, 0, query);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
attention_fwd(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
              const __grid_constant__ TmaMap v_map, const __grid_constant__ ForwardParams p) {
    extern __shared__ __align__(SWIZZLE_ATOM_BYTES) unsigned char shared_raw[];
    const SharedTiles<SLOTS> shared = shared_tiles<SLOTS>(shared_raw);
    const QueryTile query(p.seq_q, p.heads, p.group);
    const int num_tiles = kv_tiles(query.m0, p.seq_kv, p.causal), warpgroup = threadIdx.x / WARPGROUP_THREADS;
    Rows rows(query.m0 + warpgroup * WARPGROUP_ROWS + threadIdx.x / 32 % 4 * 16);
    unsigned probs[P_STEPS][4];  // P, as the A operands of P·V

    // --8<-- [start:loop]
    if (threadIdx.x == 0) init_barriers(shared);
    __syncthreads();  // the barriers are initialized before anyone arrives or waits on them
    if (threadIdx.x == 0) load_first(shared, q_map, k_map, v_map, query);
    mbarrier_wait(shared.q_full(), 0);
    for (int tile = 0; tile < num_tiles; ++tile) {
        // The next tile's copies go into the buffer every thread finished with at the end of the last round.
        if (threadIdx.x == 0 && tile + 1 < num_tiles) load_kv(shared, k_map, v_map, tile + 1, query);
        const unsigned parity = (tile / SLOTS) & 1;  // the buffer's (tile / SLOTS)-th use
        mbarrier_wait(shared.k_full(tile % SLOTS), parity);
        scores_to_p(rows, probs, shared.q_tile(), shared.k_slot(tile % SLOTS), warpgroup, tile, p.seq_kv, p.causal,
                    p.scale * LOG2E);
        mbarrier_wait(shared.v_full(tile % SLOTS), parity);
        accumulate_pv(rows, probs, shared.v_slot(tile % SLOTS));
        __syncthreads();  // both warpgroups are done with this buffer: the next round's copies refill it
    }
    // --8<-- [end:loop]
    write_rows(rows, p, query);
}
