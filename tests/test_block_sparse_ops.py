"""ops.block_sparse_attention (stages/ops/block_sparse.py): stages 12 and 13 called as FlexAttention is, on a BlockMask.

Without a GPU: a BlockMask made by create_block_mask (or BlockMask.from_kv_blocks) reaches the problem's
run_stage as the problem's own layout for the same mask; every input the kernels do not take is refused in
one line before anything is launched (another GPU than sm_90a's included); the autograd plumbing, eager and
traced (make_fx, torch.compile fullgraph), gives the exact gradients with PyTorch math standing in for the
kernels. On an H100 or H200: the output, the LSE and the gradients pass the problem's checks (odd lengths,
GQA, each element mask, query blocks that see no key, a mask without full blocks apart), opcheck passes
and torch.compile(fullgraph=True) runs the forward and backward through the custom ops."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import reference
import stages
from grader.ops_benchmark import latency_figures, ops_mask_arguments
from reference.block_sparse_attention import (LAYOUT, block_layout, blockwise_attention, dense_visible,
                                              element_mask_mod, listed, to_block_mask)
from reference.block_sparse_attention_backward import exact_gradients
from reference.tolerance import relative_to_library
from stages import ops
from test_ops import A100, H100, L4, called_ops

FORWARD = reference.load("block_sparse_attention")
BACKWARD = reference.load("block_sparse_attention_backward")
CASES = FORWARD.cases()
# the problem's cases by what they hold (reference/block_sparse_attention.py's _CASES)
CAUSAL_ODD, CAUSAL_EMPTY, WINDOW, WINDOW_MQA = 1, 4, 5, 6
DOCUMENTS, DOCUMENTS_EMPTY, GRAPH, GRAPH_MQA = 9, 11, 13, 16


def case_inputs(index: int, device="cpu", backward=False) -> dict:
    c = CASES[index]
    return (BACKWARD if backward else FORWARD).make_inputs(c.shape, c.dtype, c.seed, c.input_scale, device=device)


def flex_block_mask(inputs: dict) -> BlockMask:
    """The BlockMask a FlexAttention user makes for the inputs: create_block_mask on the element mask's
    mask_mod, or, for the neighbourhood graph (a pattern of blocks, no mask_mod), from its block lists."""
    seq_len = inputs["q"].shape[2]
    if inputs["element_mask"] == "none":
        return to_block_mask(inputs, seq_len)
    return create_block_mask(element_mask_mod(inputs), None, None, seq_len, seq_len, device=inputs["q"].device)


def problem_block_mask(inputs: dict) -> BlockMask:
    """The problem's own mask (query blocks it empties included) as FlexAttention's BlockMask."""
    return to_block_mask(inputs, inputs["q"].shape[2], element_mask_mod(inputs))


@pytest.fixture
def gpu_checks_off(monkeypatch):
    without_gpu_checks(monkeypatch)


def without_gpu_checks(monkeypatch):
    """The device and stage checks off, so that the rest runs on CPU tensors (no layout remembered as fit)."""
    monkeypatch.setattr(ops.shared, "device_problem", lambda tensors: None)
    monkeypatch.setattr(ops.shared, "stage_problem", lambda problem, tensor: None)
    monkeypatch.setattr(ops.dense, "_FIT_LAYOUTS", set())


def recorded_launches(monkeypatch) -> list:
    """launch_fastest replaced: each call's (problem name, inputs) recorded, the outputs zeroed."""
    calls = []

    def record(problem, inputs, outputs):
        calls.append((problem.name, dict(inputs)))
        for t in outputs.values():
            t.zero_()
    monkeypatch.setattr(ops.shared, "launch_fastest", record)
    return calls


# ---------------------------------------------------------------- the BlockMask, as the problem takes it

@pytest.mark.parametrize("index", [CAUSAL_ODD, WINDOW_MQA, DOCUMENTS, GRAPH], ids=lambda i: CASES[i].name)
def test_a_flexattention_block_mask_reaches_the_problem_as_its_own_layout(index, gpu_checks_off, monkeypatch):
    calls = recorded_launches(monkeypatch)
    inputs = case_inputs(index)
    block_mask = flex_block_mask(inputs)
    ops.block_sparse_attention(inputs["q"], inputs["k"], inputs["v"], block_mask, **ops_mask_arguments(inputs))
    [(problem, handed)] = calls
    assert problem == "block_sparse_attention"
    for name in LAYOUT:
        assert torch.equal(handed[name], inputs[name]), name
        assert handed[name] is getattr(block_mask, name), f"{name} copied: the BlockMask's own is read"
    assert (handed["element_mask"], handed["window"], handed["scale"]) == \
        (inputs["element_mask"], inputs["window"], inputs["scale"])
    if inputs["element_mask"] == "document":
        assert torch.equal(handed["document_ids"], inputs["document_ids"])
    else:
        assert handed["document_ids"] is None  # the kernel reads none: a null pointer
    assert FORWARD.variant(handed) == FORWARD.variant(inputs)


def test_a_block_mask_without_full_blocks_apart_lists_them_all_as_partial(gpu_checks_off, monkeypatch):
    """BlockMask.from_kv_blocks given no full blocks: FlexAttention applies the mask_mod in every listed block,
    and so do the kernels, the full lists empty."""
    calls = recorded_launches(monkeypatch)
    inputs = case_inputs(CAUSAL_ODD)
    every = listed(inputs["kv_num_blocks"], inputs["kv_indices"]) | \
        listed(inputs["full_kv_num_blocks"], inputs["full_kv_indices"])
    layout = block_layout(every, torch.zeros_like(every))
    block_mask = BlockMask.from_kv_blocks(layout["kv_num_blocks"], layout["kv_indices"], BLOCK_SIZE=128,
                                          seq_lengths=(300, 300))
    ops.block_sparse_attention(inputs["q"], inputs["k"], inputs["v"], block_mask, element_mask="causal")
    [(_, handed)] = calls
    assert torch.equal(listed(handed["kv_num_blocks"], handed["kv_indices"]), every)
    assert not handed["full_kv_num_blocks"].any()


# ---------------------------------------------------------------- refusals, in one line

def cpu(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype)


def causal(b, h, i, j):
    return j <= i


def with_changes(index=CAUSAL_ODD, **changes):
    """The case's q, k, v, BlockMask and element mask arguments, some replaced."""
    def make():
        inputs = case_inputs(index)
        arguments = dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], block_mask=flex_block_mask(inputs),
                         **ops_mask_arguments(inputs))
        return {**arguments, **{name: change(inputs) if callable(change) else change
                               for name, change in changes.items()}}
    return make


S = CASES[CAUSAL_ODD].shape["S"]  # 300: three blocks, the last of 44 tokens
REFUSED = {
    "float32": (with_changes(q=cpu(2, 3, S, 64, dtype=torch.float32), k=cpu(2, 3, S, 64, dtype=torch.float32),
                             v=cpu(2, 3, S, 64, dtype=torch.float32)), "must all be float16 or all bfloat16"),
    "D = 96": (with_changes(q=cpu(2, 3, S, 96), k=cpu(2, 3, S, 96), v=cpu(2, 3, S, 96)), "one of (64, 128); got 96"),
    "k shorter than q": (with_changes(k=cpu(2, 3, 200, 64), v=cpu(2, 3, 200, 64)), "one length S (self-attention)"),
    "not a BlockMask": (with_changes(block_mask=lambda i: {n: i[n] for n in LAYOUT}),
                        "block_mask must be a FlexAttention BlockMask (create_block_mask); got dict"),
    "blocks of 64": (with_changes(block_mask=create_block_mask(causal, None, None, S, S, device="cpu", BLOCK_SIZE=64)),
                     "blocks must be 128 by 128 tokens, the kernels' tiles (create_block_mask's default BLOCK_SIZE); "
                     "got (64, 64)"),
    "a mask per batch and head": (with_changes(block_mask=create_block_mask(causal, 2, 3, S, S, device="cpu")),
                                  "one for every batch and head (create_block_mask(mask_mod, None, None, S, S)); "
                                  "got one of batches and heads (2, 3)"),
    "a mask for another length": (with_changes(block_mask=create_block_mask(causal, None, None, 384, 384,
                                                                             device="cpu")),
                                  "made for lengths (384, 384); q, k and v have S = 300"),
    "int64 lists": (with_changes(block_mask=lambda i: BlockMask.from_kv_blocks(
        *(i[n].long() for n in LAYOUT), BLOCK_SIZE=128, seq_lengths=(S, S))),
        "the block mask's lists must be int32, counts [1, 1, 3] and indices [1, 1, 3, 3]"),
    "an element mask the kernels lack": (with_changes(element_mask="alibi"),
                                         "element_mask must be one of 'none', 'causal', 'document', 'sliding_window'; "
                                         "got 'alibi'"),
    "a window without its size": (with_changes(element_mask="sliding_window"),
                                  "element_mask 'sliding_window' needs window, an int of at least 1"),
    "a window of 0": (with_changes(element_mask="sliding_window", window=0), "an int of at least 1"),
    "a window of 2.5": (with_changes(element_mask="sliding_window", window=2.5), "got 2.5"),
    "a window with a causal mask": (with_changes(window=64),
                                    "window is for element_mask 'sliding_window' alone; got window 64 with 'causal'"),
    "documents without ids": (with_changes(index=DOCUMENTS, document_ids=None),
                              "element_mask 'document' needs document_ids, int32 [S] = [700]"),
    "int64 document ids": (with_changes(index=DOCUMENTS, document_ids=lambda i: i["document_ids"].long()),
                           "got torch.int64 [700]"),
    "document ids of another length": (with_changes(index=DOCUMENTS, document_ids=lambda i: i["document_ids"][:699]),
                                       "got torch.int32 [699]"),
    "document ids with a causal mask": (with_changes(document_ids=torch.zeros(S, dtype=torch.int32)),
                                        "document_ids are for element_mask 'document' alone"),
    "strided document ids": (with_changes(index=DOCUMENTS, document_ids=lambda i: i["document_ids"].repeat(2)[::2]),
                             "must be contiguous (.contiguous() makes a copy that is); not: document_ids"),
}


@pytest.mark.parametrize("what", REFUSED)
def test_inputs_the_kernels_do_not_take_are_refused_in_one_line(what, gpu_checks_off, monkeypatch):
    make, says = REFUSED[what]
    monkeypatch.setattr(ops.shared, "launch_fastest", lambda *a: pytest.fail("launched on inputs it should refuse"))
    arguments = make()
    with pytest.raises(ValueError) as error:
        ops.block_sparse_attention(**arguments)
    message = str(error.value)
    assert message.startswith("ops.block_sparse_attention: ") and says in message, message
    assert "\n" not in message


def test_the_checks_pass_what_the_problem_takes(gpu_checks_off, monkeypatch):
    """The refusals above are of their change alone: the unchanged case of each is taken."""
    recorded_launches(monkeypatch)
    for index in (CAUSAL_ODD, DOCUMENTS, WINDOW):
        arguments = with_changes(index)()
        ops.block_sparse_attention(**arguments)


def test_cpu_tensors_are_refused(monkeypatch):
    monkeypatch.setattr(ops.shared, "launch_fastest", lambda *a: pytest.fail("launched on inputs it should refuse"))
    with pytest.raises(ValueError, match=r"^ops.block_sparse_attention: q, k, v must be on one CUDA GPU; got q on cpu"):
        ops.block_sparse_attention(**with_changes()())


def test_a_gpu_no_stage_runs_it_on_is_refused_in_one_line(monkeypatch):
    """Stages 12 and 13 are sm_90a's alone: on an A100 the call is refused before anything is compiled."""
    monkeypatch.setattr(ops.shared, "device_problem", lambda tensors: None)
    monkeypatch.setattr(ops.dense, "_FIT_LAYOUTS", set())
    monkeypatch.setattr(ops.shared, "_RUNS_HERE", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: A100)
    monkeypatch.setattr(ops.shared, "launch_fastest", lambda *a: pytest.fail("launched where no stage runs"))
    with pytest.raises(ValueError) as error:
        ops.block_sparse_attention(**with_changes()())
    assert str(error.value) == ("ops.block_sparse_attention: no course stage solves block_sparse_attention on this "
                                "GPU (NVIDIA A100-SXM4-80GB, sm_80)")


def test_stages_12_and_13_run_on_sm_90a():
    assert [(s.name, arch) for s, arch in (stages.ops_stage(p, H100) for p in (FORWARD.name, BACKWARD.name))] \
        == [("stage12_block_sparse", "sm_90a"), ("stage13_block_sparse_backward", "sm_90a")]


@pytest.mark.parametrize("gpu", [A100, L4], ids=lambda g: g.name)
@pytest.mark.parametrize("problem", [FORWARD.name, BACKWARD.name])
def test_no_stage_solves_block_sparse_attention_elsewhere(gpu, problem):
    with pytest.raises(RuntimeError, match=rf"^no course stage solves {problem} on this GPU \({gpu.name}"):
        stages.ops_stage(problem, gpu)


def test_the_ops_check_their_inputs_when_called_directly(monkeypatch):
    monkeypatch.setattr(ops.shared, "launch_fastest", lambda *a: pytest.fail("launched on inputs it should refuse"))
    inputs = case_inputs(CAUSAL_ODD, backward=True)
    mask = (*(inputs[n] for n in LAYOUT), None, "causal", 0)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    with pytest.raises(ValueError, match=r"^flashmoe::block_sparse_attention_forward: q, k, v must be on one CUDA"):
        torch.ops.flashmoe.block_sparse_attention_forward(q, k, v, *mask, 0.125)
    with pytest.raises(ValueError, match=r"^flashmoe::block_sparse_attention_backward: q, k, v must be on one CUDA"):
        torch.ops.flashmoe.block_sparse_attention_backward(inputs["do"], q, k, v, inputs["o"], inputs["lse"], *mask,
                                                           0.125)
    without_gpu_checks(monkeypatch)  # the rest of the checks, on these CPU tensors
    with pytest.raises(ValueError, match=r"^flashmoe::block_sparse_attention_forward: element_mask must be one of"):
        torch.ops.flashmoe.block_sparse_attention_forward(q, k, v, *mask[:5], "alibi", 0, 0.125)


# ---------------------------------------------------------------- the autograd plumbing, without a GPU

def math_launches(problem, inputs, outputs):
    """Stands in for launch_fastest: the kernels' contract in PyTorch math over the dense mask (small S),
    float64. The backward recomputes P from the O and LSE the forward wrote, so that both must reach it."""
    group = inputs["q"].shape[1] // inputs["k"].shape[1]
    q, k, v = (inputs[n].double().repeat_interleave(1 if n == "q" else group, 1) for n in "qkv")
    visible = dense_visible(inputs)
    scores = (inputs["scale"] * q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    if problem.name == "block_sparse_attention":
        lse = torch.logsumexp(scores, dim=-1)
        outputs["lse"].copy_(lse)
        outputs["o"].copy_(torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None]) @ v)
        return
    o, lse, grad_o = inputs["o"].double(), inputs["lse"], inputs["do"].double()
    p = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])  # 0 on a row that sees no key
    grad_scores = p * (grad_o @ v.transpose(-1, -2) - (grad_o * o).sum(-1, keepdim=True)) * inputs["scale"]
    unflat = (k.shape[0], inputs["k"].shape[1], group, *k.shape[2:])  # a KV head's gradient sums its group's
    outputs["dq"].copy_(grad_scores @ k)
    outputs["dk"].copy_((grad_scores.transpose(-1, -2) @ q).view(unflat).sum(2))
    outputs["dv"].copy_((p.transpose(-1, -2) @ grad_o).view(unflat).sum(2))


def float64_case(index: int) -> dict:
    inputs = case_inputs(index, backward=True)
    return {n: t.double() if n in ("q", "k", "v", "do") else t for n, t in inputs.items()}


def gradients(attention, inputs: dict):
    """(o, dq, dk, dv) of attention(q, k, v) on fresh leaves for the output's gradient inputs["do"]."""
    leaves = [inputs[n].detach().clone().requires_grad_() for n in "qkv"]
    o = attention(*leaves)
    o.backward(inputs["do"])
    return [o.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("index", [CAUSAL_EMPTY, WINDOW_MQA, DOCUMENTS, GRAPH], ids=lambda i: CASES[i].name)
def test_backward_gets_what_forward_saved_and_returns_the_exact_gradients(index, monkeypatch):
    """Through the eager path (the autograd.Function) and the custom ops alike: the output and gradients are the
    problem's exact ones (float64, the math standing in for the kernels), GQA's summed over each group."""
    monkeypatch.setattr(ops.shared, "launch_fastest", math_launches)
    monkeypatch.setattr(ops.shared, "refuse", lambda who, problem: None)  # float64 on the CPU: the kernels' math in it
    inputs = float64_case(index)
    block_mask, arguments = problem_block_mask(inputs), ops_mask_arguments(inputs)
    exact = [blockwise_attention(inputs)["o"], *exact_gradients(inputs).values()]
    eager = gradients(lambda q, k, v: ops.block_sparse_attention(q, k, v, block_mask, **arguments), inputs)
    mask = (*ops.mask_lists(block_mask), arguments.get("document_ids"), inputs["element_mask"], inputs["window"])
    through_ops = gradients(lambda q, k, v: torch.ops.flashmoe.block_sparse_attention_forward(
        q, k, v, *mask, inputs["scale"])[0], inputs)
    for name, mine, ops_ones, expected in zip(("o", "dq", "dk", "dv"), eager, through_ops, exact):
        torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-6, msg=name)  # the LSE is fp32
        torch.testing.assert_close(mine, ops_ones, rtol=0, atol=0, msg=name)


def test_eager_calls_skip_the_custom_ops(monkeypatch):
    monkeypatch.setattr(ops.shared, "launch_fastest", math_launches)
    monkeypatch.setattr(ops.shared, "refuse", lambda who, problem: None)
    for name in ("block_sparse_attention_forward", "block_sparse_attention_backward"):
        monkeypatch.setattr(ops.block_sparse, name, lambda *a: pytest.fail("an eager call went through the custom op"))
    inputs = float64_case(WINDOW)
    block_mask = flex_block_mask(inputs)
    o, *grads = gradients(lambda q, k, v: ops.block_sparse_attention(q, k, v, block_mask, element_mask="sliding_window",
                                                                     window=200), inputs)
    assert all(g is not None for g in grads)
    with torch.no_grad():
        torch.testing.assert_close(ops.block_sparse_attention(inputs["q"], inputs["k"], inputs["v"], block_mask,
                                                              element_mask="sliding_window", window=200), o)


OPS = ("block_sparse_attention_forward", "block_sparse_attention_backward")


@pytest.mark.parametrize("name", OPS)
def test_the_ops_are_registered_and_neither_mutate_nor_alias(name):
    schema = getattr(torch.ops.flashmoe, name).default._schema
    assert not schema.is_mutable
    assert all(a.alias_info is None for a in [*schema.arguments, *schema.returns]), str(schema)


def test_make_fx_traces_the_forward_and_backward_with_fake_tensors(gpu_checks_off, monkeypatch):
    """Differentiating through ops.block_sparse_attention on fake tensors puts both ops in the graph, with the
    fake implementations' shapes (no launch)."""
    monkeypatch.setattr(ops.shared, "launch_fastest", lambda *a: pytest.fail("a fake tensor reached a launch"))
    inputs = case_inputs(DOCUMENTS)
    lists = [inputs[n] for n in LAYOUT]

    def model(q, k, v, document_ids, *lists):
        block_mask = BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=128, seq_lengths=(700, 700))
        o = ops.block_sparse_attention(q, k, v, block_mask, element_mask="document", document_ids=document_ids)
        return o, *torch.autograd.grad(o.float().square().sum(), (q, k, v))

    leaves = [inputs[n].requires_grad_() for n in "qkv"]
    graph = make_fx(model, tracing_mode="fake")(*leaves, inputs["document_ids"], *lists)
    forward, backward = (getattr(torch.ops.flashmoe, name).default for name in OPS)
    assert {forward, backward} <= called_ops(graph), graph.code
    shapes = {node.target: [(tuple(t.shape), t.dtype) for t in node.meta["val"]] for node in graph.graph.nodes
              if node.op == "call_function" and node.target in (forward, backward)}
    q, k, v = leaves
    assert shapes[forward] == [(tuple(q.shape), q.dtype), ((1, 4, 700), torch.float32)]
    assert shapes[backward] == [(tuple(t.shape), t.dtype) for t in (q, k, v)]


def test_torch_compile_fullgraph_traces_the_checks_and_the_ops(gpu_checks_off, monkeypatch):
    """torch.compile(fullgraph=True) traces the BlockMask's conversion, the checks and the ops without a graph
    break, forward and backward (aot_eager, on CPU tensors, the math standing in for the kernels), and
    computes what eager mode does."""
    monkeypatch.setattr(ops.shared, "launch_fastest", math_launches)
    inputs = case_inputs(WINDOW_MQA, backward=True)
    block_mask = flex_block_mask(inputs)

    def model(q, k, v, block_mask):
        return ops.block_sparse_attention(q, k, v, block_mask, element_mask="sliding_window", window=128)

    results = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        results.append(gradients(lambda q, k, v: run(q, k, v, block_mask), inputs))
    for name, eager, compiled in zip(("o", "dq", "dk", "dv"), *results):
        assert eager.abs().sum() > 0, name
        torch.testing.assert_close(compiled, eager, msg=name)
    torch._dynamo.reset()


# ---------------------------------------------------------------- the serving figures' arithmetic

def test_the_serving_figures_are_the_percentiles_and_the_rate():
    latencies = [10.0] * 98 + [12.0, 30.0]  # ms: P50 10; P99 between the 99th and 100th values
    figures = latency_figures(latencies, calls_per_second=95.0)
    assert figures["p50_ms"] == 10.0 and figures["p99_ms"] == pytest.approx(12.18)
    assert figures["p99_over_p50"] == pytest.approx(1.218)
    assert figures["calls_per_second_times_p50"] == pytest.approx(0.95)


# ---------------------------------------------------------------- on an H100 or H200

GPU_CASES = [CAUSAL_ODD, CAUSAL_EMPTY, WINDOW_MQA, DOCUMENTS, DOCUMENTS_EMPTY, GRAPH, GRAPH_MQA]


def needs_stages_12_and_13():
    for problem in (FORWARD.name, BACKWARD.name):
        try:
            ops.ops_stage_on(problem, torch.cuda.current_device())
        except RuntimeError as error:
            pytest.skip(f"nothing to test: {error}")


def failures(checks) -> str:
    return "; ".join(f"{c.output}: {c.quality}" for c in checks if not c.passed)


@pytest.mark.gpu
@pytest.mark.parametrize("index", GPU_CASES, ids=lambda i: CASES[i].name)
def test_the_output_and_lse_pass_the_problems_check(index):
    needs_stages_12_and_13()
    inputs = case_inputs(index, device="cuda")
    block_mask, arguments = problem_block_mask(inputs), ops_mask_arguments(inputs)
    o = ops.block_sparse_attention(inputs["q"], inputs["k"], inputs["v"], block_mask, **arguments)
    mask = (*ops.mask_lists(block_mask), arguments.get("document_ids"), inputs["element_mask"], inputs["window"])
    o_op, lse = torch.ops.flashmoe.block_sparse_attention_forward(inputs["q"], inputs["k"], inputs["v"], *mask,
                                                                   inputs["scale"])
    assert torch.equal(o, o_op), "the eager path and the custom op launch the same kernel"
    assert o.transpose(1, 2).is_contiguous(), "O lies in memory as [B, S, H, D]"
    checks = FORWARD.check(dict(o=o, lse=lse), FORWARD.reference(inputs), FORWARD.library_output(inputs))
    assert all(c.passed for c in checks), failures(checks)


@pytest.mark.gpu
@pytest.mark.parametrize("index", GPU_CASES, ids=lambda i: CASES[i].name)
def test_the_gradients_pass_the_problems_check(index):
    needs_stages_12_and_13()
    inputs = case_inputs(index, device="cuda", backward=True)
    block_mask, arguments = problem_block_mask(inputs), ops_mask_arguments(inputs)
    _, dq, dk, dv = gradients(lambda q, k, v: ops.block_sparse_attention(q, k, v, block_mask, **arguments), inputs)
    assert (dq.shape, dk.shape, dv.shape) == (inputs["q"].shape, inputs["k"].shape, inputs["v"].shape)
    checks = BACKWARD.check(dict(dq=dq, dk=dk, dv=dv), BACKWARD.reference(inputs), BACKWARD.library_output(inputs))
    assert all(c.passed for c in checks), failures(checks)


@pytest.mark.gpu
@pytest.mark.parametrize("index", [WINDOW, DOCUMENTS], ids=lambda i: CASES[i].name)
def test_a_mask_from_create_block_mask_gives_the_problems_output(index):
    """A FlexAttention user's own BlockMask (create_block_mask on the GPU) holds the problem's lists: the same
    kernel on the same lists gives the same output, bit for bit."""
    needs_stages_12_and_13()
    inputs = case_inputs(index, device="cuda")
    arguments = ops_mask_arguments(inputs)
    theirs = ops.block_sparse_attention(inputs["q"], inputs["k"], inputs["v"], flex_block_mask(inputs), **arguments)
    ours = ops.block_sparse_attention(inputs["q"], inputs["k"], inputs["v"], problem_block_mask(inputs), **arguments)
    assert torch.equal(theirs, ours)


@pytest.mark.gpu
def test_opcheck_passes_on_the_two_ops():
    """torch.library.opcheck: the schema, the fake implementations against the real ones, the autograd
    registration, and AOTAutograd with dynamic shapes."""
    needs_stages_12_and_13()
    inputs = case_inputs(DOCUMENTS, device="cuda", backward=True)
    mask = (*(inputs[n] for n in LAYOUT), inputs["document_ids"], "document", 0)
    q, k, v = (inputs[n].detach().requires_grad_() for n in "qkv")
    torch.library.opcheck(torch.ops.flashmoe.block_sparse_attention_forward.default, (q, k, v, *mask, inputs["scale"]))
    torch.library.opcheck(torch.ops.flashmoe.block_sparse_attention_backward.default,
                          (inputs["do"], inputs["q"], inputs["k"], inputs["v"], inputs["o"], inputs["lse"], *mask,
                           inputs["scale"]))


@pytest.mark.gpu
def test_torch_compile_fullgraph_runs_the_forward_and_backward_as_eager():
    needs_stages_12_and_13()
    inputs = case_inputs(WINDOW_MQA, device="cuda", backward=True)
    block_mask, arguments = problem_block_mask(inputs), ops_mask_arguments(inputs)

    def model(q, k, v, block_mask):
        return ops.block_sparse_attention(q, k, v, block_mask, **arguments)

    results = [gradients(lambda q, k, v: run(q, k, v, block_mask), inputs)
               for run in (model, torch.compile(model, fullgraph=True))]
    for name, eager, compiled in zip(("o", "dq", "dk", "dv"), *results):
        # the same kernels; the backward's dQ sums by atomics may round in another order
        torch.testing.assert_close(compiled, eager, atol=1e-2, rtol=1e-2, msg=name)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("index", [CAUSAL_ODD, GRAPH], ids=lambda i: CASES[i].name)
def test_a_mask_without_full_blocks_apart_passes_the_problems_checks(index):
    """BlockMask.from_kv_blocks given no full blocks: every listed block partial, the element mask applied in
    each ("none": every pair of the neighbourhood graph's blocks visible all the same)."""
    needs_stages_12_and_13()
    inputs = case_inputs(index, device="cuda", backward=True)
    every = listed(inputs["kv_num_blocks"], inputs["kv_indices"]) | \
        listed(inputs["full_kv_num_blocks"], inputs["full_kv_indices"])
    inputs |= {n: t.cuda() for n, t in block_layout(every.cpu(), torch.zeros_like(every.cpu())).items()}
    seq_len = inputs["q"].shape[2]
    block_mask = BlockMask.from_kv_blocks(inputs["kv_num_blocks"], inputs["kv_indices"], BLOCK_SIZE=128,
                                          seq_lengths=(seq_len, seq_len))
    o, dq, dk, dv = gradients(lambda q, k, v: ops.block_sparse_attention(q, k, v, block_mask,
                                                                         **ops_mask_arguments(inputs)), inputs)
    checks = [relative_to_library("o", o, FORWARD.reference(inputs)["o"], FORWARD.library_output(inputs)["o"]),
              *BACKWARD.check(dict(dq=dq, dk=dk, dv=dv), BACKWARD.reference(inputs), BACKWARD.library_output(inputs))]
    assert all(c.passed for c in checks), failures(checks)
