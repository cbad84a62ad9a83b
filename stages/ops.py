"""The course's kernels as PyTorch functions, on your own tensors: `from stages import ops`.

    o = ops.attention(q, k, v, causal=True)  # q [B, H, Sq, D], k and v [B, H, Skv, D], fp16 or bf16
    o.backward(grad)                          # q.grad, k.grad, v.grad by the course's backward kernel

Each direction runs the fastest course stage this GPU runs: the highest-numbered stage that solves its
problem ("attention", "attention_backward") and compiles for the GPU (the forward: stage 4 on sm_90a,
an H100 or H200; stage 3 elsewhere). A stage is compiled on first use for the inputs' dtype and head
dimension, with the -D macros the grader uses, into the compile cache on disk (stages/common/compiler.py);
the process keeps its kernels and launches them on the caller's tensors and current stream.
"""
from __future__ import annotations

import functools
import math

import torch

import reference
import stages
from stages.common.compiler import compile_cubin
from stages.common.launcher import KernelSet

ATTENTION = reference.load("attention")  # the problem the forward stages solve: its dtypes and head dims
DTYPES = {getattr(torch, name): name for name in ATTENTION.dtypes}
HEAD_DIMS = ATTENTION.parameters["D"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """softmax(scale · q kᵀ [causal mask]) v, differentiable: reference/attention.py's problem (the causal
    mask top-left aligned, as PyTorch's); scale defaults to 1/√D."""
    check_attention_inputs(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return Attention.apply(q, k, v, bool(causal), scale)


class Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        o = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)  # what backward recomputes P from
        launch_fastest("attention", q, k, v, o, lse, scale, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # grad_o may be any view (the gradient of o.sum() is one expanded value): the kernel reads it dense.
        launch_fastest("attention_backward", q, k, v, o, lse, grad_o.contiguous(), dq, dk, dv, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None


def check_attention_inputs(q, k, v) -> None:
    """ValueError, in one line, for inputs the course's kernels do not take (before anything is launched)."""
    if problem := attention_input_problem(q, k, v):
        raise ValueError(f"ops.attention: {problem}")


def attention_input_problem(q, k, v) -> str | None:
    """What is wrong with q, k, v for the kernels, in words; None if nothing. The GPU is checked last,
    so that the rest can be checked (and tested) on tensors of any device."""
    tensors = {"q": q, "k": k, "v": v}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        return "q, k and v must be tensors"
    shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in tensors.items())
    if not all(t.dim() == 4 for t in tensors.values()) or k.shape != v.shape or \
            (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
        return f"expected q [B, H, Sq, D], k and v [B, H, Skv, D]; got {shapes}"
    if 0 in q.shape or 0 in k.shape:
        return f"every dimension must be at least 1; got {shapes}"
    if q.dtype not in DTYPES or not q.dtype == k.dtype == v.dtype:
        dtypes = ", ".join(f"{name} {t.dtype}" for name, t in tensors.items())
        return f"q, k and v must all be {' or all '.join(DTYPES.values())}; got {dtypes}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"the head dimension D must be one of {HEAD_DIMS}; got {q.shape[-1]}"
    if strided := [name for name, t in tensors.items() if not t.is_contiguous()]:
        return f"q, k and v must be contiguous (.contiguous() makes a copy that is); not: {', '.join(strided)}"
    if any(t.device.type != "cuda" for t in tensors.values()) or not q.device == k.device == v.device:
        return f"q, k and v must be on one CUDA GPU; got {', '.join(f'{n} on {t.device}' for n, t in tensors.items())}"
    return None


def launch_fastest(problem: str, q: torch.Tensor, *rest) -> None:
    """stage.launch(kernels, q, *rest) of the fastest stage of `problem` on q's GPU, its kernels compiled
    for q's dtype and head dimension."""
    stage, arch = fastest_stage_on(problem, q.device.index)
    with torch.cuda.device(q.device):  # so that the current stream, which the launch uses, is q's GPU's
        stage.launch(kernels_for(stage.name, arch, q.dtype, q.shape[-1], q.device.index), q, *rest)


@functools.cache
def fastest_stage_on(problem: str, device_index: int) -> tuple[stages.Stage, str]:
    return fastest_stage(problem, torch.cuda.get_device_properties(device_index))


def fastest_stage(problem: str, gpu) -> tuple[stages.Stage, str]:
    """(the highest-numbered stage solving `problem` that `gpu` runs, the arch to compile it for); gpu is
    anything with a name, major and minor (torch.cuda.get_device_properties())."""
    for name in reversed(stages.stage_names()):
        stage = stages.load(name)
        if stage.problem == problem:
            try:
                return stage, stages.arch_for(gpu, stage.archs)
            except ValueError:
                continue  # needs another GPU: try the stage below
    raise RuntimeError(f"no course stage solves {problem} on this GPU ({gpu.name}, sm_{gpu.major}{gpu.minor})")


@functools.cache
def kernels_for(stage_name: str, arch: str, dtype: torch.dtype, head_dim: int, device_index: int) -> KernelSet:
    """The stage's kernels for one variant, compiled (or read from the disk cache) and loaded on one GPU."""
    from cuda.core import Device

    stage = stages.load(stage_name)
    cubin = compile_cubin(stage.source_path, arch, stage.defines({"dtype": DTYPES[dtype], "D": head_dim}))
    Device(device_index).set_current()  # as the grader's worker does: PyTorch's own (primary) context
    return KernelSet(cubin.path, list(stage.kernels))
