"""grader ops' host-time breakdowns on the CPU, with a stand-in for stages.ops whose stage launch makes two
'kernel launches' of a known length: the pieces are measured where they are spent."""
import time
from types import SimpleNamespace

import torch

import stages.common.launcher as launcher
from grader import ops_benchmark

LAUNCH_S = 200e-6


def test_the_moe_layers_host_time_by_piece(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(launcher.KernelSet, "_launch", lambda self, *args: time.sleep(LAUNCH_S))

    def launch_fastest(problem, inputs, outputs):
        assert problem == "moe_layer" and set(outputs) == {"out", "topk_ids"}
        for _ in range(2):
            launcher.KernelSet._launch(None, "kernel")

    def moe_launch(x, wr, bias, w1, w2, top_k):  # the stage's launch looked up on its module, as stages.ops does
        ops.shared.launch_fastest("moe_layer", {}, {"out": None, "topk_ids": None})

    def moe_layer(x, wr, w1, w2, top_k):  # a call replayed from a graph: one "launch"
        launcher.KernelSet._launch(None, "graph")

    ops = SimpleNamespace(shared=SimpleNamespace(launch_fastest=launch_fastest), moe_layer=moe_layer,
                          moe_launch=moe_launch, moe_layer_input_problem=lambda *a: None)
    layer = {name: torch.zeros(4, 8) for name in ("x", "wr", "w1", "w2")}
    pieces = ops_benchmark.moe_host_breakdown(ops, layer, 2)
    assert pieces["kernel launches"] >= 2 * LAUNCH_S * 1e6
    assert pieces["kernel launches"] > pieces["checks"]
    assert LAUNCH_S * 1e6 <= pieces["whole"] < pieces["launch path"]
    path = ("kernel launches", "stage launch, rest (allocations, routing sizes, tensor maps)", "launch path, rest (outputs)")
    assert abs(pieces["launch path"] - sum(pieces[k] for k in path)) < 1e-6
    assert all(pieces[k] >= 0 for k in path)


VIEWS_S = 1e-3  # the harness's own work per call (clearing the leaves' gradients, making the views)


def test_the_attention_host_times_leave_out_the_making_of_the_inputs_and_add_up(monkeypatch):
    """A views() that takes 1 ms is in no piece of the forward's host time; the pieces of a forward and of a
    backward (inside autograd's engine) are timed inside one call and add up to it."""
    import stages.common.hopper as hopper

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(launcher.KernelSet, "_launch", lambda self, *args: time.sleep(LAUNCH_S))
    monkeypatch.setattr(hopper, "tensor_map", lambda x, box: b"")

    def model_views(B, H, Hkv, S, D, seed=0):
        leaves = [torch.zeros(B, S, heads, D, requires_grad=True) for heads in (H, Hkv, Hkv)]

        def views():
            time.sleep(VIEWS_S)
            return [t.transpose(1, 2) for t in leaves]
        return views, torch.zeros(B, H, S, D)

    def launch_fastest(problem, inputs, outputs):  # looked up on its module, as stages.ops does
        launcher.KernelSet._launch(None, problem)

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return ops.dense.forward_launch(q, k, v, True, 1.0)[0]

        @staticmethod
        def backward(ctx, grad_o):
            return ops.dense.backward_launch(grad_o, *ctx.saved_tensors)

    def attention(q, k, v, causal):
        ops.dense.attention_input_problem(q, k, v)
        return Attention.apply(q, k, v)

    def forward_launch(q, k, v, causal, scale):
        ops.shared.launch_fastest("attention", {}, {})
        return q * 1.0, q[..., 0].float()

    def backward_launch(grad_o, q, k, v):
        ops.shared.launch_fastest("attention_backward", {}, {})
        ops.shared.launch_fastest("attention_backward", {}, {})
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    ops = SimpleNamespace(attention=attention, shared=SimpleNamespace(launch_fastest=launch_fastest),
                          dense=SimpleNamespace(_Attention=Attention, attention_input_problem=lambda q, k, v: None,
                                                forward_launch=forward_launch, backward_launch=backward_launch))
    monkeypatch.setattr(ops_benchmark, "model_views", model_views)
    pieces = ops_benchmark.host_breakdown(ops, shape=(1, 2, 1, 8, 4))
    forward, backward = pieces["forward"], pieces["backward"]
    assert LAUNCH_S * 1e6 <= forward["whole"] < (LAUNCH_S + VIEWS_S / 2) * 1e6
    assert forward["kernel launches"] >= LAUNCH_S * 1e6 and backward["kernel launches"] >= 2 * LAUNCH_S * 1e6
    for direction in (forward, backward):
        parts = [value for name, value in direction.items() if name != "whole"]
        assert all(value >= 0 for value in parts)
        assert abs(sum(parts) - direction["whole"]) < 1e-6
    assert not hasattr(Attention.backward, "__wrapped__") and Attention.backward.__name__ == "backward"  # restored
