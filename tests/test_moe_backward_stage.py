"""Stage 14 (the MoE layer's backward on Hopper) against the problem's own check.

On the CPU: the launch's arithmetic (the permutation, SwiGLU's, the combine's and the router's backward)
with PyTorch's grouped GEMMs in place of backward.cu's, on cases of many tokens. On a GPU (sm_90a): a
weight-gradient kernel that leaves an empty expert's dW unwritten, and one that gives both consumers the
same columns of A, fail (every case of the stage's own kernel: tests/test_gpu.py). Skipped without an
sm_90 GPU."""
import pytest
import torch

from mutations import mutate
from stage_on_gpu import StageOnGpu
from stages.stage14_moe_backward import backward

ON_GPU = StageOnGpu("stage14")  # its kernels run here on one case at a time
STAGE, PROBLEM = ON_GPU.stage, ON_GPU.problem
CASES = PROBLEM.cases(0)


def _segments(offsets):
    bounds = offsets.tolist()
    return [(e, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1)]


class TorchGemms:
    """backward.cu's grouped GEMMs in PyTorch (fp32 accumulation, outputs rounded to the dtype), for the CPU."""

    def up(self, a_perm, offsets, weight, out):
        out.zero_()
        for e, a, b in _segments(offsets):
            out[a:b] = (a_perm[a:b].float() @ weight[e].float()).to(out.dtype)

    def data(self, a_perm, offsets, weight, out):
        out.zero_()
        for e, a, b in _segments(offsets):
            out[a:b] = (a_perm[a:b].float() @ weight[e].float().t()).to(out.dtype)

    def weight(self, a_perm, b_perm, offsets, dw):
        for e, a, b in _segments(offsets):
            dw[e] = (a_perm[a:b].float().t() @ b_perm[a:b].float()).to(dw.dtype)


def _check(inputs, outputs):
    return PROBLEM.check(outputs, PROBLEM.reference(inputs), PROBLEM.library_output(inputs))


# Cases of many tokens: with one token, the fp32 dBias is one token's dlogits, and its error against the
# library's (2 × the library's, no more) is a matter of a few roundings either way.
CPU_CASES = [c for c in CASES if c.shape["tokens"] >= 37][::5]


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.name for c in CPU_CASES])
def test_the_launchs_arithmetic_passes_with_pytorchs_gemms(case):
    inputs = PROBLEM.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device="cpu")
    outputs = PROBLEM.allocate_outputs(inputs)
    i = inputs
    backward(TorchGemms(), i["x"], i["wr"], i["bias"], i["w1"], i["w2"], i["top_k"], i["topk_ids"],
             i["topk_weights"], i["dy"], i["aux_coef"], *(outputs[n] for n in PROBLEM.outputs))
    failed = [c.output for c in _check(inputs, outputs) if not c.passed]
    assert not failed, f"{case.name}: {failed}"


def test_the_permutation_pads_every_expert_to_whole_tiles():
    from stages.stage14_moe_backward import BLOCK_M, permutation

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)
    dest, counts, offsets = permutation(ids, 4, 3 * 2 + 4 * (BLOCK_M - 1))
    assert counts.tolist() == [2, 1, 3, 0]
    assert offsets.tolist() == [0, BLOCK_M, 2 * BLOCK_M, 3 * BLOCK_M, 3 * BLOCK_M]
    # expert by expert, in token order inside an expert
    assert dest.tolist() == [2 * BLOCK_M, 0, 2 * BLOCK_M + 1, BLOCK_M, 1, 2 * BLOCK_M + 2]


# ---------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if "empty" in c.name][:2], ids=lambda c: c.name)
def test_an_empty_experts_unwritten_weight_gradient_fails(case, tmp_path):
    """The weight kernel storing nothing for an expert without rows leaves its dW's NaN poison."""
    _, path = mutate("moe_backward_empty_expert_unwritten", tmp_path)
    assert not all(c.passed for c in ON_GPU.check(case, path))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if "T1000 E32" in c.name][:2], ids=lambda c: c.name)
def test_both_consumers_on_the_same_columns_of_a_fail(case, tmp_path):
    """The weight kernel loading the same 64 columns of A for both consumer warpgroups: dW's rows 64-127 of
    every 128-row tile are wrong (the transposed A's box coordinates matter)."""
    _, path = mutate("moe_backward_same_a_columns", tmp_path)
    assert not all(c.passed for c in ON_GPU.check(case, path))
