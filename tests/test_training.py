"""stages/stage10_model/train.py on the CPU, in float32, with tiny models: the text and its batches, gradients
that reach every weight, a loss that falls, the course way's plumbing (PyTorch standing in for the ops gives the
pytorch way's losses exactly, so that on a GPU any difference is the kernels'), the compiled way's balance loss,
a refused course way, and the command's refusal without a CUDA GPU."""
import math
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from reference import moe
from reference.model import WEIGHTS, attend, model_shape
from stages import ops
from stages.stage10_model import train as T

TINY = model_shape("small", 4, 32, layers=2, hidden=64, heads=2, kv_heads=1, inter=128)
TINY_MOE = model_shape("moe", 4, 32, layers=2, hidden=64, heads=2, kv_heads=1, inter=64, experts=4, top_k=2)
STAND_INS = T.Way("sdpa", "loop")


@pytest.fixture(scope="module")
def tokens():
    return T.tokens_of(T.course_text())


def tiny_batches(tokens, shape, steps, seed=0):
    return T.batches(tokens, shape["B"], shape["S"], steps, seed, "cpu")


# ---------------------------------------------------------------- the text and its batches

def test_the_text_is_the_docs_pages_bytes_in_path_order_one_token_a_byte(tokens):
    pages = sorted((REPO / "docs").rglob("*.md"))
    text = T.course_text()
    assert len(pages) > 10 and len(text) == sum(p.stat().st_size for p in pages)
    assert text.startswith(pages[0].read_bytes()) and text.endswith(pages[-1].read_bytes())
    assert tokens.dtype == torch.int64 and tokens.shape == (len(text),)
    assert 0 <= int(tokens.min()) and int(tokens.max()) < T.VOCAB
    assert T.tokens_of(b"\x00 A\xff").tolist() == [0, 32, 65, 255]


def test_batches_are_windows_of_the_text_targets_one_token_on_and_seeded():
    counting = torch.arange(1000)  # token i at offset i: a window's tokens count up by one
    steps = T.batches(counting, 3, 16, steps=5, seed=7, device="cpu")
    assert len(steps) == 5
    for inputs, targets in steps:
        assert inputs.shape == targets.shape == (3, 16) and inputs.dtype == torch.int64
        assert torch.equal(inputs[:, 1:] - inputs[:, :-1], torch.ones(3, 15, dtype=torch.int64))
        assert torch.equal(targets, inputs + 1)
        assert int(targets.max()) < 1000
    again, other = (T.batches(counting, 3, 16, steps=5, seed=s, device="cpu") for s in (7, 8))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(steps, again))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(steps, other))


# ---------------------------------------------------------------- the model's gradients and training

@pytest.mark.parametrize("shape", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_one_step_s_gradients_reach_every_weight(shape, tokens):
    weights = T.initial_weights(shape, T.SEED, "cpu")
    assert set(weights) == {*WEIGHTS, "embedding", "lm_head"} - ({"wr"} if not shape["experts"] else set())
    assert all(w.dtype == torch.float32 and w.is_leaf and w.requires_grad for w in weights.values())
    (inputs, targets), = tiny_batches(tokens, shape, 1)
    cross_entropy, total = T.loss_function(STAND_INS, shape, torch.float32)(weights, inputs, targets)
    total.backward()
    for name, w in weights.items():
        assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0, name
    if shape["experts"]:  # the balance loss of each layer: about BALANCE_COEF each (1 when balanced)
        balance = float((total - cross_entropy).detach())
        assert 0.5 * T.BALANCE_COEF * shape["layers"] < balance < 4 * T.BALANCE_COEF * shape["layers"]
    else:
        assert torch.equal(total, cross_entropy)


@pytest.mark.parametrize("shape", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_forty_steps_lower_the_loss_well_below_a_uniform_guess(shape, tokens):
    """From about ln 256 = 5.5 (a guess of the byte), 40 AdamW steps learn at least the bytes' frequencies
    (English text: about 3.3 nats): the last 10 steps' mean must be 1.5 nats below ln 256."""
    losses = T.train(STAND_INS, shape, tiny_batches(tokens, shape, 40), 3e-3, torch.float32, every=1)["losses"]
    assert len(losses) == 40 and abs(losses[0] - math.log(T.VOCAB)) < 1.0
    assert sum(losses[-10:]) / 10 < math.log(T.VOCAB) - 1.5, losses


# ---------------------------------------------------------------- the three ways

def pytorch_ops(calls: list, checked: bool = False):
    """ops.attention and ops.moe_layer computed by PyTorch as the pytorch way computes them, counting calls;
    where `checked`, after the ops' own checks of their inputs."""
    def attention(q, k, v, causal):
        calls.append("attention")
        assert causal is True
        if checked:
            ops.check_attention_inputs(q, k, v)
        return attend(q, k, v, "sdpa")

    def moe_layer(x, router_weight, w1, w2, top_k):
        calls.append("moe_layer")
        if checked:
            ops.refuse("ops.moe_layer", ops.moe_layer_input_problem(x, router_weight, None, w1, w2, top_k))
        return moe.layer_grouped_mm(dict(x=x, wr=router_weight, w1=w1, w2=w2), top_k)
    return attention, moe_layer


@pytest.mark.parametrize("name", sorted(T.TRAINED))
def test_the_trained_models_pass_every_check_of_the_ops_but_the_gpu_s(name, tokens, monkeypatch):
    """What the course way hands the ops in bf16 (layouts, dtypes, sizes) is what they take: on a GPU only the
    GPU itself may refuse it."""
    calls = []
    attention, moe_layer = pytorch_ops(calls, checked=True)
    monkeypatch.setattr(ops, "attention", attention)
    monkeypatch.setattr(ops, "moe_layer", moe_layer)
    monkeypatch.setattr(ops, "device_problem", lambda tensors: None)
    shape = T.trained_shape(name, 2, 64)
    (inputs, targets), = tiny_batches(tokens, shape, 1)
    with torch.no_grad():
        T.loss_function(T.ways()["course"], shape, torch.bfloat16)(T.initial_weights(shape, 0, "cpu"), inputs, targets)
    assert calls.count("attention") == shape["layers"] and calls.count("moe_layer") == (shape["layers"]
                                                                                        if shape["experts"] else 0)


def test_the_course_way_with_pytorch_for_the_ops_gives_the_pytorch_way_s_losses_exactly(tokens, monkeypatch):
    """Same weights, batches, optimizer, balance loss: the course way differs from the pytorch way only in the
    ops it calls, so that on a GPU any difference between their curves is the kernels'."""
    calls = []
    attention, moe_layer = pytorch_ops(calls)
    monkeypatch.setattr(ops, "attention", attention)
    monkeypatch.setattr(ops, "moe_layer", moe_layer)
    eager = {name: way for name, way in T.ways().items() if way.compile_options is None}
    assert set(eager) == {"course", "pytorch"}
    results, skipped = T.compare(eager, TINY_MOE, tiny_batches(tokens, TINY_MOE, 8), 3e-3, torch.float32, every=3)
    assert not skipped and len(results["course"]["losses"]) == 4  # steps 0, 3, 6 and the last, 7
    assert results["course"]["losses"] == results["pytorch"]["losses"]
    assert calls.count("attention") == calls.count("moe_layer") == 8 * TINY_MOE["layers"]


def test_the_compiled_way_computes_the_eager_losses_balance_loss_included(tokens):
    """Under torch.compile (here dynamo's graphs run by aot_eager: no C++ compiler), the balance losses that
    Balanced keeps inside the compiled layer reach the loss. In bf16: grouped_mm's meta function takes no fp32."""
    torch._dynamo.reset()
    (inputs, targets), = tiny_batches(tokens, TINY_MOE, 1)
    weights = T.initial_weights(TINY_MOE, T.SEED, "cpu")
    eager, compiled = (T.loss_function(T.Way("sdpa", "grouped_mm", options), TINY_MOE, torch.bfloat16)(
        weights, inputs, targets) for options in (None, dict(backend="aot_eager")))
    assert float((compiled[1] - compiled[0]).detach()) > 0
    torch.testing.assert_close(torch.stack(compiled), torch.stack(eager), rtol=1e-5, atol=1e-5)


def test_a_way_the_ops_refuse_is_skipped_with_its_line_and_the_others_run(tokens, monkeypatch):
    refusal = "ops.moe_layer: the MoE layer's backward needs an H100 or H200 (sm_90a, where stage 14 runs)"

    def refused(*args, **kwargs):
        raise ValueError(refusal)
    monkeypatch.setattr(ops, "attention", refused)
    eager = {name: way for name, way in T.ways().items() if way.compile_options is None}
    results, skipped = T.compare(eager, TINY, tiny_batches(tokens, TINY, 2), 1e-3, torch.float32, every=1)
    assert skipped == {"course": refusal} and set(results) == {"pytorch"}
    lines = T.report(results, skipped, steps=2, every=1)
    assert len(lines) == 5 and lines[-1] == f"course: skipped: {refusal}"
    with pytest.raises(ValueError):  # another way's ValueError is a bug, not a refusal
        T.compare({"pytorch": T.Way(refused, "loop")}, TINY, tiny_batches(tokens, TINY, 1), 1e-3, torch.float32, 1)


# ---------------------------------------------------------------- the command without a GPU

def test_without_cuda_the_command_says_so_in_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert T.main(["--model", "moe", "--steps", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "CUDA GPU" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_the_module_run_as_a_command_exits_2_without_cuda():
    run = subprocess.run([sys.executable, "-m", "stages.stage10_model.train", "--steps", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
