"""Stage 6's ladder: the experts' grouped GEMM with the techniques of earlier stages, graded like stage 6.

Both rungs compute what experts.cu computes, with the same tile scheduler, kernels and tile order, as
persistent grids of 256-thread blocks over 128 × 128 output tiles (grouped.cuh); they differ in how a
block multiplies its tile: simt.cu on the CUDA cores in fp32 (stage 1's register tiling), mma_sync.cu
on the tensor cores with mma.sync, ldmatrix and a cp.async ring (stages 2-3). They run on sm_80 and
newer: on a GPU without wgmma (an A100, an L4, an RTX 4090) the mma_sync rung is stage 6, and stage 7
builds the MoE layer on it.
"""
import torch

from stages import ALL_ARCHS, Goal, Stage
from stages.common.hopper import sm_count
from stages.common.moe import MAX_EXPERTS, ExpertParams

SIGNATURE = "const elem_t*, const elem_t*, elem_t*, const ExpertParams"  # the operands, then experts.cu's struct
KERNELS = {"expert_up_swiglu": SIGNATURE, "expert_down": SIGNATURE}
PARAM_STRUCTS = (ExpertParams,)  # the struct KERNELS name
SWIGLU = {"expert_up_swiglu": "true", "expert_down": "false"}  # the template argument of each kernel

# What the launch uses, as grouped.cuh and each rung's .cu compute it (the grader checks each value
# against the kernel): 256 threads; blocks per SM in the persistent grid, the kernels'
# __launch_bounds__ minimum; dynamic shared memory, the ring (simt: 2 fp32 slices of 16 k; mma_sync:
# 2 stages of 64 k) and the experts' offsets.
NUM_THREADS = 256
BLOCKS_PER_SM = {"expert_up_swiglu": 1, "expert_down": 2}
SHARED_BYTES = {"simt": {"expert_up_swiglu": 50180, "expert_down": 33796},
                "mma_sync": {"expert_up_swiglu": 99332, "expert_down": 66564}}


def geometry(rung: str) -> dict:
    return {"NUM_THREADS": NUM_THREADS, "MAX_EXPERTS": MAX_EXPERTS,
            **{f"BLOCKS_PER_SM<{SWIGLU[k]}>": n for k, n in BLOCKS_PER_SM.items()},
            **{f"SHARED_BYTES<{SWIGLU[k]}>": n for k, n in SHARED_BYTES[rung].items()}}


def run_experts(rung: str, kernels, x_perm, expert_offsets, w1, w2, h, y_perm):
    """h = SwiGLU(x_perm · W1), y_perm = h · W2 over the rows each expert owns, as stage 6's run_experts,
    on a persistent grid of BLOCKS_PER_SM blocks per SM."""
    experts, hidden, inter = w1.shape[0], w1.shape[1], w2.shape[1]
    sms = sm_count(x_perm.device)

    def launch(name, *args):
        getattr(kernels, name)((BLOCKS_PER_SM[name] * sms,), (NUM_THREADS,), *args, smem=SHARED_BYTES[rung][name])

    params = ExpertParams(offsets=expert_offsets, experts=experts, inter=inter, hidden=hidden)  # both GEMMs'
    launch("expert_up_swiglu", x_perm, w1, h, params)
    launch("expert_down", h, w2, y_perm, params)


def rung(name: str, goal: Goal) -> Stage:
    def launch(kernels, x_perm, expert_offsets, expert_counts, w1, w2, y_perm):
        h = torch.empty(x_perm.shape[0], w2.shape[1], dtype=x_perm.dtype, device=x_perm.device)
        run_experts(name, kernels, x_perm, expert_offsets, w1, w2, h, y_perm)

    return Stage(name="stage6_grouped_gemm", problem="moe_experts", source=f"ladder/{name}.cu", kernels=KERNELS,
                 launch=launch, param_structs=PARAM_STRUCTS, archs=ALL_ARCHS, geometry=lambda defines: geometry(name),
                 goal=goal, rung=name)


# Goals scale to what each technique can reach against the fastest library baseline (tensor cores):
# CUDA cores in fp32 reach about 1/15 of the 16-bit tensor-core rate, mma.sync about 2/3 of wgmma's.
RUNGS = (rung("mma_sync", Goal("reference", 0.6)), rung("simt", Goal("reference", 0.06)))
