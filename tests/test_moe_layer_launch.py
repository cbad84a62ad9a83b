"""Stage 7's launch without a GPU (recorded launches on meta tensors): without save it launches what it always
did; with save=True the same launches but for stage 6's saving up GEMM, which also gets h1, and it returns what
the backward reads (reference/moe_layer_backward.Saved), the very tensors its kernels wrote; the mma_sync rung
refuses to save, in one line, before anything is launched; the problem's forward_for_backward hands the saved
tensors on under Saved's names."""
import pytest
import torch

import reference
import stages
import stages.stage5_moe_routing as stage5
import stages.stage6_grouped_gemm as stage6
import stages.stage6_grouped_gemm.ladder as ladder
import stages.stage7_moe_layer as stage7
from reference import moe
from reference.moe_layer_backward import Saved
from stages.common.launcher import parameter_types
from stage_on_gpu import StageOnGpu
from test_launcher import assert_arguments_declared

LAYER = reference.load("moe_layer")
SHAPES = [dict(T=37, E=8, k=2, hidden=64, inter=72), dict(T=1000, E=64, k=8, hidden=4096, inter=1408),
          dict(T=1, E=256, k=8, hidden=7168, inter=2048)]


class RecordingKernels:
    """Stands in for a KernelSet: records each launch's kernel, grid and arguments."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        return lambda grid, block, *args, smem=0: self.launches.append((name, tuple(grid), tuple(args)))

    def names(self) -> list[str]:
        return [name for name, _, _ in self.launches]

    def arguments(self, name: str) -> tuple:
        (args,) = [args for kernel, _, args in self.launches if kernel == name]
        return args


class Map(tuple):
    """What the patched tensor_map returns: (tensor, box)."""


@pytest.fixture(autouse=True)
def no_driver(request, monkeypatch):
    """The driver calls of a launch (TMA descriptors, the SM count) answered without a GPU (but in the GPU tests)."""
    if request.node.get_closest_marker("gpu"):
        return
    monkeypatch.setattr(stage6, "tensor_map", lambda x, box: Map((x, box)))
    monkeypatch.setattr(stage6, "sm_count", lambda device: 132)
    monkeypatch.setattr(ladder, "sm_count", lambda device: 132)
    monkeypatch.setattr(stage5, "tokens_per_group", lambda tokens, group, device: 1)


def layer(T, E, k, hidden, inter, dtype=torch.bfloat16) -> dict:
    def meta(*shape, dtype=dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")
    return dict(x=meta(T, hidden), wr=meta(hidden, E), bias=meta(E, dtype=torch.float32), w1=meta(E, hidden, 2 * inter),
                w2=meta(E, inter, hidden), top_k=k, out=meta(T, hidden), topk_ids=meta(T, k, dtype=torch.int32))


def launch(stage, inputs: dict, **keywords):
    kernels = RecordingKernels()
    i = inputs
    found = stage.launch(kernels, i["x"], i["wr"], i["bias"], i["w1"], i["w2"], i["top_k"], i["out"], i["topk_ids"],
                         **keywords)
    return kernels, found


def router(hidden: int, tokens: int) -> list[str]:
    """The router's launches: router_sum where hidden is split (test_moe_layer checks when)."""
    kernels = RecordingKernels()
    stage7.router_logits(kernels, torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta"),
                         torch.empty(hidden, 8, dtype=torch.bfloat16, device="meta"), None,
                         torch.empty(tokens, 8, device="meta"))
    return kernels.names()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("keywords", [{}, dict(save=False)], ids=["as-before", "save-false"])
def test_without_save_the_layer_launches_what_it_always_did(shape, keywords):
    kernels, found = launch(stage7.STAGE, layer(**shape), **keywords)
    assert found is None
    assert kernels.names() == [*router(shape["hidden"], shape["T"]), "moe_topk", "moe_align", "moe_scatter",
                               "gather_rows", "expert_up_swiglu", "expert_down", "moe_combine"]


def described(argument):
    """A launch argument as two launches on like tensors pass it alike: a tensor's shape and dtype, a tensor map's
    tensor's shape and its box, a parameter struct's fields each so described."""
    if isinstance(argument, torch.Tensor):
        return argument.shape, argument.dtype
    if isinstance(argument, Map):
        return argument[0].shape, argument[1]
    if hasattr(argument, "_c_fields"):
        return type(argument).__name__, [described(field) for field in argument]
    return argument


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_with_save_only_the_up_gemm_changes_and_it_stores_h1(shape):
    inputs = layer(**shape)
    plain, _ = launch(stage7.STAGE, inputs)
    saving, saved = launch(stage7.STAGE, inputs, save=True)
    assert saving.names() == [n.replace("expert_up_swiglu", "expert_up_swiglu_saving") for n in plain.names()]
    for (name, grid, args), (_, plain_grid, plain_args) in zip(saving.launches, plain.launches):
        assert grid == plain_grid, name
        same, before = [described(a) for a in args], [described(a) for a in plain_args]
        if name == "expert_up_swiglu_saving":  # x_perm, W1, h, then h1's map, and the rest as before
            assert same.pop(3) == ((1, *saved.h1.shape), (1, stage6.CONSUMER_ROWS, stage6.BOX_COLS))
            assert args[3][0]._base is saved.h1  # the map is over h1[None]
        assert same == before, name


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_with_save_the_launch_returns_what_the_backward_reads(shape):
    inputs = layer(**shape)
    kernels, saved = launch(stage7.STAGE, inputs, save=True)
    T, E, k, inter = shape["T"], shape["E"], shape["k"], shape["inter"]
    rows = moe.padded_capacity(T, E, k, stage6.BLOCK_M)
    i32, f32 = torch.int32, torch.float32
    assert isinstance(saved, Saved)
    assert [(tuple(t.shape), t.dtype) for t in saved] == [
        ((T, k), i32), ((T, k), f32), ((T, E), f32), ((E,), i32), ((E + 1,), i32), ((T, k), i32), ((rows,), i32),
        ((rows, 2 * inter), torch.bfloat16)]
    # the very tensors the kernels wrote and read
    assert saved.topk_ids is inputs["topk_ids"]
    (topk,), (align,) = kernels.arguments("moe_topk"), kernels.arguments("moe_align")
    assert topk.logits is saved.logits and topk.topk_weights is saved.topk_weights and topk.rank is saved.dest
    assert align.expert_counts is saved.expert_counts and align.expert_offsets is saved.expert_offsets
    assert align.source_token is saved.source_token
    combine = kernels.arguments("moe_combine")
    assert combine[1] is saved.dest and combine[2] is saved.topk_weights
    assert kernels.arguments("expert_up_swiglu_saving")[3][0]._base is saved.h1


@pytest.mark.parametrize("stage,save", [(stage7.STAGE, False), (stage7.STAGE, True), (stage7.RUNGS[0], False)],
                         ids=["wgmma", "wgmma-save", "mma_sync"])
def test_every_launch_passes_the_arguments_its_kernel_declares(stage, save):
    """As many arguments as the C signature has, each of its kind (a parameter struct's fields each of theirs), a
    tensor map where it says TmaMap."""
    kernels, _ = launch(stage, layer(**SHAPES[0]), save=save)
    for kernel, _, args in kernels.launches:
        assert_arguments_declared(stage, kernel, args)
        for arg, c_type in zip(args, parameter_types(stage.kernels[kernel])):
            assert (c_type == "TmaMap") == isinstance(arg, Map), f"{kernel}: {arg!r} for a {c_type}"


def test_stage_6_declares_the_saving_kernel_and_run_experts_selects_it_by_h1():
    assert stage6.STAGE.kernels["expert_up_swiglu_saving"] == \
        "const TmaMap, const TmaMap, const TmaMap, const TmaMap, const ExpertParams"
    assert set(stage6.STAGE.kernels) <= set(stage7.STAGE.kernels)
    x_perm, h = torch.empty(256, 64, device="meta"), torch.empty(256, 72, device="meta")
    w1, w2, y = torch.empty(4, 64, 144, device="meta"), torch.empty(4, 72, 64, device="meta"), torch.empty_like(x_perm)
    offsets = torch.empty(5, dtype=torch.int32, device="meta")
    for h1, up in ((None, "expert_up_swiglu"), (torch.empty(256, 144, device="meta"), "expert_up_swiglu_saving")):
        kernels = RecordingKernels()
        stage6.run_experts(kernels, x_perm, offsets, w1, w2, h, y, h1=h1)
        assert kernels.names() == [up, "expert_down"]
    with pytest.raises(AssertionError):
        stage6.run_experts(RecordingKernels(), x_perm, offsets, w1, w2, h, y, h1=torch.empty(256, 72, device="meta"))


def test_the_mma_sync_rung_refuses_to_save_in_one_line_before_launching():
    rung = stages.load("stage7_moe_layer:mma_sync")
    kernels = RecordingKernels()
    i = layer(**SHAPES[0])
    with pytest.raises(ValueError) as error:
        rung.launch(kernels, i["x"], i["wr"], i["bias"], i["w1"], i["w2"], i["top_k"], i["out"], i["topk_ids"],
                    save=True)
    assert str(error.value) == stage7.SAVE_REFUSAL and "needs sm_90a" in str(error.value)
    assert "\n" not in str(error.value) and not kernels.launches
    kernels, found = launch(rung, i)
    assert found is None and "expert_up_swiglu" in kernels.names()


def test_forward_for_backward_runs_the_saving_launch_and_names_what_it_saved():
    inputs = layer(**SHAPES[0])
    outputs = {n: inputs.pop(n) for n in ("out", "topk_ids")}
    kernels = RecordingKernels()
    found = LAYER.forward_for_backward(stage7.STAGE, kernels, inputs, outputs)
    assert list(found) == ["out", "topk_ids", *Saved._fields[1:]]
    assert found["out"] is outputs["out"] and found["topk_ids"] is outputs["topk_ids"]
    assert "expert_up_swiglu_saving" in kernels.names()


# ---------------------------------------------------------------- on an H100 or H200: the kernels

ON_GPU = StageOnGpu("stage7")  # its kernels run here on one case at a time
GPU_CASES = ["T1 E64 k8 hidden128 inter128 bf16", "T333 E16 k4 hidden200 inter136 fp16",
             "T777 E16 k2 hidden136 inter200 bf16", "T500 E16 k4 hidden72 inter104 empty3,7 bf16",
             "T1000 E32 k2 hidden256 inter384 bf16 x10"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CASES)
def test_on_the_gpu_saving_changes_no_output_and_saves_the_routing_and_h1(name):
    """The saving launch writes the plain launch's out and topk_ids bit for bit, and saves: the fp32 logits,
    the softmax of the chosen ones, the counts and padded offsets of the ids, a permutation that puts each
    token-slot in its expert's segment (source_token its inverse), and h1 = x·W1[e] of each token-slot at its
    row, up to the dtype's rounding (I not a multiple of 128 among the cases: gate boxes holding up columns)."""
    case = next(c for c in LAYER.cases() if c.name == name)
    ON_GPU.arch()
    inputs = LAYER.make_inputs(case.shape, case.dtype, case.seed, case.input_scale)
    kernels = ON_GPU.kernels(ON_GPU.stage.source_path, inputs)
    plain, outputs = LAYER.allocate_outputs(inputs), LAYER.allocate_outputs(inputs)
    LAYER.run_stage(ON_GPU.stage, kernels, inputs, plain)
    found = LAYER.forward_for_backward(ON_GPU.stage, kernels, inputs, outputs)
    torch.cuda.synchronize()
    assert torch.equal(found["out"], plain["out"]) and torch.equal(found["topk_ids"], plain["topk_ids"])
    saved = Saved(*(found[n] for n in Saved._fields))
    x, w1, (T, k), E = inputs["x"], inputs["w1"], saved.topk_ids.shape, inputs["wr"].shape[1]
    ids = saved.topk_ids.long()
    logits = moe.router_logits(x, inputs["wr"], inputs["bias"])
    torch.testing.assert_close(saved.logits, logits, rtol=1e-5, atol=1e-5 * float(logits.abs().max()))
    torch.testing.assert_close(saved.topk_weights, torch.softmax(saved.logits.gather(1, ids), dim=-1))
    assert torch.equal(saved.expert_counts, moe.expert_counts(saved.topk_ids, E))
    assert torch.equal(saved.expert_offsets, moe.expert_offsets(saved.expert_counts, stage6.BLOCK_M))
    rows, token = saved.dest.flatten().long(), torch.arange(T * k, device=x.device) // k
    start, count = saved.expert_offsets[ids.flatten()].long(), saved.expert_counts[ids.flatten()].long()
    assert ((rows >= start) & (rows < start + count)).all() and rows.unique().numel() == T * k
    assert torch.equal(saved.source_token[rows].long(), token)
    h1 = torch.stack([x[t].float() @ w1[e].float() for t, e in zip(token.tolist(), ids.flatten().tolist())])
    torch.testing.assert_close(saved.h1[rows].float(), h1, rtol=1e-2, atol=1e-2 * float(h1.abs().max()))
