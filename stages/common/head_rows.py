"""A [B, H, S, D] tensor with D contiguous (any strides: a model's [B, S, H, D] views) in a kernel's parameter
struct, as the kernels' HeadRows (attention.cuh) take it: its pointer, then its batch, head and row strides,
named after it (o, o_batch_stride, o_head_stride, o_row_stride); the heads are the struct's own field."""
from __future__ import annotations

import torch


def head_rows_fields(name: str, pointer_type: str) -> list[tuple[str, str]]:
    """The fields (name, C type) that hold tensor `name`: its pointer, its batch, head and row strides."""
    return [(name, pointer_type), (f"{name}_batch_stride", "long long"), (f"{name}_head_stride", "long long"),
            (f"{name}_row_stride", "int")]


def head_rows(name: str, x: torch.Tensor) -> dict:
    """x's values of head_rows_fields(name, ...)."""
    batch_stride, head_stride, row_stride = x.stride()[:3]
    return {name: x, f"{name}_batch_stride": batch_stride, f"{name}_head_stride": head_stride,
            f"{name}_row_stride": row_stride}
