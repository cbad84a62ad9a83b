"""Stage 7 — the whole MoE layer: route, permute, grouped GEMMs, combine

The layer from the course's kernels, in eight launches (nine when the router splits hidden) and no host
synchronization: router logits, stage 5's top-k, offsets and permutation, a gather of the tokens into
expert order, stage 6's two grouped GEMMs (SwiGLU fused into the first), stage 5's combine. sm_90a with stage 6's wgmma GEMMs;
its mma_sync rung runs on sm_80 and newer with stage 6's mma_sync rung instead.

A forward whose backward follows (stage 14: ops.moe_layer with gradients) launches with save=True: the
same launches but for stage 6's saving up GEMM, which also stores h1 = x·W1, and the launch returns what
the backward reads (reference/moe_layer_backward.Saved): the routing and the permutation, temporaries
otherwise, and h1. sm_90a only: the mma_sync rung refuses to save.
"""
from functools import partial

import torch

from reference.moe import padded_capacity
from reference.moe_layer_backward import Saved
import stages
from stages import ALL_ARCHS, Goal, Stage
from stages.common.moe import MAX_EXPERTS, RouterParams
from stages.stage5_moe_routing import STAGE as ROUTING
from stages.stage5_moe_routing import combine, route
from stages.stage6_grouped_gemm import BLOCK_M, ladder
from stages.stage6_grouped_gemm import STAGE as EXPERTS
from stages.stage6_grouped_gemm import run_experts

ALPHA = 0.01          # the load-balancing loss's coefficient (stage 5 computes the loss on the way)
# layer.cu's router tiles, which the grader checks the launch against (with stages 5 and 6's geometry).
ROUTER_THREADS = 512
ROUTER_TOKENS = 64    # tokens per block
ROUTER_K = 32         # hidden elements per shared-memory chunk: a split of hidden is whole chunks
ROUTER_STAGES = 4     # chunks in the router's shared-memory ring
ROUTER_SHARED_BYTES = ROUTER_STAGES * (ROUTER_TOKENS * (ROUTER_K + 8) + ROUTER_K * (MAX_EXPERTS + 8)) * 2  # 16-bit
ROUTER_BLOCKS = 256   # router blocks aimed at (two per SM): with fewer token tiles than that, hidden is split,
MIN_SPLIT = ROUTER_K  # down to one chunk per block (a block's chunks are one memory round trip each)
SUM_WARPS = 8         # router_sum: a warp per logit, 8 per block
GATHER_THREADS = 128  # gather_rows: a block per row, any block size


def geometry(experts):
    """layer.cu holds stage 5's kernels, the grouped GEMMs of `experts` (stage 6 or a rung) and the
    router: their constants, and its own."""
    return lambda defines: {**ROUTING.geometry(defines), **experts.geometry(defines),
                            "ROUTER_THREADS": ROUTER_THREADS, "ROUTER_TOKENS": ROUTER_TOKENS, "ROUTER_K": ROUTER_K,
                            "ROUTER_STAGES": ROUTER_STAGES, "ROUTER_SHARED_BYTES": ROUTER_SHARED_BYTES}


def router_logits(kernels, x, wr, bias, logits) -> None:
    """logits = x · wr + bias (None: no bias) in fp32. Few tokens fill few blocks of 64: then hidden is split
    too, the splits' partial sums written apart and added in a fixed order by router_sum (the same logits on
    every run)."""
    tokens, hidden = x.shape
    experts = wr.shape[1]
    token_tiles = -(-tokens // ROUTER_TOKENS)
    splits = max(1, min(ROUTER_BLOCKS // token_tiles, hidden // MIN_SPLIT))
    per_split = -(-hidden // (splits * ROUTER_K)) * ROUTER_K
    splits = -(-hidden // per_split)
    bias = 0 if bias is None else bias  # 0: a null pointer
    partials = logits if splits == 1 else torch.empty(splits, tokens, experts, dtype=torch.float32, device=x.device)
    params = RouterParams(x=x, wr=wr, bias=bias, out=partials, tokens=tokens, hidden=hidden, experts=experts,
                          per_split=per_split)
    kernels.router_logits((token_tiles, splits), (ROUTER_THREADS,), params, smem=ROUTER_SHARED_BYTES)
    if splits > 1:
        kernels.router_sum((-(-tokens * experts // SUM_WARPS),), (32 * SUM_WARPS,), partials, bias, logits, tokens,
                           experts, splits)


def route_tokens(kernels, x, wr, bias, top_k, block, topk_ids):
    """The router's logits (here) and stage 5's routing of x's tokens, each expert's segment padded to
    `block` rows (0: none): (topk_weights, logits, counts, offsets, dest, source_token), in Saved's order,
    topk_ids written. counts and offsets are views of one buffer. Shared with stage 11, which routes
    without padding."""
    tokens, hidden = x.shape
    experts = wr.shape[1]
    # The permuted buffers' capacity, known on the host without looking at the routing; the kernels
    # use the offsets[E] rows actually needed.
    rows = padded_capacity(tokens, experts, top_k, block)
    device, f32, i32 = x.device, torch.float32, torch.int32
    logits = torch.empty(tokens, experts, dtype=f32, device=device)
    topk_weights = torch.empty(tokens, top_k, dtype=f32, device=device)
    dest = torch.empty(tokens, top_k, dtype=i32, device=device)
    counts_offsets = torch.empty(2 * experts + 1, dtype=i32, device=device)
    counts, offsets = counts_offsets[:experts], counts_offsets[experts:]
    source_token = torch.empty(rows, dtype=i32, device=device)
    balance = torch.empty(2, dtype=f32, device=device)  # load-balancing loss, usage variance
    router_logits(kernels, x, wr, bias, logits)
    route(kernels, logits, top_k, block, ALPHA, topk_ids, topk_weights, counts, offsets, dest, source_token,
          balance[:1], balance[1:])
    return topk_weights, logits, counts, offsets, dest, source_token


SAVE_REFUSAL = ("the MoE backward needs sm_90a (an H100 or H200): stage 7's mma_sync rung cannot save what it "
                "reads (h1 = x·W1, stage 6's saving up GEMM is a wgmma kernel)")


def layer_launch(run_experts, saves=True):
    """The layer's launch, with `run_experts` for its grouped GEMMs (stage 6's, or a rung's); `saves`:
    whether they can store h1 (run_experts takes h1=), which save=True needs."""
    def launch(kernels, x, wr, bias, w1, w2, top_k, out, topk_ids, save=False):
        """out and topk_ids written; with save, also h1, and the Saved of this call returned (else None)."""
        if save and not saves:
            raise ValueError(SAVE_REFUSAL)
        routing = route_tokens(kernels, x, wr, bias, top_k, BLOCK_M, topk_ids)
        topk_weights, _, _, offsets, dest, source_token = routing
        rows, hidden, inter = source_token.shape[0], x.shape[1], w2.shape[1]
        x_perm = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
        h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
        y_perm = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
        kernels.gather_rows((rows,), (GATHER_THREADS,), x, source_token, offsets, w1.shape[0], x_perm, hidden)
        if save:
            h1 = torch.empty(rows, 2 * inter, dtype=x.dtype, device=x.device)
            run_experts(kernels, x_perm, offsets, w1, w2, h, y_perm, h1=h1)
        else:
            run_experts(kernels, x_perm, offsets, w1, w2, h, y_perm)
        combine(kernels, y_perm, dest, topk_weights, out, top_k)
        return Saved(topk_ids, *routing, h1) if save else None
    return launch


OWN_KERNELS = {
    "router_logits": "const RouterParams",
    "router_sum": "const float*, const float*, float*, int, int, int",
    **ROUTING.kernels,
    "gather_rows": "const elem_t*, const int*, const int*, int, elem_t*, int",
}
OWN_PARAM_STRUCTS = (RouterParams, *ROUTING.param_structs)

STAGE = Stage(
    name="stage7_moe_layer",
    problem="moe_layer",
    source="layer.cu",
    kernels={**OWN_KERNELS, **EXPERTS.kernels},
    launch=layer_launch(run_experts),
    param_structs=OWN_PARAM_STRUCTS + EXPERTS.param_structs,
    archs=("sm_90a",),
    geometry=geometry(EXPERTS),
    goal=Goal("reference", 1.0),  # the fastest library baseline: the torch._grouped_mm layer
)

# Where the GPU has no wgmma (sm_80-sm_89), the same layer on stage 6's mma_sync rung.
RUNGS = (Stage(
    name="stage7_moe_layer",
    problem="moe_layer",
    source="layer.cu",
    kernels={**OWN_KERNELS, **ladder.KERNELS},
    launch=layer_launch(partial(ladder.run_experts, "mma_sync"), saves=False),
    param_structs=OWN_PARAM_STRUCTS + ladder.PARAM_STRUCTS,
    archs=ALL_ARCHS,
    geometry=geometry(stages.load("stage6:mma_sync")),
    goal=Goal("reference", 0.6),  # as stage 6's mma_sync rung
    rung="mma_sync",
    constants={"MMA_SYNC_EXPERTS": "1"},
),)
