"""The attention backward problem (reference/attention_backward.py) on the CPU: its exact gradients against
autograd in float64, its inputs against the forward's, its work; and which forward kernel the grader times
before a backward stage."""
import pytest
import torch

import reference
from reference import attention_backward

P = reference.load("attention_backward")
FORWARD = reference.load("attention")


def autograd_gradients(inputs):
    """dQ, dK, dV by autograd through softmax attention written plainly, in float64. With fewer KV heads than
    query heads (GQA), through K and V repeated to H heads (repeat_interleave, Llama's repeat_kv): autograd
    sums each repeated head's gradients back onto its KV head."""
    q, k, v = (inputs[n].to(torch.float64).requires_grad_() for n in "qkv")
    group = q.shape[1] // k.shape[1]
    keys_, values_ = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = inputs["scale"] * q @ keys_.transpose(-1, -2)
    if inputs["causal"]:
        keys, queries = torch.arange(k.shape[2]), torch.arange(q.shape[2])
        scores = torch.where(keys[None, :] <= queries[:, None], scores, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ values_
    return dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), inputs["do"].to(torch.float64))))


SMALL = [(5, 5, False), (7, 7, True), (3, 9, True), (9, 3, True), (1, 4, False), (6, 2, False)]


@pytest.mark.parametrize("Sq,Skv,causal", SMALL)
def test_reference_matches_autograd(Sq, Skv, causal):
    shape = dict(B=2, H=3, Sq=Sq, Skv=Skv, D=64, causal=causal)
    inputs = P.make_inputs(shape, "float16", seed=Sq * 31 + Skv, input_scale=3.0, device="cpu")
    exact, expected = P.reference(inputs), autograd_gradients(inputs)
    for name in P.outputs:
        assert exact[name].dtype == torch.float64
        torch.testing.assert_close(exact[name], expected[name], rtol=1e-10, atol=1e-12)


def test_the_reference_in_chunks_of_heads_is_the_reference_at_once(monkeypatch):
    shape = dict(B=2, H=3, Sq=9, Skv=3, D=64, causal=True)
    inputs = P.make_inputs(shape, "bfloat16", seed=5, device="cpu")
    at_once = P.reference(inputs)
    monkeypatch.setattr(attention_backward, "CHUNK_ELEMENTS", 4 * 9 * 3)  # 6 pairs: chunks of 4 and 2
    in_chunks = P.reference(inputs)
    for name in P.outputs:
        torch.testing.assert_close(in_chunks[name], at_once[name], rtol=1e-12, atol=1e-14)


def test_inputs_are_the_forwards_with_its_exact_results_and_a_seeded_do():
    shape = dict(B=1, H=2, Sq=5, Skv=6, D=64, causal=True)
    inputs = P.make_inputs(shape, "bfloat16", seed=3, input_scale=2.0, device="cpu")
    forward_inputs = FORWARD.make_inputs(shape, "bfloat16", seed=3, input_scale=2.0, device="cpu")
    for name in ("q", "k", "v", "scale", "causal"):
        assert torch.equal(torch.as_tensor(inputs[name]), torch.as_tensor(forward_inputs[name]))
    exact = FORWARD.reference(forward_inputs)
    assert torch.equal(inputs["o"], exact["o"].to(torch.bfloat16))
    assert inputs["lse"].dtype == torch.float32 and torch.equal(inputs["lse"], exact["lse"].float())
    assert inputs["do"].shape == inputs["q"].shape and inputs["do"].dtype == torch.bfloat16
    again, other = (P.make_inputs(shape, "bfloat16", seed=s, input_scale=2.0, device="cpu") for s in (3, 4))
    assert torch.equal(again["do"], inputs["do"]) and not torch.equal(other["do"], inputs["do"])
    assert P.variant(inputs) == {"dtype": "bfloat16", "D": 64}


def test_outputs_are_poisoned_and_shaped_as_q_k_v():
    inputs = P.make_inputs(dict(B=1, H=2, Sq=5, Skv=7, D=128, causal=False), "float16", seed=0, device="cpu")
    out = P.allocate_outputs(inputs)
    for name in "qkv":
        grad = out[f"d{name}"]
        assert grad.shape == inputs[name].shape and grad.dtype == inputs[name].dtype and grad.isnan().all()


def test_cases_benchmarks_and_labels_are_the_forwards():
    assert P.cases(seed=3) == FORWARD.cases(seed=3)
    assert P.benchmarks() == FORWARD.benchmarks() and len(P.benchmarks()) == 4
    assert all(b["dtype"] == "float16" for b in P.benchmarks())
    shape = dict(B=2, H=2, Sq=100, Skv=333, D=128, causal=True)
    assert P.shape_label(shape) == FORWARD.shape_label(shape)


@pytest.mark.parametrize("causal", [False, True])
def test_flops_are_two_and_a_half_forwards_and_bytes_each_tensor_once(causal):
    shape = dict(B=16, H=16, Sq=2048, Skv=1024, D=64, causal=causal)
    assert P.flops(shape) == 2.5 * FORWARD.flops(shape)
    # read Q, K, V, O, dO (2 bytes) and the LSE (4 bytes a row); write dQ, dK, dV
    assert P.min_bytes(shape) == 16 * 16 * ((2048 + 2 * 1024 + 2048 + 2048) * 64 * 2 + 2048 * 4
                                            + (2048 + 2 * 1024) * 64 * 2)


def test_the_library_passes_its_own_rule_and_the_baselines_run():
    inputs = P.make_inputs(dict(B=1, H=2, Sq=9, Skv=3, D=64, causal=True), "float16", seed=1, device="cpu")
    library = P.library_output(inputs)
    assert all(check.passed for check in P.check(library, P.reference(inputs), library))
    for runs in (P.baselines(inputs), P.forward_backward_baselines(inputs)):
        assert "naive" in runs and len(runs) >= 2  # an SDPA backend runs on the CPU too
        for run in runs.values():
            assert run() is None and run() is None  # a backward alone: the second call reuses the graph
    assert P.forward == "attention" and set(FORWARD.outputs) <= set(inputs)


# ---- the grader's forward + backward ----------------------------------------------------------------
def test_the_forward_timed_before_a_backward_is_the_highest_stage_that_runs_on_the_gpu():
    from grader.device import GpuInfo
    from grader.run import forward_stage

    h100 = GpuInfo("NVIDIA H100 80GB HBM3", 9, 0, 132, 50 << 20, 1980, 80 << 30, "13.0")
    a100 = GpuInfo("NVIDIA A100-SXM4-80GB", 8, 0, 108, 40 << 20, 1410, 80 << 30, "12.4")
    assert forward_stage(P, h100).key == "stage4_hopper"
    assert forward_stage(P, a100).key == "stage3_pipeline"
    assert forward_stage(FORWARD, h100) is None  # a problem with no forward


def test_forward_backward_figures_count_both_problems_work():
    from grader.run import _forward_backward_figures

    shape = dict(B=16, H=16, Sq=2048, Skv=2048, D=64, causal=True)
    event = {"stage": "stage4_hopper", "skipped": {"math": "out of memory"},
             "timings": {"kernel": {"ms": 2.0}, "flash": {"ms": 3.0}, "naive": {"ms": 30.0}}}
    figures = _forward_backward_figures(event, shape, P)
    assert figures["ms"] == 2.0 and figures["stage"] == "stage4_hopper"
    assert figures["baselines"] == {"flash": 3.0, "naive": 30.0, "math": None}
    assert figures["tflops"] == pytest.approx(3.5 * FORWARD.flops(shape) / 2.0 / 1e9)


# ---- grouped-query attention: dK and dV of a KV head are sums over its group of query heads ------------
@pytest.mark.parametrize("H,Hkv,Sq,Skv,causal", [(4, 2, 5, 5, False), (6, 2, 7, 7, True), (4, 1, 3, 9, True),
                                                  (8, 2, 9, 3, True), (3, 1, 6, 2, False)])
def test_grouped_reference_matches_autograd(H, Hkv, Sq, Skv, causal):
    shape = dict(B=2, H=H, Hkv=Hkv, Sq=Sq, Skv=Skv, D=64, causal=causal)
    inputs = P.make_inputs(shape, "float16", seed=Sq * 31 + Skv, input_scale=3.0, device="cpu")
    exact, expected = P.reference(inputs), autograd_gradients(inputs)
    assert exact["dk"].shape == exact["dv"].shape == (2, Hkv, Skv, 64) and exact["dq"].shape == (2, H, Sq, 64)
    for name in P.outputs:
        torch.testing.assert_close(exact[name], expected[name], rtol=1e-10, atol=1e-12)


def test_grouped_reference_in_chunks_is_the_reference_at_once(monkeypatch):
    shape = dict(B=2, H=6, Hkv=2, Sq=9, Skv=3, D=64, causal=True)
    inputs = P.make_inputs(shape, "bfloat16", seed=5, device="cpu")
    at_once = P.reference(inputs)
    monkeypatch.setattr(attention_backward, "CHUNK_ELEMENTS", 5 * 9 * 3)  # 12 pairs: chunks that cut groups
    in_chunks = P.reference(inputs)
    for name in P.outputs:
        torch.testing.assert_close(in_chunks[name], at_once[name], rtol=1e-12, atol=1e-14)


def test_grouped_library_passes_its_own_rule_and_the_baselines_run():
    inputs = P.make_inputs(dict(B=1, H=4, Hkv=1, Sq=9, Skv=5, D=64, causal=True), "bfloat16", seed=1, device="cpu")
    library = P.library_output(inputs)
    assert library["dk"].shape == inputs["k"].shape
    assert all(check.passed for check in P.check(library, P.reference(inputs), library))
    for runs in (P.baselines(inputs), P.forward_backward_baselines(inputs)):
        assert "naive" in runs and len(runs) >= 2
        for run in runs.values():
            assert run() is None


def test_grouped_bytes_count_kv_heads_once():
    shape = dict(B=2, H=8, Sq=64, Skv=32, D=64, causal=False)
    # K, V read and dK, dV written: 4 tensors of Skv × D for each of the 6 KV heads fewer
    assert P.min_bytes(shape) - P.min_bytes(dict(shape, Hkv=2)) == 2 * 6 * 4 * 32 * 64 * 2
