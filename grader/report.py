"""Print a stage's result, for a terminal or a log: as tables where they fit the width, else as
records (a pipe or a CI log is 80 columns wide, where a table would cut its figures short: `FFM…`)."""
from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from grader.grading import reference_of

console = Console(highlight=False)
INDENT, SEPARATOR = 2, " · "  # of a record's lines (cells hold commas and semicolons of their own)


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


def show(title: str, columns: list[str], rows: list[list[str]], keys: int = 1, right: tuple = ()) -> None:
    """`rows` as a table if it fits the console with no cell wrapped, else as records (_print_records).
    A row with fewer cells than `columns` is its keys and a message (a failure). Cells may hold markup."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left", overflow="fold")
    for row in rows:
        table.add_row(*row)
    unlimited = console.options.update_width(10**6)
    if Measurement.get(console, unlimited, table).maximum <= console.width:
        console.print(table)
    else:
        _print_records(title, columns, rows, keys)


def _print_records(title: str, columns: list[str], rows: list[list[str]], keys: int) -> None:
    """Each row as its first `keys` cells on a line, then `column value` items packed into indented
    lines; an item is split only where it is longer than a line, at a space (a SASS mix)."""
    console.print(Text(title, style="bold"))
    for row in rows:
        head, cells = " ".join(c for c in row[:keys] if c), row[keys:]
        if len(row) == len(columns):
            cells = [f"{column} {cell}" for column, cell in zip(columns[keys:], cells) if cell]
        if head:
            console.print(Text(head, style="bold"))
        for line in _packed(cells, console.width - INDENT):
            for piece in Text.from_markup(line).wrap(console, console.width - INDENT):
                piece.rstrip()
                console.print(Text(" " * INDENT) + piece)


def _packed(items: list[str], width: int) -> list[str]:
    """The items joined by SEPARATOR into lines of at most `width` cells; an item longer than that
    gets a line of its own, which the console wraps at its spaces."""
    lines, current = [], ""
    for item in items:
        joined = f"{current}{SEPARATOR}{item}" if current else item
        if current and Text.from_markup(joined).cell_len > width:
            lines.append(current)
            joined = item
        current = joined
    return lines + [current] if current else lines


def print_resources(result: dict) -> None:
    compiler = f" by NVRTC {result['nvrtc']}" if result.get("nvrtc") else ""
    rows = []
    for variant, kernels in result["resources"].items():
        for name, info in kernels.items():
            spills = f"{info['spill_stores']}/{info['spill_loads']}"
            mix = " ".join(f"{op}:{n}" for op, n in info["sass"].items())
            rows.append([variant_label(variant), name, str(info["registers"]), f"{info['shared_bytes']} B",
                         f"{info['stack_bytes']} B", spills if spills == "0/0" else f"[red]{spills}[/red]", mix])
    show(f"Compiled for {result['arch']}{compiler}: resources per kernel",
         ["variant", "kernel", "regs", "static smem", "stack", "spills st/ld", "SASS (key instructions)"], rows, keys=2)
    if dynamic := result.get("dynamic_shared_bytes"):  # ptxas sees only the static part
        sizes = SEPARATOR.join(f"{variant_label(variant)} {n:,} B" for variant, n in dynamic.items())
        console.print(f"Dynamic shared memory per block, as the launch gives it (SHARED_BYTES): {sizes}")


def print_correctness(correctness: dict) -> None:
    rows = []
    for case in correctness["cases"]:
        if "failure" in case:
            rows.append([case["name"], "", "", "", "", "", "", f"[red]FAIL[/red] {case['failure']}"])
            continue
        for i, check in enumerate(case["checks"]):
            k = check["kernel"]
            ok = check["passed"] and case["inputs_unmodified"]
            note = "" if case["inputs_unmodified"] else " (inputs modified!)"
            rows.append([case["name"] if i == 0 else "", check["output"], _fmt(k["max_abs"], ".2e"),
                         _fmt(k["mean_abs"], ".2e"), _fmt(k["max_rel"], ".2e"), _fmt(check["tolerance"], ".2e"),
                         check["quality"], ("[green]pass[/green]" if ok else "[red]FAIL[/red]") + note])
    stopped = f", {correctness['not_run']} not run (stopped at the first failure)" if "not_run" in correctness else ""
    show(f"Correctness: {correctness['passed']} passed, {correctness['failed']} failed{stopped} "
         f"(seed {correctness['seed']}, {correctness['trials']} trials each, fresh inputs per trial)",
         ["case", "output", "max abs", "mean abs", "max rel", "tolerance", "quality", "result"], rows)


def print_benchmarks(result: dict, gpu_name: str) -> None:
    rows = []
    for bench in result["benchmarks"]:
        if "failure" in bench:
            rows.append([bench["label"], f"[red]{bench['failure']}[/red]"])
            continue
        ref = bench.get("reference")
        occupancy = ", ".join(f"{o['blocks_per_sm']} blk/SM" for o in bench["launches"].values())
        rows.append([bench["label"], _fmt(bench["ms"], ".3f"), _fmt(bench["ms_min"], ".3f"),
                     f"{100 * bench['spread']:.1f}%", _fmt(bench["tflops"], ".1f"), _fmt(bench.get("pct_peak"), ".1f"),
                     _fmt(bench.get("pct_bandwidth"), ".1f"),
                     f"{ref['name']} {ref['ms']:.3f} ms" if ref else "—", _fmt(bench.get("pct_of_reference"), ".1f"),
                     f"{bench['speedup_vs_naive']:.2f}x" if bench.get("speedup_vs_naive") else "—",
                     _mib(bench["extra_memory_bytes"]), occupancy])
    columns = ["shape", "ms", "min", "spread", "TFLOP/s", "% peak", "% BW", "reference", "% of ref",
               "vs naive", "extra memory", "occupancy"]
    show(f"Speed on {gpu_name} (median of side-by-side runs, L2 flushed)", columns, rows, right=tuple(columns[1:]))
    print_baselines(result["benchmarks"])
    print_forward_backward(result["benchmarks"])
    print_previous_stage(result["benchmarks"])
    for bench in result["benchmarks"]:
        for note in bench.get("notes", []):
            console.print(f"[cyan]note[/cyan] {bench['label']}: {note}")
        for flag in bench.get("flags", []):
            console.print(f"[yellow]suspect[/yellow] {bench['label']}: {flag}")


def print_baselines(benchmarks: list[dict]) -> None:
    names = sorted({n for b in benchmarks for n in [*b.get("baselines", {}), *b.get("skipped", {})]})
    rows = []
    for bench in benchmarks:
        if "baselines" in bench:
            cells = []
            for name in names:
                ms = bench["baselines"].get(name)
                why = bench.get("skipped", {}).get(name)
                mem = bench.get("baseline_extra_memory_bytes", {}).get(name)
                cells.append(why or ("—" if ms is None else f"{ms:.3f}; {_mib(mem)}"))
            rows.append([bench["label"], *cells])
    show("Baselines (ms; extra memory)", ["shape", *names], rows, right=tuple(names))


def print_forward_backward(benchmarks: list[dict]) -> None:
    """A backward's stage: the course's forward kernel then this one, against each library's forward +
    backward, timed in the same loop (the rows' "forward_backward", from run.py)."""
    timed = [(bench["label"], bench["forward_backward"]) for bench in benchmarks if bench.get("forward_backward")]
    if not timed:
        return
    names = sorted({n for _, both in timed for n in both["baselines"]})
    rows = []
    for label, both in timed:
        ref = reference_of(both["baselines"])
        cells = [both["skipped"].get(n) or _fmt(both["baselines"].get(n), ".3f") for n in names]
        rows.append([label, f"{both['ms']:.3f}", _fmt(both["tflops"], ".1f"), *cells,
                     f"{ref[1] / both['ms']:.2f}x vs {ref[0]}" if ref else "—"])
    columns = ["shape", "ours", "TFLOP/s", *names, "speed-up"]
    show(f"Forward + backward (ms): {timed[0][1]['stage']}, then this kernel, beside each library's",
         columns, rows, right=tuple(columns[1:]))


def print_previous_stage(benchmarks: list[dict]) -> None:
    """What this stage's idea bought: the step below it (the previous stage, or the next lower rung of its
    ladder), timed in the same loop."""
    steps = [(bench["label"], bench["ms"], bench["previous_stage"]) for bench in benchmarks if bench.get("previous_stage")]
    if not steps:
        return
    before = steps[0][2]["stage"]
    rows = [[label, f"{step['ms']:.3f}", f"{ms:.3f}", f"{step['speedup']:.2f}x"] for label, ms, step in steps]
    show(f"What this stage bought over {before} (its kernel timed in the same loop; ms)",
         ["shape", before, "this kernel", "speed-up"], rows, right=(before, "this kernel", "speed-up"))


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
    if len(result["title"]) + 6 <= console.width:
        console.rule(f"[bold]{result['title']}")
    else:  # a rule would cut the title short
        console.print(Text(result["title"], style="bold"))
    console.print(f"Graded file: [bold]{result['kernel_path']}[/bold]  (sha256 {result['source_sha256'][:12]}…)")
    if result.get("rung"):
        console.print(f"A lower rung of the stage's ladder ({result['rung']}): the problem with fewer of the stage's "
                      f"ideas, or with an earlier stage's technique where the stage's own instructions do not run; "
                      f"here compiled for {result['arch']}.", soft_wrap=True)
    print_resources(result)
    if "correctness" in result:
        print_correctness(result["correctness"])
    if result.get("benchmarks"):
        print_benchmarks(result, gpu_name)
    elif "correctness" in result and result["correctness"]["failed"]:
        console.print("[red]Correctness failed: no timing (a fast wrong answer is not a result).[/red]")
    print_grade(result)
