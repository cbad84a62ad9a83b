"""The backward of block-sparse attention: given dO, the gradients dQ, dK, dV over the visible pairs.

Inputs as in the forward (reference/block_sparse_attention.py: Q [B, H, S, D], K and V [B, H_kv, S, D], the
block mask's four lists, the element mask, scale 1/√D), with the forward's results, computed exactly and
rounded, as a kernel gets them from a forward pass: O [B, H, S, D] in the dtype, LSE [B, H, S] float32
(-inf on rows that see no key); and dO [B, H, S, D]. Outputs dQ, dK, dV, shaped and typed as Q, K, V: the
formulas of reference/attention_backward.py with P zero on every pair the masks hide, and, with fewer KV
heads than query heads (GQA), the dK and dV of a KV head summed over the query heads of its group.

A row that sees no key has P = 0 on every key, as FlexAttention's backward has it (its math backward,
torch/_higher_order_ops/flex_attention.py, sdpa_dense_backward: where the logsumexp is -inf, the softmax
scores are set to 0): its dQ is 0 and it adds nothing to dK and dV.

The exact reference walks the forward's block lists (block_sparse_attention.visible_keys), one query block
at a time, in float64: never S×S, whatever S. Cases and benchmark shapes are the forward's.

Work, FlashAttention's convention: five products per visible tile (Q Kᵀ recomputed, dV, dP, dQ, dK) for
the forward's two, 2.5 × the forward's flops. Fewest bytes: Q, O, dO and the LSE read for the rows that see
a key, K and V for the key blocks some list holds, the mask as the forward reads it; dQ, dK and dV written
for every row (zeros where nothing reaches them).
"""
from __future__ import annotations

import torch

from reference import block_sparse_attention as forward_module
from reference import tolerance
from reference.attention import kv_heads
from reference.attention_backward import (AttentionBackwardProblem, autograd_gradients, backward_run,
                                         forward_backward_run)
from reference.block_sparse_attention import (LAYOUT, BlockSparseAttentionProblem, block_weights,
                                              blockwise_attention, dense_visible, drawn_inputs, kv_grouped,
                                              library_attentions, library_sdpa, listed_traffic, visible_keys)
from reference.problem import Case, Problem

FORWARD = forward_module.PROBLEM


class BlockSparseAttentionBackwardProblem(Problem):
    name = "block_sparse_attention_backward"
    outputs = ("dq", "dk", "dv")
    primary_input = "q"
    parameters = BlockSparseAttentionProblem.parameters
    forward = "block_sparse_attention"  # whose outputs o and lse are inputs here

    # ---- cases and shapes: the forward's ------------------------------------------------------
    def cases(self, seed: int = 0) -> list[Case]:
        return FORWARD.cases(seed)

    def benchmarks(self) -> list[dict]:
        return FORWARD.benchmarks()

    shape_label = staticmethod(BlockSparseAttentionProblem.shape_label)

    # ---- inputs and outputs -------------------------------------------------------------------
    def make_inputs(self, shape: dict, dtype: str, seed: int, input_scale: float = 1.0, device="cuda") -> dict:
        gen = torch.Generator(device=device).manual_seed(seed)
        inputs = drawn_inputs(shape, dtype, gen, input_scale)  # the forward's inputs for this seed
        q = inputs["q"]
        exact = FORWARD.reference(inputs)
        do = torch.randn(q.shape, generator=gen, device=q.device).to(q.dtype)
        return dict(inputs, o=exact["o"].to(q.dtype), lse=exact["lse"].to(torch.float32), do=do)

    allocate_outputs = AttentionBackwardProblem.allocate_outputs  # dQ, dK, dV, as dense attention's backward

    def parameter_values(self, inputs: dict) -> dict:
        return FORWARD.parameter_values(inputs)

    def run_stage(self, stage, kernels, inputs: dict, outputs: dict) -> None:
        stage.launch(kernels, inputs["q"], inputs["k"], inputs["v"], inputs["o"], inputs["lse"], inputs["do"],
                     outputs["dq"], outputs["dk"], outputs["dv"], *(inputs[n] for n in LAYOUT),
                     inputs["document_ids"], inputs["scale"], inputs["window"])

    # ---- the exact result and the check ------------------------------------------------------
    def reference(self, inputs: dict) -> dict:
        return exact_gradients(inputs)

    def library_output(self, inputs: dict) -> dict:
        """PyTorch's own backward through autograd, in the inputs' dtype: of SDPA with the dense boolean mask
        up to SDPA_MAX_TOKENS (forward_module.library_sdpa), else of the block-by-block forward: its sums in
        the dtype make a looser yardstick (about 3× SDPA's errors in fp16 on the 1,100-token graph case)."""
        if inputs["q"].shape[2] <= forward_module.SDPA_MAX_TOKENS:
            visible = dense_visible(inputs)
            return autograd_gradients(inputs, lambda tensors: library_sdpa(tensors, visible))
        return autograd_gradients(inputs, lambda tensors: blockwise_attention(tensors, inputs["q"].dtype)["o"])

    def check(self, outputs: dict, exact: dict, library: dict) -> list[tolerance.OutputCheck]:
        return [tolerance.relative_to_library(n, outputs[n], exact[n], library[n]) for n in self.outputs]

    # ---- baselines timed beside the kernel -------------------------------------------------------
    def baselines(self, inputs: dict) -> dict:
        """The backward alone of compiled FlexAttention with the same BlockMask, and of SDPA with the dense
        boolean mask up to SDPA_MAX_TOKENS; on a GPU only."""
        return {name: backward_run(inputs, attention) for name, attention in library_attentions(inputs).items()}

    def forward_backward_baselines(self, inputs: dict) -> dict:
        """Forward and backward of the same libraries."""
        return {name: forward_backward_run(inputs, attention)
                for name, attention in library_attentions(inputs).items()}

    # ---- work -----------------------------------------------------------------------------
    @staticmethod
    def flops(shape: dict) -> float:
        return 2.5 * BlockSparseAttentionProblem.flops(shape)

    @staticmethod
    def min_bytes(shape: dict, element_bytes: int = 2) -> float:
        query_tokens, key_tokens, mask = listed_traffic(shape)
        B, H, S, D = (shape[n] for n in "BHSD")
        query_side = B * H * (query_tokens * (3 * D * element_bytes + 4) + S * D * element_bytes)  # Q, O, dO, LSE; dQ
        key_side = B * kv_heads(shape) * 2 * (key_tokens + S) * D * element_bytes                  # K, V; dK, dV
        return query_side + key_side + mask


def exact_gradients(inputs: dict) -> dict:
    """dQ, dK, dV in float64, one query block at a time over the keys its lists name, from scores recomputed
    exactly (the inputs' O and LSE are rounded: a kernel's, not the truth)."""
    t = kv_grouped(inputs, ("q", "k", "v", "do"), torch.float64)  # query side [B, H_kv, group, S, D]
    scale = inputs["scale"]
    dq, dk, dv = (torch.zeros_like(t[n]) for n in "qkv")
    for start, end, cols, visible in visible_keys(inputs):
        q_rows, do_rows, k_cols, v_cols = (t["q"][..., start:end, :], t["do"][..., start:end, :],
                                           t["k"][..., cols, :], t["v"][..., cols, :])
        p, _ = block_weights(q_rows, k_cols, visible, scale)  # all 0 on a row that sees no key
        delta = (do_rows * (p @ v_cols)).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O) with the exact O = P V
        ds = p * (do_rows @ v_cols.transpose(-1, -2) - delta)
        dq[..., start:end, :] = scale * (ds @ k_cols)
        # a KV head's keys take the sum over its group of query heads
        dk.index_add_(-2, cols, scale * (ds.transpose(-1, -2) @ q_rows).sum(dim=2, keepdim=True))
        dv.index_add_(-2, cols, (p.transpose(-1, -2) @ do_rows).sum(dim=2, keepdim=True))
    return dict(dq=dq.flatten(1, 2), dk=dk.squeeze(2), dv=dv.squeeze(2))


PROBLEM = BlockSparseAttentionBackwardProblem()
