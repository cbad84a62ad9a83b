"""Time GPU work with CUDA events, side by side, with a cold L2 (used in the worker process only).

Every candidate (the kernel, each library baseline) runs in every round, one after the other, so
that clocks and temperature drift hit them alike; each takes its turn to go first, and the loop
ends only after whole turns, so each has gone first as often as the others. Before each launch L2 is
left cold and clean, outside the timed event pair (ColdL2): no candidate finds its inputs left in L2
by the previous one, nor pays for writing back what the flush wrote. Rounds repeat until every
candidate's median (the figure reported) has settled -- its 95% confidence interval, from the order
statistics (no assumption about
the distribution: a few slow outliers do not hold the loop as they would a mean's standard error),
within 1% of it -- or the time budget ends. (A candidate that left the loop as soon as its own figures
settled would leave the others timed in rounds of a different mix of work, under other clocks.)

The events time the GPU, not Python: a round starts with the GPU held in a spin (`torch.cuda._sleep`)
long enough for the host to queue the whole round behind it. Without the hold, a candidate whose
host code takes longer to queue its launches than the GPU takes to flush the L2 (a launch through
Python with many arguments: 0.1-0.3 ms) would have the GPU idle inside its own events, and be
charged for the host's time as well.

Every candidate after the first of a round also starts after a rest: the GPU held in the spin for as
long as the candidate before it ran (its time in the last round; at most GpuHold.MAX_MS). Work that
holds the GPU at its power limit for tens of milliseconds (a whole model's forward) lowers the clocks
for what runs right after it; and in a fixed order of turns each candidate always follows the same
one, so one that follows light work (eager PyTorch) would be timed at higher clocks than one that
follows heavy work, every round. After the rest each starts from the same state, whatever ran before.
The rest does not undo everything: a CUDA graph replayed right after another CUDA graph runs slower
(0.1 ms of a 1.5 ms forward, measured) than after other work. So past its first, a round's order is
shuffled (the same shuffles every run): each candidate follows each other about equally often.
"""
from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    spread: float        # (p90 - p10) / median
    rel_std_err: float
    reps: int

    def as_dict(self) -> dict:
        return dict(ms=self.median_ms, ms_min=self.min_ms, spread=self.spread, rel_std_err=self.rel_std_err, reps=self.reps)


def _summary(times: list[float]) -> Timing:
    ordered = sorted(times)
    median = statistics.median(ordered)
    mean = statistics.fmean(ordered)
    se = statistics.stdev(ordered) / len(ordered) ** 0.5 if len(ordered) > 1 else float("inf")
    p10, p90 = ordered[int(0.1 * (len(ordered) - 1))], ordered[int(0.9 * (len(ordered) - 1))]
    return Timing(median, ordered[0], (p90 - p10) / median if median else 0.0, se / mean if mean else 0.0, len(ordered))


class GpuHold:
    """Keeps the GPU busy for a given time with a spin kernel, so that the launches the host queues
    meanwhile run back to back once it ends. Longest hold: MAX_MS (a candidate that synchronizes
    with the host cannot be helped by any hold)."""
    MAX_MS = 20.0

    def __init__(self):
        probe = 1_000_000
        torch.cuda._sleep(probe)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        self.cycles_per_ms = probe / max(start.elapsed_time(end), 1e-3)

    def hold(self, ms: float) -> None:
        torch.cuda._sleep(int(self.cycles_per_ms * min(ms, self.MAX_MS)))


class ColdL2:
    """Empties L2 of everything a candidate could use, and of dirty lines. A buffer twice the size of L2 is
    written (what L2 held is evicted), then another is read: the written lines, dirty, are written back
    to memory here and replaced by clean ones. Without the read, the next kernel's first misses would
    write the flush's dirty lines back inside its own events: 8 to 9 µs on an H200, whatever the kernel
    (measured 2026-11-29 on kernels of 37 to 260 µs), a fifth of the shortest decode step's time."""

    def __init__(self, l2_bytes: int):
        self._written = torch.empty(2 * l2_bytes // 4, dtype=torch.float32, device="cuda")
        self._read = torch.zeros(2 * l2_bytes // 4, dtype=torch.float32, device="cuda")
        self._sum = torch.empty((), dtype=torch.float32, device="cuda")

    def __call__(self) -> None:
        self._written.zero_()
        torch.sum(self._read, dim=0, out=self._sum)


Z_95 = 1.96  # the normal quantile of a two-sided 95% interval


def median_interval(times: list[float]) -> tuple[float, float] | None:
    """A distribution-free 95% confidence interval of the median of `times`: the order statistics at
    n/2 -+ Z_95·sqrt(n)/2 (the binomial count below the median, approximated as normal); None while
    there are too few times for one (under 8)."""
    n, half_width = len(times), Z_95 * math.sqrt(len(times)) / 2
    low, high = math.floor(n / 2 - half_width), math.ceil(n / 2 + half_width)
    if low < 0 or high > n - 1:
        return None
    ordered = sorted(times)
    return ordered[low], ordered[high]


def median_settled(times: list[float], target_rel: float) -> bool:
    """Whether the median's 95% interval lies within target_rel of the median, on both sides."""
    interval = median_interval(times)
    median = statistics.median(times)
    return interval is not None and median - interval[0] <= target_rel * median and \
        interval[1] - median <= target_rel * median


def enough(times: dict[str, list[float]], past_deadline: bool, target_rel: float, max_reps: int) -> bool:
    """Whether the loop may stop after this round: only after whole turns (every candidate has gone
    first equally often), once every candidate's median has settled, or the budget is spent (and each
    has 3 runs at least), or the most rounds allowed have run."""
    rounds = len(next(iter(times.values())))
    if rounds >= max_reps:
        return True
    if rounds % len(times):
        return False
    settled = all(median_settled(t, target_rel) for t in times.values())
    return settled or (past_deadline and rounds >= 3)


def timed(run) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """Calls run() between two CUDA events recorded on the current stream, and returns them."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    return start, end


def time_side_by_side(candidates: dict, l2_bytes: int, budget_s: float = 4.0, target_rel: float = 0.01,
                      max_reps: int = 500) -> dict[str, Timing]:
    """{name: Timing} for each callable in `candidates`; each is called with no arguments."""
    cold_l2 = ColdL2(l2_bytes)
    host_start = time.perf_counter()
    warm_up = {name: timed(run) for name, run in candidates.items()}  # module loads, heuristics, allocator
    host_round_ms = (time.perf_counter() - host_start) * 1e3  # an overestimate: the first calls are slow
    torch.cuda.synchronize()
    last_ms = {name: start.elapsed_time(end) for name, (start, end) in warm_up.items()}  # each one's last time
    gpu = GpuHold()

    times = {name: [] for name in candidates}
    deadline = time.perf_counter() + budget_s
    names, shuffles = list(candidates), random.Random(0)
    while True:
        pending = []
        order = round_order(names, len(times[names[0]]), shuffles)
        # Twice the last round's host time (the host queues this round before the GPU reaches it), and
        # at least the rest the last round's work calls for.
        gpu.hold(max(2.0 * host_round_ms + 0.05, *last_ms.values()))
        host_start = time.perf_counter()
        for place, name in enumerate(order):
            if place:
                gpu.hold(last_ms[order[place - 1]])  # the rest: as long as the one before it ran
            cold_l2()
            pending.append((name, *timed(candidates[name])))
        host_round_ms = (time.perf_counter() - host_start) * 1e3
        torch.cuda.synchronize()
        for name, start, end in pending:
            last_ms[name] = start.elapsed_time(end)
            times[name].append(last_ms[name])
        if enough(times, time.perf_counter() > deadline, target_rel, max_reps):
            break
    return {name: _summary(t) for name, t in times.items()}


def round_order(names: list[str], round_index: int, shuffles: random.Random) -> list[str]:
    """Round `round_index`'s order: each candidate takes its turn to go first after the hold, the others
    after it in a shuffled order, so that none always follows the same one."""
    first = names[(round_index + 1) % len(names)]
    rest = [name for name in names if name != first]
    shuffles.shuffle(rest)
    return [first, *rest]


def extra_memory(run) -> int:
    """Device memory `run` allocates beyond what it returns (its workspace), in bytes."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = run()
    torch.cuda.synchronize()
    returned = result.numel() * result.element_size() if isinstance(result, torch.Tensor) else 0
    return max(torch.cuda.max_memory_allocated() - before - returned, 0)
