"""A [B, H, S, D] tensor with D contiguous (any strides: a model's [B, S, H, D] views) in a kernel's parameter
struct, as the kernels' HeadRows (attention.cuh) take it: its pointer, then its batch, head and row strides,
named after it (o, o_batch_stride, o_head_stride, o_row_stride); the heads are the struct's own field."""
from __future__ import annotations

import functools

import torch


@functools.cache
def field_names(name: str) -> tuple[str, str, str, str]:
    """The names of tensor `name`'s fields: (name, name_batch_stride, name_head_stride, name_row_stride)."""
    return name, f"{name}_batch_stride", f"{name}_head_stride", f"{name}_row_stride"


def head_rows_fields(name: str, pointer_type: str) -> list[tuple[str, str]]:
    """The fields (name, C type) that hold tensor `name`: its pointer, its batch, head and row strides."""
    return list(zip(field_names(name), (pointer_type, "long long", "long long", "int")))


def head_rows(name: str, x: torch.Tensor) -> dict:
    """x's values of head_rows_fields(name, ...), for a launch (its names made once: this runs every launch)."""
    pointer, batch_stride, head_stride, row_stride = field_names(name)
    strides = x.stride()
    return {pointer: x, batch_stride: strides[0], head_stride: strides[1], row_stride: strides[2]}
