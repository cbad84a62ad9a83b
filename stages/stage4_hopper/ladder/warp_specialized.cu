// Stage 4's ladder, rung 3 — the TMA rung, warp-specialized. sm_90a only.
//
// The TMA rung (tma.cu) split by role. A third warpgroup, the producer, gives most of its registers
// away (setmaxnreg) and one of its threads issues every copy: Q, then the K/V tiles into a ring of
// KV_STAGES buffers (attention.cu's: 3 at D = 64, 2 at D = 128), as far ahead as the ring allows. The
// two warpgroups that compute, the consumers, take the registers (240 each) and never copy or sync as a
// block: a buffer changes hands on mbarriers both ways, "full" (the producer's copy has landed, as in
// the TMA rung) and "empty" (all 256 consumer threads are done with it: the producer may refill it),
// each waited on by the phase of its use. So a consumer waits only for the tile it needs, not for the
// other consumer, and the copies run ahead of both.
//
// attention.cu is this kernel with three things more: the consumers take turns on the tensor cores
// (ping-pong), each issues S_j beside P_{j-1}·V_{j-1} and runs the softmax of S_j while that product
// runs, and the grid is persistent. Here each consumer waits for every product, and there is one
// block per query tile.
//
// 384 threads, one block per SM (240·256 + 24·128 registers). Shared memory: attention.cu's.
#include "forward.cuh"

constexpr int KV_STAGES = HEAD_DIM == 64 ? 3 : 2;  // K/V ring slots, attention.cu's
constexpr int NUM_THREADS = WARPGROUP_THREADS + COMPUTE_THREADS;  // the producer warpgroup + 2 consumer warpgroups
constexpr int CONSUMER_THREADS = COMPUTE_THREADS;
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
constexpr int NUM_BARRIERS = 1 + 4 * KV_STAGES;  // Q's, each slot's K and V full and empty barriers
constexpr int SHARED_BYTES = TILES_BYTES<KV_STAGES> + 8 * NUM_BARRIERS + SWIZZLE_ATOM_BYTES;  // + room to align
static_assert(SHARED_BYTES <= 227 * 1024, "an H100 block has at most 227 KB of shared memory");
using Shared = SharedTiles<KV_STAGES>;

// One thread initializes every mbarrier, before the warpgroups go their ways.
__device__ __forceinline__ void init_barriers(const Shared& shared) {
    mbarrier_init(shared.q_full(), 1);
    for (int s = 0; s < KV_STAGES; ++s) {
        mbarrier_init(shared.k_full(s), 1);  // the producer's arrive.expect_tx, then the bytes
        mbarrier_init(shared.v_full(s), 1);
        mbarrier_init(shared.k_empty(s), CONSUMER_THREADS);  // every consumer thread releases
        mbarrier_init(shared.v_empty(s), CONSUMER_THREADS);
    }
    mbarrier_init_fence();
}

// --8<-- [start:producer]
// The producer: one thread issues every copy, Q, then the query tile's K/V tiles into the ring, each
// once the consumers have emptied its slot.
__device__ __forceinline__ void produce(const Shared& shared, const QueryTile& query, const TmaMap& q_map,
                                        const TmaMap& k_map, const TmaMap& v_map, int seq_kv, int causal) {
    tma_prefetch_map(q_map);
    tma_prefetch_map(k_map);
    tma_prefetch_map(v_map);
    mbarrier_arrive_expect_tx(shared.q_full(), Q_TILE_BYTES);
    load_tile<BLOCK_M, HEAD_DIM>(shared.q_tile(), q_map, shared.q_full(), query.m0, query.head, query.batch);
    const int num_tiles = kv_tiles(query.m0, seq_kv, causal);
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int stage = tile % KV_STAGES;
        const unsigned parity = (tile / KV_STAGES) & 1;  // which use of this slot
        mbarrier_wait(shared.k_empty(stage), parity ^ 1);  // slot free (a fresh barrier: at once)
        mbarrier_arrive_expect_tx(shared.k_full(stage), KV_TILE_BYTES);
        load_tile<BLOCK_N, HEAD_DIM>(shared.k_slot(stage), k_map, shared.k_full(stage), tile * BLOCK_N,
                                     query.kv_head, query.batch);
        mbarrier_wait(shared.v_empty(stage), parity ^ 1);
        mbarrier_arrive_expect_tx(shared.v_full(stage), KV_TILE_BYTES);
        load_tile<BLOCK_N, HEAD_DIM>(shared.v_slot(stage), v_map, shared.v_full(stage), tile * BLOCK_N,
                                     query.kv_head, query.batch);
    }
}
// --8<-- [end:producer]

// --8<-- [start:consumer]
// Consumer `consumer` (0 or 1): rows 64·consumer .. 64·consumer + 63 of the query tile. Per K/V tile: K
// landed, S and P, K released; V landed, O += P·V, V released.
__device__ __forceinline__ void consume(const Shared& shared, const QueryTile& query, int consumer,
                                        const ForwardParams& p) {
    const int num_tiles = kv_tiles(query.m0, p.seq_kv, p.causal);
    Rows rows(query.m0 + consumer * WARPGROUP_ROWS + threadIdx.x / 32 % 4 * 16);
    unsigned probs[P_STEPS][4];  // P, as the A operands of P·V
    mbarrier_wait(shared.q_full(), 0);
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int stage = tile % KV_STAGES;
        const unsigned parity = (tile / KV_STAGES) & 1;
        mbarrier_wait(shared.k_full(stage), parity);
        scores_to_p(rows, probs, shared.q_tile(), shared.k_slot(stage), consumer, tile, p.seq_kv, p.causal,
                    p.scale * LOG2E);
        mbarrier_arrive(shared.k_empty(stage));
        mbarrier_wait(shared.v_full(stage), parity);
        accumulate_pv(rows, probs, shared.v_slot(stage));
        mbarrier_arrive(shared.v_empty(stage));
    }
    write_rows(rows, p, query);
}
// --8<-- [end:consumer]

// --8<-- [start:kernel]
// A producer warpgroup that gives its registers away and copies; two consumer warpgroups that take
// them and compute.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
attention_fwd(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
              const __grid_constant__ TmaMap v_map, const __grid_constant__ ForwardParams p) {
    extern __shared__ __align__(SWIZZLE_ATOM_BYTES) unsigned char shared_raw[];
    const Shared shared = shared_tiles<KV_STAGES>(shared_raw);
    const QueryTile query(p.seq_q, p.heads, p.group);
    if (threadIdx.x == 0) init_barriers(shared);
    __syncthreads();

    const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();  // the producer keeps 24 registers per thread
        if (threadIdx.x == 0) produce(shared, query, q_map, k_map, v_map, p.seq_kv, p.causal);
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();  // 240 per thread for S, P and O
        consume(shared, query, warpgroup - 1, p);
    }
}
// --8<-- [end:kernel]
