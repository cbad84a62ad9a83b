"""The Mixture-of-Experts layer the MoE stages build, piece by piece (Mixtral-style, SwiGLU experts).

    logits  = x · Wr                                  [T, E], fp32 accumulation
    probs   = softmax(logits) over the E experts
    ids, w  = the top-k experts of each token, w = their probabilities renormalized to sum 1
    expert e (SwiGLU): h = silu(x · W1[e][:, :I]) * (x · W1[e][:, I:]),   y_e = h · W2[e]
    out[t]  = Σ_j w[t, j] · y_{ids[t, j]}(x[t])

x: [T, hidden], Wr: [hidden, E], W1: [E, hidden, 2·I] (gate half, then up half), W2: [E, I, hidden],
in float16 or bfloat16; every product accumulates in fp32. Ties in the top-k go to the lower expert.

Work: each token meets k experts, 2·hidden·2I + 2·I·hidden flops each (the router's 2·hidden·E
is left out, as everyone does). This module holds what the MoE problems and stages share: the
configurations, a seeded input generator, the exact references, and the PyTorch baselines.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# name -> the layer's dimensions and the token counts the stages time it at.
CONFIGS = {
    # The course's 32-expert layer: 32 experts, each the size of Llama-7B's FFN, top-2.
    "seed": dict(hidden=4096, inter=11008, experts=32, top_k=2, tokens=(4 * 512, 16 * 2048, 32 * 2048)),
    "mixtral": dict(hidden=4096, inter=14336, experts=8, top_k=2, tokens=(4096,)),
    # Fine-grained, DeepSeek-V3-like: many small experts, 8 per token. Its weights alone are 22.5 GB
    # in bf16: a few thousand tokens keep it and the baselines' buffers well inside 80 GB.
    "deepseek": dict(hidden=7168, inter=2048, experts=256, top_k=8, tokens=(4096,)),
}


def layer_flops(tokens: int, hidden: int, inter: int, top_k: int) -> float:
    return float(tokens) * top_k * (2 * hidden * 2 * inter + 2 * inter * hidden)


# ---------------------------------------------------------------- inputs

def routing_bias(experts: int, skew: float = 0.0, empty=()) -> torch.Tensor:
    """A bias added to the router logits: `skew` > 0 favours the first experts (expert e gets
    skew · 0.6^e: with skew 4, a few experts take most tokens); experts in `empty` get -1e4, so
    no token picks them (as long as top_k <= experts - len(empty))."""
    bias = skew * 0.6 ** torch.arange(experts, dtype=torch.float64)
    bias[list(empty)] = -1e4
    return bias.float()


def make_layer(tokens: int, hidden: int, inter: int, experts: int, dtype: str, seed: int, *, with_experts=True,
               input_scale: float = 1.0, skew: float = 0.0, empty=(), device="cuda") -> dict:
    """x, the router Wr and (with_experts) W1, W2, seeded, with unit-variance products: entries of
    x are N(0, input_scale²), of each weight N(0, 1/fan_in). The router logits x·Wr are then about
    N(0, input_scale²) before the bias of `routing_bias`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, dtype)

    def randn(*shape, std=1.0):  # drawn in the dtype itself: no fp32 copy of 15 GB of weights
        return torch.randn(*shape, generator=gen, device=device, dtype=dt).mul_(std)

    layer = dict(x=randn(tokens, hidden, std=input_scale), wr=randn(hidden, experts, std=hidden ** -0.5),
                 bias=routing_bias(experts, skew, empty).to(device))
    if with_experts:
        layer["w1"] = randn(experts, hidden, 2 * inter, std=hidden ** -0.5)
        layer["w2"] = randn(experts, inter, hidden, std=inter ** -0.5)
    return layer


def router_logits(x: torch.Tensor, wr: torch.Tensor, bias: torch.Tensor | None = None,
                  dtype=torch.float32) -> torch.Tensor:
    """x · Wr in fp32 (fp32 inputs, fp32 accumulation; float64: exact), plus the routing bias."""
    logits = x.to(dtype) @ wr.to(dtype)
    return logits if bias is None else logits + bias


# ---------------------------------------------------------------- the exact routing

def topk_exact(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] int32 (in decreasing logit order, ties to the lower expert) and their renormalized
    weights [T, k] float64. Softmax is monotonic, so the top-k of the probabilities is the top-k of
    the fp32 logits, compared exactly; a stable descending sort keeps equal logits in index order."""
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    chosen = logits.gather(1, order).double()
    weights = torch.softmax(chosen, dim=-1)  # exp(l_j - m) / Σ_selected: the full softmax's denominator cancels
    return order.to(torch.int32), weights


def expert_offsets(counts: torch.Tensor, block: int) -> torch.Tensor:
    """[E+1] int32: where each expert's segment starts in the permuted buffer, each segment's length
    rounded up to a multiple of `block` (0: no padding), as vLLM's moe_align_block_size does."""
    padded = (counts + block - 1) // block * block if block > 0 else counts
    return F.pad(torch.cumsum(padded.long(), 0), (1, 0)).to(torch.int32)


def padded_capacity(tokens: int, experts: int, top_k: int, block: int) -> int:
    """An upper bound of the permuted buffer's length, known without looking at the routing:
    every expert pads fewer than `block` rows."""
    return tokens * top_k + (experts * (block - 1) if block > 0 else 0)


def balance_loss(probs: torch.Tensor, counts: torch.Tensor, top_k: int, alpha: float) -> torch.Tensor:
    """The Switch Transformer load-balancing loss α·E·Σ_i f_i·P_i (f_i: fraction of the T·k
    token-slots routed to expert i, P_i: mean router probability of expert i over the T tokens),
    a scalar tensor in probs' dtype: differentiable in probs, not in the counts (a discrete choice)."""
    tokens, experts = probs.shape
    f = counts.to(probs.dtype) / (tokens * top_k)
    return alpha * experts * (f * probs.mean(0)).sum()


def balance_stats(probs: torch.Tensor, counts: torch.Tensor, top_k: int, alpha: float) -> tuple[float, float]:
    """balance_loss in float64, and the usage variance mean_i (E·f_i - 1)² in percent (0: perfectly
    balanced; E·f_i is 1 when balanced)."""
    tokens, experts = probs.shape
    f = counts.double() / (tokens * top_k)
    return float(balance_loss(probs.double(), counts, top_k, alpha)), float(100 * ((experts * f - 1) ** 2).mean())


# ---------------------------------------------------------------- the exact layer

def swiglu(h1: torch.Tensor, inter: int) -> torch.Tensor:
    return F.silu(h1[..., :inter]) * h1[..., inter:]


def layer_reference(layer: dict, top_k: int, dtype=torch.float64, ids=None, weights=None) -> torch.Tensor:
    """The layer in `dtype` (float64: exact for the course's purposes), routed by the fp32 logits, or
    by the given `ids` [T, k] and `weights` [T, k] (another router's choice, judged by its own routing).
    Every expert is evaluated on the tokens it received, from the inputs' rounded values."""
    x = layer["x"].to(dtype)
    if ids is None:
        ids, weights = topk_exact(router_logits(layer["x"], layer["wr"], layer.get("bias")), top_k)
    inter = layer["w2"].shape[1]
    out = torch.zeros_like(x)
    for e in range(layer["w1"].shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel():
            y = swiglu(x[token] @ layer["w1"][e].to(dtype), inter) @ layer["w2"][e].to(dtype)
            out.index_add_(0, token, y * weights[token, slot, None].to(dtype))
    return out


# ---------------------------------------------------------------- PyTorch baselines

def torch_routing(logits: torch.Tensor, top_k: int):
    """Softmax, torch.topk, renormalization: ids [T, k] int64, weights [T, k] fp32."""
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True), probs


def layer_loop(layer: dict, top_k: int, ids=None, weights=None) -> torch.Tensor:
    """The layer as most PyTorch MoE code writes it (e.g. Hugging Face's Mixtral): a loop over the
    experts, each gathering its tokens (torch.where: a host synchronization per expert). Routed by
    torch_routing, or by the given `ids` [T, k] and fp32 `weights` [T, k]."""
    x, w1, w2 = layer["x"], layer["w1"], layer["w2"]
    if ids is None:
        ids, weights, _ = torch_routing(router_logits(x, layer["wr"], layer.get("bias")), top_k)
    inter = w2.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel():
            y = swiglu(x[token] @ w1[e], inter) @ w2[e]
            out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_mm_baseline(run, name: str = "grouped_mm") -> dict:
    """{name: run} where torch._grouped_mm exists and `run` runs once here (it may refuse a dtype or a
    device), else {}. Running out of memory counts as running: the grader reports it."""
    if not has_grouped_mm():
        return {}
    try:
        run()
    except torch.OutOfMemoryError:
        pass
    except (RuntimeError, TypeError, NotImplementedError):
        return {}
    return {name: run}


def experts_grouped_mm(x_sorted: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU FFN on its rows of x_sorted (expert-contiguous, unpadded: group e is rows
    offs[e-1]..offs[e]), one torch._grouped_mm for W1 and one for W2. Calling convention:
    _grouped_mm(A [M, K] 2-D, B [E, K, N] 3-D, offs=int32 [E] cumulative row ends) -> [M, N]."""
    h = swiglu(torch._grouped_mm(x_sorted, w1, offs=offs), w2.shape[1])
    return torch._grouped_mm(h, w2, offs=offs)


def slots_by_expert(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-slots of ids [T, k] in expert order (a stable sort: by token within an expert), as
    indices into ids.flatten(), and each expert's count (expert_counts)."""
    return torch.argsort(ids.flatten(), stable=True), expert_counts(ids, experts)


def expert_counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """[E] int32: the token-slots of ids [T, k] each expert received (no bincount: it synchronizes with the host)."""
    flat = ids.flatten()
    return torch.zeros(experts, dtype=torch.int32, device=ids.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))


def combine_sorted(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j w[t, j] · y[row of (t, j)], y's rows being the token-slots in `order` (slots_by_expert):
    fp32 sums, rounded to y's dtype once. weights [T, k] fp32."""
    tokens, top_k = weights.shape
    out = torch.zeros(tokens, y.shape[1], dtype=torch.float32, device=y.device)
    out.index_add_(0, order // top_k, y.float() * weights.flatten()[order, None])
    return out.to(y.dtype)


def layer_grouped_mm(layer: dict, top_k: int, ids=None, weights=None) -> torch.Tensor:
    """The layer with torch._grouped_mm (PyTorch >= 2.8, bf16): the token-slots sorted by expert,
    one grouped GEMM for W1 and one for W2 (experts_grouped_mm). Routed by torch_routing, or by the
    given `ids` [T, k] and fp32 `weights` [T, k]."""
    x, w1, w2 = layer["x"], layer["w1"], layer["w2"]
    if ids is None:
        ids, weights, _ = torch_routing(router_logits(x, layer["wr"], layer.get("bias")), top_k)
    order, counts = slots_by_expert(ids, w1.shape[0])
    y = experts_grouped_mm(x[order // top_k], w1, w2, torch.cumsum(counts, 0, dtype=torch.int32))
    return combine_sorted(y, order, weights)
