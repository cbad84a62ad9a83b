"""The stages of the course: one folder each, `stageN_<name>/`, holding a kernel and its launch.

A stage's `__init__.py` has a docstring whose first line is its title and defines `STAGE`, a `Stage`
saying which problem it solves (see `reference/`), which `.cu` file holds its kernels, the architectures
it compiles for, the kernels' C signatures, how to launch them, the launch geometry it relies on, and
what speed it is graded against.

The launch geometry (tiles, threads per block, dynamic shared memory, limits) is computed in the `.cu`
file, its home; the launch declares the values it launches with, per variant, in `geometry`, and the
grader checks them against the kernel's constants each time it compiles it (grader/run.py), so that
a kernel and its launch cannot disagree. A stage's launch code never imports grader/.
"""
from __future__ import annotations

import importlib
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

STAGES_DIR = Path(__file__).resolve().parent
ALL_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a")


@dataclass(frozen=True)
class Goal:
    """What 100% means for a stage's grade: `fraction` of a baseline's speed.

    `baseline` names a baseline of the problem ("naive", "flash", "cudnn", ...) or "reference",
    the fastest library baseline on this GPU.
    """

    baseline: str = "reference"
    fraction: float = 1.0

    @property
    def text(self) -> str:
        who = "the fastest library baseline" if self.baseline == "reference" else f"the {self.baseline} baseline"
        return who if self.fraction == 1.0 else f"{self.fraction:g} × {who}"


@dataclass(frozen=True)
class Stage:
    name: str                       # the folder, e.g. "stage0_naive"
    problem: str                    # a problem of reference/, e.g. "attention"
    source: str                     # the .cu file in the folder
    kernels: dict[str, str]         # kernel name -> its C parameter list, checked at compile time
    launch: Callable                # launch(kernels, *problem tensors and parameters)
    archs: tuple[str, ...] = ALL_ARCHS
    specializations: dict[str, tuple] = field(default_factory=dict)  # -D macros compiled in, e.g. HEAD_DIM
    goal: Goal = Goal()
    extra_benchmarks: tuple = ()    # shapes timed after the problem's own (dicts as problem.benchmarks())
    # The kernel's constants the launch relies on, for a variant's -D macros: {"BLOCK_M": 128, ...};
    # a key is a constant expression of the kernel (a name, or e.g. "SHARED_BYTES<true>").
    geometry: Callable[[dict[str, str]], dict[str, int]] = lambda defines: {}

    @property
    def number(self) -> int:
        return int(re.match(r"stage(\d+)", self.name).group(1))

    @property
    def folder(self) -> Path:
        return STAGES_DIR / self.name

    @property
    def source_path(self) -> Path:
        return self.folder / self.source

    @property
    def title(self) -> str:
        doc = importlib.import_module(f"stages.{self.name}").__doc__ or self.name
        return doc.strip().splitlines()[0]

    def variants(self, dtype_macros: dict[str, str]) -> list[dict[str, str]]:
        """Every combination of -D macros to compile: the problem's dtypes × the stage's specializations."""
        names = list(self.specializations)
        combos = list(itertools.product(*(self.specializations[n] for n in names)))
        return [{"ELEM_T": elem, **{n: str(v) for n, v in zip(names, combo)}}
                for elem in dtype_macros.values() for combo in combos]


def stage_names() -> list[str]:
    return sorted((p.name for p in STAGES_DIR.glob("stage*_*") if (p / "__init__.py").exists()),
                  key=lambda n: int(re.match(r"stage(\d+)", n).group(1)))


def previous(stage: Stage) -> Stage | None:
    """The stage before `stage` on the same problem (stage 2 for stage 3), or None for the first."""
    earlier = [load(n) for n in stage_names() if int(re.match(r"stage(\d+)", n).group(1)) < stage.number]
    same_problem = [s for s in earlier if s.problem == stage.problem]
    return same_problem[-1] if same_problem else None


def load(name: str) -> Stage:
    """A stage by folder name ("stage0_naive") or by short name ("stage0", "0")."""
    wanted = name if name.startswith("stage") else f"stage{name}"
    for full in stage_names():
        if full == wanted or full.split("_")[0] == wanted:
            return importlib.import_module(f"stages.{full}").STAGE
    raise KeyError(name)
