"""What every fused attention stage (1 to 3) shares: one kernel, `attention_fwd` in attention.cu,
compiled per head dimension, one block per tile of BLOCK_M query rows of one (batch, head)."""
from stages import Goal, Stage
from stages.common.attention import by_head_dim, head_slices

KERNELS = {"attention_fwd": "const elem_t*, const elem_t*, const elem_t*, elem_t*, float*, int, int, float, int"}


def fused_launch(geometry: dict[int, dict[str, int]]):
    """The launch of a kernel whose BLOCK_M, NUM_THREADS and SHARED_BYTES (dynamic shared memory) at
    head dimension D are geometry[D]'s."""
    def launch(kernels, q, k, v, o, lse, scale, causal) -> None:
        launched = geometry[q.shape[-1]]
        seq_q, seq_kv = q.shape[2], k.shape[2]
        for q_, k_, v_, o_, lse_ in head_slices(q, k, v, o, lse):  # B·H in grid.y: 65,535 pairs a launch
            grid = (-(-seq_q // launched["BLOCK_M"]), q_.shape[0])
            kernels.attention_fwd(grid, (launched["NUM_THREADS"],), q_, k_, v_, o_, lse_, seq_q, seq_kv, scale,
                                  int(causal), smem=launched["SHARED_BYTES"])
    return launch


def fused_stage(name: str, geometry: dict[int, dict[str, int]], goal: Goal) -> Stage:
    """The Stage of such a kernel: compiled for each head dimension `geometry` has, launched with its
    values, which the grader checks against the kernel's constants."""
    return Stage(name=name, problem="attention", source="attention.cu", kernels=KERNELS, launch=fused_launch(geometry),
                 specializations={"HEAD_DIM": "D"}, geometry=by_head_dim(geometry), goal=goal)
