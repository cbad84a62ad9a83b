"""The problem interface (reference/problem.py) and the variant rule between problems and stages."""
import pytest

import reference
import stages
from reference.problem import Problem

PROBLEMS = ["attention", "attention_backward", "moe_routing", "moe_experts", "moe_layer", "moe_layer_backward",
            "moe_expert_parallel", "model", "block_sparse_attention", "block_sparse_attention_backward", "decode_attention"]


@pytest.mark.parametrize("name", PROBLEMS)
def test_every_problem_implements_the_interface(name):
    problem = reference.load(name)
    assert isinstance(problem, Problem) and problem.name == name
    assert not getattr(type(problem), "__abstractmethods__")  # every abstract method is written


def test_a_problem_missing_a_method_cannot_be_made():
    class Half(Problem):
        name, outputs, primary_input = "half", ("o",), "q"

    with pytest.raises(TypeError, match="abstract"):
        Half()


@pytest.mark.parametrize("name", stages.stage_names())
def test_each_stage_specializes_on_parameters_its_problem_has(name):
    stage = stages.load(name)
    problem = reference.load(stage.problem)
    assert set(stage.specializations.values()) <= set(problem.parameters)
    keys = {stages.variant_key(stage.defines(v)) for v in stage.variants(problem)}
    assert len(keys) == len(stage.variants(problem))  # one cubin per variant, none merged


def test_the_variant_rule_maps_a_problem_variant_to_a_stages_macros():
    stage = stages.load("stage3")
    assert stage.defines({"dtype": "bfloat16", "D": 128}) == {"ELEM_T": "__nv_bfloat16", "HEAD_DIM": "128"}
    assert stages.variant_key(stage.defines({"dtype": "float16", "D": 64})) == "ELEM_T=__half,HEAD_DIM=64"
    assert stages.load("stage6").defines({"dtype": "float16"}) == {"ELEM_T": "__half"}


def test_a_forward_gives_a_backward_its_outputs_by_default():
    """Problem.forward_for_backward: the stage run by run_stage, its outputs returned (the same dict)."""
    runs = []

    class Forward(Problem):
        name, outputs, primary_input = "forward", ("o",), "q"
        cases = benchmarks = shape_label = make_inputs = allocate_outputs = None
        reference = library_output = check = baselines = flops = min_bytes = None

        def run_stage(self, stage, kernels, inputs, outputs):
            runs.append((stage, kernels, inputs))
            outputs["o"] = "written"

    outputs = {"o": "poisoned"}
    given = Forward().forward_for_backward("stage", "kernels", {"q": 1}, outputs)
    assert given is outputs and given == {"o": "written"} and runs == [("stage", "kernels", {"q": 1})]
