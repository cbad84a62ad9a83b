"""The whole MoE layer: router, routing, expert GEMMs and combine, from x to out (stage 7).

Inputs: x [T, hidden], the router Wr [hidden, E], W1 [E, hidden, 2·I] (gate half, then up half),
W2 [E, I, hidden] (float16 or bfloat16), bias [E] fp32 (the routing bias, added to the logits), top_k.

Outputs (all written by the stage's kernels):
  topk_ids [T, k] int32     each token's experts, by decreasing logit (logits = x·Wr + bias in fp32)
  out [T, hidden] elem_t    out[t] = Σ_j w[t, j] · SwiGLU_{ids[t, j]}(x[t]), w = the softmax of the
                            chosen logits (the top-k's probabilities renormalized to sum 1)

Checks: the stage computes its logits in fp32 in its own summation order, so they differ from the
exact ones by rounding and a near-tie may go either way: topk_ids passes if each token's ids are
distinct, in range, and a top-k of the exact (float64) logits up to TIE_TOL·(1 + |logit|), in
decreasing order up to the same slack (check_topk). out is judged by the library-relative rule
through the kernel's own routing: the exact layer (float64) and PyTorch's loop over the experts
(matmuls and SwiGLU in the dtype, the weighted sum in fp32), both routed by the kernel's ids with
weights from the exact logits at those ids.

Work: the experts' flops, as moe_experts (the router's 2·hidden·E per token left out, as everyone
does). min_bytes: every expert's weights (all get tokens at the benchmarks), the router, x in, out
and topk_ids out.
"""
from __future__ import annotations

import torch

from reference import moe, moe_experts, tolerance
from reference.problem import FLOAT_POISON, INT_POISON, Case, Problem

# fp32 logits of unit size, summed over hidden <= 7168 terms in any order: at most ~4e-6 from the exact
# ones even summed one term at a time (measured), relative to 1 + |logit|.
TIE_TOL = 1e-5


class MoeLayerProblem(Problem):
    name = "moe_layer"
    primary_input = "x"
    outputs = ("topk_ids", "out")

    # ---- cases and shapes: those of moe_experts ----------------------------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return moe_experts.cases(seed)

    def benchmarks(self) -> list[dict]:
        return moe_experts.benchmarks()

    shape_label = staticmethod(moe_experts.shape_label)

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        layer = moe_experts.make_layer(shape, dtype, seed, input_scale, device)
        return dict(layer, top_k=shape["top_k"], shape=dict(shape, dtype=dtype, seed=seed))

    def allocate_outputs(self, inputs: dict) -> dict:
        x, k = inputs["x"], inputs["top_k"]
        return dict(out=torch.full_like(x, FLOAT_POISON),
                    topk_ids=torch.full((x.shape[0], k), INT_POISON, dtype=torch.int32, device=x.device))

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        i = inputs
        stage.launch(kernels, i["x"], i["wr"], i["bias"], i["w1"], i["w2"], i["top_k"], outputs["out"],
                     outputs["topk_ids"])

    def forward_for_backward(self, stage, kernels, inputs: dict, outputs: dict) -> dict:
        """run_stage with save=True: the outputs, and what the stage saved for the backward under the names
        of moe_layer_backward.Saved's fields, the backward's inputs (topk_ids, an output, is one of them)."""
        i = inputs
        saved = stage.launch(kernels, i["x"], i["wr"], i["bias"], i["w1"], i["w2"], i["top_k"], outputs["out"],
                             outputs["topk_ids"], save=True)
        return {**outputs, **saved._asdict()}

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        """The exact logits, and the layer itself: out is evaluated through the kernel's routing."""
        layer = {n: inputs[n] for n in ("x", "wr", "bias", "w1", "w2")}
        return dict(logits=moe.router_logits(layer["x"], layer["wr"], layer["bias"], dtype=torch.float64),
                    layer=layer)

    def library_output(self, inputs: dict) -> dict:
        """Nothing ahead of time: the library result follows the kernel's routing (a near-tie may
        go either way), so `check` computes it from the kernel's topk_ids."""
        return {}

    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]:
        logits, layer = exact["logits"], exact["layer"]
        ids = outputs["topk_ids"]
        # Routed by the kernel's ids (clamped into range if invalid: check_topk has failed then anyway).
        routed = ids.long().clamp(0, logits.shape[1] - 1)
        weights = torch.softmax(logits.gather(1, routed), dim=-1)
        k = ids.shape[1]
        exact_out = moe.layer_reference(layer, k, ids=routed, weights=weights)
        library_out = moe.layer_loop(layer, k, ids=routed, weights=weights.float())
        return [check_topk(ids, logits), tolerance.relative_to_library("out", outputs["out"], exact_out, library_out)]

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """The layer in PyTorch: with torch._grouped_mm ("grouped_mm", where it runs: PyTorch >= 2.8,
        bf16 on the GPU), and with a loop over the experts as Hugging Face's Mixtral ("naive")."""
        layer, k = {n: inputs[n] for n in ("x", "wr", "bias", "w1", "w2")}, inputs["top_k"]
        found = moe.grouped_mm_baseline(lambda: moe.layer_grouped_mm(layer, k))
        found["naive"] = lambda: moe.layer_loop(layer, k)
        return found

    @staticmethod
    def notes(shape: dict, ms: float, baseline_ms: dict) -> list[str]:
        tokens = shape["tokens"]

        def rate(t):  # millions of tokens per second
            return f"{tokens / t / 1e3:.2f} M tokens/s"

        theirs = [f"{n} {rate(t)}, {t / ms:.2f}× faster" if t >= ms else f"{n} {rate(t)}, {ms / t:.2f}× slower"
                  for n, t in baseline_ms.items() if t]
        return [f"{tokens} tokens: {rate(ms)}" + (f" ({'; '.join(theirs)})" if theirs else "")]

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        return moe.layer_flops(shape["tokens"], shape["hidden"], shape["inter"], shape["top_k"])

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        T, E, k, hidden, inter = (shape[n] for n in ("tokens", "experts", "top_k", "hidden", "inter"))
        weights = (E * 3 * hidden * inter + hidden * E) * element_bytes + 4 * E  # W1, W2, Wr, bias
        tokens = 2 * T * hidden * element_bytes + 4 * T * k                      # x in, out and topk_ids out
        return float(weights + tokens)


# ---------------------------------------------------------------- the routing check

def check_topk(ids: torch.Tensor, logits: torch.Tensor) -> tolerance.OutputCheck:
    """Each token's ids must be distinct, in range, each chosen expert's exact logit at least the
    k-th largest minus TIE_TOL·(1 + |k-th|), and each at least the next one minus TIE_TOL·(1 + |next|):
    a top-k of the exact logits, in decreasing order, but for near-ties fp32 rounding may flip."""
    (T, k), E = ids.shape, logits.shape[1]
    i = ids.long()
    chosen = logits.gather(1, i.clamp(0, E - 1))
    kth = logits.topk(k, dim=1).values[:, -1:]
    faults = {
        "out of range": ~((i >= 0) & (i < E)).all(1),
        "repeated": ~(i.sort(1).values.diff(dim=1) != 0).all(1),
        "not a top-k": ~(chosen >= kth - TIE_TOL * (1 + kth.abs())).all(1),
        "out of order": ~(chosen[:, :-1] >= chosen[:, 1:] - TIE_TOL * (1 + chosen[:, 1:].abs())).all(1),
    }
    wrong = int(torch.stack(list(faults.values())).any(0).sum())
    if wrong:
        why = ", ".join(f"{int(f.sum())} {name}" for name, f in faults.items() if f.any())
        return tolerance.rule("topk_ids", wrong, T, f"{wrong} tokens wrong: {why}")
    flipped = int((i != moe.topk_exact(logits, k)[0]).any(1).sum())
    return tolerance.rule("topk_ids", 0, T, f"exact but {flipped} near-ties resolved otherwise" if flipped else "exact")


PROBLEM = MoeLayerProblem()
