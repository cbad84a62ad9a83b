"""Stage 14 (the MoE layer's backward on Hopper) against the problem's own check.

On the CPU: the launch's wiring and arithmetic with each of backward.cu's kernels replaced by PyTorch doing
what the kernel's comment says it does (TorchKernels), on cases of many tokens. On a GPU (sm_90a): wrong
kernels fail (every case of the stage's own kernel: tests/test_gpu.py). Skipped without an sm_90 GPU."""
import pytest
import torch

from mutations import mutate
from reference.moe_layer_backward import saved_of
from stage_on_gpu import StageOnGpu
from stages.stage14_moe_backward import BLOCK_N, backward

ON_GPU = StageOnGpu("stage14")  # its kernels run here on one case at a time
STAGE, PROBLEM = ON_GPU.stage, ON_GPU.problem
CASES = PROBLEM.cases(0)


def _segments(offsets):
    bounds = offsets.tolist()
    return [(e, bounds[e], bounds[e + 1]) for e in range(len(bounds) - 1)]


class TorchKernels:
    """backward.cu's kernels in PyTorch (fp32 arithmetic, outputs rounded to the dtype), for the CPU."""

    def gather(self, x, dy, saved, x_perm, dy_perm, row_weight):
        used = int(saved.expert_offsets[-1])
        token = saved.source_token[:used].long()
        for e, a, b in _segments(saved.expert_offsets):  # a padding row copies its segment's first token
            if b > a:
                token[a:b] = torch.where(token[a:b] < 0, token[a], token[a:b])
        x_perm[:used], dy_perm[:used] = x[token], dy[token]
        row_weight[:used] = 0
        row_weight[saved.dest.flatten().long()] = saved.topk_weights.flatten()

    def swiglu_grad(self, dy_perm, w2, saved, row_weight, dgu, hw, g_partial):
        inter = w2.shape[1]
        for e, a, b in _segments(saved.expert_offsets):
            da = dy_perm[a:b].float() @ w2[e].float().t()
            gate, up = saved.h1[a:b].float().split(inter, dim=1)
            w = row_weight[a:b, None]
            s = torch.sigmoid(gate)
            h = gate * s * up
            padding = w == 0
            dgu[a:b, :inter] = torch.where(padding, 0.0, w * da * up * s * (1 + gate * (1 - s))).to(dgu.dtype)
            dgu[a:b, inter:] = torch.where(padding, 0.0, w * da * gate * s).to(dgu.dtype)
            hw[a:b] = torch.where(padding, 0.0, w * h).to(hw.dtype)
            for n in range(g_partial.shape[0]):
                cols = slice(n * BLOCK_N, (n + 1) * BLOCK_N)
                g_partial[n, a:b] = (da[:, cols] * h[:, cols]).sum(1)

    def data(self, a_perm, offsets, weight, out):
        for e, a, b in _segments(offsets):
            out[a:b] = (a_perm[a:b].float() @ weight[e].float().t()).to(out.dtype)

    def weight(self, a_perm, b_perm, offsets, counts, dw):
        for (e, a, _), count in zip(_segments(offsets), counts.tolist()):
            dw[e] = (a_perm[a:a + count].float().t() @ b_perm[a:a + count].float()).to(dw.dtype)

    def router(self, saved, g_partial, aux_scale, dlogits, dlogits_rounded):
        tokens, experts = saved.logits.shape  # in fp64, as the kernel
        p = torch.softmax(saved.logits.double(), dim=1)
        dp = aux_scale * saved.expert_counts.double() / (tokens * saved.topk_ids.shape[1] * tokens)
        grad = p * (dp - (dp * p).sum(1, keepdim=True))
        g = g_partial.sum(0)[saved.dest.long()].double()
        w = saved.topk_weights.double()
        grad.scatter_add_(1, saved.topk_ids.long(), w * (g - (w * g).sum(1, keepdim=True)))
        dlogits.copy_(grad)
        dlogits_rounded.copy_(grad)

    def router_weight(self, x, dlogits, dwr, dbias):
        dwr.copy_(x.float().t() @ dlogits)
        dbias.copy_(dlogits.double().sum(0))

    def combine(self, dx_perm, saved, router, dx):
        dx.copy_(dx_perm[saved.dest.long()].float().sum(1) + router.float())


def _check(inputs, outputs):
    return PROBLEM.check(outputs, PROBLEM.reference(inputs), PROBLEM.library_output(inputs))


def _run(kernels, inputs, outputs):
    i = inputs
    backward(kernels, i["x"], i["wr"], i["w1"], i["w2"], i["dy"], i["aux_coef"], saved_of(i),
             *(outputs[n] for n in PROBLEM.outputs))


CPU_CASES = CASES[::4]


@pytest.mark.parametrize("case", CPU_CASES, ids=[c.name for c in CPU_CASES])
def test_the_launchs_arithmetic_passes_with_pytorchs_kernels(case):
    inputs = PROBLEM.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device="cpu")
    outputs = PROBLEM.allocate_outputs(inputs)
    _run(TorchKernels(), inputs, outputs)
    failed = [c.output for c in _check(inputs, outputs) if not c.passed]
    assert not failed, f"{case.name}: {failed}"


def test_a_wrong_swiglu_backward_fails_on_the_cpu():
    """The check sees a SwiGLU backward that forgets silu's derivative (dG = dh·U·s): dX and dW1 fail."""
    class Wrong(TorchKernels):
        def swiglu_grad(self, dy_perm, w2, saved, row_weight, dgu, hw, g_partial):
            super().swiglu_grad(dy_perm, w2, saved, row_weight, dgu, hw, g_partial)
            inter = w2.shape[1]
            dgu[:, :inter] *= 1.5

    case = next(c for c in CASES if c.shape["tokens"] == 1000)
    inputs = PROBLEM.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device="cpu")
    outputs = PROBLEM.allocate_outputs(inputs)
    _run(Wrong(), inputs, outputs)
    failed = {c.output for c in _check(inputs, outputs) if not c.passed}
    assert {"dx", "dw1"} <= failed


def test_the_launch_passes_what_the_kernels_declare(monkeypatch):
    """HopperKernels gives each of backward.cu's kernels what its C signature declares (its parameter struct's
    values, each field of its kind), on the smallest case, without a GPU: the tensor maps and the SM count,
    which need a driver, replaced."""
    from stages.common import hopper
    from test_launcher import assert_case_launches_as_declared

    monkeypatch.setattr(hopper, "tensor_map", lambda x, box: x)
    monkeypatch.setattr(hopper, "sm_count", lambda device: 132)
    assert_case_launches_as_declared(STAGE, PROBLEM, min(CASES, key=lambda c: c.shape["tokens"]))


# ---------------------------------------------------------------- on the GPU

def _fails(mutation, case, tmp_path) -> bool:
    _, path = mutate(mutation, tmp_path)
    return not all(c.passed for c in ON_GPU.check(case, path))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if "empty" in c.name][:2], ids=lambda c: c.name)
def test_an_empty_experts_unwritten_weight_gradient_fails(case, tmp_path):
    """The weight kernel storing nothing for an expert without rows leaves its dW's NaN poison."""
    assert _fails("moe_backward_empty_expert_unwritten", case, tmp_path)


ONE_THOUSAND = [c for c in CASES if "T1000 E32" in c.name][:2]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ONE_THOUSAND, ids=lambda c: c.name)
def test_both_consumers_on_the_same_columns_of_a_fail(case, tmp_path):
    """The weight kernel loading the same 64 columns of A for both consumer warpgroups: dW's rows 64-127 of
    every 128-row tile are wrong (the transposed A's box coordinates matter)."""
    assert _fails("moe_backward_same_a_columns", case, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("mutation", ["moe_backward_g_one_lane", "moe_backward_padding_multiplied",
                                      "moe_backward_topk_term_unweighted"])
def test_a_wrong_epilogue_or_router_fails(mutation, tmp_path):
    """g summed by one lane of each quad, padding rows multiplied by their zero weight (h1 holds NaN there),
    the top-k term without its weight: each fails the check."""
    assert _fails(mutation, ONE_THOUSAND[0], tmp_path)
