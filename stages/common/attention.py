"""What the launches of the attention stages share: B·H beyond the limits of a grid.

A kernel that walks the (batch, head) pairs in grid.y or grid.z sees at most 65,535 of them in one
launch (grid.x goes up to 2^31 - 1, grid.y and grid.z only to 65,535), and a decode-sized batch
(280 sequences × 250 heads) has more. The launch then covers them in slices: the tensors, seen as
[B·H, ...], are cut into runs of at most 65,535 pairs, and each run is one launch whose pointers start
at its first pair. The kernels stay as they are.
"""
MAX_GRID_YZ = 65535


def by_head_dim(geometry: dict[int, dict[str, int]]):
    """Stage.geometry for a table of the kernel's constants per head dimension (the -DHEAD_DIM it is
    compiled with): {64: {"BLOCK_M": 64, ...}, 128: {...}}."""
    return lambda defines: geometry[int(defines["HEAD_DIM"])]


def head_slices(*tensors, pairs_per_launch: int = MAX_GRID_YZ):
    """For tensors of shape [B, H, ...]: lists of [n, ...] views, one list per launch, of the same
    n ≤ pairs_per_launch (batch, head) pairs of each tensor."""
    flat = [t.flatten(0, 1) for t in tensors]  # contiguous [B, H, ...]: a view, no copy
    for first in range(0, flat[0].shape[0], pairs_per_launch):
        yield [t[first:first + pairs_per_launch] for t in flat]
