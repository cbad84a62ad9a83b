"""What the ops share: their input checks (each a problem in words, or None), the refusal of inputs the
kernels do not take in one line, and the launch of the stage stages.OPS_STAGES names for a problem on the
inputs' GPU, compiled on first use and kept (stages.ops_stage)."""
from __future__ import annotations

import torch

import stages
from stages.common.compiler import compile_cubin
from stages.common.launcher import KernelSet

ALIGNMENT = 16     # bytes: the kernels load 16-byte vectors (cp.async, TMA) from each tensor's start and row


def refuse(who: str, problem: str | None) -> None:
    """ValueError "who: problem", in one line, where there is a problem."""
    if problem:
        raise ValueError(f"{who}: {problem}")


def plain_eager(*tensors) -> bool:
    """Plain CUDA tensors in eager mode: no torch.compile or make_fx tracing, no fake tensors, no dispatch
    mode that should see the custom ops."""
    return not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack() and \
        all(type(t) is torch.Tensor for t in tensors)


def layout_problem(tensors: dict) -> str | None:
    """Each tensor dense, in row-major order, from a 16-byte aligned start (a contiguous tensor of the
    caching allocator's, or a slice of one on whole rows, is)."""
    if strided := [name for name, t in tensors.items() if not t.is_contiguous()]:
        names = ", ".join(tensors)
        return f"{names} must be contiguous (.contiguous() makes a copy that is); not: {', '.join(strided)}"
    return alignment_problem(tensors)


def strides_problem(tensors: dict) -> str | None:
    """Each tensor's last dimension contiguous and its other strides whole 16-byte units, from a 16-byte
    aligned start: what TMA and the kernels' 16-byte row accesses need. A model's [B, S, H, D] views
    and slices of a fused projection are; a dimension of one element may have any stride."""
    if strided := [name for name, t in tensors.items() if not strides_fit(t)]:
        return (f"each tensor's last dimension must be contiguous and its other strides multiples of "
                f"{ALIGNMENT} bytes (.contiguous() makes a copy that is); not: {', '.join(strided)} (strides "
                f"{', '.join(str(tensors[n].stride()) for n in strided)})")
    return alignment_problem(tensors)


def strides_fit(t: torch.Tensor) -> bool:
    """The last dimension contiguous, the other strides whole 16-byte units (but a dimension of one element's)."""
    return t.stride(-1) == 1 and all(size == 1 or stride * t.element_size() % ALIGNMENT == 0
                                     for size, stride in zip(t.shape[:-1], t.stride()[:-1]))


def alignment_problem(tensors: dict) -> str | None:
    if torch.compiler.is_compiling():  # Dynamo cannot trace storage_offset(): the op checks it when it runs
        return None
    if unaligned := [name for name, t in tensors.items() if t.storage_offset() * t.element_size() % ALIGNMENT]:
        return (f"each tensor must start {ALIGNMENT}-byte aligned (.clone() makes a copy that does); "
                f"not: {', '.join(unaligned)}")
    return None


def device_problem(tensors: dict) -> str | None:
    first = next(iter(tensors.values())).device
    if first.type != "cuda" or any(t.device != first for t in tensors.values()):
        names = ", ".join(tensors)
        return f"{names} must be on one CUDA GPU; got {', '.join(f'{n} on {t.device}' for n, t in tensors.items())}"
    return None


_LOADED: dict = {}  # (problem, GPU, variant values) -> (stage, its KernelSet on that GPU)


def launch_fastest(problem, inputs: dict, outputs: dict, saving: bool = False):
    """problem.run_stage (the grader's call) of the stage the ops run for `problem` (stages.ops_stage) on the
    GPU of its primary input, compiled for the variant the inputs need (problem.variant: dtype, head dimension). With
    saving, problem.forward_for_backward instead (the forward of a backward, as the grader runs it), whose
    dict is returned: the outputs and what the stage saved for the backward."""
    device = inputs[problem.primary_input].device
    variant = problem.variant(inputs)
    key = (problem.name, device.index, *variant.values())
    stage, kernels = _LOADED.get(key) or _load(key, problem, device.index, variant)
    run = problem.forward_for_backward if saving else problem.run_stage
    if device.index == torch.cuda.current_device():
        return run(stage, kernels, inputs, outputs)
    with torch.cuda.device(device):  # the current stream, which the launch uses, must be that GPU's
        return run(stage, kernels, inputs, outputs)


def ops_stage_on(problem: str, device_index: int) -> tuple[stages.Stage, str]:
    """stages.ops_stage on the GPU of a device index."""
    return stages.ops_stage(problem, torch.cuda.get_device_properties(device_index))


def _load(key: tuple, problem, device_index: int, variant: dict) -> tuple:
    """The kernels of the stage the ops run, for one variant, on one GPU (load_kernels), kept."""
    stage, arch = ops_stage_on(problem.name, device_index)
    _LOADED[key] = stage, load_kernels(stage, arch, variant, device_index)
    return _LOADED[key]


def load_kernels(stage: stages.Stage, arch: str, variant: dict, device_index: int) -> KernelSet:
    """A stage's kernels for one variant's -D macros (stage.defines), compiled for `arch` (or read from the disk
    cache) and loaded on one GPU."""
    from cuda.core import Device

    cubin = compile_cubin(stage.source_path, arch, stage.defines(variant))
    Device(device_index).set_current()  # as the grader's worker does: PyTorch's own (primary) context
    return KernelSet(cubin.path, stage.kernels, stage.param_structs)


_RUNS_HERE: dict = {}  # (problem, GPU) -> why no course stage solves it there, or None


def stage_problem(problem, tensor: torch.Tensor) -> str | None:
    """Why no course stage solves `problem` on the GPU of `tensor`, in one line; None if one does. Asked once
    per GPU; a traced call (fake tensors, Dynamo) is asked when its op runs."""
    if torch.compiler.is_compiling() or type(tensor) is not torch.Tensor:
        return None
    key = (problem.name, tensor.device.index)
    if key not in _RUNS_HERE:
        try:
            ops_stage_on(problem.name, tensor.device.index)
            _RUNS_HERE[key] = None
        except RuntimeError as error:
            _RUNS_HERE[key] = str(error)
    return _RUNS_HERE[key]

