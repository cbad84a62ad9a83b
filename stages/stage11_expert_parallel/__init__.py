"""Stage 11 — expert parallelism: the MoE layer across GPUs through NCCL

Stage 7's layer with its experts sharded over the ranks of a torch.distributed process group (NCCL, launched
with torchrun): each rank routes its own tokens (stage 7's router, stage 5's routing), sends each token-slot
to the rank that owns its expert (all_to_all_single, after an exchange of the counts, or with a fixed
capacity), runs its local experts' grouped GEMMs (stage 6), sends the results back and sums them (stage 5's
combine). dispatch.py holds the communication through NCCL, device-agnostic; nvlink.py the same journey
over NVLink by this stage's own kernels (nvlink.cuh: rows stored straight into the peers' buffers);
expert_parallel.cu includes them beside the regroup index. The grader runs it in a world of one;
`torchrun -m stages.stage11_expert_parallel` on several GPUs. sm_90a (stage 6's wgmma GEMMs).
"""
import torch

from stages import Goal, Stage
from stages.common.hopper import sm_count
from stages.common.launcher import param_struct
from stages.stage5_moe_routing import combine
from stages.stage6_grouped_gemm import BLOCK_M, run_experts
from stages.stage7_moe_layer import STAGE as LAYER
from stages.stage7_moe_layer import route_tokens
from stages.stage11_expert_parallel import dispatch, nvlink
from stages.stage11_expert_parallel.dispatch import Parts, Routing

REGROUP_THREADS = 256  # expert_parallel.cu's regroup_index: a grid-stride loop over the grouped rows
# regroup_index's parameters, as expert_parallel.cu's RegroupParams holds them (the grader checks the layout).
RegroupParams = param_struct("RegroupParams", [
    ("counts", "const int*"), ("ranks", "int"), ("experts", "int"), ("align", "int"), ("grouped_rows", "int"),
    ("expert_offsets", "int*"), ("source_row", "int*"), ("grouped_row", "int*")])


class KernelParts(Parts):
    """The course's kernels: stage 7's router with stage 5's routing (unpadded: the rows travel as they
    are) and combine, this stage's regroup index, stage 6's grouped GEMMs on the local experts w1, w2.
    spare_sms: SMs the GEMMs leave to NCCL's kernels or the NVLink copies, so that a piece's transfer can run
    beside another's GEMMs (a persistent GEMM holds every SM's shared memory and registers until it ends)."""
    align = BLOCK_M

    def __init__(self, kernels, wr, bias, w1, w2, top_k, spare_sms=0):
        self.kernels, self.wr, self.bias, self.w1, self.w2, self.top_k = kernels, wr, bias, w1, w2, top_k
        self.spare_sms = spare_sms

    def route(self, x, topk_ids):
        weights, _, counts, _, dest, source_token = route_tokens(self.kernels, x, self.wr, self.bias, self.top_k, 0,
                                                                 topk_ids)
        return Routing(topk_ids, weights, counts, source_token, dest)

    def regroup_index(self, piece):
        ranks, local = piece.recv_counts.shape
        device = piece.recv_counts.device
        offsets, source_row, grouped_row = (torch.empty(n, dtype=torch.int32, device=device) for n in
                                            (local + 1, piece.grouped_rows, piece.received_rows))
        blocks = min(-(-piece.grouped_rows // REGROUP_THREADS), sm_count(device))
        self.kernels.regroup_index((blocks,), (REGROUP_THREADS,),
                                   RegroupParams(counts=piece.recv_counts, ranks=ranks, experts=local, align=self.align,
                                                 grouped_rows=piece.grouped_rows, expert_offsets=offsets,
                                                 source_row=source_row, grouped_row=grouped_row))
        return offsets, source_row, grouped_row

    def experts(self, rows, offsets, experts, y):
        h = rows.new_empty(rows.shape[0], self.w2.shape[1])
        run_experts(self.kernels, rows, offsets, self.w1[experts], self.w2[experts], h, y, self.spare_sms)

    def weighted_sum(self, returned, row_of_slot, weights, out):
        combine(self.kernels, returned, row_of_slot, weights, out, self.top_k)


def launch(kernels, x, wr, bias, w1, w2, top_k, out, topk_ids, group, *, pieces=1, capacity=False, spare_sms=0,
           peers=None):
    """This rank's tokens x through the layer whose experts w1, w2 it holds: through NCCL (dispatch.layer),
    or over NVLink with `peers`, nvlink.PeerBuffers mapped by the whole group (nvlink.layer; its pieces'
    transfers beside the GEMMs on a second stream)."""
    parts = KernelParts(kernels, wr, bias, w1, w2, top_k, spare_sms)
    if peers is None:
        dispatch.layer(x, parts, group, out, topk_ids, pieces=pieces, capacity=capacity)
    else:
        nvlink.layer(x, parts, nvlink.KernelPeers(kernels, peers, parts.align), out, topk_ids, pieces,
                     nvlink.side_stream(x.device) if pieces > 1 else None)


STAGE = Stage(
    name="stage11_expert_parallel",
    problem="moe_expert_parallel",
    source="expert_parallel.cu",
    kernels={**LAYER.kernels, "regroup_index": "const RegroupParams", **nvlink.KERNELS},
    launch=launch,
    param_structs=(*LAYER.param_structs, RegroupParams, *nvlink.PARAM_STRUCTS),
    archs=("sm_90a",),
    geometry=lambda defines: {**LAYER.geometry(defines), "REGROUP_THREADS": REGROUP_THREADS, **nvlink.GEOMETRY},
    goal=Goal("reference", 1.0),  # in the grader's world of one: the fastest library layer, sharded or not
)
