"""ops.block_sparse_attention: attention over a FlexAttention BlockMask and its gradients (stages 12 and 13,
sm_90a's alone), its custom ops flashmoe::block_sparse_attention_forward and _backward, and the checks of the
BlockMask and the element mask; q, k and v are checked as ops.attention's (stages/ops/dense.py)."""
from __future__ import annotations

import math
from typing import Optional

import torch

import reference
from reference.block_sparse_attention import BLOCK, ELEMENT_MASKS, LAYOUT
from stages.ops import dense, shared

BLOCK_SPARSE = reference.load("block_sparse_attention")
BLOCK_SPARSE_BACKWARD = reference.load("block_sparse_attention_backward")
BLOCK_SPARSE_CALLER = "ops.block_sparse_attention"
# the block-sparse ops' arguments after q, k and v (scale last): the problem's mask inputs
MASK_ARGUMENTS = (*LAYOUT, "document_ids", "element_mask", "window")
# q, k and v are checked as attention's
assert BLOCK_SPARSE.parameters["D"] == dense.HEAD_DIMS and BLOCK_SPARSE.dtypes == dense.ATTENTION.dtypes


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
    shared.refuse(BLOCK_SPARSE_CALLER,
                  dense.attention_input_problem(q, k, v) or block_mask_problem(block_mask, q.shape[2]))
    mask = (*mask_lists(block_mask), document_ids, element_mask, 0 if window is None else window)
    shared.refuse(BLOCK_SPARSE_CALLER, mask_problem(q, k, mask, BLOCK_SPARSE))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if not shared.plain_eager(q, k, v, *(t for t in mask[:5] if t is not None)):
        return block_sparse_attention_forward(q, k, v, *mask, scale)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _BlockSparseAttention.apply(q, k, v, scale, *mask)
    return dense.outputs_launch(BLOCK_SPARSE, block_sparse_inputs(q, k, v, mask, scale))[0]


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
        o, lse = dense.outputs_launch(BLOCK_SPARSE, block_sparse_inputs(q, k, v, mask, scale))
        save_block_sparse(ctx, q, k, v, mask, scale, o, lse)
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse, mask, scale = saved_block_sparse(ctx)
        inputs = dict(block_sparse_inputs(q, k, v, mask, scale), o=o, lse=lse, do=grad_o)
        return *dense.gradients_launch(BLOCK_SPARSE_BACKWARD, inputs), None, *(None,) * len(MASK_ARGUMENTS)


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
    shared.refuse("flashmoe::block_sparse_attention_forward", block_sparse_input_problem(q, k, v, mask, BLOCK_SPARSE))
    return dense.outputs_launch(BLOCK_SPARSE, block_sparse_inputs(q, k, v, mask, scale))


@block_sparse_attention_forward.register_fake
def _(q, k, v, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, document_ids, element_mask,
      window, scale):
    return dense.outputs_like(q)


@torch.library.custom_op("flashmoe::block_sparse_attention_backward", mutates_args=())
def block_sparse_attention_backward(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    o: torch.Tensor, lse: torch.Tensor, kv_num_blocks: torch.Tensor,
                                    kv_indices: torch.Tensor, full_kv_num_blocks: torch.Tensor,
                                    full_kv_indices: torch.Tensor, document_ids: Optional[torch.Tensor],
                                    element_mask: str, window: int,
                                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for the output's gradient grad_o (any strides) and the forward's o and lse."""
    mask = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, document_ids, element_mask, window)
    shared.refuse("flashmoe::block_sparse_attention_backward",
                  block_sparse_input_problem(q, k, v, mask, BLOCK_SPARSE_BACKWARD)
                  or dense.forward_results_problem(grad_o, q, o, lse))
    return dense.gradients_launch(BLOCK_SPARSE_BACKWARD, dict(block_sparse_inputs(q, k, v, mask, scale), o=o, lse=lse,
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
    return dense.attention_input_problem(q, k, v) or mask_problem(q, k, mask, problem)


def mask_problem(q, k, mask: tuple, problem) -> str | None:
    """block_sparse_input_problem's checks after q, k and v's own (dense.attention_input_problem)."""
    if q.shape[2] != k.shape[2]:
        return f"q, k and v must have one length S (self-attention); got q {list(q.shape)}, k {list(k.shape)}"
    arguments = dict(zip(MASK_ARGUMENTS, mask))
    lists = {name: arguments[name] for name in LAYOUT}
    ids = {} if arguments["document_ids"] is None else {"document_ids": arguments["document_ids"]}
    return mask_lists_problem(lists, q.shape[2]) or \
        element_mask_problem(arguments["element_mask"], arguments["window"], arguments["document_ids"], q.shape[2]) \
        or shared.layout_problem({**lists, **ids}) or shared.device_problem({"q": q, **lists, **ids}) \
        or shared.stage_problem(problem, q)


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

