"""ops.decode_attention: a decode step's attention over a paged KV cache the caller keeps (stages.OPS_STAGES:
stage 15), and its custom op flashmoe::decode_attention. Inference only: no gradient."""
from __future__ import annotations

import math

import torch

import reference
from stages.ops import dense, shared

DECODE = reference.load("decode_attention")  # the problem the op solves: its dtypes, head dims, run_stage


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(scale · q kᵀ) v of each sequence's Sq new tokens over its whole cache: reference/decode_attention.py's
    problem. q [B, H, Sq, D] (any strides: copied to contiguous where it is not); k_cache and v_cache
    [num_pages, page_size, H_kv, D] contiguous, H_kv dividing H; block_table [B, max_pages] int32, the pages of
    sequence b in order; seq_lens [B] int32, each sequence's length with its Sq new tokens (new token i of
    sequence b sees keys 0 .. seq_lens[b] - Sq + i). float16 or bfloat16, D 64 or 128, on one CUDA GPU; the
    output is contiguous [B, H, Sq, D]. It reads no value back to the host, so a step can be captured in a
    CUDA graph: the keys are split for the longest sequence the table can hold (max_pages · page_size), and
    a split past a sequence's end costs a block that writes nothing of weight."""
    q = q if q.is_contiguous() else q.contiguous()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not shared.plain_eager(q, k_cache, v_cache, block_table, seq_lens):
        return decode_attention_op(q, k_cache, v_cache, block_table, seq_lens, scale)
    shared.refuse("ops.decode_attention", decode_input_problem(q, k_cache, v_cache, block_table, seq_lens))
    return decode_launch(q, k_cache, v_cache, block_table, seq_lens, scale)


def decode_launch(q, k_cache, v_cache, block_table, seq_lens, scale: float) -> torch.Tensor:
    """O by the decode stage, for inputs already checked."""
    o, lse = torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)  # the kernel writes o as q lies
    inputs = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens, scale=scale,
                  max_len=block_table.shape[1] * k_cache.shape[1])
    shared.launch_fastest(DECODE, inputs, dict(o=o, lse=lse))
    return o


@torch.library.custom_op("flashmoe::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """O of ops.decode_attention, for q contiguous."""
    shared.refuse("flashmoe::decode_attention", decode_input_problem(q, k_cache, v_cache, block_table, seq_lens))
    return decode_launch(q, k_cache, v_cache, block_table, seq_lens, scale)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, scale):
    return torch.empty_like(q)


def decode_input_problem(q, k_cache, v_cache, block_table, seq_lens) -> str | None:
    """What is wrong with the inputs for the decode kernel, in words; None if nothing."""
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens)
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return "q, k_cache, v_cache, block_table and seq_lens must be tensors"
    if q.dim() != 4 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or block_table.dim() != 2 or \
            seq_lens.dim() != 1 or k_cache.shape[3] != q.shape[3] or not \
            q.shape[0] == block_table.shape[0] == seq_lens.shape[0]:
        return ("expected q [B, H, Sq, D], k_cache and v_cache [num_pages, page_size, H_kv, D], block_table "
                f"[B, max_pages], seq_lens [B]; got {dense.shapes_of(tensors)}")
    if 0 in q.shape or 0 in k_cache.shape or 0 in block_table.shape:
        return f"every dimension must be at least 1; got {dense.shapes_of(tensors)}"
    if q.shape[1] % k_cache.shape[2]:
        return f"the KV heads H_kv must divide the query heads H (grouped-query attention); got {dense.shapes_of(tensors)}"
    if q.dtype not in dense.DTYPES or not q.dtype == k_cache.dtype == v_cache.dtype:
        return (f"q, k_cache and v_cache must all be {' or all '.join(dense.DTYPES.values())}; got {q.dtype}, "
                f"{k_cache.dtype}, {v_cache.dtype}")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        return f"block_table and seq_lens must be int32; got {block_table.dtype}, {seq_lens.dtype}"
    if q.shape[-1] not in DECODE.parameters["D"]:
        return f"the head dimension D must be one of {DECODE.parameters['D']}; got {q.shape[-1]}"
    return shared.layout_problem(tensors) or shared.device_problem(tensors)
