"""What the Hopper stages' launches share: TMA descriptors (tensor maps) built by cuda.core, and the
number of SMs a persistent grid fills."""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

_MAPS: dict = {}  # (address, shape, strides, dtype, box) -> (TensorMapDescriptor, what it keeps alive)
_SMS: dict = {}   # device index -> number of SMs


def tensor_map(x: torch.Tensor, box: tuple[int, int, int]):
    """A TMA descriptor over the 3-D, 16-bit tensor x: boxes of box[0] × box[1] × box[2] elements
    (outermost first, as x's dimensions), the innermost 64 wide at most, with the 128-byte swizzle.
    Elements outside x read as zeros. Encoding costs host time, so descriptors are cached.

    cuda.core refuses a box longer than the tensor: a dimension shorter than the box is padded with
    zeros first, into a copy that the cache keeps with its descriptor (attention's short sequences;
    never for a buffer a kernel writes). The copy is refreshed from x on every call: x may have
    changed in place since (a KV cache, a buffer a CUDA graph refills), and the kernel must read it now."""
    from cuda.core.utils import StridedMemoryView

    key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, tuple(box))
    if key in _MAPS:
        descriptor, kept = _MAPS[key]
        if kept:  # (x, its padded copy)
            kept[1][tuple(slice(0, n) for n in x.shape)].copy_(x)
        return descriptor
    short = [max(0, b - n) for b, n in zip(box, x.shape)]
    source = F.pad(x, [p for s in reversed(short) for p in (0, s)]) if any(short) else x
    tm = importlib.import_module("cuda.core._tensor_map")
    data_type = tm.TensorMapDataType.BFLOAT16 if x.dtype == torch.bfloat16 else tm.TensorMapDataType.FLOAT16
    # Through DLPack as int16 (NumPy, which cuda.core maps dtypes through, has no bfloat16); the
    # element type the tensor map records is given explicitly.
    view = StridedMemoryView.from_any_interface(source.view(torch.int16), stream_ptr=-1)
    descriptor = view.as_tensor_map(box_dim=tuple(box), data_type=data_type, swizzle=tm.TensorMapSwizzle.SWIZZLE_128B)
    if len(_MAPS) >= 16:  # a few launches' worth
        _MAPS.clear()
    # A descriptor holds an address, shapes and strides, nothing of the contents: any tensor with
    # the same ones may use it. Except a padded copy's: that entry keeps x and the copy alive, so
    # that no other tensor gets x's address while it is cached.
    _MAPS[key] = (descriptor, (x, source) if source is not x else ())
    return descriptor


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
