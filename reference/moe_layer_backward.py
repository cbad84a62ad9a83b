"""The backward of the MoE layer (reference/moe_layer.py): given dY, the gradient of a loss with respect to
the layer's output, the gradients of the layer's inputs and weights, with the load-balancing loss's added.

Inputs: the forward's (x [T, hidden], Wr [hidden, E], bias [E] fp32, W1 [E, hidden, 2·I] gate half then up
half, W2 [E, I, hidden], top_k), the forward's saved routing, topk_ids [T, k] int32 and topk_weights [T, k]
fp32 (the softmax of the fp32 logits at those ids, which the softmax's backward needs), dY [T, hidden] in
the dtype, and aux_coef, the load-balancing loss's coefficient (stage 5's α). Outputs: dX, dWr, dW1, dW2
shaped and typed as x, Wr, W1, W2, and dBias [E] fp32: the gradients of

    L = Σ_t,c dY[t, c] · out[t, c] + aux_coef · E · Σ_i f_i · P_i

with, as in the forward (logits = x·Wr + bias, exact here, fp32 in a kernel):
    w[t, j]  = softmax_j(logits[t, ids[t, j]])            the softmax over the top-k logits only
    out[t]   = Σ_j w[t, j] · y_{ids[t, j]}(x[t])          y_e(x) = (silu(x·W1[e][:, :I]) * (x·W1[e][:, I:]))·W2[e]
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
h1 = x[t]·W1[e] and h = SwiGLU(h1) recomputed (the inputs hold no activations). An expert no token chose
has dW1[e] = dW2[e] = 0, which a kernel writes too.

Cases: the forward's (stage 7's: T = 1, ragged token counts, skew, empty experts, both dtypes), then
DeepSeek-like ones (E 256, top-8); benchmarks: the forward's. Where the grader times the forward's kernel
then this problem's, the forward's topk_ids replace the exact ones.

Exact reference: autograd of the float64 layer (moe.layer_reference, the forward's exact code) routed by
the saved ids, with w from the exact logits. Checks: every output by the library-relative rule; the library
is PyTorch's autograd of the layer in the inputs' dtype (logits and w in fp32), through torch._grouped_mm
where it runs (PyTorch >= 2.8; on the GPU bf16 only), else through the loop over the experts.

Work: twice the forward's GEMM flops (moe.layer_flops), 12·hidden·I per token-slot: each forward product
has a data-side and a weight-side one, dX_e = dh1·W1ᵀ and dW1 = xᵀ·dh1 (4·hidden·I each), dh = (w·dY)·W2ᵀ
and dW2 = hᵀ·(w·dY) (2·hidden·I each). Not counted: recomputing x·W1 (4·hidden·I per token-slot, a kernel's
overhead: PyTorch's baselines keep the forward's activations in their graph instead), and the router's
4·hidden·E per token, left out as the forward leaves out its 2·hidden·E. min_bytes: x, dY, Wr, bias, the
saved routing and the weights of the experts that get tokens read once; dX, dWr, dBias and every expert's
dW1 and dW2 written once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from reference import moe, moe_experts, moe_layer, moe_routing, tolerance
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
    forward = "moe_layer"  # whose output topk_ids is an input here

    # ---- cases and shapes: the forward's, and DeepSeek-like ones ----------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return moe_experts.cases(seed, extra=DEEPSEEK_CASES)

    def benchmarks(self) -> list[dict]:
        """The forward's shapes up to 32,768 tokens: each library's backward keeps its forward's graph (its
        activations) beside the kernel's, and at 65,536 tokens of the seed's layer they do not fit 80 GB."""
        return [shape for shape in FORWARD.benchmarks() if shape["tokens"] <= MAX_BENCHMARK_TOKENS]

    shape_label = staticmethod(moe_experts.shape_label)

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        """The forward's inputs for this seed, its routing as the exact forward chooses it, a seeded dY."""
        inputs = FORWARD.make_inputs(shape, dtype, seed, input_scale, device)
        x = inputs["x"]
        ids, weights = moe.topk_exact(moe.router_logits(x, inputs["wr"], inputs["bias"]), shape["top_k"])
        gen = torch.Generator(device=device).manual_seed(seed + 1)  # apart from the layer's own draws
        dy = torch.randn(x.shape, generator=gen, device=device).to(x.dtype)
        return dict(inputs, topk_ids=ids, topk_weights=weights.float(), dy=dy, aux_coef=moe_routing.ALPHA)

    def allocate_outputs(self, inputs: dict) -> dict:
        return {f"d{n}": torch.full_like(inputs[n], FLOAT_POISON) for n in DIFFERENTIATED}

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        i, o = inputs, outputs
        stage.launch(kernels, i["x"], i["wr"], i["bias"], i["w1"], i["w2"], i["top_k"], i["topk_ids"],
                     i["topk_weights"], i["dy"], i["aux_coef"], *(o[n] for n in self.outputs))

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        leaves = {n: inputs[n].detach().to(torch.float64).requires_grad_() for n in DIFFERENTIATED}
        return gradients(inputs, leaves, routed_layer(inputs, leaves, moe.layer_reference, torch.float64))

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
        router = 2 * (hidden * E * element_bytes + 4 * E)          # Wr, bias in; dWr, dBias out
        tokens = 3 * T * hidden * element_bytes + 2 * 4 * T * k    # x, dY in, dX out; topk_ids, topk_weights in
        return float(weights + router + tokens)


# ---------------------------------------------------------------- the layer, differentiated

def routed_layer(inputs: dict, leaves: dict, layer, logits_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """out and the load-balancing loss of the layer on `leaves` (x, wr, bias, w1, w2), routed by the saved
    topk_ids: `layer` (moe.layer_reference, layer_loop or layer_grouped_mm) weighted by the softmax of the
    logits (computed in logits_dtype) at those ids."""
    ids, top_k = inputs["topk_ids"], inputs["top_k"]
    logits = moe.router_logits(leaves["x"], leaves["wr"], leaves["bias"], dtype=logits_dtype)
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
