"""ops.moe_layer: the MoE layer (stage 7, or its mma_sync rung off sm_90a) and its gradients (stage 14, sm_90a's
alone), its custom ops flashmoe::moe_layer, moe_layer_saving and moe_layer_backward, its checks, and the CUDA
graphs that small calls without gradients replay."""
from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Optional

import torch

import reference
from reference import moe
from reference.moe_experts import BLOCK as MOE_BLOCK
from reference.moe_layer_backward import Saved
from stages.common.moe import MAX_EXPERTS, MAX_TOP_K
from stages.ops import shared

MOE_LAYER = reference.load("moe_layer")  # the problems the op solves: their dtypes, run_stage
MOE_LAYER_BACKWARD = reference.load("moe_layer_backward")
MOE_DTYPES = {getattr(torch, name): name for name in MOE_LAYER.dtypes}
MOE_MIN_DIM = 64   # hidden and inter: multiples of 8 (16-byte rows, TMA strides), at least a 64-wide tile


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
    shared.refuse("ops.moe_layer", moe_layer_input_problem(x, router_weight, router_bias, w1, w2, top_k))
    top_k = int(top_k)
    wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                             for t in (x, router_weight, router_bias, w1, w2))
    if not shared.plain_eager(x, router_weight, w1, w2):
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
        shared.refuse("ops.moe_layer", moe_backward_gpu_problem(x.device.index))
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
        shared.launch_fastest(*layer)
        return out, topk_ids
    found = shared.launch_fastest(*layer, saving=True)
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
    shared.launch_fastest(MOE_LAYER_BACKWARD, inputs, dict(zip(MOE_LAYER_BACKWARD.outputs, gradients)))
    return gradients


def empty_moe_gradients(x, router_weight, w1, w2) -> tuple:
    """dx, dwr, dbias (fp32 [E]), dw1, dw2, unwritten (the real op's and its fake's)."""
    dbias = x.new_empty(router_weight.shape[1], dtype=torch.float32)
    return torch.empty_like(x), torch.empty_like(router_weight), dbias, torch.empty_like(w1), torch.empty_like(w2)


@torch.library.custom_op("flashmoe::moe_layer", mutates_args=())
def moe_layer_op(x: torch.Tensor, router_weight: torch.Tensor, router_bias: Optional[torch.Tensor],
                 w1: torch.Tensor, w2: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, topk_ids) of the MoE layer: see ops.moe_layer."""
    shared.refuse("flashmoe::moe_layer", moe_layer_input_problem(x, router_weight, router_bias, w1, w2, top_k))
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
    shared.refuse("flashmoe::moe_layer_saving", moe_layer_input_problem(x, router_weight, router_bias, w1, w2, top_k))
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
    shared.refuse("flashmoe::moe_layer_backward",
                  moe_layer_backward_input_problem(grad_out, x, router_weight, w1, w2, saved))
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
    return shared.layout_problem(tensors) or shared.device_problem(tensors)


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
        shared.device_problem({"x": x, "grad_out": grad_out}) or moe_backward_gpu_problem(x.device.index)


@functools.cache
def moe_backward_gpu_problem(device_index: int) -> str | None:
    """Why no course stage runs the MoE layer's backward on this GPU, in words; None where one does (stage 14,
    on sm_90a alone)."""
    try:
        shared.ops_stage_on(MOE_LAYER_BACKWARD.name, device_index)
    except RuntimeError as error:
        return f"the MoE layer's backward needs an H100 or H200 (sm_90a, where stage 14 runs); {error}"
    return None

