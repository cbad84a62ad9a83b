"""The problems the course's kernels solve: what is computed, on which inputs, and how it is judged.

Each module defines `PROBLEM`, an instance of `reference.problem.Problem` (the interface, written
once there): attention.py, attention_backward.py, moe_routing.py, moe_experts.py, moe_layer.py,
moe_layer_backward.py, moe_expert_parallel.py, model.py, block_sparse_attention.py,
block_sparse_attention_backward.py, decode_attention.py.
"""
import importlib


def load(name: str):
    return importlib.import_module(f"reference.{name}").PROBLEM
