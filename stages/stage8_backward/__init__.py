"""Stage 8 — attention backward: FlashAttention-2's backward on tensor cores

dQ, dK and dV from Q, K, V, O, the LSE and dO, never storing P: one block per tile of 128 keys keeps
its dK and dV in registers while it walks the query tiles, recomputing P from Q, K and the LSE; five
mma.sync products per tile, fed by stage 3's cp.async ring; dQ summed over key tiles with fp32 atomics.

Grouped-query attention (K, V with H_kv < H heads), for now in the launch, not the kernel: K and V are
repeated to H heads, the kernel runs as for H_kv = H, and each KV head's dK and dV are the fp32 sums of its
group's, rounded once more. (The kernel's own way, a block per key tile of one KV head walking its group's
query heads with dK, dV in registers, spilled at D = 128 in every variant tried so far.)
"""
import torch

from stages import Goal, Stage
from stages.common.attention import by_head_dim, head_slices, kv_group
from stages.common.attention_backward import backward_workspace, blocks, convert_dq, preprocess

# What the launch uses, per head dimension, as attention.cu computes it (the grader checks each value
# against the kernel): 8 warps × 16 keys per block, query tiles of 64 rows; dynamic shared memory, the
# K and V tiles, 2 buffers of Q and dO, the dSᵀ tile, 2 buffers of the LSE and Δ; rows of the query-side
# vectors per preprocess block; the threads of the preprocess and of the dQ conversion. At D = 128 a block
# takes 145 KB of shared memory: an A100's or an H100's SM holds it, an sm_86/sm_89 GPU's (99 KB) does not.
GEOMETRY = {64: {"BLOCK_N": 128, "BLOCK_M": 64, "NUM_THREADS": 256, "SHARED_BYTES": 82944,
                 "ROWS_PER_PREPROCESS_BLOCK": 32, "PREPROCESS_THREADS": 256, "CONVERT_THREADS": 256},
            128: {"BLOCK_N": 128, "BLOCK_M": 64, "NUM_THREADS": 256, "SHARED_BYTES": 148480,
                  "ROWS_PER_PREPROCESS_BLOCK": 16, "PREPROCESS_THREADS": 256, "CONVERT_THREADS": 256}}

KERNELS = {
    "attention_bwd_preprocess": "const elem_t*, const elem_t*, const float*, float*, float*, float*, int, int, int",
    "attention_bwd": "const elem_t*, const elem_t*, const elem_t*, const elem_t*, const float*, const float*, float*, "
                     "elem_t*, elem_t*, int, int, int, float, int",
    "attention_bwd_dq": "const float*, elem_t*, float, int, int, int",
}



def launch(kernels, q, k, v, o, lse, d_o, dq, dk, dv, scale, causal) -> None:
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
    for q_, k_, v_, do_, lse_, delta_, dqa_, dk_, dv_ in head_slices(q, k, v, d_o, ws.lse_log2, ws.delta, ws.dq_accum,
                                                                     dk, dv):
        kernels.attention_bwd((blocks(seq_kv, launched["BLOCK_N"]), q_.shape[0]), (launched["NUM_THREADS"],),
                              q_, k_, v_, do_, lse_, delta_, dqa_, dk_, dv_, seq_q, seq_kv, ws.seq_q_padded, scale,
                              int(causal), smem=launched["SHARED_BYTES"])
    convert_dq(kernels, launched, ws, dq, scale)


STAGE = Stage(
    name="stage8_backward",
    problem="attention_backward",
    source="attention.cu",
    kernels=KERNELS,
    launch=launch,
    specializations={"HEAD_DIM": "D"},
    geometry=by_head_dim(GEOMETRY),
    goal=Goal("cudnn", 0.8),
    extra_benchmarks=tuple(dict(B=8, H=16, Sq=4096, Skv=4096, D=128, causal=causal, dtype="float16")
                           for causal in (False, True)),
)
