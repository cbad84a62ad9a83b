"""The whole model: a Llama/Mixtral-style decoder's prefill forward, from token embeddings to hidden states (stage 10).

Each of `layers` decoder layers (pre-norm, as Llama and Mixtral):

    a = RMSNorm(h) · attn_norm          q, k, v = a · Wqkv, split into H query heads and KV key/value heads of D
    q, k = RoPE(q), RoPE(k)             h = h + attention(q, k, v, causal, GQA: query head j reads KV head j // (H/KV)) · Wo
    m = RMSNorm(h) · mlp_norm           h = h + MLP(m)
    MLP: SwiGLU, silu(m · W1[:, :I]) * (m · W1[:, I:]) · W2, or (MoE) reference/moe.py's layer, stage 7's layout
    out = RMSNorm(h) · norm             (the final norm, as Hugging Face's LlamaModel's last_hidden_state)

RMSNorm(x) = x / sqrt(mean(x²) + eps). RoPE is Hugging Face's rotate-half convention (what LlamaModel and
MixtralModel compute, so that they match with the same weights): position p, frequency i < D/2 of
inv_freq_i = theta^(-2i/D); x·cos + rotate_half(x)·sin with cos, sin = cos(p·inv_freq), sin(p·inv_freq)
repeated over both halves, rotate_half(x) = [-x[D/2:], x[:D/2]]. Attention scale 1/√D, causal (top-left:
a prefill from position 0). The MoE router has no bias (Mixtral's); each token's top_k experts by router
logit, weighted by the softmax of their logits (Mixtral's softmax-topk-renormalize is the same).

Inputs: x [B, S, hidden], the token embeddings, in the dtype: no vocabulary. The embedding lookup is a
gather of B·S rows (no flops, nothing to teach) and the LM head is outside a model's hidden states;
Hugging Face's models take `inputs_embeds`, so the comparison with them stays. Weights, each stacked over the
layers, in the dtype, in the course's x·W layout ([in, out], as stage 7's):
    attn_norm, mlp_norm [L, hidden], norm [hidden]
    wqkv [L, hidden, (H + 2·KV)·D] (the H query heads' columns, then KV keys', then KV values'), wo [L, H·D, hidden]
    dense: w1 [L, hidden, 2·I] (gate half, then up half), w2 [L, I, hidden]
    MoE:   wr [L, hidden, E], w1 [L, E, hidden, 2·I], w2 [L, E, I, hidden]
Output: hidden [B, S, hidden] in the dtype.

Initialization (seeded, drawn in the dtype on the device, no fp32 copy of the weights): x ~ N(0, input_scale²);
every projection into a residual branch (Wqkv, W1, Wr) ~ N(0, 1/fan_in), so that its outputs have unit
variance (q·k/√D of unit size: attention neither uniform nor one-hot); the projections back onto the
residual stream (Wo, W2) ~ N(0, 1/fan_in / (2·layers)), GPT-2's and Llama-style residual scaling, so that
the 2·layers branches add about unit variance in all: the residual stream stays O(1) through 32 layers.
Norm weights 1 + N(0, 0.1²) rather than Llama's ones, so that a kernel that forgets them shows.

The exact result: the same model in float64, each layer's weights rounded from the inputs' values and
widened one layer at a time (so only one layer's float64 copy lives), the attention one batch element at a
time, the routing by float64 logits. The library: the model in the dtype as Hugging Face writes it
(RMSNorm in fp32 then rounded, RoPE's cos and sin in fp32 rounded to the dtype, SDPA, the residual adds in
the dtype; the MoE layer as reference/moe.py's loop: fp32 logits and combine). Checks: hidden by the
library-relative rule (max), and the same rule on the mean error (MEAN_FACTOR): in the MoE model a near-tie
in the router flips a token's expert, a jump in its hidden state that bf16's rounding causes in the library
too, so the max alone is loose there; the mean sees an error spread over every token.

Work: 2·(every matmul weight a token meets)·tokens (Wqkv, Wo; W1, W2 of the MLP or of its top_k experts; the
router's 2·hidden·E left out, as reference/moe.py does) + the causal attention's 4·B·H·D·S(S+1)/2
(reference/attention.py); norms, RoPE, SiLU and the residual adds (a few flops per element) not counted.
min_bytes: every weight read once (every expert's: at these sizes each gets tokens), x read, out written.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from reference import moe, tolerance
from reference.attention import causal_mask, visible_pairs
from reference.problem import FLOAT_POISON, Case, Problem

MEAN_FACTOR = 2.0  # the kernel's mean |error| may be at most this times the library's (see the docstring)


def llama_inter(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4·hidden, rounded up to a multiple of 256 (4096 -> 11008)."""
    return multiple_of * -(-int(8 * hidden / 3) // multiple_of)


# name -> the model's dimensions and the (batch, sequence) points the stage is timed at. experts 0: dense.
# The dense sizes are GPT-2-small-like, 1B-like and Llama-2-7B's (MHA, theta 1e4, eps 1e-5); the MoE one is
# Mixtral-8x7B's first 4 layers (GQA 32/8, theta 1e6). Weights in bf16: 0.17, 2.4, 13.0 and 11.6 GB.
CONFIGS = {
    "small": dict(layers=12, hidden=768, heads=12, kv_heads=12, inter=llama_inter(768), experts=0, top_k=0,
                  rope_theta=10000.0, eps=1e-5, points=((1, 128), (4, 512), (16, 2048))),
    "medium": dict(layers=24, hidden=2048, heads=16, kv_heads=16, inter=llama_inter(2048), experts=0, top_k=0,
                   rope_theta=10000.0, eps=1e-5, points=((1, 128), (4, 512), (8, 1024))),
    "large": dict(layers=32, hidden=4096, heads=32, kv_heads=32, inter=llama_inter(4096), experts=0, top_k=0,
                  rope_theta=10000.0, eps=1e-5, points=((1, 128), (4, 512), (8, 2048))),
    "moe": dict(layers=4, hidden=4096, heads=32, kv_heads=8, inter=14336, experts=8, top_k=2,
                rope_theta=1e6, eps=1e-5, points=((1, 128), (4, 512), (4, 2048))),
}
DIMENSIONS = ("layers", "hidden", "heads", "kv_heads", "inter", "experts", "top_k", "rope_theta", "eps")


def model_shape(name: str, B: int, S: int, **changes) -> dict:
    """A shape: the model's dimensions (a CONFIGS entry, with `changes`), B and S; `model` names it."""
    config = {k: CONFIGS[name][k] for k in DIMENSIONS} | changes
    label = name if not changes else name + "-" + "-".join(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}"
                                                             for k, v in changes.items())
    return dict(model=label, **config, B=B, S=S)


def head_dim(shape: dict) -> int:
    return shape["hidden"] // shape["heads"]


def parameters(shape: dict) -> int:
    """Every weight of the model (norms included)."""
    L, h, H, KV, I, E = (shape[k] for k in ("layers", "hidden", "heads", "kv_heads", "inter", "experts"))
    D = head_dim(shape)
    attention = h * (H + 2 * KV) * D + H * D * h
    mlp = E * 3 * h * I + h * E if E else 3 * h * I
    return L * (attention + mlp + 2 * h) + h


def active_matmul_parameters(shape: dict) -> int:
    """The matmul weights one token meets (its top_k experts only; the router left out)."""
    L, h, H, KV, I = (shape[k] for k in ("layers", "hidden", "heads", "kv_heads", "inter"))
    D = head_dim(shape)
    experts_met = shape["top_k"] if shape["experts"] else 1
    return L * (h * (H + 2 * KV) * D + H * D * h + experts_met * 3 * h * I)


# Correctness cases: (shape, dtype, input scale). Sequences that are no multiple of any tile; GQA (groups of
# 2 and 4) and MHA; head dims 64 and 128; the real small model whole, the others' real widths on fewer layers;
# an MoE model small enough for every expert to see few tokens (and one with none, likely at T=37); large
# embeddings; fp16 once.
_CASES = [
    (model_shape("small", 1, 1, layers=2), "bfloat16", 1),
    (model_shape("small", 1, 128), "bfloat16", 1),
    (model_shape("small", 2, 333), "bfloat16", 1),
    (model_shape("small", 3, 77, kv_heads=6), "bfloat16", 1),
    (model_shape("small", 2, 200, layers=4), "float16", 1),
    (model_shape("small", 2, 129, layers=4), "bfloat16", 10),
    (model_shape("medium", 2, 300, layers=3), "bfloat16", 1),
    (model_shape("medium", 1, 1000, layers=2, kv_heads=4), "bfloat16", 1),
    (model_shape("large", 1, 256, layers=2), "bfloat16", 1),
    (model_shape("moe", 1, 37, layers=2, hidden=512, heads=8, kv_heads=2, inter=256), "bfloat16", 1),
    (model_shape("moe", 2, 500, layers=2, hidden=512, heads=4, kv_heads=4, inter=512, experts=16, top_k=4),
     "bfloat16", 1),
    (model_shape("moe", 1, 128, layers=1), "bfloat16", 1),
]


def shape_label(shape: dict) -> str:
    kind = (f"E{shape['experts']} k{shape['top_k']} " if shape["experts"] else "")
    heads = f"H{shape['heads']}" + (f"/{shape['kv_heads']}" if shape["kv_heads"] != shape["heads"] else "")
    return (f"{shape['model']} L{shape['layers']} hidden{shape['hidden']} {heads} inter{shape['inter']} {kind}"
            f"B{shape['B']} S{shape['S']}")


class ModelProblem(Problem):
    name = "model"
    outputs = ("hidden",)
    primary_input = "x"
    parameters = {"D": (64, 128)}  # the head dimension, as the attention problem's

    # ---- cases and shapes -------------------------------------------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return [Case(f"{shape_label(s)} {'fp16' if d == 'float16' else 'bf16'}" + (f" x{scale:g}" if scale != 1 else ""),
                     s, d, scale, seed * 1000 + i) for i, (s, d, scale) in enumerate(_CASES)]

    def benchmarks(self) -> list[dict]:
        """bfloat16: each model at each of its points."""
        return [dict(model_shape(name, B, S), dtype="bfloat16") for name, c in CONFIGS.items() for B, S in c["points"]]

    shape_label = staticmethod(shape_label)

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        return make_inputs(shape, dtype, seed, input_scale, device)

    def allocate_outputs(self, inputs: dict) -> dict:
        return dict(hidden=torch.full_like(inputs["x"], FLOAT_POISON))

    def parameter_values(self, inputs: dict) -> dict:
        return {"D": head_dim(inputs["config"])}

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        stage.launch(kernels, inputs["x"], weights_of(inputs), inputs["config"], outputs["hidden"])

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        return dict(hidden=forward(inputs["x"], weights_of(inputs), inputs["config"], exact=True))

    def library_output(self, inputs: dict) -> dict:
        with torch.no_grad():
            return dict(hidden=forward(inputs["x"], weights_of(inputs), inputs["config"]))

    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]:
        out, ex, lib = outputs["hidden"], exact["hidden"], library["hidden"]
        return [tolerance.relative_to_library("hidden", out, ex, lib), mean_relative_to_library("hidden (mean)", out, ex, lib)]

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """The model in PyTorch, each a callable: "eager" (SDPA; the MoE layer with torch._grouped_mm where
        it runs, else reference/moe.py's loop), "naive" (eager, attention as matmul-softmax-matmul, the S×S
        scores in memory, as Llama's reference code and Hugging Face's "eager" attention), "compile"
        (torch.compile, default mode, of the model's regions: Regions) and "compile + CUDA graph" (that
        compiled forward captured in one CUDA graph, as mode="reduce-overhead" would; not where the MoE loop
        synchronizes with the host). Compiled on the first call (the worker makes it outside the timed loop);
        the graph shares the compiled code."""
        # A fresh start for torch.compile at each shape: its compiled code for earlier shapes is dead, and a
        # new shape would count as a recompile of the same code: past the first, dynamo would make its sizes
        # dynamic. Each shape is thus compiled for itself (static shapes: its best code).
        torch._dynamo.reset()
        moe_impl = "grouped_mm" if inputs["config"]["experts"] and grouped_mm_runs(inputs) else "loop"
        x, weights, config = inputs["x"], weights_of(inputs), inputs["config"]
        regions = _lazily(compiled_regions)

        def model(attention="sdpa", compiled=False):
            return _no_grad(lambda: forward(x, weights, config, attention=attention, moe_impl=moe_impl,
                                            regions=regions() if compiled else EAGER))

        found = dict(eager=model(), naive=model("naive"), compile=model(compiled=True))
        if not (config["experts"] and moe_impl == "loop"):  # the loop's torch.where waits for the GPU
            found["compile + CUDA graph"] = _graphed(model(compiled=True))
        return found

    def notes(self, shape: dict, ms: float, baseline_ms: dict) -> list[str]:
        tokens = shape["B"] * shape["S"]
        rates = [f"{n} {tokens / t * 1e3:,.0f}" for n, t in baseline_ms.items() if t]
        return [f"{tokens} tokens: {tokens / ms * 1e3:,.0f} tokens/s" + (f" (baselines, tokens/s: {'; '.join(rates)})"
                                                                         if rates else "")]

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        tokens = shape["B"] * shape["S"]
        attention = 4.0 * shape["B"] * shape["heads"] * head_dim(shape) * visible_pairs(shape["S"], shape["S"], True)
        return 2.0 * active_matmul_parameters(shape) * tokens + shape["layers"] * attention

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        return float((parameters(shape) + 2 * shape["B"] * shape["S"] * shape["hidden"]) * element_bytes)


def mean_relative_to_library(name: str, out: torch.Tensor, exact: torch.Tensor, library_out: torch.Tensor) -> tolerance.OutputCheck:
    """mean|out - exact| <= MEAN_FACTOR · mean|library - exact| (both include the output's own rounding)."""
    kernel, library = tolerance.error_stats(out, exact), tolerance.error_stats(library_out, exact)
    limit = MEAN_FACTOR * library.mean_abs
    return tolerance.OutputCheck(name, kernel.finite and kernel.mean_abs <= limit, limit, kernel, library,
                                 tolerance.quality(kernel, library))


# ---------------------------------------------------------------- inputs

WEIGHTS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w1", "w2", "wr", "norm")


def make_inputs(shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
    """x and the weights (module docstring), drawn in this order from one generator on `device`, in the dtype
    itself; `config`: the model's dimensions (the shape's, with B and S)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, dtype)
    L, h, H, KV, I, E = (shape[k] for k in ("layers", "hidden", "heads", "kv_heads", "inter", "experts"))
    D = head_dim(shape)
    if h % H or H % KV:
        raise ValueError(f"hidden {h} must be a multiple of heads {H}, heads of kv_heads {KV}")

    def randn(*size, std=1.0, mean=0.0):
        return torch.randn(*size, generator=gen, device=device, dtype=dt).mul_(std).add_(mean)

    out_std = (2 * L) ** -0.5  # the residual branches' output projections
    inputs = dict(x=randn(shape["B"], shape["S"], h, std=input_scale),
                  attn_norm=randn(L, h, std=0.1, mean=1.0),
                  wqkv=randn(L, h, (H + 2 * KV) * D, std=h ** -0.5),
                  wo=randn(L, H * D, h, std=(H * D) ** -0.5 * out_std),
                  mlp_norm=randn(L, h, std=0.1, mean=1.0))
    if E:
        inputs["wr"] = randn(L, h, E, std=h ** -0.5)
        inputs["w1"] = randn(L, E, h, 2 * I, std=h ** -0.5)
        inputs["w2"] = randn(L, E, I, h, std=I ** -0.5 * out_std)
    else:
        inputs["w1"] = randn(L, h, 2 * I, std=h ** -0.5)
        inputs["w2"] = randn(L, I, h, std=I ** -0.5 * out_std)
    inputs["norm"] = randn(h, std=0.1, mean=1.0)
    inputs["config"] = {k: shape[k] for k in (*DIMENSIONS, "B", "S")}
    return inputs


def weights_of(inputs: dict) -> dict:
    return {n: inputs[n] for n in WEIGHTS if n in inputs}


# ---------------------------------------------------------------- the model in PyTorch

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: in fp32 (or wider), rounded to x's dtype, then times the weight."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def inv_freq(D: int, theta: float, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """theta^(-2i/D), i < D/2: in fp32 as Hugging Face computes it, or exactly (float64)."""
    return 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).to(dtype) / D))


def rope_cos_sin(S: int, D: int, theta: float, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, D] of positions 0..S-1, each frequency repeated over both halves; computed in fp32
    (float64 for a float64 dtype) and rounded to `dtype`, as Hugging Face's rotary embedding."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    angles = torch.arange(S, device=device, dtype=wide)[:, None] * inv_freq(D, theta, wide, device)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]; cos, sin [S, D]."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, KV, S, D] -> [B, KV·groups, S, D]: KV head j serves query heads j·groups .. j·groups + groups - 1."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def attend(q, k, v, how: str | Callable) -> torch.Tensor:
    """Causal attention, q [B, H, S, D], k and v [B, KV, S, D]: "sdpa" (PyTorch's fused attention, GQA by
    enable_gqa), "naive" (matmul, softmax in fp32, matmul, as Llama's reference code), "exact" (in q's dtype,
    one batch element at a time, for float64), or how(q, k, v) for a callable: another attention (GQA its own
    to do) returning [B, H, S, D], such as the course's ops.attention with causal=True."""
    if callable(how):
        return how(q, k, v)
    groups = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if how == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if how == "naive":
        scores = (q @ k.transpose(-1, -2)) * scale
        scores.masked_fill_(mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).type_as(q) @ v
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        scores = (q[b] @ k[b].transpose(-1, -2)) * scale
        out[b] = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v[b]
    return out


def moe_block(m: torch.Tensor, wr, w1, w2, top_k: int, impl: str | Callable) -> torch.Tensor:
    """reference/moe.py's layer on m [T, hidden]: "exact" (float64 logits and layer), "loop" (its loop over
    the experts: fp32 logits, fp32 combine), "grouped_mm", or impl(m, wr, w1, w2, top_k) for a callable:
    another MoE layer returning [T, hidden], such as the course's ops.moe_layer."""
    if callable(impl):
        return impl(m, wr, w1, w2, top_k)
    layer = dict(x=m, wr=wr, w1=w1, w2=w2)
    if impl == "exact":
        ids, weights = moe.topk_exact(moe.router_logits(m, wr, dtype=torch.float64), top_k)
        return moe.layer_reference(layer, top_k, dtype=m.dtype, ids=ids, weights=weights)
    return moe.layer_grouped_mm(layer, top_k) if impl == "grouped_mm" else moe.layer_loop(layer, top_k)


class Regions(NamedTuple):
    """The model's code in two pieces, run as they are (EAGER) or each compiled (compiled_regions): what
    comes before the first layer, and one decoder layer, which every layer runs with its own weights.
    Compiled so, torch.compile compiles one layer rather than the model unrolled over its 4-32 layers
    (PyTorch's regional compilation): minutes less per shape for the large models. A layer ends with the
    next layer's RMSNorm, so that the residual add and the norm after it stay in one region, where
    inductor fuses them as it would in the whole model."""
    start: Callable
    layer: Callable


def model_start(x: torch.Tensor, attn_norm: torch.Tensor, config: dict) -> tuple:
    """RoPE's cos and sin for x's positions, in x's dtype, and the first layer's RMSNorm of x."""
    cos, sin = rope_cos_sin(x.shape[1], x.shape[2] // config["heads"], config["rope_theta"], x.dtype, x.device)
    return cos, sin, rms_norm(x, attn_norm, config["eps"])


def decoder_layer(h: torch.Tensor, a: torch.Tensor, cos, sin, weights: dict, next_norm: torch.Tensor, config: dict,
                  attention: str | Callable, moe_impl: str | Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer (module docstring) on the residual stream h [B, S, hidden], given a, its RMSNorm by the
    layer's attn_norm, and the layer's `weights` (layer_weights): (h after the layer, its RMSNorm by
    next_norm: the next layer's attn_norm, or the final norm)."""
    H, KV, I = (config[k] for k in ("heads", "kv_heads", "inter"))
    B, S, hidden = h.shape
    D = hidden // H
    qkv = a @ weights["wqkv"]
    q, k, v = qkv.split((H * D, KV * D, KV * D), dim=-1)
    q, k, v = (t.reshape(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
    o = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, attention)
    h = h + o.transpose(1, 2).reshape(B, S, H * D) @ weights["wo"]
    m = rms_norm(h, weights["mlp_norm"], config["eps"])
    if config["experts"]:
        y = moe_block(m.reshape(B * S, hidden), weights["wr"], weights["w1"], weights["w2"], config["top_k"], moe_impl)
        h = h + y.reshape(B, S, hidden)
    else:
        g = m @ weights["w1"]
        h = h + (F.silu(g[..., :I]) * g[..., I:]) @ weights["w2"]
    return h, rms_norm(h, next_norm, config["eps"])


EAGER = Regions(model_start, decoder_layer)


def compiled_regions(**options) -> Regions:
    """Regions compiled by torch.compile (`options`: its keyword arguments), each on its first call."""
    return Regions(torch.compile(model_start, **options), torch.compile(decoder_layer, **options))


def layer_weights(weights: dict, layer: int, dtype, experts: int) -> dict:
    """Layer `layer`'s weights in `dtype`; the experts' as given (the exact MoE layer widens one expert at a
    time: Mixtral's 1.4 G per layer)."""
    as_given = ("wr", "w1", "w2") if experts else ()
    return {n: weights[n][layer] if n in as_given else weights[n][layer].to(dtype)
            for n in ("wqkv", "wo", "mlp_norm", "wr", "w1", "w2") if n in weights}


def forward(x: torch.Tensor, weights: dict, config: dict, *, exact: bool = False, attention: str | Callable = "sdpa",
            moe_impl: str | Callable = "loop", final_norm: bool = True, regions: Regions = EAGER) -> torch.Tensor:
    """The model (module docstring) on x [B, S, hidden]: in x's dtype as Hugging Face computes it, or (exact)
    in float64, each layer's weights widened when its turn comes. Returns [B, S, hidden] in x's dtype, or
    float64 if exact; without final_norm, the residual stream before the final RMSNorm. `attention` and
    `moe_impl`: attend's and moe_block's options, names or callables."""
    L = config["layers"]
    dtype = torch.float64 if exact else x.dtype
    if exact:
        attention, moe_impl = "exact", "exact"
    h = x.to(dtype)
    cos, sin, a = regions.start(h, weights["attn_norm"][0].to(dtype), config)
    for l in range(L):
        next_norm = weights["attn_norm"][l + 1] if l + 1 < L else weights["norm"]
        h, a = regions.layer(h, a, cos, sin, layer_weights(weights, l, dtype, config["experts"]), next_norm.to(dtype),
                             config, attention, moe_impl)
    return a if final_norm else h


def _no_grad(run):
    """`run` under torch.no_grad: a callable with no arguments."""
    def call():
        with torch.no_grad():
            return run()
    return call


def _lazily(make):
    """A callable returning make(), made on its first call."""
    made = []

    def get():
        if not made:
            made.append(make())
        return made[0]
    return get


def _graphed(run):
    """A callable replaying `run` (no arguments; fixed tensors in and out) as one CUDA graph, captured on its
    first call after a warm-up on the capturing stream: what torch.compile's mode="reduce-overhead" does,
    here over the whole forward at once. (stages/stage10_model's launch captures its forward the same way.)"""
    captured = {}

    def replay():
        if not captured:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # the warm-up: compiles and tunes outside the capture
                run()
            # cuBLAS's workspace made outside the capture would live outside the graph's memory, and another
            # capture (stage 10's launch) frees it before its own: dropped, the capture makes its own in its pool.
            torch._C._cuda_clearCublasWorkspaces()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                captured["out"] = run()
            torch.cuda.current_stream().wait_stream(stream)
            captured["graph"] = graph
        captured["graph"].replay()
        return captured["out"]
    return replay


def grouped_mm_runs(inputs: dict) -> bool:
    """Whether torch._grouped_mm runs the MoE layer here (PyTorch >= 2.8, bf16 on a GPU that has it)."""
    layer = inputs["config"]
    if not moe.has_grouped_mm():
        return False
    m = inputs["x"][0, :1].reshape(1, -1)
    try:
        moe_block(m, inputs["wr"][0], inputs["w1"][0], inputs["w2"][0], layer["top_k"], "grouped_mm")
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


# ---------------------------------------------------------------- Hugging Face's models, where installed

def transformers_output(inputs: dict, attn_implementation: str = "sdpa") -> torch.Tensor | None:
    """The last hidden state of Hugging Face's LlamaModel (dense) or MixtralModel (MoE) with these weights on
    x (`inputs_embeds`), in the inputs' dtype; None where `transformers` is not installed (transformers_model
    builds the model)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    model = transformers_model(weights_of(inputs), inputs["config"], attn_implementation)
    with torch.no_grad():
        return model(inputs_embeds=inputs["x"]).last_hidden_state


def transformers_model(weights: dict, config: dict, attn_implementation: str = "sdpa"):
    """Hugging Face's LlamaModel (dense) or MixtralModel (MoE) with these weights (`config`: the model's
    dimensions and S), in eval mode; with an "embedding" [vocab, hidden] and an "lm_head" [hidden, vocab]
    among the weights, LlamaForCausalLM or MixtralForCausalLM (untied: each its own), with no BOS, EOS or
    padding token, so that generate stops only at its length. The model is built on the meta device and given
    the weights' tensors (transposed views copied: nn.Linear's [out, in]), its rotary embeddings rebuilt on
    the weights' device; the inverse frequencies are checked against ours. Written for transformers 4.4x and
    5.x (Mixtral's experts as a list of w1/w2/w3 Linears or as fused gate_up_proj and down_proj tensors): an
    unknown layout raises. ImportError where transformers is not installed."""
    import transformers

    L, h, H, KV, I, E = (config[k] for k in ("layers", "hidden", "heads", "kv_heads", "inter", "experts"))
    D = h // H
    device = weights["norm"].device
    causal_lm = "lm_head" in weights
    common = dict(hidden_size=h, intermediate_size=I, num_hidden_layers=L, num_attention_heads=H,
                  num_key_value_heads=KV, head_dim=D, rms_norm_eps=config["eps"], rope_theta=config["rope_theta"],
                  vocab_size=weights["lm_head"].shape[1] if causal_lm else 32,
                  max_position_embeddings=max(4096, config["S"]), tie_word_embeddings=False,
                  attn_implementation=attn_implementation)
    if causal_lm:
        common.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if E:
        hf_config = transformers.MixtralConfig(num_local_experts=E, num_experts_per_tok=config["top_k"],
                                               sliding_window=None, **common)
        model_class = transformers.MixtralForCausalLM if causal_lm else transformers.MixtralModel
    else:
        hf_config = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
        model_class = transformers.LlamaForCausalLM if causal_lm else transformers.LlamaModel
    if hasattr(hf_config, "rope_parameters"):  # transformers 5: the theta lives here
        hf_config.rope_parameters = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    with torch.device("meta"):
        model = model_class(hf_config)
    state = _hf_state_dict(weights, config, model.state_dict())
    model.load_state_dict(state, strict=True, assign=True)
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            rebuilt = type(module)(config=hf_config, device=device)
            setattr(model.get_submodule(parent) if parent else model, attr, rebuilt)
            ours = inv_freq(D, config["rope_theta"], torch.float32, device)
            if not torch.allclose(rebuilt.inv_freq.float(), ours, rtol=1e-6):
                raise ValueError(f"{name}: transformers' RoPE frequencies differ from ours (theta not taken?)")
    return model.eval()


def _hf_state_dict(inputs: dict, config: dict, wanted: dict) -> dict:
    """Hugging Face's parameter names -> our weights (`inputs`: the weights by our names, with "embedding" and
    "lm_head" for a causal LM) in their layout, for every key of `wanted` (a causal LM's decoder keys under
    "model.")."""
    H, KV, I, hidden = config["heads"], config["kv_heads"], config["inter"], config["hidden"]
    D = hidden // H
    dense = lambda t: t.t().contiguous()  # noqa: E731  [in, out] -> nn.Linear's [out, in]
    state = {}
    for key, meta in wanted.items():
        parts = key.removeprefix("model.").split(".")
        if parts == ["norm", "weight"]:
            state[key] = inputs["norm"]
            continue
        if key == "lm_head.weight":
            state[key] = dense(inputs["lm_head"])
            continue
        if parts == ["embed_tokens", "weight"]:  # a decoder given inputs_embeds never reads it
            state[key] = inputs["embedding"] if "embedding" in inputs else \
                torch.zeros(meta.shape, dtype=inputs["norm"].dtype, device=inputs["norm"].device)
            continue
        if parts[0] != "layers":
            raise ValueError(f"no weight of ours for transformers' {key}")
        l, rest = int(parts[1]), ".".join(parts[2:])
        wqkv = inputs["wqkv"][l]
        simple = {
            "input_layernorm.weight": lambda: inputs["attn_norm"][l],
            "post_attention_layernorm.weight": lambda: inputs["mlp_norm"][l],
            "self_attn.q_proj.weight": lambda: dense(wqkv[:, :H * D]),
            "self_attn.k_proj.weight": lambda: dense(wqkv[:, H * D:(H + KV) * D]),
            "self_attn.v_proj.weight": lambda: dense(wqkv[:, (H + KV) * D:]),
            "self_attn.o_proj.weight": lambda: dense(inputs["wo"][l]),
            "mlp.gate_proj.weight": lambda: dense(inputs["w1"][l][:, :I]),
            "mlp.up_proj.weight": lambda: dense(inputs["w1"][l][:, I:]),
            "mlp.down_proj.weight": lambda: dense(inputs["w2"][l]),
            "block_sparse_moe.gate.weight": lambda: dense(inputs["wr"][l]),
            "mlp.gate.weight": lambda: dense(inputs["wr"][l]),
        }
        if rest in simple:
            state[key] = simple[rest]()
        elif rest.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # fused, [E, out, in] as nn.Linear (transformers 5.17: gate_up_proj [E, 2I, hidden], down_proj
            # [E, hidden, I]) or [E, in, out] as ours; [E, out, in] first, where a square shape allows both
            ours = inputs["w1" if rest.endswith("gate_up_proj") else "w2"][l]
            transposed = ours.transpose(1, 2)
            state[key] = transposed.contiguous() if tuple(meta.shape) == tuple(transposed.shape) else ours
        elif ".experts." in rest:                    # a list of experts: w1 (gate), w3 (up), w2 (down)
            e, which = int(parts[-3]), parts[-2]
            w1 = inputs["w1"][l, e]
            state[key] = {"w1": lambda: dense(w1[:, :I]), "w3": lambda: dense(w1[:, I:]),
                          "w2": lambda: dense(inputs["w2"][l, e])}[which]()
        else:
            raise ValueError(f"no weight of ours for transformers' {key}")
        if tuple(state[key].shape) != tuple(meta.shape):
            raise ValueError(f"transformers' {key} is {tuple(meta.shape)}; ours {tuple(state[key].shape)}")
    return state


PROBLEM = ModelProblem()
