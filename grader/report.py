"""Print a stage's result as tables (rich), for a terminal or a log."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

console = Console(highlight=False)


def _fmt(value, spec=".3g", missing="—"):
    return missing if value is None else format(value, spec)


def _mib(n):
    return "—" if n is None else ("0" if n == 0 else f"{n / 2**20:,.0f} MiB")


def variant_label(key: str) -> str:
    """"ELEM_T=__half,HEAD_DIM=64" -> "fp16 D64"."""
    names = {"__half": "fp16", "__nv_bfloat16": "bf16"}
    parts = dict(item.split("=", 1) for item in key.split(","))
    return " ".join([names.get(parts.pop("ELEM_T", ""), "")] + [("D" if k == "HEAD_DIM" else f"{k}=") + v
                                                               for k, v in parts.items()]).strip()


def print_resources(result: dict) -> None:
    table = Table(title=f"Compiled for {result['arch']}: resources per kernel", title_justify="left")
    for column in ("variant", "kernel", "regs", "smem", "stack", "spills st/ld", "SASS: key instructions (count)"):
        table.add_column(column, no_wrap=column != "SASS: key instructions (count)")
    for variant, kernels in result["resources"].items():
        for name, info in kernels.items():
            spills = f"{info['spill_stores']}/{info['spill_loads']}"
            mix = " ".join(f"{op}:{n}" for op, n in info["sass"].items())
            table.add_row(variant_label(variant), name, str(info["registers"]), f"{info['shared_bytes']} B",
                          f"{info['stack_bytes']} B", spills if spills == "0/0" else f"[red]{spills}[/red]", mix)
    console.print(table)


def print_correctness(correctness: dict) -> None:
    table = Table(title=f"Correctness: {correctness['passed']} passed, {correctness['failed']} failed "
                        f"(seed {correctness['seed']}, {correctness['trials']} trials each, fresh inputs per trial)",
                  title_justify="left")
    for column in ("case", "output", "max abs", "mean abs", "max rel", "tolerance", "quality", "result"):
        table.add_column(column)
    for case in correctness["cases"]:
        if "failure" in case:
            table.add_row(case["name"], "", "", "", "", "", "", f"[red]FAIL[/red] {case['failure']}")
            continue
        for i, check in enumerate(case["checks"]):
            k = check["kernel"]
            ok = check["passed"] and case["inputs_unmodified"]
            note = "" if case["inputs_unmodified"] else " (inputs modified!)"
            table.add_row(case["name"] if i == 0 else "", check["output"], _fmt(k["max_abs"], ".2e"),
                          _fmt(k["mean_abs"], ".2e"), _fmt(k["max_rel"], ".2e"), _fmt(check["tolerance"], ".2e"),
                          check["quality"], ("[green]pass[/green]" if ok else "[red]FAIL[/red]") + note)
    console.print(table)


def print_benchmarks(result: dict, gpu_name: str) -> None:
    table = Table(title=f"Speed on {gpu_name} (median of side-by-side runs, L2 flushed)", title_justify="left")
    for column in ("shape", "ms", "min", "spread", "TFLOP/s", "% peak", "% BW", "reference", "% of ref",
                   "vs naive", "extra memory", "occupancy"):
        table.add_column(column, justify="right" if column != "shape" else "left")
    for bench in result["benchmarks"]:
        if "failure" in bench:
            table.add_row(bench["label"], f"[red]{bench['failure']}[/red]")
            continue
        ref = bench.get("reference")
        occupancy = ", ".join(f"{o['blocks_per_sm']} blk/SM" for o in bench["launches"].values())
        table.add_row(bench["label"], _fmt(bench["ms"], ".3f"), _fmt(bench["ms_min"], ".3f"),
                      f"{100 * bench['spread']:.1f}%", _fmt(bench["tflops"], ".1f"), _fmt(bench.get("pct_peak"), ".1f"),
                      _fmt(bench.get("pct_bandwidth"), ".1f"),
                      f"{ref['name']} {ref['ms']:.3f} ms" if ref else "—", _fmt(bench.get("pct_of_reference"), ".1f"),
                      f"{bench['speedup_vs_naive']:.2f}x" if bench.get("speedup_vs_naive") else "—",
                      _mib(bench["extra_memory_bytes"]), occupancy)
    console.print(table)
    baselines = Table(title="Baselines (ms; extra memory)", title_justify="left")
    names = sorted({n for b in result["benchmarks"] for n in [*b.get("baselines", {}), *b.get("skipped", {})]})
    baselines.add_column("shape")
    for name in names:
        baselines.add_column(name, justify="right")
    for bench in result["benchmarks"]:
        if "baselines" in bench:
            cells = []
            for name in names:
                ms = bench["baselines"].get(name)
                why = bench.get("skipped", {}).get(name)
                mem = bench.get("baseline_extra_memory_bytes", {}).get(name)
                cells.append(why or ("—" if ms is None else f"{ms:.3f}; {_mib(mem)}"))
            baselines.add_row(bench["label"], *cells)
    console.print(baselines)
    for bench in result["benchmarks"]:
        for note in bench.get("notes", []):
            console.print(f"[cyan]note[/cyan] {bench['label']}: {note}")
        for flag in bench.get("flags", []):
            console.print(f"[yellow]suspect[/yellow] {bench['label']}: {flag}")


def print_grade(result: dict) -> None:
    if "score" not in result:
        return
    goal = result["goal"]
    console.print(f"[bold]Grade {result['grade']}[/bold]: {100 * result['score']:.0f}% of the goal "
                  f"({goal['text']}). Bands: {result['rule']}.")
    refs = [b["pct_of_reference"] for b in result["benchmarks"] if b.get("pct_of_reference")]
    if refs:
        from grader.grading import geomean
        console.print(f"Against the fastest library baseline (the reference): {geomean(refs):.1f}% (geometric mean).")


def print_stage(result: dict, gpu_name: str | None) -> None:
    console.rule(f"[bold]{result['title']}")
    console.print(f"Graded file: [bold]{result['kernel_path']}[/bold]  (sha256 {result['source_sha256'][:12]}…)")
    print_resources(result)
    if "correctness" in result:
        print_correctness(result["correctness"])
    if result.get("benchmarks"):
        print_benchmarks(result, gpu_name)
    elif "correctness" in result and result["correctness"]["failed"]:
        console.print("[red]Correctness failed: no timing (a fast wrong answer is not a result).[/red]")
    print_grade(result)
