"""Stage 1 — tiled attention with online softmax (CUDA cores)

What's new: one kernel, and no score matrix in global memory. A block keeps a tile of queries,
streams K and V through shared memory tile by tile, and folds each tile of scores into a running
max, a running sum and an fp32 output accumulator (the online softmax), rescaling what it has
accumulated whenever the max grows. Each thread computes a block of 8 × 8 results from registers
(register tiling), so the fp32 CUDA cores, not memory, set the speed.
"""
from stages import Goal, Stage
from stages.common.fused_attention import KERNELS, launch_fused

# These must match the constants at the top of attention.cu.
BLOCK_M = 64                          # query rows per block
BLOCK_N = 64                          # keys per K/V tile
ROW_GROUPS = 8
COL_GROUPS = {64: 8, 128: 16}         # per HEAD_DIM


def shared_bytes(head_dim: int) -> int:
    """Q tile + (K tile, reused for P) + V tile, all fp32, with attention.cu's row strides."""
    col_groups = COL_GROUPS[head_dim]
    q_floats = BLOCK_M * head_dim
    kp_floats = max(BLOCK_N * (head_dim + 4), BLOCK_M * (BLOCK_N + col_groups))
    v_floats = BLOCK_N * head_dim
    return 4 * (q_floats + kp_floats + v_floats)  # 51200 bytes at D = 64, 99328 at D = 128


def launch(kernels, q, k, v, o, lse, scale, causal):
    head_dim = q.shape[-1]
    launch_fused(kernels, q, k, v, o, lse, scale, causal, block_m=BLOCK_M,
                 threads=ROW_GROUPS * COL_GROUPS[head_dim], smem=shared_bytes(head_dim))


STAGE = Stage(
    name="stage1_tiled",
    problem="attention",
    source="attention.cu",
    kernels=KERNELS,
    launch=launch,
    specializations={"HEAD_DIM": "D"},  # the head dimension, compiled in
    goal=Goal("naive", 1.0),  # beat naive PyTorch with CUDA cores only
)
