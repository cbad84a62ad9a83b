"""Stage 6 — grouped GEMM: the experts' SwiGLU FFN with a device-side tile scheduler

sm_90a only. Two persistent launches, one block per SM: x·W1 with SwiGLU fused into its epilogue,
then h·W2, for every expert at once (for a forward whose backward follows, the first one also stores
the product x·W1 itself: expert_up_swiglu_saving). Each block walks (expert, column tile, row tile) triples,
finding each tile's expert from the padded offsets on the device, so the host never waits for the
routing. The main loop is stage 4's machinery at GEMM scale: TMA into a 3-deep ring of 128-byte-
swizzled stages, two consumer warpgroups on wgmma.m64n256k16, one producer warp.
"""
import torch

from stages import Goal, Stage
from stages.common.hopper import sm_count, tensor_map
from stages.common.moe import MAX_EXPERTS, ExpertParams

# What the launch uses, as experts.cu computes it (the grader checks each value against the kernel):
BLOCK_M = 128         # rows per tile; expert segments must start at multiples of it (schedule.cuh)
BLOCK_K = 64          # K per ring stage: the rows of a TMA box of B
CONSUMER_ROWS = 64    # a consumer warpgroup's rows of a tile: the rows of a TMA box of the output
BOX_COLS = 64         # a TMA box with the 128-byte swizzle is at most 64 16-bit elements wide
NUM_THREADS = 384     # a producer warpgroup + 2 consumer warpgroups
SHARED_BYTES = 215096  # the ring, the consumers' output tiles, the offsets, the mbarriers, 1 KB to align
GEOMETRY = {"BLOCK_M": BLOCK_M, "BLOCK_K": BLOCK_K, "CONSUMER_ROWS": CONSUMER_ROWS, "BOX_COLS": BOX_COLS,
            "NUM_THREADS": NUM_THREADS, "SHARED_BYTES": SHARED_BYTES, "MAX_EXPERTS": MAX_EXPERTS}


def run_experts(kernels, x_perm, expert_offsets, w1, w2, h, y_perm, spare_sms=0, h1=None):
    """h = SwiGLU(x_perm · W1), y_perm = h · W2 over the rows each expert owns (shared with stages 7 and 11).
    x_perm, h, y_perm: [rows, ·] with every expert's segment padded to BLOCK_M rows; W1 [E, hidden,
    2·inter], W2 [E, inter, hidden]. Rows past expert_offsets[E] are neither read nor written. A block per
    SM, less `spare_sms`: SMs left to kernels that run beside (stage 11's NCCL transfers). With h1, a
    [rows, 2·inter] buffer: the up GEMM also stores its product x_perm · W1 = [G U] there (the saving
    kernel, for the backward); its padding rows as the kernel leaves them."""
    experts, hidden, inter = w1.shape[0], w1.shape[1], w2.shape[1]
    assert experts <= MAX_EXPERTS, experts
    assert hidden % 8 == 0 and inter % 8 == 0 and min(hidden, inter) >= BLOCK_K, \
        f"hidden and inter must be multiples of 8 (TMA strides), at least {BLOCK_K}: {hidden}, {inter}"
    grid = (sm_count(x_perm.device) - spare_sms,)  # persistent: the kernels find their tiles on the device
    a_box, b_box, out_box = (1, BLOCK_M, BLOCK_K), (1, BLOCK_K, BOX_COLS), (1, CONSUMER_ROWS, BOX_COLS)
    params = ExpertParams(offsets=expert_offsets, experts=experts, inter=inter, hidden=hidden)  # both GEMMs'
    if h1 is None:
        kernels.expert_up_swiglu(grid, (NUM_THREADS,), tensor_map(x_perm[None], a_box), tensor_map(w1, b_box),
                                 tensor_map(h[None], out_box), params, smem=SHARED_BYTES)
    else:
        assert h1.shape == (x_perm.shape[0], 2 * inter), (h1.shape, x_perm.shape, inter)
        kernels.expert_up_swiglu_saving(grid, (NUM_THREADS,), tensor_map(x_perm[None], a_box), tensor_map(w1, b_box),
                                        tensor_map(h[None], out_box), tensor_map(h1[None], out_box), params,
                                        smem=SHARED_BYTES)
    kernels.expert_down(grid, (NUM_THREADS,), tensor_map(h[None], a_box), tensor_map(w2, b_box),
                        tensor_map(y_perm[None], out_box), params, smem=SHARED_BYTES)


def launch(kernels, x_perm, expert_offsets, expert_counts, w1, w2, y_perm):
    h = torch.empty(x_perm.shape[0], w2.shape[1], dtype=x_perm.dtype, device=x_perm.device)
    run_experts(kernels, x_perm, expert_offsets, w1, w2, h, y_perm)


STAGE = Stage(
    name="stage6_grouped_gemm",
    problem="moe_experts",
    source="experts.cu",
    kernels={
        "expert_up_swiglu": "const TmaMap, const TmaMap, const TmaMap, const ExpertParams",
        "expert_down": "const TmaMap, const TmaMap, const TmaMap, const ExpertParams",
        "expert_up_swiglu_saving": "const TmaMap, const TmaMap, const TmaMap, const TmaMap, const ExpertParams",
    },
    launch=launch,
    param_structs=(ExpertParams,),
    archs=("sm_90a",),
    geometry=lambda defines: GEOMETRY,
    goal=Goal("reference", 1.0),  # the fastest library baseline: torch._grouped_mm where it runs
)
from stages.stage6_grouped_gemm.ladder import RUNGS  # noqa: E402  (the ladder's lower rungs, graded alike)
