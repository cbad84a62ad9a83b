// Stage 3 — an asynchronous cp.async pipeline with swizzled shared memory.
//
// New here: tiles are copied global -> shared by cp.async, which needs no registers and does
// not stall the thread, in a ring of KV_STAGES buffers: K and V of the next tiles are in flight
// while tile j is multiplied, so after the first tile no warp waits for memory (the copies were
// issued a whole tile of math earlier -- the V copy included, long before the softmax that
// precedes P·V). Shared memory is unpadded and swizzled instead: the 16-byte chunk index of each
// row is XORed with the row, so both the cp.async stores and the ldmatrix reads hit 8 distinct
// groups of banks. The warp-level math is stage 2's (mma.cuh); blocks grow to 128 query rows so
// that each K/V tile fetched from L2 serves 128 rows. At D = 128 the online softmax rescales O
// lazily, only when a running max grows by more than 2^8 (online_softmax_lazy).
//
// Per block: BLOCK_M = 128 query rows and K/V tiles of BLOCK_N = 64 keys in a ring of 2 buffers;
// the warps depend on D (see the configuration below).
//   D = 64:  8 warps × 16 rows. Every warp reads the whole K/V tile through ldmatrix for its 16
//            rows: 16 FLOPs per byte of shared memory, the budget that binds. Registers 128 (the
//            cap for 2 blocks), shared 16 + 32 = 48 KB: 2 blocks = 16 warps per SM.
//   D = 128: 4 warps × 32 rows (two m16 tiles that share every K/V fragment), the shape of the
//            hdim-128 kernel of SDPA's flash backend (FlashAttention-2). Q is re-read from shared
//            memory each tile (its 64 registers do not fit beside O's 128 and S's 64): per warp
//            and tile 80 ldmatrix.x4 (Q 16, K 32, V 32) for 256 mma, 25.6 FLOPs per byte where
//            16 rows per warp gave 16. Registers 255 (the cap for 2 blocks of 128 threads; no
//            spills), shared 32 + 64 = 96 KB: 2 blocks = 8 warps per SM on Hopper (228 KB), in two
//            independent blocks -- one block's barrier wait is the other's turn (an A100's 164 KB
//            hold one block). 64-key tiles fit in 255 registers only with two economies, the
//            cp.async address code of load_tile_from_base (swizzle.cuh) and the lazy rescale of
//            online_softmax_lazy: without the first ptxas spills 96 bytes, without the second 36.
// (Predictions and measurements, 64-key tiles against 32-key ones at D = 128: docs/notebook/stage3.md.)
//
// Tensors are [B, H, S, D], K and V [B, H_kv, S, D], contiguous (grouped-query attention: H / H_kv
// query heads read one KV head); blockIdx.z walks the B·H_kv KV (batch, head) pairs, blockIdx.y the
// gridDim.y = H / H_kv query heads of each: query pair blockIdx.z · gridDim.y + blockIdx.y.
// Causal masking is top-left aligned, as in PyTorch: query i sees keys j <= i.
#include "mma.cuh"
#include "cp_async.cuh"
#include "swizzle.cuh"  // swizzle<ROW_BYTES> and the cp.async copies of a tile

// The tile configuration, per head dimension. A warp owns M_TILES m16 tiles (16 query rows each)
// and keeps, in fp32 registers, O (M_TILES·D/2) and S (M_TILES·BLOCK_N/2) -- the count decides.
//   D = 64:  8 warps × 1 m-tile. O 32 + S 32 + Q fragments 16 (kept for the whole loop) fit the
//            cap of 128 registers that 2 blocks of 256 threads per SM impose.
//   D = 128: 4 warps × 2 m-tiles (32 rows each, as FlashAttention-2), so that each K/V fragment
//            read by ldmatrix feeds the mma of 32 rows, not 16. O alone is 128 registers and S 64
//            more, and 2 blocks of 128 threads cap a thread at 255: Q's fragments (64 more) stay
//            in shared memory, re-read one k-step at a time every tile. Shared memory, 32 KB of Q
//            + 2 buffers × 32 KB of K and V = 96 KB, lets 2 blocks share an H100's SM.
constexpr int M_TILES = HEAD_DIM == 64 ? 1 : 2;     // m16 tiles per warp
constexpr int NUM_WARPS = HEAD_DIM == 64 ? 8 : 4;
constexpr int WARP_ROWS = 16 * M_TILES;             // query rows per warp
constexpr int BLOCK_M = NUM_WARPS * WARP_ROWS;      // query rows per block: 128 either way
constexpr int BLOCK_N = 64;                         // keys per K/V tile
constexpr int KV_STAGES = 2;                        // K/V buffers in the ring: tile j+1 loads during tile j
constexpr int NUM_THREADS = NUM_WARPS * 32;
constexpr int MIN_BLOCKS_PER_SM = 2;                // caps registers at 65536 / (2 · NUM_THREADS)
constexpr bool Q_IN_REGISTERS = M_TILES == 1;       // else re-read from shared memory every tile
constexpr bool LAZY_RESCALE = HEAD_DIM == 128;      // online_softmax_lazy; else mma.cuh's exact online_softmax
constexpr int Q_HELD_STEPS = Q_IN_REGISTERS ? HEAD_DIM / 16 : 1;  // k-steps of Q fragments held at once
constexpr int ROW_BYTES = HEAD_DIM * 2;       // rows are not padded: the swizzle does that job
constexpr int Q_TILE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int KV_TILE_BYTES = BLOCK_N * ROW_BYTES;
constexpr int SHARED_BYTES = Q_TILE_BYTES + 2 * KV_STAGES * KV_TILE_BYTES;  // Q, the K ring, the V ring
constexpr int D_STEPS = HEAD_DIM / 16;        // k-steps of Q·Kᵀ (16 columns of d each)
constexpr int S_FRAGS = BLOCK_N / 8;          // n8 fragments of an m-tile's 16 × BLOCK_N scores
constexpr int O_FRAGS = HEAD_DIM / 8;         // n8 fragments of an m-tile's 16 × D output
static_assert(sizeof(elem_t) == 2, "ldmatrix and the chunk arithmetic assume 16-bit elements");

// The copies of a Q, K or V tile into its swizzled buffer (swizzle.cuh): one index per copy at
// D = 64, one shared and one global base at D = 128 -- at each D the form that fits the register
// cap without spilling (see load_tile_from_base).
template <int TILE_ROWS>
__device__ __forceinline__ void load_tile_async(unsigned tile, const elem_t* source, int rows) {
    if constexpr (HEAD_DIM == 64)
        load_tile_by_index<TILE_ROWS, HEAD_DIM, NUM_THREADS>(tile, source, rows);
    else
        load_tile_from_base<TILE_ROWS, HEAD_DIM, NUM_THREADS, /*UNPREDICATED_WHOLE_TILES=*/true>(tile, source, rows);
}

// Issues the copies of K and V tile `tile` into ring buffer tile % KV_STAGES.
__device__ __forceinline__ void load_kv_tile_async(unsigned k_ring, unsigned v_ring, const elem_t* k_head,
                                                   const elem_t* v_head, int tile, int seq_kv) {
    const int n0 = tile * BLOCK_N;
    const unsigned buffer = (tile % KV_STAGES) * KV_TILE_BYTES;
    load_tile_async<BLOCK_N>(k_ring + buffer, k_head + (size_t)n0 * HEAD_DIM, seq_kv - n0);
    load_tile_async<BLOCK_N>(v_ring + buffer, v_head + (size_t)n0 * HEAD_DIM, seq_kv - n0);
}

// The warp-level math of stage 2, reading swizzled tiles: the lane -> (row, chunk) mapping of
// ldmatrix is unchanged (mma.cuh), only the address of a chunk is now swizzle<ROW_BYTES>(row, chunk).
// The A operand of Q for k-step kk of the 16 rows from tile row `row0` on.
__device__ __forceinline__ void load_q_fragment(unsigned (&a)[4], unsigned q_tile, int row0, int kk, int lane) {
    ldmatrix_x4(a, q_tile + swizzle<ROW_BYTES>(row0 + a_order_row(lane), 2 * kk + a_order_chunk(lane)));
}

// S[WARP_ROWS × BLOCK_N] = Q · Kᵀ for the warp's M_TILES m-tiles (see stage 2),
// each K fragment read once and used by every m-tile. Q's fragments come from
// q_frag (Q_IN_REGISTERS) or are read from the warp's rows of the Q tile, starting at q_row0.
__device__ __forceinline__ void warp_scores(float (&s)[M_TILES][S_FRAGS][4],
                                            const unsigned (&q_frag)[M_TILES][Q_HELD_STEPS][4], unsigned q_tile,
                                            int q_row0, unsigned k_tile, int lane) {
    const int row = b_order_row(lane), chunk = b_order_chunk(lane);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int n = 0; n < S_FRAGS; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.0f;
    // Loops over the k-steps kk and the 16-key blocks n16, in one of two orders. Q in registers
    // (D = 64): n16 outer, as in stage 2. Q re-read (D = 128): kk outer, so that each Q fragment
    // is read from shared memory once per tile and used for all BLOCK_N keys.
    constexpr int OUTER = Q_IN_REGISTERS ? BLOCK_N / 16 : D_STEPS;
    constexpr int INNER = Q_IN_REGISTERS ? D_STEPS : BLOCK_N / 16;
#pragma unroll
    for (int i = 0; i < OUTER; ++i) {
        unsigned q_read[M_TILES][4];  // k-step kk = i of Q, when it is read from shared memory
        if (!Q_IN_REGISTERS) {
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) load_q_fragment(q_read[mt], q_tile, q_row0 + 16 * mt, i, lane);
        }
#pragma unroll
        for (int j = 0; j < INNER; ++j) {
            const int n16 = Q_IN_REGISTERS ? i : j, kk = Q_IN_REGISTERS ? j : i;
            unsigned k_frag[4];  // b[0], b[1] of keys 16·n16 + 0..7, then of keys + 8..15
            ldmatrix_x4(k_frag, k_tile + swizzle<ROW_BYTES>(16 * n16 + row, 2 * kk + chunk));
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                const unsigned (&a)[4] = *(Q_IN_REGISTERS ? &q_frag[mt][kk % Q_HELD_STEPS] : &q_read[mt]);
                mma_m16n8k16<elem_t>(s[mt][2 * n16], a, k_frag[0], k_frag[1]);
                mma_m16n8k16<elem_t>(s[mt][2 * n16 + 1], a, k_frag[2], k_frag[3]);
            }
        }
    }
}

// O[WARP_ROWS × D] += P · V, P straight from the registers of S (see stage 2); each V fragment
// is read once and used by every m-tile.
__device__ __forceinline__ void warp_pv(float (&o)[M_TILES][O_FRAGS][4], const float (&p)[M_TILES][S_FRAGS][4],
                                        unsigned v_tile, int lane) {
    const int row = a_order_row(lane), chunk = a_order_chunk(lane);
#pragma unroll
    for (int k16 = 0; k16 < BLOCK_N / 16; ++k16) {
        unsigned p_frag[M_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) p_as_a_operand(p[mt], k16, p_frag[mt]);
#pragma unroll
        for (int d16 = 0; d16 < D_STEPS; ++d16) {
            unsigned v_frag[4];
            ldmatrix_x4_trans(v_frag, v_tile + swizzle<ROW_BYTES>(16 * k16 + row, 2 * d16 + chunk));
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_m16n8k16<elem_t>(o[mt][2 * d16], p_frag[mt], v_frag[0], v_frag[1]);
                mma_m16n8k16<elem_t>(o[mt][2 * d16 + 1], p_frag[mt], v_frag[2], v_frag[3]);
            }
        }
    }
}

// --8<-- [start:lazy_rescale]
// The online softmax with a lazy rescale: FlashAttention-4's "conditional rescaling", used at
// D = 128. mma.cuh's online_softmax moves a row's running max whenever it grows, and rescales O
// and the row sum by 2^(old max - new max) each time: at D = 128, 128 FMULs per thread and tile
// (O is 2 m-tiles × 64 registers). Here the maxes move only when some row of the warp's m-tile
// grew by more than 8 in log2 units (a factor 2^8); otherwise every row keeps its stale max, and
// its p = 2^(s·scale_log2 - max·scale_log2) may exceed 1, up to 2^8 = 256 -- a range that fp16,
// bf16 and the fp32 accumulators hold with the same relative precision as [0, 1]. Nothing is
// lost: O and the row sum carry the same factor 2^(true max - stale max), which the final
// O / sum cancels, and LSE = scale·max + log(sum) takes the max the sum was taken with. The
// decision is warp-wide (__any_sync), so the rescale is a branch the warp takes or skips as one;
// once the row maxes have settled, it skips it. Besides the FMULs, this saves the registers that
// let BLOCK_N = 64 fit in 255 at D = 128: with the exact update ptxas spills (36 bytes, sm_90a).
// D = 64 keeps the exact update: there the lazy one spills 12 bytes (sm_90a, cap 128), and it
// has not been measured.
constexpr float RESCALE_THRESHOLD_LOG2 = 8.0f;

// Moves the running maxes to new_max and rescales O and the row sums to match.
template <int D_FRAGS>
__device__ __forceinline__ void rescale(float (&o)[D_FRAGS][4], float (&row_max)[2], float (&row_sum)[2],
                                        const float (&new_max)[2], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float max_scaled = scaled_max(new_max[r], scale_log2);
        const float correction = fast_exp2(row_max[r] * scale_log2 - max_scaled);
        row_max[r] = new_max[r];
        row_sum[r] *= correction;
#pragma unroll
        for (int d = 0; d < D_FRAGS; ++d) {
            o[d][2 * r] *= correction;
            o[d][2 * r + 1] *= correction;
        }
    }
}

// s (raw scores, masked ones -inf) becomes P; o, row_max and row_sum as in online_softmax.
template <int N_FRAGS, int D_FRAGS>
__device__ __forceinline__ void online_softmax_lazy(float (&s)[N_FRAGS][4], float (&o)[D_FRAGS][4],
                                                    float (&row_max)[2], float (&row_sum)[2], float scale_log2) {
    float new_max[2];
    bool grew_past_threshold = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        new_max[r] = fmaxf(row_max[r], tile_row_max(s, r));
        // From -inf (no key seen yet) to a finite max: inf > threshold, a rescale (by 0). While
        // both are -inf: NaN, which compares false, and there is nothing to rescale.
        grew_past_threshold |= (new_max[r] - row_max[r]) * scale_log2 > RESCALE_THRESHOLD_LOG2;
    }
    if (__any_sync(0xffffffffu, grew_past_threshold)) rescale(o, row_max, row_sum, new_max, scale_log2);
#pragma unroll
    for (int r = 0; r < 2; ++r) row_sum[r] += exponentiate_row(s, r, scale_log2, scaled_max(row_max[r], scale_log2));
}
// --8<-- [end:lazy_rescale]

// The block's query (batch, head) pair, blockIdx.z · gridDim.y + blockIdx.y, from blockIdx read again
// where it is used (volatile asm: not held in registers since the kernel's start). At D = 64 the
// 128-register cap has no room for the query pair beside the KV pair through the loop: held, ptxas
// spills 8 bytes at sm_80 and 16 at sm_90a.
__device__ __forceinline__ size_t query_pair() {
    unsigned y, z;
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    return (size_t)z * gridDim.y + y;
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS, MIN_BLOCKS_PER_SM)
attention_fwd(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
              elem_t* __restrict__ o, float* __restrict__ lse, int seq_q, int seq_kv, float scale, int causal) {
    // [Q tile][K ring: KV_STAGES tiles][V ring: KV_STAGES tiles], all swizzled. The swizzle
    // assumes every tile starts on a 128-byte boundary: the tiles are multiples of 128 bytes.
    extern __shared__ __align__(128) unsigned char shared_bytes[];
    const unsigned q_tile = shared_address(shared_bytes);
    const unsigned k_ring = q_tile + Q_TILE_BYTES;
    const unsigned v_ring = k_ring + KV_STAGES * KV_TILE_BYTES;

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int m0 = blockIdx.x * BLOCK_M;      // first query row of the block
    const int q_row0 = warp * WARP_ROWS;      // first row of this warp in the Q tile
    const int warp_m0 = m0 + q_row0;          // first query row of this warp
    const size_t head = (size_t)blockIdx.z * gridDim.y + blockIdx.y;  // the query (batch, head) pair
    const size_t kv_offset = (size_t)blockIdx.z * seq_kv * HEAD_DIM;  // the K and V of its KV pair
#define k_head (k + kv_offset)
#define v_head (v + kv_offset)

    // Causal: keys from m0 + BLOCK_M on are masked for every row of the block: never loaded.
    const int kv_end = causal ? min(seq_kv, m0 + BLOCK_M) : seq_kv;
    const int num_tiles = (kv_end + BLOCK_N - 1) / BLOCK_N;

    // --8<-- [start:pipeline]
    // Prologue: Q, then the first KV_STAGES - 1 K/V tiles, each its own commit group.
    load_tile_async<BLOCK_M>(q_tile, q + (head * seq_q + m0) * HEAD_DIM, seq_q - m0);
    cp_async_commit();
    for (int tile = 0; tile < KV_STAGES - 1; ++tile) {
        if (tile < num_tiles) load_kv_tile_async(k_ring, v_ring, k_head, v_head, tile, seq_kv);
        cp_async_commit();  // committed even when empty, so that group counts stay uniform
    }
    cp_async_wait<KV_STAGES - 1>();  // the oldest group, Q, has landed (K/V may still be in flight)
    __syncthreads();                 // ... for every thread's copies, not only this thread's
    unsigned q_frag[M_TILES][Q_HELD_STEPS][4];
    if (Q_IN_REGISTERS) {  // load them once, for good; else warp_scores reads them tile by tile
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int kk = 0; kk < Q_HELD_STEPS; ++kk) load_q_fragment(q_frag[mt][kk], q_tile, q_row0 + 16 * mt, kk, lane);
    }

    float o_acc[M_TILES][O_FRAGS][4] = {};
    float row_max[M_TILES][2], row_sum[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.0f;
    }
    const float scale_log2 = scale * LOG2E;

    for (int tile = 0; tile < num_tiles; ++tile) {
        // EXERCISE: keep the ring full. Wait until this thread's copies of `tile` have landed
        // (cp_async_wait: of the groups committed so far, only the newest KV_STAGES - 2 may
        // still be in flight), then __syncthreads(): all threads' copies are visible, and every
        // warp is done with tile - 1, whose buffer is the one to refill. Then issue the copies of
        // tile + KV_STAGES - 1 (if it exists) with load_kv_tile_async, and commit the group --
        // also when it is empty, so that the count in the wait above stays right.
        // STUB: cp_async_wait<0>();  // waits for the prologue's copies, but nothing refills the ring:
        // STUB: __syncthreads();      // from the second tile on, the buffers hold stale data (wrong results)
        cp_async_wait<KV_STAGES - 2>();
        __syncthreads();
        const int next = tile + KV_STAGES - 1;
        if (next < num_tiles) load_kv_tile_async(k_ring, v_ring, k_head, v_head, next, seq_kv);
        cp_async_commit();
        // END EXERCISE

        // Tile `tile` is in shared memory and stays there until the next iteration's barrier.
        const unsigned buffer = (tile % KV_STAGES) * KV_TILE_BYTES;
        const int n0 = tile * BLOCK_N;
        if (causal && n0 > warp_m0 + WARP_ROWS - 1) continue;  // above the diagonal for all rows of this warp
        float s[M_TILES][S_FRAGS][4];
        warp_scores(s, q_frag, q_tile, q_row0, k_ring + buffer, lane);
        const bool crosses_end = n0 + BLOCK_N > seq_kv;
        const bool crosses_diagonal = causal && n0 + BLOCK_N - 1 > warp_m0;
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            if (crosses_end || crosses_diagonal) apply_mask(s[mt], n0, warp_m0 + 16 * mt + lane / 4, seq_kv, causal, lane);
            if constexpr (LAZY_RESCALE)
                online_softmax_lazy(s[mt], o_acc[mt], row_max[mt], row_sum[mt], scale_log2);
            else
                online_softmax(s[mt], o_acc[mt], row_max[mt], row_sum[mt], scale_log2);
        }
        warp_pv(o_acc, s, v_ring + buffer, lane);
    }
    // --8<-- [end:pipeline]

#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
        write_output(o_acc[mt], row_max[mt], row_sum[mt], scale, o + query_pair() * seq_q * HEAD_DIM,
                     lse + query_pair() * seq_q, warp_m0 + 16 * mt, seq_q, lane);
#undef k_head
#undef v_head
}
