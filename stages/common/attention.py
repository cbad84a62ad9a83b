"""What the launches of the attention stages share: B·H beyond the limits of a grid, K, V with fewer
heads than Q (grouped-query attention), and the Hopper forward's parameter struct (stage 4 and its rungs).

A kernel that walks the (batch, head) pairs in grid.y or grid.z sees at most 65,535 of them in one
launch (grid.x goes up to 2^31 - 1, grid.y and grid.z only to 65,535), and a decode-sized batch
(280 sequences × 250 heads) has more. The launch then covers them in slices: the tensors, seen as
[B·H, ...], are cut into runs of at most 65,535 pairs, and each run is one launch whose pointers start
at its first pair. The kernels stay as they are.

With GQA, Q is [B, H, ...] and K, V are [B, H_kv, ...], H a multiple of H_kv: query head h uses KV head
h / group, group = H / H_kv, so query pair p = b·H + h uses KV pair b·H_kv + h / group = p / group. A slice
of query pairs [first, first + n), first and n multiples of the group, uses KV pairs [first / group,
(first + n) / group): the launch passes both views and the kernel takes KV pair (p - first) / group.
"""
from stages.common.head_rows import head_rows, head_rows_fields
from stages.common.launcher import param_struct

MAX_GRID_YZ = 65535

# The parameters of stage 4's attention_fwd and of its ladder's rungs besides Q, K and V, as
# wgmma_attention.cuh's ForwardParams holds them (the grader checks the layout against it).
ForwardParams = param_struct("ForwardParams", [
    *head_rows_fields("o", "elem_t*"), ("heads", "int"), ("lse", "float*"), ("seq_q", "int"), ("seq_kv", "int"),
    ("scale", "float"), ("causal", "int"), ("group", "int"), ("batch_heads", "int"), ("persistent", "int")])


def by_head_dim(geometry: dict[int, dict[str, int]]):
    """Stage.geometry for a table of the kernel's constants per head dimension (the -DHEAD_DIM it is
    compiled with): {64: {"BLOCK_M": 64, ...}, 128: {...}}."""
    return lambda defines: geometry[int(defines["HEAD_DIM"])]


def forward_params(q, k, o, lse, scale, causal, persistent: int) -> ForwardParams:
    """The ForwardParams of a launch on q [B, H, S_q, D] and k [B, H_kv, S_kv, D], writing o (any [B, H, S_q, D]
    view with D contiguous) and lse [B, H, S_q]; `persistent`: stage 4's schedule (0 for the rungs)."""
    batch, heads, seq_q, _ = q.shape
    return ForwardParams(**head_rows("o", o), heads=heads, lse=lse, seq_q=seq_q, seq_kv=k.shape[2], scale=scale,
                         causal=int(causal), group=kv_group(q, k), batch_heads=batch * heads, persistent=persistent)


def kv_group(q, k) -> int:
    """Query heads per KV head, H / H_kv, of q [B, H, ...] and k [B, H_kv, ...]; ValueError unless H_kv divides H."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads are no multiple of {kv_heads} KV heads")
    return heads // kv_heads


def head_slices(*tensors, kv=(), group: int = 1, pairs_per_launch: int = MAX_GRID_YZ):
    """For tensors of shape [B, H, ...] and kv tensors of shape [B, H / group, ...]: lists of views, one list
    per launch, of the same n (batch, head) pairs of each tensor, then of the n / group KV pairs those use
    of each kv tensor. n is at most pairs_per_launch rounded down to a multiple of the group, so that no
    launch cuts a group of query heads."""
    step = pairs_per_launch - pairs_per_launch % group
    if step < 1:
        raise ValueError(f"groups of {group} query heads do not fit {pairs_per_launch} pairs a launch")
    flat = [t.flatten(0, 1) for t in tensors]  # contiguous [B, H, ...]: a view, no copy
    flat_kv = [t.flatten(0, 1) for t in kv]
    for first in range(0, flat[0].shape[0], step):
        yield ([t[first:first + step] for t in flat] +
               [t[first // group:(first + step) // group] for t in flat_kv])
