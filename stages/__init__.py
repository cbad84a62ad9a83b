"""The stages of the course: one folder each, `stageN_<name>/`, holding a kernel and its launch.

A stage's `__init__.py` has a docstring whose first line is its title and defines `STAGE`, a `Stage`
saying which problem it solves (see `reference/`), which `.cu` file holds its kernels, the architectures
it compiles for, the kernels' C signatures, how to launch them, the launch geometry it relies on, and
what speed it is graded against.

The launch geometry (tiles, threads per block, dynamic shared memory, limits) is computed in the `.cu`
file, its home; the launch declares the values it launches with, per variant, in `geometry`, and the
grader checks them against the kernel's constants each time it compiles it (grader/run.py), so that
a kernel and its launch cannot disagree. A stage's launch code never imports grader/.

A kernel with many parameters takes them as one struct: `const __grid_constant__ NameParams p`, after
its tensor maps, read as `p.heads` in the kernel. Its Python class, made by `param_struct` (stages/common/
launcher.py) from the C struct's fields in order with their C types, is what a launch passes, built once
per launch with every field by name (`NameParams(heads=..., ...)`); the stage lists it in `param_structs`
and names it in the kernel's parameter list ("const TmaMap, const NameParams"). The fields are written
twice, in the `.cu` file and in Python, and the grader checks that they agree each time it compiles the
kernel (each field's type, their order, the struct's size: grader/run.py's param_struct_checks), so that a
struct packed otherwise than the kernel reads it is a compile error of one line, never garbage in the
kernel's parameters. A pointer in a struct is not `__restrict__` to the compiler: what a kernel streams
read-only through one, it reads with `__ldg`.

`stages.ops` runs the stages OPS_STAGES lists, the fastest this GPU runs, as PyTorch functions, on a learner's
own tensors.
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
ELEM_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}  # a problem's dtype -> the kernel's ELEM_T


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
    param_structs: tuple = ()       # the parameter structs (launcher.py's param_struct) the lists name
    archs: tuple[str, ...] = ALL_ARCHS
    specializations: dict[str, str] = field(default_factory=dict)  # -D macro -> the problem parameter it takes
    goal: Goal = Goal()
    extra_benchmarks: tuple = ()    # shapes timed after the problem's own (dicts as problem.benchmarks())
    rung: str = ""                  # "" for the stage's own kernel; else a rung of its ladder (see RUNGS)
    uses: tuple[str, ...] = ()      # other stages (keys) it launches at run time, e.g. through stages.ops:
                                    # their sources count in its results' digest (grader/results.py)
    constants: dict[str, str] = field(default_factory=dict)  # -D macros every build of it gets
    # The kernel's constants the launch relies on, for a variant's -D macros: {"BLOCK_M": 128, ...};
    # a key is a constant expression of the kernel (a name, or e.g. "SHARED_BYTES<true>").
    geometry: Callable[[dict[str, str]], dict[str, int]] = lambda defines: {}

    @property
    def key(self) -> str:
        """Its name in reports and results: the folder, then ":rung" for a rung ("stage6_grouped_gemm:simt")."""
        return f"{self.name}:{self.rung}" if self.rung else self.name

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
        title = doc.strip().splitlines()[0]
        return f"{title} ({self.rung} rung)" if self.rung else title

    def variants(self, problem) -> list[dict]:
        """Every variant of the problem to compile for: its dtypes × the values of the parameters the
        stage specializes on (reference.problem.Problem.variant says which one given inputs need)."""
        taken = list(self.specializations.values())
        return [{"dtype": dtype, **dict(zip(taken, values))} for dtype in problem.dtypes
                for values in itertools.product(*(problem.parameters[name] for name in taken))]

    def defines(self, variant: dict) -> dict[str, str]:
        """The -D macros of a variant: ELEM_T for the dtype, then each specialization's parameter."""
        return {"ELEM_T": ELEM_TYPES[variant["dtype"]],
                **{macro: str(variant[name]) for macro, name in self.specializations.items()}, **self.constants}


def variant_key(defines: dict[str, str]) -> str:
    """The name of one compiled variant, e.g. "ELEM_T=__half,HEAD_DIM=64" (the results' keys too)."""
    return ",".join(f"{k}={v}" for k, v in sorted(defines.items()))


def arch_for(gpu, stage_archs: tuple[str, ...]) -> str:
    """The architecture to compile a stage for on this GPU, or ValueError saying why it can't run here.
    `gpu` is anything with a name, major and minor: the grader's GpuInfo, torch.cuda.get_device_properties().

    A stage whose every arch ends in "a" (sm_90a: wgmma, setmaxnreg) runs on exactly that GPU
    generation; other stages run on their lowest arch and anything newer.
    """
    own = f"sm_{gpu.major}{gpu.minor}"
    if f"{own}a" in stage_archs:
        return f"{own}a"
    if own in stage_archs:
        return own
    numbers = [int(a[3:].rstrip("a")) for a in stage_archs]
    if all(a.endswith("a") for a in stage_archs) or gpu.major * 10 + gpu.minor < min(numbers):
        needs = " or ".join(stage_archs) if all(a.endswith("a") for a in stage_archs) else f"{min(stage_archs)} or newer"
        raise ValueError(f"this stage needs {needs}; this GPU ({gpu.name}) is {own}")
    return own


def stage_names() -> list[str]:
    return sorted((p.name for p in STAGES_DIR.glob("stage*_*") if (p / "__init__.py").exists()),
                  key=lambda n: int(re.match(r"stage(\d+)", n).group(1)))


def previous(stage: Stage) -> Stage | None:
    """The step below `stage`: the next lower rung of its ladder (stage 6 -> its mma_sync rung -> its simt
    rung), else the stage before it on the same problem (stage 2 for stage 3); None for the first."""
    ladder = [s.key for s in with_rungs(stage.name)]
    below = ladder[ladder.index(stage.key) + 1:]
    if below:
        return load(below[0])
    earlier = [load(n) for n in stage_names() if int(re.match(r"stage(\d+)", n).group(1)) < stage.number]
    same_problem = [s for s in earlier if s.problem == stage.problem]
    return same_problem[-1] if same_problem else None


def load(name: str) -> Stage:
    """A stage by folder name ("stage0_naive") or by short name ("stage0", "0"); a rung of its ladder
    after a colon ("stage6:mma_sync")."""
    name, _, rung = name.partition(":")
    wanted = name if name.startswith("stage") else f"stage{name}"
    for full in stage_names():
        if full == wanted or full.split("_")[0] == wanted:
            if not rung:
                return importlib.import_module(f"stages.{full}").STAGE
            for lower in rungs(full):
                if lower.rung == rung:
                    return lower
    raise KeyError(f"{name}:{rung}" if rung else name)


def rungs(name: str) -> tuple[Stage, ...]:
    """The lower rungs of a stage's ladder, highest first: the same problem, solved with the techniques of
    earlier stages (stage 6's, which run where the stage's own kernel may not) or with fewer of the stage's
    own ideas (stage 4's, one idea a rung), graded as the stage is. They are the module's RUNGS, or else
    its ladder package's (stages/<name>/ladder/): a stage whose module does not import its ladder keeps
    the rungs' launch code out of its own sources, and so out of its results' digest (grader/results.py)."""
    module = importlib.import_module(f"stages.{name}")
    if hasattr(module, "RUNGS") or not (STAGES_DIR / name / "ladder" / "__init__.py").is_file():
        return getattr(module, "RUNGS", ())
    return importlib.import_module(f"stages.{name}.ladder").RUNGS


def with_rungs(name: str) -> list[Stage]:
    """A stage, then its rungs."""
    return [load(name), *rungs(load(name).name)]


# The stages stages.ops runs for each problem an op serves, the fastest first: a stage's folder, or
# "folder:rung" for a rung of its ladder (stage 7's mma_sync rung runs where wgmma is missing).
OPS_STAGES = {
    "attention": ("stage4_hopper", "stage3_pipeline"),
    "attention_backward": ("stage9_hopper_backward", "stage8_backward"),
    "moe_layer": ("stage7_moe_layer", "stage7_moe_layer:mma_sync"),
    "moe_layer_backward": ("stage14_moe_backward",),
    "block_sparse_attention": ("stage12_block_sparse",),
    "block_sparse_attention_backward": ("stage13_block_sparse_backward",),
    "decode_attention": ("stage15_decode",),
}


def ops_stage(problem: str, gpu) -> tuple[Stage, str]:
    """(the stage stages.ops runs for `problem` on `gpu`, the arch to compile it for): the first stage of
    OPS_STAGES[problem] that compiles for the GPU (arch_for). Only a listed stage serves an op, whatever its
    number: a later stage of the same problem (a decode attention, say) serves none until it is listed,
    where it should be preferred. gpu is anything with a name, major and minor
    (torch.cuda.get_device_properties()). Only the listed stages are imported."""
    for key in OPS_STAGES[problem]:
        stage = load(key)
        try:
            return stage, arch_for(gpu, stage.archs)
        except ValueError:
            continue  # needs another GPU: try the next one listed
    raise RuntimeError(f"no course stage solves {problem} on this GPU ({gpu.name}, sm_{gpu.major}{gpu.minor})")
