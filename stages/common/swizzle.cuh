// Swizzled shared-memory tiles, stage 3's layout: rows of 16-byte chunks, unpadded, chunk c of row r
// stored at position c ^ (r % 8). Here are the swizzle itself and the cp.async copies of a global tile
// into such a tile, the one home of both: stage 3 teaches them, stage 8 copies its Q, dO, K and V tiles
// with them, and stage 6's mma_sync rung lays out its operands with the swizzle. Hopper's TMA and
// wgmma apply the same XOR in hardware, the 128-byte swizzle of stages 4, 6 and 9; where stages 6 and
// 9 store into such a tile themselves, they address it with swizzle<SWIZZLE_BYTES>. A kernel's own tile shapes
// come in as template parameters: the bytes of a row, the rows of a tile, the threads that share the
// copies.
#pragma once
#include "cp_async.cuh"

// --8<-- [start:swizzle]
// The swizzle's span: a line of shared memory (32 banks × 4 bytes), the 8 16-byte chunks the XOR
// permutes -- and the row of TMA's and wgmma's 128-byte swizzle. The XOR takes row % 8, so the
// pattern repeats every 8 rows: an "atom" of 8 such rows, which a swizzled tile must be aligned to.
constexpr int SWIZZLE_BYTES = 128;
constexpr int SWIZZLE_ATOM_BYTES = 8 * SWIZZLE_BYTES;  // 1024

// Byte offset of 16-byte chunk `chunk` (elements 8·chunk .. 8·chunk+7 of 16-bit elements) of row
// `row` of a tile whose rows are ROW_BYTES long.
//
// Shared memory has 32 banks of 4 bytes: a 16-byte chunk covers 4 banks, and a 128-byte line
// holds the 8 possible groups of 4 banks. Stage 3's rows are 128 or 256 bytes, so without a swizzle
// chunk c of every row sits in the same bank group, and ldmatrix -- which reads one chunk from
// each of 8 consecutive rows at a time -- would be served one row after another, 8 times slower.
// XORing the chunk index with row % 8 moves chunk c of row r to position c ^ r:
//
//              position:  0  1  2  3  4  5  6  7        (D = 64: one 128-byte line per row)
//     row 0 holds chunk   0  1  2  3  4  5  6  7
//     row 1               1  0  3  2  5  4  7  6
//     row 2               2  3  0  1  6  7  4  5
//     row 3               3  2  1  0  7  6  5  4
//      ...                                              (row 7: 7 6 5 4 3 2 1 0)
//
// Chunk c of rows 0..7 now lies in 8 different positions (one column of the picture has every
// number once): ldmatrix reads are conflict-free. A row still occupies whole 128-byte lines, so
// cp.async stores of consecutive chunks of a row are conflict-free too. At D = 128 a row is two
// lines and the XOR, on the low 3 bits of the chunk index, permutes within each line.
template <int ROW_BYTES>
__device__ __forceinline__ unsigned swizzle(int row, int chunk) {
    static_assert(ROW_BYTES % SWIZZLE_BYTES == 0, "the swizzle permutes the 8 chunks of each 128-byte line");
    return row * ROW_BYTES + ((chunk ^ (row % 8)) * 16);
}
// --8<-- [end:swizzle]

// The cp.async copies of rows [0, rows) of a row-major [*, ROW_ELEMS] global tile into a swizzled
// tile of TILE_ROWS rows at shared address `tile`, shared by the THREADS threads of the block; rows
// past `rows` are zero-filled (a key row of zeros still meets p = 0 in P·V, but 0 × garbage can be
// NaN; a zero query or key row adds nothing to any product of the backward). Neighbouring threads
// copy neighbouring chunks of a row: coalesced reads, conflict-free writes. Two ways to write the
// addresses, the same copies: which one fits a kernel's register cap without spilling depends on
// the kernel (stage 3 takes the first at D = 64 and the second at D = 128, stage 8 the second).

// One index i per copy, taken apart into (row, chunk) and swizzled.
template <int TILE_ROWS, int ROW_ELEMS, int THREADS, typename T>
__device__ __forceinline__ void load_tile_by_index(unsigned tile, const T* source, int rows) {
    constexpr int ROW_BYTES = ROW_ELEMS * (int)sizeof(T), CHUNK_ELEMS = 16 / (int)sizeof(T);
    constexpr int CHUNKS_PER_ROW = ROW_BYTES / 16;
    static_assert(TILE_ROWS * CHUNKS_PER_ROW % THREADS == 0, "every thread copies as many chunks");
#pragma unroll
    for (int step = 0; step < TILE_ROWS * CHUNKS_PER_ROW / THREADS; ++step) {
        const int i = step * THREADS + threadIdx.x;
        const int row = i / CHUNKS_PER_ROW, chunk = i % CHUNKS_PER_ROW;
        const bool valid = row < rows;
        const T* from = source + (size_t)(valid ? row : 0) * ROW_ELEMS + chunk * CHUNK_ELEMS;  // row 0 exists
        cp_async_16(tile + swizzle<ROW_BYTES>(row, chunk), from, valid);
    }
}

// A thread copies the same chunk of rows row0, row0 + ROWS_PER_STEP, ...; ROWS_PER_STEP is a
// multiple of 8, so every one of these rows has the same swizzle term, and the addresses are one
// shared and one global base plus compile-time offsets. The per-index form above costs registers in
// a kernel that loads tiles inside a loop: ptxas hoisted its per-chunk index arithmetic out of stage
// 3's K/V loop and kept some 14-18 more registers live through it, and at D = 128 that alone spills
// 96 bytes. threadIdx.x is read through a volatile asm, a value ptxas cannot hoist either: the two
// bases are recomputed by a few integer instructions per call instead of being held (held, stage 8's
// spill at D = 128 too). (Stage 3 at D = 64 is the other way round: this form spills 12 bytes at the
// cap of 128 registers, the per-index one none.)
// With UNPREDICATED_WHOLE_TILES, a whole tile (rows >= TILE_ROWS: all but the last) takes a branch of
// its own whose copies test no row (stage 3); without, every copy tests its row (stage 8).
template <int TILE_ROWS, int ROW_ELEMS, int THREADS, bool UNPREDICATED_WHOLE_TILES, typename T>
__device__ __forceinline__ void load_tile_from_base(unsigned tile, const T* source, int rows) {
    constexpr int ROW_BYTES = ROW_ELEMS * (int)sizeof(T), CHUNK_ELEMS = 16 / (int)sizeof(T);
    constexpr int CHUNKS_PER_ROW = ROW_BYTES / 16;
    constexpr int ROWS_PER_STEP = THREADS / CHUNKS_PER_ROW;
    static_assert(THREADS % CHUNKS_PER_ROW == 0 && ROWS_PER_STEP % 8 == 0, "the swizzle repeats every 8 rows");
    static_assert(TILE_ROWS % ROWS_PER_STEP == 0, "every thread copies as many chunks");
    unsigned thread;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(thread));
    const int row0 = (int)(thread / CHUNKS_PER_ROW), chunk = (int)(thread % CHUNKS_PER_ROW);
    const unsigned to = tile + swizzle<ROW_BYTES>(row0, chunk);
    const T* from = source + row0 * ROW_ELEMS + chunk * CHUNK_ELEMS;
    if (UNPREDICATED_WHOLE_TILES && rows >= TILE_ROWS) {  // no predicates
#pragma unroll
        for (int step = 0; step < TILE_ROWS / ROWS_PER_STEP; ++step)
            cp_async_16(to + step * ROWS_PER_STEP * ROW_BYTES, from + step * ROWS_PER_STEP * ROW_ELEMS, true);
    } else {
#pragma unroll
        for (int step = 0; step < TILE_ROWS / ROWS_PER_STEP; ++step) {
            const bool valid = row0 + step * ROWS_PER_STEP < rows;
            cp_async_16(to + step * ROWS_PER_STEP * ROW_BYTES,  // an invalid copy reads nothing, but its
                        valid ? from + step * ROWS_PER_STEP * ROW_ELEMS : source, valid);  // address must exist: row 0
        }
    }
}

// A shared-memory address rounded up to a whole swizzle atom: TMA's 128-byte swizzle and the wgmma
// descriptors' base offset 0 assume tiles aligned to SWIZZLE_ATOM_BYTES, which a kernel's dynamic shared
// memory is not promised to be (its launch asks for one atom more).
__device__ __forceinline__ unsigned atom_aligned(unsigned address) {
    return (address + SWIZZLE_ATOM_BYTES - 1) & ~(SWIZZLE_ATOM_BYTES - 1u);
}
