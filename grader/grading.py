"""From measured times to per-shape figures and a letter grade.

The grade: for each benchmark shape, the kernel's speed relative to the stage's goal
(goal time / kernel time, the goal being a fraction of one baseline's speed; see stages.Goal);
their geometric mean is the score, and the bands are those of the course's grading spec:

    A > 80%,  B > 70%,  C > 60%,  D > 40%,  F otherwise.

A stage scales what 100% means to what its technique can reach (stage 2 is graded against
0.6 × FlashAttention-2), and the report always shows the kernel against the fastest library
baseline too ("% of reference").
"""
from __future__ import annotations

import math

BANDS = (("A", 0.80), ("B", 0.70), ("C", 0.60), ("D", 0.40))
RULE = "A > 80%, B > 70%, C > 60%, D > 40%, else F (geometric mean over the benchmark shapes)"


def letter(score: float) -> str:
    for grade, floor in BANDS:
        if score > floor:
            return grade
    return "F"


def geomean(values: list[float]) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else 0.0


def reference_of(baseline_ms: dict[str, float | None]) -> tuple[str, float] | None:
    """The fastest library baseline (naive PyTorch is a baseline, not a reference)."""
    libraries = {n: ms for n, ms in baseline_ms.items() if ms and n != "naive"}
    return min(libraries.items(), key=lambda item: item[1]) if libraries else None


def benchmark_figures(shape: dict, ms: float, baseline_ms: dict, flops: float, min_bytes: float, spec) -> dict:
    """The report's columns for one shape; % of peak and of bandwidth need a known GPU (`spec`)."""
    figures = {"ms": ms, "tflops": flops / ms / 1e9}
    ref = reference_of(baseline_ms)
    if ref:
        figures["reference"] = {"name": ref[0], "ms": ref[1], "tflops": flops / ref[1] / 1e9}
        figures["pct_of_reference"] = 100 * ref[1] / ms
    if baseline_ms.get("naive"):
        figures["speedup_vs_naive"] = baseline_ms["naive"] / ms
    flags = []
    if spec:
        figures["pct_peak"] = 100 * figures["tflops"] / spec.tflops_16bit
        figures["pct_bandwidth"] = 100 * (min_bytes / ms / 1e9) / spec.bandwidth_tbs
        floor_ms = max(flops / (spec.tflops_16bit * 1e9), min_bytes / (spec.bandwidth_tbs * 1e9))
        if ms < floor_ms:
            flags.append(f"faster than the roofline floor ({floor_ms:.3f} ms): suspect the timing or the check")
    if ref and ms > 10 * ref[1]:
        flags.append("more than 10x slower than the reference")
    figures["flags"] = flags
    return figures


def grade(goal, benchmarks: list[dict]) -> dict:
    """The score and letter for a stage's benchmarks (each with "ms" and "baselines")."""
    ratios, used = [], goal.baseline
    for bench in benchmarks:
        base = bench["baselines"].get(goal.baseline) if goal.baseline != "reference" else None
        if goal.baseline == "reference" or not base:
            ref = reference_of(bench["baselines"])
            base, used = (ref[1], "reference") if ref else (None, used)
        if base:
            ratios.append(base / goal.fraction / bench["ms"])
    score = geomean(ratios)
    return {"grade": letter(score) if ratios else "?", "score": score,
            "goal": {"baseline": used, "fraction": goal.fraction, "text": goal.text}, "rule": RULE}
