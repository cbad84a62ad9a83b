// Stage 12 — block-sparse attention forward on Hopper. sm_90a only.
//
// Stage 4's machinery -- a TMA producer warpgroup, two wgmma consumer warpgroups taking turns on
// the tensor cores, the online softmax overlapped with the P·V product in flight, a persistent grid
// -- walking a block mask instead of every key:
//   lists     query block m's K/V tiles are the blocks its lists name (FlexAttention's BlockMask:
//             full_kv_indices[m][0 .. full_kv_num_blocks[m]), then kv_indices[m][0 .. kv_num_blocks[m])),
//             not 0 .. S/BLOCK_N: the producer loads the tile at each listed block, the consumers
//             mask by the same list. Absent blocks cost nothing.
//   masks     full blocks are used as they are; partial blocks apply the element mask in registers
//             (causal, documents, sliding window: -DELEMENT_MASK, compiled in, so that a mask of full
//             blocks only -- the neighbourhood graph -- carries no masking code but the end of S).
//             Keys past S (the last block, which TMA zero-fills) are masked in both.
//   empty     a query block with empty lists loads nothing and writes O = 0, LSE = -inf; a row that
//             sees no key of its tiles does the same (write_output_or_empty).
//   schedule  a persistent grid over (query block, batch·head) units; `order` lists the query blocks
//             longest lists first (the launch sorts them), and unit u is query block order[u / BH]
//             of pair u % BH, so the blocks start on the long units and finish on the short ones.
//
// Tiles: BLOCK_M = 128 query rows (consumer c owns rows 64c .. 64c+63), BLOCK_N = 128 keys (the
// mask's block), 384 threads. Shared memory: Q 128·D·2 + KV_STAGES·2·128·D·2 bytes (+ barriers,
// + 1 KB of alignment): D = 64: 16 + 3·32 = 112 KB; D = 128: 32 + 2·64 = 160 KB.
#include "block_mask.cuh"  // the element mask, compiled in: MASK, element_visible
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "wgmma_attention.cuh"

constexpr int BLOCK_M = 128;                          // query rows per query tile = the mask's block
constexpr int BLOCK_N = 128;                          // keys per K/V tile = the mask's block
constexpr int KV_STAGES = HEAD_DIM == 64 ? 3 : 2;     // K/V ring slots
constexpr int CONSUMERS = 2;
constexpr int NUM_THREADS = (1 + CONSUMERS) * WARPGROUP_THREADS;
constexpr int CONSUMER_THREADS = CONSUMERS * WARPGROUP_THREADS;
constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
constexpr int Q_TILE_BYTES = BLOCK_M * HEAD_DIM * 2;
constexpr int KV_TILE_BYTES = BLOCK_N * HEAD_DIM * 2;
constexpr int S_FRAGS = BLOCK_N / 8;
constexpr int O_FRAGS = HEAD_DIM / 8;
constexpr int P_STEPS = BLOCK_N / 16;
constexpr int TURN_BARRIER = 1;                       // named barriers 1, 2: consumer c's turn
constexpr int K_RING = Q_TILE_BYTES;
constexpr int V_RING = K_RING + KV_STAGES * KV_TILE_BYTES;
constexpr int BARRIERS = V_RING + KV_STAGES * KV_TILE_BYTES;
constexpr int Q_FULL = 0, Q_EMPTY = 1, K_FULL = 2, V_FULL = 2 + KV_STAGES, K_EMPTY = 2 + 2 * KV_STAGES,
              V_EMPTY = 2 + 3 * KV_STAGES, NUM_BARRIERS = 2 + 4 * KV_STAGES;
constexpr int SHARED_BYTES = BARRIERS + 8 * NUM_BARRIERS + SWIZZLE_ATOM_BYTES;  // + room to align the base
static_assert(SHARED_BYTES <= 227 * 1024, "an H100 block has at most 227 KB of shared memory");
static_assert(sizeof(elem_t) == 2, "16-bit elements");
static_assert(HEAD_DIM % ATOM_COLS == 0, "D is a whole number of 128-byte swizzle rows");

// The block mask and the element mask, as the kernel receives them.
struct Mask {
    const int *kv_num, *kv_indices, *full_num, *full_indices;  // the BlockMask's four tensors, [Qb] and [Qb, KVb]
    int kv_blocks;                                            // KVb: the indices' row length
    int window;                                               // for element_mask::sliding_window
    const int* document_ids;                                  // [S], for element_mask::document (read with
                                                              // __ldg: the kernel's parameter struct cannot say
                                                              // __restrict__)
    __device__ int full_count(int m) const { return full_num[m]; }
    __device__ int tiles(int m) const { return full_num[m] + kv_num[m]; }
    // The key block of query block m's tile t: its full blocks first, then its partial ones.
    __device__ int block(int m, int t, int full) const {
        return t < full ? full_indices[m * kv_blocks + t] : kv_indices[m * kv_blocks + t - full];
    }
};

// The units a block computes: unit u is query block order[u / batch_heads] of pair u % batch_heads.
struct Schedule {
    const int* order;
    int batch_heads, num_units;
    __device__ int pair(int unit) const { return unit % batch_heads; }
    __device__ int m_block(int unit) const { return order[unit / batch_heads]; }
};

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

__device__ __forceinline__ void init_barriers(const SharedMemory& shared) {
    mbarrier_init(shared.barrier(Q_FULL), 1);
    mbarrier_init(shared.barrier(Q_EMPTY), CONSUMER_THREADS);
    for (int s = 0; s < KV_STAGES; ++s) {
        mbarrier_init(shared.barrier(K_FULL + s), 1);
        mbarrier_init(shared.barrier(V_FULL + s), 1);
        mbarrier_init(shared.barrier(K_EMPTY + s), CONSUMER_THREADS);
        mbarrier_init(shared.barrier(V_EMPTY + s), CONSUMER_THREADS);
    }
    mbarrier_init_fence();
}

// --8<-- [start:producer]
// The producer: one thread loads each unit's Q, then the K/V tiles at the blocks its lists name.
// Units with empty lists load nothing (their Q is never read).
__device__ __forceinline__ void produce(const SharedMemory& shared, const Schedule& schedule, const Mask& mask,
                                        const TmaMap& q_map, const TmaMap& k_map, const TmaMap& v_map, int heads,
                                        int group) {
    tma_prefetch_map(q_map);
    tma_prefetch_map(k_map);
    tma_prefetch_map(v_map);
    int ring = 0, q_loads = 0;  // K/V tiles and Q tiles loaded so far by this block, as stage 4 counts them
    for (int unit = blockIdx.x; unit < schedule.num_units; unit += gridDim.x) {
        const int m = schedule.m_block(unit), pair = schedule.pair(unit);
        const int num_tiles = mask.tiles(m), full = mask.full_count(m);
        if (num_tiles == 0) continue;
        const int batch = pair / heads, head = pair % heads, kv_head = head / group;
        mbarrier_wait(shared.barrier(Q_EMPTY), (q_loads & 1) ^ 1);
        mbarrier_arrive_expect_tx(shared.barrier(Q_FULL), Q_TILE_BYTES);
        load_tile<BLOCK_M, HEAD_DIM>(shared.q_tile(), q_map, shared.barrier(Q_FULL), m * BLOCK_M, head, batch);
        ++q_loads;
        for (int tile = 0; tile < num_tiles; ++tile, ++ring) {
            const int stage = ring % KV_STAGES;
            const unsigned parity = (ring / KV_STAGES) & 1;
            // EXERCISE: load K, then V, of the key block `mask.block(m, tile, full)` (its first row:
            // that block times BLOCK_N) of KV head `kv_head` of `batch` into ring slot `stage`, each
            // after its empty barrier's wait, announced on its full barrier with KV_TILE_BYTES, as
            // stage 4's producer does for tile `tile`.
            // STUB: mbarrier_wait(shared.barrier(K_EMPTY + stage), parity ^ 1);
            // STUB: mbarrier_arrive_expect_tx(shared.barrier(K_FULL + stage), 0);  // arrives, loads nothing
            // STUB: mbarrier_wait(shared.barrier(V_EMPTY + stage), parity ^ 1);
            // STUB: mbarrier_arrive_expect_tx(shared.barrier(V_FULL + stage), 0);
            const int row0 = mask.block(m, tile, full) * BLOCK_N;
            mbarrier_wait(shared.barrier(K_EMPTY + stage), parity ^ 1);
            mbarrier_arrive_expect_tx(shared.barrier(K_FULL + stage), KV_TILE_BYTES);
            load_tile<BLOCK_N, HEAD_DIM>(shared.k_slot(stage), k_map, shared.barrier(K_FULL + stage), row0, kv_head,
                                         batch);
            mbarrier_wait(shared.barrier(V_EMPTY + stage), parity ^ 1);
            mbarrier_arrive_expect_tx(shared.barrier(V_FULL + stage), KV_TILE_BYTES);
            load_tile<BLOCK_N, HEAD_DIM>(shared.v_slot(stage), v_map, shared.barrier(V_FULL + stage), row0, kv_head,
                                         batch);
            // END EXERCISE
        }
    }
}
// --8<-- [end:producer]

// --8<-- [start:mask]
// The scores of one K/V tile (keys n0 .. n0 + BLOCK_N - 1) of the warp's rows `row` and `row + 8`
// (C-fragment layout, as mma.cuh's apply_mask): keys past S hidden, and in a partial tile the element
// mask. A full tile inside S needs neither, which one test per tile says (the same for every thread of
// the block): most tiles then cost nothing here. Hidden scores are selected, not branched to, and the
// keys' documents (document masks) are read whatever the test says, at a key clamped inside S.
// ids[0], ids[1]: the documents of the two rows.
__device__ __forceinline__ void mask_tile(float (&s)[S_FRAGS][4], int n0, int row, int seq, bool partial,
                                          const Mask& mask, const int (&ids)[2], int lane) {
    if (!partial && n0 + BLOCK_N <= seq) return;
    const bool element = MASK != element_mask::none && partial;
#pragma unroll
    for (int n = 0; n < S_FRAGS; ++n) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int key = n0 + 8 * n + 2 * (lane % 4) + c % 2, query = row + 8 * (c / 2);
            const int key_doc = MASK == element_mask::document ? __ldg(mask.document_ids + min(key, seq - 1)) : 0;
            const bool hidden = (key >= seq) | (element & !element_visible(key, query, mask.window, key_doc, ids[c / 2]));
            s[n][c] = hidden ? -INFINITY : s[n][c];
        }
    }
}
// --8<-- [end:mask]

struct Output {
    elem_t* o;
    long long batch_stride, head_stride;
    int row_stride, heads;
    __device__ elem_t* head_rows(int pair) const {
        return o + (pair / heads) * batch_stride + (pair % heads) * head_stride;
    }
};

// --8<-- [start:consumer]
// Consumer `consumer` (0 or 1): stage 4's rounds -- S_0 alone, then S_j with P_{j-1}·V_{j-1}, then the
// last P·V, their steps from wgmma_attention.cuh -- over the unit's listed tiles, masking each as its
// list says.
__device__ __forceinline__ void consume(const SharedMemory& shared, const Schedule& schedule, const Mask& mask,
                                        int consumer, const Output& out, float* lse, int seq, float scale) {
    const int lane = threadIdx.x % 32, warp_in_group = threadIdx.x / 32 % 4;
    const Turns<CONSUMER_THREADS> turns(TURN_BARRIER, consumer);
    const float scale_log2 = scale * LOG2E;
    if (consumer == 1) named_barrier_arrive(TURN_BARRIER + 0, CONSUMER_THREADS);

    int ring = 0, q_loads = 0;
    for (int unit = blockIdx.x; unit < schedule.num_units; unit += gridDim.x) {
        const int m = schedule.m_block(unit), pair = schedule.pair(unit);
        const int num_tiles = mask.tiles(m), full = mask.full_count(m);
        const int warp_m0 = m * BLOCK_M + consumer * 64 + warp_in_group * 16;  // this warp's 16 rows
        const int row = warp_m0 + lane / 4;
        int ids[2] = {0, 0};
        if (MASK == element_mask::document)
            for (int r = 0; r < 2; ++r) ids[r] = row + 8 * r < seq ? __ldg(mask.document_ids + row + 8 * r) : -1;

        float o_acc[O_FRAGS][4] = {};
        float s[S_FRAGS][4];
        unsigned p[P_STEPS][4];
        float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f}, correction[2];

        if (num_tiles > 0) {
            mbarrier_wait(shared.barrier(Q_FULL), q_loads & 1);
            ++q_loads;

            // Round 0: S_0 alone. Each tile's key block is read before its waits: the load is in flight
            // while the tile's products run, not after them, on the way to the softmax.
            const int first_n0 = mask.block(m, 0, full) * BLOCK_N, first = ring % KV_STAGES;
            mbarrier_wait(shared.barrier(K_FULL + first), (ring / KV_STAGES) & 1);
            issue_scores<BLOCK_M, BLOCK_N, HEAD_DIM>(s, shared.q_tile(), shared.k_slot(first), consumer, turns);
            wait_scores<0>(s, shared, first, num_tiles == 1);
            mask_tile(s, first_n0, row, seq, full == 0, mask, ids, lane);
            softmax_to_p(s, row_max, row_sum, correction, scale_log2);
            p_operands(s, p);

            for (int tile = 1; tile < num_tiles; ++tile) {
                const int k = ring + tile;
                const int stage = k % KV_STAGES, prev = (k - 1) % KV_STAGES;
                const int n0 = mask.block(m, tile, full) * BLOCK_N;
                mbarrier_wait(shared.barrier(K_FULL + stage), (k / KV_STAGES) & 1);
                mbarrier_wait(shared.barrier(V_FULL + prev), ((k - 1) / KV_STAGES) & 1);
                issue_scores_and_pv<BLOCK_M, BLOCK_N, HEAD_DIM>(s, o_acc, p, shared.q_tile(), shared.k_slot(stage),
                                                                shared.v_slot(prev), consumer, turns);
                wait_scores<1>(s, shared, stage, tile == num_tiles - 1);
                mask_tile(s, n0, row, seq, tile >= full, mask, ids, lane);
                softmax_to_p(s, row_max, row_sum, correction, scale_log2);
                wait_pv(o_acc, p, shared, prev);
                rescale_accumulator(o_acc, correction);
                p_operands(s, p);
            }

            const int k = ring + num_tiles - 1, last = k % KV_STAGES;
            mbarrier_wait(shared.barrier(V_FULL + last), (k / KV_STAGES) & 1);
            issue_last_pv<BLOCK_N, HEAD_DIM>(o_acc, p, shared.v_slot(last), turns);
            turns.pass();
            wait_pv(o_acc, p, shared, last);
            ring += num_tiles;
        }
        // An empty unit writes its zeros and -inf straight away (row_sum is 0).
        write_output_or_empty(o_acc, row_max, row_sum, scale, out.head_rows(pair), lse + (size_t)pair * seq, warp_m0,
                              seq, lane, out.row_stride);
    }
    // Consumer 1 arrived on consumer 0's turn once more than consumer 0 synced (its first arrival, then
    // one per turn, whichever unit was its last with tiles): consumer 0 takes that last turn here, so
    // no named barrier is left half-arrived.
    if (consumer == 0) named_barrier_sync(TURN_BARRIER + 0, CONSUMER_THREADS);
}
// --8<-- [end:consumer]

// The kernel's parameters besides its tensor maps (__init__.py's BlockSparseParams packs them): O as HeadRows
// take it (Output), the LSE [B, H, S], the schedule's order of query blocks (Schedule), the BlockMask's lists and
// the element mask's (Mask).
struct BlockSparseParams {
    elem_t* o;
    long long o_batch_stride, o_head_stride;
    int o_row_stride;
    int heads;
    float* lse;
    int seq;
    float scale;
    int batch_heads, group;
    const int *kv_num, *kv_indices, *full_num, *full_indices;
    int kv_blocks;
    const int* order;
    int num_q_blocks, window;
    const int* document_ids;
};

extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
block_sparse_attention_fwd(const __grid_constant__ TmaMap q_map, const __grid_constant__ TmaMap k_map,
                           const __grid_constant__ TmaMap v_map, const __grid_constant__ BlockSparseParams p) {
    extern __shared__ __align__(SWIZZLE_ATOM_BYTES) unsigned char shared_raw[];
    const SharedMemory shared{atom_aligned(shared_address(shared_raw))};
    const Schedule schedule{p.order, p.batch_heads, p.num_q_blocks * p.batch_heads};
    const Mask mask{p.kv_num, p.kv_indices, p.full_num, p.full_indices, p.kv_blocks, p.window, p.document_ids};
    if (threadIdx.x == 0) init_barriers(shared);
    __syncthreads();

    const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) produce(shared, schedule, mask, q_map, k_map, v_map, p.heads, p.group);
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const Output out{p.o, p.o_batch_stride, p.o_head_stride, p.o_row_stride, p.heads};
        consume(shared, schedule, mask, warpgroup - 1, out, p.lse, p.seq, p.scale);
    }
}
