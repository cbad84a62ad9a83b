"""Stage 5 — MoE routing: top-k, permutation and combine

Everything a Mixture-of-Experts layer does around its expert GEMMs: softmax and top-k with a warp
per token, per-expert counts, a padded prefix sum, the scatter to expert-contiguous order, the
load-balancing loss, and the weighted combine back to token order.
"""
import torch

from stages import Goal, Stage
from stages.common.moe import MAX_EXPERTS, MAX_TOP_K, AlignParams, TopkParams

# routing.cu's block sizes, which the grader checks the launch against (with moe.cuh's limits).
TOPK_THREADS = 256
ALIGN_THREADS = 256   # a thread per expert: MAX_EXPERTS
GEOMETRY = {"TOPK_THREADS": TOPK_THREADS, "ALIGN_THREADS": ALIGN_THREADS, "MAX_EXPERTS": MAX_EXPERTS,
            "MAX_TOP_K": MAX_TOP_K}
SCATTER_THREADS = 256  # moe_scatter: a thread per token-slot, any block size
MAX_TOKENS_PER_GROUP = 8


def lanes_per_token(experts: int) -> int:
    """The smallest power of two >= experts, at most 32 (a warp): 8 lanes for 8 experts, 32 for 60."""
    return min(32, 1 << (experts - 1).bit_length())


def tokens_per_group(tokens: int, group: int, device) -> int:
    """Enough tokens per lane group that the grid is about one wave of full SMs (2048 threads each),
    so that each block's counts cost few atomics; at most MAX_TOKENS_PER_GROUP."""
    resident_groups = torch.cuda.get_device_properties(device).multi_processor_count * (2048 // group)
    return max(1, min(MAX_TOKENS_PER_GROUP, -(-tokens // resident_groups)))


def route(kernels, logits, top_k, block, alpha, topk_ids, topk_weights, expert_counts, expert_offsets, dest,
          source_token, aux_loss, usage_var):
    """Top-k, counts, padded offsets, the permutation and the balance statistics (shared with stage 7)."""
    tokens, experts = logits.shape
    assert 1 <= top_k <= min(experts, MAX_TOP_K) and experts <= MAX_EXPERTS, (experts, top_k)
    group = lanes_per_token(experts)  # >= top_k: lane j of a group writes slot j
    per_group = tokens_per_group(tokens, group, logits.device)
    token_blocks = -(-tokens // (TOPK_THREADS // group * per_group))

    # Counts, then fp32 probability sums (all-zero bits are 0.0f): zeroed for moe_topk's atomics.
    workspace = torch.zeros(2 * experts, dtype=torch.int32, device=logits.device)
    counts, prob_sums = workspace[:experts], workspace[experts:]
    kernels.moe_topk((token_blocks,), (TOPK_THREADS,),
                     TopkParams(logits=logits, topk_ids=topk_ids, topk_weights=topk_weights, rank=dest,
                                expert_counts=counts, prob_sums=prob_sums, tokens=tokens, experts=experts, top_k=top_k,
                                group=group, tokens_per_group=per_group))
    kernels.moe_align((1,), (ALIGN_THREADS,),
                      AlignParams(counts=counts, prob_sums=prob_sums, expert_counts=expert_counts,
                                  expert_offsets=expert_offsets, source_token=source_token, aux_loss=aux_loss,
                                  usage_var=usage_var, tokens=tokens, experts=experts, top_k=top_k, block=block,
                                  rows=source_token.shape[0], alpha=alpha))
    slots = tokens * top_k
    kernels.moe_scatter((-(-slots // SCATTER_THREADS),), (SCATTER_THREADS,), topk_ids, expert_offsets, dest,
                        source_token, slots, top_k)


def combine(kernels, y_perm, dest, topk_weights, out, top_k):
    """out[t] = Σ_j topk_weights[t, j] · y_perm[dest[t, j]] (shared with stage 7)."""
    tokens, hidden = out.shape
    columns = hidden // 8 if hidden % 8 == 0 else hidden  # what the combine's threads share out
    threads = min(128, 32 * -(-columns // 32))
    kernels.moe_combine((tokens,), (threads,), y_perm, dest, topk_weights, out, top_k, hidden)


def launch(kernels, logits, y_perm, top_k, block, alpha, topk_ids, topk_weights, expert_counts, expert_offsets,
           dest, source_token, aux_loss, usage_var, out):
    route(kernels, logits, top_k, block, alpha, topk_ids, topk_weights, expert_counts, expert_offsets, dest,
          source_token, aux_loss, usage_var)
    combine(kernels, y_perm, dest, topk_weights, out, top_k)


STAGE = Stage(
    name="stage5_moe_routing",
    problem="moe_routing",
    source="routing.cu",
    kernels={
        "moe_topk": "const TopkParams",
        "moe_align": "const AlignParams",
        "moe_scatter": "const int*, const int*, int*, int*, int, int",
        "moe_combine": "const elem_t*, const int*, const float*, elem_t*, int, int",
    },
    launch=launch,
    param_structs=(TopkParams, AlignParams),
    geometry=lambda defines: GEOMETRY,
    # The reference is PyTorch's own routing, vectorized ("torch": softmax, topk, argsort, scatters,
    # a gather-and-sum; a dozen kernels, several passes over the data). Matching it is the floor; the
    # kernels here should beat it several times over, and stay under 2% of the layer (see notes).
    goal=Goal("reference", 1.0),
)
