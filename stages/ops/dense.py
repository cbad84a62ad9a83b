"""ops.attention: the dense attention and its gradients (stages.OPS_STAGES: stage 4 or 3 forward, stage 9 or
8 backward), its custom ops flashmoe::attention_forward and flashmoe::attention_backward, and the checks of
q, k and v that block-sparse attention makes too (stages/ops/block_sparse.py)."""
from __future__ import annotations

import math

import torch

import reference
from stages.ops import shared

ATTENTION = reference.load("attention")  # the problems the op solves: their dtypes, head dims, run_stage
ATTENTION_BACKWARD = reference.load("attention_backward")
DTYPES = {getattr(torch, name): name for name in ATTENTION.dtypes}
HEAD_DIMS = ATTENTION.parameters["D"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """softmax(scale · q kᵀ [causal mask]) v, differentiable: reference/attention.py's problem (the causal
    mask top-left aligned, as PyTorch's); scale defaults to 1/√D. q [B, H, Sq, D], k and v [B, H_kv, Skv, D]
    with H_kv dividing H (grouped-query attention: query head h uses KV head h // (H / H_kv)), any strides
    with D contiguous, all float16 or all bfloat16, D 64 or 128, on one CUDA GPU. The output lies in memory
    as [B, Sq, H, D], as PyTorch's flash SDPA returns it, so that a model's output projection reads
    o.transpose(1, 2).reshape(B, Sq, H·D) with no copy."""
    shared.refuse("ops.attention", attention_input_problem(q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    causal = bool(causal)
    if not shared.plain_eager(q, k, v):
        return attention_forward(q, k, v, causal, scale)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, causal, scale)
    return forward_launch(q, k, v, causal, scale)[0]


class _Attention(torch.autograd.Function):
    """ops.attention's autograd in eager mode: the custom ops' launches, without their dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = forward_launch(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    def backward(ctx, grad_o):
        return *backward_launch(grad_o, *ctx.saved_tensors, ctx.causal, ctx.scale), None, None


def forward_launch(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) by the fastest forward stage, for inputs already checked."""
    return outputs_launch(ATTENTION, dict(q=q, k=k, v=v, scale=scale, causal=causal))


def backward_launch(grad_o, q, k, v, o, lse, causal: bool, scale: float):
    """(dq, dk, dv) by the fastest backward stage, in the layouts of q, k and v where they are dense."""
    return gradients_launch(ATTENTION_BACKWARD, dict(q=q, k=k, v=v, o=o, lse=lse, do=grad_o, scale=scale,
                                                     causal=causal))


def outputs_launch(problem, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of an attention problem (dense or block-sparse) by its stage, for inputs already checked."""
    o, lse = outputs_like(inputs["q"])
    shared.launch_fastest(problem, inputs, dict(o=o, lse=lse))
    return o, lse


def gradients_launch(problem, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of an attention backward problem by its stage, in the layouts of q, k and v where
    they are dense; the output's gradient inputs["do"] may have any strides (made dense where they do not fit)."""
    grad_o = inputs["do"]
    if not shared.strides_fit(grad_o) or grad_o.data_ptr() % shared.ALIGNMENT:  # e.g. o.sum()'s, one value expanded
        inputs["do"] = grad_o.contiguous()
    dq, dk, dv = (torch.empty_like(inputs[name]) for name in "qkv")
    shared.launch_fastest(problem, inputs, dict(dq=dq, dk=dk, dv=dv))
    return dq, dk, dv


@torch.library.custom_op("flashmoe::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): the attention and each query row's log-sum-exp of its scaled scores (natural log, fp32
    [B, H, Sq]), what the backward recomputes the probabilities from."""
    shared.refuse("flashmoe::attention_forward", attention_input_problem(q, k, v))
    return forward_launch(q, k, v, causal, scale)


@attention_forward.register_fake
def _(q, k, v, causal, scale):
    return outputs_like(q)


def outputs_like(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """O (output_like) and the LSE, fp32 [B, H, Sq], for the attention of q, to be written."""
    return output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def output_like(q: torch.Tensor) -> torch.Tensor:
    """O of q's shape [B, H, Sq, D] over a [B, Sq, H, D] buffer (the real op's layout and its fake's)."""
    batch, heads, seq_q, head_dim = q.shape
    row = heads * head_dim  # one query's H heads side by side; allocated strided in one step, not transposed
    return q.new_empty_strided((batch, heads, seq_q, head_dim), (seq_q * row, head_dim, row, 1))


@torch.library.custom_op("flashmoe::attention_backward", mutates_args=())
def attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for the output's gradient grad_o (any strides) and the forward's o and lse."""
    shared.refuse("flashmoe::attention_backward", attention_backward_input_problem(grad_o, q, k, v, o, lse))
    return backward_launch(grad_o, q, k, v, o, lse, causal, scale)


@attention_backward.register_fake
def _(grad_o, q, k, v, o, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_for_attention_backward(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)  # the kernels give no gradient through the LSE: say so, not drop it


def _attention_gradients(ctx, grad_o, grad_lse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(grad_o, q, k, v, o, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


attention_forward.register_autograd(_attention_gradients, setup_context=_save_for_attention_backward)


_FIT_LAYOUTS: set = set()  # (shapes, strides, dtypes, GPUs) of q, k, v found fit: then only alignment is checked
MAX_FIT_LAYOUTS = 1024


def check_attention_inputs(q, k, v) -> None:
    """ValueError, in one line, for inputs the course's kernels do not take (before anything is launched)."""
    shared.refuse("ops.attention", attention_input_problem(q, k, v))


def attention_input_problem(q, k, v) -> str | None:
    """What is wrong with q, k, v for the kernels, in words; None if nothing. This runs on every call, so a
    layout (shapes, strides, dtypes, GPU) found fit once is remembered, and its next calls check only that
    each tensor starts 16-byte aligned. Under tracing, every check runs (Dynamo traces them)."""
    if torch.compiler.is_compiling() or not all(type(t) is torch.Tensor for t in (q, k, v)):
        return full_attention_input_problem(q, k, v)
    layout = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
              q.get_device(), k.get_device(), v.get_device())
    if layout in _FIT_LAYOUTS and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % shared.ALIGNMENT:
        return None
    problem = full_attention_input_problem(q, k, v)
    if problem is None:
        if len(_FIT_LAYOUTS) >= MAX_FIT_LAYOUTS:
            _FIT_LAYOUTS.clear()
        _FIT_LAYOUTS.add(layout)
    return problem


def full_attention_input_problem(q, k, v) -> str | None:
    """Every check of q, k, v, the GPU last, so that the rest can be checked (and tested) on tensors of any
    device. The words are made only for a problem."""
    tensors = {"q": q, "k": k, "v": v}
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k and v must be tensors"
    if not (q.dim() == k.dim() == v.dim() == 4) or k.shape != v.shape or \
            (k.shape[0], k.shape[3]) != (q.shape[0], q.shape[3]):
        return f"expected q [B, H, Sq, D], k and v [B, H_kv, Skv, D]; got {shapes_of(tensors)}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"the KV heads H_kv must divide the query heads H (grouped-query attention); got {shapes_of(tensors)}"
    if 0 in q.shape or 0 in k.shape:
        return f"every dimension must be at least 1; got {shapes_of(tensors)}"
    if q.dtype not in DTYPES or not q.dtype == k.dtype == v.dtype:
        dtypes = ", ".join(f"{name} {t.dtype}" for name, t in tensors.items())
        return f"q, k and v must all be {' or all '.join(DTYPES.values())}; got {dtypes}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"the head dimension D must be one of {HEAD_DIMS}; got {q.shape[-1]}"
    return shared.strides_problem(tensors) or shared.device_problem(tensors)


def shapes_of(tensors: dict) -> str:
    return ", ".join(f"{name} {list(t.shape)}" for name, t in tensors.items())


def attention_backward_input_problem(grad_o, q, k, v, o, lse) -> str | None:
    """attention_input_problem, and o, lse and grad_o as the forward gives them for q, k, v."""
    return attention_input_problem(q, k, v) or forward_results_problem(grad_o, q, o, lse)


def forward_results_problem(grad_o, q, o, lse) -> str | None:
    """What is wrong with o, lse and grad_o, as the forward gives them for q (checked), for a backward."""
    if not all(isinstance(t, torch.Tensor) for t in (grad_o, o, lse)):
        return "grad_o, o and lse must be tensors"
    if grad_o.shape != q.shape or o.shape != q.shape or lse.shape != q.shape[:3]:
        return (f"expected grad_o and o of q's shape {list(q.shape)} and lse [B, H, Sq]; got grad_o "
                f"{list(grad_o.shape)}, o {list(o.shape)}, lse {list(lse.shape)}")
    if grad_o.dtype != q.dtype or o.dtype != q.dtype or lse.dtype != torch.float32:
        return (f"expected grad_o and o of q's dtype {q.dtype} and lse float32; got {grad_o.dtype}, {o.dtype}, "
                f"{lse.dtype}")
    # grad_o may have any strides (the op makes others dense); o and lse are the forward's.
    return shared.strides_problem({"o": o}) or shared.layout_problem({"lse": lse}) or \
        shared.device_problem({"q": q, "grad_o": grad_o, "o": o, "lse": lse})

