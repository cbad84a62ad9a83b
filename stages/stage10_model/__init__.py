"""Stage 10 — the whole model: a Llama/Mixtral-style decoder from the course's kernels, in one CUDA graph

reference/model.py's model (prefill, token embeddings to the last hidden state) with the course's attention
(stages.ops: stage 4 on sm_90a, stage 3 elsewhere; GQA in the kernel) and MoE layer (stage 7), cuBLAS for the
dense projections, and this stage's own kernels (model.cu) for every chain of small operations between them:
the residual add fused with the next RMSNorm (where cuBLAS does not add it: the dense projections into the
residual stream add in their epilogue), the QKV split with RoPE into the attention's layout, SwiGLU. The
attention writes its output in the [B, S, H, D] layout the output projection reads.
The whole forward is captured once in a CUDA graph and replayed: one launch from Python per forward
instead of ~10 per layer, its intermediate buffers reused on every replay, no host synchronization.
"""
import math

import torch

from reference.model import rope_cos_sin
from stages import OPS_STAGES, Goal, Stage
from stages.common.launcher import param_struct

VECTOR = 8            # model.cu: the elements a thread of add_rmsnorm or swiglu moves at once (16 bytes)
ROPE_THREADS = 256    # rope_split: a thread per VECTOR pairs of a query or key head
SWIGLU_THREADS = 256  # swiglu: a thread per VECTOR columns
# rope_split's parameters, as model.cu's RopeParams holds them (the grader checks the layout against it).
RopeParams = param_struct("RopeParams", [
    ("qkv", "const elem_t*"), ("cos", "const elem_t*"), ("sin", "const elem_t*"), ("q", "elem_t*"), ("k", "elem_t*"),
    ("seq", "int"), ("heads", "int"), ("kv_heads", "int"), ("items", "long long")])


def add_rmsnorm(kernels, h, delta, weight, normed, eps):
    """h += delta (if delta is not None), normed = RMSNorm(h) · weight: [tokens, hidden] rows, in one launch: a
    block per row, a thread per VECTOR elements, whole warps."""
    hidden = h.shape[-1]
    threads = 32 * -(-hidden // (32 * VECTOR))
    kernels.add_rmsnorm((h.numel() // hidden,), (threads,), h, 0 if delta is None else delta, weight, normed,
                        hidden, float(eps))  # 0: a null pointer, nothing to add


def rope_split(kernels, qkv, cos, sin, batch, seq, heads, kv_heads, head_dim):
    """qkv [tokens, (H + 2·KV)·D] -> q [B, H, S, D] and k [B, KV, S, D] turned by RoPE, and v [B, KV, S, D]: a
    view of qkv's value columns (the attention takes any strides with D contiguous), not a copy."""
    q = qkv.new_empty(batch, heads, seq, head_dim)
    k = qkv.new_empty(batch, kv_heads, seq, head_dim)
    items = batch * seq * (heads + kv_heads) * head_dim // (2 * VECTOR)  # VECTOR pairs of a turned head each
    kernels.rope_split((-(-items // ROPE_THREADS),), (ROPE_THREADS,),
                       RopeParams(qkv=qkv, cos=cos, sin=sin, q=q, k=k, seq=seq, heads=heads, kv_heads=kv_heads,
                                  items=items))
    v = qkv.view(batch, seq, heads + 2 * kv_heads, head_dim)[:, :, heads + kv_heads:].transpose(1, 2)
    return q, k, v


def swiglu(kernels, g, inter):
    """SiLU(g[:, :I]) · g[:, I:] for the MLP's first projection g [tokens, 2·I]."""
    act = g.new_empty(g.shape[0], inter)
    vectors = act.numel() // VECTOR
    kernels.swiglu((-(-vectors // SWIGLU_THREADS),), (SWIGLU_THREADS,), g, act, inter, vectors)  # a long long
    return act


def check_widths(config) -> None:
    """The kernels' vectors tile every row: one line otherwise, before any launch."""
    hidden, inter = config["hidden"], config["inter"]
    if hidden % VECTOR or inter % VECTOR or hidden > 1024 * VECTOR:
        raise ValueError(f"stage 10 needs hidden and inter multiples of {VECTOR} and hidden <= {1024 * VECTOR}; "
                         f"got hidden {hidden}, inter {inter}")


def causal_attention(layer, q, k, v):
    """The prefill's attention: q [B, H, S, D] over k and v [B, KV, S, D] of the same S tokens, causal, by
    ops.attention, whose output lies in memory as [B, S, H, D]. (`layer`: which layer asks; unused here.)"""
    from stages import ops  # the course's attention as an op (compiled on first use)

    return ops.attention(q, k, v, causal=True, scale=1.0 / math.sqrt(q.shape[-1]))


def forward(kernels, x, weights, config, out, rope, attend=causal_attention):
    """The model, launch by launch on the current stream: what the CUDA graph captures. `rope`: RoPE's (cos,
    sin) tables for x's positions (rope_tables), made once outside the graph: they depend on no input.
    attend(layer, q, k, v): each layer's attention of q [B, H, S, D] (RoPE turned) given its k, v [B, KV, S, D],
    returning o [B, H, S, D]; a generator's attend keeps k and v in its KV cache and attends over that."""
    from stages import ops  # the course's MoE layer as an op (compiled on first use)

    L, H, KV, I, E = (config[k] for k in ("layers", "heads", "kv_heads", "inter", "experts"))
    B, S, hidden = x.shape
    D, T, eps = hidden // H, B * S, config["eps"]
    cos, sin = rope
    h = x.reshape(T, hidden).clone()  # the residual stream, updated in place (cuBLAS's addmm_, add_rmsnorm)
    normed = torch.empty_like(h)
    delta = None                      # the branch output still to add to h
    for l in range(L):
        add_rmsnorm(kernels, h, delta, weights["attn_norm"][l], normed, eps)
        q, k, v = rope_split(kernels, normed @ weights["wqkv"][l], cos, sin, B, S, H, KV, D)
        o = attend(l, q, k, v)  # ops.attention's o lies in memory as [B, S, H, D]; decode's S is 1
        # h += o·Wo in cuBLAS's epilogue (beta = 1): the product never goes to memory on its own
        h.addmm_(o.transpose(1, 2).reshape(T, H * D), weights["wo"][l])  # the reshape is a view: no copy
        add_rmsnorm(kernels, h, None, weights["mlp_norm"][l], normed, eps)
        if E:
            delta = ops.moe_layer(normed, weights["wr"][l], weights["w1"][l], weights["w2"][l], config["top_k"])
        else:
            h.addmm_(swiglu(kernels, normed @ weights["w1"][l], I), weights["w2"][l])
            delta = None
    add_rmsnorm(kernels, h, delta, weights["norm"], out.view(T, hidden), eps)


def rope_tables(x, config):
    """RoPE's cos and sin [S, D] for x [B, S, hidden]: what every layer's rope_split reads."""
    return rope_cos_sin(x.shape[1], x.shape[2] // config["heads"], config["rope_theta"], x.dtype, x.device)


# The one captured forward: its key (what it was captured for), the graph, and the memory pool every capture
# allocates from. One graph at a time, so that a graph's buffers go back to the pool before the next shape's
# are taken; one pool for the process, so that no block made in it (cuBLAS's workspace is one) can outlive it.
_captured = {}


def launch(kernels, x, weights, config, out):
    """The forward as one CUDA graph: captured on the first call for these tensors (after one ordinary run,
    which compiles and loads every kernel outside the capture), replayed on every call after it. The graph
    reads x and the weights and writes out at the addresses it was captured with: the key holds them."""
    check_widths(config)
    key = (id(kernels), x.data_ptr(), out.data_ptr(), tuple(x.shape), x.dtype, tuple(sorted(config.items())),
           tuple((n, w.data_ptr()) for n, w in sorted(weights.items())))
    if _captured.get("key") != key:
        # cuBLAS keeps a workspace per stream, which a capture uses as it finds it. Made outside the capture,
        # it would live outside the graph's memory, and whoever frees it (torch.compile's CUDA graphs do,
        # before each capture of theirs) would leave our graph's matmuls writing into memory that others
        # then get. So the workspaces are dropped before the capture, which makes its own in the graph's
        # pool, and dropped again before that graph is, as the next one replaces it.
        torch._C._cuda_clearCublasWorkspaces()
        pool = _captured.get("pool") or torch.cuda.MemPool()  # lives as long as this module holds it
        _captured.clear()
        rope = rope_tables(x, config)  # read by the graph at these addresses: kept with it
        graph = capture(lambda: forward(kernels, x, weights, config, out, rope), pool.id)
        _captured.update(key=key, graph=graph, pool=pool, rope=rope)
    _captured["graph"].replay()


def capture(run, pool=None) -> torch.cuda.CUDAGraph:
    """run() (no arguments, no return) once on a side stream, the warm-up that compiles and loads every kernel
    outside the capture, then captured in a CUDA graph (its memory from `pool`, a pool id, or its own); the
    current stream waits for both. The warm-up really runs: a run that changes state changes it once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch._C._cuda_clearCublasWorkspaces()  # made by the warm-up, outside the graph's memory (launch says why)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


STAGE = Stage(
    name="stage10_model",
    problem="model",
    source="model.cu",
    kernels={"add_rmsnorm": "elem_t*, const elem_t*, const elem_t*, elem_t*, int, float",
             "rope_split": "const RopeParams",
             "swiglu": "const elem_t*, elem_t*, int, long long"},
    launch=launch,
    param_structs=(RopeParams,),
    specializations={"HEAD_DIM": "D"},
    geometry=lambda defines: {"VECTOR": VECTOR, "ROPE_THREADS": ROPE_THREADS, "SWIGLU_THREADS": SWIGLU_THREADS},
    goal=Goal("reference", 1.0),  # the fastest library baseline: torch.compile's, with or without CUDA graphs
    uses=(*OPS_STAGES["attention"], *OPS_STAGES["moe_layer"]),  # what ops.attention and ops.moe_layer run
)
