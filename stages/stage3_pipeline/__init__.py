"""Stage 3 — an asynchronous cp.async pipeline with swizzled shared memory

Stage 2's warp-level math, fed by a ring of cp.async copies: the next K/V tile loads while this one
is computed, into XOR-swizzled shared memory that ldmatrix reads without bank conflicts.
"""
from stages import Goal, Stage

BLOCK_M = 128   # query rows per block (8 warps × 16), as in attention.cu
BLOCK_N = 64    # keys per K/V tile
KV_STAGES = 2   # K/V buffers in the cp.async ring
THREADS = 256


def shared_bytes(head_dim: int, element_size: int) -> int:
    """The Q tile and KV_STAGES K and V tiles, unpadded (attention.cu)."""
    return (BLOCK_M + 2 * KV_STAGES * BLOCK_N) * head_dim * element_size


def launch(kernels, q, k, v, o, lse, scale, causal):
    batch, heads, seq_q, head_dim = q.shape
    seq_kv = k.shape[2]
    grid = ((seq_q + BLOCK_M - 1) // BLOCK_M, batch * heads)
    kernels.attention_fwd(grid, (THREADS,), q, k, v, o, lse, seq_q, seq_kv, scale, int(causal),
                          smem=shared_bytes(head_dim, q.element_size()))


STAGE = Stage(
    name="stage3_pipeline",
    problem="attention",
    source="attention.cu",
    kernels={"attention_fwd": "const elem_t*, const elem_t*, const elem_t*, elem_t*, float*, int, int, float, int"},
    launch=launch,
    specializations={"HEAD_DIM": (64, 128)},
    goal=Goal("flash", 0.9),
)
