"""Launch NVRTC-compiled kernels on PyTorch tensors: in the grader's worker process, and in the
course's PyTorch ops (stages/ops/). One path serves both, so the grader times what a model runs.

A stage's launch function receives a `KernelSet` and calls its kernels by name:

    kernels.attention_fwd(grid, block, q, k, v, o, lse, seq_q, seq_kv, scale, causal, smem=49152)

Each argument is passed as the C signature the stage declares says (the grader checks those against
the kernels at compile time): a tensor as its device pointer, a Python int as an `int` or a `long
long`, a float as a `float`, a TmaMap as its 128 bytes (stages/common/hopper.py's tensor_map), a
parameter struct (param_struct) as the C struct it describes; a wrong number of arguments is an error
before the launch. Launches go to PyTorch's current stream, so CUDA events recorded by PyTorch time them,
and CUDA graphs capture them.

The host cost of a launch is what a model pays on every call, and a small kernel's GPU time is a few
microseconds, so a launch does only what changed: each kernel keeps one packed parameter buffer (a
slot of 8 bytes per scalar or pointer, 128 per tensor map, a parameter struct's size rounded up to 8) and
the array of pointers into it that cuLaunchKernel takes; a call writes the arguments into the buffer with one struct.pack_into and makes
one driver call, through ctypes (cuda.bindings' wrapper builds a Python object per argument, each
call). Geometry checks and the LaunchRecord run once per (grid, block, shared memory). A KernelSet
launches from one thread at a time (its buffers are reused).
"""
from __future__ import annotations

import ctypes
import struct
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

STATIC_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
GRID_LIMITS = (2**31 - 1, 65535, 65535)  # blocks along x, y, z (the limits of every sm_80+ GPU)
MAX_THREADS_PER_BLOCK = 1024
TMA_MAP_BYTES = 128  # a CUtensorMap


class LaunchGeometryError(ValueError):
    """A launch the driver would refuse with a bare INVALID_VALUE, said in one line before it is made."""


def check_geometry(name: str, grid: tuple, block: tuple) -> None:
    for axis, (blocks, limit) in enumerate(zip(grid, GRID_LIMITS)):
        if not 1 <= blocks <= limit:
            raise LaunchGeometryError(f"{name}: grid.{'xyz'[axis]} = {blocks} blocks, outside the GPU's 1..{limit:,} "
                                      f"(grid {grid}): the stage's launch does not handle this shape")
    threads = int(np.prod(block))
    if not 1 <= threads <= MAX_THREADS_PER_BLOCK:
        raise LaunchGeometryError(f"{name}: {threads} threads per block, outside the GPU's 1..{MAX_THREADS_PER_BLOCK}")


def check_shared_memory(name: str, smem: int, limit: int, gpu: str) -> None:
    """A block asking for more shared memory than the GPU gives one block (an sm_86 or sm_89 GPU: 99 KB,
    an A100: 163 KB, an H100: 227 KB), refused in one line: the driver would only say INVALID_VALUE."""
    if smem > limit:
        raise LaunchGeometryError(f"{name}: {smem:,} bytes of shared memory per block, but the {gpu} gives a block at "
                                  f"most {limit:,}: this configuration of the stage needs a GPU with more (an A100 or H100)")


@dataclass(frozen=True)
class LaunchRecord:
    grid: tuple
    block: tuple
    smem: int


def parameter_types(signature: str) -> list[str]:
    """"const elem_t*, long long, int" -> ["pointer", "long long", "int"] (qualifiers dropped)."""
    types = []
    for parameter in signature.split(","):
        words = parameter.replace("const", " ").split()
        types.append("pointer" if "*" in parameter else " ".join(words))
    return types


def _address(value) -> int:
    """A tensor's device pointer, or a raw address (None or 0: a null pointer)."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else int(value or 0)


# A C scalar type -> its struct format; each is aligned to its size, in a C struct as on the GPU.
SCALARS = {"pointer": "Q", "int": "i", "unsigned": "I", "long long": "q", "size_t": "Q", "float": "f"}
SLOT_BYTES = 8
# A C parameter type -> its slot in the packed buffer, as a struct format: 8 bytes a scalar, a tensor map's
# 128 (the driver copies each parameter from its own address).
SLOTS = {c_type: f"{code}{SLOT_BYTES - struct.calcsize(code)}x" for c_type, code in SCALARS.items()} | \
    {"TmaMap": f"{TMA_MAP_BYTES}s"}


def param_struct(name: str, fields: list[tuple[str, str]]) -> type:
    """The class of a C struct that a kernel takes as one parameter (`const __grid_constant__ Name p`), in place
    of a long list of them: a named tuple of its fields, in order, each given as (name, C type) of SCALARS'
    types. A launch passes `Name(field=value, ...)`, every field by name. Its layout, as a C compiler lays the
    fields out (each aligned to its size), in attributes named as a named tuple's own are, so that no field's
    name hides them: _c_fields (the pairs), _offsets, _size, _format (the struct module's, of its bytes) and
    _pointer_fields (the positions of the pointers). The grader checks, each time it compiles the kernel, that
    the C struct has these fields, in this order, of these types, and this size (grader/run.py)."""
    kinds = parameter_types(", ".join(c_type for _, c_type in fields))
    unknown = [t for t in kinds if t not in SCALARS]
    if unknown:
        raise TypeError(f"{name}: no way to pack a field of type {unknown[0]!r} (known: {', '.join(SCALARS)})")
    offsets, format_, end = {}, "", 0
    for (field, _), kind in zip(fields, kinds):
        size = struct.calcsize(SCALARS[kind])
        padding = -end % size
        offsets[field] = end + padding
        format_ += f"{padding}x{SCALARS[kind]}"
        end += padding + size
    alignment = max(struct.calcsize(SCALARS[kind]) for kind in kinds)
    size = end + -end % alignment  # an array of them keeps each field aligned: so does sizeof
    layout = {"__slots__": (), "_c_fields": tuple(fields), "_offsets": offsets, "_size": size,
              "_format": format_ + f"{size - end}x",
              "_pointer_fields": tuple(i for i, kind in enumerate(kinds) if kind == "pointer")}
    return type(name, (namedtuple(name, [field for field, _ in fields]),), layout)


class PackedParameters:
    """One kernel's parameters, packed for cuLaunchKernel: `pack(args)` writes them, `pointers` is the
    address of the void* array the driver reads them through. `structs`: the parameter structs (param_struct)
    the types may name; a kernel takes at most one, whose fields are packed in its slot, in the same
    struct.pack_into."""

    def __init__(self, types: list[str], structs: tuple[type, ...] = ()):
        by_name = {s.__name__: s for s in structs}
        unknown = [t for t in types if t not in SLOTS and t not in by_name]
        if unknown:
            known = ", ".join([*SLOTS, *by_name])
            raise TypeError(f"no way to pass a parameter of type {unknown[0]!r} (known: {known})")
        taken = [i for i, t in enumerate(types) if t in by_name]
        if len(taken) > 1:
            raise TypeError(f"a kernel takes at most one parameter struct; this one takes {len(taken)}")
        self.count = len(types)
        self._struct_at = taken[0] if taken else None  # the struct's position in the arguments
        self._struct_type = by_name[types[taken[0]]] if taken else None
        # struct packs ints, floats and bytes as they are: only pointers need converting (a tensor's address).
        # Their positions are in the arguments as packed: the struct's fields in its place.
        pointers, slots, position = [], [], 0
        for t in types:
            if t in by_name:
                fields = by_name[t]
                pointers += [position + i for i in fields._pointer_fields]
                slots.append(fields._format + f"{-fields._size % SLOT_BYTES}x")
                position += len(fields._fields)
            else:
                pointers += [position] if t == "pointer" else []
                slots.append(SLOTS[t])
                position += 1
        self._pointer_slots = tuple(pointers)
        self._struct = struct.Struct("<" + "".join(slots))
        self._buffer = ctypes.create_string_buffer(max(self._struct.size, 1))
        offsets, offset = [], 0
        for slot in slots:
            offsets.append(offset)
            offset += struct.calcsize("<" + slot)
        base = ctypes.addressof(self._buffer)
        self._array = (ctypes.c_void_p * max(self.count, 1))(*(base + o for o in offsets))
        self.pointers = ctypes.addressof(self._array)

    def pack(self, args: tuple) -> None:
        at = self._struct_at
        if at is None:
            args = list(args)
        elif type(args[at]) is self._struct_type:
            args = [*args[:at], *args[at], *args[at + 1:]]  # the struct's fields in its place
        else:
            raise TypeError(f"argument {at} must be a {self._struct_type.__name__}")
        for i in self._pointer_slots:  # _address, inlined: this runs for every pointer of every launch
            value = args[i]
            args[i] = value.data_ptr() if type(value) is torch.Tensor else _address(value)
        self._struct.pack_into(self._buffer, 0, *args)

    def raw(self) -> bytes:
        """The packed bytes (for tests)."""
        return self._buffer.raw[:self._struct.size]


def _driver_launch():
    """The driver's cuLaunchKernel as a ctypes function (the driver library PyTorch has loaded)."""
    c = ctypes
    function = c.CDLL("libcuda.so.1").cuLaunchKernel
    function.argtypes = [c.c_void_p, *[c.c_uint] * 7, c.c_void_p, c.c_void_p, c.c_void_p]
    function.restype = c.c_int
    return function


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """PyTorch's current stream on a GPU, as the driver's handle; torch.cuda.current_stream() would build a
    Stream object per call, which costs a launch's worth of host time."""
    return _RAW_STREAM(device_index) if _RAW_STREAM else torch.cuda.current_stream(device_index).cuda_stream


class KernelSet:
    def __init__(self, cubin: Path, kernels: dict[str, str], param_structs: tuple[type, ...] = ()):
        """The kernels of a cubin, by name -> C parameter list (a stage's `kernels`), on the current GPU;
        param_structs: the parameter structs the lists name (a stage's `param_structs`)."""
        from cuda.core import Device, ObjectCode

        self._device = Device()
        self._device_index = self._device.device_id  # read once: a property of cuda.core's Device
        module = ObjectCode.from_cubin(Path(cubin).read_bytes())
        self._kernels = {name: module.get_kernel(name) for name in kernels}
        self._parameters = {name: PackedParameters(parameter_types(signature), param_structs)
                            for name, signature in kernels.items()}
        self._handles = {name: int(kernel.handle) for name, kernel in self._kernels.items()}  # CUkernel
        self._cu_launch = _driver_launch()
        self._smem_raised: dict[str, int] = {}
        self._records: dict[tuple, LaunchRecord] = {}  # (name, grid, block, smem) -> its checked record
        self.launches: dict[str, LaunchRecord] = {}    # each kernel's last launch (the grader's occupancy)
        for name in kernels:  # kernels.<name>(grid, block, *args, smem=0), bound once
            setattr(self, name, self._launcher(name))

    def __getattr__(self, name: str):
        raise AttributeError(f"no kernel named {name!r} in this stage")

    def _launcher(self, name: str):
        def launch(grid, block, *args, smem: int = 0):
            self._launch(name, tuple(grid), tuple(block), args, smem)
        return launch

    def _launch(self, name, grid, block, args, smem):
        parameters = self._parameters[name]
        if len(args) != parameters.count:
            raise TypeError(f"{name} takes {parameters.count} arguments; the launch gave {len(args)}")
        record = self._records.get((name, grid, block, smem)) or self._check(name, grid, block, smem)
        parameters.pack(args)
        err = self._cu_launch(self._handles[name], *record.grid, *record.block, smem,
                              current_stream_handle(self._device_index), parameters.pointers, None)
        if err:
            from cuda.bindings import driver

            raise RuntimeError(f"CUDA error launching {name}: {driver.CUresult(err).name}")
        self.launches[name] = record

    def _check(self, name, grid, block, smem) -> LaunchRecord:
        """The first launch of a geometry: its limits checked, the kernel's shared memory raised if needed."""
        check_geometry(name, grid, block)
        if smem > STATIC_SHARED_LIMIT and self._smem_raised.get(name, 0) < smem:
            properties = self._device.properties
            check_shared_memory(name, smem, properties.max_shared_memory_per_block_optin, self._device.name)
            self._raise_smem_limit(self._kernels[name], smem)
            self._smem_raised[name] = smem
        as_3d = (lambda dims: (*dims, 1, 1)[:3])  # the driver takes x, y and z
        record = self._records[name, grid, block, smem] = LaunchRecord(as_3d(grid), as_3d(block), smem)
        return record

    def _raise_smem_limit(self, kernel, smem: int) -> None:
        from cuda.bindings import driver

        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        handle = kernel.handle
        if isinstance(handle, driver.CUkernel):
            _, dev = driver.cuDeviceGet(self._device.device_id)
            (err,) = driver.cuKernelSetAttribute(attribute, smem, handle, dev)
        else:
            (err,) = driver.cuFuncSetAttribute(handle, attribute, smem)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot give a kernel {smem} bytes of shared memory: {err.name}")

    def occupancy(self, name: str) -> dict:
        """Blocks per SM and the fraction of the SM's warp slots the last launch of `name` fills."""
        record = self.launches[name]
        threads = int(np.prod(record.block))
        blocks = self._kernels[name].occupancy.max_active_blocks_per_multiprocessor(threads, record.smem)
        max_threads = self._device.properties.max_threads_per_multiprocessor
        return {"blocks_per_sm": blocks, "warps_per_sm": blocks * threads // 32,
                "occupancy": round(blocks * threads / max_threads, 3)}
