"""python -m grader <stage> | all | list | init <stage>   (python -m grader --help)"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

USAGE = """python -m grader STAGE [options]     grade a stage (e.g. stage0, stage3, 3)
       python -m grader all [options]       grade every stage (instructors: --json results/<gpu>.json)
       python -m grader list                the stages, the architectures each needs, their last recorded grade
       python -m grader init STAGE          write an exercise copy to workspace/ (graded from then on)"""


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m grader", usage=USAGE,
                                description="Compile, check, time and grade the course's CUDA kernels.")
    p.add_argument("command", help="a stage, all, list or init")
    p.add_argument("stage", nargs="?", help="the stage, after init")
    p.add_argument("--kernel", type=Path, help="grade this .cu file instead of the stage's own or your workspace copy")
    p.add_argument("--solution", action="store_true", help="grade the course's kernel even if you have a workspace copy")
    p.add_argument("--arch", help="compile only, for this architecture (e.g. sm_90a); needs no GPU")
    p.add_argument("--seed", type=int, default=0, help="base seed of the correctness cases (default 0, the public seeds)")
    p.add_argument("--trials", type=int, default=2, help="fresh random inputs per case (default 2)")
    p.add_argument("--no-bench", action="store_true", help="check correctness only")
    p.add_argument("--cases", metavar="REGEX", help="only the correctness cases whose name matches (no benchmarks)")
    p.add_argument("--budget", type=float, default=4.0, help="seconds of timing per benchmark shape (default 4)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds without progress before a kernel counts as hung")
    p.add_argument("--json", type=Path, help="write the results here (updates the stages it holds)")
    p.add_argument("--force", action="store_true", help="init: overwrite your workspace copy")
    return p.parse_args(argv)


def fail(message: str) -> int:
    from grader.report import console
    console.print(f"[red]error:[/red] {message}", soft_wrap=True)
    return 2


def cmd_list() -> int:
    import stages
    from grader import results
    from grader.report import console
    from rich.table import Table

    recorded = results.load_all()
    table = Table(title="Stages")
    for column in ("stage", "title", "architectures", *[f"grade on {gpu}" for gpu in recorded]):
        table.add_column(column)
    for name in stages.stage_names():
        stage = stages.load(name)
        grades = []
        for data in recorded.values():
            entry = data["stages"].get(name)
            fresh = entry and entry.get("source_sha256") == results.source_digest(stage)
            grades.append("—" if not entry else f"{entry.get('grade', '?')}" + ("" if fresh else " (stale: kernel changed)"))
        table.add_row(name, stage.title, ", ".join(stage.archs), *grades)
    console.print(table)
    return 0


def cmd_init(name: str | None, force: bool) -> int:
    import stages
    from grader import exercise
    from grader.report import console

    if not name:
        return fail("init needs a stage, e.g. python -m grader init stage1")
    try:
        stage = stages.load(name)
        path = exercise.init(stage, force)
    except KeyError:
        return fail(f"unknown stage {name!r}; python -m grader list shows them")
    except (FileExistsError, exercise.MarkerError) as error:
        return fail(str(error))
    console.print(f"Wrote {exercise.shown(path)}: fill in the TODO(exercise) blocks, then run "
                  f"[bold]python -m grader {stage.name.split('_')[0]}[/bold] (it grades your copy; --solution grades ours).")
    return 0


def kernel_path_for(stage, args) -> Path:
    from grader import exercise

    if args.kernel:
        if not args.kernel.is_file():
            raise FileNotFoundError(f"no such kernel file: {args.kernel}")
        return args.kernel.resolve()
    mine = exercise.workspace_path(stage)
    if mine.exists() and not args.solution:
        return mine
    return stage.source_path


def grade(names: list[str], args) -> int:
    import stages
    from grader import device, report, results
    from grader.compiler import CompileError
    from grader.run import GraderError, grade_stage

    console = report.console
    try:
        chosen = [stages.load(n) for n in names]
    except KeyError as error:
        return fail(f"unknown stage {error.args[0]!r}; python -m grader list shows them")
    gpu, why = (None, "--arch asks to compile only") if args.arch else device.probe()
    if gpu is None and not args.arch:
        console.print(f"[yellow]No GPU ({why}): compiling only.[/yellow] Results need an NVIDIA GPU (sm_80 or newer).")
    elif gpu:
        console.print(f"GPU: {gpu.name} ({gpu.arch}, {gpu.sms} SMs, driver CUDA {gpu.driver})")

    all_results, status = {}, 0
    for stage in chosen:
        try:
            kernel_path = kernel_path_for(stage, args)
            arch = args.arch or (device.arch_for(gpu, stage.archs) if gpu else max(stage.archs))
            started = time.perf_counter()
            with console.status(f"{stage.name}: compiling") as status_line:
                def progress(what, done, total, label, ok):
                    status_line.update(f"{stage.name}: {what} {done}/{total} {label}")
                    if what == "case" and not ok:
                        console.print(f"  [red]FAIL[/red] {label}")

                result = grade_stage(stage, kernel_path, gpu, arch, seed=args.seed, trials=args.trials,
                                     timeout_s=args.timeout, budget_s=args.budget, bench=not args.no_bench,
                                     only=args.cases, progress=progress)
        except (GraderError, FileNotFoundError, ValueError) as error:
            status = fail(f"{stage.name}: {error}")
            continue
        except CompileError as error:
            console.print(f"[red]{stage.name}: compile error for {error.arch}[/red]")
            console.print(error.log, markup=False)
            status = 1
            continue
        report.print_stage(result, gpu.name if gpu else None)
        console.print(f"({time.perf_counter() - started:.0f} s)")
        if result.get("correctness", {}).get("failed"):
            status = 1
        result["measured"] = results.provenance(gpu) if gpu else None
        all_results[stage.name] = result

    if args.json and all_results:
        if gpu is None:
            console.print("[yellow]No GPU: nothing measured, so no results file written.[/yellow]")
        else:
            latest = list(all_results.values())[-1]["measured"]  # the file's provenance: its newest stage's
            results.write(args.json, gpu.name, latest, all_results)
            console.print(f"Results written to {args.json}")
    return status


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.command == "list":
        return cmd_list()
    if args.command == "init":
        return cmd_init(args.stage, args.force)
    if args.command == "all":
        import stages
        return grade(stages.stage_names(), args)
    return grade([args.command], args)


if __name__ == "__main__":
    sys.exit(main())
