"""Stage 13 (block-sparse attention backward on Hopper). On the CPU: the launch's transposed lists are
the transpose of the forward's. On a GPU, against the problem's own check, in this process:
partial blocks taken as full (the element mask skipped) and another query block's lists fail. The GPU
tests are skipped without an sm_90 GPU. (Every case of the stage's own kernel: tests/test_gpu.py, through
the grader's worker as every stage.)"""
import re

import pytest
import torch

from mutations import mutate
from stage_on_gpu import StageOnGpu

ON_GPU = StageOnGpu("stage13")  # its kernels run here on one case at a time
STAGE, PROBLEM = ON_GPU.stage, ON_GPU.problem
CASES = PROBLEM.cases(0)
LISTS = (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"))


# ---------------------------------------------------------------- on the CPU

@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_transposed_lists_name_the_query_blocks_that_name_each_key_block(case):
    """Key block n's transposed list holds, in increasing order, exactly the query blocks whose list
    (the first num entries of its row) names n; full and partial apart."""
    from stages.stage13_block_sparse_backward import transposed_lists

    inputs = PROBLEM.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device="cpu")
    for num_name, indices_name in LISTS:
        num, indices = inputs[num_name][0, 0], inputs[indices_name][0, 0]
        q_num, q_indices = transposed_lists(inputs[num_name], inputs[indices_name])
        assert q_num.dtype == q_indices.dtype == torch.int32 and q_indices.shape == indices.T.shape
        for n in range(indices.shape[1]):
            naming = [m for m in range(indices.shape[0]) if n in indices[m, :num[m]].tolist()]
            assert q_indices[n, :q_num[n]].tolist() == naming, (num_name, n)


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if re.search("causal|window|documents", c.name)
                                  and c.shape["S"] > 1][::4], ids=lambda c: c.name)
def test_partial_blocks_taken_as_full_fail(case, kernel_dir):
    """The first partial query block of each key block's lists taken as full -- its element mask
    skipped, so queries see the keys after them -- fails the check. At S = 1 there is no key after a
    query: such a case cannot tell, and is not one of these."""
    _, path = mutate("block_sparse_backward_partial_as_full", kernel_dir)  # where the warm-up compiled it
    assert not all(c.passed for c in ON_GPU.check(case, path))


@pytest.mark.gpu
def test_the_mask_the_kernel_is_given_matters():
    """The stage's own kernels, given another query block's lists, fail: the transposed lists are made
    from the lists it is given."""
    case = next(c for c in CASES if c.shape["mask"] == "graph" and c.shape["S"] >= 1000)

    def shifted(inputs):
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            inputs[name] = inputs[name].roll(1, dims=2).contiguous()
        return inputs
    assert not all(c.passed for c in ON_GPU.check(case, edit=shifted))
