"""Stage 9 — Hopper attention backward: wgmma, TMA and warp specialization

sm_90a only. Stage 8's backward (a block per 128 keys keeps dK and dV while it walks the query tiles,
recomputing P; five products per tile) in the FlashAttention-3 style: a producer warpgroup copies K
and V once, then each query tile's Q, dO, LSE and Δ, with TMA into a 2-slot mbarrier ring; two
consumer warpgroups (64 keys each) run the five products with wgmma, Pᵀ and dSᵀ from registers; dQ
summed over key tiles in fp32, each tile added from shared memory by one bulk reduce-add that a thread of
the producer warpgroup issues. Stage 8's preprocess and dQ conversion, unchanged.

Grouped-query attention in the kernel: a block owns 128 keys of one KV head and walks the query tiles of
every query head of its group, dK and dV summed in its registers.

Q, K, V, O, dO and dQ, dK, dV may have any strides with D contiguous (a model's [B, S, H, D] views): the
tensor maps and the kernels' row addresses carry them, so nothing is copied.
"""
from stages import Goal, Stage
from stages.common.attention import by_head_dim, kv_group
from stages.common.attention_backward import (DqParams, PreprocessParams, backward_workspace, blocks, convert_dq,
                                              preprocess)
from stages.common.head_rows import head_rows, head_rows_fields
from stages.common.hopper import sm_count, tensor_map
from stages.common.launcher import param_struct
from stages.common.prompts import SHORT_PROMPTS

# What the launch uses, per head dimension, as wgmma_attention_backward.cuh computes it (the grader checks each value
# against the kernel): keys per block (2 consumer warpgroups × 64), query rows per tile, threads (a
# producer warpgroup + 2 consumers), the width of a TMA box (64 16-bit elements, the 128-byte
# swizzle's) and its rows (tma.cuh's load_tile), dynamic shared memory (K, V, 2 buffers of Q and dO, 2
# of dSᵀ, the fp32 dQ buffers (2 of 64 queries at D = 128, 1 of 128 at D = 64), 2 of the LSE and Δ, the
# mbarriers, 1 KB to align the tiles to 1024 bytes: at D = 128 all but 952 bytes of the 227 KB an H100
# block may have); the preprocess's rows per block and threads, the
# dQ conversion's threads (stages/common/attention_backward.cuh).
GEOMETRY = {64: {"BLOCK_N": 128, "BLOCK_M": 128, "NUM_THREADS": 384, "ATOM_COLS": 64, "TILE_BOX_ROWS": 64,
                 "SHARED_BYTES": 199736,
                 "ROWS_PER_PREPROCESS_BLOCK": 32, "PREPROCESS_THREADS": 256, "CONVERT_THREADS": 256},
            128: {"BLOCK_N": 128, "BLOCK_M": 64, "NUM_THREADS": 384, "ATOM_COLS": 64, "TILE_BOX_ROWS": 64,
                  "SHARED_BYTES": 231496,
                  "ROWS_PER_PREPROCESS_BLOCK": 16, "PREPROCESS_THREADS": 256, "CONVERT_THREADS": 256}}

# attention_bwd's parameters besides its tensor maps, as attention.cu's BackwardParams holds them (the grader
# checks the layout against it).
BackwardParams = param_struct("BackwardParams", [
    ("lse_log2", "const float*"), ("delta", "const float*"), ("dq_accum", "float*"),
    *head_rows_fields("dk", "elem_t*"), *head_rows_fields("dv", "elem_t*"), ("kv_heads", "int"), ("seq_q", "int"),
    ("seq_kv", "int"), ("seq_q_padded", "int"), ("scale", "float"), ("causal", "int"), ("group", "int"),
    ("kv_pairs", "int"), ("chunk_pairs", "int")])

KERNELS = {
    "attention_bwd_preprocess": "const PreprocessParams",
    "attention_bwd": "const TmaMap, const TmaMap, const TmaMap, const TmaMap, const BackwardParams",
    "attention_bwd_dq": "const DqParams",
}



def _tensor_map(x, box_rows: int, box_cols: int):
    """A TMA descriptor over x [B, H, S, D] (K and V: [B, H_kv, S, D]), any strides with D contiguous: boxes
    of 1 × 1 × box_rows × box_cols with the 128-byte swizzle; rows past S read as zeros (stage 4's)."""
    return tensor_map(x, (1, 1, box_rows, box_cols))


def launch(kernels, q, k, v, o, lse, d_o, dq, dk, dv, scale, causal) -> None:
    batch, _, seq_q, head_dim = q.shape
    seq_kv, group = k.shape[2], kv_group(q, k)  # query heads per KV head
    launched = GEOMETRY[head_dim]
    block_m, block_n, box_cols = launched["BLOCK_M"], launched["BLOCK_N"], launched["ATOM_COLS"]
    # Workspace, as stage 8's (the producer copies a tile's LSE and Δ whole: padded to whole tiles).
    ws = backward_workspace(q, block_m)
    preprocess(kernels, launched, o, d_o, lse, ws)
    # TMA boxes of 64 rows (tma.cuh's load_tile copies a tile as several)
    q_map, do_map, k_map, v_map = (_tensor_map(x, launched["TILE_BOX_ROWS"], box_cols) for x in (q, d_o, k, v))
    # A block per (128 keys, KV pair), walking the group's query heads, in one grid.x; the kernel starts them
    # in chunks of KV pairs, key tile by key tile (attention.cu's key_tile_and_pair): enough pairs a chunk
    # that its blocks fill the SMs.
    kv_heads, key_tiles = k.shape[1], blocks(seq_kv, block_n)
    kv_pairs = batch * kv_heads
    chunk_pairs = min(kv_pairs, blocks(sm_count(q.device), key_tiles))
    params = BackwardParams(lse_log2=ws.lse_log2, delta=ws.delta, dq_accum=ws.dq_accum, **head_rows("dk", dk),
                            **head_rows("dv", dv), kv_heads=kv_heads, seq_q=seq_q, seq_kv=seq_kv,
                            seq_q_padded=ws.seq_q_padded, scale=scale, causal=int(causal), group=group,
                            kv_pairs=kv_pairs, chunk_pairs=chunk_pairs)
    kernels.attention_bwd((key_tiles * kv_pairs,), (launched["NUM_THREADS"],), q_map, k_map, v_map, do_map, params,
                          smem=launched["SHARED_BYTES"])
    convert_dq(kernels, launched, ws, dq, scale)


STAGE = Stage(
    name="stage9_hopper_backward",
    problem="attention_backward",
    source="attention.cu",
    kernels=KERNELS,
    param_structs=(PreprocessParams, BackwardParams, DqParams),
    launch=launch,
    archs=("sm_90a",),
    specializations={"HEAD_DIM": "D"},
    geometry=by_head_dim(GEOMETRY),
    goal=Goal("cudnn", 0.9),
    extra_benchmarks=tuple(dict(B=8, H=16, Sq=4096, Skv=4096, D=128, causal=causal, dtype="float16")
                           for causal in (False, True)) + SHORT_PROMPTS,
)
