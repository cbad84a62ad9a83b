"""stages/stage10_model/train.py on the CPU, in float32, with tiny models: the text and its batches, gradients
that reach every weight, a loss that falls, the sizes trained, the course way's plumbing (PyTorch standing in
for the ops gives the pytorch way's losses exactly, so that on a GPU any difference is the kernels'), the
compiled ways (each region one graph, the course's custom ops in it: no graph break; the eager losses and
gradients, balance loss included), a refused course way and a failed compiled way, the records --json writes,
and the command's refusal without a CUDA GPU."""
import concurrent.futures
import json
import math

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

from conftest import REPO, run_as_command
from reference import moe
from reference.model import WEIGHTS, attend, model_shape
from stages import ops
from stages.stage10_model import records
from stages.stage10_model import train as T

TINY = model_shape("small", 4, 32, layers=2, hidden=64, heads=2, kv_heads=1, inter=128)
TINY_MOE = model_shape("moe", 4, 32, layers=2, hidden=64, heads=2, kv_heads=1, inter=64, experts=4, top_k=2)
# head dimension 64, as the course's attention takes: for the custom ops' own checks
TINY_MOE_D64 = model_shape("moe", 2, 32, layers=2, hidden=128, heads=2, kv_heads=1, inter=64, experts=4, top_k=2)
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


# ---------------------------------------------------------------- the sizes

def test_the_llama_sizes_are_a_1b_like_model_s_widths_on_4_layers_at_4_by_2048_tokens():
    for name, experts in (("llama", 0), ("moe-llama", 8)):
        trained = records.TRAINED[name]
        shape = T.trained_shape(name, trained["batch"], trained["seq"])
        assert (shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"], shape["inter"]) == (4, 2048, 32, 8, 5632)
        assert shape["hidden"] // shape["heads"] == 64 and (shape["experts"], shape["top_k"]) == (experts, 2 if experts else 0)
        assert (shape["B"], shape["S"], shape["model"]) == (4, 2048, name)
        assert {k: v for k, v in T.settings(T.parse(["--model", name]), name).items()} == \
            {k: trained[k] for k in T.SETTINGS}
    args = T.parse(["--model", "llama", "moe-llama", "--steps", "7", "--lr", "1e-4"])
    assert args.model == ["llama", "moe-llama"]
    assert T.settings(args, "moe-llama") == dict(batch=4, seq=2048, steps=7, lr=1e-4)
    assert T.parse([]).model == ["small"] and T.settings(T.parse([]), "small") == dict(batch=8, seq=256, steps=200, lr=1e-3)


# ---------------------------------------------------------------- the ways

def test_four_ways_eager_first_the_compiled_ones_with_cuda_graphs_and_no_graph_break():
    found = T.ways()
    assert list(found) == ["course", "pytorch", "pytorch-compiled", "course-compiled"]
    assert set(T.COURSE_WAYS) == {n for n, w in found.items() if callable(w.attention)} and set(records.WAYS) >= set(found)
    assert found["course-compiled"][:2] == found["course"][:2] and found["pytorch-compiled"][:2] == found["pytorch"][:2]
    assert found["course"].compile_options is found["pytorch"].compile_options is None
    assert found["course-compiled"].compile_options == found["pytorch-compiled"].compile_options == \
        dict(mode="reduce-overhead", fullgraph=True)


def pytorch_ops(calls: list, checked: bool = False):
    """ops.attention and ops.moe_layer computed by PyTorch as the pytorch way computes them, counting calls;
    where `checked`, after the ops' own checks of their inputs, the MoE layer's output as zeros: what is checked
    there is what the ops are handed, not what they return, and a CPU takes seconds for a 1B-like layer's experts."""
    def attention(q, k, v, causal):
        calls.append("attention")
        assert causal is True
        if checked:
            ops.check_attention_inputs(q, k, v)
        return attend(q, k, v, "sdpa")

    def moe_layer(x, router_weight, w1, w2, top_k):
        calls.append("moe_layer")
        layer = dict(x=x, wr=router_weight, w1=w1, w2=w2)
        if not checked:
            return moe.layer_grouped_mm(layer, top_k)
        ops.refuse("ops.moe_layer", ops.moe_layer_input_problem(x, router_weight, None, w1, w2, top_k))
        return torch.zeros_like(x)
    return attention, moe_layer


@pytest.mark.parametrize("name", list(T.TRAINED))
def test_the_trained_models_pass_every_check_of_the_ops_but_the_gpu_s(name, tokens, monkeypatch):
    """What the course way hands the ops in bf16 (layouts, dtypes, sizes) is what they take: on a GPU only the
    GPU itself may refuse it. Each model's widths, on one layer, at 2 × 8 tokens (bf16's products on a CPU
    run at well under a GFLOP/s: at 2 × 64 tokens the 1B-like layers took minutes). A dense model's MLP, which no
    op sees, at a width of 128; a MoE model's experts, two of them (top-2): each of the width the op sees."""
    calls = []
    attention, moe_layer = pytorch_ops(calls, checked=True)
    monkeypatch.setattr(ops, "attention", attention)
    monkeypatch.setattr(ops, "moe_layer", moe_layer)
    monkeypatch.setattr(ops.shared, "device_problem", lambda tensors: None)
    shape = T.trained_shape(name, 2, 8, layers=1)
    if not shape["experts"]:
        shape = T.trained_shape(name, 2, 8, layers=1, inter=128)
    elif shape["experts"] > shape["top_k"]:
        shape = T.trained_shape(name, 2, 8, layers=1, experts=shape["top_k"])
    (inputs, targets), = tiny_batches(tokens, shape, 1)
    with torch.no_grad():
        T.loss_function(T.ways()["course"], shape, torch.bfloat16)(T.initial_weights(shape, 0, "cpu"), inputs, targets)
    assert calls == ["attention", "moe_layer"] if shape["experts"] else calls == ["attention"]


def test_the_course_way_with_pytorch_for_the_ops_gives_the_pytorch_way_s_losses_exactly(tokens, monkeypatch):
    """Same weights, batches, optimizer, balance loss: the course way differs from the pytorch way only in the
    ops it calls, so that on a GPU any difference between their curves is the kernels'."""
    calls = []
    attention, moe_layer = pytorch_ops(calls)
    monkeypatch.setattr(ops, "attention", attention)
    monkeypatch.setattr(ops, "moe_layer", moe_layer)
    eager = {name: way for name, way in T.ways().items() if way.compile_options is None}
    assert set(eager) == {"course", "pytorch"}
    found = T.compare(eager, TINY_MOE, tiny_batches(tokens, TINY_MOE, 8), 3e-3, torch.float32, every=3)
    assert not found.skipped and not found.failed and len(found.results["course"]["losses"]) == 4  # steps 0, 3, 6, 7
    assert found.results["course"]["losses"] == found.results["pytorch"]["losses"]
    assert calls.count("attention") == calls.count("moe_layer") == 8 * TINY_MOE["layers"]


# ---------------------------------------------------------------- the compiled ways

def differentiated(function, inputs: tuple, grad: torch.Tensor) -> tuple:
    """The gradients of function(*inputs) for `grad`, in a thread of its own: a custom op's kernel runs below
    autograd's dispatch keys, which a thread excludes for itself alone, so a fresh thread records a graph."""
    def run():
        leaves = [t.detach().requires_grad_() for t in inputs]
        return torch.autograd.grad(function(*leaves), leaves, grad)
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(run).result()


@pytest.fixture
def stand_in_launches(monkeypatch):
    """The custom ops as they are (checks, fake implementations, autograd), their launches computed by PyTorch
    as the pytorch way computes them: SDPA, the grouped_mm layer; and a GPU's checks passed on the CPU."""
    def forward(q, k, v, causal, scale):
        o, lse = ops.outputs_like(q)
        groups = q.shape[1] // k.shape[1]
        scores = (q.float() @ k.repeat_interleave(groups, 1).float().transpose(-1, -2)) * scale
        lse.copy_(torch.logsumexp(scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf), -1))
        return o.copy_(attend(q, k, v, "sdpa")), lse

    def backward(grad_o, q, k, v, o, lse, causal, scale):
        gradients = differentiated(lambda *qkv: attend(*qkv, "sdpa"), (q, k, v), grad_o)
        return tuple(torch.empty_like(t).copy_(g) for t, g in zip((q, k, v), gradients))

    def layer(x, router_weight, w1, w2, top_k):
        return moe.layer_grouped_mm(dict(x=x, wr=router_weight, w1=w1, w2=w2), top_k)

    def moe_saving(x, router_weight, router_bias, w1, w2, top_k):
        ids = moe.torch_routing(moe.router_logits(x, router_weight), top_k)[0].to(torch.int32)
        return layer(x, router_weight, w1, w2, top_k), ops.saved_like(x, router_weight, w1, ids)

    def moe_backward(grad_out, x, router_weight, w1, w2, saved):
        top_k = saved.topk_ids.shape[1]
        dx, dwr, dw1, dw2 = differentiated(lambda *a: layer(*a, top_k), (x, router_weight, w1, w2), grad_out)
        return dx, dwr, torch.zeros(router_weight.shape[1]), dw1, dw2

    for module, name, stand_in in ((ops.dense, "forward_launch", forward), (ops.dense, "backward_launch", backward),
                                   (ops.moe, "moe_saving_launch", moe_saving),
                                   (ops.moe, "moe_backward_launch", moe_backward),
                                   (ops.moe, "moe_backward_gpu_problem", lambda device_index: None),
                                   (ops.shared, "device_problem", lambda tensors: None)):
        monkeypatch.setattr(module, name, stand_in)


def recording_backend(graphs: list):
    """A torch.compile backend keeping each graph Dynamo hands it, then aot_eager's: autograd's forward and
    backward run as PyTorch's own ops (no C++ compiler)."""
    def backend(graph, example_inputs):
        graphs.append(graph)
        return lookup_backend("aot_eager")(graph, example_inputs)
    return backend


@pytest.mark.parametrize("name", ["course", "pytorch"])
def test_a_compiled_way_traces_each_region_in_one_graph_and_computes_the_eager_loss_and_gradients(
        name, tokens, stand_in_launches):
    """fullgraph=True: a graph break would raise. Two graphs, the regions (the start; one decoder layer, which
    every layer runs: no recompilation), the course's custom ops inside the layer's (course-compiled), and
    the eager way's losses, the balance loss that Balanced keeps from inside the compiled layer included, and
    gradients. In bf16: grouped_mm's meta function takes no fp32."""
    graphs = []
    eager = T.ways()[name]
    compiled = T.ways(dict(backend=recording_backend(graphs), fullgraph=True))[f"{name}-compiled"]
    (inputs, targets), = tiny_batches(tokens, TINY_MOE_D64, 1)
    found = {}
    T.fresh_compiler()
    for way in (eager, compiled):
        weights = T.initial_weights(TINY_MOE_D64, T.SEED, "cpu")
        losses = T.loss_function(way, TINY_MOE_D64, torch.bfloat16)(weights, inputs, targets)
        losses[1].backward()
        found[way.compile_options is None] = torch.stack(losses).detach(), {n: w.grad for n, w in weights.items()}
    assert len(graphs) == 2 and T.compiled_counts() == dict(graphs=2, cudagraph_skips=0)
    layer = graphs[1].code
    course_ops = ("torch.ops.flashmoe.attention_forward", "torch.ops.flashmoe.moe_layer_saving")
    assert all(op in layer for op in course_ops) if name == "course" else "flashmoe" not in layer
    (eager_losses, eager_grads), (compiled_losses, compiled_grads) = found[True], found[False]
    assert float(compiled_losses[1] - compiled_losses[0]) > 0
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-5, atol=1e-5)
    for weight, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[weight], grad, rtol=1e-2, atol=1e-5, msg=weight)


def test_a_way_the_ops_refuse_is_skipped_with_its_line_and_the_others_run(tokens, monkeypatch):
    refusal = "ops.moe_layer: the MoE layer's backward needs an H100 or H200 (sm_90a, where stage 14 runs)"

    def refused(*args, **kwargs):
        raise ValueError(refusal)
    monkeypatch.setattr(ops, "attention", refused)
    eager = {name: way for name, way in T.ways().items() if way.compile_options is None}
    found = T.compare(eager, TINY, tiny_batches(tokens, TINY, 2), 1e-3, torch.float32, every=1)
    assert found.skipped == {"course": refusal} and set(found.results) == {"pytorch"} and not found.failed
    lines = T.report(found, steps=2, every=1)
    assert len(lines) == 5 and lines[-1] == f"course: skipped: {refusal}"
    with pytest.raises(ValueError):  # another way's ValueError is a bug, not a refusal
        T.compare({"pytorch": T.Way(refused, "loop")}, TINY, tiny_batches(tokens, TINY, 1), 1e-3, torch.float32, 1)


def test_a_compiled_way_that_fails_is_reported_in_a_line_and_the_others_run(tokens, capsys):
    def broken(*args):  # a backend, or an MoE layer
        raise RuntimeError("no CUDA graph today\nsecond line")
    ways = {"pytorch": STAND_INS, "pytorch-compiled": STAND_INS._replace(compile_options=dict(backend=broken)),
            "course-compiled": STAND_INS._replace(compile_options=dict(backend="eager", fullgraph=True))}
    announced = []
    found = T.compare(ways, TINY, tiny_batches(tokens, TINY, 2), 1e-3, torch.float32, 1, announced.append)
    assert set(found.results) == {"pytorch", "course-compiled"} and list(found.failed) == ["pytorch-compiled"]
    assert "no CUDA graph today" in found.failed["pytorch-compiled"] and "second line" not in found.failed["pytorch-compiled"]
    assert "Traceback" in capsys.readouterr().err and [line.split(":")[0] for line in announced] == ["pytorch", "course-compiled"]
    assert found.results["course-compiled"]["graphs"] == 2 and "graphs" not in found.results["pytorch"]
    lines = T.report(found, steps=2, every=1)
    assert lines[0].split() == ["step", "pytorch", "course-compiled"]
    assert lines[-2:] == ["course-compiled: 2 graphs compiled, 0 run without CUDA graphs",
                          f"pytorch-compiled: failed: {found.failed['pytorch-compiled']}"]
    with pytest.raises(RuntimeError):  # an eager way's error is raised
        T.compare({"pytorch": T.Way("sdpa", broken)}, TINY_MOE, tiny_batches(tokens, TINY_MOE, 1), 1e-3, torch.float32, 1)


# ---------------------------------------------------------------- the records

def a_run(model="llama", batch=4, seq=2048, gpu="NVIDIA H200", **more) -> dict:
    return dict(model=model, batch=batch, seq=seq, gpu=gpu, **more)


def test_a_run_s_record_carries_its_source_settings_and_each_way_s_figures(monkeypatch):
    found = T.Comparison({"pytorch": dict(losses=[5.5, 3.0], tokens_per_s=1e6, warmup_s=2.0)}, {"course": "no GPU"}, {})
    shape = T.trained_shape("llama", 4, 2048)
    argv = ["--model", "llama", "--json", "results/training/h200.json"]
    monkeypatch.setenv("FLASHMOE_COMMIT", "abc1234")
    run = T.record("llama", shape, T.settings(T.parse(argv), "llama"), 10, found, "NVIDIA H200", argv)
    assert run["label"] == "llama L4 hidden2048 H32/8 inter5632 B4 S2048" and (run["commit"], run["dirty"]) == ("abc1234", None)
    assert run["command"] == "python -m stages.stage10_model.train --model llama --json results/training/h200.json"
    assert {k: run[k] for k in ("model", "batch", "seq", "steps", "lr", "every", "gpu")} == \
        dict(model="llama", batch=4, seq=2048, steps=200, lr=3e-4, every=10, gpu="NVIDIA H200")
    assert run["ways"] == found.results and run["skipped"] == {"course": "no GPU"} and run["failed"] == {}
    assert run["torch"] == torch.__version__ and run["date"].startswith("20")
    monkeypatch.delenv("FLASHMOE_COMMIT")
    assert T.source()["commit"]  # this checkout's HEAD, by git


def test_a_records_file_holds_one_gpu_s_runs_a_new_one_replacing_its_size(tmp_path):
    path = tmp_path / "training" / "h200.json"
    records.merge(path, a_run(steps=1))
    records.merge(path, a_run(model="small", batch=8, seq=256))
    found = records.merge(path, a_run(steps=2))
    assert json.loads(path.read_text()) == found and found["gpu"] == "NVIDIA H200"
    assert [(r["model"], r.get("steps")) for r in found["runs"]] == [("small", None), ("llama", 2)]
    assert records.unmeasured(found["runs"]) == ["moe", "moe-llama"]
    with pytest.raises(ValueError, match="NVIDIA H200"):
        records.merge(path, a_run(gpu="NVIDIA H100 80GB HBM3"))
    assert records.load(path.parent)[0]["_file"] == "h200.json"


def test_the_committed_records_are_runs_of_the_trained_sizes():
    found = records.load()
    assert found, "no records in results/training/"
    for file in found:
        for run in file["runs"]:
            assert run["model"] in records.TRAINED and run["gpu"] == file["gpu"], run["model"]
            assert {"label", "batch", "seq", "steps", "every", "lr", "torch", "commit", "date", "command"} <= set(run)
            assert set(run["ways"]) <= set(records.WAYS) and records.BASELINE in run["ways"]
            logged = len(range(0, run["steps"], run["every"])) + bool((run["steps"] - 1) % run["every"])
            assert all(len(w["losses"]) == logged and w["tokens_per_s"] > 0 for w in run["ways"].values())


def test_a_model_s_run_prints_its_figures_and_records_them(tokens, tmp_path, monkeypatch, capsys):
    """The command's work for one model (main runs it on the GPU, for each model named): small's widths at 1 × 16
    tokens for 3 steps, one eager way standing in for the four (bf16 products on a CPU: seconds a step)."""
    monkeypatch.setattr(T, "ways", lambda: {"pytorch": STAND_INS})
    path = tmp_path / "h200.json"
    argv = ["--model", "small", "--batch", "1", "--seq", "16", "--steps", "3", "--every", "2", "--json", str(path)]
    found = T.run_model("small", T.parse(argv), argv, tokens, torch.device("cpu"), "NVIDIA H200")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "small L2 hidden768 H12 inter2048 B1 S16 bf16, 3 steps, AdamW lr 0.001, on NVIDIA H200, torch " \
        + torch.__version__
    assert out[1].startswith("pytorch: ") and out[2].split() == ["step", "pytorch"] and out[-1].startswith("tokens/s")
    run, = json.loads(path.read_text())["runs"]
    assert run["ways"] == found.results and (run["model"], run["batch"], run["seq"], run["steps"]) == ("small", 1, 16, 3)
    assert len(run["ways"]["pytorch"]["losses"]) == 2  # steps 0 and 2, the last


# ---------------------------------------------------------------- the command without a GPU

def test_without_cuda_the_command_says_so_in_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert T.main(["--model", "moe", "--steps", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "CUDA GPU" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_the_module_run_as_a_command_exits_2_without_cuda(capsys):
    status = run_as_command("stages.stage10_model.train", "--steps", "1")
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.count("\n") == 1, err
