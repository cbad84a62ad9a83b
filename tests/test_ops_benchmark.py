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

    def moe_layer(x, wr, w1, w2, top_k):
        launch_fastest("moe_layer", {}, {"out": None, "topk_ids": None})

    ops = SimpleNamespace(MOE_LAYER="moe_layer", launch_fastest=launch_fastest, moe_layer=moe_layer,
                          moe_layer_input_problem=lambda *a: None)
    layer = {name: torch.zeros(4, 8) for name in ("x", "wr", "w1", "w2")}
    pieces = ops_benchmark.moe_host_breakdown(ops, layer, 2)
    assert pieces["kernel launches"] >= 2 * LAUNCH_S * 1e6
    assert pieces["kernel launches"] > pieces["checks"]
    assert abs(pieces["whole"] - sum(v for k, v in pieces.items() if k != "whole")) < 1e-6
