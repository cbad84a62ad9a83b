"""Stage 7 — the whole MoE layer: route, permute, grouped GEMMs, combine

sm_90a only (stage 6's GEMMs). The layer from the course's kernels, in eight launches and no host
synchronization: router logits, stage 5's top-k, offsets and permutation, a gather of the tokens
into expert order, stage 6's two grouped GEMMs (SwiGLU fused into the first), stage 5's combine.
"""
import torch

from reference.moe import padded_capacity
from stages import Goal, Stage
from stages.stage5_moe_routing import STAGE as ROUTING
from stages.stage5_moe_routing import combine, route
from stages.stage6_grouped_gemm import BLOCK_M
from stages.stage6_grouped_gemm import STAGE as EXPERTS
from stages.stage6_grouped_gemm import run_experts

ALPHA = 0.01          # the load-balancing loss's coefficient (stage 5 computes the loss on the way)
# layer.cu's router tiles, which the grader checks the launch against (with stages 5 and 6's geometry).
ROUTER_THREADS = 256
ROUTER_TOKENS = 64    # tokens per block
GATHER_THREADS = 128  # gather_rows: a block per row, any block size


def geometry(defines: dict) -> dict:
    """layer.cu holds stage 5's and stage 6's kernels and the router: their constants, and its own."""
    return {**ROUTING.geometry(defines), **EXPERTS.geometry(defines),
            "ROUTER_THREADS": ROUTER_THREADS, "ROUTER_TOKENS": ROUTER_TOKENS}


def launch(kernels, x, wr, bias, w1, w2, top_k, out, topk_ids):
    tokens, hidden = x.shape
    experts, inter = w1.shape[0], w2.shape[1]
    # The permuted buffers' capacity, known on the host without looking at the routing; the kernels
    # use the offsets[E] rows actually needed.
    rows = padded_capacity(tokens, experts, top_k, BLOCK_M)
    device, f32, i32 = x.device, torch.float32, torch.int32
    logits = torch.empty(tokens, experts, dtype=f32, device=device)
    topk_weights = torch.empty(tokens, top_k, dtype=f32, device=device)
    dest = torch.empty(tokens, top_k, dtype=i32, device=device)
    counts_offsets = torch.empty(2 * experts + 1, dtype=i32, device=device)
    counts, offsets = counts_offsets[:experts], counts_offsets[experts:]
    source_token = torch.empty(rows, dtype=i32, device=device)
    balance = torch.empty(2, dtype=f32, device=device)  # load-balancing loss, usage variance
    x_perm = torch.empty(rows, hidden, dtype=x.dtype, device=device)
    h = torch.empty(rows, inter, dtype=x.dtype, device=device)
    y_perm = torch.empty(rows, hidden, dtype=x.dtype, device=device)

    kernels.router_logits((-(-tokens // ROUTER_TOKENS),), (ROUTER_THREADS,), x, wr, bias, logits, tokens, hidden,
                          experts)
    route(kernels, logits, top_k, BLOCK_M, ALPHA, topk_ids, topk_weights, counts, offsets, dest, source_token,
          balance[0:], balance[1:])
    kernels.gather_rows((rows,), (GATHER_THREADS,), x, source_token, offsets, experts, x_perm, hidden)
    run_experts(kernels, x_perm, offsets, w1, w2, h, y_perm)
    combine(kernels, y_perm, dest, topk_weights, out, top_k)


STAGE = Stage(
    name="stage7_moe_layer",
    problem="moe_layer",
    source="layer.cu",
    kernels={
        "router_logits": "const elem_t*, const elem_t*, const float*, float*, int, int, int",
        **ROUTING.kernels,
        "gather_rows": "const elem_t*, const int*, const int*, int, elem_t*, int",
        **EXPERTS.kernels,
    },
    launch=launch,
    archs=("sm_90a",),
    geometry=geometry,
    goal=Goal("reference", 1.0),  # the fastest library baseline: the torch._grouped_mm layer
)
