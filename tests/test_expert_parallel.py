"""Stage 11's dispatch and combine on the CPU: gloo process groups of 2 and 4 processes (torch.multiprocessing),
small shapes, the experts in PyTorch. Each scenario runs the sharded layer on every rank, gathers the outputs
and compares them with the single-process layer on the gathered inputs (reference/moe.py's, float64: equal
to rounding): through NCCL's path (dispatch.py, on gloo) and NVLink's (nvlink.py, with GlooPeers standing in
for the mapped buffers). Each world size is one spawn running every scenario (the processes' start-up is most
of the time); rank 0 writes what it found, and the tests read it."""
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import REPO
from reference import load, moe
from reference.moe_expert_parallel import expert_rows, shard, token_rows
from stages.stage11_expert_parallel import dispatch, nvlink, records
from stages.stage11_expert_parallel.dispatch import Parts, Routing

P = load("moe_expert_parallel")

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 16, 24  # bf16 rows of 16-byte multiples: torch._grouped_mm wants them


class TorchParts(Parts):
    """The layer's device work in PyTorch, in float64 whatever the inputs' dtype (out rounded to it once):
    reference/moe.py's exact top-k of float64 logits, a loop over the local experts, the weighted sum."""

    def __init__(self, layer: dict, top_k: int, align: int = 1):
        self.layer, self.top_k, self.align = layer, top_k, align

    def route(self, x, topk_ids):
        ids, weights = moe.topk_exact(moe.router_logits(x, self.layer["wr"], self.layer["bias"], torch.float64),
                                      self.top_k)
        order, counts = moe.slots_by_expert(ids, self.layer["wr"].shape[1])
        dest = torch.empty_like(order)
        dest[order] = torch.arange(order.numel())
        topk_ids.copy_(ids)
        return Routing(ids, weights, counts, order // self.top_k, dest.view_as(ids))

    def experts(self, rows, offsets, experts, y):
        w1, w2 = self.layer["w1"][experts].double(), self.layer["w2"][experts].double()
        for e, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
            y[start:end] = moe.swiglu(rows[start:end].double() @ w1[e], w2.shape[1]) @ w2[e]

    def weighted_sum(self, returned, row_of_slot, weights, out):
        out.copy_((returned[row_of_slot.long()] * weights[..., None].double()).sum(1))



def exchanged(items: list, group) -> list:
    """items[d] sent to rank d; returns what each rank sent this one (gloo: through all_gather_object)."""
    everything = [None] * dist.get_world_size(group)
    dist.all_gather_object(everything, items, group=group)
    return [sent[dist.get_rank(group)] for sent in everything]


class GlooPeers(nvlink.Peers):
    """nvlink.Peers on gloo, for the CPU: each rank's rows, y, origin and returned are its own (NaN or -1 until
    written); a store into a peer's buffer travels as an exchange of (rows, values). nvlink.layer and nvlink.plan
    run as they do on the GPU, so the rows land where ep_plan says, piece by piece, and come back by origin."""

    def __init__(self, group, tokens: int, hidden: int, experts: int, top_k: int, align: int, dtype, pieces: int = 1):
        most = torch.tensor([tokens])
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        world = dist.get_world_size(group)
        self.group, self.align, self.local, self.slots = group, align, experts // world, int(most) * top_k
        rows = nvlink.grouped_rows(world, int(most), top_k, self.local, align, pieces)
        self.rows = torch.full((rows, hidden), float("nan"), dtype=dtype)
        self.y = torch.full_like(self.rows, float("nan"))
        self.origin = torch.full((rows,), -1, dtype=torch.long)
        self.returned = torch.full((self.slots, hidden), float("nan"), dtype=dtype)

    def plan(self, counts, pieces):
        table = torch.stack(exchanged([counts] * dist.get_world_size(self.group), self.group))
        return nvlink.plan(table, dist.get_rank(self.group), self.align, pieces, self.rows.shape[0] // pieces)

    def dispatch(self, x, routing, plan, p, sms=0):
        ids, (rank, world) = routing.ids.long(), (dist.get_rank(self.group), dist.get_world_size(self.group))
        row, to = routing.dest.long() + plan.shift.long()[ids], ids // self.local
        experts = plan.piece(p)[0]
        wanted = (ids % self.local >= experts.start) & (ids % self.local < experts.stop)
        slot = torch.arange(ids.numel()).view_as(ids)
        stores = [(row[m], x[slot[m] // ids.shape[1]], rank * self.slots + slot[m])
                  for m in (wanted & (to == d) for d in range(world))]
        for rows, values, origin in exchanged(stores, self.group):
            self.rows[rows], self.origin[rows] = values, origin
        return 0

    def wait_dispatched(self, count):
        """The exchanges above were the waits."""

    def give_back(self, plan, p, sms=0):
        experts, rows, offsets = plan.piece(p)
        real = torch.cat([torch.arange(int(o), int(o) + int(n)) for o, n in zip(offsets[:-1], plan.filled[experts])])
        real += rows.start
        source, slot = self.origin[real] // self.slots, self.origin[real] % self.slots
        stores = [(slot[source == d], self.y[real[source == d]]) for d in range(dist.get_world_size(self.group))]
        for slots, values in exchanged(stores, self.group):
            self.returned[slots] = values

    def combine(self, routing, out):
        tokens, k = routing.ids.shape
        values = self.returned[:tokens * k].double().view(tokens, k, -1)
        out.copy_((values * routing.weights[..., None].double()).sum(1))

    def check(self):
        """PeerBuffers.check's place: nothing here can time out."""


def small_layer(world: int, tokens: int | None = None, dtype="float64", **knobs) -> dict:
    shape = dict(tokens=tokens or 12 * world + 5, experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, inter=INTER, **knobs)
    return P.make_inputs(shape, dtype, seed=7, device="cpu")


def last_ranks_experts(world: int) -> tuple:
    return tuple(range(EXPERTS)[expert_rows(EXPERTS, world - 1, world)])


# name -> (the inputs' knobs, the layer's options (nvlink: nvlink.layer over GlooPeers), the GEMMs' alignment)
SCENARIOS = {
    "counts": ({}, {}, 1),
    "counts, padded segments": ({}, {}, 4),
    "capacity": ({}, dict(capacity=True), 4),
    "pieces": ({}, dict(pieces=2), 1),
    "pieces, capacity": ({}, dict(pieces=2, capacity=True), 4),
    "uneven load": (dict(skew=6.0), {}, 4),           # the first experts, rank 0's, take most token-slots
    "uneven load, capacity": (dict(skew=6.0), dict(capacity=True), 4),
    "uneven load, pieces": (dict(skew=6.0), dict(pieces=2), 4),
    "idle rank": (dict(empty="last"), {}, 4),         # no token chooses the last rank's experts
    "idle rank, capacity": (dict(empty="last"), dict(capacity=True), 4),
    "idle rank, pieces": (dict(empty="last"), dict(pieces=2), 1),
    "one token per rank": (dict(tokens="world"), {}, 1),
    "nvlink": ({}, dict(nvlink=True), 4),
    "nvlink, unpadded": ({}, dict(nvlink=True), 1),
    "nvlink, uneven load": (dict(skew=6.0), dict(nvlink=True), 4),
    "nvlink, idle rank": (dict(empty="last"), dict(nvlink=True), 4),
    "nvlink, one token per rank": (dict(tokens="world"), dict(nvlink=True), 4),
    "nvlink, pieces": ({}, dict(nvlink=True, pieces=2), 4),
    "nvlink, pieces, unpadded": ({}, dict(nvlink=True, pieces=2), 1),
    "nvlink, uneven load, pieces": (dict(skew=6.0), dict(nvlink=True, pieces=2), 4),
    "nvlink, idle rank, pieces": (dict(empty="last"), dict(nvlink=True, pieces=2), 4),
}


def gathered(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows, in rank order (their counts may differ: gloo's all_gather wants equal ones)."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, tensor, group=group)
    return torch.cat(parts)


def received_rows(layer: dict, group) -> list[int]:
    """The rows each rank receives under the counts' plan, as rank 0 learns them."""
    parts = TorchParts(layer, TOP_K)
    routing = parts.route(layer["x"], torch.empty(layer["x"].shape[0], TOP_K, dtype=torch.int32))
    exchange = dispatch.exchange_counts(routing, group, 1)
    return gathered(torch.tensor([int(exchange.received.sum())]), group).tolist()


def run_scenario(name: str, group) -> dict:
    world = dist.get_world_size(group)
    knobs, options, align = SCENARIOS[name]
    knobs = dict(knobs)
    if knobs.get("empty") == "last":
        knobs["empty"] = last_ranks_experts(world)
    tokens = world if knobs.pop("tokens", None) == "world" else None
    inputs = small_layer(world, tokens, **knobs)
    local = shard(inputs, group)
    out = torch.full_like(local["x"], float("nan"))
    ids = torch.full((local["x"].shape[0], TOP_K), -1, dtype=torch.int32)
    parts = TorchParts(local, TOP_K, align)
    if options.get("nvlink"):
        pieces = options.get("pieces", 1)
        peers = GlooPeers(group, local["x"].shape[0], HIDDEN, EXPERTS, TOP_K, align, local["x"].dtype, pieces)
        nvlink.layer(local["x"], parts, peers, out, ids, pieces)
    else:
        dispatch.layer(local["x"], parts, group, out, ids, **options)
    out, ids = gathered(out, group), gathered(ids, group)
    exact_ids, weights = moe.topk_exact(moe.router_logits(inputs["x"], inputs["wr"], inputs["bias"], torch.float64),
                                        TOP_K)
    exact = moe.layer_reference(inputs, TOP_K, ids=exact_ids, weights=weights)
    return dict(max_error=float((out - exact).abs().max() / exact.abs().max()), ids_equal=bool(torch.equal(ids, exact_ids)),
                received=received_rows(local, group))


def torch_launch(kernels, x, wr, bias, w1, w2, top_k, out, topk_ids, group, spare_sms=0, peers=None, pieces=1,
                 **options):
    """Stage 11's launch with TorchParts in place of the kernels (no SMs to spare) and GlooPeers in place of
    the mapped buffers."""
    parts = TorchParts(dict(wr=wr, bias=bias, w1=w1, w2=w2), top_k, 4)
    if peers is None:
        dispatch.layer(x, parts, group, out, topk_ids, pieces=pieces, **options)
    else:
        nvlink.layer(x, parts, peers, out, topk_ids, pieces)


def run_problem(group) -> dict:
    """In bf16, through the problem: its inputs sharded, run_stage with a stand-in stage (torch_launch), its
    check on the gathered outputs; and its plain-PyTorch baseline against the one-process layer."""
    world = dist.get_world_size(group)
    inputs = small_layer(world, dtype="bfloat16", skew=2.0)
    local = shard(inputs, group)
    outputs = P.allocate_outputs(local)
    P.run_stage(SimpleNamespace(launch=torch_launch), None, local, outputs)
    checks = P.check({n: gathered(t, group) for n, t in outputs.items()}, P.reference(inputs), {})
    baseline = gathered(P.baselines(local)["ep_grouped_mm"](), group)
    one_process = moe.layer_grouped_mm(inputs, TOP_K)
    return dict(checks={c.output: c.passed for c in checks},
                baseline_error=float((baseline.double() - one_process.double()).abs().max() / one_process.double().abs().max()),
                baselines=sorted(P.baselines(local)))


class WallClockEvent:
    """torch.cuda.Event's timing methods, on the host's clock."""

    def __init__(self, enable_timing=True):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, later) -> float:
        return (later.at - self.at) * 1e3


def one_process_layer(x, wr, w1, w2, top_k, router_bias=None, return_topk_ids=False):
    """ops.moe_layer, as its signature has it (out, or (out, topk_ids) when asked), as TorchParts computes in a
    world of one: float64, each expert's rows rounded to x's dtype (the results buffer's), the sum rounded once."""
    ids, weights = moe.topk_exact(moe.router_logits(x, wr, router_bias, torch.float64), top_k)
    y = torch.empty(*ids.shape, x.shape[1], dtype=torch.float64)
    for e in range(w1.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        found = moe.swiglu(x[token].double() @ w1[e].double(), w2.shape[1]) @ w2[e].double()
        y[token, slot] = found.to(x.dtype).double()
    out = (y * weights[..., None].double()).sum(1).to(x.dtype)
    return (out, ids.to(torch.int32)) if return_topk_ids else out


RUNNER_EXPERTS = 16  # 4 local experts at 4 ranks: the runner's 4 pieces
BROKEN = "99 pieces"  # a variant that fails on every rank (more pieces than experts): reported, the others go on


def broken_error(world: int) -> str:
    return f"ValueError: pieces must be from 1 to the {RUNNER_EXPERTS // world} experts of a rank; got 99"


def run_runner(group) -> dict:
    """The multi-GPU runner's measure, report and record, on the CPU: its kernels, stage 7, CUDA's events and
    the mapped buffers replaced."""
    import stages.stage11_expert_parallel.__main__ as runner

    torch.cuda.Event = WallClockEvent
    runner.DEVICE = "cpu"
    runner.head_start = lambda: None
    runner.STAGE = SimpleNamespace(launch=torch_launch)
    runner.KernelParts = lambda kernels, wr, bias, w1, w2, top_k, spare_sms=0: TorchParts(
        dict(wr=wr, bias=bias, w1=w1, w2=w2), top_k, 4)
    runner.peer_buffers = lambda local, group: GlooPeers(group, local["x"].shape[0], HIDDEN, RUNNER_EXPERTS, TOP_K, 4,
                                                         local["x"].dtype, 4)  # the runner's most pieces
    runner.KernelPeers = lambda kernels, peers, align: peers
    runner.VARIANTS = {**runner.VARIANTS, BROKEN: dict(pieces=99)}
    runner.ops.moe_layer = one_process_layer
    runner.shape_of = lambda config, tokens: dict(tokens=tokens, experts=RUNNER_EXPERTS, top_k=TOP_K, hidden=HIDDEN,
                                                  inter=INTER)
    found = runner.measure("seed", runner.parse(["--tokens-per-rank", "8", "--reps", "2"]), None, group)
    if not found:
        return {}
    record = records.record([found], gpu="CPU", world=dist.get_world_size(group), torch=torch.__version__, nccl="none",
                            commit="test", head_start_ms=0.0)
    return dict(lines=runner.report(found), record=record)


def run_rank(rank: int, world: int, store_path: str, results_path: str) -> None:
    torch.set_num_threads(1)  # 4 processes on a small CI machine
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    group = dist.group.WORLD
    found = {name: run_scenario(name, group) for name in SCENARIOS}
    found["problem"] = run_problem(group)
    found["runner"] = run_runner(group)
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def results(request, tmp_path_factory):
    world = request.param
    folder = tmp_path_factory.mktemp(f"gloo{world}")
    path = folder / "results.json"
    # Forked, the ranks start with this process's imports (a spawned one imports PyTorch again: seconds each);
    # spawned where this process holds a CUDA context, which a fork cannot take along.
    start = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(run_rank, args=(world, str(folder / "store"), str(path)), nprocs=world, join=True,
                       start_method=start)
    return world, json.loads(path.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_sharded_layer_is_the_layer(results, name):
    _, found = results
    assert found[name]["ids_equal"], name
    assert found[name]["max_error"] < 1e-13, (name, found[name]["max_error"])


@pytest.mark.distributed
def test_uneven_load_reaches_the_first_rank_and_an_idle_rank_receives_nothing(results):
    world, found = results
    balanced, skewed, idle = (found[n]["received"] for n in ("counts", "uneven load", "idle rank"))
    assert sum(balanced) == sum(skewed) == sum(idle) == TOP_K * (12 * world + 5)
    assert skewed[0] > sum(skewed) / 2 and skewed[0] > 1.5 * max(balanced)
    assert idle[-1] == 0 and all(idle[:-1])


@pytest.mark.distributed
def test_the_problem_checks_the_gathered_outputs_and_its_baseline_is_the_layer(results):
    _, found = results
    assert found["problem"]["checks"] == {"topk_ids": True, "out": True}
    assert found["problem"]["baseline_error"] < 2**-6
    assert found["problem"]["baselines"] == ["ep_grouped_mm"]  # the one-GPU layers only in a world of one


@pytest.mark.distributed
def test_the_runner_checks_and_times_every_variant_and_reports_a_failure_in_one_line(results):
    world, found = results
    from stages.stage11_expert_parallel.__main__ import NVLINK, VARIANTS

    (config,) = found["runner"]["record"]["configs"]
    for name in VARIANTS:
        assert config["correctness"][name]["ids_equal"] and config["correctness"][name]["out_differ"] == 0, name
        assert config["layer_ms"][name] > 0, name
    for name in ("counts", NVLINK):
        check = config["correctness"][name]["check"]
        assert check["topk_ids"] == dict(passed=True, quality="exact") and check["out"]["passed"], name
    assert config["layer_ms"][BROKEN] == config["correctness"][BROKEN] == {"error": broken_error(world)}


@pytest.mark.distributed
def test_the_runner_times_the_phases_of_both_transports_and_the_pipelines_costs(results):
    world, found = results
    from stages.stage11_expert_parallel.__main__ import NVLINK, PHASES

    (config,) = found["runner"]["record"]["configs"]
    assert list(config["phases_ms"]) == ["NCCL", NVLINK]
    assert all(list(p) == list(PHASES) and min(p.values()) > 0 for p in config["phases_ms"].values())
    assert list(config["transfers_ms"]) == ["NCCL", NVLINK]
    assert all(list(t) == ["dispatch", "combine"] and min(t.values()) > 0 for t in config["transfers_ms"].values())
    assert list(config["costs_ms"]) == ["whole", "2 pieces by expert", "2 pieces by token", "4 pieces by expert",
                                        "4 pieces by token", "16 SMs spared", "32 SMs spared"]
    assert config["bytes_per_rank"] == 8 * TOP_K * HIDDEN * 2 and config["capacity"]["token_slots"] == 8 * TOP_K


@pytest.mark.distributed
def test_the_record_reads_back_as_the_lessons_tables(results, tmp_path):
    world, found = results
    record = found["runner"]["record"]
    assert set(record) == set(records.FIELDS)
    (tmp_path / f"cpux{world}.json").write_text(json.dumps(record))
    text = records.lesson_tables(tmp_path)
    assert text.startswith(f"#### {world} × CPU\n")
    assert f"| {BROKEN} | failed: {broken_error(world)} | | | |" in text
    assert "| counts |" in text and "| NVLink kernels |" in text and "| plain PyTorch |" in text
    assert "| NCCL |" in text and "| experts' GEMMs | whole |" in text
    lines = found["runner"]["lines"]
    assert lines[:len(records.config_tables(record["configs"][0]))] == records.config_tables(record["configs"][0])
    assert any("overlap through NCCL:" in line for line in lines)
    assert any("overlap over NVLink: NVLink kernels, " in line and " pieces, " in line for line in lines)
    assert any("NVLink kernels: dispatch + combine (alone)" in line for line in lines)
    assert any("NCCL: dispatch + combine (alone)" in line for line in lines)
    assert "| NCCL, each transfer alone |" in text and "| NVLink kernels, each transfer alone |" in text


def test_a_record_without_its_environment_is_refused():
    with pytest.raises(ValueError, match="needs \\['commit'"):
        records.record([], gpu="G", world=2, torch="t", nccl="n", head_start_ms=2.0)


def test_the_lesson_says_not_measured_without_records(tmp_path):
    assert records.lesson_tables(tmp_path) == "Not measured yet."


@pytest.mark.parametrize("path", sorted(records.FOLDER.glob("*.json")), ids=lambda p: p.name)
def test_committed_records_are_named_by_gpu_and_world(path):
    from grader.gpus import slug_for

    record = json.loads(path.read_text())
    assert set(record) == set(records.FIELDS)
    assert path.name == f"{slug_for(record['gpu'])}x{record['world']}.json"
    assert records.tables(record)


def test_without_a_gpu_the_runner_says_so_in_one_line_and_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, "-m", "stages.stage11_expert_parallel"], capture_output=True, text=True,
                          env={**env, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["stage 11's runner needs a CUDA GPU, and this machine shows none"]


# ---------------------------------------------------------------- single process

@pytest.mark.parametrize("align", [1, 4, 128])
def test_regroup_index_groups_by_expert_pads_and_inverts(align):
    gen = torch.Generator().manual_seed(align)
    ranks, local = 4, 3
    counts = torch.randint(0, 6, (ranks, local), generator=gen, dtype=torch.int32)
    counts[:, 1] = 0  # an expert no rank sends to
    received = int(counts.sum())
    grouped = int(moe.expert_offsets(counts.sum(0), align)[-1])
    offsets, source_row, grouped_row = dispatch.regroup_index(counts, received, grouped, align)
    # The received rows, labelled (source rank, expert, index in the bucket), in the order they arrive.
    arrived = [(s, e, i) for s in range(ranks) for e in range(local) for i in range(int(counts[s, e]))]
    for e in range(local):
        start, end, rows = int(offsets[e]), int(offsets[e + 1]), int(counts[:, e].sum())
        assert start % align == 0 and end - start == -(-rows // align) * align
        segment = [arrived[r] for r in source_row[start:end].tolist()]
        real = sorted(a for a in arrived if a[1] == e)
        assert segment[:rows] == real  # every row of e's, by source rank, then as it came
        assert all(row == segment[rows - 1] for row in segment[rows:])  # padding repeats the last row
    assert sorted(grouped_row.tolist()) == sorted(set(grouped_row.tolist()))
    assert torch.equal(source_row[grouped_row], torch.arange(received))


def test_shards_cover_the_tokens_and_the_experts():
    assert [token_rows(10, r, 4) for r in range(4)] == [slice(0, 2), slice(2, 5), slice(5, 7), slice(7, 10)]
    assert [expert_rows(8, r, 4) for r in range(4)] == [slice(2 * r, 2 * r + 2) for r in range(4)]
    with pytest.raises(ValueError, match="do not shard evenly"):
        expert_rows(6, 0, 4)


def test_benchmarks_are_one_ranks_share_of_the_bars():
    assert P.benchmarks() == [
        dict(tokens=4096, experts=32, top_k=2, hidden=4096, inter=11008, dtype="bfloat16"),
        dict(tokens=4096, experts=256, top_k=8, hidden=7168, inter=2048, dtype="bfloat16")]
    assert P.cases() == load("moe_layer").cases()
    shape = P.benchmarks()[1]
    assert P.flops(shape) == load("moe_layer").flops(shape)


def test_a_world_of_one_in_a_fresh_process_runs_the_problem_and_its_baselines(tmp_path):
    """The grader's way: no torchrun, default_group starts a gloo world of one (here, on the CPU)."""
    script = f"""
import torch, sys
sys.path.insert(0, {str(REPO)!r})
from reference import load, moe
from reference.moe_expert_parallel import default_group
import torch.distributed as dist
P = load("moe_expert_parallel")
inputs = P.make_inputs(dict(tokens=20, experts=4, top_k=2, hidden=16, inter=8), "bfloat16", 3, device="cpu")
found = P.baselines(inputs)
assert sorted(found) == ["ep_grouped_mm", "grouped_mm", "naive"], sorted(found)
assert dist.get_world_size(default_group(torch.device("cpu"))) == 1
torch.testing.assert_close(found["ep_grouped_mm"](), moe.layer_grouped_mm(inputs, 2), rtol=0, atol=0)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.stdout.strip() == "ok", done.stderr


# ---------------------------------------------------------------- on a GPU: the kernels, in a world of one

def stage11_kernels():
    from stages.stage11_expert_parallel import STAGE
    from stages.stage11_expert_parallel.__main__ import stage_kernels

    try:
        return STAGE, stage_kernels(0)
    except ValueError as why:
        pytest.skip(str(why))


@pytest.mark.gpu
@pytest.mark.parametrize("ranks,local,align", [(1, 32, 128), (8, 4, 128), (4, 64, 128), (2, 3, 1), (8, 32, 128)])
def test_the_regroup_kernel_writes_what_dispatch_regroup_index_computes(ranks, local, align):
    from stages.stage11_expert_parallel import KernelParts
    from stages.stage11_expert_parallel.dispatch import Piece

    _, kernels = stage11_kernels()
    gen = torch.Generator().manual_seed(ranks * local)
    counts = torch.randint(0, 300, (ranks, local), generator=gen, dtype=torch.int32)
    counts[:, local // 2] = 0  # an expert that gets nothing
    received, grouped = int(counts.sum()), int(moe.expert_offsets(counts.sum(0), align)[-1])
    piece = Piece(slice(None), None, [], counts.sum(1).tolist(), counts.cuda(), grouped)
    parts = KernelParts(kernels, None, None, None, None, 1)
    parts.align = align
    found = [t.cpu().long() for t in parts.regroup_index(piece)]
    expected = [t.long() for t in dispatch.regroup_index(counts, received, grouped, align)]
    for name, f, e in zip(("offsets", "source_row", "grouped_row"), found, expected):
        assert torch.equal(f, e), name


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, dict(capacity=True), dict(pieces=3), dict(pieces=2, capacity=True),
                                     dict(pieces=2, spare_sms=16), dict(peers=True),
                                     dict(peers=True, pieces=3, spare_sms=16)],
                         ids=["counts", "capacity", "pieces", "pieces, capacity", "pieces, SMs spared", "nvlink",
                              "nvlink, pieces on two streams"])
def test_every_variant_on_one_gpu_is_stage_7_bit_for_bit(options):
    """In a world of one; over NVLink twice, so that the second call's flags follow the first's."""
    from reference.moe_expert_parallel import default_group
    from stages import ops
    from stages.stage11_expert_parallel import KernelParts

    stage, kernels = stage11_kernels()
    shape = dict(tokens=1000, experts=32, top_k=2, hidden=256, inter=384, skew=3.0)
    inputs = P.make_inputs(shape, "bfloat16", seed=5)
    i, outputs = inputs, P.allocate_outputs(inputs)
    group = default_group(i["x"].device)
    if "peers" in options:
        options = dict(options, peers=nvlink.symmetric_buffers(group, 1000, 256, 32, 2, KernelParts.align,
                                                               torch.bfloat16, i["x"].device, options.get("pieces", 1)))
    for _ in range(2 if "peers" in options else 1):
        stage.launch(kernels, i["x"], i["wr"], i["bias"], i["w1"], i["w2"], i["top_k"], outputs["out"],
                     outputs["topk_ids"], group, **options)
    if "peers" in options:
        options["peers"].check()
    assert all(c.passed for c in P.check(outputs, P.reference(inputs), {}))
    out7, ids7 = ops.moe_layer(i["x"], i["wr"], i["w1"], i["w2"], i["top_k"], router_bias=i["bias"],
                              return_topk_ids=True)
    assert torch.equal(outputs["topk_ids"], ids7) and torch.equal(outputs["out"], out7)


def addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("pieces", [1, 3])
def test_the_nvlink_kernels_as_rank_1_of_4_on_one_gpu(pieces):
    """Rank 1 of a world of 4 whose peers' buffers are other tensors of this GPU; the others' tables and counts
    written beforehand, as they would have written them. ep_plan against nvlink.plan; ep_dispatch's rows and
    origins where the plan says, piece by piece; ep_return's results at their slots on the ranks they came
    from; the combine against the weighted sum; the tables and counts left on every peer."""
    from stages.stage11_expert_parallel import KernelParts
    from stages.stage11_expert_parallel.dispatch import Routing

    _, kernels = stage11_kernels()
    world, rank, experts, k, hidden, tokens = 4, 1, 32, 2, 256, 300
    local, align, gen = experts // world, KernelParts.align, torch.Generator().manual_seed(3 + pieces)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).int()
    ids[:5] = torch.tensor([rank * local + 1, rank * local + 2], dtype=torch.int32)  # rows this rank sends itself
    counts = torch.bincount(ids.flatten().long(), minlength=experts).int()
    table = torch.randint(0, 40, (world, experts), generator=gen, dtype=torch.int32)
    table[:, rank * local] = 0  # a local expert nobody chose: an empty segment
    table[rank] = counts
    order = torch.argsort(ids.flatten().long(), stable=True)
    dest = torch.empty_like(order)
    dest[order] = torch.arange(order.numel())
    slots = tokens * k
    capacity = nvlink.grouped_rows(world, 2 * tokens, k, local, align, pieces)
    controls = [torch.zeros(nvlink.CONTROL_INTS, dtype=torch.int32, device="cuda") for _ in range(world)]
    grouped = [torch.full((capacity, hidden), float("nan"), device="cuda").bfloat16() for _ in range(world)]
    origins = [torch.full((capacity,), -1, dtype=torch.int32, device="cuda") for _ in range(world)]
    returned = [torch.full((slots, hidden), float("nan"), device="cuda").bfloat16() for _ in range(world)]
    blocks = 8
    for s in set(range(world)) - {rank}:
        controls[rank][nvlink.TABLE + s * nvlink.MAX_EXPERTS:][:experts] = table[s].cuda()
        for flag, value in ((nvlink.PLANNED, 1), (nvlink.ARRIVED, blocks * pieces), (nvlink.RETURNED, blocks * pieces)):
            controls[rank][flag + s] = value
    buffers = nvlink.PeerBuffers(grouped[rank], origins[rank], returned[rank], controls[rank],
                                 torch.randn(capacity, hidden, generator=gen).bfloat16().cuda(), addresses(grouped),
                                 addresses(origins), addresses(returned), addresses(controls), rank, world, slots,
                                 pieces, blocks)
    peers = nvlink.KernelPeers(kernels, buffers, align)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().cuda()
    weights = torch.rand(tokens, k, generator=gen).cuda()
    routing = Routing(ids.cuda(), weights, counts.cuda(), None, dest.view(tokens, k).int().cuda())

    plan = peers.plan(routing.counts, pieces)
    expected = nvlink.plan(table, rank, align, pieces, capacity // pieces)
    for name in ("shift", "offsets", "filled"):
        assert torch.equal(getattr(plan, name).cpu(), getattr(expected, name)), name
    row = dest.view(tokens, k) + expected.shift.long()[ids.long()]
    for p in range(pieces):
        assert peers.dispatch(x, routing, plan, p) == blocks * (p + 1)
    for (t, j), d in zip(np.ndindex(tokens, k), (ids // local).flatten().tolist()):
        assert torch.equal(grouped[d][int(row[t, j])], x[t]), (t, j)
        assert int(origins[d][int(row[t, j])]) == rank * slots + t * k + j, (t, j)
    # This rank's results go back to where their rows came from: its own rows to itself; the others' rows (no
    # real peer wrote their origins here) are given distinct slots of ranks 0, 2 and 3.
    real = torch.cat([p * plan.region + int(plan.offsets[e + p]) + torch.arange(int(plan.filled[e]))
                      for p in range(pieces) for e in range(*plan.piece(p)[0].indices(local))]).cuda()
    foreign = real[origins[rank][real] < 0]
    assert 0 < foreign.numel() <= 3 * slots
    at = torch.arange(foreign.numel(), device="cuda")
    origins[rank][foreign] = (torch.tensor([0, 2, 3], device="cuda")[at // slots] * slots + at % slots).int()
    returned[rank].normal_()  # the slots other ranks would return
    for p in range(pieces):
        peers.give_back(plan, p)
    for r in real.tolist():
        source, slot = divmod(int(origins[rank][r]), slots)
        assert torch.equal(returned[source][slot], buffers.y[r]), r
    out = torch.empty_like(x)
    peers.combine(routing, out)
    values = returned[rank].view(tokens, k, hidden).float()
    expected_out = (values * weights[..., None]).sum(1).bfloat16().float()
    torch.testing.assert_close(out.float(), expected_out, rtol=2**-7, atol=1e-3)  # a bf16 rounding apart at most
    for d in range(world):
        assert torch.equal(controls[d][nvlink.TABLE + rank * nvlink.MAX_EXPERTS:][:experts].cpu(), counts)
        flags = (nvlink.PLANNED, nvlink.ARRIVED, nvlink.RETURNED)
        assert [int(controls[d][flag + rank]) for flag in flags] == [1, blocks * pieces, blocks * pieces]
    assert int(controls[rank][nvlink.TIMED_OUT]) == 0
