"""The launch every fused attention stage (1 and later) shares: one kernel, `attention_fwd`,
one block per tile of `block_m` query rows of one (batch, head)."""

KERNELS = {"attention_fwd": "const elem_t*, const elem_t*, const elem_t*, elem_t*, float*, int, int, float, int"}


def launch_fused(kernels, q, k, v, o, lse, scale, causal, *, block_m: int, threads: int, smem: int) -> None:
    batch, heads, seq_q, _ = q.shape
    grid = (-(-seq_q // block_m), batch * heads)  # B·H in grid.y: at most 65535 (batch, head) pairs
    kernels.attention_fwd(grid, (threads,), q, k, v, o, lse, seq_q, k.shape[2], scale, int(causal), smem=smem)
