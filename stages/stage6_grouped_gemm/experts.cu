// Stage 6 — grouped GEMM: every expert's SwiGLU FFN in two launches (TMA + wgmma). sm_90a only.
//
// After stage 5 the token-slots sit in expert-contiguous order: expert e owns rows offsets[e] ..
// offsets[e+1] - 1 of x_perm, its segment padded to a multiple of BLOCK_M = 128 rows (whose results
// nobody reads: the padding rows repeat a token-slot, see stage 7's gather_rows).
// Two kernels then compute, for every expert at once,
//   expert_up_swiglu   h[rows of e] = silu(x·W1[e][:, :I]) * (x·W1[e][:, I:])    [rows, I]
//   expert_down        y[rows of e] = h · W2[e]                                   [rows, hidden]
// and, for a forward whose backward follows (stage 14), expert_up_swiglu_saving: expert_up_swiglu
// that also stores h1 = x·W1[e] = [G U] [rows, 2·I], the product SwiGLU's backward needs.
// New here, after stage 4's TMA/wgmma/warp-specialization machinery:
//   a device-side tile scheduler  the grid is one block per SM whatever the routing; each block
//            walks the (expert, n, m) tiles t = blockIdx.x, + gridDim.x, ... and finds the expert of
//            a tile from the offsets (a binary search in shared memory). The host never reads the
//            counts: no synchronization between routing and GEMMs, one launch per GEMM.
//   a fused epilogue  the up kernel loads the gate and the up columns of W1 side by side as one
//            256-wide B tile, so each thread holds gate[c] and up[c] of the same (row, column) and
//            writes silu(gate)·up: the 2·I-wide product never reaches memory.
//   a GEMM main loop  a 3-deep ring of (A 128×64, B 64×256) stages filled by TMA; each consumer
//            warpgroup issues 4 wgmma.m64n256k16 per stage and releases the stage one stage later
//            (one batch stays in flight, so the tensor cores never wait for the warps).
//   an asynchronous epilogue  each consumer writes its 64 output rows into shared memory in the
//            layout TMA reads (128-byte swizzle), one thread copies them out with a TMA store, and
//            the warpgroup starts the next tile's main loop while the copy runs.
//
// Per tile: 128 rows × 256 B columns, K in steps of 64. FLOPs per stage 2·128·256·64 = 4.2 M for
//   48 KB of shared memory written by TMA (87 FLOPs per byte); each consumer's wgmmas read its 8 KB
//   of A and the whole 32 KB of B per stage: 52 FLOPs per byte of shared memory read.
// Registers: consumers 232 (the accumulator is 128 floats a thread), producer 40:
//   232·256 + 40·128 = 64512 <= 65536. Shared memory: 3 × 48 KB of ring + 2 × 32 KB of output tiles
//   + offsets + barriers (+1 KB to align) = 210 KB: one block per SM.
// Tile order, for L2: inside an expert, m fastest (t → n = local / m_tiles, m = local % m_tiles):
//   the 132 blocks running at once share a few 256-column panels of W (each read from memory once)
//   and the expert's rows (16 MB at 2048 rows × 4096), both held in the 50 MB L2; n fastest instead
//   was twice as slow.
// The epilogue stages its outputs for TMA stores that overlap the next tile's main loop: the
//   structure that pays wherever the epilogue is exposed. (Predictions and the A/B runs behind these
//   choices: docs/notebook/stage6.md.)
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "moe.cuh"
#include "swizzle.cuh"  // swizzle<SWIZZLE_BYTES>: TMA's 128-byte swizzle, for the epilogue's stores
#include "stage6_grouped_gemm/schedule.cuh"  // BLOCK_M = 128 rows per tile (2 consumer warpgroups × 64), Scheduler

constexpr int BLOCK_N = 256;                            // B columns per tile: one wgmma n256
constexpr int BLOCK_K = 64;                             // K per stage: one 128-byte swizzle row
constexpr int STAGES = 3;                               // ring slots (4 ran no faster)
constexpr int CONSUMERS = 2;
constexpr int CONSUMER_ROWS = BLOCK_M / CONSUMERS;      // a consumer warpgroup's rows: one wgmma m64
constexpr int NUM_THREADS = (1 + CONSUMERS) * WARPGROUP_THREADS;  // + the producer warpgroup
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
constexpr int BOX_COLS = SWIZZLE_BYTES / 2;             // a 128-byte-swizzled TMA box is 64 elements wide
constexpr int B_BOXES = BLOCK_N / BOX_COLS;
constexpr int A_BYTES = BLOCK_M * BLOCK_K * 2;          // 16 KB
constexpr int B_BOX_BYTES = BLOCK_K * BOX_COLS * 2;     // 8 KB
constexpr int STAGE_BYTES = A_BYTES + B_BOXES * B_BOX_BYTES;
constexpr int ACC_FRAGS = BLOCK_N / 8;                  // a warp's accumulator: float[32][4]
constexpr int OUT_BOX_BYTES = CONSUMER_ROWS * BOX_COLS * 2;  // a 64-row × 64-column box of the output: 8 KB
constexpr int EPILOGUE_BYTES = CONSUMER_ROWS * BLOCK_N * 2;  // a consumer's output rows, at most 256 wide
// Layout of the dynamic shared memory, from a 1024-byte-aligned base.
constexpr int EPILOGUE = STAGES * STAGE_BYTES;          // each consumer's output tile, on its way out
constexpr int OFFSETS = EPILOGUE + CONSUMERS * EPILOGUE_BYTES;  // the experts' row offsets, E+1 ints
constexpr int BARRIERS = OFFSETS + 4 * (MAX_EXPERTS + 2);
constexpr int FULL = 0, EMPTY = STAGES;                 // mbarriers: full[s], empty[s]
constexpr int SHARED_BYTES = BARRIERS + 8 * 2 * STAGES + SWIZZLE_ATOM_BYTES;  // + room to align the base to an atom
static_assert(SHARED_BYTES <= 227 * 1024, "an H100 block has at most 227 KB of shared memory");
static_assert(BARRIERS % 8 == 0, "mbarriers are 8-byte aligned");
static_assert(sizeof(elem_t) == 2, "16-bit elements");

// The TMA column of B box b for output column tile n. SwiGLU: boxes 0-1 are the gate columns
// 128n .. 128n+127 and boxes 2-3 the up columns, `up` = inter further right -- so the 256-wide
// accumulator holds gate and up of 128 output columns. Without: boxes 0-3 are columns 256n ...
template <bool SWIGLU>
__device__ __forceinline__ int b_column(int n, int box, int up) {
    if (SWIGLU) return n * (BLOCK_N / 2) + (box % 2) * BOX_COLS + (box / 2) * up;
    return n * BLOCK_N + box * BOX_COLS;
}

// --8<-- [start:mainloop]
// One consumer warpgroup's 64 × 256 accumulator over the whole K: each stage, wait until its A and B
// have landed, issue 4 wgmmas (k = 16 each: 32 bytes further along A's swizzled rows, 16 rows
// further down B), then wait for the PREVIOUS stage's batch only and hand that slot back to the
// producer. `it` counts the stages consumed by this block so far (slot it % STAGES, its use number
// it / STAGES gives the phase to wait for).
__device__ __forceinline__ void mainloop(float (&acc)[ACC_FRAGS][4], unsigned base, int consumer, int k_blocks,
                                         int& it) {
    const bool lane0 = threadIdx.x % 32 == 0;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int stage = it % STAGES;
        const unsigned a_tile = base + stage * STAGE_BYTES, b_tile = a_tile + A_BYTES;
        mbarrier_wait(base + BARRIERS + 8 * (FULL + stage), (it / STAGES) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
            // A (K-major): this consumer's 64 rows, 8-row groups 1024 bytes apart.
            const u64 a =
                make_smem_desc(a_tile + consumer * CONSUMER_ROWS * SWIZZLE_BYTES + kk * 32, 16, SWIZZLE_ATOM_BYTES);
            // B (MN-major): k runs down the 128-byte rows; the 64-column boxes are LBO apart.
            const u64 b = make_smem_desc(b_tile + kk * 16 * SWIZZLE_BYTES, B_BOX_BYTES, SWIZZLE_ATOM_BYTES);
            wgmma_ss<elem_t, BLOCK_N, MN_MAJOR>(acc, a, b, kb > 0 || kk > 0);
        }
        wgmma_commit();
        wgmma_wait<1>();  // the previous stage's wgmmas are done reading its slot
        if (kb > 0 && lane0) mbarrier_arrive(base + BARRIERS + 8 * (EMPTY + (it - 1) % STAGES));
    }
    wgmma_wait<0>();
    fence_registers(acc);
    if (lane0) mbarrier_arrive(base + BARRIERS + 8 * (EMPTY + (it - 1) % STAGES));
}
// --8<-- [end:mainloop]

// --8<-- [start:epilogue]
// A consumer's 64 × OUT_COLS results into its shared-memory buffer, as the 64-column boxes the TMA
// store copies out: 64 rows of 128 bytes each, 16-byte chunk c of row r at position c ^ (r % 8) (the
// 128-byte swizzle, stage 3's swizzle<SWIZZLE_BYTES>). Entry j of a warp's float[32][4] is rows g, g+8 ×
// columns 8j + 2t, +1 of its 16 rows (g = lane / 4, t = lane % 4): for one j the 8 rows g land in 8
// different chunks, so the 32 lanes' 4-byte stores hit 32 different banks. SwiGLU: entry j (j < 16) holds gate columns and entry
// j + 16 the up columns of the same outputs.
template <bool SWIGLU>
__device__ __forceinline__ void stage_tile(const float (&acc)[ACC_FRAGS][4], unsigned char* buffer, int warp_in_group,
                                           int lane) {
    constexpr int OUT_FRAGS = SWIGLU ? ACC_FRAGS / 2 : ACC_FRAGS;
#pragma unroll
    for (int j = 0; j < OUT_FRAGS; ++j) {
        const int box = j / 8, chunk = j % 8;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float v0 = acc[j][2 * half], v1 = acc[j][2 * half + 1];
            if (SWIGLU) {
                // EXERCISE: apply SwiGLU, silu(gate) * up (silu: moe.cuh): v0, v1 hold the gate values of entry j;
                // the up values of the same rows and columns are entry j + OUT_FRAGS. Left as they
                // are, v0 and v1 write the gate alone.
                v0 = silu(v0) * acc[j + OUT_FRAGS][2 * half];
                v1 = silu(v1) * acc[j + OUT_FRAGS][2 * half + 1];
                // END EXERCISE
            }
            const int row = warp_in_group * 16 + lane / 4 + 8 * half;
            unsigned char* at = buffer + box * OUT_BOX_BYTES + swizzle<SWIZZLE_BYTES>(row, chunk) + (lane % 4) * 4;
            *reinterpret_cast<unsigned*>(at) = pack_pair<elem_t>(v0, v1);
        }
    }
}
// --8<-- [end:epilogue]

// The saving up kernel's extra store, before SwiGLU's output is staged: the raw 64 × 256 accumulator
// (each element x·W1[e] at one B column, rounded to elem_t) through the consumer's buffer to h1, each
// 64-column box at the very B column the producer loaded for it (b_column<true>: gate boxes at 128n,
// up boxes at I + 128n), so h1 = [G U] column for column. Where I is not a multiple of 128 a gate
// box's last columns are up columns, whose B columns it loaded too: those are stored twice, the same
// product either way. The tile's `store` below waits for these reads before it stages h.
__device__ __forceinline__ void store_h1(const float (&acc)[ACC_FRAGS][4], unsigned char* buffer,
                                         unsigned buffer_address, const TmaMap& h1_map, const Tile& tile, int consumer,
                                         int up, int my_barrier, bool storer, int warp_in_group, int lane) {
    if (storer) tma_store_wait_read();  // the previous tile's stores must have read the buffer
    named_barrier_sync(my_barrier, WARPGROUP_THREADS);
    stage_tile<false>(acc, buffer, warp_in_group, lane);
    fence_async_shared();
    named_barrier_sync(my_barrier, WARPGROUP_THREADS);
    if (storer) {
        for (int box = 0; box < B_BOXES; ++box)
            tma_store_3d(h1_map, buffer_address + box * OUT_BOX_BYTES, b_column<true>(tile.n, box, up),
                         tile.row0 + consumer * CONSUMER_ROWS, 0);
        tma_store_commit();
    }
}

// out[rows of e, n_out] = A[rows of e, K] · B[e][K, ...], for every expert e with rows, with the
// SwiGLU epilogue or without. a_map: A as [1, rows, K], boxes 1 × 128 × 64; b_map: B as [E, K, N],
// boxes 1 × 64 × 64; out_map: the output as [1, rows, n_out], boxes 1 × 64 × 64; all 128-byte swizzled.
// SAVE_H1 (with SWIGLU): *h1_map, [1, rows, 2·I] in boxes 1 × 64 × 64, also receives the raw product
// (store_h1); otherwise h1_map is not read.
template <bool SWIGLU, bool SAVE_H1 = false>
__device__ void grouped_gemm(const TmaMap& a_map, const TmaMap& b_map, const TmaMap& out_map,
                             const int* __restrict__ offsets, int experts, int n_out, int k, int up,
                             const TmaMap* h1_map = nullptr) {
    static_assert(SWIGLU || !SAVE_H1, "h1 is the up GEMM's product");
    extern __shared__ __align__(SWIZZLE_ATOM_BYTES) unsigned char shared_raw[];
    // TMA's 128-byte swizzle and the descriptors' base offset 0 assume 1024-byte-aligned tiles.
    const unsigned base = atom_aligned(shared_address(shared_raw));
    unsigned char* aligned = shared_raw + (base - shared_address(shared_raw));
    int* expert_offsets = reinterpret_cast<int*>(aligned + OFFSETS);
    auto barrier = [&](int index) { return base + BARRIERS + 8 * index; };

    for (int e = threadIdx.x; e <= experts; e += NUM_THREADS) expert_offsets[e] = __ldg(offsets + e);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(barrier(FULL + s), 1);                  // the producer's arrive.expect_tx, then the bytes
            mbarrier_init(barrier(EMPTY + s), CONSUMERS * 4);     // lane 0 of every consumer warp
        }
        mbarrier_init_fence();
    }
    __syncthreads();

    constexpr int OUT_COLS = SWIGLU ? BLOCK_N / 2 : BLOCK_N;  // output columns per tile
    const Scheduler scheduler{expert_offsets, experts, (n_out + OUT_COLS - 1) / OUT_COLS};
    const int num_tiles = scheduler.num_tiles(), k_blocks = (k + BLOCK_K - 1) / BLOCK_K;
    const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
    int it = 0;  // stages filled (producer) or consumed (consumers) by this block, across its tiles

    if (warpgroup == 0) {
        // Producer: one thread issues every copy. The ring runs on across tiles: the next tile's
        // first stages load while the consumers finish this one and store it.
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        tma_prefetch_map(a_map);
        tma_prefetch_map(b_map);
        tma_prefetch_map(out_map);
        if (SAVE_H1) tma_prefetch_map(*h1_map);
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const Tile tile = scheduler.tile(t);
            for (int kb = 0; kb < k_blocks; ++kb, ++it) {
                const int stage = it % STAGES;
                const unsigned a_tile = base + stage * STAGE_BYTES, b_tile = a_tile + A_BYTES;
                mbarrier_wait(barrier(EMPTY + stage), ((it / STAGES) & 1) ^ 1);  // a fresh slot: at once
                // Bytes past the edges of A or B are zero-filled and counted: always a full stage.
                mbarrier_arrive_expect_tx(barrier(FULL + stage), STAGE_BYTES);
                tma_load_3d(a_tile, a_map, barrier(FULL + stage), kb * BLOCK_K, tile.row0, 0);
#pragma unroll
                for (int box = 0; box < B_BOXES; ++box)
                    tma_load_3d(b_tile + box * B_BOX_BYTES, b_map, barrier(FULL + stage),
                                b_column<SWIGLU>(tile.n, box, up), kb * BLOCK_K, tile.expert);
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int consumer = warpgroup - 1, lane = threadIdx.x % 32, warp_in_group = threadIdx.x / 32 % 4;
        const bool storer = threadIdx.x % WARPGROUP_THREADS == 0;  // issues this consumer's TMA stores
        const int my_barrier = 1 + consumer;                    // named barrier of this warpgroup
        unsigned char* buffer = aligned + EPILOGUE + consumer * EPILOGUE_BYTES;
        float acc[ACC_FRAGS][4];
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const Tile tile = scheduler.tile(t);
            mainloop(acc, base, consumer, k_blocks, it);
            if (SAVE_H1)
                store_h1(acc, buffer, base + EPILOGUE + consumer * EPILOGUE_BYTES, *h1_map, tile, consumer, up,
                         my_barrier, storer, warp_in_group, lane);
            // --8<-- [start:store]
            // The previous tile's stores must have read the buffer before it is overwritten.
            if (storer) tma_store_wait_read();
            named_barrier_sync(my_barrier, WARPGROUP_THREADS);
            stage_tile<SWIGLU>(acc, buffer, warp_in_group, lane);
            fence_async_shared();  // the buffer's ordinary stores, visible to TMA
            named_barrier_sync(my_barrier, WARPGROUP_THREADS);
            if (storer) {
                for (int box = 0; box < OUT_COLS / BOX_COLS; ++box)
                    tma_store_3d(out_map, base + EPILOGUE + consumer * EPILOGUE_BYTES + box * OUT_BOX_BYTES,
                                 tile.n * OUT_COLS + box * BOX_COLS, tile.row0 + consumer * CONSUMER_ROWS, 0);
                tma_store_commit();  // and on to the next tile's main loop while the copy runs
            }
            // --8<-- [end:store]
        }
        if (storer) tma_store_wait_read();  // the block's shared memory must outlive its last stores
    }
}

// The kernels, unless an including file wants the machinery above alone (stage 14's GEMMs: its cubin then
// holds its own kernels only). Their parameters besides the tensor maps: moe.cuh's ExpertParams, one for
// the up and the down kernel.
#ifndef GROUPED_GEMM_MACHINERY_ONLY
// h = silu(x_perm · W1_gate) * (x_perm · W1_up), per expert. W1 is [E, hidden, 2·inter].
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_up_swiglu(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w1_map,
                 const __grid_constant__ TmaMap h_map, const __grid_constant__ ExpertParams p) {
    grouped_gemm<true>(x_map, w1_map, h_map, p.offsets, p.experts, p.inter, p.hidden, p.inter);
}

// The same, h1 = x_perm · W1 = [G U] also stored, [rows, 2·inter]: for the backward (stage 14).
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_up_swiglu_saving(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w1_map,
                        const __grid_constant__ TmaMap h_map, const __grid_constant__ TmaMap h1_map,
                        const __grid_constant__ ExpertParams p) {
    grouped_gemm<true, true>(x_map, w1_map, h_map, p.offsets, p.experts, p.inter, p.hidden, p.inter, &h1_map);
}

// y = h · W2, per expert. W2 is [E, inter, hidden].
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_down(const __grid_constant__ TmaMap h_map, const __grid_constant__ TmaMap w2_map,
            const __grid_constant__ TmaMap y_map, const __grid_constant__ ExpertParams p) {
    grouped_gemm<false>(h_map, w2_map, y_map, p.offsets, p.experts, p.hidden, p.inter, 0);
}
#endif  // GROUPED_GEMM_MACHINERY_ONLY
