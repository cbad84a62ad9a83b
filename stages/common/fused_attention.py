"""The launch every fused attention stage (1 and later) shares: one kernel, `attention_fwd`,
one block per tile of `block_m` query rows of one (batch, head)."""
from stages.common.attention import head_slices

KERNELS = {"attention_fwd": "const elem_t*, const elem_t*, const elem_t*, elem_t*, float*, int, int, float, int"}


def launch_fused(kernels, q, k, v, o, lse, scale, causal, *, block_m: int, threads: int, smem: int) -> None:
    seq_q, seq_kv = q.shape[2], k.shape[2]
    for q_, k_, v_, o_, lse_ in head_slices(q, k, v, o, lse):  # B·H in grid.y: 65,535 pairs a launch
        grid = (-(-seq_q // block_m), q_.shape[0])
        kernels.attention_fwd(grid, (threads,), q_, k_, v_, o_, lse_, seq_q, seq_kv, scale, int(causal), smem=smem)
