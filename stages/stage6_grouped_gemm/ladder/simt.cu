// Stage 6's ladder, rung 1 — the experts' grouped GEMM on CUDA cores: fp32 fused multiply-adds.
//
// The kernels, signatures, tiles and tile order of experts.cu (grouped.cuh: 128 × 128 output tiles,
// found on the device by schedule.cuh's scheduler, in a persistent grid), multiplied the way stage 1
// multiplies: operands converted to fp32 in shared memory, and each thread computing an 8 × 8 block
// of outputs in registers (register tiling). sm_80 and newer.
//
// A block of 256 threads owns a 128 × 128 output tile. The up kernel's B slice is 256 columns wide
// (128 gate + 128 up), and a thread holds the gate and the up products of its 8 × 8 outputs: 128
// accumulators, from which it writes silu(gate) · up, so that only h leaves the block. K goes by in
// slices of BLOCK_K = 16 in two shared-memory buffers: while the threads multiply one slice, the next
// one's global loads (16 bytes of A and 16 or 32 of B per thread) are in flight into registers; they
// are converted and stored into the other buffer after the multiply-adds, and one __syncthreads per
// slice publishes them.
//
// Thread (rg, cg) of the 16 × 16 grid owns rows 4·rg + 64·h + i and output columns 4·cg + 64·h + i
// (h < 2, i < 4). For each k it reads two float4s of A (A's slice is stored transposed, [k][row], so
// that a thread's 4 rows are one float4) and two of B (four with the up columns), and does 64 (128)
// FMAs. In a warp the 16 lanes of a row group read the same A float4 (a broadcast) and the 2 row
// groups the same 16 B float4s (256 bytes): per k, some 6 (10) shared-memory transactions of 128
// bytes for 64 (128) warp-wide FMAs = 4096 (8192) FLOPs, 5.3 (6.4) FLOPs per byte. An SM does 128
// FMAs (256 FLOPs) per clock and serves 128 bytes of shared memory, 2 FLOPs per byte: shared memory
// keeps up at well under half its rate, and the bound is the fp32 FMA rate (~67 TFLOP/s on an H100
// SXM).
// Registers: the accumulators are 64 floats (down) or 128 (up), the operands of one k 16 (24), the
// loads in flight 8 (12). ptxas gives the up kernel 218-230 (one block of 256 threads per SM), the
// down kernel the 128 that two blocks allow (__launch_bounds__), no spills: with the k loop fully
// unrolled instead of 4 at a time, it spilled. Shared memory: 2 buffers × (8 KB of A + 16 or 8 KB of
// B) + the offsets: 49 KB (up), 33 KB (down). (Measured: docs/stages/stage6.md, the ladder.)
#include "grouped.cuh"

constexpr int BLOCK_K = 16;                  // K per slice
constexpr int GROUPS = 16;                   // the threads as a 16 × 16 grid (row group, column group)
static_assert(GROUPS * GROUPS == NUM_THREADS, "one thread per (row group, column group)");
constexpr int ROWS = BLOCK_M / GROUPS;       // rows per thread: 8
constexpr int OUT_COLS = BLOCK_N / GROUPS;   // output columns per thread: 8
template <bool SWIGLU> constexpr int B_COLS = TileOperands<SWIGLU>::B_COLS;
template <bool SWIGLU> constexpr int COLS = B_COLS<SWIGLU> / GROUPS;  // B columns per thread: 8, or 16 with the up ones
constexpr int A_FLOATS = BLOCK_K * BLOCK_M;  // a slice of A, transposed: [k][row]
template <bool SWIGLU> constexpr int SLICE_FLOATS = A_FLOATS + BLOCK_K * B_COLS<SWIGLU>;  // then B: [k][column]
// Two slice buffers, then the offsets (the launch, ladder/__init__.py, declares it: the grader checks).
template <bool SWIGLU> constexpr int SHARED_BYTES = 2 * 4 * SLICE_FLOATS<SWIGLU> + OFFSETS_BYTES;
static_assert(SHARED_BYTES<true> <= 99 * 1024, "a block fits the 99 KB an sm_86 or sm_89 block may have");

// The i-th (i < 8) row or column a thread of group `group` owns: 4·group + 64·(i / 4) + i % 4. For
// B's columns i goes on to 15 in the up kernel: i + 8 is then the up column of output column i.
__device__ __forceinline__ int owned(int group, int i) { return 4 * group + 64 * (i / 4) + i % 4; }

__device__ __forceinline__ void read4(const float* from, float* to) {
    const float4 v = *reinterpret_cast<const float4*>(from);
    to[0] = v.x, to[1] = v.y, to[2] = v.z, to[3] = v.w;
}

// A thread's global loads of one slice, kept as raw 16-bit elements (4 registers a chunk) until
// the slice before it has been multiplied. A: row t / 2, chunk t % 2 (the two threads of a row read
// its 32 bytes); B: consecutive threads take consecutive chunks of a row. Zeros past K and n_out.
template <bool SWIGLU>
struct SliceLoads {
    static constexpr int B_ROW_CHUNKS = B_COLS<SWIGLU> / 8;
    static constexpr int B_CHUNKS = BLOCK_K * B_ROW_CHUNKS / NUM_THREADS;  // per thread: 1 or 2
    static_assert(BLOCK_M * BLOCK_K / 8 == NUM_THREADS && B_CHUNKS * NUM_THREADS == BLOCK_K * B_ROW_CHUNKS,
                  "every thread loads one chunk of A and as many of B");
    uint4 a, b[B_CHUNKS];

    __device__ static uint4 load(const elem_t* p) {
        return p ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
    }

    __device__ void fetch(const TileOperands<SWIGLU>& in, int k0) {
        a = load(in.a_chunk(threadIdx.x / 2, k0, threadIdx.x % 2));
#pragma unroll
        for (int i = 0; i < B_CHUNKS; ++i) {
            const int chunk = threadIdx.x + i * NUM_THREADS;
            b[i] = load(in.b_chunk(chunk / B_ROW_CHUNKS, k0, chunk % B_ROW_CHUNKS));
        }
    }

    // Into a slice buffer, as fp32: A transposed, element j of the chunk to k = 8·(t % 2) + j;
    // B as it is, two float4s.
    __device__ void store(float* slice) const {
        float v[8];
        load8(reinterpret_cast<const elem_t*>(&a), v);
#pragma unroll
        for (int j = 0; j < 8; ++j) slice[(8 * (threadIdx.x % 2) + j) * BLOCK_M + threadIdx.x / 2] = v[j];
#pragma unroll
        for (int i = 0; i < B_CHUNKS; ++i) {
            const int chunk = threadIdx.x + i * NUM_THREADS;
            float* to = slice + A_FLOATS + chunk / B_ROW_CHUNKS * B_COLS<SWIGLU> + 8 * (chunk % B_ROW_CHUNKS);
            load8(reinterpret_cast<const elem_t*>(&b[i]), v);
            *reinterpret_cast<float4*>(to) = make_float4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<float4*>(to + 4) = make_float4(v[4], v[5], v[6], v[7]);
        }
    }
};

// --8<-- [start:slice]
// acc[r][c] += Σ_k A[row r][k] · B[k][column c] over one slice: for each k, the thread's 8 values of
// A and 8 (16) of B, then every product of the two, 64 (128) FMAs.
template <bool SWIGLU>
__device__ __forceinline__ void multiply_slice(float (&acc)[ROWS][COLS<SWIGLU>], const float* slice, int rg, int cg) {
    const float* b_slice = slice + A_FLOATS;
#pragma unroll 4  // fully unrolled, ptxas holds more loads in flight than the down kernel's 128 registers allow
    for (int k = 0; k < BLOCK_K; ++k) {
        float a[ROWS], b[COLS<SWIGLU>];
#pragma unroll
        for (int i = 0; i < ROWS; i += 4) read4(slice + k * BLOCK_M + owned(rg, i), a + i);
#pragma unroll
        for (int i = 0; i < COLS<SWIGLU>; i += 4) read4(b_slice + k * B_COLS<SWIGLU> + owned(cg, i), b + i);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int c = 0; c < COLS<SWIGLU>; ++c) acc[r][c] = fmaf(a[r], b[c], acc[r][c]);
    }
}
// --8<-- [end:slice]

// --8<-- [start:mainloop]
// One tile's products over the whole K, slice by slice through the two buffers: the loads of slice
// s + 1 are issued before the FMAs of slice s and stored after them, into the buffer slice s - 1
// used -- which every thread is done with, since the __syncthreads that ended slice s - 1.
template <bool SWIGLU>
__device__ __forceinline__ void multiply_tile(float (&acc)[ROWS][COLS<SWIGLU>], float* buffers,
                                              const TileOperands<SWIGLU>& in, int rg, int cg) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int c = 0; c < COLS<SWIGLU>; ++c) acc[r][c] = 0.0f;
    const int slices = (in.k + BLOCK_K - 1) / BLOCK_K;
    SliceLoads<SWIGLU> next;
    next.fetch(in, 0);
    next.store(buffers);
    __syncthreads();
    for (int s = 0; s < slices; ++s) {
        const bool more = s + 1 < slices;
        if (more) next.fetch(in, (s + 1) * BLOCK_K);  // in flight during the FMAs
        multiply_slice<SWIGLU>(acc, buffers + s % 2 * SLICE_FLOATS<SWIGLU>, rg, cg);
        if (more) next.store(buffers + (s + 1) % 2 * SLICE_FLOATS<SWIGLU>);
        __syncthreads();  // slice s + 1 is in place; slice s's buffer is free
    }
}
// --8<-- [end:mainloop]

// The thread's 8 × 8 outputs, 4 columns (8 bytes) per store; with SwiGLU, product c is the gate
// and product c + OUT_COLS the up value of output column c.
template <bool SWIGLU>
__device__ __forceinline__ void write_tile(const float (&acc)[ROWS][COLS<SWIGLU>], const TileOperands<SWIGLU>& in,
                                           int rg, int cg) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int c0 = 0; c0 < OUT_COLS; c0 += 4) {
            elem_t* to = in.out_at(owned(rg, r), owned(cg, c0));
            if (to == nullptr) continue;
            uint2 packed;  // 4 elements
            elem_t* e = reinterpret_cast<elem_t*>(&packed);
#pragma unroll
            for (int c = c0; c < c0 + 4; ++c)
                e[c - c0] = from_float<elem_t>(output_value<SWIGLU>(acc[r][c], acc[r][SWIGLU ? c + OUT_COLS : c]));
            *reinterpret_cast<uint2*>(to) = packed;
        }
    }
}

// grouped.cuh's grouped_gemm, which its kernels call: this rung's way of multiplying.
template <bool SWIGLU>
__device__ __forceinline__ void grouped_gemm(const elem_t* a, const elem_t* b, elem_t* out, const int* offsets,
                                             int experts, int n_out, int k) {
    extern __shared__ __align__(16) float shared[];  // 2 slice buffers, then the offsets
    const int rg = threadIdx.x / GROUPS, cg = threadIdx.x % GROUPS;
    for_each_tile(reinterpret_cast<int*>(shared + 2 * SLICE_FLOATS<SWIGLU>), offsets, experts, n_out,
                  [&](const Tile& tile) {
                      const TileOperands<SWIGLU> in(tile, a, b, out, k, n_out);
                      float acc[ROWS][COLS<SWIGLU>];
                      multiply_tile<SWIGLU>(acc, shared, in, rg, cg);
                      write_tile<SWIGLU>(acc, in, rg, cg);
                  });
}
