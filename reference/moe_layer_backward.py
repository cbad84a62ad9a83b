"""The backward of the MoE layer (reference/moe_layer.py): given dY, the gradient of a loss with respect to
the layer's output, and what the forward saved, the gradients of the layer's inputs and weights, with the
load-balancing loss's added.

Inputs: the forward's (x [T, hidden], Wr [hidden, E], bias [E] fp32, W1 [E, hidden, 2·I] gate half then up
half, W2 [E, I, hidden], top_k), dY [T, hidden] in the dtype, aux_coef, the load-balancing loss's coefficient
(stage 5's α), and what the forward saves (`Saved`, each field an input under its own name):
    topk_ids [T, k] int32        each token's experts
    topk_weights [T, k] fp32     the softmax of the saved logits at topk_ids
    logits [T, E] fp32           x·Wr + bias, as the forward computed them
    expert_counts [E] int32      token-slots per expert
    expert_offsets [E+1] int32   expert e's segment of the permuted rows, offsets[e] .. offsets[e+1], each
                                 padded to a multiple of BLOCK = 128 rows (moe.expert_offsets)
    dest [T, k] int32            the row of token-slot (t, j): offsets[e] <= dest < offsets[e] + counts[e]
    source_token [rows] int32    the token of each row; -1 on the padding rows and on the rows past offsets[E]
    h1 [rows, 2·I] dtype         the first product, h1[dest[t, j]] = x[t]·W1[ids[t, j]] = [G U]
with rows = moe.padded_capacity(T, E, k, BLOCK), a bound known without the routing. A kernel may assume no
order of the token-slots within a segment (dest and source_token agree on it; make_inputs writes (token, slot)
order, a stable sort) and must not read h1's padding rows or those past offsets[E]: make_inputs fills them
with NaN (FLOAT_POISON), so that a gradient that takes them in shows. Its saved tensors are an exact forward's
(make_inputs: logits = moe.router_logits in fp32, topk_ids = moe.topk_exact's, h1 = x·W1 in fp32 rounded once
to the dtype); where the grader times the forward's kernel then this problem's, the forward's own replace
them (Problem.forward_for_backward). Nothing is recomputed from x: the saved logits and h1 are the values.

Outputs: dX, dWr, dW1, dW2 shaped and typed as x, Wr, W1, W2, and dBias [E] fp32: the gradients of

    L = Σ_t,c dY[t, c] · out[t, c] + aux_coef · E · Σ_i f_i · P_i

with, as in the forward (logits = x·Wr + bias, h1 = x·W1[e], valued as saved):
    w[t, j]  = softmax_j(logits[t, ids[t, j]])            the softmax over the top-k logits only
    out[t]   = Σ_j w[t, j] · y_{ids[t, j]}(x[t])          y_e = (silu(h1[:, :I]) * h1[:, I:])·W2[e], h1 = x·W1[e]
    P_i      = (1/T) Σ_t softmax(logits[t])_i             over all E experts (stage 5's load-balancing loss,
    f_i      = (token-slots of expert i) / (T·k)          moe.balance_loss)

The routing ids are the saved topk_ids, whatever the forward chose at a tie: they are constants, and no
gradient flows through the discrete top-k choice (f_i, a count, included). Through the router, out's
gradient reaches only the chosen logits, through w: with g_j = dY[t]·y_{ids[t, j]}(x[t]) (= h·(dY[t]·W2[e]ᵀ):
no need for y itself),
    dlogits[t, ids[t, j]] = w[t, j] · (g_j - Σ_l w[t, l] · g_l)
and the load-balancing loss's reaches every logit, through the full softmax p[t] = softmax(logits[t]):
    dlogits[t, i] += aux_coef · E / T · p[t, i] · (f_i - Σ_l f_l · p[t, l])
and then dWr = xᵀ·dlogits, dBias = Σ_t dlogits[t], and dX = the experts' data-side gradient + dlogits·Wrᵀ.
Each expert's token-slots (t, j) give dW2[e] += hᵀ·(w·dY[t]), dW1[e] += x[t]ᵀ·dh1 and dX[t] += dh1·W1[e]ᵀ,
h = SwiGLU(h1) from the saved h1. An expert no token chose has dW1[e] = dW2[e] = 0, which a kernel writes too.

Cases: the forward's (stage 7's: T = 1, ragged token counts, skew, empty experts, both dtypes), then
DeepSeek-like ones (E 256, top-8); benchmarks: the forward's up to 32,768 tokens.

Exact reference: float64 autograd of the layer at the saved activations: the forward in float64 routed by
the saved ids, whose logits and h1 (per token-slot, row dest[t, j]) take the saved values, upcast, with the
gradient flowing through them as through their exact expressions, v = v_exact + (v_saved - v_exact) with the
difference detached (at_saved); w and P are the softmaxes of the saved logits. Checks: every output by the
library-relative rule; the library is PyTorch's autograd of the whole layer in the inputs' dtype (its own
forward: logits and w in fp32, h1 = x·W1 in the dtype), routed by the saved ids, through torch._grouped_mm
where it runs (PyTorch >= 2.8; on the GPU bf16 only), else through the loop over the experts.

Work: twice the forward's GEMM flops (moe.layer_flops), 12·hidden·I per token-slot: each forward product
has a data-side and a weight-side one, dX_e = dh1·W1ᵀ and dW1 = xᵀ·dh1 (4·hidden·I each), dh = (w·dY)·W2ᵀ
and dW2 = hᵀ·(w·dY) (2·hidden·I each); nothing is recomputed (h1 and the logits are saved). The router's
4·hidden·E per token is left out, as the forward leaves out its 2·hidden·E. min_bytes: x, dY, Wr, the
saved routing (topk ids and weights, dest, source_token's valid rows, logits, counts and offsets), h1's
valid rows (2·I per token-slot) and the weights of the experts that get tokens read once; dX, dWr, dBias
and every expert's dW1 and dW2 written once (bias is not read: the saved logits hold it).

Saved bytes: what the forward keeps for this backward per token-slot, ours (saved_bytes_per_slot: `Saved`
as allocated, h1's padding rows included) beside PyTorch's autograd graph of the same layer
(grouped_mm_saved_bytes: the storages its saved_tensors_hooks see, each once, the layer's inputs and weights
left out), counted on meta tensors at any shape. The 32-expert layer at 32,768 tokens (E 32, k 2, hidden 4096,
I 11008, bf16): ours 46,843 bytes per token-slot (h1 44,032, its padding rows 2,731, the routing 80: 3.1 GB),
PyTorch's 137,392 (h1 44,032, silu(G) and h 22,016 each, two fp32 [T·k, hidden] 16,384 each, x in fp32 8,192,
x's gathered rows 8,192, the logits, routing and Wr in fp32 176: 9.0 GB).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from reference import moe, moe_experts, moe_layer, moe_routing, tolerance
from reference.moe_experts import BLOCK
from reference.moe_layer import MoeLayerProblem
from reference.problem import FLOAT_POISON, Case, Problem

FORWARD = moe_layer.PROBLEM


class Saved(NamedTuple):
    """What the forward keeps for the backward, per layer call: the routing and permutation of stage 5/7 and
    the first product h1 = x·W1 per token-slot. rows = moe.padded_capacity(T, E, k, BLOCK): expert e's
    token-slots sit at rows offsets[e] .. offsets[e] + counts[e] - 1 of the permuted buffers, in any order
    (dest and source_token agree on it), then padding up to offsets[e+1], a multiple of BLOCK."""
    topk_ids: torch.Tensor        # [T, k] int32, each token's experts
    topk_weights: torch.Tensor    # [T, k] fp32, the softmax of the saved logits at topk_ids
    logits: torch.Tensor          # [T, E] fp32, x·Wr + bias
    expert_counts: torch.Tensor   # [E] int32, token-slots per expert
    expert_offsets: torch.Tensor  # [E+1] int32, each expert's first row, padded segments
    dest: torch.Tensor            # [T, k] int32, the row of token-slot (t, j)
    source_token: torch.Tensor    # [rows] int32, the token of each row, -1 for padding (and rows past offsets[E])
    h1: torch.Tensor              # [rows, 2·I] in the dtype, x[token]·W1[e] = [G U]; padding rows unspecified


DIFFERENTIATED = ("x", "wr", "bias", "w1", "w2")  # the inputs whose gradients are the outputs, in their order

# Beyond the forward's cases (E up to 64): DeepSeek-like routing, 256 experts and 8 per token, CPU-sized;
# rows as moe_experts._CASES's (T, E, k, hidden, inter, dtype, input scale, knobs).
DEEPSEEK_CASES = [
    (1, 256, 8, 64, 64, "bfloat16", 1), (1000, 256, 8, 128, 64, "bfloat16", 1),
    (333, 256, 8, 64, 128, "float16", 1, dict(skew=4, empty=(255,))),
]


MAX_BENCHMARK_TOKENS = 32768


class MoeLayerBackwardProblem(Problem):
    name = "moe_layer_backward"
    primary_input = "x"
    outputs = tuple(f"d{n}" for n in DIFFERENTIATED)
    forward = "moe_layer"  # whose saved tensors (Saved's fields) are inputs here

    # ---- cases and shapes: the forward's, and DeepSeek-like ones ----------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return moe_experts.cases(seed, extra=DEEPSEEK_CASES)

    def benchmarks(self) -> list[dict]:
        """The forward's shapes up to 32,768 tokens: each library's backward keeps its forward's graph (its
        activations) beside the kernel's, and at 65,536 tokens of the 32-expert layer they do not fit 80 GB."""
        return [shape for shape in FORWARD.benchmarks() if shape["tokens"] <= MAX_BENCHMARK_TOKENS]

    shape_label = staticmethod(moe_experts.shape_label)

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        """The forward's inputs for this seed, what an exact forward saves (forward_saved), a seeded dY."""
        inputs = FORWARD.make_inputs(shape, dtype, seed, input_scale, device)
        x = inputs["x"]
        saved = forward_saved(x, inputs["wr"], inputs["bias"], inputs["w1"], shape["top_k"])
        gen = torch.Generator(device=device).manual_seed(seed + 1)  # apart from the layer's own draws
        dy = torch.randn(x.shape, generator=gen, device=device).to(x.dtype)
        return dict(inputs, **saved._asdict(), dy=dy, aux_coef=moe_routing.ALPHA)

    def allocate_outputs(self, inputs: dict) -> dict:
        return {f"d{n}": torch.full_like(inputs[n], FLOAT_POISON) for n in DIFFERENTIATED}

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        i, o = inputs, outputs
        stage.launch(kernels, i["x"], i["wr"], i["w1"], i["w2"], i["dy"], i["aux_coef"], saved_of(i),
                     *(o[n] for n in self.outputs))

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        """Float64 autograd of the layer at the saved logits and h1 (the module docstring)."""
        leaves = {n: inputs[n].detach().to(torch.float64).requires_grad_() for n in DIFFERENTIATED}
        layer = layer_at_saved_h1(inputs["h1"], inputs["dest"])
        return gradients(inputs, leaves, routed_layer(inputs, leaves, layer, torch.float64, inputs["logits"]))

    def library_output(self, inputs: dict) -> dict:
        """PyTorch's autograd of the layer in the inputs' dtype, through torch._grouped_mm where it runs,
        else through the loop over the experts."""
        if moe.has_grouped_mm():
            try:
                return library_gradients(inputs, moe.layer_grouped_mm)
            except (RuntimeError, TypeError, NotImplementedError):
                pass  # torch._grouped_mm refuses these inputs here (fp16 on the GPU)
        return library_gradients(inputs, moe.layer_loop)

    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]:
        return [tolerance.relative_to_library(n, outputs[n], exact[n], library[n]) for n in self.outputs]

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """The backward alone of the layer in PyTorch, through torch._grouped_mm ("grouped_mm", where it runs)
        and through the loop over the experts ("naive")."""
        found = moe.grouped_mm_baseline(_backward_run(inputs, moe.layer_grouped_mm))
        found["naive"] = _backward_run(inputs, moe.layer_loop)
        return found

    def forward_backward_baselines(self, inputs: dict) -> dict:
        """The same, forward and backward."""
        found = moe.grouped_mm_baseline(lambda: library_gradients(inputs, moe.layer_grouped_mm))
        found["naive"] = lambda: library_gradients(inputs, moe.layer_loop)
        return found

    notes = staticmethod(MoeLayerProblem.notes)  # tokens per second, beside the baselines'

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        return 2 * FORWARD.flops(shape)

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        T, E, k, hidden, inter = (shape[n] for n in ("tokens", "experts", "top_k", "hidden", "inter"))
        used = E - len(shape.get("empty", ()))
        weights = (used + E) * 3 * hidden * inter * element_bytes  # W1, W2 of experts with tokens in; all dW1, dW2 out
        router = 2 * hidden * E * element_bytes + 4 * E            # Wr in, dWr and dBias out
        tokens = 3 * T * hidden * element_bytes                    # x, dY in, dX out
        h1 = T * k * 2 * inter * element_bytes                     # the saved h1's valid rows
        # topk ids and weights, dest, source_token's valid rows; the logits; counts and offsets
        routing = 4 * (4 * T * k + T * E + 2 * E + 1)
        return float(weights + router + tokens + h1 + routing)


def saved_of(inputs: dict) -> Saved:
    """The saved tensors among the inputs, as the stage's launch takes them."""
    return Saved(*(inputs[n] for n in Saved._fields))


# ---------------------------------------------------------------- what the forward saves

H1_ROWS = 8192  # rows per piece of make_inputs' fp32 products: their temporaries stay ~8192 × (hidden + 2·I) × 4 B


def forward_saved(x: torch.Tensor, wr: torch.Tensor, bias: torch.Tensor, w1: torch.Tensor, top_k: int,
                  topk_ids: torch.Tensor | None = None) -> Saved:
    """What an exact forward saves (the module docstring): the fp32 logits, their exact top-k (or the given
    topk_ids, another forward's choice at a tie) and its softmax, the padded permutation with each expert's
    token-slots in (token, slot) order, and h1 = x·W1 in fp32 rounded to the dtype on the valid rows, NaN on
    every other row. h1 is computed expert by expert in pieces of H1_ROWS rows, one host synchronization for
    the segments: no [T·k, 2·I] fp32 temporary (11.5 GB at 32K tokens of the 32-expert layer)."""
    tokens, experts = x.shape[0], wr.shape[1]
    logits = moe.router_logits(x, wr, bias)
    if topk_ids is None:
        topk_ids = moe.topk_exact(logits, top_k)[0]
    weights = torch.softmax(logits.gather(1, topk_ids.long()).double(), dim=-1).float()
    counts = moe.expert_counts(topk_ids, experts)
    offsets = moe.expert_offsets(counts, BLOCK)
    order = torch.argsort(topk_ids.flatten(), stable=True)  # the token-slots by expert, (token, slot) within one
    valid = moe_experts.valid_rows(offsets, counts)           # their rows, in the same order
    dest = torch.empty_like(order)
    dest[order] = valid
    rows = moe.padded_capacity(tokens, experts, top_k, BLOCK)
    source_token = torch.full((rows,), -1, dtype=torch.int32, device=x.device)
    source_token[valid] = (order // top_k).to(torch.int32)
    h1 = torch.full((rows, w1.shape[2]), FLOAT_POISON, dtype=x.dtype, device=x.device)
    for e, (start, count) in enumerate(zip(offsets[:-1].tolist(), counts.tolist())):
        if count:
            w1_e = w1[e].float()
            for first in range(start, start + count, H1_ROWS):
                piece = slice(first, min(first + H1_ROWS, start + count))
                h1[piece] = (x[source_token[piece].long()].float() @ w1_e).to(x.dtype)
    return Saved(topk_ids.to(torch.int32), weights, logits, counts, offsets, dest.view(topk_ids.shape).to(torch.int32),
                 source_token, h1)


def saved_bytes_per_slot(shape: dict, element_bytes: int = 2) -> float:
    """The bytes of `Saved` as allocated (h1 and source_token with their padded_capacity rows), per token-slot."""
    T, E, k, inter = (shape[n] for n in ("tokens", "experts", "top_k", "inter"))
    rows = moe.padded_capacity(T, E, k, BLOCK)
    h1 = rows * 2 * inter * element_bytes
    routing = 4 * (3 * T * k + T * E + E + (E + 1) + rows)  # ids, weights, dest; logits; counts, offsets; source_token
    return (h1 + routing) / (T * k)


def grouped_mm_saved_bytes(shape: dict, dtype: str = "bfloat16", device="meta") -> float:
    """The bytes PyTorch's autograd keeps for the backward of the layer (routed_layer, logits in fp32) per
    token-slot: every storage its saved_tensors_hooks see, once however many views of it are saved, but the
    layer's inputs and weights (x, Wr, bias, W1, W2), through moe.layer_grouped_mm where torch._grouped_mm
    exists, else moe.layer_loop (not on "meta"). On "meta" no tensor holds data (any shape, the 32-expert layer
    at 32K tokens included; the routing does not change what is kept, only the expert loop's pieces); on
    another device, make_inputs' inputs."""
    T, E, k, hidden, inter = (shape[n] for n in ("tokens", "experts", "top_k", "hidden", "inter"))
    if device == "meta":
        dt = getattr(torch, dtype)

        def empty(*size, dtype=dt):
            return torch.empty(*size, dtype=dtype, device="meta")
        inputs = dict(x=empty(T, hidden), wr=empty(hidden, E), bias=empty(E, dtype=torch.float32),
                      w1=empty(E, hidden, 2 * inter), w2=empty(E, inter, hidden), top_k=k,
                      topk_ids=empty(T, k, dtype=torch.int32), aux_coef=moe_routing.ALPHA)
    else:
        inputs = PROBLEM.make_inputs(shape, dtype, 0, device=device)
    leaves = _leaves(inputs)
    theirs = {t.untyped_storage()._cdata for t in leaves.values()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in theirs:
            kept[storage._cdata] = storage.nbytes()
        return t
    layer = moe.layer_grouped_mm if moe.has_grouped_mm() else moe.layer_loop
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        graph = routed_layer(inputs, leaves, layer, torch.float32)  # noqa: F841  (kept alive while counted)
    return sum(kept.values()) / (T * k)


# ---------------------------------------------------------------- the layer, differentiated

def at_saved(exact: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
    """saved's value (upcast to exact's dtype) with exact's gradient: exact + (saved - exact), the difference
    detached."""
    return exact + (saved.to(exact.dtype) - exact).detach()


def layer_at_saved_h1(h1: torch.Tensor, dest: torch.Tensor):
    """A layer as moe.layer_reference (leaves, top_k, ids=, weights=) -> out, in the leaves' dtype, whose first
    product x[t]·W1[e] takes the saved value h1[dest[t, j]] for token-slot (t, j) (at_saved): only the valid
    rows of h1 are read."""
    def layer(leaves: dict, top_k: int, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        x, w1, w2 = leaves["x"], leaves["w1"], leaves["w2"]
        out = torch.zeros_like(x)
        for e in range(w1.shape[0]):
            token, slot = torch.where(ids == e)
            if token.numel():
                h1_e = at_saved(x[token] @ w1[e], h1[dest[token, slot].long()])
                y = moe.swiglu(h1_e, w2.shape[1]) @ w2[e]
                out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
        return out
    return layer


def routed_layer(inputs: dict, leaves: dict, layer, logits_dtype,
                 saved_logits=None) -> tuple[torch.Tensor, torch.Tensor]:
    """out and the load-balancing loss of the layer on `leaves` (x, wr, bias, w1, w2), routed by the saved
    topk_ids: `layer` (moe.layer_reference, layer_loop, layer_grouped_mm or layer_at_saved_h1's) weighted by
    the softmax of the logits (computed in logits_dtype, valued as `saved_logits` if given: at_saved) at
    those ids."""
    ids, top_k = inputs["topk_ids"], inputs["top_k"]
    logits = moe.router_logits(leaves["x"], leaves["wr"], leaves["bias"], dtype=logits_dtype)
    if saved_logits is not None:
        logits = at_saved(logits, saved_logits)
    out = layer(leaves, top_k, ids=ids, weights=torch.softmax(logits.gather(1, ids.long()), dim=-1))
    counts = moe.expert_counts(ids, logits.shape[1])
    return out, moe.balance_loss(torch.softmax(logits, dim=-1), counts, top_k, inputs["aux_coef"])


def gradients(inputs: dict, leaves: dict, layer_result, retain_graph=False) -> dict:
    """The outputs: the gradients of L (the module docstring) with respect to the leaves, from routed_layer's result."""
    out, aux_loss = layer_result
    grads = torch.autograd.grad((out, aux_loss), tuple(leaves.values()),
                                (inputs["dy"].to(out.dtype), torch.ones_like(aux_loss)), retain_graph=retain_graph)
    return {f"d{n}": g for n, g in zip(leaves, grads)}


def _leaves(inputs: dict) -> dict:
    """The differentiated inputs as autograd leaves, sharing their storage (no copy of the experts' weights:
    the DeepSeek-like layer's are 22.5 GB in bf16)."""
    return {n: inputs[n].detach().requires_grad_() for n in DIFFERENTIATED}


def library_gradients(inputs: dict, layer) -> dict:
    """PyTorch's forward and backward of the layer in the inputs' dtype (logits in fp32)."""
    leaves = _leaves(inputs)
    return gradients(inputs, leaves, routed_layer(inputs, leaves, layer, torch.float32))


def _backward_run(inputs: dict, layer):
    """A callable: the gradients through the layer's forward graph, which the first call builds and keeps
    (then, not here, so that the worker's first call, in a try, meets its OOM)."""
    leaves, graph = _leaves(inputs), []

    def run():
        if not graph:
            graph.append(routed_layer(inputs, leaves, layer, torch.float32))
        return gradients(inputs, leaves, graph[0], retain_graph=True)
    return run


PROBLEM = MoeLayerBackwardProblem()
