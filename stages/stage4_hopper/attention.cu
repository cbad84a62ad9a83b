// Stage 4 — Hopper: TMA, wgmma and warp specialization (FlashAttention-3 style). sm_90a only.
//
// New here, after stage 3's cp.async ring and mma.sync warps:
//   TMA      one thread copies a whole K or V tile (a "box" of a tensor map built on the host) into
//            128-byte-swizzled shared memory; the copy counts its bytes on an mbarrier.
//   wgmma    a warpgroup (4 warps) multiplies 64 query rows at once, reading Q, K and V straight
//            from shared memory through matrix descriptors -- no ldmatrix, no register copies of
//            K or V -- asynchronously: the warps go on while the tensor cores work.
//   warp specialization   one producer warpgroup only issues TMA copies (and gives its registers
//            away with setmaxnreg); two consumer warpgroups only compute. They talk through
//            mbarriers, a full (the tile has landed) and an empty one (every consumer is done with it)
//            for each slot's K and for its V -- a ring of KV_STAGES slots, each barrier with its phase bit.
//   ping-pong  the two consumers take turns on the tensor cores (named barriers 1 and 2): while one
//            runs its softmax on the CUDA cores, the other's GEMMs run, so neither unit idles.
//   intra-warpgroup overlap  a consumer issues S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} together and
//            runs the softmax of S_j while the P·V product is still in flight.
//
// Per query tile: BLOCK_M = 128 query rows (consumer c owns rows 64c .. 64c+63), tiles of BLOCK_N
// keys (192 at D = 64 without the causal mask, else 128), 384 threads = 3 warpgroups:
//
//   producer  | TMA Q | TMA K0 V0 | K1 V1 | K2 V2 (when a slot is empty) ...
//   consumer0 | S0 |softmax0| S1 PV0 |softmax1| S2 PV1 |softmax2| ...
//   consumer1 |    | S0 |softmax0| S1 PV0 |softmax1| S2 PV1 |softmax2| ...
//   tensor    | S0 | S0 | S1 PV0 | S1 PV0 | S2 PV1 | S2 PV1 | ...   (the two consumers alternate)
//
// FLOPs and bytes per K/V tile: 4·128·BLOCK_N·D FLOPs (6.3 M at D=64, 8.4 M at D=128) for
//   2·BLOCK_N·D·2 bytes of K and V from L2 (48 KB, 64 KB): 128 FLOPs per byte. Shared memory is
//   read by the tensor cores only: per consumer and tile Q 64·D·2 + K BLOCK_N·D·2 + V BLOCK_N·D·2
//   bytes for 2·64·BLOCK_N·D·2 FLOPs, ~51-55 FLOPs per byte (stage 3 read 16), well within
//   Hopper's shared-memory bandwidth.
// Registers: consumers setmaxnreg 240 -- S BLOCK_N/2 floats (96 or 64), P BLOCK_N/4 (48 or 32),
//   O D/2 (32 or 64), the softmax's row state; the producer keeps 24 (240·256 + 24·128 = 64512
//   <= 65536, one block per SM).
// Shared memory: Q 128·D·2 + KV_STAGES·2·BLOCK_N·D·2 (+ barriers, + 1 KB to align to 1024
//   bytes): D=64: 16 + 3·48 = 160 KB (causal: 16 + 4·32 = 144 KB); D=128: 32 + 2·64 = 160 KB. One
//   block per SM.
// D = 64 is the hard case: per tile, the exponentials (one MUFU.EX2 per score, 16 lanes per SM
//   per cycle) take as long as both GEMMs on the tensor cores, and each consumer warp's softmax is
//   a chain of dependent steps that only the one other consumer can hide. Hence the row max and sum
//   in independent chains (softmax_to_p, wgmma_attention.cuh), and 192-key tiles at D = 64 (FlashAttention-3's
//   choice): a third fewer tile transitions -- barrier waits, turns, wgmma issue and wait -- per key,
//   for some waste on a partial last tile.
// Causal: the mask is compiled in (CAUSAL, 0 or 1: the launch picks the variant). A query tile's last
//   K/V tile crosses the diagonal and is partly masked, the more so the wider it is, and a short
//   prompt is mostly diagonal: at S = 256 a 192-key tiling computes 576 key columns per pair of query
//   tiles where 384 are needed, a 128-key one exactly 384. So the causal kernel keeps 128-key tiles at
//   D = 64 too, with a fourth ring slot in the room they leave.
// Persistent: a block has a fixed cost per query tile -- launch, barrier setup, the cold Q and K_0
//   loads, S_0 alone, the last P·V and the output stores with the tensor cores idle -- of a few µs,
//   which short sequences do not hide. So the grid is one block per SM, each looping over query
//   tiles (Schedule, below): the producer loads the next Q (once both consumers' last Q·Kᵀ is done:
//   barrier Q_EMPTY) and the next tiles' K/V into the same ring (its counters run on across query
//   tiles) while the consumers finish, and the ping-pong turns simply continue. Causal pairs query
//   tiles i and M-1-i (M+1 K/V tiles whatever i) so that a static round-robin stays balanced.
//   persistent = 0 (one block per query tile) stays in the kernel, to compare the two.
// (The A/B measurements behind these choices, and the predictions: docs/notebook/stage4.md.)
//
// Tensors are [B, H, S, D], D contiguous; the host builds 4-D tensor maps with their strides, so a box
// never crosses into the next head: rows past S read as zeros. Causal masking is top-left
// aligned: query i sees keys j <= i.
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_attention.cuh"  // the products, the online softmax split around P·V

constexpr int BLOCK_M = 128;                          // query rows per query tile
constexpr int BLOCK_N = HEAD_DIM == 64 && !CAUSAL ? 192 : 128;  // keys per K/V tile (see above)
constexpr int KV_STAGES = HEAD_DIM == 64 ? (CAUSAL ? 4 : 3) : 2;  // K/V ring slots: what shared memory allows
constexpr int CONSUMERS = 2;                          // consumer warpgroups, 64 query rows each
constexpr int NUM_THREADS = (1 + CONSUMERS) * WARPGROUP_THREADS;  // + the producer warpgroup
constexpr int CONSUMER_THREADS = CONSUMERS * WARPGROUP_THREADS;
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
constexpr int COL_BLOCKS = HEAD_DIM / ATOM_COLS;      // 128-byte column blocks of a D-wide row
constexpr int Q_TILE_BYTES = BLOCK_M * HEAD_DIM * 2;
constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
constexpr int S_FRAGS = BLOCK_N / 8;                  // n8 fragments of a warp's 16 × BLOCK_N scores
constexpr int O_FRAGS = HEAD_DIM / 8;                 // n8 fragments of a warp's 16 × D output
constexpr int P_STEPS = BLOCK_N / 16;                 // k-steps of P·V (16 keys each)
constexpr int TURN_BARRIER = 1;                       // named barriers 1, 2: consumer c's turn
// Layout of the dynamic shared memory, from a 1024-byte-aligned base.
constexpr int K_RING = Q_TILE_BYTES;
constexpr int V_RING = K_RING + KV_STAGES * KV_TILE_BYTES;
constexpr int BARRIERS = V_RING + KV_STAGES * KV_TILE_BYTES;  // then 8-byte mbarriers:
constexpr int Q_FULL = 0, Q_EMPTY = 1, K_FULL = 2, V_FULL = 2 + KV_STAGES, K_EMPTY = 2 + 2 * KV_STAGES,
              V_EMPTY = 2 + 3 * KV_STAGES, NUM_BARRIERS = 2 + 4 * KV_STAGES;
constexpr int SHARED_BYTES = BARRIERS + 8 * NUM_BARRIERS + SWIZZLE_ATOM_BYTES;  // + room to align the base to an atom
static_assert(SHARED_BYTES <= 227 * 1024, "an H100 block has at most 227 KB of shared memory");
static_assert(sizeof(elem_t) == 2, "16-bit elements");
static_assert(HEAD_DIM % ATOM_COLS == 0, "D is a whole number of 128-byte swizzle rows");


// The query tiles a block computes. A "unit" is one query tile (m_block, head) -- or, when the
// launch is persistent and causal, the pair of query tiles i and M-1-i of a head, which together see
// M+1 K/V tiles whatever i is: every unit then has the same work, so a static round-robin of units
// over the blocks is balanced. Units are numbered head-major, heaviest first inside a head (as the
// old 2-D grid did), so the blocks running at once share a few heads' K and V in L2.
// Block b takes units b, b + gridDim.x, ...: gridDim.x = units (one unit per block, the hardware
// balances causal blocks) or = the number of SMs (persistent: the producer loads the next query
// tile's Q and first K/V tiles while the consumers finish the current one -- no block launch, no
// cold pipeline, between tiles).
struct Schedule {
    int num_m_blocks, units_per_head, num_units, paired;
    __device__ Schedule(int seq_q, int batch_heads, int persistent) {
        num_m_blocks = (seq_q + BLOCK_M - 1) / BLOCK_M;
        paired = persistent && CAUSAL;
        units_per_head = paired ? (num_m_blocks + 1) / 2 : num_m_blocks;
        num_units = units_per_head * batch_heads;
    }
    __device__ int tiles_in(int unit) const {  // 2, or 1 (unpaired, or the middle tile of an odd M)
        const int i = unit % units_per_head;
        return paired && 2 * i + 1 != num_m_blocks ? 2 : 1;
    }
    __device__ int head(int unit) const { return unit / units_per_head; }
    __device__ int m0(int unit, int half) const {  // first query row: the heavy tile first
        const int i = unit % units_per_head;
        return (half == 0 ? num_m_blocks - 1 - i : i) * BLOCK_M;
    }
};

// The block's dynamic shared memory, from its 1024-byte-aligned base: the Q tile, the K and V rings
// (KV_STAGES slots each) and the mbarriers, as 32-bit shared addresses.
struct SharedMemory {
    unsigned base;
    __device__ unsigned q_tile() const { return base; }
    __device__ unsigned k_slot(int slot) const { return base + K_RING + slot * KV_TILE_BYTES; }
    __device__ unsigned v_slot(int slot) const { return base + V_RING + slot * KV_TILE_BYTES; }
    __device__ unsigned barrier(int index) const { return base + BARRIERS + 8 * index; }
    // The barriers wgmma_attention.cuh's consumer steps arrive on.
    __device__ unsigned q_empty() const { return barrier(Q_EMPTY); }
    __device__ unsigned k_empty(int slot) const { return barrier(K_EMPTY + slot); }
    __device__ unsigned v_empty(int slot) const { return barrier(V_EMPTY + slot); }
};

// The K/V tiles the query tile of rows m0.. needs: keys past kv_end are masked for every row of it.
__device__ __forceinline__ int kv_tiles(int m0, int seq_kv) {
    const int kv_end = CAUSAL ? min(seq_kv, m0 + BLOCK_M) : seq_kv;
    return (kv_end + BLOCK_N - 1) / BLOCK_N;  // >= 1: key 0 is seen by every row
}

// One thread initializes every mbarrier, before the warpgroups go their ways.
__device__ __forceinline__ void init_barriers(const SharedMemory& shared) {
    mbarrier_init(shared.barrier(Q_FULL), 1);
    mbarrier_init(shared.barrier(Q_EMPTY), CONSUMER_THREADS);  // Q may be overwritten: the last Q·Kᵀ is done
    for (int s = 0; s < KV_STAGES; ++s) {
        mbarrier_init(shared.barrier(K_FULL + s), 1);  // the producer's arrive.expect_tx, then the bytes
        mbarrier_init(shared.barrier(V_FULL + s), 1);
        mbarrier_init(shared.barrier(K_EMPTY + s), CONSUMER_THREADS);  // every consumer thread releases
        mbarrier_init(shared.barrier(V_EMPTY + s), CONSUMER_THREADS);
    }
    mbarrier_init_fence();
}

// --8<-- [start:warp_specialization]
// The producer: one thread issues every copy, Q of each query tile and its K/V tiles into the ring.
__device__ __forceinline__ void produce(const SharedMemory& shared, const Schedule& schedule, const TmaMap& q_map,
                                        const TmaMap& k_map, const TmaMap& v_map, int seq_kv, int heads, int group) {
    tma_prefetch_map(q_map);
    tma_prefetch_map(k_map);
    tma_prefetch_map(v_map);
    // ring counts the K/V tiles loaded so far by this block, across query tiles: slot
    // ring % KV_STAGES, used for the (ring / KV_STAGES)-th time. q_loads counts the Q tiles.
    int ring = 0, q_loads = 0;
    for (int unit = blockIdx.x; unit < schedule.num_units; unit += gridDim.x) {
        for (int half = 0; half < schedule.tiles_in(unit); ++half, ++q_loads) {
            const int m0 = schedule.m0(unit, half), pair = schedule.head(unit);
            const int batch = pair / heads, head = pair % heads;
            const int kv_head = head / group;  // grouped-query attention: group query heads share one KV head
            // One Q buffer: wait until both consumers' last Q·Kᵀ of the previous query tile is done.
            mbarrier_wait(shared.barrier(Q_EMPTY), (q_loads & 1) ^ 1);
            mbarrier_arrive_expect_tx(shared.barrier(Q_FULL), Q_TILE_BYTES);
            load_tile<BLOCK_M, HEAD_DIM>(shared.q_tile(), q_map, shared.barrier(Q_FULL), m0, head, batch);
            const int num_tiles = kv_tiles(m0, seq_kv);
            for (int tile = 0; tile < num_tiles; ++tile, ++ring) {
                const int stage = ring % KV_STAGES;
                const unsigned parity = (ring / KV_STAGES) & 1;  // which use of this slot
                mbarrier_wait(shared.barrier(K_EMPTY + stage), parity ^ 1);  // slot free (a fresh barrier: at once)
                // EXERCISE: fill ring slot `stage` with K, then V, of `tile`. K: tell its full barrier how
                // many bytes are coming (mbarrier_arrive_expect_tx -- the producer's one arrival, and
                // KV_TILE_BYTES: rows past seq_kv are zero-filled and counted too), then issue the TMA copy
                // (load_tile<BLOCK_N, HEAD_DIM>) of rows tile·BLOCK_N onwards of KV head `kv_head` of `batch`,
                // completing on that same barrier. V: wait for its own empty barrier as K's was waited for
                // above, then the same.
                // STUB: mbarrier_arrive_expect_tx(shared.barrier(K_FULL + stage), 0);  // arrives but loads nothing:
                // STUB: mbarrier_wait(shared.barrier(V_EMPTY + stage), parity ^ 1);   // wrong results, no hang
                // STUB: mbarrier_arrive_expect_tx(shared.barrier(V_FULL + stage), 0);
                mbarrier_arrive_expect_tx(shared.barrier(K_FULL + stage), KV_TILE_BYTES);
                load_tile<BLOCK_N, HEAD_DIM>(shared.k_slot(stage), k_map, shared.barrier(K_FULL + stage),
                                             tile * BLOCK_N, kv_head, batch);
                mbarrier_wait(shared.barrier(V_EMPTY + stage), parity ^ 1);
                mbarrier_arrive_expect_tx(shared.barrier(V_FULL + stage), KV_TILE_BYTES);
                load_tile<BLOCK_N, HEAD_DIM>(shared.v_slot(stage), v_map, shared.barrier(V_FULL + stage),
                                             tile * BLOCK_N, kv_head, batch);
                // END EXERCISE
            }
        }
    }
}
// --8<-- [end:warp_specialization]

// Where O goes: element (b, h, s, d) at o + b·batch_stride + h·head_stride + s·row_stride + d, for
// `heads` query heads: contiguous [B, H, S, D], or a model's [B, S, H, D] buffer, which the output
// projection reads as [tokens, H·D] with no transpose in between.
struct Output {
    elem_t* o;
    long long batch_stride, head_stride;
    int row_stride, heads;
    __device__ elem_t* head_rows(int pair) const {  // row 0 of (batch, head) pair b·H + h
        return o + (pair / heads) * batch_stride + (pair % heads) * head_stride;
    }
};

// --8<-- [start:pipeline]
// Consumer `consumer` (0 or 1): rows 64·consumer .. 64·consumer + 63 of each query tile, one turn
// on the tensor cores per K/V tile and one more. Ping-pong: consumer 0 goes first, consumer 1
// hands it the first turn. The turns alternate across query tiles too: both consumers take
// num_tiles + 1 turns per query tile.
__device__ __forceinline__ void consume(const SharedMemory& shared, const Schedule& schedule, int consumer,
                                        const Output& out, float* lse, int seq_q, int seq_kv, float scale) {
    const int lane = threadIdx.x % 32, warp_in_group = threadIdx.x / 32 % 4;
    const Turns<CONSUMER_THREADS> turns(TURN_BARRIER, consumer);  // ping-pong: wgmma_attention.cuh
    const float scale_log2 = scale * LOG2E;
    if (consumer == 1) named_barrier_arrive(TURN_BARRIER + 0, CONSUMER_THREADS);

    int ring = 0, q_loads = 0;  // as the producer counts them
    for (int unit = blockIdx.x; unit < schedule.num_units; unit += gridDim.x) {
        for (int half = 0; half < schedule.tiles_in(unit); ++half, ++q_loads) {
            const int m0 = schedule.m0(unit, half), head = schedule.head(unit);
            const int num_tiles = kv_tiles(m0, seq_kv);
            const bool block_done = unit + gridDim.x >= schedule.num_units && half + 1 == schedule.tiles_in(unit);
            const int warp_m0 = m0 + consumer * 64 + warp_in_group * 16;  // this warp's 16 rows

            float o_acc[O_FRAGS][4] = {};
            float s[S_FRAGS][4];
            unsigned p[P_STEPS][4];
            float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f}, correction[2];

            mbarrier_wait(shared.barrier(Q_FULL), q_loads & 1);

            // Round 0: S_0 alone.
            const int first = ring % KV_STAGES;
            mbarrier_wait(shared.barrier(K_FULL + first), (ring / KV_STAGES) & 1);
            issue_scores<BLOCK_M, BLOCK_N, HEAD_DIM>(s, shared.q_tile(), shared.k_slot(first), consumer, turns);
            wait_scores<0>(s, shared, first, num_tiles == 1);
            if (BLOCK_N > seq_kv || (CAUSAL && BLOCK_N - 1 > warp_m0)) apply_mask(s, 0, warp_m0 + lane / 4, seq_kv, CAUSAL, lane);
            softmax_to_p(s, row_max, row_sum, correction, scale_log2);  // O is still 0: no rescale
            p_operands(s, p);

            // Rounds 1 .. num_tiles - 1: S_j and P_{j-1}·V_{j-1} together, softmax of S_j meanwhile.
            for (int tile = 1; tile < num_tiles; ++tile) {
                const int k = ring + tile;  // this K/V tile's number in the block's ring sequence
                const int stage = k % KV_STAGES, prev = (k - 1) % KV_STAGES;
                mbarrier_wait(shared.barrier(K_FULL + stage), (k / KV_STAGES) & 1);
                mbarrier_wait(shared.barrier(V_FULL + prev), ((k - 1) / KV_STAGES) & 1);
                issue_scores_and_pv<BLOCK_M, BLOCK_N, HEAD_DIM>(s, o_acc, p, shared.q_tile(), shared.k_slot(stage),
                                                                shared.v_slot(prev), consumer, turns);
                wait_scores<1>(s, shared, stage, tile == num_tiles - 1);  // S_j is ready (P·V may still run)
                const int n0 = tile * BLOCK_N;
                if (n0 + BLOCK_N > seq_kv || (CAUSAL && n0 + BLOCK_N - 1 > warp_m0))
                    apply_mask(s, n0, warp_m0 + lane / 4, seq_kv, CAUSAL, lane);
                softmax_to_p(s, row_max, row_sum, correction, scale_log2);
                wait_pv(o_acc, p, shared, prev);  // P_{j-1}·V_{j-1} is done: O may be rescaled, P overwritten
                rescale_accumulator(o_acc, correction);
                p_operands(s, p);
            }

            // Last round: P·V of the last tile.
            const int k = ring + num_tiles - 1, last = k % KV_STAGES;
            mbarrier_wait(shared.barrier(V_FULL + last), (k / KV_STAGES) & 1);
            issue_last_pv<BLOCK_N, HEAD_DIM>(o_acc, p, shared.v_slot(last), turns);
            // After the block's last turn of consumer 1, consumer 0 will not sync again: 1 does not arrive.
            if (consumer == 0 || !block_done) turns.pass();
            wait_pv(o_acc, p, shared, last);
            ring += num_tiles;

            // While this consumer writes its rows, the other one's P·V runs, and the producer is
            // already loading the next query tile's Q and first K/V tiles.
            write_output(o_acc, row_max, row_sum, scale, out.head_rows(head), lse + (size_t)head * seq_q, warp_m0,
                         seq_q, lane, out.row_stride);
        }
    }
}
// --8<-- [end:pipeline]

// --8<-- [start:kernel]
// A producer warpgroup that gives its registers away and copies; two consumer warpgroups that take
// them and compute.
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
attention_fwd(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
              const __grid_constant__ TmaMap v_map, const __grid_constant__ ForwardParams p) {
    extern __shared__ __align__(SWIZZLE_ATOM_BYTES) unsigned char shared_raw[];
    // TMA's 128-byte swizzle and the descriptors' base offset 0 assume 1024-byte-aligned tiles.
    const SharedMemory shared{atom_aligned(shared_address(shared_raw))};
    const Schedule schedule(p.seq_q, p.batch_heads, p.persistent);
    if (threadIdx.x == 0) init_barriers(shared);
    __syncthreads();

    const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();  // the producer keeps 24 registers per thread
        if (threadIdx.x == 0) produce(shared, schedule, q_map, k_map, v_map, p.seq_kv, p.heads, p.group);
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();  // 240 per thread for S, P and O
        const Output out{p.o, p.o_batch_stride, p.o_head_stride, p.o_row_stride, p.heads};
        consume(shared, schedule, warpgroup - 1, out, p.lse, p.seq_q, p.seq_kv, p.scale);
    }
}
// --8<-- [end:kernel]
