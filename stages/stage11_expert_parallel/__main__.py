"""torchrun --nproc-per-node N -m stages.stage11_expert_parallel [--config seed|deepseek|all] [--tokens-per-rank T]

Stage 11 on the GPUs of one machine, one process per GPU; without torchrun (python -m ...) a world of one on one
GPU. For each configuration, N × T tokens in bf16, the inputs made alike on every rank from the seed:

  correctness  every variant's gathered outputs against one GPU's stage 7 on the gathered inputs (the same
               kernels row for row: equal bit for bit), and the problem's check (the float64 layer) on the first
  layer        each variant's time: the counts' exchange or a fixed capacity, in 1, 2 or 4 pieces; the same
               sharding in plain PyTorch; one GPU's stage 7 on one rank's tokens, the throughput bar's yardstick
  phases       the un-pipelined layer's route + plan, dispatch, experts and combine; dispatch and combine in
               GB/s against all_to_all_single of the same bytes, split evenly

Each time is the slowest rank's median over --reps runs (a barrier before each; the all-to-alls make every rank
wait for the slowest anyway). NCCL_NVLS_ENABLE=0 unless set. Rank 0 prints; --json writes the same figures.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

# Before CUDA starts (as the grader's worker): several GB of buffers come and go beside 9-23 GB of weights.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import stages  # noqa: E402
from reference import load  # noqa: E402
from reference.moe_expert_parallel import (BAR_CONFIGS, TOKENS_PER_RANK, default_group,  # noqa: E402
                                           exchange_bytes, layer_expert_parallel, shape_of, shard)
from stages import ops  # noqa: E402
from stages.stage11_expert_parallel import STAGE, KernelParts, dispatch  # noqa: E402

PROBLEM = load(STAGE.problem)
SPARE = 16  # SMs a pipelined variant's GEMMs leave to NCCL: a guess, for the runs to judge
VARIANTS = {"counts": {}, "capacity": dict(capacity=True), "pipeline 2": dict(chunks=2), "pipeline 4": dict(chunks=4),
            f"pipeline 4, {SPARE} SMs spared": dict(chunks=4, spare_sms=SPARE),
            "pipeline 4, capacity": dict(chunks=4, capacity=True)}
BANDWIDTH_BAR = 0.6   # issue #18: dispatch + combine at >= 60% of all_to_all_single's GB/s
THROUGHPUT_BAR = 0.8  # and the layer at >= 0.8 × N × one GPU's stage 7, in tokens/s
PHASES = ("route + plan", "dispatch", "experts", "combine")
DEVICE = "cuda"  # where this rank's tensors live: the GPU torch.cuda.set_device chose


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m stages.stage11_expert_parallel",
                                description="Stage 11 (expert parallelism) across the GPUs of one machine.")
    p.add_argument("--config", choices=[*BAR_CONFIGS, "all"], default="all", help="the layer (default: both)")
    p.add_argument("--tokens-per-rank", type=int, default=TOKENS_PER_RANK, help=f"default {TOKENS_PER_RANK}")
    p.add_argument("--reps", type=int, default=20, help="timed runs of each candidate (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write rank 0's figures here")
    return p.parse_args(argv)


# ---------------------------------------------------------------- timing

def slowest(value: float, group) -> float:
    found = torch.tensor([value], device=DEVICE)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return float(found)


def run_times(run, reps: int, group) -> list[list[float]]:
    """ms between the marks of each of `reps` runs (after one warm-up): run(mark) calls mark() where a phase
    ends. With a group, its ranks start each run together."""
    times = []
    for rep in range(reps + 1):
        if group is not None:
            dist.barrier(group=group)
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


# ---------------------------------------------------------------- the candidates

def variant_run(kernels, local: dict, group, options: dict):
    """The stage's launch on this rank's inputs with one variant's options; its outputs."""
    x, k = local["x"], local["top_k"]
    out, topk_ids = torch.empty_like(x), torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device)

    def run():
        STAGE.launch(kernels, x, local["wr"], local["bias"], local["w1"], local["w2"], k, out, topk_ids, group,
                     **options)
    return run, out, topk_ids


def phases(parts: KernelParts, local: dict, group, reps: int) -> tuple[dict, float]:
    """The slowest rank's median ms of each phase of the un-pipelined layer (the counts' exchange), and the
    bytes this rank sends each way."""
    x = local["x"]
    out, topk_ids = torch.empty_like(x), torch.empty(x.shape[0], local["top_k"], dtype=torch.int32, device=x.device)
    sent = []

    def run(mark):
        routing = parts.route(x, topk_ids)
        (exchange,) = dispatch.exchange_counts([routing], group, parts.align)
        mark()
        received = dispatch.send(x, exchange, group).wait()
        mark()
        y = dispatch.compute(received, exchange, parts)
        mark()
        parts.weighted_sum(dispatch.send_back(y, exchange, group).wait(), exchange.row_of_slot, routing.weights, out)
        mark()
        sent.append(exchange.send_token.numel())

    times = run_times(run, reps, group)
    medians = {name: slowest(statistics.median(t[i] for t in times), group) for i, name in enumerate(PHASES)}
    return medians, exchange_bytes(sent[-1], x.shape[1])


def all_to_all_ms(bytes_per_rank: float, hidden: int, group, reps: int) -> tuple[float, float]:
    """(ms, bytes per rank) of all_to_all_single of about `bytes_per_rank` of bf16 rows, split evenly."""
    world = dist.get_world_size(group)
    rows = max(1, round(bytes_per_rank / exchange_bytes(world, hidden))) * world
    rows_out = torch.randn(rows, hidden, dtype=torch.bfloat16, device=DEVICE)
    rows_in = torch.empty_like(rows_out)
    return timed(lambda: dist.all_to_all_single(rows_in, rows_out, group=group), reps, group), exchange_bytes(rows, hidden)


def padding(parts: KernelParts, local: dict, group) -> dict:
    """What the fixed capacity costs on this layer: the capacity, and the rows every rank sends with it
    against the token-slots it has."""
    x, k = local["x"], local["top_k"]
    routing = parts.route(x, torch.empty(x.shape[0], k, dtype=torch.int32, device=x.device))
    (exchange,) = dispatch.fixed_capacity([routing], group, parts.align)
    return dict(capacity=exchange.grouped_rows // routing.counts.numel(), rows_sent=exchange.send_token.numel(),
                token_slots=x.shape[0] * k)


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


def correctness(outputs: dict, inputs: dict | None, group) -> dict:
    """Rank 0: each variant's gathered outputs against stage 7 on the gathered inputs, and the problem's
    check on the first variant's. `outputs`: variant -> (out, topk_ids) of this rank."""
    found = {name: (gathered(out, group), gathered(ids, group)) for name, (out, ids) in outputs.items()}
    if inputs is None:
        return {}
    i = inputs
    out7, ids7 = ops.moe_layer(i["x"], i["wr"], i["w1"], i["w2"], i["top_k"], router_bias=i["bias"],
                              return_topk_ids=True)
    report = {name: dict(ids_equal=bool(torch.equal(ids, ids7)), out_differ=int((out != out7).sum()),
                         elements=out.numel()) for name, (out, ids) in found.items()}
    first = next(iter(found))
    checks = PROBLEM.check(dict(out=found[first][0], topk_ids=found[first][1]), PROBLEM.reference(inputs), {})
    report[first]["check"] = {c.output: dict(passed=c.passed, quality=c.quality) for c in checks}
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

    runs = {name: variant_run(kernels, local, group, options) for name, options in VARIANTS.items()}
    for run, _, _ in runs.values():
        run()
    checked = correctness({name: (out, ids) for name, (_, out, ids) in runs.items()}, whole, group)
    layer_ms = {name: timed(run, args.reps, group) for name, (run, _, _) in runs.items()}
    del runs
    parts = KernelParts(kernels, local["wr"], local["bias"], local["w1"], local["w2"], local["top_k"])
    torch_ep_ms = timed(lambda: layer_expert_parallel(local, local["top_k"], group), args.reps, group)
    phase_ms, sent = phases(parts, local, group, args.reps)
    mean_sent = sum_over(sent, group) / world
    a2a_ms, a2a_bytes = all_to_all_ms(mean_sent, shape["hidden"], group, args.reps)
    capacity = padding(parts, local, group)
    one_gpu_ms = one_gpu(whole, local, args.reps) if rank == 0 else None
    dist.barrier(group=group)
    if rank:
        return None
    return dict(config=config, shape=shape, world=world, tokens_per_rank=args.tokens_per_rank, correctness=checked,
                layer_ms=layer_ms, torch_expert_parallel_ms=torch_ep_ms, one_gpu_stage7_ms=one_gpu_ms,
                phases_ms=phase_ms, bytes_per_rank=mean_sent, all_to_all=dict(ms=a2a_ms, bytes_per_rank=a2a_bytes),
                capacity=capacity)


def sum_over(value: float, group) -> float:
    found = torch.tensor([value], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(found, group=group)
    return float(found)


def one_gpu(whole: dict, local: dict, reps: int) -> float:
    """ms of stage 7 (the whole layer on one GPU) on this rank's tokens: the throughput bar's yardstick."""
    w = whole
    return timed(lambda: ops.moe_layer(local["x"], w["wr"], w["w1"], w["w2"], w["top_k"], router_bias=w["bias"]), reps)


# ---------------------------------------------------------------- the report

def gb_per_s(nbytes: float, ms: float) -> float:
    return nbytes / ms / 1e6


def report(r: dict) -> list[str]:
    """What rank 0 prints of one configuration's figures."""
    s, world, tokens = r["shape"], r["world"], r["tokens_per_rank"]
    one_gpu_rate = tokens / r["one_gpu_stage7_ms"] / 1e3  # M tokens/s

    def rate(ms):
        return f"{world * tokens / ms / 1e3:.2f} M tokens/s = {world * tokens / ms / 1e3 / (world * one_gpu_rate):.2f}" \
               f" × {world} × one GPU's stage 7"

    lines = [f"{r['config']}: hidden {s['hidden']}, inter {s['inter']}, {s['experts']} experts, top-{s['top_k']}, "
             f"{world} × {tokens} tokens, bf16", "  correctness against one GPU's stage 7 on the gathered inputs:"]
    for name, c in r["correctness"].items():
        check = "; the problem's check: " + ", ".join(f"{o} {'passed' if v['passed'] else 'FAILED'} ({v['quality']})"
                                                      for o, v in c["check"].items()) if "check" in c else ""
        lines.append(f"    {name}: topk_ids {'equal' if c['ids_equal'] else 'DIFFER'}, out: {c['out_differ']} of "
                     f"{c['elements']} elements differ{check}")
    lines.append("  layer:")
    lines += [f"    {name}: {ms:.3f} ms, {rate(ms)}" for name, ms in r["layer_ms"].items()]
    lines.append(f"    plain PyTorch (all_to_all_single + torch._grouped_mm): {r['torch_expert_parallel_ms']:.3f} ms, "
                 f"{rate(r['torch_expert_parallel_ms'])}")
    best = min(r["layer_ms"], key=r["layer_ms"].get)
    met = world * tokens / r["layer_ms"][best] / 1e3 >= THROUGHPUT_BAR * world * one_gpu_rate
    lines.append(f"    one GPU's stage 7 on {tokens} tokens: {r['one_gpu_stage7_ms']:.3f} ms, {one_gpu_rate:.2f} M tokens/s; "
                 f"bar: the best variant ({best}) >= {THROUGHPUT_BAR} × {world} × that: {'met' if met else 'NOT met'}")
    return lines + phase_lines(r) + capacity_lines(r)


def phase_lines(r: dict) -> list[str]:
    p, nbytes, a2a = r["phases_ms"], r["bytes_per_rank"], r["all_to_all"]
    a2a_rate = gb_per_s(a2a["bytes_per_rank"], a2a["ms"])
    both = gb_per_s(2 * nbytes, p["dispatch"] + p["combine"])
    return [f"  phases of the un-pipelined layer (counts), {nbytes / 1e6:.1f} MB sent per rank each way:",
            "    " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in p.items()),
            f"    dispatch {gb_per_s(nbytes, p['dispatch']):.1f} GB/s, combine {gb_per_s(nbytes, p['combine']):.1f} GB/s "
            f"(per rank; dispatch: the gather and all_to_all_single, combine: all_to_all_single and the weighted sum)",
            f"    all_to_all_single of the same bytes: {a2a['ms']:.3f} ms, {a2a_rate:.1f} GB/s; dispatch + combine at "
            f"{both / a2a_rate:.2f} of it, bar {BANDWIDTH_BAR}: {'met' if both >= BANDWIDTH_BAR * a2a_rate else 'NOT met'}"]


def capacity_lines(r: dict) -> list[str]:
    c, ms = r["capacity"], r["layer_ms"]
    overlap = ", ".join(f"{name} {ms[name] / ms['counts']:.2f}" for name in ms if name.startswith("pipeline"))
    return [f"  fixed capacity {c['capacity']} rows per (rank, expert): {c['rows_sent']} rows sent per rank for "
            f"{c['token_slots']} token-slots, {c['rows_sent'] / c['token_slots'] - 1:.0%} padding; "
            f"its layer at {ms['capacity'] / ms['counts']:.2f} × the counts' time",
            f"  the pipeline's time over the un-pipelined one: {overlap}"]


def stage_kernels(device_index: int):
    """This stage's kernels (bf16), compiled (or read from the compile cache) and loaded on one GPU, in
    PyTorch's own context; ValueError where the GPU is not sm_90a."""
    from cuda.core import Device

    from stages.common.compiler import compile_cubin
    from stages.common.launcher import KernelSet

    arch = stages.arch_for(torch.cuda.get_device_properties(device_index), STAGE.archs)
    cubin = compile_cubin(STAGE.source_path, arch, STAGE.defines({"dtype": "bfloat16"}))
    Device(device_index).set_current()
    return KernelSet(cubin.path, STAGE.kernels)


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
    results = [measure(config, args, kernels, group) for config in configs]
    if dist.get_rank(group) == 0:
        print(f"Stage 11 on {dist.get_world_size(group)} × {torch.cuda.get_device_name(device)}, torch "
              f"{torch.__version__}, NCCL {torch.cuda.nccl.version()}, "
              f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']}", flush=True)
        for r in results:
            print("\n".join(report(r)), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
