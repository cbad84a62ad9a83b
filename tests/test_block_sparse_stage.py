"""On a GPU: wrong versions of stage 12 (block-sparse attention on Hopper) against the problem's own check,
in this process: outputs the kernel leaves unwritten (the NaN the outputs are poisoned with) and a wrong
mask fail. Skipped without an sm_90 GPU. (Every case of the stage's own kernel: tests/test_gpu.py, through
the grader's worker as every stage.)"""
import re

import pytest

from mutations import mutate
from stage_on_gpu import StageOnGpu

pytestmark = pytest.mark.gpu

ON_GPU = StageOnGpu("stage12")  # its kernels run here on one case at a time
STAGE, PROBLEM = ON_GPU.stage, ON_GPU.problem
CASES = PROBLEM.cases(0)



@pytest.mark.parametrize("case", [c for c in CASES if "no key" in c.name][:2], ids=lambda c: c.name)
def test_rows_left_unwritten_fail(case, kernel_dir):
    """The kernel skipping the query blocks whose lists are empty leaves their NaN poison: the check fails."""
    _, path = mutate("block_sparse_empty_rows_unwritten", kernel_dir)
    assert not all(c.passed for c in ON_GPU.check(case, path))


@pytest.mark.parametrize("case", [c for c in CASES if re.search("causal|window|documents", c.name)
                                  and c.shape["S"] > 1][::4], ids=lambda c: c.name)
def test_a_wrong_mask_fails(case, kernel_dir):
    """The element mask off by one in the kernel (each query sees the next key) fails the check. At S = 1
    there is no next key: such a case cannot tell, and is not one of these."""
    _, path = mutate("block_sparse_mask_off_by_one", kernel_dir)
    assert not all(c.passed for c in ON_GPU.check(case, path))


def test_the_mask_the_kernel_is_given_matters():
    """The stage's own kernel, given another query block's lists, fails: it reads the lists it is given."""
    case = next(c for c in CASES if c.shape["mask"] == "graph" and c.shape["S"] >= 1000)

    def shifted(inputs):
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            inputs[name] = inputs[name].roll(1, dims=2).contiguous()
        return inputs
    assert not all(c.passed for c in ON_GPU.check(case, edit=shifted))
