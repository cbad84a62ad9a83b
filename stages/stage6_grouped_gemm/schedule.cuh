// Stage 6's device-side tile scheduler, shared by the three rungs of its ladder: the wgmma kernel
// (experts.cu) and the CUDA-core and mma.sync kernels (ladder/simt.cu, ladder/mma_sync.cu).
//
// A grouped GEMM's work is a list of 128-row × N-column output tiles, expert after expert, that only
// the device knows (the offsets come from the routing). A persistent grid walks it: block b takes
// tiles b, b + gridDim.x, b + 2·gridDim.x, ... and finds each tile's expert from the offsets.
#pragma once

constexpr int BLOCK_M = 128;  // rows per tile; every expert's segment is padded to a multiple of it

struct Tile {
    int expert, row0, n;  // rows row0 .. row0 + 127 of expert `expert`, column tile n
};

// --8<-- [start:scheduler]
// The tiles of one launch, numbered expert by expert; inside an expert column tile by column tile,
// and the expert's m-tiles fastest. Expert e starts at tile offsets[e] / BLOCK_M · n_tiles -- its
// segment is padded to whole m-tiles, so no tile holds two experts -- and an expert without tokens
// has no tiles. Every thread of a block walks the same sequence: tile, tile + gridDim.x, ...
struct Scheduler {
    const int* offsets;  // in shared memory: offsets[0 .. experts], multiples of BLOCK_M
    int experts, n_tiles;

    __device__ int num_tiles() const { return offsets[experts] / BLOCK_M * n_tiles; }

    // Tile t's expert is the last e in 0 .. experts-1 whose first tile, offsets[e] / BLOCK_M ·
    // n_tiles, is <= t (a binary search; the last, so that experts with no rows are skipped).
    __device__ Tile tile(int t) const {
        int lo = 0, hi = experts - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (offsets[mid] / BLOCK_M * n_tiles <= t) lo = mid;
            else hi = mid - 1;
        }
        const int first_m = offsets[lo] / BLOCK_M, m_tiles = offsets[lo + 1] / BLOCK_M - first_m;
        const int local = t - first_m * n_tiles;
        return {lo, (first_m + local % m_tiles) * BLOCK_M, local / m_tiles};
    }
};
// --8<-- [end:scheduler]
