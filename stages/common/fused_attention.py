"""What every fused attention stage (1 to 3) shares: one kernel, `attention_fwd` in attention.cu,
compiled per head dimension, one block per tile of BLOCK_M query rows of one (batch, head).

grid = (query tiles, group, KV pairs): grouped-query attention has group = H / H_kv query heads per KV
head, and the block (x, y, z) takes query pair z · group + y (gridDim.y = group: no parameter says it)
and reads the K and V of KV pair z. Without groups, grid.y = 1 and grid.z walks the pairs."""
import torch

from stages import Goal, Stage
from stages.common.attention import MAX_GRID_YZ, by_head_dim, head_slices, kv_group

KERNELS = {"attention_fwd": "const elem_t*, const elem_t*, const elem_t*, elem_t*, float*, int, int, float, int"}


def fused_launch(geometry: dict[int, dict[str, int]]):
    """The launch of a kernel whose BLOCK_M, NUM_THREADS and SHARED_BYTES (dynamic shared memory) at
    head dimension D are geometry[D]'s."""
    def launch(kernels, q, k, v, o, lse, scale, causal) -> None:
        launched = geometry[q.shape[-1]]
        seq_q, seq_kv, group = q.shape[2], k.shape[2], kv_group(q, k)
        # These kernels read and write dense [B, H, S, D]: other layouts (a model's [B, S, H, D] views, ops'
        # [B, S, H, D] output buffer) are copied; stage 4, on Hopper, reads and writes them where they lie.
        q, k, v = (x.contiguous() for x in (q, k, v))
        dense = o if o.is_contiguous() else torch.empty_like(q)
        # B·H_kv in grid.z: at most 65,535 KV pairs a launch, each with its whole group of query heads
        for q_, o_, lse_, k_, v_ in head_slices(q, dense, lse, kv=(k, v), group=group,
                                                pairs_per_launch=MAX_GRID_YZ * group):
            grid = (-(-seq_q // launched["BLOCK_M"]), group, k_.shape[0])
            kernels.attention_fwd(grid, (launched["NUM_THREADS"],), q_, k_, v_, o_, lse_, seq_q, seq_kv, scale,
                                  int(causal), smem=launched["SHARED_BYTES"])
        if dense is not o:
            o.copy_(dense)
    return launch


def fused_stage(name: str, geometry: dict[int, dict[str, int]], goal: Goal) -> Stage:
    """The Stage of such a kernel: compiled for each head dimension `geometry` has, launched with its
    values, which the grader checks against the kernel's constants."""
    return Stage(name=name, problem="attention", source="attention.cu", kernels=KERNELS, launch=fused_launch(geometry),
                 specializations={"HEAD_DIM": "D"}, geometry=by_head_dim(geometry), goal=goal)
