"""ops.moe_layer's gradients (stages/ops/moe.py): stage 14's backward, on what stage 7's forward saved, behind the
eager torch.autograd.Function and behind the custom ops flashmoe::moe_layer_saving and
flashmoe::moe_layer_backward (torch.library.register_autograd).

Without a GPU: PyTorch math stands in for the kernels, the forward's with what it saves (test_ops.saved_in_torch)
and the backward's from the saved tensors alone (backward_from_saved: the routing's weights, logits and
permutation and h1, as stage 14's launch takes them); the gradients that reach ops.moe_layer's inputs then pass
the backward problem's check, on both paths, which therefore hand the backward what the forward saved under
the right names. Also: gradients only where wanted, none for a router_bias of None, a caller's load-balancing
loss on top, the fake implementations, make_fx, torch.compile(fullgraph=True) forward and backward,
torch.library.opcheck, and the refusals in one line (a backward off sm_90a among them). On an H100 or H200:
the same checks on stage 7's and stage 14's kernels, opcheck and torch.compile(fullgraph=True) of a forward
and backward."""
import functools
from collections import OrderedDict

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import reference
import stages
from reference import moe
from reference.moe_layer_backward import DIFFERENTIATED, Saved
from reference.moe_routing import ALPHA
from stages import ops
from test_ops import A100, H100, called_ops, fake_cuda, math_launches, no_launch, saved_in_torch

BACKWARD = reference.load("moe_layer_backward")
CASES = BACKWARD.cases()
LAYER_INPUTS = ("x", "wr", "bias", "w1", "w2")  # the backward problem's names of ops.moe_layer's tensors
LAYERS = {  # the eager path (the autograd.Function) and the custom op's, each -> (out, topk_ids)
    "ops.moe_layer": lambda x, wr, bias, w1, w2, top_k: ops.moe_layer(x, wr, w1, w2, top_k, router_bias=bias,
                                                                      return_topk_ids=True),
    "flashmoe::moe_layer_saving": lambda x, wr, bias, w1, w2, top_k: tuple(
        torch.ops.flashmoe.moe_layer_saving(x, wr, bias, w1, w2, top_k)[:2]),
}


def case_named(name: str):
    return next(c for c in CASES if c.name == name)


def problem_inputs(case, device="cuda") -> dict:
    """The backward problem's inputs for a case, without a load-balancing loss (aux_coef 0), as ops.moe_layer
    differentiates the layer."""
    return dict(BACKWARD.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device=device),
                aux_coef=0.0)


def layer_gradients(layer, inputs: dict, with_bias=True, wanted=DIFFERENTIATED, extra_loss=None) -> dict:
    """{"dx": ..., "dbias": ..., ...}: the gradients of Σ dY·out (+ extra_loss(leaves, out, topk_ids)) through
    `layer` (one of LAYERS) at the problem's inputs, each input a leaf requiring grad where `wanted`; the
    router_bias given as None without with_bias. inputs' topk_ids become the forward's routing, which the
    problem's reference then follows (as where the grader times the forward's kernel and the backward's)."""
    leaves = {n: inputs[n].detach().clone().requires_grad_(n in wanted) for n in LAYER_INPUTS}
    bias = leaves["bias"] if with_bias else None
    out, topk_ids = layer(leaves["x"], leaves["wr"], bias, leaves["w1"], leaves["w2"], inputs["top_k"])
    loss = (out.float() * inputs["dy"].float()).sum()
    if extra_loss:
        loss = loss + extra_loss(leaves, out, topk_ids)
    loss.backward()
    inputs["topk_ids"] = topk_ids
    return {f"d{n}": leaves[n].grad for n in DIFFERENTIATED}


def failures(inputs: dict, gradients: dict) -> list[str]:
    checks = BACKWARD.check(gradients, BACKWARD.reference(inputs), BACKWARD.library_output(inputs))
    return [f"{c.output}: {c.quality}" for c in checks if not c.passed]


def caller_balance_loss(leaves, out, topk_ids):
    """The Switch load-balancing loss as a model computes it beside ops.moe_layer (α = stage 5's ALPHA): from
    the router's fp32 logits and the layer's routing; autograd adds its gradient to x's, Wr's and bias's."""
    logits = moe.router_logits(leaves["x"], leaves["wr"], leaves["bias"])
    counts = moe.expert_counts(topk_ids, logits.shape[1])
    return moe.balance_loss(torch.softmax(logits, dim=-1), counts, topk_ids.shape[1], ALPHA)


# ---------------------------------------------------------------- without a GPU: PyTorch math for the kernels

def backward_from_saved(x, wr, w1, w2, dy, aux_coef, saved: Saved, dx, dwr, dbias, dw1, dw2) -> None:
    """The backward problem's gradients into dx .. dw2 (reference/moe_layer_backward.py's formulas) in fp32,
    from what the forward saved and nothing recomputed: h1 = [G U] of each token-slot at its row dest[t, j],
    the top-k weights, the logits (the load-balancing term's softmax), the counts; stage 14's launch's
    arguments. Each row's token must be source_token's."""
    ids, weights, h1 = saved.topk_ids.long(), saved.topk_weights, saved.h1
    (tokens, top_k), experts, inter = ids.shape, wr.shape[1], w2.shape[1]
    rows = saved.dest.flatten().long()
    token = torch.arange(tokens * top_k) // top_k
    assert torch.equal(saved.source_token[rows].long(), token), "dest and source_token disagree"
    slot_gradient = torch.zeros(tokens * top_k)  # g_j = dY[t] · y_e(x[t])
    dx_f, dy_f = torch.zeros(x.shape), dy.float()
    for e in range(experts):
        slots = torch.nonzero(ids.flatten() == e).flatten()
        gate, up = h1[rows[slots]].float().split(inter, dim=1)
        sig = torch.sigmoid(gate)
        h = gate * sig * up
        weighted = weights.flatten()[slots, None] * dy_f[token[slots]]
        slot_gradient[slots] = (dy_f[token[slots]] * (h @ w2[e].float())).sum(1)
        dh = weighted @ w2[e].float().T
        dh1 = torch.cat((dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig), dim=1)
        dw2[e] = h.T @ weighted
        dw1[e] = x[token[slots]].float().T @ dh1
        dx_f.index_add_(0, token[slots], dh1 @ w1[e].float().T)
    g = slot_gradient.view(tokens, top_k)
    dlogits = torch.zeros(tokens, experts).scatter_add_(1, ids, weights * (g - (weights * g).sum(1, keepdim=True)))
    p, f = torch.softmax(saved.logits, dim=-1), saved.expert_counts.float() / (tokens * top_k)
    dlogits += aux_coef * experts / tokens * p * (f - (p * f).sum(1, keepdim=True))
    dwr.copy_(x.float().T @ dlogits)
    dbias.copy_(dlogits.sum(0))
    dx.copy_(dx_f + dlogits @ wr.float().T)


def cpu_launches(problem, inputs, outputs, saving=False):
    """Stands in for launch_fastest on CPU tensors: the forward's contract in PyTorch math (test_ops), with
    what it saves where saving; the backward by backward_from_saved on the backward problem's inputs, as
    stage 14's launch takes them (Saved's fields by their names)."""
    if problem.name != BACKWARD.name:
        return math_launches(problem, inputs, outputs, saving=saving)
    i = inputs
    backward_from_saved(i["x"], i["wr"], i["w1"], i["w2"], i["dy"], i["aux_coef"],
                        Saved(*(i[name] for name in Saved._fields)), *(outputs[n] for n in BACKWARD.outputs))


@pytest.fixture
def on_the_cpu(monkeypatch):
    """CPU tensors taken (every check but the device's runs), PyTorch math as the kernels."""
    monkeypatch.setattr(ops.shared, "launch_fastest", cpu_launches)
    monkeypatch.setattr(ops.shared, "device_problem", lambda tensors: None)
    monkeypatch.setattr(ops.moe, "moe_backward_gpu_problem", lambda device_index: None)


# Cases of many tokens (test_moe_backward_stage says why): fp16 top-4, skewed bf16, experts no token picks.
CPU_CASES = ["T333 E16 k4 hidden200 inter136 fp16", "T1000 E32 k2 hidden256 inter128 skew6 bf16",
             "T999 E64 k8 hidden64 inter128 empty63 fp16"]
TOP_1 = "T37 E8 k1 hidden72 inter104 bf16"


@pytest.mark.parametrize("path", LAYERS)
@pytest.mark.parametrize("case", CPU_CASES)
def test_the_gradients_through_both_paths_pass_the_backward_problems_check(case, path, on_the_cpu):
    inputs = problem_inputs(case_named(case), device="cpu")
    gradients = layer_gradients(LAYERS[path], inputs)
    assert [g.dtype for g in gradients.values()] == [inputs[n].dtype for n in DIFFERENTIATED]
    assert not failures(inputs, gradients), failures(inputs, gradients)


def test_both_paths_give_the_same_gradients(on_the_cpu):
    case = case_named(CPU_CASES[0])
    eager, through_ops = (layer_gradients(LAYERS[path], problem_inputs(case, device="cpu")) for path in LAYERS)
    for name in eager:
        torch.testing.assert_close(eager[name], through_ops[name], rtol=0, atol=0, msg=name)


def test_a_wrong_routing_fails_the_check(on_the_cpu, monkeypatch):
    """The check above can fail: a backward handed other top-k ids than the forward's gives gradients the
    problem rejects."""
    def shifted(problem, inputs, outputs, saving=False):
        if problem.name == BACKWARD.name:
            inputs = dict(inputs, topk_ids=(inputs["topk_ids"] + 1) % inputs["wr"].shape[1])
        return cpu_launches(problem, inputs, outputs, saving)
    monkeypatch.setattr(ops.shared, "launch_fastest", shifted)
    inputs = problem_inputs(case_named(CPU_CASES[0]), device="cpu")
    assert failures(inputs, layer_gradients(LAYERS["ops.moe_layer"], inputs))


@pytest.mark.parametrize("path", LAYERS)
def test_only_the_inputs_that_require_grad_get_gradients(path, on_the_cpu):
    inputs = problem_inputs(case_named(CPU_CASES[0]), device="cpu")
    gradients = layer_gradients(LAYERS[path], inputs, wanted=("x", "w2"))
    assert [n for n, g in gradients.items() if g is not None] == ["dx", "dw2"]


@pytest.mark.parametrize("path", LAYERS)
def test_without_a_router_bias_there_is_no_dbias_and_the_rest_is_a_zero_bias_gradients(path, on_the_cpu):
    inputs = problem_inputs(case_named(CPU_CASES[0]), device="cpu")
    inputs["bias"].zero_()
    without = layer_gradients(LAYERS[path], inputs, with_bias=False)
    zero_bias = layer_gradients(LAYERS[path], inputs)
    assert without.pop("dbias") is None and zero_bias.pop("dbias") is not None
    for name in without:
        torch.testing.assert_close(without[name], zero_bias[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("path", LAYERS)
def test_a_callers_balance_loss_adds_the_gradient_of_the_problems_aux_term(path, on_the_cpu):
    """ops.moe_layer returns no load-balancing loss; one computed beside it (caller_balance_loss) makes the
    gradients of the backward problem's whole L, its aux_coef α included. One expert per token: the top-k
    weight is 1 whatever the logits, and the router's gradients are the balance loss's alone."""
    inputs = problem_inputs(case_named(TOP_1), device="cpu")
    gradients = layer_gradients(LAYERS[path], inputs, extra_loss=caller_balance_loss)
    inputs["aux_coef"] = ALPHA
    assert not failures(inputs, gradients), failures(inputs, gradients)
    inputs["aux_coef"] = 0.0
    assert failures(inputs, gradients), "the balance loss's gradient is too small for the check to see"


@pytest.mark.parametrize("path", LAYERS)
def test_torch_compile_fullgraph_differentiates_as_eager(path, on_the_cpu):
    """torch.compile(fullgraph=True) traces a forward and backward through the MoE layer without a graph break
    (aot_eager, on CPU tensors) and computes the eager gradients."""
    inputs = problem_inputs(case_named(TOP_1), device="cpu")
    eager = layer_gradients(LAYERS[path], inputs)
    compiled = layer_gradients(torch.compile(LAYERS[path], fullgraph=True, backend="aot_eager"), inputs)
    torch._dynamo.reset()
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], msg=name)


def small_layer(device="cpu", requires_grad=False):
    inputs = BACKWARD.make_inputs(dict(tokens=37, experts=8, top_k=2, hidden=64, inter=72), "bfloat16", seed=0,
                                  device=device)
    return {n: inputs[n].requires_grad_(requires_grad) for n in LAYER_INPUTS}, inputs["dy"]


@pytest.mark.parametrize("with_bias", [True, False])
def test_opcheck_passes_with_stage_14s_arithmetic_for_the_kernels(with_bias, on_the_cpu):
    """torch.library.opcheck on CPU tensors: the schemas (no mutation, no aliasing), the fake implementations
    against the real ops, the autograd registration, AOTAutograd with dynamic shapes."""
    layer, dy = small_layer(requires_grad=True)
    bias = layer["bias"] if with_bias else None
    args = (layer["x"], layer["wr"], bias, layer["w1"], layer["w2"])
    torch.library.opcheck(torch.ops.flashmoe.moe_layer_saving.default, (*args, 2))
    detached = [None if t is None else t.detach() for t in args]
    torch.library.opcheck(torch.ops.flashmoe.moe_layer.default, (*detached, 2))
    _, *saved = torch.ops.flashmoe.moe_layer_saving(*detached, 2)
    x, wr, _, w1, w2 = detached
    torch.library.opcheck(torch.ops.flashmoe.moe_layer_backward.default, (dy, x, wr, w1, w2, *saved))


# ---------------------------------------------------------------- tracing: fake implementations and make_fx

def saved_shapes(T, E, k, inter, dtype=torch.bfloat16) -> list:
    """(shape, dtype) of each of Saved's tensors, as stage 7 saves them: rows = T·k + E·127."""
    rows = moe.padded_capacity(T, E, k, 128)
    i32, f32 = torch.int32, torch.float32
    return [((T, k), i32), ((T, k), f32), ((T, E), f32), ((E,), i32), ((E + 1,), i32), ((T, k), i32),
            ((rows,), i32), ((rows, 2 * inter), dtype)]


@pytest.mark.parametrize("with_bias", [True, False])
def test_the_saving_forwards_fake_gives_out_and_what_stage_7_saves(with_bias, monkeypatch):
    no_launch(monkeypatch)
    mode = FakeTensorMode()
    x, wr = fake_cuda(mode, 5, 64), fake_cuda(mode, 64, 8)
    w1, w2 = fake_cuda(mode, 8, 64, 256), fake_cuda(mode, 8, 128, 64)
    bias = fake_cuda(mode, 8, dtype=torch.float32) if with_bias else None
    with mode:
        out, *saved = torch.ops.flashmoe.moe_layer_saving(x, wr, bias, w1, w2, 3)
    assert all(isinstance(t, FakeTensor) and t.device.type == "cuda" for t in (out, *saved))
    assert (out.shape, out.dtype) == (x.shape, x.dtype)
    assert [(tuple(t.shape), t.dtype) for t in saved] == saved_shapes(5, 8, 3, 128)
    assert len(saved) == len(Saved._fields)


def test_the_backwards_fake_gives_the_gradients_shapes_dtypes_and_devices(monkeypatch):
    no_launch(monkeypatch)
    mode = FakeTensorMode()
    x, dy, wr = fake_cuda(mode, 5, 64), fake_cuda(mode, 5, 64), fake_cuda(mode, 64, 8)
    w1, w2 = fake_cuda(mode, 8, 64, 256), fake_cuda(mode, 8, 128, 64)
    with mode:
        saved = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in saved_shapes(5, 8, 3, 128)]
        gradients = torch.ops.flashmoe.moe_layer_backward(dy, x, wr, w1, w2, *saved)
    assert all(isinstance(g, FakeTensor) and g.device.type == "cuda" for g in gradients)
    assert [(g.shape, g.dtype) for g in gradients] == [(x.shape, x.dtype), (wr.shape, wr.dtype),
                                                       ((8,), torch.float32), (w1.shape, w1.dtype),
                                                       (w2.shape, w2.dtype)]


def test_make_fx_traces_the_moe_backward(monkeypatch):
    """Differentiating through ops.moe_layer puts the saving forward and flashmoe::moe_layer_backward in the
    graph, and not the inference op (fake CPU tensors, the device check off, as test_ops's attention backward)."""
    no_launch(monkeypatch)
    monkeypatch.setattr(ops.shared, "device_problem", lambda tensors: None)
    with FakeTensorMode():
        shapes = dict(x=(37, 64), wr=(64, 8), bias=(8,), w1=(8, 64, 144), w2=(8, 72, 64))
        layer = {n: torch.empty(shape, dtype=torch.float32 if n == "bias" else torch.bfloat16).requires_grad_()
                 for n, shape in shapes.items()}
        dy = torch.empty(37, 64, dtype=torch.bfloat16)

    def model(x, wr, bias, w1, w2):
        out = ops.moe_layer(x, wr, w1, w2, 2, router_bias=bias)
        return out, *torch.autograd.grad((out.float() * dy.float()).sum(), (x, wr, bias, w1, w2))

    graph = make_fx(model, tracing_mode="fake")(*(layer[n] for n in LAYER_INPUTS))
    called = called_ops(graph)
    assert {torch.ops.flashmoe.moe_layer_saving.default, torch.ops.flashmoe.moe_layer_backward.default} <= called, \
        graph.code
    assert torch.ops.flashmoe.moe_layer.default not in called


def test_without_gradients_the_traced_layer_is_the_inference_op(monkeypatch):
    no_launch(monkeypatch)
    monkeypatch.setattr(ops.shared, "device_problem", lambda tensors: None)
    with FakeTensorMode():
        shapes = dict(x=(37, 64), wr=(64, 8), w1=(8, 64, 144), w2=(8, 72, 64))
        layer = {n: torch.empty(shape, dtype=torch.bfloat16).requires_grad_() for n, shape in shapes.items()}

    def model(x, wr, w1, w2):
        with torch.no_grad():
            return ops.moe_layer(x, wr, w1, w2, 2)

    called = called_ops(make_fx(model, tracing_mode="fake")(*layer.values()))
    assert torch.ops.flashmoe.moe_layer.default in called
    assert torch.ops.flashmoe.moe_layer_saving.default not in called


# ---------------------------------------------------------------- refusals

REFUSAL = ("the MoE layer's backward needs an H100 or H200 (sm_90a, where stage 14 runs); no course stage "
           "solves moe_layer_backward on this GPU (NVIDIA A100-SXM4-80GB, sm_80)")


@pytest.mark.parametrize("path,who", [("ops.moe_layer", "ops.moe_layer"),
                                      ("flashmoe::moe_layer_saving", "flashmoe::moe_layer_backward")])
def test_a_backward_off_sm_90a_is_refused_in_one_line(path, who, monkeypatch):
    """The forward runs (stage 7's rung, here its math), without saving (the rung cannot); the backward raises
    one ValueError naming the GPUs that run it, before anything is launched."""
    def forward_only(problem, inputs, outputs):
        assert problem.name != BACKWARD.name, "the backward launched off sm_90a"
        math_launches(problem, inputs, outputs)
    monkeypatch.setattr(ops.shared, "launch_fastest", forward_only)
    monkeypatch.setattr(ops.shared, "device_problem", lambda tensors: None)
    monkeypatch.setattr(ops.shared, "ops_stage_on", lambda problem, device_index: stages.ops_stage(problem, A100))
    monkeypatch.setattr(ops.moe, "moe_backward_gpu_problem",
                        functools.cache(ops.moe.moe_backward_gpu_problem.__wrapped__))
    layer, dy = small_layer(requires_grad=True)
    out, _ = LAYERS[path](*(layer[n] for n in LAYER_INPUTS), 2)
    with pytest.raises(ValueError) as error:
        out.backward(dy)
    assert str(error.value) == f"{who}: {REFUSAL}"


def test_stage_14_alone_runs_the_backward_and_on_sm_90a_only(monkeypatch):
    chosen, arch = stages.ops_stage("moe_layer_backward", H100)
    assert (chosen.name, arch) == ("stage14_moe_backward", "sm_90a")
    for gpu, problem in ((H100, None), (A100, REFUSAL)):
        monkeypatch.setattr(ops.shared, "ops_stage_on", lambda name, device_index: stages.ops_stage(name, gpu))
        assert ops.moe.moe_backward_gpu_problem.__wrapped__(0) == problem


def backward_args(**changes) -> dict:
    """flashmoe::moe_layer_backward's arguments by name, as the forward gives them on the CPU, but `changes`."""
    layer, dy = small_layer()
    topk_ids = moe.topk_exact(moe.router_logits(layer["x"], layer["wr"], layer["bias"]), 2)[0]
    return {"grad_out": dy, "x": layer["x"], "router_weight": layer["wr"], "w1": layer["w1"], "w2": layer["w2"],
            **saved_in_torch(layer, topk_ids)._asdict(), **changes}


ROWS = moe.padded_capacity(37, 8, 2, 128)  # small_layer's
BAD_BACKWARD_INPUTS = {
    "grad_out of another shape": (dict(grad_out=torch.zeros(36, 64, dtype=torch.bfloat16)),
                                  "expected grad_out of x's shape [37, 64] and dtype torch.bfloat16"),
    "grad_out in float16": (dict(grad_out=torch.zeros(37, 64, dtype=torch.float16)), "got grad_out torch.float16"),
    "int64 topk_ids": (dict(topk_ids=torch.zeros(37, 2, dtype=torch.int64)),
                       "topk_ids torch.int32 [37, 2]; got topk_ids torch.int64 [37, 2]"),
    "flat topk_ids": (dict(topk_ids=torch.zeros(74, dtype=torch.int32)), "topk_ids [T, top_k]"),
    "top_k 9": (dict(topk_ids=torch.zeros(37, 9, dtype=torch.int32)), "top_k must be an int from 1 to min(E, 8)"),
    "fp32 weights": (dict(w1=torch.zeros(8, 64, 144)), "must all be float16 or all bfloat16"),
    "bf16 logits": (dict(logits=torch.zeros(37, 8, dtype=torch.bfloat16)),
                    "logits torch.float32 [37, 8]; got logits torch.bfloat16 [37, 8]"),
    "h1 of the unpadded rows": (dict(h1=torch.zeros(74, 144, dtype=torch.bfloat16)),
                                f"h1 torch.bfloat16 [{ROWS}, 144]; got h1 torch.bfloat16 [74, 144]"),
    "offsets without their end": (dict(expert_offsets=torch.zeros(8, dtype=torch.int32)),
                                  "expert_offsets torch.int32 [9]; got expert_offsets torch.int32 [8]"),
    "a strided h1": (dict(h1=torch.zeros(144, ROWS, dtype=torch.bfloat16).t()), "must be contiguous"),
    "CPU tensors": ({}, "must be on one CUDA GPU"),
}


@pytest.mark.parametrize("what", BAD_BACKWARD_INPUTS)
def test_the_backward_op_refuses_inputs_in_one_line(what, monkeypatch):
    changes, says = BAD_BACKWARD_INPUTS[what]
    monkeypatch.setattr(ops.shared, "launch_fastest", lambda *a: pytest.fail("launched on inputs it should refuse"))
    with pytest.raises(ValueError) as error:
        torch.ops.flashmoe.moe_layer_backward(**backward_args(**changes))
    assert str(error.value).startswith("flashmoe::moe_layer_backward: ") and says in str(error.value)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------- on an H100 or H200

def needs_the_backward():
    try:
        ops.ops_stage_on(BACKWARD.name, torch.cuda.current_device())
    except RuntimeError as error:
        pytest.skip(f"no MoE backward on this GPU: {error}")


# One token-heavy case of each kind: fp16 top-4; skewed routing; experts no token picks; DeepSeek-like.
GPU_CASES = ["T333 E16 k4 hidden200 inter136 fp16", "T1000 E32 k2 hidden256 inter128 skew6 bf16",
             "T500 E16 k4 hidden72 inter104 empty3,7 bf16", "T1000 E256 k8 hidden128 inter64 bf16"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", LAYERS)
@pytest.mark.parametrize("case", GPU_CASES)
def test_the_kernels_gradients_pass_the_backward_problems_check(case, path):
    needs_the_backward()
    inputs = problem_inputs(case_named(case))
    gradients = layer_gradients(LAYERS[path], inputs)
    assert [g.dtype for g in gradients.values()] == [inputs[n].dtype for n in DIFFERENTIATED]
    assert not failures(inputs, gradients), failures(inputs, gradients)


@pytest.mark.gpu
def test_on_the_kernels_no_router_bias_gives_no_dbias_and_a_zero_bias_gradients():
    needs_the_backward()
    inputs = problem_inputs(case_named(GPU_CASES[1]))
    inputs["bias"].zero_()
    gradients = layer_gradients(LAYERS["ops.moe_layer"], inputs, with_bias=False)
    assert gradients.pop("dbias") is None
    gradients["dbias"] = torch.zeros_like(inputs["bias"])  # a placeholder: its check is left out
    assert [f for f in failures(inputs, gradients) if not f.startswith("dbias")] == []


@pytest.mark.gpu
def test_on_the_kernels_a_callers_balance_loss_makes_the_problems_gradients():
    """One expert per token, as on the CPU: the router's gradients are the balance loss's alone."""
    needs_the_backward()
    inputs = problem_inputs(case_named(TOP_1))
    gradients = layer_gradients(LAYERS["ops.moe_layer"], inputs, extra_loss=caller_balance_loss)
    inputs["aux_coef"] = ALPHA
    assert not failures(inputs, gradients), failures(inputs, gradients)


@pytest.mark.gpu
def test_opcheck_passes_on_the_moe_ops_with_gradients():
    needs_the_backward()
    for with_bias in (True, False):
        layer, dy = small_layer("cuda", requires_grad=True)
        args = (layer["x"], layer["wr"], layer["bias"] if with_bias else None, layer["w1"], layer["w2"])
        # Not test_aot_dispatch_dynamic, which compares two runs' outputs bit for bit: the saved permutation's
        # order within an expert's segment is stage 5's atomics' (dest, source_token and h1's rows with it),
        # and rows past offsets[E] are never written. The gradients through it are compared below and in
        # test_torch_compile_fullgraph_runs_the_moe_forward_and_backward_as_eager.
        torch.library.opcheck(torch.ops.flashmoe.moe_layer_saving.default, (*args, 2),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        detached = [None if t is None else t.detach() for t in args]
        torch.library.opcheck(torch.ops.flashmoe.moe_layer.default, (*detached, 2))
        _, *saved = torch.ops.flashmoe.moe_layer_saving(*detached, 2)
        x, wr, _, w1, w2 = detached
        torch.library.opcheck(torch.ops.flashmoe.moe_layer_backward.default, (dy, x, wr, w1, w2, *saved))


@pytest.mark.gpu
def test_torch_compile_fullgraph_runs_the_moe_forward_and_backward_as_eager():
    """Inductor's graph of a forward and backward through ops.moe_layer: the same kernels as eager, within
    rounding (the backward's combine adds each token's slots with atomics)."""
    needs_the_backward()
    inputs = problem_inputs(case_named(GPU_CASES[1]))
    eager = layer_gradients(LAYERS["ops.moe_layer"], inputs)
    compiled = layer_gradients(torch.compile(LAYERS["ops.moe_layer"], fullgraph=True), inputs)
    torch._dynamo.reset()
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], atol=2e-2, rtol=2e-2, msg=name)


# ---------------------------------------------------------------- small calls without gradients: CUDA graphs

class FakeGraph:
    """Stands in for ops.moe.MoeGraph: counts its captures and replays, computes as the launch does."""
    captured = []

    def __init__(self, *layer):
        self.layer = layer[1:]
        FakeGraph.captured.append(self)
        self.replays = 0

    def __call__(self, x):
        self.replays += 1
        return ops.moe_launch(x, *self.layer)


@pytest.fixture
def graphs(monkeypatch, on_the_cpu):
    """CPU tensors taken for small GPU calls outside a capture; empty caches; FakeGraph for the graphs."""
    monkeypatch.setattr(ops.moe, "graphs_apply", lambda x: True)
    monkeypatch.setattr(ops.moe, "MoeGraph", FakeGraph)
    monkeypatch.setattr(ops.moe, "_MOE_GRAPHS", OrderedDict())
    monkeypatch.setattr(ops.moe, "_MOE_SEEN", OrderedDict())
    FakeGraph.captured = []
    return FakeGraph.captured


def call(layer: dict, x=None):
    return ops.moe_layer(layer["x"] if x is None else x, layer["wr"], layer["w1"], layer["w2"], layer["top_k"],
                         router_bias=layer["bias"], return_topk_ids=True)


def test_a_small_call_seen_before_replays_a_graph_with_the_same_results(graphs):
    """The first call of a shape is launched, the second captures, the third replays the same graph; each
    gives the launch's results for its own x."""
    layer = {**small_layer()[0], "top_k": 2}
    for n in range(3):
        x = torch.randn_like(layer["x"])
        torch.testing.assert_close(call(layer, x), ops.moe_launch(x, layer["wr"], layer["bias"], layer["w1"],
                                                                   layer["w2"], 2), rtol=0, atol=0)
        assert len(graphs) == (0, 1, 1)[n]
    assert graphs[0].replays == 2


def test_other_weights_or_another_shape_are_another_graph(graphs):
    layer = {**small_layer()[0], "top_k": 2}
    other = {**layer, "w1": layer["w1"].clone()}
    for _ in range(2):
        call(layer), call(other), call(layer, layer["x"][:5])
    assert len(graphs) == 3
    assert len({id(g) for g in ops.moe._MOE_GRAPHS.values()}) == 3


def test_the_least_recently_replayed_graph_goes_first(graphs, monkeypatch):
    monkeypatch.setattr(ops.moe, "MOE_GRAPHS", 2)
    layer = {**small_layer()[0], "top_k": 2}
    shapes = [layer["x"][:n] for n in (3, 4, 5)]
    for x in shapes + shapes[:2] + shapes[:1]:
        call(layer, x)
    assert [key[0][0] for key in ops.moe._MOE_GRAPHS] == [4, 3]  # 5's graph dropped when 4's was replayed


def test_graphs_only_for_small_gpu_calls_outside_a_capture(monkeypatch):
    mode = FakeTensorMode()
    small, large = fake_cuda(mode, ops.MOE_GRAPH_TOKENS, 64), fake_cuda(mode, ops.MOE_GRAPH_TOKENS + 1, 64)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert ops.moe.graphs_apply(small) and not ops.moe.graphs_apply(large)
    assert not ops.moe.graphs_apply(torch.empty(5, 64))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not ops.moe.graphs_apply(small)


@pytest.mark.gpu
def test_replayed_graphs_give_the_launchs_results_on_the_gpu():
    """On a GPU: three calls of a small shape, fresh x each time (launched, captured, replayed), and a
    weight updated in place between them: each result equals a plain launch's, bit for bit."""
    layer = {**small_layer(device="cuda")[0], "top_k": 2}
    for n in range(4):
        x = torch.randn_like(layer["x"])
        if n == 3:
            layer["w2"].mul_(2)
        expected = ops.moe_launch(x, layer["wr"], layer["bias"], layer["w1"], layer["w2"], 2)
        for got, want in zip(call(layer, x), expected):
            assert torch.equal(got, want), f"call {n}"
