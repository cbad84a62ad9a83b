"""torchrun --nproc-per-node N -m stages.stage11_expert_parallel [--config seed|deepseek|all] [--tokens-per-rank T]

Stage 11 on the GPUs of one machine, one process per GPU; without torchrun (python -m ...) a world of one on one
GPU. For each configuration, N × T tokens in bf16, the inputs made alike on every rank from the seed:

  correctness  every variant's gathered outputs against one GPU's stage 7 on the gathered inputs (the same
               kernels row for row, but the router, which splits its sums by the number of tokens: a few
               elements may differ: docs/notebook/stage11.md), and the problem's check (the float64 layer) on the first
  layer        each variant's time: through NCCL, the counts' exchange or a fixed capacity, whole or in pieces
               by expert with SMs spared for NCCL; over NVLink by the stage's kernels; the same sharding in plain
               PyTorch; one GPU's stage 7 on one rank's tokens, the throughput bar's yardstick
  phases       route, plan, dispatch, experts and combine of the un-pipelined layer through NCCL and over
               NVLink; dispatch and combine in GB/s against all_to_all_single of the same bytes, split evenly
  transfers    each transport's dispatch, and its combine, alone (every rank starting together): what the
               phases hold of the wait for the slowest rank left out, as all_to_all_single is timed
  costs        what a pipeline pays, without communication: the experts' GEMMs whole, in pieces by expert,
               in pieces by token, and with SMs spared

Each time is the slowest rank's median over --reps runs (a barrier before each; the all-to-alls make every rank
wait for the slowest anyway), each run begun behind a GPU wait (HEAD_START_CYCLES), as inside a model, where the
previous layer's kernels keep the GPU busy while the host launches: a phase then takes the GPU's time, unless the
host has to wait for the GPU in it. A variant that fails is reported in one line and the others go on.
NCCL_NVLS_ENABLE=0 unless set. Rank 0 prints; --json writes the record (records.py reads it) after each
configuration.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Before CUDA starts (as the grader's worker): several GB of buffers come and go beside 9-23 GB of weights.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import stages  # noqa: E402
from reference import load  # noqa: E402
from reference.moe import expert_offsets  # noqa: E402
from reference.moe_expert_parallel import (BAR_CONFIGS, TOKENS_PER_RANK, default_group,  # noqa: E402
                                           exchange_bytes, layer_expert_parallel, shape_of, shard)
from stages import ops  # noqa: E402
from stages.stage11_expert_parallel import STAGE, KernelParts, dispatch, nvlink, records  # noqa: E402

PROBLEM = load(STAGE.problem)
NVLINK = "NVLink kernels"
VARIANTS = {"counts": {}, "capacity": dict(capacity=True), "2 pieces": dict(pieces=2),
            "2 pieces, 16 SMs spared": dict(pieces=2, spare_sms=16),
            "4 pieces, 16 SMs spared": dict(pieces=4, spare_sms=16),
            "4 pieces, 32 SMs spared": dict(pieces=4, spare_sms=32), NVLINK: dict(peers=True),
            "NVLink kernels, 2 pieces, 16 SMs spared": dict(peers=True, pieces=2, spare_sms=16),
            "NVLink kernels, 4 pieces, 16 SMs spared": dict(peers=True, pieces=4, spare_sms=16),
            "NVLink kernels, 4 pieces, 32 SMs spared": dict(peers=True, pieces=4, spare_sms=32)}
PIECES, SPARED = (2, 4), (16, 32)  # the costs' pieces and spared SMs
BANDWIDTH_BAR = 1.0   # the bar: dispatch + combine at >= all_to_all_single's GB/s with the NVLink kernels
NCCL_BANDWIDTH_BAR = 0.6  # and at >= 0.6 × through NCCL
THROUGHPUT_BAR = 0.95  # the best variant at >= 0.95 × N × one GPU's stage 7, in tokens/s
OVERLAP_BAR = 1.1     # an overlapped variant >= 1.1 × faster than the un-pipelined one of its transport
PHASES = ("route", "plan", "dispatch", "experts", "combine")
HEAD_START_CYCLES = 4_000_000  # about 2 ms of the GPU's clock: the record says how long it took
DEVICE = "cuda"  # where this rank's tensors live: the GPU torch.cuda.set_device chose


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m stages.stage11_expert_parallel",
                                description="Stage 11 (expert parallelism) across the GPUs of one machine.")
    p.add_argument("--config", choices=[*BAR_CONFIGS, "all"], default="all", help="the layer's configuration: "
                   f"{', '.join(BAR_CONFIGS)}, or all (the default: each of them in turn)")
    p.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK, help=f"default {TOKENS_PER_RANK}")
    p.add_argument("--reps", type=int, default=20, help="timed runs of each candidate (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write rank 0's record here (results/expert-parallel/<gpu>x<N>.json)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- timing

def slowest(value: float, group) -> float:
    found = torch.tensor([value], device=DEVICE)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return float(found)


def head_start() -> None:
    """Keeps the GPU busy for HEAD_START_CYCLES while the host launches what follows."""
    torch.cuda._sleep(HEAD_START_CYCLES)


def run_times(run, reps: int, group) -> list[list[float]]:
    """ms between the marks of each of `reps` runs (after one warm-up): run(mark) calls mark() where a phase
    ends. With a group, its ranks start each run together."""
    times = []
    for rep in range(reps + 1):
        if group is not None:
            dist.barrier(group=group)
        head_start()
        events = [torch.cuda.Event(enable_timing=True)]
        events[0].record()

        def mark():
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()

        run(mark)
        events[-1].synchronize()
        if rep:
            times.append([a.elapsed_time(b) for a, b in zip(events, events[1:])])
    return times


def timed(run, reps: int, group=None) -> float:
    """The median ms of run(); with a group, the slowest rank's, all ranks calling."""
    def whole(mark):
        run()
        mark()

    ms = statistics.median(t[0] for t in run_times(whole, reps, group))
    return slowest(ms, group) if group is not None else ms


def agreed(attempt, group):
    """attempt()'s value, or on any rank's failure {"error": one line} on every rank (so that all go on alike)."""
    try:
        value, error = attempt(), ""
    except Exception as why:  # noqa: BLE001  (a variant's failure is a figure too: the others must still come)
        value, error = None, f"{type(why).__name__}: {str(why).splitlines()[0] if str(why) else ''}"
    failed = torch.tensor([float(bool(error))], device=DEVICE)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    return {"error": error or "failed on another rank"} if float(failed) else value


# ---------------------------------------------------------------- the candidates

def peer_buffers(local: dict, group):
    """NVLink's mapped buffers for this layer, room for every variant's pieces (a collective call)."""
    x, w1 = local["x"], local["w1"]
    pieces = max(o.get("pieces", 1) for o in VARIANTS.values() if "peers" in o)
    return nvlink.symmetric_buffers(group, x.shape[0], x.shape[1], w1.shape[0] * dist.get_world_size(group),
                                    local["top_k"], KernelParts.align, x.dtype, x.device, pieces)


def variant_run(kernels, local: dict, group, options: dict, peers):
    """The stage's launch on this rank's inputs with one variant's options; its outputs."""
    x, k = local["x"], local["top_k"]
    out, topk_ids = torch.empty_like(x), torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device)
    options = dict(options, peers=peers) if "peers" in options else options

    def run():
        STAGE.launch(kernels, x, local["wr"], local["bias"], local["w1"], local["w2"], k, out, topk_ids, group,
                     **options)
    return run, out, topk_ids


def layer_figures(kernels, local: dict, whole: dict | None, group, reps: int, peers, variants: dict,
                  expected: dict) -> tuple[dict, dict]:
    """Each of `variants`' correctness (rank 0's) and time; a failed one {"error": ...} in both. `expected`:
    stage 7's outputs and the reference, kept from one call to the next."""
    checked, layer_ms = {}, {}
    for name, options in variants.items():
        if "peers" in options and isinstance(peers, dict):
            checked[name] = layer_ms[name] = peers  # the buffers could not be made
            continue
        run, out, ids = variant_run(kernels, local, group, options, peers)

        def first():
            run()
            if "peers" in options:
                peers.check()
        failed = agreed(first, group)
        if failed:
            checked[name] = layer_ms[name] = failed
            continue
        checked[name] = correctness(out, ids, whole, group, expected, check=name in ("counts", NVLINK))
        layer_ms[name] = agreed(lambda: timed(run, reps, group), group)
    return checked, layer_ms


def nccl_phases(parts: KernelParts, local: dict, group):
    """run(mark) of the un-pipelined layer through NCCL (the counts' exchange), marking its phases."""
    x = local["x"]
    out, topk_ids = torch.empty_like(x), torch.empty(x.shape[0], local["top_k"], dtype=torch.int32, device=x.device)

    def run(mark):
        routing = parts.route(x, topk_ids)
        mark()
        exchange = dispatch.exchange_counts(routing, group, parts.align)
        (piece,), row_of_slot = dispatch.split(exchange, routing.ids, 1, parts.align)
        mark()
        received = dispatch.send(x, piece, group).wait()
        mark()
        y = dispatch.compute(received, piece, parts)
        mark()
        returned = x.new_empty(piece.send_token.numel(), x.shape[1])
        dispatch.all_to_all(y, returned, piece.send_splits, piece.recv_splits, group).wait()
        parts.weighted_sum(returned, row_of_slot, routing.weights, out)
        mark()
    return run


def nvlink_phases(parts: KernelParts, peers, local: dict):
    """run(mark) of the layer over NVLink, marking its phases."""
    x = local["x"]
    out, topk_ids = torch.empty_like(x), torch.empty(x.shape[0], local["top_k"], dtype=torch.int32, device=x.device)

    def run(mark):
        routing = parts.route(x, topk_ids)
        mark()
        plan = peers.plan(routing.counts, 1)
        mark()
        peers.wait_dispatched(peers.dispatch(x, routing, plan, 0))
        mark()
        experts, rows, offsets = plan.piece(0)
        parts.experts(peers.rows[rows], offsets, experts, peers.y[rows])
        mark()
        peers.give_back(plan, 0)
        peers.combine(routing, out)
        mark()
    return run


def nccl_transfers(parts: KernelParts, local: dict, group, reps: int) -> dict:
    """The slowest rank's median ms of NCCL's dispatch alone (the rows gathered, all_to_all_single) and of its
    combine alone (all_to_all_single back, the weighted sum), each run begun on every rank together after one
    layer's plan and GEMMs: as nvlink_transfers."""
    x = local["x"]
    out, topk_ids = torch.empty_like(x), torch.empty(x.shape[0], local["top_k"], dtype=torch.int32, device=x.device)
    routing = parts.route(x, topk_ids)
    exchange = dispatch.exchange_counts(routing, group, parts.align)
    (piece,), row_of_slot = dispatch.split(exchange, routing.ids, 1, parts.align)
    returned = x.new_empty(piece.send_token.numel(), x.shape[1])
    found = {"dispatch": timed(lambda: dispatch.send(x, piece, group).wait(), reps, group)}
    y = dispatch.compute(dispatch.send(x, piece, group).wait(), piece, parts)

    def combine_alone():
        dispatch.all_to_all(y, returned, piece.send_splits, piece.recv_splits, group).wait()
        parts.weighted_sum(returned, row_of_slot, routing.weights, out)

    found["combine"] = timed(combine_alone, reps, group)
    return found


def nvlink_transfers(parts: KernelParts, peers, local: dict, group, reps: int) -> dict:
    """The slowest rank's median ms of the NVLink dispatch alone and of the return + combine alone, each run
    begun on every rank together after one layer's plan and GEMMs: the transfers without the wait for the
    slowest rank's GEMMs that the phases' combine holds (all_to_all_single is timed alone too)."""
    x = local["x"]
    out, topk_ids = torch.empty_like(x), torch.empty(x.shape[0], local["top_k"], dtype=torch.int32, device=x.device)
    routing = parts.route(x, topk_ids)
    plan = peers.plan(routing.counts, 1)
    experts, rows, offsets = plan.piece(0)

    def combine_alone():
        peers.give_back(plan, 0)
        peers.combine(routing, out)

    found = {"dispatch": timed(lambda: peers.wait_dispatched(peers.dispatch(x, routing, plan, 0)), reps, group)}
    parts.experts(peers.rows[rows], offsets, experts, peers.y[rows])
    found["combine"] = timed(combine_alone, reps, group)
    return found


def phases(run, reps: int, group) -> dict:
    """The slowest rank's median ms of each phase of run(mark)."""
    times = run_times(run, reps, group)
    return {name: slowest(statistics.median(t[i] for t in times), group) for i, name in enumerate(PHASES)}


def all_to_all_ms(bytes_per_rank: float, hidden: int, group, reps: int) -> tuple[float, float]:
    """(ms, bytes per rank) of all_to_all_single of about `bytes_per_rank` of bf16 rows, split evenly."""
    world = dist.get_world_size(group)
    rows = max(1, round(bytes_per_rank / exchange_bytes(world, hidden))) * world
    rows_out = torch.randn(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    rows_in = torch.empty_like(rows_out)
    ms = timed(lambda: dist.all_to_all_single(rows_in, rows_out, group=group), reps, group)
    return ms, exchange_bytes(rows, hidden)


def padding(parts: KernelParts, local: dict, group) -> dict:
    """What the fixed capacity costs on this layer: the capacity, and the rows every rank sends with it
    against the token-slots it has."""
    x, k = local["x"], local["top_k"]
    routing = parts.route(x, torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device))
    exchange = dispatch.fixed_capacity(routing, group, parts.align)
    return dict(capacity=int(exchange.sent[0, 0]), rows_sent=exchange.send_token.numel(), token_slots=x.shape[0] * k)


# ---------------------------------------------------------------- what a pipeline pays

def grouped_rows(parts: KernelParts, local: dict, group) -> tuple[torch.Tensor, np.ndarray]:
    """This rank's received rows grouped by expert, as the un-pipelined layer gives its GEMMs, and the rows of
    each local expert."""
    x, k = local["x"], local["top_k"]
    routing = parts.route(x, torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device))
    exchange = dispatch.exchange_counts(routing, group, parts.align)
    (piece,), _ = dispatch.split(exchange, routing.ids, 1, parts.align)
    received = dispatch.send(x, piece, group).wait()
    _, source_row, _ = parts.regroup_index(piece)
    return received.index_select(0, source_row), exchange.received.sum(0)


def pieces_run(parts: KernelParts, rows: torch.Tensor, rows_per_piece: list[np.ndarray], experts: list[slice]):
    """The GEMMs on consecutive pieces of `rows`, piece i holding rows_per_piece[i] rows of local experts[i]."""
    device, align = rows.device, parts.align
    offsets = [expert_offsets(torch.as_tensor(n), align) for n in rows_per_piece]
    starts = np.cumsum([0] + [int(o[-1]) for o in offsets])
    rows = rows.repeat(-(-int(starts[-1]) // max(1, rows.shape[0])), 1)  # pieces padded apart take more rows
    views = [(rows[a:b], torch.empty_like(rows[a:b]), o.to(device), e)
             for a, b, o, e in zip(starts, starts[1:], offsets, experts)]
    return lambda: [parts.experts(r, o, e, y) for r, y, o, e in views]


def costs(local: dict, parts_for, group, reps: int) -> dict:
    """ms of this rank's expert GEMMs without communication: whole, cut into pieces by expert (each weight read
    once), into pieces by token (every weight read by every piece), and with SMs left to NCCL."""
    parts = parts_for(0)
    rows, per_expert = grouped_rows(parts, local, group)
    local_experts = per_expert.size
    whole = pieces_run(parts, rows, [per_expert], [slice(None)])
    found = {"whole": timed(whole, reps, group)}
    for n in PIECES:
        if n > local_experts:
            continue
        bounds = [local_experts * p // n for p in range(n + 1)]
        cut = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
        found[f"{n} pieces by expert"] = timed(pieces_run(parts, rows, [per_expert[c] for c in cut], cut), reps, group)
        by_token = [per_expert * (p + 1) // n - per_expert * p // n for p in range(n)]
        found[f"{n} pieces by token"] = timed(pieces_run(parts, rows, by_token, [slice(None)] * n), reps, group)
    for spared in SPARED:
        found[f"{spared} SMs spared"] = timed(pieces_run(parts_for(spared), rows, [per_expert], [slice(None)]),
                                              reps, group)
    return found


# ---------------------------------------------------------------- correctness

def gathered(tensor: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts)


def same_inputs_everywhere(inputs: dict, group) -> None:
    """The ranks made their inputs from one seed: they must be equal, or the check means nothing."""
    mine = torch.stack([inputs[n].sum(dtype=torch.float32) for n in ("x", "wr", "w1", "w2")])
    if not torch.equal(gathered(mine[None], group), mine.expand(dist.get_world_size(group), -1)):
        raise RuntimeError("the ranks' seeded inputs differ: the GPUs' random generators disagree")


def correctness(out: torch.Tensor, ids: torch.Tensor, inputs: dict | None, group, expected: dict,
                check: bool) -> dict:
    """Rank 0: a variant's gathered outputs against stage 7 on the gathered inputs, and with `check` the
    problem's check; `expected` keeps stage 7's outputs and the reference for the next variants."""
    out, ids = gathered(out, group), gathered(ids, group)
    if inputs is None:
        return {}
    i = inputs
    if not expected:
        expected["out"], expected["ids"] = ops.moe_layer(i["x"], i["wr"], i["w1"], i["w2"], i["top_k"],
                                                         router_bias=i["bias"], return_topk_ids=True)
    report = dict(ids_equal=bool(torch.equal(ids, expected["ids"])), out_differ=int((out != expected["out"]).sum()),
                  elements=out.numel())
    if check:
        if "reference" not in expected:
            expected["reference"] = PROBLEM.reference(inputs)
        checks = PROBLEM.check(dict(out=out, topk_ids=ids), expected["reference"], {})
        report["check"] = {c.output: dict(passed=c.passed, quality=c.quality) for c in checks}
    return report


# ---------------------------------------------------------------- one configuration

def measure(config: str, args, kernels, group) -> dict | None:
    """Every figure of one configuration; rank 0 gets them, the others None."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shape = shape_of(config, world * args.tokens_per_rank)
    inputs = PROBLEM.make_inputs(shape, "bfloat16", args.seed, device=DEVICE)
    same_inputs_everywhere(inputs, group)
    local = shard(inputs, group, copy=rank > 0)
    whole = inputs if rank == 0 else None  # rank 0 keeps the whole layer: one GPU's stage 7 and the check
    del inputs
    torch.cuda.empty_cache()

    # NCCL's figures first, NVLink's last: a fault in the stage's own transport cannot take the others with it.
    nccl, expected = {n: o for n, o in VARIANTS.items() if "peers" not in o}, {}
    checked, layer_ms = layer_figures(kernels, local, whole, group, args.reps, None, nccl, expected)

    def parts_for(spare_sms):
        return KernelParts(kernels, local["wr"], local["bias"], local["w1"], local["w2"], local["top_k"], spare_sms)

    parts = parts_for(0)
    torch_ep_ms = timed(lambda: layer_expert_parallel(local, local["top_k"], group), args.reps, group)
    phase_ms = {"NCCL": phases(nccl_phases(parts, local, group), args.reps, group)}
    sent = exchange_bytes(local["x"].shape[0] * local["top_k"], shape["hidden"])
    mean_sent = sum_over(sent, group) / world
    a2a_ms, a2a_bytes = all_to_all_ms(mean_sent, shape["hidden"], group, args.reps)
    capacity = padding(parts, local, group)
    cost_ms = costs(local, parts_for, group, args.reps)
    one_gpu_ms = one_gpu(whole, local, args.reps) if rank == 0 else None

    peers = agreed(lambda: peer_buffers(local, group), group)
    found = layer_figures(kernels, local, whole, group, args.reps, peers,
                          {n: o for n, o in VARIANTS.items() if "peers" in o}, expected)
    checked, layer_ms = {**checked, **found[0]}, {**layer_ms, **found[1]}
    phase_ms[NVLINK] = peers if isinstance(peers, dict) else agreed(
        lambda: phases(nvlink_phases(parts, KernelPeers(kernels, peers, parts.align), local), args.reps, group), group)
    transfer_ms = {"NCCL": nccl_transfers(parts, local, group, args.reps),
                   NVLINK: peers if isinstance(peers, dict) else agreed(
                       lambda: nvlink_transfers(parts, KernelPeers(kernels, peers, parts.align), local, group,
                                                args.reps), group)}
    dist.barrier(group=group)
    if rank:
        return None
    return dict(config=config, shape=shape, world=world, tokens_per_rank=args.tokens_per_rank, correctness=checked,
                layer_ms=layer_ms, torch_expert_parallel_ms=torch_ep_ms, one_gpu_stage7_ms=one_gpu_ms,
                phases_ms=phase_ms, transfers_ms=transfer_ms, bytes_per_rank=mean_sent, all_to_all=dict(ms=a2a_ms, bytes_per_rank=a2a_bytes),
                capacity=capacity, costs_ms=cost_ms)


KernelPeers = nvlink.KernelPeers  # how the phases drive the NVLink buffers (the CPU tests put a stand-in here)


def sum_over(value: float, group) -> float:
    found = torch.tensor([value], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(found, group=group)
    return float(found)


def one_gpu(whole: dict, local: dict, reps: int) -> float:
    """ms of stage 7 (the whole layer on one GPU) on this rank's tokens: the throughput bar's yardstick."""
    w = whole
    return timed(lambda: ops.moe_layer(local["x"], w["wr"], w["w1"], w["w2"], w["top_k"], router_bias=w["bias"]), reps)


# ---------------------------------------------------------------- the report

def bars(c: dict) -> list[str]:
    """The stage's bars on one configuration's figures, one line each."""
    ms, world, one_gpu = c["layer_ms"], c["world"], c["one_gpu_stage7_ms"]
    timed_ms = {name: v for name, v in ms.items() if not records.failed(v)}
    lines = []
    if timed_ms:
        best = min(timed_ms, key=timed_ms.get)
        lines.append(met(f"the best variant ({best}) at {one_gpu / timed_ms[best]:.2f} × {world} × one GPU's stage 7",
                         one_gpu / timed_ms[best] >= THROUGHPUT_BAR, THROUGHPUT_BAR))
    pieces = {name: v for name, v in timed_ms.items() if "pieces" in name}
    nccl_pieces = {name: v for name, v in pieces.items() if not name.startswith(NVLINK)}
    if nccl_pieces and records.UNPIPELINED in timed_ms:
        fastest = min(nccl_pieces, key=nccl_pieces.get)
        speedup = timed_ms[records.UNPIPELINED] / nccl_pieces[fastest]
        lines.append(met(f"overlap through NCCL: {fastest} {speedup:.2f} × faster than {records.UNPIPELINED}",
                         speedup >= OVERLAP_BAR, OVERLAP_BAR))
    nvlink_pieces = {name: v for name, v in pieces.items() if name.startswith(NVLINK)}
    if nvlink_pieces and NVLINK in timed_ms:
        fastest = min(nvlink_pieces, key=nvlink_pieces.get)
        speedup = timed_ms[NVLINK] / nvlink_pieces[fastest]
        lines.append(met(f"overlap over NVLink: {fastest} {speedup:.2f} × faster than {NVLINK}",
                         speedup >= OVERLAP_BAR, OVERLAP_BAR))
    a2a = records.gb_per_s(c["all_to_all"]["bytes_per_rank"], c["all_to_all"]["ms"])
    transfers = {**c["phases_ms"], **c.get("transfers_ms", {})}  # alone where measured
    for transport, p in transfers.items():
        if records.failed(p):
            continue
        both = records.gb_per_s(2 * c["bytes_per_rank"], p["dispatch"] + p["combine"]) / a2a
        bar = BANDWIDTH_BAR if transport == NVLINK else NCCL_BANDWIDTH_BAR
        alone = " (alone)" if transport in c.get("transfers_ms", {}) else ""
        lines.append(met(f"{transport}: dispatch + combine{alone} at {both:.2f} × all_to_all_single's GB/s",
                         both >= bar, bar))
    for transport, p in c["phases_ms"].items():
        if records.failed(p):
            continue
        share = (p["route"] + p["plan"]) / p["experts"]
        lines.append(f"  {transport}: route + plan at {share:.0%} of the experts' time")
    return lines


def met(text: str, ok: bool, bar: float) -> str:
    return f"  {text}: bar {bar}, {'met' if ok else 'NOT met'}"


def report(c: dict) -> list[str]:
    """What rank 0 prints of one configuration's figures: the record's tables, then the bars."""
    return records.config_tables(c) + bars(c)


def environment(device: torch.device, group) -> dict:
    commit = os.environ.get("FLASHMOE_COMMIT")  # as the grader's records: a copy of the tree may have no git
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    nccl = torch.cuda.nccl.version()
    return dict(gpu=torch.cuda.get_device_name(device), world=dist.get_world_size(group), torch=torch.__version__,
                nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl), commit=commit,
                head_start_ms=timed(head_start, 3))


def stage_kernels(device_index: int):
    """This stage's kernels (bf16), compiled (or read from the compile cache) and loaded on one GPU, in
    PyTorch's own context; ValueError where the GPU is not sm_90a."""
    from cuda.core import Device

    from stages.common.compiler import compile_cubin
    from stages.common.launcher import KernelSet

    arch = stages.arch_for(torch.cuda.get_device_properties(device_index), STAGE.archs)
    cubin = compile_cubin(STAGE.source_path, arch, STAGE.defines({"dtype": "bfloat16"}))
    Device(device_index).set_current()
    return KernelSet(cubin.path, STAGE.kernels, STAGE.param_structs)


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("stage 11's runner needs a CUDA GPU, and this machine shows none", file=sys.stderr)
        return 2
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    group = default_group(device)
    kernels = stage_kernels(device.index)
    configs = BAR_CONFIGS if args.config == "all" else (args.config,)
    env = environment(device, group)
    rank = dist.get_rank(group)
    if rank == 0:
        print(f"Stage 11 on {env['world']} × {env['gpu']}, torch {env['torch']}, NCCL {env['nccl']}, "
              f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}", flush=True)
    done = []
    for config in configs:
        done.append(measure(config, args, kernels, group))
        if rank == 0:
            print("\n".join(report(done[-1])), flush=True)
            if args.json:  # after each configuration: a later failure keeps the earlier figures
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(records.record(done, **env), indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
