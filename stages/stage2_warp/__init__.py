"""Stage 2 — tensor cores with mma.sync (FlashAttention-2 split)

One kernel: each warp owns 16 query rows and computes S = QKᵀ and O += PV with mma.sync on the
tensor cores, the online softmax on the accumulator fragments, P kept in registers.
"""
from stages import Goal, Stage
from stages.common.fused_attention import KERNELS, launch_fused

BLOCK_M = 64  # query rows per block (4 warps × 16), as in attention.cu
BLOCK_N = 64  # keys per K/V tile
THREADS = 128


def shared_bytes(head_dim: int, element_size: int) -> int:
    """Q, K and V tiles of 64 rows, each row padded by 8 elements (attention.cu, load_tile)."""
    return (BLOCK_M + 2 * BLOCK_N) * (head_dim + 8) * element_size


def launch(kernels, q, k, v, o, lse, scale, causal):
    launch_fused(kernels, q, k, v, o, lse, scale, causal, block_m=BLOCK_M, threads=THREADS,
                 smem=shared_bytes(q.shape[-1], q.element_size()))


STAGE = Stage(
    name="stage2_warp",
    problem="attention",
    source="attention.cu",
    kernels=KERNELS,
    launch=launch,
    specializations={"HEAD_DIM": "D"},  # the head dimension, compiled in
    goal=Goal("flash", 0.6),
)
