"""Stage 13 — block-sparse attention backward on Hopper: stage 9's backward over a FlexAttention block mask

sm_90a only. Stage 9's kernel (a block per 128 keys of a KV pair keeps dK and dV in registers while a TMA
producer warpgroup feeds it query tiles and two wgmma consumer warpgroups run the five products; dQ summed
in fp32 by bulk reduce-adds, then converted), walking, for key block n, only the query blocks whose lists
name n: the transposed BlockMask (FlexAttention's full_q_indices, then q_indices), full blocks first. The
element mask (causal, documents, sliding window) is applied in registers in partial blocks only; a row
that sees no key (LSE = -inf) gets P = 0. Stage 8's preprocess (Δ, the LSE in log2 units) and dQ
conversion, unchanged (stages/common/attention_backward.*).

The transposed lists are computed here with a few torch ops on the device, per launch (fine for now: a
few small kernels over [Qb, KVb] integers beside the backward's work; a kernel of its own, or lists the
forward hands over, can replace them).
"""
import torch

from reference.block_sparse_attention import BLOCK
from stages import Goal, Stage
from stages.common.attention import MAX_GRID_YZ, by_head_dim, kv_group
from stages.common.attention_backward import (DqParams, PreprocessParams, backward_workspace, blocks, convert_dq,
                                              preprocess)
from stages.common.head_rows import head_rows, head_rows_fields
from stages.common.hopper import tensor_map
from stages.common.launcher import param_struct
from stages.stage9_hopper_backward import GEOMETRY as HOPPER_BACKWARD_GEOMETRY

# What the launch uses, per head dimension, as attention.cu computes it (checked against the kernel):
# stage 9's geometry (its tiles and shared-memory layout are this kernel's: wgmma_attention_backward.cuh),
# and the mask's block, to which the workspace is padded.
GEOMETRY = {head_dim: {"BLOCK": BLOCK, **geometry} for head_dim, geometry in HOPPER_BACKWARD_GEOMETRY.items()}
assert all(g["BLOCK"] == g["BLOCK_N"] == BLOCK for g in GEOMETRY.values())  # a key tile = a block of the mask

# block_sparse_attention_bwd's parameters besides its tensor maps, as attention.cu's BlockSparseBackwardParams
# holds them (the grader checks the layout against it).
BlockSparseBackwardParams = param_struct("BlockSparseBackwardParams", [
    ("lse_log2", "const float*"), ("delta", "const float*"), ("dq_accum", "float*"),
    *head_rows_fields("dk", "elem_t*"), *head_rows_fields("dv", "elem_t*"), ("kv_heads", "int"), ("seq", "int"),
    ("seq_q_padded", "int"), ("scale", "float"), ("group", "int"), ("kv_pair0", "int"), ("q_num", "const int*"),
    ("q_indices", "const int*"), ("full_q_num", "const int*"), ("full_q_indices", "const int*"), ("q_blocks", "int"),
    ("window", "int"), ("document_ids", "const int*")])

KERNELS = {  # the preprocess and the dQ conversion: attention_backward.cuh's, as stage 9 launches them
    "attention_bwd_preprocess": "const PreprocessParams",
    "block_sparse_attention_bwd": "const TmaMap, const TmaMap, const TmaMap, const TmaMap, "
                                  "const BlockSparseBackwardParams",
    "attention_bwd_dq": "const DqParams",
}


def listed_blocks(num_blocks, indices):
    """[Qb, KVb] bool: whether query block m's list (num_blocks [1, 1, Qb], indices [1, 1, Qb, KVb], the
    mask shared by every batch and head, as stage 12 reads it) names key block n."""
    num_blocks, indices = num_blocks[0, 0], indices[0, 0]
    q_blocks, kv_blocks = indices.shape
    named = torch.arange(kv_blocks, device=indices.device) < num_blocks[:, None]  # the list's first num entries
    listed = torch.zeros(q_blocks, kv_blocks + 1, dtype=torch.int32, device=indices.device)
    listed.scatter_(1, torch.where(named, indices.long(), kv_blocks), 1)  # unnamed entries into a spare column
    return listed[:, :kv_blocks].bool()


def transposed_lists(num_blocks, indices):
    """FlexAttention's transposed lists (BlockMask's q_num_blocks, q_indices): for key block n, how many
    query blocks name it, and which, in increasing order ([KVb] and [KVb, Qb] int32)."""
    names = listed_blocks(num_blocks, indices).T.contiguous()  # [KVb, Qb]
    count = names.sum(dim=1, dtype=torch.int32)
    order = torch.argsort(names.to(torch.int8), dim=1, descending=True, stable=True)  # naming blocks first
    return count.contiguous(), order.to(torch.int32).contiguous()


def launch(kernels, q, k, v, o, lse, d_o, dq, dk, dv, kv_num_blocks, kv_indices, full_kv_num_blocks,
           full_kv_indices, document_ids, scale, window) -> None:
    batch, _, seq, head_dim = q.shape
    group = kv_group(q, k)  # query heads per KV head
    launched = GEOMETRY[head_dim]
    # Workspace padded to whole blocks of the mask (every query tile of a listed block lies inside it).
    ws = backward_workspace(q, launched["BLOCK"])
    preprocess(kernels, launched, o, d_o, lse, ws)
    q_num, q_indices = transposed_lists(kv_num_blocks, kv_indices)
    full_q_num, full_q_indices = transposed_lists(full_kv_num_blocks, full_kv_indices)
    q_map, do_map, k_map, v_map = (tensor_map(x, (1, 1, launched["TILE_BOX_ROWS"], launched["ATOM_COLS"]))
                                   for x in (q, d_o, k, v))
    kv_heads = k.shape[1]
    kv_pairs = batch * kv_heads
    for kv_pair0 in range(0, kv_pairs, MAX_GRID_YZ):
        params = BlockSparseBackwardParams(
            lse_log2=ws.lse_log2, delta=ws.delta, dq_accum=ws.dq_accum, **head_rows("dk", dk), **head_rows("dv", dv),
            kv_heads=kv_heads, seq=seq, seq_q_padded=ws.seq_q_padded, scale=scale, group=group, kv_pair0=kv_pair0,
            q_num=q_num, q_indices=q_indices, full_q_num=full_q_num, full_q_indices=full_q_indices,
            q_blocks=q_indices.shape[1], window=window, document_ids=document_ids)
        kernels.block_sparse_attention_bwd(
            (blocks(seq, launched["BLOCK_N"]), min(MAX_GRID_YZ, kv_pairs - kv_pair0)), (launched["NUM_THREADS"],),
            q_map, k_map, v_map, do_map, params, smem=launched["SHARED_BYTES"])
    convert_dq(kernels, launched, ws, dq, scale)


STAGE = Stage(
    name="stage13_block_sparse_backward",
    problem="block_sparse_attention_backward",
    source="attention.cu",
    kernels=KERNELS,
    param_structs=(PreprocessParams, BlockSparseBackwardParams, DqParams),
    launch=launch,
    archs=("sm_90a",),
    # the head dimension and the element mask (none, causal, document, sliding_window), compiled in
    specializations={"HEAD_DIM": "D", "ELEMENT_MASK": "element_mask"},
    geometry=by_head_dim(GEOMETRY),
    goal=Goal("flex_attention", 1.3),  # 1.3 × the speed of compiled FlexAttention's backward
)
