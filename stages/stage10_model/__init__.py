"""Stage 10 — the whole model (v0): a Llama/Mixtral-style decoder from the course's kernels

v0, the starting point, not the stage: reference/model.py's model with the course's attention (stages.ops:
stage 4 on sm_90a, stage 3 elsewhere) and MoE layer (stage 7), the residual adds fused with RMSNorm in this
stage's one kernel (model.cu), everything else plain PyTorch (the projections, RoPE, SwiGLU), launch by
launch from Python with PyTorch's allocator. Not yet: RoPE fused, a CUDA graph of the whole forward with
buffers reused across calls. GQA: the attention kernels take as many K/V heads as query heads, so K and V
are expanded with repeat_interleave (a copy) until GQA attention arrives. Untested on a GPU so far.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from reference.model import apply_rope, repeat_kv, rope_cos_sin
from stages import Goal, Stage

NORM_THREADS = 256  # model.cu's add_rmsnorm: one block of NORM_THREADS per row


def add_rmsnorm(kernels, h, delta, weight, normed, eps):
    """h += delta (if delta is not None), normed = RMSNorm(h) · weight: [T, hidden] rows, in one launch."""
    hidden = h.shape[-1]
    null = np.uint64(0)  # a null pointer: no add
    kernels.add_rmsnorm((h.numel() // hidden,), (NORM_THREADS,), h, null if delta is None else delta, weight, normed,
                        hidden, float(eps))


def launch(kernels, x, weights, config, out):
    from stages import ops  # the course's attention and MoE layer as ops (compiled on first use)

    L, H, KV, I, E = (config[k] for k in ("layers", "heads", "kv_heads", "inter", "experts"))
    B, S, hidden = x.shape
    D = hidden // H
    eps = config["eps"]
    cos, sin = rope_cos_sin(S, D, config["rope_theta"], x.dtype, x.device)
    h = x.clone()                  # the residual stream, updated in place by add_rmsnorm
    normed = torch.empty_like(x)
    delta = None                   # the branch output still to add to h
    for l in range(L):
        add_rmsnorm(kernels, h, delta, weights["attn_norm"][l], normed, eps)
        q, k, v = (normed @ weights["wqkv"][l]).split((H * D, KV * D, KV * D), dim=-1)
        q, k, v = (t.reshape(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin).contiguous(), apply_rope(k, cos, sin)
        k, v = repeat_kv(k, H // KV).contiguous(), repeat_kv(v, H // KV).contiguous()
        o = ops.attention(q, k, v, causal=True, scale=1.0 / math.sqrt(D))
        delta = o.transpose(1, 2).reshape(B, S, H * D) @ weights["wo"][l]
        add_rmsnorm(kernels, h, delta, weights["mlp_norm"][l], normed, eps)
        if E:
            delta = ops.moe_layer(normed.reshape(B * S, hidden), weights["wr"][l].contiguous(), weights["w1"][l],
                                  weights["w2"][l], config["top_k"]).reshape(B, S, hidden)
        else:
            g = normed @ weights["w1"][l]
            delta = (F.silu(g[..., :I]) * g[..., I:]) @ weights["w2"][l]
    add_rmsnorm(kernels, h, delta, weights["norm"], out, eps)


STAGE = Stage(
    name="stage10_model",
    problem="model",
    source="model.cu",
    kernels={"add_rmsnorm": "elem_t*, const elem_t*, const elem_t*, elem_t*, int, float"},
    launch=launch,
    specializations={"HEAD_DIM": "D"},
    geometry=lambda defines: {"NORM_THREADS": NORM_THREADS},
    goal=Goal("reference", 1.0),  # the fastest library baseline: torch.compile's, with or without CUDA graphs
)
