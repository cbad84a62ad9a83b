"""Stage 3 — an asynchronous cp.async pipeline with swizzled shared memory

Stage 2's warp-level math, fed by a ring of cp.async copies: the next K/V tile loads while this one
is computed, into XOR-swizzled shared memory that ldmatrix reads without bank conflicts. At D=128
the online softmax rescales O only when a running max grows by more than 2^8.
"""
from stages import Goal, Stage
from stages.common.fused_attention import KERNELS, launch_fused

BLOCK_M = 128   # query rows per block, as in attention.cu


def config(head_dim: int) -> tuple[int, int, int]:
    """(threads, BLOCK_N, KV_STAGES) per head dimension, as in attention.cu: 64-key tiles in
    2 buffers either way; 8 warps × 16 rows at D=64, 4 warps × 32 rows at D=128."""
    return (256, 64, 2) if head_dim == 64 else (128, 64, 2)


def shared_bytes(head_dim: int, element_size: int) -> int:
    """The Q tile and KV_STAGES K and V tiles, unpadded (attention.cu): 48 KB at D=64, 96 KB at
    D=128 (16-bit elements)."""
    _, block_n, kv_stages = config(head_dim)
    return (BLOCK_M + 2 * kv_stages * block_n) * head_dim * element_size


def launch(kernels, q, k, v, o, lse, scale, causal):
    head_dim = q.shape[-1]
    launch_fused(kernels, q, k, v, o, lse, scale, causal, block_m=BLOCK_M, threads=config(head_dim)[0],
                 smem=shared_bytes(head_dim, q.element_size()))


STAGE = Stage(
    name="stage3_pipeline",
    problem="attention",
    source="attention.cu",
    kernels=KERNELS,
    launch=launch,
    specializations={"HEAD_DIM": "D"},  # the head dimension, compiled in
    goal=Goal("flash", 0.9),
)
