"""Stage 14 — the MoE layer's backward on Hopper: grouped GEMMs for the weights' gradients

sm_90a only. The gradients of stage 7's layer (dX, dWr, dBias, dW1, dW2) from dY and the forward's
routing. Six grouped GEMMs on TMA + wgmma (backward.cu): the forward's x·W1 again (stage 6's
expert_down), dH = dY·W2ᵀ and dX = [dG dU]·W1ᵀ with the weights read transposed (expert_grad_data),
and dW2 = hᵀ·(w·dY), dW1 = xᵀ·[dG dU] as sums over each expert's rows (expert_grad_weight: a
different K per expert, found on the device), and y = h·W2 again (expert_down) for the top-k weights'
gradient. The permutation, SwiGLU's backward, the combine's and the router's backward are PyTorch
operations in the launch, in this first version.
"""
from __future__ import annotations

import torch

from reference.moe import padded_capacity
from stages import Goal, Stage
from stages.common.moe import MAX_EXPERTS
from stages.stage6_grouped_gemm import BLOCK_K, BLOCK_M, BOX_COLS, CONSUMER_ROWS, GEOMETRY as EXPERTS_GEOMETRY
from stages.stage6_grouped_gemm import NUM_THREADS, SHARED_BYTES

BLOCK_N = 256         # output columns per tile: one wgmma n256 (both new kernels)
A_BOX_BYTES = 8192    # expert_grad_weight: A's 64-row × 64-column box, one per consumer and k-step
GEOMETRY = {**EXPERTS_GEOMETRY, "BLOCK_N": BLOCK_N, "A_BOX_BYTES": A_BOX_BYTES}

# TMA boxes (outermost first) of the launch's tensor maps, all 128-byte swizzled (stages.common.hopper).
ROWS_BOX = (1, BLOCK_M, BLOCK_K)      # A of the row-side GEMMs: 128 permuted rows × 64 of K
WEIGHT_BOX = (1, BLOCK_K, BOX_COLS)   # a weight [E, ·, ·]: 64 × 64 (stage 6's B; here also read transposed)
OUT_BOX = (1, CONSUMER_ROWS, BOX_COLS)  # every output: a consumer's 64 rows × 64 columns
STEP_BOX = (1, BLOCK_K, BOX_COLS)     # expert_grad_weight's A and B: 64 rows (one k-step) × 64 columns


def permutation(topk_ids: torch.Tensor, experts: int, rows: int):
    """(dest [T·k] int64, counts [E] int64, offsets [E+1] int32): token-slot s = t·k + j goes to row
    dest[s] of the permuted buffers, expert by expert in token order, each expert's segment padded to
    BLOCK_M rows (stage 5's layout), from the saved ids, without a host synchronization."""
    ids = topk_ids.reshape(-1).long()
    slots = ids.numel()
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    offsets = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device)
    offsets[1:] = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts  # each expert's first slot in sorted order
    order = torch.sort(ids, stable=True).indices
    rank = torch.empty_like(ids)
    rank[order] = torch.arange(slots, device=ids.device) - starts[ids[order]]
    dest = offsets[ids] + rank
    assert rows >= slots  # rows: padded_capacity, the buffers' length
    return dest, counts, offsets.int()


def scatter_rows(values: torch.Tensor, dest: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, ·] with row dest[s] = values[s] and zeros elsewhere (the padding rows: zero, so that they
    add nothing to the weights' gradients)."""
    out = torch.zeros(rows, values.shape[1], dtype=values.dtype, device=values.device)
    out[dest] = values
    return out


class HopperGemms:
    """The launch's grouped GEMMs on backward.cu's kernels (tensors in, tensors out)."""

    def __init__(self, kernels, device):
        from stages.common.hopper import sm_count

        self.kernels, self.grid = kernels, (sm_count(device),)

    def up(self, a_perm, offsets, weight, out):
        """out = a_perm · W[e] over each expert's rows, W [E, k, n_out] (stage 6's expert_down, W as its B):
        h1 = x·W1 and y = h·W2."""
        from stages.common.hopper import tensor_map

        experts, k, n_out = weight.shape
        self.kernels.expert_down(self.grid, (NUM_THREADS,), tensor_map(a_perm[None], ROWS_BOX),
                                 tensor_map(weight, WEIGHT_BOX), tensor_map(out[None], OUT_BOX), offsets, experts,
                                 n_out, k, smem=SHARED_BYTES)

    def data(self, a_perm, offsets, weight, out):
        """out = a_perm · W[e]ᵀ over each expert's rows, W [E, n_out, k]."""
        from stages.common.hopper import tensor_map

        experts, n_out, k = weight.shape
        self.kernels.expert_grad_data(self.grid, (NUM_THREADS,), tensor_map(a_perm[None], ROWS_BOX),
                                      tensor_map(weight, WEIGHT_BOX), tensor_map(out[None], OUT_BOX), offsets,
                                      experts, n_out, k, smem=SHARED_BYTES)

    def weight(self, a_perm, b_perm, offsets, dw):
        """dw[e] = a_perm[rows of e]ᵀ · b_perm[rows of e], dw [E, m_out, n_out], every expert written."""
        from stages.common.hopper import tensor_map

        experts, m_out, n_out = dw.shape
        self.kernels.expert_grad_weight(self.grid, (NUM_THREADS,), tensor_map(a_perm[None], STEP_BOX),
                                        tensor_map(b_perm[None], STEP_BOX), tensor_map(dw, OUT_BOX), offsets,
                                        experts, m_out, n_out, smem=SHARED_BYTES)


SWIGLU_ROWS = 8192  # rows per piece of the fp32 arithmetic below: its temporaries stay ~10 × 8192 × inter × 4 B


def swiglu_backward(h1: torch.Tensor, dh_unweighted: torch.Tensor, w_perm: torch.Tensor):
    """(h, [dG dU]) in h1's dtype from h1 = [G U] and dH (without the top-k weight), in fp32, piece by piece:
    h = silu(G)·U, dh = w·dH, dG = dh·U·silu'(G), dU = dh·silu(G)."""
    inter = dh_unweighted.shape[1]
    h = torch.empty_like(dh_unweighted)
    dgu = torch.empty_like(h1)
    for start in range(0, h1.shape[0], SWIGLU_ROWS):
        rows = slice(start, start + SWIGLU_ROWS)
        gate, up = h1[rows].float().split(inter, dim=1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        h[rows] = silu * up
        dh = dh_unweighted[rows].float() * w_perm[rows, None]
        dgu[rows, :inter] = dh * up * sig * (1 + gate * (1 - sig))
        dgu[rows, inter:] = dh * silu
    return h, dgu


def check_shapes(experts: int, hidden: int, inter: int) -> None:
    assert experts <= MAX_EXPERTS, experts
    assert hidden % 8 == 0 and inter % 8 == 0 and min(hidden, inter) >= BLOCK_K, \
        f"hidden and inter must be multiples of 8 (TMA strides), at least {BLOCK_K}: {hidden}, {inter}"


def backward(gemms, x, wr, bias, w1, w2, top_k, topk_ids, topk_weights, dy, aux_coef, dx, dwr, dbias, dw1, dw2):
    """The layer's gradients into dx, dwr, dbias, dw1, dw2 (reference/moe_layer_backward.py's formulas),
    the grouped GEMMs on `gemms` (HopperGemms; the CPU tests pass PyTorch's), the rest in PyTorch."""
    tokens, hidden = x.shape
    experts, inter = wr.shape[1], w2.shape[1]
    check_shapes(experts, hidden, inter)
    dtype, f32 = x.dtype, torch.float32
    rows = padded_capacity(tokens, experts, top_k, BLOCK_M)
    dest, counts, offsets = permutation(topk_ids, experts, rows)
    token = torch.arange(tokens * top_k, device=x.device) // top_k
    w = topk_weights.reshape(-1).float()

    # The permuted rows: x, dY, w·dY, zero on the padding rows.
    x_perm = scatter_rows(x[token], dest, rows)
    dy_perm = scatter_rows(dy[token], dest, rows)
    dyw_perm = scatter_rows((dy[token].float() * w[:, None]).to(dtype), dest, rows)
    w_perm = torch.zeros(rows, dtype=f32, device=x.device)
    w_perm[dest] = w

    # The forward's h1 = [G U] again, then dH = dY·W2ᵀ (without the top-k weight).
    h1 = torch.empty(rows, 2 * inter, dtype=dtype, device=x.device)
    gemms.up(x_perm, offsets, w1, h1)
    dh_unweighted = torch.empty(rows, inter, dtype=dtype, device=x.device)
    gemms.data(dy_perm, offsets, w2, dh_unweighted)

    h, dgu = swiglu_backward(h1, dh_unweighted, w_perm)
    # The top-k weight's gradient g = dY[t]·y_e(x[t]), y = h·W2 recomputed as PyTorch's autograd has it:
    # h = silu(G)·U rounded twice (silu's, then the product's), y rounded, the dot product in fp32. dBias sums
    # g's errors over every token (fp32 output: the tolerance is twice the library's error, no rounding term),
    # and those come from the 16-bit GEMM outputs (h1, dH or y), not from the fp32 chain after them: g = h·dH,
    # with h in fp32 or not, has other roundings than the library's, and over seeds on the CPU exceeded twice
    # its error (up to 2.3x its tolerance); the library's own arithmetic stays at its error.
    gate_d, up_d = h1.split(inter, dim=1)
    y = torch.empty(rows, hidden, dtype=dtype, device=x.device)
    gemms.up(torch.nn.functional.silu(gate_d) * up_d, offsets, w2, y)
    g_rows = torch.cat([(y_rows.float() * dy_rows.float()).sum(1)
                        for y_rows, dy_rows in zip(y.split(SWIGLU_ROWS), dy_perm.split(SWIGLU_ROWS))])

    # The data side, dX_perm = [dG dU]·W1ᵀ; the weights' side, sums over each expert's rows.
    dx_perm = torch.empty(rows, hidden, dtype=dtype, device=x.device)
    gemms.data(dgu, offsets, w1, dx_perm)
    gemms.weight(x_perm, dgu, offsets, dw1)
    gemms.weight(h, dyw_perm, offsets, dw2)

    # The router: the softmax over the top-k (out's term), the full softmax (the balance loss's term).
    g = g_rows[dest].view(tokens, top_k)
    weights = topk_weights.float()
    dlogits_topk = weights * (g - (weights * g).sum(1, keepdim=True))
    logits = x.float() @ wr.float() + bias
    p = torch.softmax(logits, dim=1)
    f = counts.float() / (tokens * top_k)
    # The loss's gradient in p, then the softmax's backward, rounded in autograd's order: with k = 1 the top-k
    # term is exactly zero, dBias is this term alone and the library's error on it under a unit in the last place.
    dp = (aux_coef * experts * f) / tokens
    dlogits = p * (dp - (dp * p).sum(1, keepdim=True))
    dlogits.scatter_add_(1, topk_ids.long(), dlogits_topk)
    dwr.copy_(x.float().t() @ dlogits)
    dbias.copy_(dlogits.sum(0))

    # The combine's backward: each token's slots' dX rows added, then the router's data side.
    dx_tokens = torch.zeros(tokens, hidden, dtype=f32, device=x.device).index_add_(0, token, dx_perm[dest].float())
    dx.copy_(dx_tokens + dlogits @ wr.float().t())


def launch(kernels, x, wr, bias, w1, w2, top_k, topk_ids, topk_weights, dy, aux_coef, dx, dwr, dbias, dw1, dw2):
    backward(HopperGemms(kernels, x.device), x, wr, bias, w1, w2, top_k, topk_ids, topk_weights, dy, aux_coef,
             dx, dwr, dbias, dw1, dw2)


STAGE = Stage(
    name="stage14_moe_backward",
    problem="moe_layer_backward",
    source="backward.cu",
    kernels={
        "expert_up_swiglu": "const TmaMap, const TmaMap, const TmaMap, const int*, int, int, int",
        "expert_down": "const TmaMap, const TmaMap, const TmaMap, const int*, int, int, int",
        "expert_grad_data": "const TmaMap, const TmaMap, const TmaMap, const int*, int, int, int",
        "expert_grad_weight": "const TmaMap, const TmaMap, const TmaMap, const int*, int, int, int",
    },
    launch=launch,
    archs=("sm_90a",),
    geometry=lambda defines: GEOMETRY,
    goal=Goal("grouped_mm", 1.2),
)
