"""What the backward stages (8 and 9) share on the host: the workspace of attention_backward.cuh's
preprocess and dQ conversion, and their launches around each stage's main kernel.

    workspace = backward_workspace(q, block_m)         the LSE in log2 units and Δ per query row, padded to
    preprocess(kernels, launched, o, d_o, lse, ws)     whole query tiles of block_m; dQ zeroed in fp32
    ... the stage's main kernel: dK, dV, and dQ summed into ws.dq_accum ...
    convert_dq(kernels, launched, ws, dq, scale)       dQ = scale · the fp32 sum, in dq's dtype

O, dO and dQ may have any strides with D contiguous (`head_rows`); the workspace is dense.
`launched` is the stage's geometry at this head dimension (ROWS_PER_PREPROCESS_BLOCK, PREPROCESS_THREADS,
CONVERT_THREADS). The two kernels take their parameters as one struct each, described here
(PreprocessParams, DqParams: a stage that launches them lists both in its param_structs)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.common.head_rows import head_rows, head_rows_fields
from stages.common.launcher import param_struct


def blocks(n: int, per_block: int) -> int:
    return -(-n // per_block)


PreprocessParams = param_struct("PreprocessParams", [
    *head_rows_fields("o", "const elem_t*"), *head_rows_fields("d_o", "const elem_t*"), ("heads", "int"),
    ("lse", "const float*"), ("lse_log2", "float*"), ("delta", "float*"), ("dq_accum", "float*"),
    ("seq_q", "int"), ("seq_q_padded", "int"), ("pairs", "int")])

DqParams = param_struct("DqParams", [
    ("dq_accum", "const float*"), *head_rows_fields("dq", "elem_t*"), ("heads", "int"), ("scale", "float"),
    ("groups", "int"), ("seq_q", "int"), ("seq_q_padded", "int")])


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
    params = PreprocessParams(**head_rows("o", o), **head_rows("d_o", d_o), heads=heads, lse=lse,
                              lse_log2=ws.lse_log2, delta=ws.delta, dq_accum=ws.dq_accum, seq_q=seq_q,
                              seq_q_padded=ws.seq_q_padded, pairs=batch * heads)
    kernels.attention_bwd_preprocess((blocks(rows, launched["ROWS_PER_PREPROCESS_BLOCK"]),),
                                     (launched["PREPROCESS_THREADS"],), params)


def convert_dq(kernels, launched: dict, ws: Workspace, dq, scale: float) -> None:
    """dq = scale · ws.dq_accum's first seq_q rows of each head, rounded to dq's dtype: a thread per 8
    elements of the accumulator."""
    groups = ws.dq_accum.numel() // 8
    params = DqParams(dq_accum=ws.dq_accum, **head_rows("dq", dq), heads=dq.shape[1], scale=scale, groups=groups,
                      seq_q=dq.shape[2], seq_q_padded=ws.seq_q_padded)
    kernels.attention_bwd_dq((blocks(groups, launched["CONVERT_THREADS"]),), (launched["CONVERT_THREADS"],), params)
