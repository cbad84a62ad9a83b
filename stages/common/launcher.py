"""Launch NVRTC-compiled kernels on PyTorch tensors: in the grader's worker process, and in the
course's PyTorch ops (stages/ops.py).

A stage's launch function receives a `KernelSet` and calls its kernels by name:

    kernels.attention_fwd(grid, block, q, k, v, o, lse, seq_q, seq_kv, scale, causal, smem=49152)

Each argument is passed as the C signature the stage declares says (the grader checks those against
the kernels at compile time): a tensor as its device pointer, a Python int as an `int` or a `long
long`, a float as a `float`; a wrong number of arguments is an error before the launch. Launches go to
PyTorch's current stream, so CUDA events recorded by PyTorch time them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

STATIC_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
GRID_LIMITS = (2**31 - 1, 65535, 65535)  # blocks along x, y, z (the limits of every sm_80+ GPU)
MAX_THREADS_PER_BLOCK = 1024


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


@dataclass
class LaunchRecord:
    grid: tuple
    block: tuple
    smem: int


# C parameter types -> how a Python value is passed as one (anything else, e.g. a TmaMap, goes as it is)
SCALARS = {"int": np.int32, "unsigned": np.uint32, "long long": np.int64, "size_t": np.uint64, "float": np.float32}


def parameter_types(signature: str) -> list[str]:
    """"const elem_t*, long long, int" -> ["pointer", "long long", "int"] (qualifiers dropped)."""
    types = []
    for parameter in signature.split(","):
        words = parameter.replace("const", " ").split()
        types.append("pointer" if "*" in parameter else " ".join(words))
    return types


def _as_kernel_arg(value, c_type: str):
    if isinstance(value, torch.Tensor):
        return np.uint64(value.data_ptr())   # a device pointer
    if c_type == "pointer":
        return np.uint64(value)              # a raw address (0: a null pointer)
    if c_type in SCALARS:
        return SCALARS[c_type](value)
    return value                             # e.g. a TensorMapDescriptor, passed by value


class KernelSet:
    def __init__(self, cubin: Path, kernels: dict[str, str]):
        """The kernels of a cubin, by name -> C parameter list (a stage's `kernels`)."""
        from cuda.core import Device, ObjectCode

        self._device = Device()
        module = ObjectCode.from_cubin(Path(cubin).read_bytes())
        self._kernels = {name: module.get_kernel(name) for name in kernels}
        self._types = {name: parameter_types(signature) for name, signature in kernels.items()}
        self._smem_raised: dict[str, int] = {}
        self._streams: dict[int, object] = {}   # cuda.core Stream per PyTorch stream handle
        self._configs: dict[tuple, object] = {}  # LaunchConfig per (grid, block, smem)
        self.launches: dict[str, LaunchRecord] = {}

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self._kernels:
            raise AttributeError(f"no kernel named {name!r} in this stage")

        def launch(grid, block, *args, smem: int = 0):
            self._launch(name, tuple(grid), tuple(block), args, smem)

        return launch

    def _launch(self, name, grid, block, args, smem):
        from cuda.core import LaunchConfig, Stream, launch

        kernel, types = self._kernels[name], self._types[name]
        if len(args) != len(types):
            raise TypeError(f"{name} takes {len(types)} arguments ({', '.join(types)}); the launch gave {len(args)}")
        if smem > STATIC_SHARED_LIMIT and self._smem_raised.get(name, 0) < smem:
            properties = self._device.properties
            check_shared_memory(name, smem, properties.max_shared_memory_per_block_optin, self._device.name)
            self._raise_smem_limit(kernel, smem)
            self._smem_raised[name] = smem
        # Both objects are cached: building them on every launch costs more host time than a
        # small kernel takes on the GPU, and the timings would measure Python.
        handle = torch.cuda.current_stream().cuda_stream
        if handle not in self._streams:
            self._streams[handle] = Stream.from_handle(handle)
        if (grid, block, smem) not in self._configs:
            check_geometry(name, grid, block)
            self._configs[grid, block, smem] = LaunchConfig(grid=grid, block=block, shmem_size=smem)
        launch(self._streams[handle], self._configs[grid, block, smem], kernel,
               *(_as_kernel_arg(a, t) for a, t in zip(args, types)))
        self.launches[name] = LaunchRecord(grid, block, smem)

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
