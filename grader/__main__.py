"""python -m grader <stage>... | all | list | init <stage>... | ops | rekey <results file>...   (python -m grader --help)"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

USAGE = """python -m grader STAGE [STAGE ...] [options]   grade stages in turn (e.g. stage0, stage3, 3, stage6:mma_sync)
       python -m grader all [options]       grade every stage and rung this GPU runs (instructors: --json results/<gpu>.json)
       python -m grader list                the stages, the architectures each needs, their last recorded grade
       python -m grader init STAGE [STAGE ...]  write exercise copies to workspace/ (graded from then on)
       python -m grader ops [--json FILE]   the ops (stages/ops/) as a model calls them, beside PyTorch's
       python -m grader STAGE --profile [SHAPE]  Nsight Compute, beside the reference, on one benchmark shape
       python -m grader rekey FILE [FILE ...]   give a results file's current entries their runs digest (no GPU)"""

ENVIRONMENT = """environment:
  FLASHMOE_WORKSPACE   where init writes exercise copies and grading finds them (default: workspace/)
  FLASHMOE_CACHE       where compiled kernels are kept (default: ~/.cache/flashmoe-course)
  FLASHMOE_NO_GPU=1    compile only, as on a machine without a GPU"""

ARCH = re.compile(r"sm_(\d+)(a?)")  # sm_80, sm_90a: a GPU generation, "a" for its arch-specific features
LOWEST_ARCH = 80                    # the course's kernels use cp.async, ldmatrix and bf16 mma.sync
# options that only a GPU run uses
GPU_ONLY = ("cases", "first_failure", "shapes", "no_bench", "json", "seed", "trials", "budget", "timeout", "profile",
            "beside")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """argparse's own prints the whole usage before the error; here one line, as every other error."""
        sys.exit(fail(f"{message} (python -m grader --help lists the options)"))


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m grader", usage=USAGE, epilog=ENVIRONMENT,
               formatter_class=argparse.RawDescriptionHelpFormatter,
               description="Compile, check, time and grade the course's CUDA kernels.")
    p.add_argument("command", nargs="?", help="a stage, all, list, init, ops or rekey (none: this usage and the stages)")
    p.add_argument("stages", nargs="*", metavar="STAGE", help="more stages to grade; after init, the stages to copy; "
                   "after rekey, the results files")
    p.add_argument("--kernel", type=Path, help="grade this .cu file instead of the stage's own or your workspace copy")
    p.add_argument("--solution", action="store_true", help="grade the course's kernel even if you have a workspace copy")
    p.add_argument("--arch", help="compile only, for this architecture (e.g. sm_90a); needs no GPU")
    p.add_argument("--seed", type=int, default=0, help="base seed of the correctness cases (default 0, the public seeds)")
    p.add_argument("--trials", type=int, default=2, help="fresh random inputs per case (default 2)")
    p.add_argument("--no-bench", action="store_true", help="check correctness only")
    p.add_argument("--cases", metavar="REGEX", help="only the correctness cases whose name matches (no benchmarks)")
    p.add_argument("-x", "--first-failure", action="store_true",
                   help="stop the correctness cases at the first that fails (quick feedback while you work)")
    p.add_argument("--shapes", metavar="REGEX", help="time only the benchmark shapes whose label matches; with "
                   "--json, merged into the shapes recorded for the same source")
    p.add_argument("--budget", type=float, default=4.0, help="seconds of timing per benchmark shape (default 4)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before a kernel counts as hung")
    p.add_argument("--json", type=Path, help="write the results here (updates the stages it holds)")
    p.add_argument("--force", action="store_true", help="init: overwrite your workspace copy")
    p.add_argument("--profile", nargs="?", const="0", metavar="SHAPE",
                   help="profile the kernel beside the fastest library baseline with Nsight Compute (ncu) on one "
                        "benchmark shape: its index (default 0) or a regular expression matching its label; "
                        "no correctness cases or timings")
    p.add_argument("--beside", metavar="BASELINE",
                   help="with --profile: profile beside this library baseline (e.g. flash) instead of the fastest")
    return p


def fail(message: str) -> int:
    from rich.text import Text
    from grader.report import console

    console.print(Text("error: ", style="red") + Text(message), soft_wrap=True)  # no markup: messages hold [ ]
    return 2


def option_problem(args) -> str | None:
    """What is wrong with the options whatever the stage, said in one line before any work; None if nothing."""
    for variable in ("FLASHMOE_WORKSPACE", "FLASHMOE_CACHE"):  # folders the grader writes into
        if problem := folder_problem(variable):
            return problem
    if args.json is not None and not args.json.parent.is_dir():
        return f"--json {args.json}: no folder {args.json.parent} to write it in"
    if args.arch:
        match = ARCH.fullmatch(args.arch)
        if not match:
            return f"--arch {args.arch}: not an architecture; write sm_NN or sm_NNa (e.g. sm_80, sm_90a)"
        if int(match[1]) < LOWEST_ARCH:
            return f"--arch {args.arch}: the course's kernels need sm_{LOWEST_ARCH} or newer"
    if args.profile is not None:
        from grader.profile import shape_problem
        if problem := shape_problem(args.profile):
            return problem
        if args.cases is not None or args.no_bench:
            return "--profile runs no correctness cases and no timings: leave out --cases and --no-bench"
    elif args.beside is not None:
        return "--beside names the baseline a profile is taken beside: give it with --profile"
    if args.cases is not None and args.shapes is not None:
        return "--cases checks some cases and times nothing, --shapes times some shapes: give one of them"
    for option, value in (("--cases", args.cases), ("--shapes", args.shapes)):
        if value is None:
            continue
        try:
            re.compile(value)
        except re.error as error:
            return f"{option} {value!r} is not a regular expression: {error}"
    return None


def folder_problem(variable: str) -> str | None:
    """Why the folder an environment variable names cannot be written into, or None: a file there or on
    the way there, or a folder that is not writable. The folder itself may not exist yet: it is made."""
    folder = os.environ.get(variable)
    if not folder:
        return None
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())  # the root, at least
    if not existing.is_dir():
        where = "" if existing == path else f": {existing} is a file"
        return f"{variable}={folder}: not a folder{where} (it names where the grader keeps its files)"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{variable}={folder}: {existing} is not writable (it names where the grader keeps its files)"
    return None


def arch_problem(stage, arch: str) -> str | None:
    """Why `stage` cannot be compiled for `arch`, or None. The rule of stages.arch_for: a stage
    with a plain arch compiles for its lowest arch and any newer plain one; an "a" arch (sm_90a:
    wgmma, setmaxnreg) only where the stage lists it, for exactly that generation."""
    if arch in stage.archs:
        return None
    number, arch_specific = ARCH.fullmatch(arch).groups()
    lowest = min(int(ARCH.fullmatch(a)[1]) for a in stage.archs)
    any_plain = not all(a.endswith("a") for a in stage.archs)
    if any_plain and not arch_specific and int(number) >= lowest:
        return None
    allowed = ", ".join(stage.archs) + (" or a newer sm_NN" if any_plain else " only")
    return f"{stage.key} compiles for {allowed}, not {arch}"


def unused_gpu_options(args) -> list[str]:
    """The GPU-only options given (not left at their defaults), as typed: ["--cases", "--json"]."""
    defaults = parser()
    return [f"--{name.replace('_', '-')}" for name in GPU_ONLY if getattr(args, name) != defaults.get_default(name)]


def say_compile_only(args, no_gpu_why: str) -> None:
    """One line: this run compiles only, and which of the options given it does not use."""
    from grader.report import console

    unused = unused_gpu_options(args)
    if args.arch and not unused:
        return  # --arch asked for exactly this
    head = f"--arch {args.arch}: compiling only" if args.arch else f"No GPU ({no_gpu_why}): compiling only"
    tail = f"; not used without a GPU run: {' '.join(unused)}" if unused else \
        f"; results need an NVIDIA GPU (sm_{LOWEST_ARCH} or newer)"
    console.print(f"[yellow]{head}[/yellow]{tail}.", soft_wrap=True)


def cmd_list() -> int:
    from grader import results
    from grader.report import console, show
    from grader.runs_digest import is_current
    from stages.common.compiler import nvrtc_version

    recorded = results.load_all()
    rows = []
    for stage in everything():
        grades = []
        for data in recorded.values():
            entry = data["stages"].get(stage.key)
            grades.append("—" if not entry else f"{entry.get('grade', '?')}" + freshness(entry, stage, is_current))
        rows.append([stage.key, stage.title, ", ".join(stage.archs), *grades])
    show("Stages", ["stage", "title", "architectures", *[f"grade on {gpu}" for gpu in recorded]], rows)
    console.print(f"NVRTC here: {nvrtc_version()}", soft_wrap=True)
    for gpu, data in recorded.items():
        measured = data.get("provenance") or {}
        console.print(f"{gpu}'s results: NVRTC {measured.get('nvrtc', '?')}, torch {measured.get('torch', '?')}",
                      soft_wrap=True)
    return 0


def freshness(entry: dict, stage, is_current) -> str:
    """"" for an entry that holds for the tree; else why not. An entry marked stale is not compiled again to
    find out (a stale entry's machine code is drawn up to three times a variant: seconds each)."""
    if entry.get("stale"):
        return " (stale: marked)"
    return "" if is_current(entry, stage) else " (stale: kernel changed)"


def cmd_init(names: list[str], force: bool) -> int:
    import stages
    from grader import exercise
    from grader.report import console

    if not names:
        return fail("init needs a stage, e.g. python -m grader init stage1")
    status = 0
    for name in names:
        try:
            stage = stages.load(name)
            path = exercise.init(stage, force)
        except KeyError:
            status = fail(f"unknown stage {name!r}; python -m grader list shows them")
            continue
        except (FileExistsError, exercise.MarkerError) as error:
            status = fail(str(error))
            continue
        except OSError as error:  # the workspace cannot be written
            status = fail(f"{stage.key}: cannot write the exercise copy ({error})")
            continue
        console.print(f"Wrote {exercise.shown(path)}: fill in the TODO(exercise) blocks, then run "
                      f"[bold]{interpreter()} -m grader {stage.name.split('_')[0]}[/bold] (it grades your copy; "
                      f"--solution grades ours).", soft_wrap=True)
    return status


def interpreter() -> str:
    """The Python running the grader, as the learner can type it: a bare `python` may be another one (outside
    an activated venv). Relative to the current folder where that is shorter."""
    relative = os.path.relpath(sys.executable)
    if os.sep not in relative:
        relative = os.path.join(os.curdir, relative)  # a bare name would be looked up on PATH
    return min(relative, sys.executable, key=len)


def kernel_path_for(stage, args) -> Path:
    from grader import exercise

    if args.kernel:
        if args.kernel.is_dir():
            raise FileNotFoundError(f"--kernel {args.kernel}: a folder; give the .cu file in it (e.g. "
                                    f"{args.kernel / stage.source})")
        if not args.kernel.is_file():
            raise FileNotFoundError(f"no such kernel file: {args.kernel}")
        return args.kernel.resolve()
    mine = exercise.workspace_path(stage)
    if mine.exists() and not args.solution:
        return mine
    return stage.source_path


def everything() -> list:
    """Every stage, each followed by the lower rungs of its ladder."""
    import stages
    return [stage for name in stages.stage_names() for stage in stages.with_rungs(name)]


def runs_here(stage, gpu, arch: str | None) -> bool:
    import stages

    if arch:
        return arch_problem(stage, arch) is None
    try:
        stages.arch_for(gpu, stage.archs)
        return True
    except ValueError:
        return False


def instead_of(stage, gpu):
    """On a GPU the stage's own kernel cannot run on, the highest rung of its ladder that can (an A100
    grades stage 6 on its mma_sync rung); None where there is none."""
    import stages

    if gpu is None or stage.rung or runs_here(stage, gpu, None):
        return None
    return next((rung for rung in stages.rungs(stage.name) if runs_here(rung, gpu, None)), None)


def grade(names: list[str] | None, args) -> int:
    """Grade the stages named (None: all of them and their rungs, leaving out what this GPU cannot run)."""
    import stages
    from grader import device, report, results

    try:
        chosen = list({stage.key: stage for stage in map(stages.load, names)}.values()) if names else everything()
    except KeyError as error:
        return fail(f"unknown stage {error.args[0]!r}; python -m grader list shows them")
    gpu, why = (None, "") if args.arch else device.probe()
    if gpu is None:
        say_compile_only(args, why)
    else:
        report.console.print(f"GPU: {gpu.name} ({gpu.arch}, {gpu.sms} SMs, driver CUDA {gpu.driver})")
        if args.profile is not None:
            from grader.profile import NOT_FOUND, find_ncu
            if find_ncu() is None:
                return fail(NOT_FOUND)
    if names is None and (gpu or args.arch):
        skipped = [s.key for s in chosen if not runs_here(s, gpu, args.arch)]
        chosen = [s for s in chosen if runs_here(s, gpu, args.arch)]
        if skipped:
            report.console.print(f"Not run on {args.arch or gpu.arch}: {', '.join(skipped)}", soft_wrap=True)

    all_results, status = {}, 0
    for stage in chosen:
        if rung := instead_of(stage, gpu):
            report.console.print(f"{stage.key} needs {', '.join(stage.archs)}: grading its {rung.rung} rung "
                                 f"({rung.key}) on this {gpu.arch} GPU.", soft_wrap=True)
            stage = rung
        result, stage_status = grade_one(stage, args, gpu)
        status = max(status, stage_status)
        if result is not None:
            result["measured"] = results.provenance(gpu) if gpu else None
            all_results[stage.key] = result

    if args.json and all_results and gpu is not None and args.profile is not None:
        for key, result in all_results.items():
            try:
                results.add_profile(args.json, gpu.name, key, dict(result["profile"], measured=result["measured"]))
            except ValueError as error:
                status = fail(str(error))
                continue
            report.console.print(f"Profile of {key} written to {args.json}")
    elif args.json and all_results and gpu is not None:
        latest = list(all_results.values())[-1]["measured"]  # the file's provenance: its newest stage's
        if args.shapes is not None:
            from grader.run import merge_benchmarks
            recorded = results.recorded_entries(args.json, gpu.name)
            all_results = {key: merge_benchmarks(stages.load(key), recorded.get(key), result)
                           for key, result in all_results.items()}
        results.write(args.json, gpu.name, latest, all_results)
        report.console.print(f"Results written to {args.json}")
    return status


def grade_one(stage, args, gpu) -> tuple[dict | None, int]:
    """(the result, or None if there is none, and the exit status) of one stage, reported as it goes."""
    import stages
    from grader import profile, report
    from grader.profile import ProfileError
    from grader.run import GraderError, grade_stage, profile_stage
    from grader.runs_digest import runs_digest
    from stages.common.compiler import CompileError, nvrtc_version

    console = report.console
    if args.arch and (problem := arch_problem(stage, args.arch)):
        return None, fail(problem)
    profiling = args.profile is not None and gpu is not None
    try:
        kernel_path = kernel_path_for(stage, args)
        arch = args.arch or (stages.arch_for(gpu, stage.archs) if gpu else max(stage.archs))
        started = time.perf_counter()
        with console.status(f"{stage.key}: compiling") as status_line:
            def progress(what, done, total, label, ok):
                line = f"{stage.key}: {what} {done} of {total}: {label}"
                status_line.update(line)
                if what == "case" and not ok:
                    console.print(f"  [red]FAIL[/red] {label}")
                elif what == "shape" and not console.is_terminal:  # a log has no status line: one per step
                    console.print(line, markup=False, soft_wrap=True)

            if profiling:
                result = profile_stage(stage, kernel_path, gpu, arch, args.profile,
                                       profile.csv_path_for(stage.key, args.json),
                                       timeout_s=max(args.timeout, 300.0), progress=progress, beside=args.beside)
            else:
                result = grade_stage(stage, kernel_path, gpu, arch, seed=args.seed, trials=args.trials,
                                     timeout_s=args.timeout, budget_s=args.budget, bench=not args.no_bench,
                                     only=args.cases, shapes=args.shapes, first_failure=args.first_failure,
                                     progress=progress)
    except (GraderError, ProfileError, OSError, ValueError) as error:  # OSError: a file or folder not found or not writable
        return None, fail(f"{stage.key}: {error}")
    except CompileError as error:
        console.print(f"[red]{stage.key}: compile error for {error.arch}[/red]")
        console.print(error.log, markup=False, soft_wrap=True)  # the log's lines as NVRTC wrote them
        return None, 1
    result["nvrtc"] = nvrtc_version()  # what made the registers and SASS the report shows
    if args.json and gpu is not None and not profiling:  # a record: keyed on what runs too
        result["runs_digest"] = {nvrtc_version(): runs_digest(stage, arch, kernel_path)}
    report.print_stage(result, gpu.name if gpu else None)
    if profiling:
        profile.print_profile(result["profile"], stage.key, gpu.name)
    result["seconds"] = round(time.perf_counter() - started, 1)  # its record's: the wall time of its grading
    phases = "".join(f", {phase} {seconds:.0f}" for phase, seconds in result.get("phase_seconds", {}).items())
    console.print(f"({result['seconds']:.0f} s{phases})")
    return result, 1 if result.get("correctness", {}).get("failed") else 0


def cmd_ops(json_path: Path | None) -> int:
    """python -m grader ops: grader/ops_benchmark.py on this GPU, its figures under "ops" of --json."""
    from grader import device, ops_benchmark, results
    from grader.report import console

    gpu, why = device.probe()
    if gpu is None:
        return fail(f"ops needs a GPU ({why})")
    console.print(f"The course's ops as a model calls them, beside PyTorch, on the {gpu.name}:")
    measured = ops_benchmark.run(report=console.print)
    if json_path:
        results.add_ops(json_path, gpu.name, results.provenance(gpu), measured)
        console.print(f"written under \"ops\" in {json_path}")
    return 0


def cmd_rekey(files: list[str]) -> int:
    """python -m grader rekey FILE...: runs_digest.rekey on each file, what it did said per entry."""
    from grader.report import console
    from grader.runs_digest import rekey
    from stages.common.compiler import nvrtc_version

    if not files:
        return fail("rekey needs a results file, e.g. python -m grader rekey results/h100-sxm.json")
    if missing := [name for name in files if not Path(name).is_file()]:
        return fail(f"no such results file: {', '.join(missing)}")
    for name in files:
        console.print(f"{name} (NVRTC {nvrtc_version()} here):", soft_wrap=True)
        for key, done in rekey(Path(name)).items():
            console.print(f"  {key}: {done}", markup=False, soft_wrap=True)
    return 0


def main(argv=None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser().print_usage()
        return cmd_list()
    if args.command in ("list", "all") and args.stages:
        return fail(f"{args.command} takes no stage (got {' '.join(args.stages)})")
    if problem := option_problem(args):
        return fail(problem)
    if args.command == "list":
        return cmd_list()
    if args.command == "init":
        return cmd_init(args.stages, args.force)
    if args.command == "ops":
        return cmd_ops(args.json)
    if args.command == "rekey":
        return cmd_rekey(args.stages)
    if args.command == "all":
        return grade(None, args)
    return grade([args.command, *args.stages], args)


if __name__ == "__main__":
    sys.exit(main())
