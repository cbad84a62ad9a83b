"""Stage 8 — attention backward: FlashAttention-2's backward on tensor cores

dQ, dK and dV from Q, K, V, O, the LSE and dO, never storing P: one block per tile of 128 keys keeps
its dK and dV in registers while it walks the query tiles, recomputing P from Q, K and the LSE; five
mma.sync products per tile, fed by stage 3's cp.async ring; dQ summed over key tiles with fp32 atomics.
Without a causal mask, the last wave's key tiles are split evenly over the SMs (the tail, attention.cu).

Grouped-query attention (K, V with H_kv < H heads), for now in the launch, not the kernel: K and V are
repeated to H heads, the kernel runs as for H_kv = H, and each KV head's dK and dV are the fp32 sums of its
group's, rounded once more. (The kernel's own way, a block per key tile of one KV head walking its group's
query heads with dK, dV in registers, spilled at D = 128 in every variant tried so far.)

The preprocess and the dQ conversion take O, dO and dQ of any strides; the main kernels read Q, K, V, dO
and write dK, dV dense [B, H, S, D], so the launch makes dense copies of others (a model's [B, S, H, D]
views): stage 9, on Hopper, reads and writes them where they lie.
"""
import torch

from stages import Goal, Stage
from stages.common.attention import by_head_dim, head_slices, kv_group
from stages.common.attention_backward import (DqParams, PreprocessParams, backward_workspace, blocks, convert_dq,
                                              preprocess)
from stages.common.hopper import sm_count  # cached per device; nothing Hopper-specific
from stages.common.launcher import param_struct

# What the launch uses, per head dimension, as attention.cu computes it (the grader checks each value
# against the kernel): 8 warps × 16 keys per block, query tiles of 64 rows; dynamic shared memory, the
# K and V tiles, 2 buffers of Q and dO, the dSᵀ tile, 2 buffers of the LSE and Δ; rows of the query-side
# vectors per preprocess block; the threads of the preprocess and of the dQ conversion. At D = 128 a block
# takes 145 KB of shared memory: an A100's or an H100's SM holds it, an sm_86/sm_89 GPU's (99 KB) does not.
GEOMETRY = {64: {"BLOCK_N": 128, "BLOCK_M": 64, "NUM_THREADS": 256, "SHARED_BYTES": 82944,
                 "ROWS_PER_PREPROCESS_BLOCK": 32, "PREPROCESS_THREADS": 256, "CONVERT_THREADS": 256},
            128: {"BLOCK_N": 128, "BLOCK_M": 64, "NUM_THREADS": 256, "SHARED_BYTES": 148480,
                  "ROWS_PER_PREPROCESS_BLOCK": 16, "PREPROCESS_THREADS": 256, "CONVERT_THREADS": 256}}

# The parameters of attention_bwd and attention_bwd_tail, as attention.cu's BackwardParams holds them (the grader
# checks the layout against it): one struct a (batch, head) slice, for both.
BackwardParams = param_struct("BackwardParams", [
    ("q", "const elem_t*"), ("k", "const elem_t*"), ("v", "const elem_t*"), ("d_o", "const elem_t*"),
    ("lse_log2", "const float*"), ("delta", "const float*"), ("dq_accum", "float*"), ("dk", "elem_t*"),
    ("dv", "elem_t*"), ("dkv_tail", "float*"), ("seq_q", "int"), ("seq_kv", "int"), ("seq_q_padded", "int"),
    ("scale", "float"), ("causal", "int"), ("full_tiles", "int"), ("tail_tiles", "int")])

KERNELS = {
    "attention_bwd_preprocess": "const PreprocessParams",
    "attention_bwd": "const BackwardParams",
    "attention_bwd_tail": "const BackwardParams",
    "attention_bwd_dkv_tail": "const float*, elem_t*, elem_t*, int, int, int",
    "attention_bwd_dq": "const DqParams",
}


def split_tiles(tiles: int, sms: int, causal: bool) -> tuple[int, int]:
    """(full_tiles, tail_blocks): attention_bwd takes whole key tiles, one block per SM, for whole waves but
    the last; attention_bwd_tail's tail_blocks (a wave) share the rest. Only without a causal mask (attention.cu,
    "The tail"), and only when the tiles do not fill their last wave."""
    waves, rest = divmod(tiles, sms)
    if causal or rest == 0:
        return tiles, 0
    return max(waves - 1, 0) * sms, sms


def launch(kernels, q, k, v, o, lse, d_o, dq, dk, dv, scale, causal) -> None:
    q, k, v, d_o = (x.contiguous() for x in (q, k, v, d_o))
    if not (dk.is_contiguous() and dv.is_contiguous()):  # the main kernels write dense rows
        dense_dk, dense_dv = torch.empty_like(k), torch.empty_like(v)
        launch(kernels, q, k, v, o, lse, d_o, dq, dense_dk, dense_dv, scale, causal)
        dk.copy_(dense_dk)
        dv.copy_(dense_dv)
        return
    group = kv_group(q, k)  # query heads per KV head
    if group > 1:  # GQA: the kernel on K, V repeated to H heads, dK and dV summed over each group
        dk_heads, dv_heads = (torch.empty(q.shape[:2] + k.shape[2:], dtype=k.dtype, device=k.device) for _ in "kv")
        launch(kernels, q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), o, lse, d_o, dq,
               dk_heads, dv_heads, scale, causal)
        for summed, per_head in ((dk, dk_heads), (dv, dv_heads)):
            summed.copy_(per_head.unflatten(1, (k.shape[1], group)).sum(dim=2, dtype=torch.float32))
        return
    seq_q, seq_kv = q.shape[2], k.shape[2]
    launched = GEOMETRY[q.shape[-1]]
    ws = backward_workspace(q, launched["BLOCK_M"])
    preprocess(kernels, launched, o, d_o, lse, ws)
    key_tiles = blocks(seq_kv, launched["BLOCK_N"])
    sms = sm_count(q.device)
    for q_, k_, v_, do_, lse_, delta_, dqa_, dk_, dv_ in head_slices(q, k, v, d_o, ws.lse_log2, ws.delta, ws.dq_accum,
                                                                     dk, dv):
        tiles = q_.shape[0] * key_tiles
        full_tiles, tail_blocks = split_tiles(tiles, sms, causal)
        # dK's and dV's fp32 sums for the tail's key tiles, then rounded
        dkv_tail = torch.zeros(2, tiles - full_tiles, launched["BLOCK_N"], q.shape[-1], dtype=torch.float32,
                               device=q.device) if tail_blocks else None
        params = BackwardParams(q=q_, k=k_, v=v_, d_o=do_, lse_log2=lse_, delta=delta_, dq_accum=dqa_, dk=dk_, dv=dv_,
                                dkv_tail=dkv_tail, seq_q=seq_q, seq_kv=seq_kv, seq_q_padded=ws.seq_q_padded,
                                scale=scale, causal=int(causal), full_tiles=full_tiles, tail_tiles=tiles - full_tiles)
        if full_tiles:
            kernels.attention_bwd((key_tiles, blocks(full_tiles, key_tiles)), (launched["NUM_THREADS"],), params,
                                  smem=launched["SHARED_BYTES"])
        if tail_blocks:
            kernels.attention_bwd_tail((tail_blocks,), (launched["NUM_THREADS"],), params,
                                       smem=launched["SHARED_BYTES"])
            groups = dkv_tail[0].numel() // 8
            kernels.attention_bwd_dkv_tail((blocks(2 * groups, launched["CONVERT_THREADS"]),),
                                           (launched["CONVERT_THREADS"],), dkv_tail, dk_, dv_, groups, full_tiles,
                                           seq_kv)
    convert_dq(kernels, launched, ws, dq, scale)


STAGE = Stage(
    name="stage8_backward",
    problem="attention_backward",
    source="attention.cu",
    kernels=KERNELS,
    param_structs=(PreprocessParams, BackwardParams, DqParams),
    launch=launch,
    specializations={"HEAD_DIM": "D"},
    geometry=by_head_dim(GEOMETRY),
    goal=Goal("cudnn", 0.8),
    extra_benchmarks=tuple(dict(B=8, H=16, Sq=4096, Skv=4096, D=128, causal=causal, dtype="float16")
                           for causal in (False, True)),
)
