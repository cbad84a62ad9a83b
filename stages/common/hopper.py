"""What the Hopper stages' launches share: TMA descriptors (tensor maps), and the number of SMs a
persistent grid fills."""
from __future__ import annotations

import ctypes

import torch

from stages.common.launcher import TMA_MAP_BYTES

_MAPS: dict = {}  # (shape, strides, dtype, box) -> _Descriptor
_SMS: dict = {}   # device index -> number of SMs
MAX_CACHED_MAPS = 256  # layouts, not tensors: a model has a few per layer shape
MAX_ADDRESSES = 64     # per layout: a model's layers' activations of that layout


class _Descriptor:
    """A CUtensorMap encoded once for a layout, and its bytes for each address it has been pointed at (a
    model's activations come back at the same few addresses from PyTorch's caching allocator, step
    after step, so most calls find theirs)."""

    def __init__(self, x: torch.Tensor, box: tuple):
        from cuda.bindings import driver

        self.map = _encode(driver, x, box)
        self.by_address: dict[int, bytes] = {}

    def at(self, address: int) -> bytes:
        """The descriptor's 128 bytes, pointed at `address` (same layout, another tensor): the driver
        rewrites the address field in place, far cheaper than encoding anew."""
        found = self.by_address.get(address)
        if found is None:
            from cuda.bindings import driver

            _check(driver.cuTensorMapReplaceAddress(self.map, address)[0], "cuTensorMapReplaceAddress")
            if len(self.by_address) >= MAX_ADDRESSES:
                self.by_address.clear()
            found = self.by_address[address] = ctypes.string_at(self.map.getPtr(), TMA_MAP_BYTES)
        return found


def tensor_map(x: torch.Tensor, box: tuple[int, ...]) -> bytes:
    """A TMA descriptor over the 16-bit tensor x, of up to 5 dimensions with any strides but a contiguous
    innermost one (16-byte aligned start and strides): boxes of `box` elements (outermost first, as x's
    dimensions; the innermost 64 wide at most), with the 128-byte swizzle. Elements outside x read as
    zeros, a box longer than x too. As the 128 bytes a kernel's `const __grid_constant__ TmaMap` takes.

    Encoding a descriptor costs tens of microseconds, so one is encoded per layout (shape, strides,
    dtype, box) and re-pointed at each call's tensor: nothing of the contents is in it."""
    key = (x.shape, x.stride(), x.dtype, box)
    descriptor = _MAPS.get(key)
    if descriptor is None:
        if len(_MAPS) >= MAX_CACHED_MAPS:
            _MAPS.clear()
        descriptor = _MAPS[key] = _Descriptor(x, box)
    return descriptor.at(x.data_ptr())


def _encode(driver, x: torch.Tensor, box: tuple):
    """cuTensorMapEncodeTiled over x: dimensions and box innermost first, strides in bytes of the outer ones."""
    if x.stride(-1) != 1 or x.element_size() != 2:
        raise ValueError(f"a tensor map needs 16-bit elements and a contiguous last dimension; got {x.dtype}, "
                         f"strides {x.stride()}")
    types = driver.CUtensorMapDataType
    data_type = types.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 if x.dtype == torch.bfloat16 else \
        types.CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    rank, u64, u32 = x.dim(), driver.cuuint64_t, driver.cuuint32_t
    # A dimension of one element may have any stride in PyTorch; TMA wants 16-byte multiples: its dense one.
    dense = torch.empty(0).new_empty(x.shape, device="meta").stride()
    strides = [stride if size > 1 else fill for size, stride, fill in zip(x.shape, x.stride(), dense)]
    err, descriptor = driver.cuTensorMapEncodeTiled(
        data_type, rank, x.data_ptr(), [u64(n) for n in reversed(x.shape)],
        [u64(s * 2) for s in reversed(strides[:-1])], [u32(n) for n in reversed(box)], [u32(1)] * rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    _check(err, f"cuTensorMapEncodeTiled (shape {list(x.shape)}, strides {list(x.stride())}, box {list(box)})")
    return descriptor


def _check(err, what: str) -> None:
    from cuda.bindings import driver

    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {err.name}")


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
