"""What the backward stages (8 and 9) share on the host: the workspace of attention_backward.cuh's
preprocess and dQ conversion, and their launches around each stage's main kernel.

    workspace = backward_workspace(q, block_m)         the LSE in log2 units and Δ per query row, padded to
    preprocess(kernels, launched, o, d_o, lse, ws)     whole query tiles of block_m; dQ zeroed in fp32
    ... the stage's main kernel: dK, dV, and dQ summed into ws.dq_accum ...
    convert_dq(kernels, launched, ws, dq, scale)       dQ = scale · the fp32 sum, in dq's dtype

O, dO and dQ may have any strides with D contiguous (`head_strides`); the workspace is dense.
`launched` is the stage's geometry at this head dimension (ROWS_PER_PREPROCESS_BLOCK, PREPROCESS_THREADS,
CONVERT_THREADS)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def blocks(n: int, per_block: int) -> int:
    return -(-n // per_block)


def head_strides(x: torch.Tensor) -> tuple:
    """(x, batch stride, head stride, row stride) of a [B, H, S, D] tensor with D contiguous: how the
    kernels' HeadRows (attention.cuh) take it."""
    return (x, *x.stride()[:3])


@dataclass
class Workspace:
    seq_q_padded: int        # query rows per head, a whole number of tiles
    lse_log2: torch.Tensor   # fp32 [B, H, seq_q_padded]
    delta: torch.Tensor      # fp32 [B, H, seq_q_padded]: Δ = rowsum(dO ∘ O)
    dq_accum: torch.Tensor   # fp32 [B, H, seq_q_padded, D]: whole tiles, added to without a row test


def backward_workspace(q: torch.Tensor, block_m: int) -> Workspace:
    batch, heads, seq_q, head_dim = q.shape
    seq_q_padded = blocks(seq_q, block_m) * block_m
    lse_log2 = torch.empty(batch, heads, seq_q_padded, dtype=torch.float32, device=q.device)
    return Workspace(seq_q_padded, lse_log2, torch.empty_like(lse_log2),
                     torch.empty(lse_log2.shape + (head_dim,), dtype=torch.float32, device=q.device))


def preprocess(kernels, launched: dict, o, d_o, lse, ws: Workspace) -> None:
    """ws's LSE·log2(e) and Δ for every query row (the padding rows too), and dQ's sum zeroed."""
    batch, heads, seq_q, _ = o.shape
    rows = batch * heads * ws.seq_q_padded
    kernels.attention_bwd_preprocess((blocks(rows, launched["ROWS_PER_PREPROCESS_BLOCK"]),),
                                     (launched["PREPROCESS_THREADS"],), *head_strides(o), *head_strides(d_o), heads,
                                     lse, ws.lse_log2, ws.delta, ws.dq_accum, seq_q, ws.seq_q_padded, batch * heads)


def convert_dq(kernels, launched: dict, ws: Workspace, dq, scale: float) -> None:
    """dq = scale · ws.dq_accum's first seq_q rows of each head, rounded to dq's dtype: a thread per 8
    elements of the accumulator."""
    groups = ws.dq_accum.numel() // 8
    kernels.attention_bwd_dq((blocks(groups, launched["CONVERT_THREADS"]),), (launched["CONVERT_THREADS"],),
                             ws.dq_accum, *head_strides(dq), dq.shape[1], scale, groups, dq.shape[2], ws.seq_q_padded)
