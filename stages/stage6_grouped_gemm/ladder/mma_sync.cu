// Stage 6's ladder, rung 2 — the experts' grouped GEMM on tensor cores with mma.sync. sm_80 and newer.
//
// The kernels, signatures, tiles and tile order of experts.cu (grouped.cuh: 128 × 128 output tiles,
// found on the device by schedule.cuh's scheduler, in a persistent grid), multiplied the way stages 2
// and 3 multiply: each warp issues mma.sync.m16n8k16 (16 × 8 × 16, fp32 accumulators) on fragments it
// loads from shared memory with ldmatrix, and cp.async copies the operands from global memory into a
// ring of 2 stages, the next stage in flight while the warps multiply this one.
//
// A block of 8 warps owns a 128 × 128 output tile as a 2 × 4 grid of 64 × 32 warp tiles. In the up
// kernel a warp also holds the up products of its 32 gate columns (B tile columns c + 128, see
// grouped.cuh): fragments j and j + 4 of the same rows and columns, so that SwiGLU happens in
// registers and only h is stored. A stage is 64 deep in K: A 128 × 64 and B 64 × 128 (256 with the
// up columns), 16-bit, unpadded, swizzled as in stage 3 (16-byte chunk c of row r at position c ^ (r %
// 8)); B is stored as W is, [k][n] with n contiguous, so its fragments come from ldmatrix .trans, as
// V's did in stage 2.
//
// Per k-step of 16 a warp loads 4 A fragments (its 4 m16 tiles) and 2 (4) pairs of B fragments with
// ldmatrix.x4, 512 bytes each, for 16 (32) mma.sync of 4096 FLOPs: 21 (32) FLOPs per byte of shared
// memory read. Every warp reads its own operands through its registers: A is read by the 4 warps
// of its rows and B by the 2 of its columns. (Hopper's wgmma reads a warpgroup's B once for its 64
// rows: experts.cu's main loop does 52 FLOPs per byte. The H100's datasheet rate, 989 TFLOP/s of
// dense 16-bit math, is 4096 FLOPs per SM and clock at 1.83 GHz, while shared memory serves 128 bytes
// per clock: 32 FLOPs per byte.)
// Registers: the accumulators are 64 floats (down) or 128 (up), a k-step's A fragments 16, a pair of
// B fragments 4. ptxas gives the up kernel 243-248 (one block of 256 threads per SM), the down
// kernel 126-128 (two blocks), no spills. Shared memory: 2 stages × (16 KB of A + 32 or 16 KB of B) +
// the offsets: 97 KB (up), 65 KB (down), so that the up kernel fits the 99 KB of an sm_86/sm_89 block.
// A third ring stage would fit sm_80's and sm_90's shared memory only, and ran no faster. (Measured:
// docs/stages/stage6.md, the ladder; docs/notebook/stage6.md.)
#include "mma.cuh"
#include "cp_async.cuh"
// Stage 3's swizzle<ROW_BYTES>: chunk c of 8 consecutive rows -- what ldmatrix reads at once, for A
// and, transposed, for B -- sits in 8 different groups of 4 banks.
#include "swizzle.cuh"
#include "grouped.cuh"

constexpr int BLOCK_K = 64;                    // K per stage: 128-byte rows of A, the swizzle's span
constexpr int STAGES = 2;                      // the cp.async ring
constexpr int WARP_ROWS = 64, WARP_COLS = 32;  // warp w computes rows 64·(w / 4) .., output columns 32·(w % 4) ..
constexpr int M_TILES = WARP_ROWS / 16;        // m16 tiles of a warp
constexpr int OUT_FRAGS = WARP_COLS / 8;       // n8 fragments of a warp's output columns
template <bool SWIGLU> constexpr int FRAGS = SWIGLU ? 2 * OUT_FRAGS : OUT_FRAGS;  // + the up columns'
constexpr int A_ROW_BYTES = BLOCK_K * 2;
constexpr int A_BYTES = BLOCK_M * A_ROW_BYTES;  // 16 KB
template <bool SWIGLU> constexpr int B_ROW_BYTES = TileOperands<SWIGLU>::B_COLS * 2;
template <bool SWIGLU> constexpr int STAGE_BYTES = A_BYTES + BLOCK_K * B_ROW_BYTES<SWIGLU>;  // A, then B
// The ring, then the offsets (the launch, ladder/__init__.py, declares it: the grader checks).
template <bool SWIGLU> constexpr int SHARED_BYTES = STAGES * STAGE_BYTES<SWIGLU> + OFFSETS_BYTES;
static_assert(SHARED_BYTES<true> <= 99 * 1024, "a block fits the 99 KB an sm_86 or sm_89 block may have");

// One chunk global -> shared; a null source (past K or n_out) is 16 zero bytes, read from nowhere
// (cp.async is still given an address that exists).
__device__ __forceinline__ void copy_chunk(unsigned to, const elem_t* from, const elem_t* exists) {
    cp_async_16(to, from ? from : exists, from != nullptr);
}

// The copies of K-slice k0 .. k0 + 63 of a tile's A and B into ring stage `stage`: neighbouring
// threads take neighbouring chunks of a row (coalesced reads; whole 128-byte lines of shared memory
// written at a time, each a permutation of its 8 chunks: no bank conflicts).
template <bool SWIGLU>
__device__ __forceinline__ void load_stage(unsigned stage, const TileOperands<SWIGLU>& in, int k0) {
    constexpr int A_ROW_CHUNKS = A_ROW_BYTES / 16, B_ROW_CHUNKS = B_ROW_BYTES<SWIGLU> / 16;
#pragma unroll
    for (int i = 0; i < BLOCK_M * A_ROW_CHUNKS / NUM_THREADS; ++i) {
        const int chunk = threadIdx.x + i * NUM_THREADS, row = chunk / A_ROW_CHUNKS, column = chunk % A_ROW_CHUNKS;
        copy_chunk(stage + swizzle<A_ROW_BYTES>(row, column), in.a_chunk(row, k0, column), in.a);
    }
#pragma unroll
    for (int i = 0; i < BLOCK_K * B_ROW_CHUNKS / NUM_THREADS; ++i) {
        const int chunk = threadIdx.x + i * NUM_THREADS, row = chunk / B_ROW_CHUNKS, column = chunk % B_ROW_CHUNKS;
        copy_chunk(stage + A_BYTES + swizzle<B_ROW_BYTES<SWIGLU>>(row, column), in.b_chunk(row, k0, column), in.b);
    }
}

// --8<-- [start:stage]
// acc += the warp's rows of A · its columns of B, over one stage (4 k-steps of 16). Fragment j of
// an m16 tile is 8 columns: with SwiGLU, j < 4 the gate columns warp_col + 8j, j >= 4 the up columns
// 128 further right in the B tile. Each pair of fragments is one ldmatrix.x4.trans of 16 k-rows ×
// 16 columns: in mma.cuh's A order on a [k][n] tile, matrices 0-1 are b[0], b[1] of the first 8
// columns and matrices 2-3 those of the next 8 (as V's were in stage 2).
template <bool SWIGLU>
__device__ __forceinline__ void multiply_stage(float (&acc)[M_TILES][FRAGS<SWIGLU>][4], unsigned stage, int warp_row,
                                               int warp_col, int lane) {
    const unsigned b_tile = stage + A_BYTES;
#pragma unroll
    for (int kk = 0; kk < BLOCK_K / 16; ++kk) {
        unsigned a[M_TILES][4];
#pragma unroll
        for (int m = 0; m < M_TILES; ++m)
            ldmatrix_x4(a[m], stage + swizzle<A_ROW_BYTES>(warp_row + 16 * m + a_order_row(lane), 2 * kk + a_order_chunk(lane)));
#pragma unroll
        for (int j = 0; j < FRAGS<SWIGLU>; j += 2) {
            const int column = BLOCK_N * (j / OUT_FRAGS) + warp_col + 8 * (j % OUT_FRAGS);
            unsigned b[4];
            ldmatrix_x4_trans(b, b_tile + swizzle<B_ROW_BYTES<SWIGLU>>(16 * kk + a_order_row(lane),
                                                                      column / 8 + a_order_chunk(lane)));
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                mma_m16n8k16<elem_t>(acc[m][j], a[m], b[0], b[1]);
                mma_m16n8k16<elem_t>(acc[m][j + 1], a[m], b[2], b[3]);
            }
        }
    }
}
// --8<-- [end:stage]

// --8<-- [start:mainloop]
// One tile's products over the whole K through the ring (stage 3's pipeline): before multiplying
// stage s, wait for this thread's copies of it, then a __syncthreads -- everyone's copies have landed,
// and every warp is done with stage s - 1, whose slot the copies of stage s + STAGES - 1 refill.
template <bool SWIGLU>
__device__ __forceinline__ void multiply_tile(float (&acc)[M_TILES][FRAGS<SWIGLU>][4], unsigned ring,
                                              const TileOperands<SWIGLU>& in, int warp_row, int warp_col, int lane) {
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int j = 0; j < FRAGS<SWIGLU>; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;
    const int stages = (in.k + BLOCK_K - 1) / BLOCK_K;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < stages) load_stage<SWIGLU>(ring + s * STAGE_BYTES<SWIGLU>, in, s * BLOCK_K);
        cp_async_commit();
    }
    for (int s = 0; s < stages; ++s) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int next = s + STAGES - 1;
        if (next < stages) load_stage<SWIGLU>(ring + next % STAGES * STAGE_BYTES<SWIGLU>, in, next * BLOCK_K);
        cp_async_commit();  // an empty group at the end keeps the count of groups in flight
        multiply_stage<SWIGLU>(acc, ring + s % STAGES * STAGE_BYTES<SWIGLU>, warp_row, warp_col, lane);
    }
    __syncthreads();  // every warp is done with the ring: the next tile may refill it
}
// --8<-- [end:mainloop]

// The warp's outputs from the fragments (mma.cuh's C layout: rows g, g + 8, columns 2t, 2t + 1 of
// each n8 fragment), two columns (4 bytes) per store; with SwiGLU, fragment j + 4 holds the up values.
template <bool SWIGLU>
__device__ __forceinline__ void write_tile(const float (&acc)[M_TILES][FRAGS<SWIGLU>][4], const TileOperands<SWIGLU>& in,
                                           int warp_row, int warp_col, int lane) {
#pragma unroll
    for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
        for (int j = 0; j < OUT_FRAGS; ++j) {
            const float(&up)[4] = acc[m][SWIGLU ? j + OUT_FRAGS : j];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                elem_t* to = in.out_at(warp_row + 16 * m + lane / 4 + 8 * half, warp_col + 8 * j + 2 * (lane % 4));
                if (to == nullptr) continue;
                *reinterpret_cast<unsigned*>(to) =
                    pack_pair<elem_t>(output_value<SWIGLU>(acc[m][j][2 * half], up[2 * half]),
                                      output_value<SWIGLU>(acc[m][j][2 * half + 1], up[2 * half + 1]));
            }
        }
    }
}

// grouped.cuh's grouped_gemm, which its kernels call: this rung's way of multiplying.
template <bool SWIGLU>
__device__ __forceinline__ void grouped_gemm(const elem_t* a, const elem_t* b, elem_t* out, const int* offsets,
                                             int experts, int n_out, int k) {
    extern __shared__ __align__(SWIZZLE_BYTES) unsigned char shared[];  // the ring, then the offsets
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_row = WARP_ROWS * (warp / 4), warp_col = WARP_COLS * (warp % 4);
    for_each_tile(reinterpret_cast<int*>(shared + STAGES * STAGE_BYTES<SWIGLU>), offsets, experts, n_out,
                  [&](const Tile& tile) {
                      const TileOperands<SWIGLU> in(tile, a, b, out, k, n_out);
                      float acc[M_TILES][FRAGS<SWIGLU>][4];
                      multiply_tile<SWIGLU>(acc, shared_address(shared), in, warp_row, warp_col, lane);
                      write_tile<SWIGLU>(acc, in, warp_row, warp_col, lane);
                  });
}
