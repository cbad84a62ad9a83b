"""Error statistics and the pass rule, shared by every problem.

The rule asks of a kernel what its dtype allows, measured rather than guessed: on the same inputs,
PyTorch's own implementation in the same dtype has some error against the exact (float64) result;
the kernel may have at most twice that error, plus a rounding term of two units in the last place
of the largest output (the output itself is rounded to the dtype):

    max|kernel - exact| <= 2 · max|library - exact| + 2 · u · max|exact|

with u the unit roundoff: 2^-11 for float16, 2^-8 for bfloat16 (2^-24 for float32 outputs).
PyTorch's attention is SDPA as PyTorch dispatches it, cuDNN's backend left out (`library_dispatch`).
Integer outputs (indices, counts) must be exact, and a problem may judge an output by its own rule
(a permutation that may come in any order): `exact_match` and `rule`.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def library_dispatch():
    """The context a problem's library result is computed in: SDPA dispatched as PyTorch does, without
    cuDNN's backend. cuDNN builds and tunes a plan at its first call for each new shape, 1 to 4 s on the
    H100, which took 35 of the 40 s of stage 9's correctness cases; flash, memory-efficient and math are no
    less exact (on the H100, 2026-11-27, the attention stages' tolerances came out 0.68-0.95× of those
    against cuDNN's, and every case passed under both). The timed baselines still include cuDNN."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # a PyTorch without the choice: its default dispatch
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


# The quality levels of the course's grading spec (max abs, mean abs, max relative error).
QUALITY_LEVELS = {"excellent": (1e-4, 1e-5, 1e-3), "acceptable": (1e-3, 1e-4, 1e-2)}


@dataclass
class ErrorStats:
    max_abs: float
    mean_abs: float
    max_rel: float      # max|error| / max|exact|: relative to the output's scale, so defined near zeros
    finite: bool        # False if the output holds a NaN or inf (an unwritten, poisoned element)

    def meets(self, level: str) -> bool:
        max_abs, mean_abs, max_rel = QUALITY_LEVELS[level]
        return self.finite and self.max_abs < max_abs and self.mean_abs < mean_abs and self.max_rel < max_rel


def error_stats(out: torch.Tensor, exact: torch.Tensor) -> ErrorStats:
    out64 = out.to(torch.float64)
    finite = bool(torch.isfinite(out64).all())
    err = (out64 - exact).abs()
    scale = exact.abs().max().item() if exact.numel() else 0.0
    max_abs = err.max().item() if err.numel() else 0.0
    if not finite:
        max_abs = float("inf")
    return ErrorStats(max_abs, err.mean().item() if err.numel() else 0.0,
                      max_abs / scale if scale > 0 else max_abs, finite)


def quality(kernel: ErrorStats, library: ErrorStats) -> str:
    """The best level the kernel meets, among those the library itself meets in this dtype ("n/a" if none)."""
    for level in QUALITY_LEVELS:
        if library.meets(level):
            return level if kernel.meets(level) else "below " + level
    return "n/a"


@dataclass
class OutputCheck:
    output: str
    passed: bool
    tolerance: float
    kernel: ErrorStats
    library: ErrorStats | None
    quality: str

    def as_dict(self) -> dict:
        return asdict(self)


def relative_to_library(name: str, out: torch.Tensor, exact: torch.Tensor, library_out: torch.Tensor) -> OutputCheck:
    """The pass rule of the module docstring, for an output in a 16-bit dtype."""
    kernel, library = error_stats(out, exact), error_stats(library_out, exact)
    u = UNIT_ROUNDOFF[out.dtype]
    tolerance = 2 * library.max_abs + 2 * u * exact.abs().max().item()
    return OutputCheck(name, kernel.finite and kernel.max_abs <= tolerance, tolerance, kernel, library,
                       quality(kernel, library))


def absolute_and_relative(name: str, out: torch.Tensor, exact: torch.Tensor, rtol: float) -> OutputCheck:
    """For an fp32 output no library computes (the LSE): |out - exact| <= rtol · (1 + |exact|) everywhere."""
    kernel = error_stats(out, exact)
    err = (out.to(torch.float64) - exact).abs()
    worst = (err / (1 + exact.abs())).max().item() if err.numel() else 0.0
    passed = kernel.finite and worst <= rtol
    return OutputCheck(name, passed, rtol, kernel, None, "n/a")


def rule(name: str, wrong: int, total: int, why: str) -> OutputCheck:
    """For an output judged by a rule rather than a distance (a permutation, exact integers):
    `wrong` of `total` elements break it; `why` (shown as the quality) says how, or that it holds."""
    frac = wrong / total if total else 0.0
    stats = ErrorStats(float(wrong), frac, frac, True)
    return OutputCheck(name, wrong == 0, 0.0, stats, None, why)


def exact_match(name: str, out: torch.Tensor, exact: torch.Tensor) -> OutputCheck:
    """For integer outputs (indices, counts): every element equal to the exact one."""
    wrong = int((out.to(torch.int64) != exact.to(torch.int64)).sum())
    return rule(name, wrong, out.numel(), f"{wrong} wrong" if wrong else "exact")
