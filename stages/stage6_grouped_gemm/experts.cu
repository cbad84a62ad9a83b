// Stage 6 — grouped GEMM: every expert's SwiGLU FFN in two launches (TMA + wgmma). sm_90a only.
//
// After stage 5 the token-slots sit in expert-contiguous order: expert e owns rows offsets[e] ..
// offsets[e+1] - 1 of x_perm, its segment padded to a multiple of BLOCK_M = 128 rows (whose results
// nobody reads: the padding rows repeat a token-slot, see stage 7's gather_rows).
// Two kernels then compute, for every expert at once,
//   expert_up_swiglu   h[rows of e] = silu(x·W1[e][:, :I]) * (x·W1[e][:, I:])    [rows, I]
//   expert_down        y[rows of e] = h · W2[e]                                   [rows, hidden]
// New here, after stage 4's TMA/wgmma/warp-specialization machinery:
//   a device-side tile scheduler  the grid is one block per SM whatever the routing; each block
//            walks the (expert, n, m) tiles t = blockIdx.x, + gridDim.x, ... and finds the expert of
//            a tile from the offsets (a binary search in shared memory). The host never reads the
//            counts: no synchronization between routing and GEMMs, one launch per GEMM.
//   a fused epilogue  the up kernel loads the gate and the up columns of W1 side by side as one
//            256-wide B tile, so each thread holds gate[c] and up[c] of the same (row, column) and
//            writes silu(gate)·up: the 2·I-wide product never reaches memory.
//   a GEMM main loop  a 4-deep ring of (A 128×64, B 64×256) stages filled by TMA; each consumer
//            warpgroup issues 4 wgmma.m64n256k16 per stage and releases the stage one stage later
//            (one batch stays in flight, so the tensor cores never wait for the warps).
//
// Per tile: 128 rows × 256 B columns, K in steps of 64. FLOPs per stage 2·128·256·64 = 4.2 M for
//   48 KB of shared memory written by TMA (87 FLOPs per byte); each consumer's wgmma reads its A
//   (16 KB... 8 KB) and the whole B (32 KB) per stage: 52 FLOPs per byte of shared memory read.
// Registers: consumers 232 (the accumulator is 128 floats a thread), producer 40:
//   232·256 + 40·128 = 64512 <= 65536. Shared memory: 4 × 48 KB + offsets + barriers (+1 KB to
//   align) = 194 KB: one block per SM.
// Tile order, for L2: inside an expert, m fastest (t → n = local / m_tiles, m = local % m_tiles):
//   the 132 blocks running at once share a few 256-column panels of W (each read from memory once)
//   and the expert's rows (16 MB at 2048 rows × 4096), both held in the 50 MB L2.
// Predicted on an H100 (bf16, seed configuration, 65536 token-slots, 2048 per expert): the two
//   GEMMs do 17.7 TFLOP; the main loop at ~90% of the 755 TFLOP/s dense ceiling, minus the
//   epilogues (the tensor cores idle while a tile's 128 × 256 results are stored: ~3%) and the
//   padding (~3% more rows than token-slots): ~630 TFLOP/s, ~28 ms.
#include "hopper_gemm.cuh"
#include "moe.cuh"

constexpr int BLOCK_M = 128;                            // rows per tile: 2 consumer warpgroups × 64
constexpr int BLOCK_N = 256;                            // B columns per tile: one wgmma n256
constexpr int BLOCK_K = 64;                             // K per stage: one 128-byte swizzle row
constexpr int STAGES = 4;                               // ring slots
constexpr int CONSUMERS = 2;
constexpr int NUM_THREADS = (1 + CONSUMERS) * 128;      // + the producer warpgroup
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
constexpr int BOX_COLS = 64;                            // a 128-byte-swizzled TMA box is 64 elements wide
constexpr int B_BOXES = BLOCK_N / BOX_COLS;
constexpr int A_BYTES = BLOCK_M * BLOCK_K * 2;          // 16 KB
constexpr int B_BOX_BYTES = BLOCK_K * BOX_COLS * 2;     // 8 KB
constexpr int STAGE_BYTES = A_BYTES + B_BOXES * B_BOX_BYTES;
constexpr int ACC_FRAGS = BLOCK_N / 8;                  // a warp's accumulator: float[32][4]
// Layout of the dynamic shared memory, from a 1024-byte-aligned base.
constexpr int OFFSETS = STAGES * STAGE_BYTES;           // the experts' row offsets, E+1 ints
constexpr int BARRIERS = OFFSETS + 4 * (MAX_EXPERTS + 2);
constexpr int FULL = 0, EMPTY = STAGES;                 // mbarriers: full[s], empty[s]
constexpr int SHARED_BYTES = BARRIERS + 8 * 2 * STAGES + 1024;  // as __init__.py computes
static_assert(SHARED_BYTES <= 227 * 1024, "an H100 block has at most 227 KB of shared memory");
static_assert(BARRIERS % 8 == 0, "mbarriers are 8-byte aligned");
static_assert(sizeof(elem_t) == 2, "16-bit elements");

struct Tile {
    int expert, row0, n;  // rows row0 .. row0 + 127 of expert `expert`, column tile n
};

// --8<-- [start:scheduler]
// The tiles of one launch, numbered expert by expert; inside an expert column tile by column tile,
// and the expert's m-tiles fastest. Expert e starts at tile offsets[e] / BLOCK_M · n_tiles -- its
// segment is padded to whole m-tiles, so no tile holds two experts -- and an expert without tokens
// has no tiles. Producer and consumers walk the same sequence: tile, tile + gridDim.x, ...
struct Scheduler {
    const int* offsets;  // in shared memory: offsets[0 .. experts], multiples of BLOCK_M
    int experts, n_tiles;

    __device__ int num_tiles() const { return offsets[experts] / BLOCK_M * n_tiles; }

    __device__ Tile tile(int t) const {
        // EXERCISE: find tile t's expert -- the last e in 0 .. experts-1 whose first tile,
        // offsets[e] / BLOCK_M · n_tiles, is <= t (a binary search; the last, so that experts with no
        // rows are skipped) -- then its column tile n and first row within that expert.
        // STUB: return {0, 0, 0};
        int lo = 0, hi = experts - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (offsets[mid] / BLOCK_M * n_tiles <= t) lo = mid;
            else hi = mid - 1;
        }
        const int first_m = offsets[lo] / BLOCK_M, m_tiles = offsets[lo + 1] / BLOCK_M - first_m;
        const int local = t - first_m * n_tiles;
        return {lo, (first_m + local % m_tiles) * BLOCK_M, local / m_tiles};
        // END EXERCISE
    }
};
// --8<-- [end:scheduler]

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
            const u64 a = make_smem_desc(a_tile + consumer * 64 * 128 + kk * 32, 16, 1024);
            // B (MN-major): k runs down the 128-byte rows; the 64-column boxes are LBO apart.
            const u64 b = make_smem_desc(b_tile + kk * 16 * 128, B_BOX_BYTES, 1024);
            wgmma_256_ss_b_mn_major<elem_t>(acc, a, b, kb > 0 || kk > 0);
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

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// --8<-- [start:epilogue]
// The accumulator to memory, two adjacent columns (one 32-bit store) at a time. Entry j of a warp's
// float[32][4] is rows g, g+8 × columns 8j + 2t, +1 of its 16 rows (g = lane / 4, t = lane % 4).
// SwiGLU: entry j (j < 16) holds gate columns and entry j + 16 the up columns of the same outputs.
template <bool SWIGLU>
__device__ __forceinline__ void store_tile(const float (&acc)[ACC_FRAGS][4], elem_t* out, int row0, int col0,
                                           int n_out, int lane) {
    constexpr int OUT_FRAGS = SWIGLU ? ACC_FRAGS / 2 : ACC_FRAGS;
#pragma unroll
    for (int j = 0; j < OUT_FRAGS; ++j) {
        const int col = col0 + 8 * j + 2 * (lane % 4);
        if (col >= n_out) continue;  // n_out is even: col + 1 < n_out too
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float v0 = acc[j][2 * half], v1 = acc[j][2 * half + 1];
            if (SWIGLU) {
                v0 = silu(v0) * acc[j + OUT_FRAGS][2 * half];
                v1 = silu(v1) * acc[j + OUT_FRAGS][2 * half + 1];
            }
            const size_t row = row0 + lane / 4 + 8 * half;
            *reinterpret_cast<unsigned*>(out + row * n_out + col) = pack_pair<elem_t>(v0, v1);
        }
    }
}
// --8<-- [end:epilogue]

// out[rows of e, n_out] = A[rows of e, K] · B[e][K, ...], for every expert e with rows, with the
// SwiGLU epilogue or without. a_map: A as [1, rows, K], boxes 1 × 128 × 64; b_map: B as [E, K, N],
// boxes 1 × 64 × 64; both 128-byte swizzled.
template <bool SWIGLU>
__device__ void grouped_gemm(const TmaMap& a_map, const TmaMap& b_map, const int* __restrict__ offsets,
                             int experts, elem_t* __restrict__ out, int n_out, int k, int up) {
    extern __shared__ __align__(1024) unsigned char shared_raw[];
    // TMA's 128-byte swizzle and the descriptors' base offset 0 assume 1024-byte-aligned tiles.
    const unsigned base = (shared_address(shared_raw) + 1023) & ~1023u;
    unsigned char* aligned = shared_raw + (base - shared_address(shared_raw));
    int* expert_offsets = reinterpret_cast<int*>(aligned + OFFSETS);
    auto barrier = [&](int index) { return base + BARRIERS + 8 * index; };

    for (int e = threadIdx.x; e <= experts; e += NUM_THREADS) expert_offsets[e] = offsets[e];
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
    const int warpgroup = threadIdx.x / 128;
    int it = 0;  // stages filled (producer) or consumed (consumers) by this block, across its tiles

    if (warpgroup == 0) {
        // Producer: one thread issues every copy. The ring runs on across tiles: the next tile's
        // first stages load while the consumers finish this one and store it.
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x != 0) return;
        tma_prefetch_map(a_map);
        tma_prefetch_map(b_map);
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
        float acc[ACC_FRAGS][4];
        for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
            const Tile tile = scheduler.tile(t);
            mainloop(acc, base, consumer, k_blocks, it);
            store_tile<SWIGLU>(acc, out, tile.row0 + consumer * 64 + warp_in_group * 16, tile.n * OUT_COLS, n_out,
                               lane);
        }
    }
}

// h = silu(x_perm · W1_gate) * (x_perm · W1_up), per expert. W1 is [E, hidden, 2·inter].
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_up_swiglu(const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w1_map,
                 const int* __restrict__ offsets, int experts, elem_t* __restrict__ h, int inter, int hidden) {
    grouped_gemm<true>(x_map, w1_map, offsets, experts, h, inter, hidden, inter);
}

// y = h · W2, per expert. W2 is [E, inter, hidden].
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
expert_down(const __grid_constant__ TmaMap h_map, const __grid_constant__ TmaMap w2_map,
            const int* __restrict__ offsets, int experts, elem_t* __restrict__ y, int hidden, int inter) {
    grouped_gemm<false>(h_map, w2_map, offsets, experts, y, hidden, inter, 0);
}
