"""Stage 12 — block-sparse attention on Hopper: stage 4's pipeline over a FlexAttention block mask

sm_90a only. Stage 4's producer and consumer warpgroups, walking each query block's lists of key blocks
(FlexAttention's BlockMask at 128 tokens) instead of every key: the producer copies the listed K/V tiles
with TMA, the consumers apply the element mask (causal, documents, sliding window) in partial blocks only,
and rows that see no key write O = 0 and LSE = -inf. A persistent grid takes the query blocks longest
lists first.
"""
import torch

from reference.block_sparse_attention import BLOCK
from stages import Goal, Stage
from stages.common.attention import by_head_dim, kv_group
from stages.common.head_rows import head_rows, head_rows_fields
from stages.common.hopper import sm_count, tensor_map
from stages.common.launcher import param_struct

# What the launch uses, per head dimension, as attention.cu computes it (checked against the kernel):
# 128-row query tiles (2 consumer warpgroups × 64) and 128-key K/V tiles (the mask's block), 384
# threads, TMA boxes of 64 rows × 64 columns (tma.cuh's load_tile), and dynamic shared memory: the Q tile,
# the K and V rings (3 slots at D = 64, 2 at D = 128), the mbarriers and 1 KB of alignment.
GEOMETRY = {64: {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_THREADS": 384, "ATOM_COLS": 64, "TILE_BOX_ROWS": 64,
                 "SHARED_BYTES": 115824},
            128: {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_THREADS": 384, "ATOM_COLS": 64, "TILE_BOX_ROWS": 64,
                  "SHARED_BYTES": 164944}}
assert all(g["BLOCK_M"] == g["BLOCK_N"] == BLOCK for g in GEOMETRY.values())  # one tile = one block of the mask

# block_sparse_attention_fwd's parameters besides its tensor maps, as attention.cu's BlockSparseParams holds them
# (the grader checks the layout against it).
BlockSparseParams = param_struct("BlockSparseParams", [
    *head_rows_fields("o", "elem_t*"), ("heads", "int"), ("lse", "float*"), ("seq", "int"), ("scale", "float"),
    ("batch_heads", "int"), ("group", "int"), ("kv_num", "const int*"), ("kv_indices", "const int*"),
    ("full_num", "const int*"), ("full_indices", "const int*"), ("kv_blocks", "int"), ("order", "const int*"),
    ("num_q_blocks", "int"), ("window", "int"), ("document_ids", "const int*")])


def launch(kernels, q, k, v, o, lse, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, document_ids,
           scale, window):
    batch, heads, seq, head_dim = q.shape
    group = kv_group(q, k)  # query head h reads KV head h / group
    launched = GEOMETRY[head_dim]
    q_map, k_map, v_map = (tensor_map(x, (1, 1, launched["TILE_BOX_ROWS"], launched["ATOM_COLS"])) for x in (q, k, v))
    q_blocks, kv_blocks = kv_indices.shape[-2], kv_indices.shape[-1]
    # The query blocks, longest lists first (a stable sort: ties in block order).
    order = torch.argsort(kv_num_blocks[0, 0] + full_kv_num_blocks[0, 0], descending=True, stable=True).int()
    units = q_blocks * batch * heads
    grid = min(units, sm_count(q.device))
    params = BlockSparseParams(**head_rows("o", o), heads=heads, lse=lse, seq=seq, scale=scale,
                               batch_heads=batch * heads, group=group, kv_num=kv_num_blocks, kv_indices=kv_indices,
                               full_num=full_kv_num_blocks, full_indices=full_kv_indices, kv_blocks=kv_blocks,
                               order=order, num_q_blocks=q_blocks, window=window, document_ids=document_ids)
    kernels.block_sparse_attention_fwd((grid,), (launched["NUM_THREADS"],), q_map, k_map, v_map, params,
                                       smem=launched["SHARED_BYTES"])


STAGE = Stage(
    name="stage12_block_sparse",
    problem="block_sparse_attention",
    source="attention.cu",
    kernels={"block_sparse_attention_fwd": "const TmaMap, const TmaMap, const TmaMap, const BlockSparseParams"},
    launch=launch,
    param_structs=(BlockSparseParams,),
    archs=("sm_90a",),
    # the head dimension and the element mask (none, causal, document, sliding_window), compiled in
    specializations={"HEAD_DIM": "D", "ELEMENT_MASK": "element_mask"},
    geometry=by_head_dim(GEOMETRY),
    goal=Goal("flex_attention", 1.5),  # 1.5 × compiled FlexAttention's speed
)
