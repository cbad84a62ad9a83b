"""Build-time parts of the course site, run by mkdocs (see `hooks:` in mkdocs.yml).

- on_config: the nav's "Stages" section gets one page, docs/stages/stage<N>.md, per directory
  stages/stage<N>_*/, titled with the first line of the stage's __init__.py docstring.
- on_page_markdown: in a page, `<!-- ladder -->` and `<!-- results:<stage directory> -->` become
  charts and tables drawn from results/*.json ($FLASHMOE_RESULTS_DIR overrides the folder), and
  `<!-- stage-list -->` the list of stages (home page only: its links are relative to docs/).

Charts are inline SVG written here: no JavaScript, nothing fetched when the page is read.
"""
from __future__ import annotations

import ast
import html
import json
import math
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGE_DIR = re.compile(r"stage(\d+)_\w+")
PLACEHOLDER = re.compile(r"<!-- (ladder|stage-list|results:(\w+)) -->")
COLORS = ["#3b82f6", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#06b6d4", "#ec4899", "#84cc16",
          "#1e3a8a", "#b45309", "#065f46", "#991b1b", "#5b21b6", "#0e7490", "#9d174d", "#3f6212"]
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
NOT_MEASURED = "Not measured yet"


# ---------------------------------------------------------------- stages and results files

def stage_number(name: str) -> int:
    m = STAGE_DIR.match(name)
    return int(m[1]) if m else 1_000


def stage_dirs(root: Path = ROOT) -> list[tuple[int, str, str, str]]:
    """(number, directory, title, summary) for every stages/stage<N>_*/ directory, in stage order:
    the title is the first line of its __init__.py docstring, the summary the paragraph after it."""
    found = []
    for d in (root / "stages").glob("stage*_*"):
        if d.is_dir() and STAGE_DIR.fullmatch(d.name):
            try:
                doc = ast.get_docstring(ast.parse((d / "__init__.py").read_text())) or d.name
            except (OSError, SyntaxError):
                doc = d.name
            title, _, rest = doc.strip().partition("\n")
            summary = " ".join(rest.strip().split("\n\n")[0].split())
            found.append((stage_number(d.name), d.name, short_title(title), summary))
    return sorted(found)


def short_title(title: str) -> str:
    """"Stage 0 — naive attention: scores in global memory" -> "Stage 0 — naive attention"."""
    return title.split(": ")[0]


def load_runs() -> list[dict]:
    """Every results/*.json, the H100 first: one "run" per GPU."""
    folder = Path(os.environ.get("FLASHMOE_RESULTS_DIR") or ROOT / "results")
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    return sorted(runs, key=lambda run: "H100" not in str(run.get("gpu")))


# ---------------------------------------------------------------- mkdocs events

def on_config(config):
    pages = [{title: f"stages/stage{n}.md"} for n, _, title, _ in stage_dirs()]
    for entry in config.nav or []:
        if isinstance(entry, dict) and "Stages" in entry:
            entry["Stages"] = pages
    return config


def on_page_markdown(markdown, page, config, files):
    if not PLACEHOLDER.search(markdown):
        return markdown
    runs = load_runs()

    def fill(m):
        if m[1] == "stage-list":  # links are relative to the page: the home page, docs/index.md
            return "\n".join(f"- [**{title}**](stages/stage{n}.md). {summary}" for n, _, title, summary in stage_dirs())
        return ladder_md(runs) if m[1] == "ladder" else results_md(m[2], runs)

    return PLACEHOLDER.sub(fill, markdown)


# ---------------------------------------------------------------- formatting

def num(value, fmt: str = ".2f", unit: str = "") -> str:
    return "—" if value is None else f"{value:{fmt}}{unit}"


def shape_label(bench: dict) -> str:
    """{"B": 16, "S": 2048, "causal": False} and dtype "float16" -> "B16 S2048 non-causal fp16"."""
    shape = dict(bench.get("shape") or {})
    dtype = bench.get("dtype") or shape.get("dtype")
    shape.pop("dtype", None)
    parts = [(k if v else f"non-{k}") if isinstance(v, bool) else f"{k}{v}" for k, v in shape.items()]
    return " ".join(parts + ([DTYPES.get(dtype, dtype)] if dtype else []))


def mib(nbytes) -> str:
    return "—" if nbytes is None else "0" if nbytes == 0 else f"{nbytes / 2**20:,.1f} MiB"


def ordered_stages(run: dict) -> list[tuple[str, dict]]:
    return sorted(run.get("stages", {}).items(), key=lambda kv: (stage_number(kv[0]), kv[0]))


def speed_at(bench: dict, baseline: str):
    """TFLOP/s of a baseline on the same shape: same FLOPs, its own time."""
    ms = (bench.get("baselines") or {}).get(baseline)
    return bench["tflops"] * bench["ms"] / ms if ms and bench.get("tflops") and bench.get("ms") else None


def figure(svg: str, caption: str) -> str:
    # A raw HTML block for Python-Markdown: no blank line inside, blank lines around.
    return f'\n\n<figure class="fm-figure">\n{svg}\n<figcaption>{caption}</figcaption>\n</figure>\n\n'


def swatch(color: str, text: str, cls: str = "fm-swatch") -> str:
    return f'<span class="fm-key"><span class="{cls}" style="--c:{color}"></span>{html.escape(text)}</span>'


def provenance(p: dict) -> str:
    """What the numbers were measured with, in one line."""
    bits = [text.format(p[key]) for key, text in (("sm_clock_mhz", "SM clock {} MHz"), ("driver", "driver {}"),
            ("driver_cuda", "driver CUDA {}"), ("cuda", "CUDA {}"), ("nvrtc", "NVRTC {}"), ("torch", "torch {}"),
            ("cuda_core", "cuda.core {}")) if p.get(key)]
    if p.get("commit"):
        bits.append(f"commit `{str(p['commit'])[:10]}`" + (" (with local changes)" if p.get("dirty") else ""))
    if p.get("date"):
        bits.append(f"on {p['date']}")
    return ", ".join(bits)


# ---------------------------------------------------------------- the ladder (home page)

def ladder_md(runs: list[dict]) -> str:
    if not any(run.get("stages") for run in runs):
        return (f'\n\n!!! note "{NOT_MEASURED}"\n    No stage has recorded results in `results/*.json`: '
                "not measured yet.\n\n")
    out = []
    for run in runs:
        if not run.get("stages"):
            continue
        out.append(f"### On the {run.get('gpu', 'unknown GPU')}\n\n" + ladder_figure(run))
        rows = ["| Stage | Grade | Score: % of the goal | Goal | % of the reference | Correct cases |",
                "|---|---|--:|---|--:|--:|"]
        for key, st in ordered_stages(run):
            pct = [b["pct_of_reference"] for b in st.get("benchmarks", []) if b.get("pct_of_reference")]
            geo = math.exp(sum(map(math.log, pct)) / len(pct)) if pct else None
            c = st.get("correctness") or {}
            rows.append(f"| {short_title(st.get('title', key))} | **{st.get('grade', '—')}** | {num(100 * st['score'] if st.get('score') is not None else None, '.0f', ' %')} "
                        f"| {(st.get('goal') or {}).get('text', '—')} | {num(geo, '.1f', ' %')} "
                        f"| {c.get('passed', '—')} / {(c.get('passed') or 0) + (c.get('failed') or 0)} |")
        out.append("\n".join(rows) + f"\n\n<small>Measured with {provenance(run.get('provenance') or {}) or 'no provenance recorded'}. "
                   "Both percentages are geometric means over the benchmark shapes.</small>\n\n")
    return "\n\n" + "\n\n".join(out)


def ladder_figure(run: dict) -> str:
    """Grouped bars: one group per stage, one bar per benchmark shape, TFLOP/s on a log scale."""
    stages = [(key, st) for key, st in ordered_stages(run) if st.get("benchmarks")]
    labels = list(dict.fromkeys(label(b) for _, st in stages for b in st["benchmarks"]))
    color = {text: COLORS[i % len(COLORS)] for i, text in enumerate(labels)}
    values = [v for _, st in stages for b in st["benchmarks"]
              for v in (b.get("tflops"), (b.get("reference") or {}).get("tflops"), speed_at(b, "flash")) if v]
    if not values:
        return "<p>No TFLOP/s recorded.</p>"
    W, H, left, right, top, bottom = 760, 340, 58, 10, 14, 48
    lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    hi += hi == lo
    y = lambda v: top + (hi - math.log10(v)) / (hi - lo) * (H - top - bottom)
    body = [f'<text class="fm-axis" x="14" y="{(top + H - bottom) / 2}" transform="rotate(-90 14 {(top + H - bottom) / 2})" '
            'text-anchor="middle">TFLOP/s (log scale)</text>']
    for k in range(lo, hi + 1):
        body.append(f'<line class="fm-grid" x1="{left}" x2="{W - right}" y1="{y(10**k):.1f}" y2="{y(10**k):.1f}"/>'
                    f'<text class="fm-axis" x="{left - 6}" y="{y(10**k) + 4:.1f}" text-anchor="end">{10**k:g}</text>')
    group = (W - left - right) / len(stages)
    for g, (key, st) in enumerate(stages):
        benches = st["benchmarks"]
        bar = min(26.0, group * 0.8 / len(benches))
        x0 = left + g * group + (group - bar * len(benches)) / 2
        for i, b in enumerate(benches):
            x, text = x0 + i * bar, label(b)
            ref = b.get("reference") or {}
            tip = (f"{short_title(st.get('title', key))}, {text}: {num(b.get('tflops'), '.1f')} TFLOP/s; "
                   f"reference ({ref.get('name', '—')}) {num(ref.get('tflops'), '.1f')} TFLOP/s")
            if b.get("tflops"):
                body.append(f'<rect x="{x:.1f}" y="{y(b["tflops"]):.1f}" width="{bar - 2:.1f}" '
                            f'height="{H - bottom - y(b["tflops"]):.1f}" fill="{color[text]}"><title>{html.escape(tip)}</title></rect>')
            for value, cls in ((ref.get("tflops"), "fm-ref"), (speed_at(b, "flash"), "fm-flash")):
                if value:
                    body.append(f'<line class="{cls}" x1="{x - 1:.1f}" x2="{x + bar - 1:.1f}" y1="{y(value):.1f}" y2="{y(value):.1f}"/>')
        cx, name = left + (g + 0.5) * group, st.get("title", key).split(" — ")[0]
        body.append(f'<text class="fm-label" x="{cx:.1f}" y="{H - bottom + 16}" text-anchor="middle">{html.escape(name)}</text>'
                    f'<text class="fm-axis" x="{cx:.1f}" y="{H - bottom + 32}" text-anchor="middle">grade {st.get("grade", "—")}</text>')
    svg = (f'<svg class="fm-chart fm-ladder" viewBox="0 0 {W} {H}" role="img" xmlns="http://www.w3.org/2000/svg" '
           f'aria-label="TFLOP/s of each stage at each benchmark shape">{"".join(body)}</svg>')
    keys = [swatch(color[text], text) for text in labels]
    keys += [swatch("", "the reference: the fastest library baseline", "fm-swatch fm-ref-key"),
             swatch("", "SDPA flash backend", "fm-swatch fm-flash-key")]
    return figure(svg, " ".join(keys))


# ---------------------------------------------------------------- one stage's results

def results_md(key: str, runs: list[dict]) -> str:
    measured = [run for run in runs if key in run.get("stages", {})]
    if not measured:
        return (f'\n\n!!! note "{NOT_MEASURED}"\n    `results/*.json` has no entry for `{key}`: not measured yet. '
                "Grade the stage on your own GPU to see its numbers (`python -m grader "
                f"stage{stage_number(key)} --solution`).\n\n")
    return "".join(stage_run_md(run, run["stages"][key]) for run in measured)


def stage_run_md(run: dict, st: dict) -> str:
    c, goal = st.get("correctness") or {}, st.get("goal") or {}
    benches = st.get("benchmarks") or []
    score = f"{100 * st['score']:.0f} % of the goal" if st.get("score") is not None else "no score"
    out = [f"\n\n### On the {run.get('gpu', 'unknown GPU')}\n",
           f"**Grade {st.get('grade', '—')}**: {score} ({goal.get('text', '—')}). "
           f"Correctness: {c.get('passed', '—')} cases passed, {c.get('failed', '—')} failed. "
           f"Measured with {provenance(st.get('measured') or run.get('provenance') or {}) or 'no provenance recorded'}.\n"]
    out += speed_table(benches)
    names = list(dict.fromkeys(n for b in benches for n in (b.get("baselines") or {})))
    if names:
        out += ["", "Median milliseconds of this kernel and of the baselines, timed in the same loop "
                "(—: not timed, e.g. the backend does not take the shape or would run out of memory):", "",
                "| Shape | This kernel | " + " | ".join(names) + " |", "|---|--:|" + "--:|" * len(names)]
        out += [f"| {label(b)} | {num(b.get('ms'), '.3f')} | " + " | ".join(num((b.get('baselines') or {}).get(n), ".3f")
                for n in names) + " |" for b in benches if "baselines" in b]
    out.append(stage_figure([b for b in benches if "baselines" in b], names))
    out += resources_table(st.get("resources") or {})
    out += cases_details(c)
    return "\n".join(out) + "\n\n"


def label(bench: dict) -> str:
    return bench.get("label") or shape_label(bench)


def speed_table(benches: list[dict]) -> list[str]:
    if not benches:
        return ["No benchmark was timed (the grader times a stage only once every correctness case passes)."]
    out = ["| Shape | Median ms | Min ms | Spread | TFLOP/s | % of peak | % of bandwidth | % of the reference "
           "| Speed-up vs naive | Extra memory |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for b in benches:
        if "failure" in b:
            out.append(f"| {label(b)} | {html.escape(str(b['failure']))} |||||||||")
            continue
        ref = b.get("reference") or {}
        spread = None if b.get("spread") is None else 100 * b["spread"]
        out.append(f"| {label(b)} | {num(b.get('ms'), '.3f')} | {num(b.get('ms_min'), '.3f')} | {num(spread, '.1f', ' %')} "
                   f"| {num(b.get('tflops'), '.1f')} | {num(b.get('pct_peak'), '.1f')} | {num(b.get('pct_bandwidth'), '.1f')} "
                   f"| {num(b.get('pct_of_reference'), '.1f')} ({ref.get('name', '—')}) "
                   f"| {num(b.get('speedup_vs_naive'), '.1f', '×')} | {mib(b.get('extra_memory_bytes'))} |")
    flags = [f"- {label(b)}: {flag}" for b in benches for flag in b.get("flags") or []]
    return out + (["", "The grader flagged:", ""] + flags if flags else [])


def variant_label(key: str) -> str:
    """"ELEM_T=__half,HEAD_DIM=64" -> "fp16 D64", as the grader's report writes it."""
    parts = dict(item.split("=", 1) for item in key.split(",") if "=" in item)
    elem = {"__half": "fp16", "__nv_bfloat16": "bf16"}.get(parts.pop("ELEM_T", ""), "")
    return " ".join([elem] + [("D" if k == "HEAD_DIM" else f"{k}=") + v for k, v in parts.items()]).strip() or key


def resources_table(resources: dict) -> list[str]:
    """{variant: {kernel: info}} (or {kernel: info}) as one table: what ptxas and the SASS say."""
    rows = [(variant_label(v), k, info) for v, kernels in resources.items() if "registers" not in kernels
            for k, info in kernels.items()]
    rows += [("", k, info) for k, info in resources.items() if "registers" in info]
    if not rows:
        return []
    out = ["", "What the compiler made of each kernel:", "",
           "| Variant | Kernel | Registers / thread | Shared memory | Spills (stores / loads) | Key SASS instructions |",
           "|---|---|--:|--:|--:|---|"]
    for variant, kernel, r in rows:
        mix = " ".join(f"`{op}` {n}" for op, n in (r.get("sass") or {}).items())
        out.append(f"| {variant} | `{kernel}` | {r.get('registers', '—')} | {num(r.get('shared_bytes'), ',d', ' B')} "
                   f"| {r.get('spill_stores', '—')} B / {r.get('spill_loads', '—')} B | {mix or '—'} |")
    return out


def cases_details(correctness: dict) -> list[str]:
    """The correctness cases, one row per output, in a collapsed block."""
    cases = correctness.get("cases") or []
    if not cases:
        return []
    rows, quality = [], {}
    for case in cases:
        if "failure" in case:
            rows.append(f"| {case['name']} | | **failed**: {html.escape(str(case['failure']))} ||||||")
            continue
        for i, check in enumerate(case.get("checks") or [case]):
            err = check.get("kernel") or check
            q = check.get("quality") or "—"
            if i == 0:
                quality[q] = quality.get(q, 0) + 1
            ok = check.get("passed") and case.get("inputs_unmodified", True)
            rows.append(f"| {case['name'] if i == 0 else ''} | {check.get('output', '')} | {'pass' if ok else '**fail**'} "
                        f"| {num(err.get('max_abs'), '.2e')} | {num(check.get('tolerance'), '.2e')} "
                        f"| {num(err.get('mean_abs'), '.2e')} | {num(err.get('max_rel'), '.2e')} | {q} |")
    n = len(cases)
    title = f"Correctness: {n} case{'s' * (n != 1)}, seed {correctness.get('seed', '—')} (quality of the first output: " \
            + ", ".join(f"{k} {q}" for q, k in quality.items()) + ")"
    table = ["| Case | Output | Result | Max abs error | Tolerance | Mean abs error | Max rel error | Quality |",
             "|---|---|---|--:|--:|--:|--:|---|"] + rows
    return ["", f'??? info "{title}"', ""] + ["    " + row for row in table]


def stage_figure(benches: list[dict], names: list[str]) -> str:
    """Horizontal bars per shape: this kernel and each baseline in TFLOP/s."""
    series = ["this kernel"] + names
    rows = [(label(b), [b.get("tflops")] + [speed_at(b, n) for n in names]) for b in benches]
    top = max((v for _, vs in rows for v in vs if v), default=None)
    if not top:
        return ""
    W, left, right, bar, gap = 760, 260, 56, 9, 12
    H = 8 + len(rows) * (len(series) * bar + gap)
    scale = (W - left - right) / top
    body, y = [], 8
    for text, values in rows:
        body.append(f'<text class="fm-label" x="{left - 8}" y="{y + len(series) * bar / 2 + 4:.1f}" text-anchor="end">{html.escape(text)}</text>')
        for i, v in enumerate(values):
            if v:
                body.append(f'<rect x="{left}" y="{y}" width="{v * scale:.1f}" height="{bar - 1}" fill="{COLORS[i % len(COLORS)]}">'
                            f'<title>{html.escape(series[i])}: {v:.1f} TFLOP/s</title></rect>'
                            f'<text class="fm-axis" x="{left + v * scale + 4:.1f}" y="{y + bar - 1}">{v:.1f}</text>')
            y += bar
        y += gap
    svg = (f'<svg class="fm-chart fm-stage" viewBox="0 0 {W} {H}" role="img" xmlns="http://www.w3.org/2000/svg" '
           f'aria-label="TFLOP/s of this stage and the baselines">{"".join(body)}</svg>')
    keys = " ".join(swatch(COLORS[i % len(COLORS)], s) for i, s in enumerate(series))
    return figure(svg, f"TFLOP/s at each benchmark shape (a baseline's: the same FLOP count over its own time). {keys}")
