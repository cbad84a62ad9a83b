"""Stage 1 — tiled attention with online softmax (CUDA cores)

What's new: one kernel, and no score matrix in global memory. A block keeps a tile of queries,
streams K and V through shared memory tile by tile, and folds each tile of scores into a running
max, a running sum and an fp32 output accumulator (the online softmax), rescaling what it has
accumulated whenever the max grows. Each thread computes a block of 8 × 8 results from registers
(register tiling), so the fp32 CUDA cores, not memory, set the speed.
"""
from stages import Goal
from stages.common.fused_attention import fused_stage

# What the launch uses, per head dimension, as attention.cu computes it (the grader checks each value
# against the kernel): query rows per block; threads, 8 row groups × 8 or 16 column groups; dynamic
# shared memory, the fp32 Q tile, K tile (reused for P) and V tile.
GEOMETRY = {64: {"BLOCK_M": 64, "NUM_THREADS": 64, "SHARED_BYTES": 51200},
            128: {"BLOCK_M": 64, "NUM_THREADS": 128, "SHARED_BYTES": 99328}}

STAGE = fused_stage("stage1_tiled", GEOMETRY, Goal("naive", 1.0))  # beat naive PyTorch with CUDA cores only
