"""On a GPU: stage 12 (block-sparse attention on Hopper) against the problem's own check, case by case,
in this process: every case passes; outputs the kernel leaves unwritten (the NaN the outputs are poisoned
with) and a wrong mask fail. Skipped without an sm_90 GPU. (tests/test_gpu.py grades it through the
grader's worker as every stage; this file names the cases one by one.)"""
import re

import pytest
import torch

import reference
import stages
from conftest import gpu
from mutations import mutate

pytestmark = pytest.mark.gpu

STAGE = stages.load("stage12")
PROBLEM = reference.load(STAGE.problem)
CASES = PROBLEM.cases(0)


def _arch():
    found, _ = gpu()
    try:
        return stages.arch_for(found, STAGE.archs)
    except ValueError as why:
        pytest.skip(str(why))


_LOADED: dict = {}


def _kernels(path, inputs):
    """The KernelSet of the stage's kernel at `path` for these inputs (compiled once per path)."""
    from cuda.core import Device

    from grader.run import compile_stage
    from stages import variant_key
    from stages.common.launcher import KernelSet

    if path not in _LOADED:
        arch = _arch()
        torch.cuda.init()
        Device().set_current()  # PyTorch's primary context, as the grader's worker loads kernels
        _LOADED[path] = (compile_stage(STAGE, path, arch), {})
    cubins, sets = _LOADED[path]
    key = variant_key(STAGE.defines(PROBLEM.variant(inputs)))
    if key not in sets:
        sets[key] = KernelSet(cubins[key].path, STAGE.kernels)
    return sets[key]


def _run(case, path=None, edit=lambda inputs: inputs):
    """The check of the kernel at `path` (the stage's own by default) on `case`, the kernel given the
    inputs `edit` makes of the case's, the check made against the case's own."""
    _arch()
    inputs = PROBLEM.make_inputs(case.shape, case.dtype, case.seed, case.input_scale)
    outputs = PROBLEM.allocate_outputs(inputs)  # poisoned with NaN
    PROBLEM.run_stage(STAGE, _kernels(path or STAGE.source_path, inputs), edit(dict(inputs)), outputs)
    torch.cuda.synchronize()
    return PROBLEM.check(outputs, PROBLEM.reference(inputs), PROBLEM.library_output(inputs))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_case_passes_the_problems_check(case):
    failed = [c.name for c in _run(case) if not c.passed]
    assert not failed, f"{case.name}: {failed}"


@pytest.mark.parametrize("case", [c for c in CASES if "no key" in c.name][:2], ids=lambda c: c.name)
def test_rows_left_unwritten_fail(case, kernel_dir):
    """The kernel skipping the query blocks whose lists are empty leaves their NaN poison: the check fails."""
    _, path = mutate("block_sparse_empty_rows_unwritten", kernel_dir)
    assert not all(c.passed for c in _run(case, path))


@pytest.mark.parametrize("case", [c for c in CASES if re.search("causal|window|documents", c.name)
                                  and c.shape["S"] > 1][::4], ids=lambda c: c.name)
def test_a_wrong_mask_fails(case, kernel_dir):
    """The element mask off by one in the kernel (each query sees the next key) fails the check. At S = 1
    there is no next key: such a case cannot tell, and is not one of these."""
    _, path = mutate("block_sparse_mask_off_by_one", kernel_dir)
    assert not all(c.passed for c in _run(case, path))


def test_the_mask_the_kernel_is_given_matters():
    """The stage's own kernel, given another query block's lists, fails: it reads the lists it is given."""
    case = next(c for c in CASES if c.shape["mask"] == "graph" and c.shape["S"] >= 1000)

    def shifted(inputs):
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            inputs[name] = inputs[name].roll(1, dims=2).contiguous()
        return inputs
    assert not all(c.passed for c in _run(case, edit=shifted))
