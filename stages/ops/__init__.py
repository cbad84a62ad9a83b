"""The course's kernels as PyTorch ops, on your own tensors: `from stages import ops`.

    o = ops.attention(q, k, v, causal=True)   # q [B, H, Sq, D], k and v [B, H_kv, Skv, D] (H_kv | H), fp16 or bf16
    o.transpose(1, 2).reshape(B, Sq, H * D)    # free: o [B, H, Sq, D] lies in memory as [B, Sq, H, D]
    o.backward(grad)                           # q.grad, k.grad, v.grad by the course's backward kernel
    out = ops.moe_layer(x, router_weight, w1, w2, top_k, router_bias=None)
    out.backward(grad)                         # x, router_weight, router_bias, w1, w2's .grad: on sm_90a only
    o = ops.block_sparse_attention(q, k, v, block_mask, element_mask="causal")  # a FlexAttention BlockMask
    o = ops.decode_attention(q, k_cache, v_cache, block_table, seq_lens)  # a decode step over a paged KV cache

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
    flashmoe::decode_attention(q, k_cache, v_cache, block_table, seq_lens, scale) -> o     no gradient

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
attention: stages 12 and 13 on sm_90a, none elsewhere (the call is refused there, in one line); decode
attention: stage 15 (sm_80 and newer). A
stage is compiled on first use for the variant the inputs need (the problem's `variant`: dtype, head
dimension, element mask), with the -D macros the grader uses, into the compile cache on disk
(stages/common/compiler.py); the process keeps its kernels and launches them through the problem's own
`run_stage`, the call the grader makes, on the caller's tensors and current stream. Only the stages that
run are imported.

The package: one module per operator (dense.py: ops.attention; block_sparse.py: ops.block_sparse_attention;
moe.py: ops.moe_layer; decode.py: ops.decode_attention), each with its custom ops, autograd and input checks,
and shared.py, what they share
(the checks of strides, alignment and device, the one-line refusal, the launch of a problem's stage and the
kernels it keeps). The names below are the ops' and what the grader's measurements (grader/ops_benchmark.py)
and the tests call. Each module calls another's functions through that module (shared.launch_fastest), so
that replacing a function in the module that defines it (a test's monkeypatch, a timing wrapper) replaces
it for every op; replacing it here, in the package, would not.
"""
from stages.ops import block_sparse, decode, dense, moe, shared
from stages.ops.block_sparse import (block_sparse_attention, block_sparse_attention_backward,
                                     block_sparse_attention_forward, mask_lists)
from stages.ops.decode import decode_attention, decode_attention_op, decode_input_problem
from stages.ops.dense import (attention, attention_backward, attention_forward, attention_input_problem,
                              check_attention_inputs, outputs_like)
from stages.ops.moe import (MOE_GRAPH_TOKENS, MOE_GRAPHS, moe_launch, moe_layer, moe_layer_backward,
                            moe_layer_input_problem, moe_layer_op, moe_layer_saving, saved_like)
from stages.ops.shared import ops_stage_on, refuse, stage_problem
