"""Stage 14 — the MoE layer's backward on Hopper: four grouped GEMMs on what the forward saved, SwiGLU's backward in an epilogue

sm_90a only. The gradients of stage 7's layer (dX, dWr, dBias, dW1, dW2) from dY, the forward's routing
and permutation and its first product h1 = [G U] (reference/moe_layer_backward.py's Saved). Nothing of
the forward is recomputed: the four products of the backward (dA = dY·W2ᵀ, dX = [dG dU]·W1ᵀ, dW2 =
(w·h)ᵀ·dY, dW1 = xᵀ·[dG dU]) run on backward.cu's grouped GEMMs, SwiGLU's backward and the top-k weight's
gradient in the first one's epilogue; the permutation, the router's backward and the combine's are small
kernels of the stage. PyTorch computes one thin product, the router's data side dlogits·Wrᵀ.
"""
from __future__ import annotations

import torch

from stages import Goal, Stage
from stages.common.launcher import param_struct
from stages.common.moe import MAX_EXPERTS, MAX_TOP_K
from stages.stage6_grouped_gemm import BLOCK_K, BLOCK_M, BOX_COLS, CONSUMER_ROWS, GEOMETRY as EXPERTS_GEOMETRY
from stages.stage6_grouped_gemm import NUM_THREADS, SHARED_BYTES

BLOCK_N = 256                  # output columns per tile: one wgmma n256 (every GEMM here)
A_BOX_BYTES = 8192             # expert_grad_weight: A's 64-row × 64-column box, one per consumer and k-step
GATHER_THREADS = 128           # gather_gradient_rows, combine_gradients: a block per row
ROUTER_BACKWARD_THREADS = 256  # router_backward: a warp per token
ROUTER_BACKWARD_BLOCKS = 4     # router_backward's blocks per SM at most (each adds its dBias once)
SWIGLU_SHARED_BYTES = 231552   # expert_grad_swiglu: stage 6's layout and each consumer's 8 KB box of w·h
RWG_THREADS, RWG_COLS, RWG_TOKENS = 256, 64, 32  # router_weight_grad: block, columns and tokens per step
RWG_MAX_EXPERT_BLOCK = 64      # router_weight_grad: experts a block at most (16, 32 or 64)
RWG_BLOCKS = 8                 # router_weight_grad's blocks per SM aimed at: T is split until there are
GEOMETRY = {**EXPERTS_GEOMETRY, "BLOCK_N": BLOCK_N, "A_BOX_BYTES": A_BOX_BYTES, "GATHER_THREADS": GATHER_THREADS,
            "ROUTER_BACKWARD_THREADS": ROUTER_BACKWARD_THREADS, "MAX_TOP_K": MAX_TOP_K,
            "SWIGLU_SHARED_BYTES": SWIGLU_SHARED_BYTES, "RWG_THREADS": RWG_THREADS, "RWG_COLS": RWG_COLS,
            "RWG_TOKENS": RWG_TOKENS, "RWG_MAX_EXPERT_BLOCK": RWG_MAX_EXPERT_BLOCK}

# TMA boxes (outermost first) of the launch's tensor maps, all 128-byte swizzled (stages.common.hopper).
ROWS_BOX = (1, BLOCK_M, BLOCK_K)        # A of the data-side GEMMs: 128 permuted rows × 64 of K
WEIGHT_BOX = (1, BLOCK_K, BOX_COLS)     # a weight [E, ·, ·] read transposed: 64 n-rows × 64 k-columns
OUT_BOX = (1, CONSUMER_ROWS, BOX_COLS)  # every TMA-stored output: a consumer's 64 rows × 64 columns
STEP_BOX = (1, BLOCK_K, BOX_COLS)       # expert_grad_weight's A and B: 64 rows (one k-step) × 64 columns

# The kernels' parameters besides their tensor maps, as backward.cu's structs of these names hold them (the
# grader checks the layouts against them). RouterWeightParams serves router_weight_grad and router_weight_sum.
GatherParams = param_struct("GatherParams", [
    ("x", "const elem_t*"), ("dy", "const elem_t*"), ("source_token", "const int*"), ("dest", "const int*"),
    ("topk_weights", "const float*"), ("expert_offsets", "const int*"), ("experts", "int"), ("slots", "int"),
    ("hidden", "int"), ("x_perm", "elem_t*"), ("dy_perm", "elem_t*"), ("row_weight", "float*")])
SwigluGradParams = param_struct("SwigluGradParams", [
    ("h1", "const elem_t*"), ("row_weight", "const float*"), ("dgu", "elem_t*"), ("hw", "elem_t*"),
    ("g_partial", "float*"), ("offsets", "const int*"), ("experts", "int"), ("inter", "int"), ("hidden", "int"),
    ("rows", "int")])
DataGradParams = param_struct("DataGradParams", [
    ("offsets", "const int*"), ("experts", "int"), ("n_out", "int"), ("k", "int")])
WeightGradParams = param_struct("WeightGradParams", [
    ("offsets", "const int*"), ("counts", "const int*"), ("experts", "int"), ("m_out", "int"), ("n_out", "int")])
RouterBackwardParams = param_struct("RouterBackwardParams", [
    ("logits", "const float*"), ("topk_ids", "const int*"), ("topk_weights", "const float*"), ("dest", "const int*"),
    ("g_partial", "const float*"), ("g_tiles", "int"), ("rows", "int"), ("expert_counts", "const int*"),
    ("aux_scale", "float"), ("tokens", "int"), ("experts", "int"), ("top_k", "int"), ("dlogits", "float*"),
    ("dlogits_rounded", "elem_t*")])
RouterWeightParams = param_struct("RouterWeightParams", [
    ("x", "const elem_t*"), ("dlogits", "const float*"), ("tokens", "int"), ("hidden", "int"), ("experts", "int"),
    ("experts_per_block", "int"), ("per_split", "int"), ("splits", "int"), ("partial", "float*"),
    ("bias_partial", "double*"), ("dwr", "elem_t*"), ("dbias", "float*")])


class HopperKernels:
    """backward.cu's launches, tensors in and out (the CPU tests pass a PyTorch stand-in with these methods)."""

    def __init__(self, kernels, device):
        from stages.common.hopper import sm_count

        self.kernels, self.sms = kernels, sm_count(device)

    def gather(self, x, dy, saved, x_perm, dy_perm, row_weight):
        """x_perm, dy_perm: each row's token's x and dY; row_weight: its top-k weight (0 on padding rows)."""
        tokens, top_k = saved.topk_ids.shape
        params = GatherParams(x=x, dy=dy, source_token=saved.source_token, dest=saved.dest,
                              topk_weights=saved.topk_weights, expert_offsets=saved.expert_offsets,
                              experts=saved.expert_counts.shape[0], slots=tokens * top_k, hidden=x.shape[1],
                              x_perm=x_perm, dy_perm=dy_perm, row_weight=row_weight)
        self.kernels.gather_gradient_rows((x_perm.shape[0],), (GATHER_THREADS,), params)

    def swiglu_grad(self, dy_perm, w2, saved, row_weight, dgu, hw, g_partial):
        """dA = dY·W2[e]ᵀ per expert's rows, through SwiGLU's backward: [dG dU], w·h and g's partials."""
        from stages.common.hopper import tensor_map

        experts, inter, hidden = w2.shape
        params = SwigluGradParams(h1=saved.h1, row_weight=row_weight, dgu=dgu, hw=hw, g_partial=g_partial,
                                  offsets=saved.expert_offsets, experts=experts, inter=inter, hidden=hidden,
                                  rows=dy_perm.shape[0])
        self.kernels.expert_grad_swiglu((self.sms,), (NUM_THREADS,), tensor_map(dy_perm[None], ROWS_BOX),
                                        tensor_map(w2, WEIGHT_BOX), params, smem=SWIGLU_SHARED_BYTES)

    def data(self, a_perm, offsets, weight, out):
        """out = a_perm · W[e]ᵀ over each expert's rows, W [E, n_out, k]."""
        from stages.common.hopper import tensor_map

        experts, n_out, k = weight.shape
        params = DataGradParams(offsets=offsets, experts=experts, n_out=n_out, k=k)
        self.kernels.expert_grad_data((self.sms,), (NUM_THREADS,), tensor_map(a_perm[None], ROWS_BOX),
                                      tensor_map(weight, WEIGHT_BOX), tensor_map(out[None], OUT_BOX), params,
                                      smem=SHARED_BYTES)

    def weight(self, a_perm, b_perm, offsets, counts, dw):
        """dw[e] = a_perm[rows of e]ᵀ · b_perm[rows of e], dw [E, m_out, n_out], every expert written."""
        from stages.common.hopper import tensor_map

        experts, m_out, n_out = dw.shape
        params = WeightGradParams(offsets=offsets, counts=counts, experts=experts, m_out=m_out, n_out=n_out)
        self.kernels.expert_grad_weight((self.sms,), (NUM_THREADS,), tensor_map(a_perm[None], STEP_BOX),
                                        tensor_map(b_perm[None], STEP_BOX), tensor_map(dw, OUT_BOX), params,
                                        smem=SHARED_BYTES)

    def router(self, saved, g_partial, aux_scale, dlogits, dlogits_rounded):
        """dlogits (fp32, and rounded to the dtype) from the top-k weights' g and the balance loss."""
        tokens, experts = saved.logits.shape
        warps = ROUTER_BACKWARD_THREADS // 32
        blocks = min(-(-tokens // warps), ROUTER_BACKWARD_BLOCKS * self.sms)
        params = RouterBackwardParams(logits=saved.logits, topk_ids=saved.topk_ids, topk_weights=saved.topk_weights,
                                      dest=saved.dest, g_partial=g_partial, g_tiles=g_partial.shape[0],
                                      rows=g_partial.shape[1], expert_counts=saved.expert_counts,
                                      aux_scale=aux_scale, tokens=tokens, experts=experts,
                                      top_k=saved.topk_ids.shape[1], dlogits=dlogits, dlogits_rounded=dlogits_rounded)
        self.kernels.router_backward((blocks,), (ROUTER_BACKWARD_THREADS,), params)

    def router_weight(self, x, dlogits, dwr, dbias):
        """dwr = xᵀ·dlogits and dbias = Σ_t dlogits[t], sums over token splits added in order."""
        tokens, hidden = x.shape
        experts = dlogits.shape[1]
        per_block = 16  # the block's experts: 16, 32 or 64 (router_weight_grad's variants)
        while per_block < min(experts, RWG_MAX_EXPERT_BLOCK):
            per_block *= 2
        col_blocks, expert_blocks = -(-hidden // RWG_COLS), -(-experts // per_block)
        splits = max(1, min(-(-tokens // RWG_TOKENS), -(-RWG_BLOCKS * self.sms // (col_blocks * expert_blocks))))
        per_split = -(-tokens // (splits * RWG_TOKENS)) * RWG_TOKENS
        splits = -(-tokens // per_split)
        partial = torch.empty(splits, hidden, experts, dtype=torch.float32, device=x.device)
        bias_partial = torch.empty(splits, experts, dtype=torch.float64, device=x.device)
        params = RouterWeightParams(x=x, dlogits=dlogits, tokens=tokens, hidden=hidden, experts=experts,
                                    experts_per_block=per_block, per_split=per_split, splits=splits,
                                    partial=partial, bias_partial=bias_partial, dwr=dwr, dbias=dbias)
        self.kernels.router_weight_grad((col_blocks, splits, expert_blocks), (RWG_THREADS,), params)
        self.kernels.router_weight_sum((-(-hidden * experts // 256),), (256,), params)

    def combine(self, dx_perm, saved, router, dx):
        """dx[t] = Σ_j dx_perm[dest[t, j]] + router[t]."""
        tokens, top_k = saved.dest.shape
        self.kernels.combine_gradients((tokens,), (GATHER_THREADS,), dx_perm, saved.dest, router, dx, top_k,
                                       dx.shape[1])


def check_shapes(experts: int, top_k: int, hidden: int, inter: int) -> None:
    assert experts <= MAX_EXPERTS and top_k <= MAX_TOP_K, (experts, top_k)
    assert hidden % 8 == 0 and inter % 8 == 0 and min(hidden, inter) >= BLOCK_K, \
        f"hidden and inter must be multiples of 8 (TMA strides), at least {BLOCK_K}: {hidden}, {inter}"


def backward(kernels, x, wr, w1, w2, dy, aux_coef, saved, dx, dwr, dbias, dw1, dw2):
    """The layer's gradients into dx, dwr, dbias, dw1, dw2 (reference/moe_layer_backward.py's formulas) from
    the forward's `saved` tensors, on `kernels` (HopperKernels). No host synchronization."""
    tokens, hidden = x.shape
    experts, inter = w2.shape[0], w2.shape[1]
    check_shapes(experts, saved.topk_ids.shape[1], hidden, inter)
    rows, dtype, f32 = saved.h1.shape[0], x.dtype, torch.float32

    def buffer(*shape, dtype=dtype):
        return torch.empty(*shape, dtype=dtype, device=x.device)

    x_perm, dy_perm, row_weight = buffer(rows, hidden), buffer(rows, hidden), buffer(rows, dtype=f32)
    kernels.gather(x, dy, saved, x_perm, dy_perm, row_weight)

    # The first product's epilogue: [dG dU], w·h, and g = dA·h in partial sums per column tile.
    dgu, hw, g_partial = buffer(rows, 2 * inter), buffer(rows, inter), buffer(-(-inter // BLOCK_N), rows, dtype=f32)
    kernels.swiglu_grad(dy_perm, w2, saved, row_weight, dgu, hw, g_partial)

    # The data side of x·W1, then the weights' sides, sums over each expert's rows.
    dx_perm = buffer(rows, hidden)
    kernels.data(dgu, saved.expert_offsets, w1, dx_perm)
    kernels.weight(x_perm, dgu, saved.expert_offsets, saved.expert_counts, dw1)
    kernels.weight(hw, dy_perm, saved.expert_offsets, saved.expert_counts, dw2)

    # The router: dlogits and dBias, dWr = xᵀ·dlogits in fp32; its data side dlogits·Wrᵀ in PyTorch (the
    # launch's one PyTorch operation); then the permutation backward adds each token's k rows and it.
    dlogits, dlogits_rounded = buffer(tokens, experts, dtype=f32), buffer(tokens, experts)
    kernels.router(saved, g_partial, aux_coef * experts, dlogits, dlogits_rounded)
    kernels.router_weight(x, dlogits, dwr, dbias)
    kernels.combine(dx_perm, saved, torch.mm(dlogits_rounded, wr.t()), dx)


def launch(kernels, x, wr, w1, w2, dy, aux_coef, saved, dx, dwr, dbias, dw1, dw2):
    backward(HopperKernels(kernels, x.device), x, wr, w1, w2, dy, aux_coef, saved, dx, dwr, dbias, dw1, dw2)


STAGE = Stage(
    name="stage14_moe_backward",
    problem="moe_layer_backward",
    source="backward.cu",
    kernels={
        "gather_gradient_rows": "const GatherParams",
        "expert_grad_swiglu": "const TmaMap, const TmaMap, const SwigluGradParams",
        "expert_grad_data": "const TmaMap, const TmaMap, const TmaMap, const DataGradParams",
        "expert_grad_weight": "const TmaMap, const TmaMap, const TmaMap, const WeightGradParams",
        "router_backward": "const RouterBackwardParams",
        "router_weight_grad": "const RouterWeightParams",
        "router_weight_sum": "const RouterWeightParams",
        "combine_gradients": "const elem_t*, const int*, const elem_t*, elem_t*, int, int",
    },
    launch=launch,
    param_structs=(GatherParams, SwigluGradParams, DataGradParams, WeightGradParams, RouterBackwardParams,
                   RouterWeightParams),
    archs=("sm_90a",),
    geometry=lambda defines: GEOMETRY,
    goal=Goal("grouped_mm", 1.2),
)
