"""The backward of attention: given dO, the gradient of a loss with respect to O, the gradients dQ, dK, dV.

Inputs as in the forward (reference/attention.py: Q [B, H, Sq, D], K and V [B, H_kv, Skv, D], scale 1/√D,
causal top-left aligned, query head h with KV head h // (H / H_kv)), with the forward's results, computed exactly and rounded, as a kernel gets them
from a forward pass: O [B, H, Sq, D] in the dtype, LSE [B, H, Sq] float32; and dO [B, H, Sq, D].
Outputs dQ, dK, dV, shaped and typed as Q, K, V. With P = softmax(scale · Q Kᵀ [masked]) (= exp(scale ·
Q Kᵀ − LSE)), per (batch, head):

    dV = Pᵀ dO          dP = dO Vᵀ          Δ_i = Σ_d dO_id O_id  (= Σ_j P_ij dP_ij)
    dS = P ∘ (dP − Δ)   dQ = scale · dS K   dK = scale · dSᵀ Q

and, with fewer KV heads than query heads (GQA), the dK and dV of a KV head are the sums of these over the
query heads of its group.

Work, FlashAttention's convention: five products per tile (Q Kᵀ recomputed, dV, dP, dQ, dK) for the
forward's two, 2.5 × the forward's flops. Fewest bytes: Q, K, V, O, dO and the LSE read once, dQ, dK
and dV written once (K, V, dK, dV: H_kv heads).
"""
from __future__ import annotations

import functools

import torch

from reference import attention, tolerance
from reference.attention import (AttentionProblem, causal_mask, expand_kv, kv_group, kv_heads, naive_attention,
                                 random_inputs, sdpa, sdpa_backends)
from reference.problem import FLOAT_POISON, Case, Problem

FORWARD = attention.PROBLEM
# The exact maths keeps about five S×S float64 matrices per (batch, head) pair alive: at most this many
# elements each (512 MiB) at a time, so that B·H = 70,000 pairs or 15 heads of 4096² fit a GPU.
CHUNK_ELEMENTS = 2**26


class AttentionBackwardProblem(Problem):
    name = "attention_backward"
    outputs = ("dq", "dk", "dv")
    primary_input = "q"
    parameters = {"D": (64, 128)}  # the head dimension, which kernels take as a compile-time constant
    forward = "attention"          # whose outputs o and lse are inputs here

    # ---- cases and shapes: the forward's ------------------------------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return FORWARD.cases(seed)

    def benchmarks(self) -> list[dict]:
        return FORWARD.benchmarks()

    shape_label = staticmethod(AttentionProblem.shape_label)

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        gen = torch.Generator(device=device).manual_seed(seed)
        forward_inputs = random_inputs(shape, dtype, gen, input_scale)  # the forward's q, k, v for this seed
        q = forward_inputs["q"]
        exact = by_head_chunks(FORWARD.reference, forward_inputs)
        do = torch.randn(q.shape, generator=gen, device=q.device).to(q.dtype)
        return dict(q=q, k=forward_inputs["k"], v=forward_inputs["v"], o=exact["o"].to(q.dtype),
                    lse=exact["lse"].to(torch.float32), do=do, scale=forward_inputs["scale"],
                    causal=forward_inputs["causal"])

    def allocate_outputs(self, inputs: dict) -> dict:
        return {f"d{n}": torch.full_like(inputs[n], FLOAT_POISON) for n in "qkv"}

    def parameter_values(self, inputs: dict) -> dict:
        return {"D": inputs["q"].shape[-1]}

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        stage.launch(kernels, inputs["q"], inputs["k"], inputs["v"], inputs["o"], inputs["lse"], inputs["do"],
                     outputs["dq"], outputs["dk"], outputs["dv"], inputs["scale"], inputs["causal"])

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        return by_head_chunks(exact_gradients, inputs)

    def library_output(self, inputs: dict) -> dict:
        """PyTorch's own backward (SDPA's, through autograd) in the inputs' dtype."""
        return autograd_gradients(inputs, sdpa)

    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]:
        return [tolerance.relative_to_library(n, outputs[n], exact[n], library[n]) for n in self.outputs]

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """The backward alone of each SDPA backend that runs these inputs here, and of naive PyTorch."""
        return {name: backward_run(inputs, attention) for name, attention in _libraries(inputs).items()}

    def forward_backward_baselines(self, inputs: dict) -> dict:
        """Forward and backward of each SDPA backend that runs these inputs here, and of naive PyTorch."""
        return {name: forward_backward_run(inputs, attention) for name, attention in _libraries(inputs).items()}

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        return 2.5 * AttentionProblem.flops(shape)

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        B, H, Sq, Skv, D = (shape[k] for k in ("B", "H", "Sq", "Skv", "D"))
        query_side = (3 * Sq * D * element_bytes + Sq * 4) + Sq * D * element_bytes  # read Q, O, dO, the LSE; write dQ
        kv_side = 2 * Skv * D * element_bytes + 2 * Skv * D * element_bytes          # read K, V; write dK, dV
        return B * H * query_side + B * kv_heads(shape) * kv_side


def exact_gradients(inputs: dict) -> dict:
    """dQ, dK, dV in float64, as the module docstring writes them, from scores recomputed exactly (the
    inputs' O and LSE are rounded: a kernel's, not the truth)."""
    q, k, v, do = (inputs[n].to(torch.float64) for n in ("q", "k", "v", "do"))
    scale = inputs["scale"]
    scores = scale * (q @ k.transpose(-1, -2))
    if inputs["causal"]:
        scores = scores.masked_fill(causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    delta = (do * (p @ v)).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O) with the exact O = P V
    ds = p * (dp - delta)
    return dict(dq=scale * (ds @ k), dk=scale * (ds.transpose(-1, -2) @ q), dv=dv)


def by_head_chunks(compute, inputs: dict) -> dict:
    """compute(inputs) on a few (batch, head) pairs at a time (each pair a [1, 1, S, ...] slice's worth,
    CHUNK_ELEMENTS of S×S at most), its results joined back into [B, H, ...]. With fewer KV heads than
    query heads, K and V are first repeated to H heads, and results on their side (dk, dv) summed back
    over each group of query heads to [B, H_kv, ...]."""
    group = kv_group(inputs["q"], inputs["k"])
    inputs = expand_kv(inputs)
    B, H, seq_q = inputs["q"].shape[:3]
    pairs_per_chunk = max(1, CHUNK_ELEMENTS // (seq_q * inputs["k"].shape[2]))
    # [B, H, ...] -> [B·H, 1, ...]: the pairs as a batch of single heads, which compute sees as [b, h, S, ...]
    flat = {n: x.flatten(0, 1).unsqueeze(1) if isinstance(x, torch.Tensor) else x for n, x in inputs.items()}
    chunks = [compute({n: x[start:start + pairs_per_chunk] if isinstance(x, torch.Tensor) else x
                       for n, x in flat.items()}) for start in range(0, B * H, pairs_per_chunk)]
    joined = {n: torch.cat([c[n] for c in chunks]).reshape(B, H, *chunks[0][n].shape[2:]) for n in chunks[0]}
    for n in set(joined) & {"dk", "dv"} if group > 1 else ():  # [B, H, ...] -> [B, H_kv, group, ...], summed over the group
        joined[n] = joined[n].unflatten(1, (H // group, group)).sum(dim=2)
    return joined


def _libraries(inputs: dict) -> dict:
    """Name -> attention(inputs) for each SDPA backend whose forward and backward run these inputs on this
    device, and naive PyTorch."""
    found = {}
    q, k = inputs["q"], inputs["k"]
    for name, backend in sdpa_backends().items():
        if name == "math" and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] > 2**31:
            continue  # the math backend's fp32 S×S copies would not fit
        attention = functools.partial(sdpa, backend=backend)
        try:
            forward_backward_run(inputs, attention)()
        except torch.cuda.OutOfMemoryError:
            pass  # supported, but too big here: the worker's first call finds out again and skips it
        except RuntimeError:  # this backend does not support these inputs or this device
            continue
        found[name] = attention
    return found | {"naive": naive_attention}


def autograd_gradients(inputs: dict, attention) -> dict:
    """dq, dk, dv of attention(inputs) for the inputs' dO, through autograd."""
    leaves = _leaves(inputs)
    grads = torch.autograd.grad(attention({**inputs, **leaves}), tuple(leaves.values()), inputs["do"])
    return dict(zip(("dq", "dk", "dv"), grads))


def _leaves(inputs: dict) -> dict:
    """Copies of q, k, v that autograd differentiates with respect to (the inputs themselves stay as they are)."""
    return {n: inputs[n].detach().clone().requires_grad_() for n in "qkv"}


def forward_backward_run(inputs: dict, attention):
    """A callable: attention's forward with autograd, then the gradients of q, k, v for dO."""
    leaves = _leaves(inputs)

    def run():
        torch.autograd.grad(attention({**inputs, **leaves}), tuple(leaves.values()), inputs["do"])
    return run


def backward_run(inputs: dict, attention):
    """A callable: the gradients of q, k, v for dO through attention's forward graph, which the first call
    builds and keeps (built then, not here, so that the worker's first call, in a try, meets its OOM)."""
    leaves, graph = _leaves(inputs), []

    def run():
        if not graph:
            graph.append(attention({**inputs, **leaves}))
        torch.autograd.grad(graph[0], tuple(leaves.values()), inputs["do"], retain_graph=True)
    return run


PROBLEM = AttentionBackwardProblem()
