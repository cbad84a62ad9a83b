"""The course's kernels as PyTorch ops, on your own tensors: `from stages import ops`.

    o = ops.attention(q, k, v, causal=True)   # q [B, H, Sq, D], k and v [B, H_kv, Skv, D] (H_kv | H), fp16 or bf16
    o.transpose(1, 2).reshape(B, Sq, H * D)    # free: o [B, H, Sq, D] lies in memory as [B, Sq, H, D]
    o.backward(grad)                           # q.grad, k.grad, v.grad by the course's backward kernel
    out = ops.moe_layer(x, router_weight, w1, w2, top_k, router_bias=None)
    out.backward(grad)                         # x, router_weight, router_bias, w1, w2's .grad: on sm_90a only
    o = ops.block_sparse_attention(q, k, v, block_mask, element_mask="causal")  # a FlexAttention BlockMask

q, k and v may be any views whose last dimension is contiguous: a model's [B, S, H, D] projections
seen as [B, H, S, D] (`x.view(B, S, H, D).transpose(1, 2)`), slices of a fused QKV projection. On an
H100 or H200 the kernels read them where they lie, and the gradients come back in the inputs' layout.

They are `torch.library` custom ops (namespace "flashmoe"), each with a fake implementation (the
output shapes and dtypes alone), so that `torch.compile(fullgraph=True)` and `make_fx` trace a model
that calls them; the attentions and the MoE layer have autograd through the course's backward stages:

    flashmoe::attention_forward(q, k, v, causal, scale) -> (o, lse)        lse fp32 [B, H, Sq], no gradient
    flashmoe::attention_backward(grad_o, q, k, v, o, lse, causal, scale) -> (dq, dk, dv)
    flashmoe::moe_layer(x, router_weight, router_bias, w1, w2, top_k) -> (out, topk_ids)    no gradient (inference)
    flashmoe::moe_layer_saving(x, router_weight, router_bias, w1, w2, top_k)
        -> (out, topk_ids, topk_weights, logits, expert_counts, expert_offsets, dest, source_token, h1)
                                            the layer with gradients: out's, through what the forward saves
    flashmoe::moe_layer_backward(grad_out, x, router_weight, w1, w2, topk_ids, topk_weights, logits,
                                 expert_counts, expert_offsets, dest, source_token, h1)
        -> (dx, dwr, dbias, dw1, dw2)                                   dbias fp32 [E], no load-balancing loss
    flashmoe::block_sparse_attention_forward(q, k, v, <mask>, scale) -> (o, lse)
    flashmoe::block_sparse_attention_backward(grad_o, q, k, v, o, lse, <mask>, scale) -> (dq, dk, dv)

where <mask> is a BlockMask's kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, then
document_ids (or None), element_mask and window (0 where none): ops.block_sparse_attention unpacks the
BlockMask, which a custom op cannot take. moe_layer_saving's outputs after out are what the MoE backward
reads (reference/moe_layer_backward.Saved: the routing, the permutation, h1 = x·W1 per token-slot; rows =
moe.padded_capacity(T, E, k, 128)), none of them differentiable; traced, ops.moe_layer calls it where a
gradient is wanted and flashmoe::moe_layer, which has none, otherwise.

Each op returns new tensors and mutates none of its inputs. `ops.attention`, `ops.moe_layer` and
`ops.block_sparse_attention` refuse inputs the kernels do not take with one ValueError, in one line,
before anything is launched (the ops check again when called directly).

The host cost of a call is what a model pays on every layer, so eager calls on plain CUDA tensors skip
the custom ops' dispatch, tens of microseconds a call: ops.attention, ops.moe_layer and
ops.block_sparse_attention go through a torch.autograd.Function (or straight to the launch where no
gradient is wanted) whose forward and backward run the very launches the custom ops run. Under
torch.compile, make_fx, FakeTensorMode or any other dispatch mode, the custom ops are called, as tracing
needs. An ops.moe_layer call of at most MOE_GRAPH_TOKENS tokens without gradients replays a CUDA graph of
its launches from the second call of the same shape and weights on (not while the caller captures a graph
itself). (docs/pytorch.md measures each piece of a call.)

Each problem runs the first stage (or rung) stages.OPS_STAGES lists for it, the fastest first, that compiles
for this GPU (`stages.ops_stage`); a stage that is not listed never serves an op. The forward
attention: stage 4 on sm_90a (an H100 or H200), stage 3 elsewhere; its backward: stage 9 on sm_90a,
stage 8 elsewhere; the MoE layer: stage 7 on sm_90a, stage 7's mma_sync rung elsewhere; its backward: stage 14,
on sm_90a alone (elsewhere a backward through ops.moe_layer raises one ValueError); block-sparse
attention: stages 12 and 13 on sm_90a, none elsewhere (the call is refused there, in one line). A
stage is compiled on first use for the variant the inputs need (the problem's `variant`: dtype, head
dimension, element mask), with the -D macros the grader uses, into the compile cache on disk
(stages/common/compiler.py); the process keeps its kernels and launches them through the problem's own
`run_stage`, the call the grader makes, on the caller's tensors and current stream. Only the stages that
run are imported.
"""
from __future__ import annotations

import functools
import math
from collections import OrderedDict
from typing import Optional

import torch

import reference
import stages
from reference import moe
from reference.block_sparse_attention import BLOCK, ELEMENT_MASKS, LAYOUT
from reference.moe_experts import BLOCK as MOE_BLOCK
from reference.moe_layer_backward import Saved
from stages.common.compiler import compile_cubin
from stages.common.launcher import KernelSet
from stages.common.moe import MAX_EXPERTS, MAX_TOP_K

ATTENTION = reference.load("attention")  # the problems the ops solve: their dtypes, head dims, run_stage
ATTENTION_BACKWARD = reference.load("attention_backward")
MOE_LAYER = reference.load("moe_layer")
MOE_LAYER_BACKWARD = reference.load("moe_layer_backward")
DTYPES = {getattr(torch, name): name for name in ATTENTION.dtypes}
HEAD_DIMS = ATTENTION.parameters["D"]
MOE_DTYPES = {getattr(torch, name): name for name in MOE_LAYER.dtypes}
MOE_MIN_DIM = 64   # hidden and inter: multiples of 8 (16-byte rows, TMA strides), at least a 64-wide tile
ALIGNMENT = 16     # bytes: the kernels load 16-byte vectors (cp.async, TMA) from each tensor's start and row
BLOCK_SPARSE = reference.load("block_sparse_attention")
BLOCK_SPARSE_BACKWARD = reference.load("block_sparse_attention_backward")
BLOCK_SPARSE_CALLER = "ops.block_sparse_attention"
# the block-sparse ops' arguments after q, k and v (scale last): the problem's mask inputs
MASK_ARGUMENTS = (*LAYOUT, "document_ids", "element_mask", "window")
assert BLOCK_SPARSE.parameters["D"] == HEAD_DIMS and BLOCK_SPARSE.dtypes == ATTENTION.dtypes  # checked as attention's


# ================================================================ attention

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """softmax(scale · q kᵀ [causal mask]) v, differentiable: reference/attention.py's problem (the causal
    mask top-left aligned, as PyTorch's); scale defaults to 1/√D. q [B, H, Sq, D], k and v [B, H_kv, Skv, D]
    with H_kv dividing H (grouped-query attention: query head h uses KV head h // (H / H_kv)), any strides
    with D contiguous, all float16 or all bfloat16, D 64 or 128, on one CUDA GPU. The output lies in memory
    as [B, Sq, H, D], as PyTorch's flash SDPA returns it, so that a model's output projection reads
    o.transpose(1, 2).reshape(B, Sq, H·D) with no copy."""
    refuse("ops.attention", attention_input_problem(q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    causal = bool(causal)
    if not plain_eager(q, k, v):
        return attention_forward(q, k, v, causal, scale)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, causal, scale)
    return forward_launch(q, k, v, causal, scale)[0]


def plain_eager(*tensors) -> bool:
    """Plain CUDA tensors in eager mode: no torch.compile or make_fx tracing, no fake tensors, no dispatch
    mode that should see the custom ops."""
    return not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack() and \
        all(type(t) is torch.Tensor for t in tensors)


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
    """(o, lse) of an attention problem (dense or block-sparse) by its fastest stage, for inputs already checked."""
    o, lse = outputs_like(inputs["q"])
    launch_fastest(problem, inputs, dict(o=o, lse=lse))
    return o, lse


def gradients_launch(problem, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of an attention backward problem by its fastest stage, in the layouts of q, k and v where
    they are dense; the output's gradient inputs["do"] may have any strides (made dense where they do not fit)."""
    grad_o = inputs["do"]
    if not strides_fit(grad_o) or grad_o.data_ptr() % ALIGNMENT:  # e.g. o.sum()'s, one value expanded
        inputs["do"] = grad_o.contiguous()
    dq, dk, dv = (torch.empty_like(inputs[name]) for name in "qkv")
    launch_fastest(problem, inputs, dict(dq=dq, dk=dk, dv=dv))
    return dq, dk, dv


@torch.library.custom_op("flashmoe::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse): the attention and each query row's log-sum-exp of its scaled scores (natural log, fp32
    [B, H, Sq]), what the backward recomputes the probabilities from."""
    refuse("flashmoe::attention_forward", attention_input_problem(q, k, v))
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
    refuse("flashmoe::attention_backward", attention_backward_input_problem(grad_o, q, k, v, o, lse))
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
    refuse("ops.attention", attention_input_problem(q, k, v))


def attention_input_problem(q, k, v) -> str | None:
    """What is wrong with q, k, v for the kernels, in words; None if nothing. This runs on every call, so a
    layout (shapes, strides, dtypes, GPU) found fit once is remembered, and its next calls check only that
    each tensor starts 16-byte aligned. Under tracing, every check runs (Dynamo traces them)."""
    if torch.compiler.is_compiling() or not all(type(t) is torch.Tensor for t in (q, k, v)):
        return full_attention_input_problem(q, k, v)
    layout = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
              q.get_device(), k.get_device(), v.get_device())
    if layout in _FIT_LAYOUTS and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGNMENT:
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
    return strides_problem(tensors) or device_problem(tensors)


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
    return strides_problem({"o": o}) or layout_problem({"lse": lse}) or \
        device_problem({"q": q, "grad_o": grad_o, "o": o, "lse": lse})


# ================================================================ block-sparse attention

def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, *, element_mask: str,
                           window: int | None = None, document_ids: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """Compiled FlexAttention's flex_attention(q, k, v, block_mask=block_mask, scale=scale) for a BlockMask
    whose mask_mod is one of the element masks the kernels compile in, differentiable: reference/
    block_sparse_attention.py's problem. block_mask: a torch.nn.attention.flex_attention.BlockMask of
    128 × 128 blocks (create_block_mask's default), one for every batch and head (B=None, H=None), made for
    the length S of q, k and v. Its lists are read as they are; its mask_mod is not (a kernel cannot call a
    Python function): element_mask names what it computes, applied in the mask's partial blocks only, i the
    query's token and j the key's:

        "none"            every pair (mask_mod noop_mask, as from BlockMask.from_kv_blocks)
        "causal"          j <= i
        "document"        j <= i and document_ids[i] == document_ids[j] (int32 [S], on q's GPU)
        "sliding_window"  0 <= i - j < window

    q [B, H, S, D], k and v [B, H_kv, S, D] (H_kv dividing H), strides and dtypes as ops.attention takes
    them; scale defaults to 1/√D. A query row that sees no key outputs 0, as FlexAttention's. The stages
    (12 forward, 13 backward) are sm_90a's only: on another GPU the call is refused."""
    refuse(BLOCK_SPARSE_CALLER, attention_input_problem(q, k, v) or block_mask_problem(block_mask, q.shape[2]))
    mask = (*mask_lists(block_mask), document_ids, element_mask, 0 if window is None else window)
    refuse(BLOCK_SPARSE_CALLER, mask_problem(q, k, mask, BLOCK_SPARSE))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not plain_eager(q, k, v, *(t for t in mask[:5] if t is not None)):
        return block_sparse_attention_forward(q, k, v, *mask, scale)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _BlockSparseAttention.apply(q, k, v, scale, *mask)
    return outputs_launch(BLOCK_SPARSE, block_sparse_inputs(q, k, v, mask, scale))[0]


def mask_lists(block_mask) -> tuple:
    """A BlockMask's lists as the kernels read them, in LAYOUT's order; one made without its full blocks
    apart (BlockMask.from_kv_blocks given none) has none: every listed block is partial, as FlexAttention
    reads it."""
    counts, indices = block_mask.kv_num_blocks, block_mask.kv_indices
    if block_mask.full_kv_num_blocks is None:
        return counts, indices, torch.zeros_like(counts), indices
    return counts, indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices


def block_sparse_inputs(q, k, v, mask: tuple, scale: float) -> dict:
    """The problem's inputs, as its run_stage takes them, of the ops' arguments (mask: MASK_ARGUMENTS)."""
    return dict(q=q, k=k, v=v, scale=scale, **dict(zip(MASK_ARGUMENTS, mask)))


class _BlockSparseAttention(torch.autograd.Function):
    """ops.block_sparse_attention's autograd in eager mode: the custom ops' launches, without their dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, scale, *mask):
        o, lse = outputs_launch(BLOCK_SPARSE, block_sparse_inputs(q, k, v, mask, scale))
        save_block_sparse(ctx, q, k, v, mask, scale, o, lse)
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse, mask, scale = saved_block_sparse(ctx)
        inputs = dict(block_sparse_inputs(q, k, v, mask, scale), o=o, lse=lse, do=grad_o)
        return *gradients_launch(BLOCK_SPARSE_BACKWARD, inputs), None, *(None,) * len(MASK_ARGUMENTS)


def save_block_sparse(ctx, q, k, v, mask: tuple, scale: float, o, lse) -> None:
    ctx.save_for_backward(q, k, v, o, lse, *mask[:5])  # the lists and the document ids (None where absent)
    ctx.element_mask, ctx.window, ctx.scale = mask[5], mask[6], scale


def saved_block_sparse(ctx) -> tuple:
    """(q, k, v, o, lse, mask, scale) as save_block_sparse saved them."""
    q, k, v, o, lse, *tensors = ctx.saved_tensors
    return q, k, v, o, lse, (*tensors, ctx.element_mask, ctx.window), ctx.scale


@torch.library.custom_op("flashmoe::block_sparse_attention_forward", mutates_args=())
def block_sparse_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_num_blocks: torch.Tensor,
                                   kv_indices: torch.Tensor, full_kv_num_blocks: torch.Tensor,
                                   full_kv_indices: torch.Tensor, document_ids: Optional[torch.Tensor],
                                   element_mask: str, window: int,
                                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of block-sparse attention over a BlockMask's four lists (see ops.block_sparse_attention;
    window 0 and document_ids None where the element mask has none)."""
    mask = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, document_ids, element_mask, window)
    refuse("flashmoe::block_sparse_attention_forward", block_sparse_input_problem(q, k, v, mask, BLOCK_SPARSE))
    return outputs_launch(BLOCK_SPARSE, block_sparse_inputs(q, k, v, mask, scale))


@block_sparse_attention_forward.register_fake
def _(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, document_ids, element_mask,
      window, scale):
    return outputs_like(q)


@torch.library.custom_op("flashmoe::block_sparse_attention_backward", mutates_args=())
def block_sparse_attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    o: torch.Tensor, lse: torch.Tensor, kv_num_blocks: torch.Tensor,
                                    kv_indices: torch.Tensor, full_kv_num_blocks: torch.Tensor,
                                    full_kv_indices: torch.Tensor, document_ids: Optional[torch.Tensor],
                                    element_mask: str, window: int,
                                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for the output's gradient grad_o (any strides) and the forward's o and lse."""
    mask = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, document_ids, element_mask, window)
    refuse("flashmoe::block_sparse_attention_backward", block_sparse_input_problem(q, k, v, mask, BLOCK_SPARSE_BACKWARD)
           or forward_results_problem(grad_o, q, o, lse))
    return gradients_launch(BLOCK_SPARSE_BACKWARD, dict(block_sparse_inputs(q, k, v, mask, scale), o=o, lse=lse,
                                                        do=grad_o))


@block_sparse_attention_backward.register_fake
def _(grad_o, q, k, v, o, lse, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, document_ids,
      element_mask, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_for_block_sparse_backward(ctx, inputs, output):
    q, k, v, *mask, scale = inputs
    save_block_sparse(ctx, q, k, v, tuple(mask), scale, *output)
    ctx.mark_non_differentiable(output[1])  # the LSE, as the dense attention's


def _block_sparse_gradients(ctx, grad_o, grad_lse):
    q, k, v, o, lse, mask, scale = saved_block_sparse(ctx)
    dq, dk, dv = block_sparse_attention_backward(grad_o, q, k, v, o, lse, *mask, scale)
    return dq, dk, dv, *(None,) * (len(MASK_ARGUMENTS) + 1)


block_sparse_attention_forward.register_autograd(_block_sparse_gradients,
                                                 setup_context=_save_for_block_sparse_backward)


def block_mask_problem(block_mask, seq_len: int) -> str | None:
    """What is wrong with a BlockMask for the kernels and a length S, in words; None if nothing."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(block_mask, BlockMask):
        return f"block_mask must be a FlexAttention BlockMask (create_block_mask); got {type(block_mask).__name__}"
    if tuple(block_mask.BLOCK_SIZE) != (BLOCK, BLOCK):
        return (f"the BlockMask's blocks must be {BLOCK} by {BLOCK} tokens, the kernels' tiles (create_block_mask's "
                f"default BLOCK_SIZE); got {tuple(block_mask.BLOCK_SIZE)}")
    if tuple(block_mask.kv_num_blocks.shape[:-1]) != (1, 1):
        return (f"the BlockMask must be one for every batch and head (create_block_mask(mask_mod, None, None, S, S)); "
                f"got one of batches and heads {tuple(block_mask.kv_num_blocks.shape[:-1])}")
    if tuple(block_mask.seq_lengths) != (seq_len, seq_len):
        return f"the BlockMask was made for lengths {tuple(block_mask.seq_lengths)}; q, k and v have S = {seq_len}"
    return None


def block_sparse_input_problem(q, k, v, mask: tuple, problem) -> str | None:
    """What is wrong with q, k, v and the mask's lists, element mask, window and document ids (MASK_ARGUMENTS)
    for the kernels, in words; None if nothing. The GPU last, then whether a stage solves `problem` on it."""
    return attention_input_problem(q, k, v) or mask_problem(q, k, mask, problem)


def mask_problem(q, k, mask: tuple, problem) -> str | None:
    """block_sparse_input_problem's checks after q, k and v's own (attention_input_problem)."""
    if q.shape[2] != k.shape[2]:
        return f"q, k and v must have one length S (self-attention); got q {list(q.shape)}, k {list(k.shape)}"
    arguments = dict(zip(MASK_ARGUMENTS, mask))
    lists = {name: arguments[name] for name in LAYOUT}
    ids = {} if arguments["document_ids"] is None else {"document_ids": arguments["document_ids"]}
    return mask_lists_problem(lists, q.shape[2]) or \
        element_mask_problem(arguments["element_mask"], arguments["window"], arguments["document_ids"], q.shape[2]) \
        or layout_problem({**lists, **ids}) or device_problem({"q": q, **lists, **ids}) or stage_problem(problem, q)


def mask_lists_problem(lists: dict, seq_len: int) -> str | None:
    """The four lists int32 tensors, [1, 1, Qb] (counts) and [1, 1, Qb, Qb] (indices), Qb = ⌈S / BLOCK⌉."""
    if not all(isinstance(t, torch.Tensor) for t in lists.values()):
        return f"{', '.join(LAYOUT)} must be tensors"
    blocks = -(-seq_len // BLOCK)
    expected = {name: (1, 1, blocks) if "num" in name else (1, 1, blocks, blocks) for name in LAYOUT}
    if any(tuple(t.shape) != expected[name] or t.dtype != torch.int32 for name, t in lists.items()):
        got = ", ".join(f"{name} {t.dtype} {list(t.shape)}" for name, t in lists.items())
        return (f"the block mask's lists must be int32, counts [1, 1, {blocks}] and indices [1, 1, {blocks}, "
                f"{blocks}] for S = {seq_len} in blocks of {BLOCK}; got {got}")
    return None


def element_mask_problem(element_mask, window, document_ids, seq_len: int) -> str | None:
    """The element mask one of ELEMENT_MASKS, with a window (int >= 1) for "sliding_window" alone and
    document ids (int32 [S]) for "document" alone."""
    if element_mask not in ELEMENT_MASKS:
        return f"element_mask must be one of {', '.join(map(repr, ELEMENT_MASKS))}; got {element_mask!r}"
    if element_mask == "sliding_window":
        if isinstance(window, bool) or not isinstance(window, (int, torch.SymInt)) or window < 1:
            return (f"element_mask 'sliding_window' needs window, an int of at least 1 (0 <= i - j < window); "
                    f"got {window!r}")
    elif window:
        return f"window is for element_mask 'sliding_window' alone; got window {window!r} with {element_mask!r}"
    if element_mask != "document":
        return None if document_ids is None else \
            f"document_ids are for element_mask 'document' alone; got them with {element_mask!r}"
    if not isinstance(document_ids, torch.Tensor) or document_ids.dtype != torch.int32 or \
            tuple(document_ids.shape) != (seq_len,):
        got = f"{document_ids.dtype} {list(document_ids.shape)}" if isinstance(document_ids, torch.Tensor) else \
            repr(document_ids)
        return f"element_mask 'document' needs document_ids, int32 [S] = [{seq_len}], each token's document; got {got}"
    return None


_RUNS_HERE: dict = {}  # (problem, GPU) -> why no course stage solves it there, or None


def stage_problem(problem, tensor: torch.Tensor) -> str | None:
    """Why no course stage solves `problem` on the GPU of `tensor`, in one line; None if one does. Asked once
    per GPU; a traced call (fake tensors, Dynamo) is asked when its op runs."""
    if torch.compiler.is_compiling() or type(tensor) is not torch.Tensor:
        return None
    key = (problem.name, tensor.device.index)
    if key not in _RUNS_HERE:
        try:
            fastest_stage_on(problem.name, tensor.device.index)
            _RUNS_HERE[key] = None
        except RuntimeError as error:
            _RUNS_HERE[key] = str(error)
    return _RUNS_HERE[key]


# ================================================================ the MoE layer

def moe_layer(x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, top_k: int,
              router_bias: torch.Tensor | None = None, return_topk_ids: bool = False):
    """reference/moe_layer.py's layer (Mixtral-style, SwiGLU experts), differentiable on sm_90a:

        logits = x · router_weight + router_bias (fp32); each token's top_k experts by logit, weighted by
        the softmax of their logits; out[t] = Σ_j w[t, j] · (silu(x[t]·W1[e][:, :I]) * (x[t]·W1[e][:, I:])) · W2[e]

    x [T, hidden], router_weight [hidden, E] (the transpose of an nn.Linear(hidden, E)'s weight),
    w1 [E, hidden, 2·I] (gate half, then up half), w2 [E, I, hidden]: contiguous, all float16 or all
    bfloat16, on one CUDA GPU; router_bias fp32 [E] or None (0); hidden and I multiples of 8, at least 64;
    E <= 256, 1 <= top_k <= min(E, 8). Returns out [T, hidden] in x's dtype, and with return_topk_ids also
    each token's experts, int32 [T, top_k] by decreasing logit.

    A backward through `out` gives the gradients of x, router_weight, router_bias, w1 and w2 (those that
    require grad), in their dtypes, by stage 14 (reference/moe_layer_backward.py), which runs on sm_90a
    alone (an H100 or H200): elsewhere the backward raises one ValueError. Where a gradient is wanted, the
    forward keeps what the backward reads (reference/moe_layer_backward.Saved): the routing, and h1 = x·W1
    per token-slot, [T·k + E·127, 2·I] in the dtype. No gradient flows through the discrete top-k choice.
    The layer returns no load-balancing loss, so the backward adds none (aux_coef 0): a model that wants
    one computes it in PyTorch from the router's logits and the returned topk_ids
    (reference.moe.balance_loss), and autograd adds its gradient to x's and the router's."""
    refuse("ops.moe_layer", moe_layer_input_problem(x, router_weight, router_bias, w1, w2, top_k))
    top_k = int(top_k)
    wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                             for t in (x, router_weight, router_bias, w1, w2))
    if not plain_eager(x, router_weight, w1, w2):
        layer = moe_layer_saving if wanted else moe_layer_op
        out, topk_ids = layer(x, router_weight, router_bias, w1, w2, top_k)[:2]
    elif wanted:
        out, topk_ids = _MoeLayer.apply(x, router_weight, router_bias, w1, w2, top_k)
    else:
        out, topk_ids = moe_forward(x, router_weight, router_bias, w1, w2, top_k)
    return (out, topk_ids) if return_topk_ids else out


class _MoeLayer(torch.autograd.Function):
    """ops.moe_layer's autograd in eager mode: the custom ops' launches, without their dispatch."""

    @staticmethod
    def forward(ctx, x, router_weight, router_bias, w1, w2, top_k):
        out, saved = moe_saving_launch(x, router_weight, router_bias, w1, w2, top_k)
        ctx.save_for_backward(x, router_weight, w1, w2, *saved)
        ctx.mark_non_differentiable(saved.topk_ids)
        return out, saved.topk_ids

    @staticmethod
    def backward(ctx, grad_out, grad_topk_ids):
        x, router_weight, w1, w2, *saved = ctx.saved_tensors
        refuse("ops.moe_layer", moe_backward_gpu_problem(x.device.index))
        gradients = moe_backward_launch(grad_out, x, router_weight, w1, w2, Saved(*saved))
        return *wanted_gradients(ctx, gradients), None


def wanted_gradients(ctx, gradients: tuple) -> tuple:
    """(dx, dwr, dbias, dw1, dw2) with None for each input that needs none: one that does not require grad,
    a router_bias of None."""
    return tuple(g if needed else None for g, needed in zip(gradients, ctx.needs_input_grad))


def moe_launch(x, router_weight, router_bias, w1, w2, top_k: int, save: bool = False) -> tuple:
    """(out, topk_ids) by the fastest MoE layer stage, for inputs already checked; with save, (out, Saved):
    the forward of a backward (the problem's forward_for_backward, stage 7's launch with save=True)."""
    out = torch.empty_like(x)
    topk_ids = torch.empty(x.shape[0], top_k, dtype=torch.int32, device=x.device)
    layer = (MOE_LAYER, dict(x=x, wr=router_weight, bias=router_bias, w1=w1, w2=w2, top_k=top_k),
             dict(out=out, topk_ids=topk_ids))
    if not save:
        launch_fastest(*layer)
        return out, topk_ids
    found = launch_fastest(*layer, saving=True)
    return out, Saved(*(found[name] for name in Saved._fields))


def moe_saving_launch(x, router_weight, router_bias, w1, w2, top_k: int) -> tuple[torch.Tensor, Saved]:
    """(out, Saved) of the layer for its backward, for inputs already checked. On a GPU where no stage runs
    the backward (off sm_90a, where stage 7's rung cannot save), the forward alone and Saved's tensors
    unwritten: the backward refuses there before it reads them."""
    if moe_backward_gpu_problem(x.device.index):
        out, topk_ids = moe_launch(x, router_weight, router_bias, w1, w2, top_k)
        return out, saved_like(x, router_weight, w1, topk_ids)
    return moe_launch(x, router_weight, router_bias, w1, w2, top_k, save=True)


def saved_specs(x, router_weight, w1, top_k: int) -> dict:
    """{field of Saved: (dtype, shape)} of what the forward on x saves: the permuted buffers hold
    moe.padded_capacity(T, E, k, 128) rows, stage 7's."""
    (tokens, _), experts = x.shape, router_weight.shape[1]
    rows = moe.padded_capacity(tokens, experts, top_k, MOE_BLOCK)
    f32, i32 = torch.float32, torch.int32
    return dict(topk_ids=(i32, (tokens, top_k)), topk_weights=(f32, (tokens, top_k)), logits=(f32, (tokens, experts)),
                expert_counts=(i32, (experts,)), expert_offsets=(i32, (experts + 1,)), dest=(i32, (tokens, top_k)),
                source_token=(i32, (rows,)), h1=(x.dtype, (rows, w1.shape[2])))


def saved_like(x, router_weight, w1, topk_ids) -> Saved:
    """A Saved for the forward on x that chose topk_ids, its other tensors unwritten (the saving op's fake)."""
    specs = saved_specs(x, router_weight, w1, topk_ids.shape[1])
    return Saved(topk_ids, *(x.new_empty(shape, dtype=dtype) for name, (dtype, shape) in specs.items()
                             if name != "topk_ids"))


# A small call without gradients (decoding, a short prompt) costs the GPU well under a millisecond, and the
# host about 230 µs (measured on the H100, 2026-11-27: ten launches, their allocations and tensor maps):
# the host decides. From the second call of a shape with the same weights on, such a call replays a
# CUDA graph of the launches instead: one copy in, one replay, two copies out.
MOE_GRAPH_TOKENS = 512  # calls of at most this many tokens
MOE_GRAPHS = 8          # graphs kept, the least recently replayed dropped first: each holds its own buffers
MOE_SEEN = 64           # keys remembered as seen once (a shape seen once may never come again)
_MOE_GRAPHS: OrderedDict = OrderedDict()  # key -> MoeGraph
_MOE_SEEN: OrderedDict = OrderedDict()    # key -> None


class MoeGraph:
    """The layer's launches for one input shape and one set of weights, captured in a CUDA graph: each call
    copies x into the graph's input and its outputs out (the caller keeps them; the next replay overwrites
    the graph's). The weights are read where they lie at each replay: updated in place, they are used."""

    def __init__(self, x, router_weight, router_bias, w1, w2, top_k: int):
        self.x = x.clone()
        with torch.cuda.device(x.device):
            moe_launch(self.x, router_weight, router_bias, w1, w2, top_k)  # first launches: compiles, checks
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # allocations inside come from the graph's own pool
                self.out, self.topk_ids = moe_launch(self.x, router_weight, router_bias, w1, w2, top_k)

    def __call__(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        self.x.copy_(x)
        self.graph.replay()
        return self.out.clone(), self.topk_ids.clone()


def moe_forward(x, router_weight, router_bias, w1, w2, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, topk_ids) without gradients, for inputs already checked: launched, or replayed from a graph for a
    small call seen before (never while the caller captures a graph of its own)."""
    if not graphs_apply(x):
        return moe_launch(x, router_weight, router_bias, w1, w2, top_k)
    key = moe_graph_key(x, router_weight, router_bias, w1, w2, top_k)
    graph = _MOE_GRAPHS.get(key)
    if graph is None:
        if key not in _MOE_SEEN:
            remember(_MOE_SEEN, key, None, MOE_SEEN)
            return moe_launch(x, router_weight, router_bias, w1, w2, top_k)
        graph = MoeGraph(x, router_weight, router_bias, w1, w2, top_k)
    remember(_MOE_GRAPHS, key, graph, MOE_GRAPHS)
    return graph(x)


def graphs_apply(x) -> bool:
    """Whether a call on x may replay a graph: a small call on a GPU, outside a capture of the caller's."""
    return x.is_cuda and x.shape[0] <= MOE_GRAPH_TOKENS and not torch.cuda.is_current_stream_capturing()


def moe_graph_key(x, router_weight, router_bias, w1, w2, top_k: int) -> tuple:
    """What a graph is for: x's shape, dtype and GPU, top_k, and where each weight lies and its shape."""
    weights = tuple(None if t is None else (t.data_ptr(), tuple(t.shape)) for t in (router_weight, router_bias, w1, w2))
    return tuple(x.shape), x.dtype, x.device.index, top_k, weights


def remember(cache: OrderedDict, key, value, size: int) -> None:
    """cache[key] = value as the most recent entry, the least recent dropped beyond `size`."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


def moe_backward_launch(grad_out, x, router_weight, w1, w2, saved: Saved) -> tuple:
    """(dx, dwr, dbias, dw1, dw2) by the fastest MoE backward stage, for inputs already checked: the
    problem's inputs, what the forward saved under Saved's field names, and no load-balancing loss
    (aux_coef 0: ops.moe_layer returns none)."""
    inputs = dict(x=x, wr=router_weight, w1=w1, w2=w2, dy=grad_out.contiguous(), aux_coef=0.0, **saved._asdict())
    gradients = empty_moe_gradients(x, router_weight, w1, w2)
    launch_fastest(MOE_LAYER_BACKWARD, inputs, dict(zip(MOE_LAYER_BACKWARD.outputs, gradients)))
    return gradients


def empty_moe_gradients(x, router_weight, w1, w2) -> tuple:
    """dx, dwr, dbias (fp32 [E]), dw1, dw2, unwritten (the real op's and its fake's)."""
    dbias = x.new_empty(router_weight.shape[1], dtype=torch.float32)
    return torch.empty_like(x), torch.empty_like(router_weight), dbias, torch.empty_like(w1), torch.empty_like(w2)


@torch.library.custom_op("flashmoe::moe_layer", mutates_args=())
def moe_layer_op(x: torch.Tensor, router_weight: torch.Tensor, router_bias: Optional[torch.Tensor],
                 w1: torch.Tensor, w2: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, topk_ids) of the MoE layer: see ops.moe_layer."""
    refuse("flashmoe::moe_layer", moe_layer_input_problem(x, router_weight, router_bias, w1, w2, top_k))
    return moe_launch(x, router_weight, router_bias, w1, w2, top_k)


@moe_layer_op.register_fake
def _(x, router_weight, router_bias, w1, w2, top_k):
    return torch.empty_like(x), x.new_empty((x.shape[0], top_k), dtype=torch.int32)


@torch.library.custom_op("flashmoe::moe_layer_saving", mutates_args=())
def moe_layer_saving(x: torch.Tensor, router_weight: torch.Tensor, router_bias: Optional[torch.Tensor],
                     w1: torch.Tensor, w2: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, torch.Tensor, torch.Tensor,
                                                                              torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, *Saved) of the MoE layer, differentiable in out: see ops.moe_layer. Saved's tensors (the
    routing, the permutation, h1) are the backward's inputs."""
    refuse("flashmoe::moe_layer_saving", moe_layer_input_problem(x, router_weight, router_bias, w1, w2, top_k))
    out, saved = moe_saving_launch(x, router_weight, router_bias, w1, w2, top_k)
    # stage 7's counts and offsets are views of one buffer, and a custom op's outputs may not alias
    return out, *saved._replace(expert_offsets=saved.expert_offsets.clone())


@moe_layer_saving.register_fake
def _(x, router_weight, router_bias, w1, w2, top_k):
    topk_ids = x.new_empty((x.shape[0], top_k), dtype=torch.int32)
    return torch.empty_like(x), *saved_like(x, router_weight, w1, topk_ids)


@torch.library.custom_op("flashmoe::moe_layer_backward", mutates_args=())
def moe_layer_backward(grad_out: torch.Tensor, x: torch.Tensor, router_weight: torch.Tensor, w1: torch.Tensor,
                       w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, logits: torch.Tensor,
                       expert_counts: torch.Tensor, expert_offsets: torch.Tensor, dest: torch.Tensor,
                       source_token: torch.Tensor, h1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                             torch.Tensor, torch.Tensor]:
    """(dx, dwr, dbias, dw1, dw2) for out's gradient grad_out (any strides) and what flashmoe::moe_layer_saving
    saved (Saved's fields, in order), with no load-balancing loss; dbias fp32 [E]."""
    saved = Saved(topk_ids, topk_weights, logits, expert_counts, expert_offsets, dest, source_token, h1)
    refuse("flashmoe::moe_layer_backward", moe_layer_backward_input_problem(grad_out, x, router_weight, w1, w2, saved))
    return moe_backward_launch(grad_out, x, router_weight, w1, w2, saved)


@moe_layer_backward.register_fake
def _(grad_out, x, router_weight, w1, w2, *saved):
    return empty_moe_gradients(x, router_weight, w1, w2)


def _save_for_moe_layer_backward(ctx, inputs, output):
    x, router_weight, _, w1, w2, _ = inputs
    ctx.save_for_backward(x, router_weight, w1, w2, *output[1:])  # and Saved's tensors
    ctx.mark_non_differentiable(*output[1:])


def _moe_layer_gradients(ctx, grad_out, *grad_saved):
    return *wanted_gradients(ctx, moe_layer_backward(grad_out, *ctx.saved_tensors)), None


moe_layer_saving.register_autograd(_moe_layer_gradients, setup_context=_save_for_moe_layer_backward)


def moe_layer_input_problem(x, router_weight, router_bias, w1, w2, top_k, saved: Saved | None = None) -> str | None:
    """What is wrong with the MoE layer's inputs for stage 7, in words; None if nothing (the GPU last). With
    `saved` (the backward's check), also what the forward saved, shaped as saved_specs says."""
    tensors = {"x": x, "router_weight": router_weight, "w1": w1, "w2": w2}
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()) or \
            not (router_bias is None or isinstance(router_bias, torch.Tensor)):
        return "x, router_weight, w1 and w2 must be tensors, router_bias a tensor or None"
    shapes = ", ".join(f"{name} {list(t.shape)}" for name, t in tensors.items())
    dims = [t.dim() for t in tensors.values()]
    if dims != [2, 2, 3, 3] or not (x.shape[1] == router_weight.shape[0] == w1.shape[1] == w2.shape[2]) or \
            not (router_weight.shape[1] == w1.shape[0] == w2.shape[0]) or w1.shape[2] != 2 * w2.shape[1]:
        return (f"expected x [T, hidden], router_weight [hidden, E], w1 [E, hidden, 2·I], w2 [E, I, hidden]; "
                f"got {shapes}")
    (tokens, hidden), (experts, inter) = x.shape, (w2.shape[0], w2.shape[1])
    if tokens == 0 or experts == 0:
        return f"every dimension must be at least 1; got {shapes}"
    if x.dtype not in MOE_DTYPES or not x.dtype == router_weight.dtype == w1.dtype == w2.dtype:
        dtypes = ", ".join(f"{name} {t.dtype}" for name, t in tensors.items())
        return f"x, router_weight, w1 and w2 must all be {' or all '.join(MOE_DTYPES.values())}; got {dtypes}"
    if router_bias is not None and (router_bias.shape != (experts,) or router_bias.dtype != torch.float32):
        return f"router_bias must be float32 [E] = [{experts}]; got {router_bias.dtype} {list(router_bias.shape)}"
    if hidden % 8 or inter % 8 or min(hidden, inter) < MOE_MIN_DIM:
        return f"hidden and I must be multiples of 8, at least {MOE_MIN_DIM}; got hidden {hidden}, I {inter}"
    if experts > MAX_EXPERTS:
        return f"at most {MAX_EXPERTS} experts; got {experts}"
    if isinstance(top_k, bool) or not isinstance(top_k, (int, torch.SymInt)) or \
            not 1 <= top_k <= min(experts, MAX_TOP_K):
        return f"top_k must be an int from 1 to min(E, {MAX_TOP_K}) = {min(experts, MAX_TOP_K)}; got {top_k!r}"
    if router_bias is not None:
        tensors["router_bias"] = router_bias
    if saved is not None:
        specs, tensors = saved_specs(x, router_weight, w1, top_k), {**tensors, **saved._asdict()}
        if wrong := [name for name, t in saved._asdict().items() if (t.dtype, tuple(t.shape)) != specs[name]]:
            expected = ", ".join(f"{n} {specs[n][0]} {list(specs[n][1])}" for n in wrong)
            return (f"expected what the forward saves, {expected}; "
                    f"got {', '.join(f'{n} {tensors[n].dtype} {list(tensors[n].shape)}' for n in wrong)}")
    return layout_problem(tensors) or device_problem(tensors)


def moe_layer_backward_input_problem(grad_out, x, router_weight, w1, w2, saved: Saved) -> str | None:
    """grad_out and the saved tensors as the forward gives them for x (saved_specs), moe_layer_input_problem,
    and a GPU that runs the backward (the GPU last)."""
    topk_ids = saved.topk_ids
    if not all(isinstance(t, torch.Tensor) for t in (grad_out, x, *saved)) or topk_ids.dim() != 2:
        return f"grad_out, x and {', '.join(Saved._fields)} must be tensors, topk_ids [T, top_k]"
    if grad_out.shape != x.shape or grad_out.dtype != x.dtype or topk_ids.shape[0] != x.shape[0]:
        return (f"expected grad_out of x's shape {list(x.shape)} and dtype {x.dtype}, topk_ids [T, top_k]; "
                f"got grad_out {grad_out.dtype} {list(grad_out.shape)}, topk_ids {list(topk_ids.shape)}")
    return moe_layer_input_problem(x, router_weight, None, w1, w2, topk_ids.shape[1], saved) or \
        device_problem({"x": x, "grad_out": grad_out}) or moe_backward_gpu_problem(x.device.index)


@functools.cache
def moe_backward_gpu_problem(device_index: int) -> str | None:
    """Why no course stage runs the MoE layer's backward on this GPU, in words; None where one does (stage 14,
    on sm_90a alone)."""
    try:
        fastest_stage_on(MOE_LAYER_BACKWARD.name, device_index)
    except RuntimeError as error:
        return f"the MoE layer's backward needs an H100 or H200 (sm_90a, where stage 14 runs); {error}"
    return None


# ================================================================ shared checks and the launch

def refuse(who: str, problem: str | None) -> None:
    """ValueError "who: problem", in one line, where there is a problem."""
    if problem:
        raise ValueError(f"{who}: {problem}")


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
    """problem.run_stage (the grader's call) of the fastest stage solving `problem` on the GPU of its
    primary input, compiled for the variant the inputs need (problem.variant: dtype, head dimension). With
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


def fastest_stage_on(problem: str, device_index: int) -> tuple[stages.Stage, str]:
    return stages.ops_stage(problem, torch.cuda.get_device_properties(device_index))


def _load(key: tuple, problem, device_index: int, variant: dict) -> tuple:
    """The fastest stage's kernels for one variant's -D macros, compiled (or read from the disk cache) and
    loaded on one GPU."""
    from cuda.core import Device

    stage, arch = fastest_stage_on(problem.name, device_index)
    cubin = compile_cubin(stage.source_path, arch, stage.defines(variant))
    Device(device_index).set_current()  # as the grader's worker does: PyTorch's own (primary) context
    _LOADED[key] = stage, KernelSet(cubin.path, stage.kernels)
    return _LOADED[key]
