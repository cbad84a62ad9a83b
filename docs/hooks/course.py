"""Build-time parts of the course site, run by mkdocs (see `hooks:` in mkdocs.yml).

- on_config: the nav's "Stages" section gets one page, docs/stages/stage<N>.md, per directory
  stages/stage<N>_*/, titled with the first line of the stage's __init__.py docstring; its "Lab
  notebook" section, after the pages mkdocs.yml names there, one page per stage, docs/notebook/stage<N>.md
  (the stage's history: the variants measured and not kept, earlier profiles, dated by date and commit).
- on_page_markdown: placeholders in a page become what results/*.json holds ($FLASHMOE_RESULTS_DIR
  overrides the folder). A <key> is a stage directory, or a rung of its ladder after a colon
  ("stage6_grouped_gemm:mma_sync"), as the results files key them:
    <!-- ladder -->                    one panel per problem: each stage's and rung's speed at the shapes
                                       all the panel's kernels measured, a stage's rungs beside it from
                                       the lowest up, what each step bought over the one below, and the
                                       grades (rungs under their stage) with each one's own provenance
    <!-- results:<key> -->             a stage's (or a rung's) results: speed, launches, compiler output, cases
    <!-- rungs:<stage directory> -->   the stage and the rungs of its ladder side by side at each shape
    <!-- figure:<key>:<shape label>:<field> -->
                                       one measured figure in a lesson's prose (FIELDS lists the
                                       fields), e.g. "<!-- figure:stage6_grouped_gemm:T32768 E32 k2
                                       hidden4096 inter11008:tflops -->" becomes "678 TFLOP/s"
    <!-- measured:<key>:<shape label>:<field>[+<field>...] -->
                                       a table's measured cell beside predicted ones: the figures from
                                       the first GPU's file that holds them (the H100's first), the GPU
                                       named after them, e.g. "0.639 ms · 92.2% H200"; "not measured
                                       yet" while no file does
    <!-- stage-list -->                the list of stages (home page only: its links are relative to docs/)
    <!-- gpus -->                      the GPUs the results files hold, each with its file, the H100's first
    <!-- stall-reasons -->             the warp-stall reasons a profile reports, with what each means
                                       (grader/profile.py's STALL_REASONS)
    <!-- profile:<key> -->             a stage's (or a rung's) Nsight Compute profile beside the reference's,
                                       from the results' "profile" entry (`python -m grader stageN --profile
                                       --json ...`): the side-by-side table, the warp stalls, the verdicts;
                                       the cells and verdicts are grader/profile.py's, as its report prints them
    <!-- expert-parallel-records -->   stage 11's records across GPUs, results/expert-parallel/*.json: the tables
                                       its runner prints, one heading per record (its records.py's
                                       lesson_tables), or "Not measured yet." without records
    <!-- training-records -->          stage 10's training runs, results/training/<gpu>.json (a tab per GPU):
                                       each run's loss curves (SVG) and its table of tokens/s, then the
                                       sizes the file lacks (stages/stage10_model/records.py's TRAINED)
    <!-- ops-figures -->               `python -m grader ops`'s figures, the "ops" entry of each results file
                                       that has one (a tab per GPU): attention host µs and ms beside SDPA,
                                       the host time by piece, the tiny shapes, ops.moe_layer, whole models;
                                       "Not measured yet." where no file has them
  Every results file is shown, one per GPU: with several, each chart and table gets a tab per GPU,
  the H100's first, and the tabs of one GPU are linked across the page. A figure in prose reads the
  H200's file only (PROSE_GPU: the lessons say "on the H200" beside it). A figure that file does not
  hold fails the build when the results are the repository's own; with $FLASHMOE_RESULTS_DIR
  (another GPU's results, a test's) it reads "not measured". A stage, rung or ladder with no results
  reads "not measured yet".
- on_page_content: the tabs' radio buttons taken out of the paragraph Markdown puts them in; each
  chart and diagram at least its own size; the diagrams' arrowhead, once per page that has arrows.

Charts are inline SVG written here: no JavaScript, nothing fetched when the page is read. Each is drawn
twice, wide (labels beside the bars) and narrow (labels above them), and course.css shows the one that
fits its figure: a phone gets the narrow one.
"""
from __future__ import annotations

import ast
import functools
import html
import importlib.util
import itertools
import json
import math
import os
import re
import textwrap
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
STAGE_DIR = re.compile(r"stage(\d+)_\w+")
KEY = r"\w+(?::\w+)?"  # a stage directory, then ":rung" for a rung of its ladder
PLACEHOLDER = re.compile(rf"<!-- (ladder|stage-list|gpus|stall-reasons|expert-parallel-records|training-records|ops-figures|results:({KEY})|rungs:(\w+)|figure:({KEY}):([^:>]+):([\w.:]+)"
                         rf"|profile:({KEY})|measured:({KEY}):([^:>]+):([\w.:+]+)) -->")
COLORS = ["#3b82f6", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#06b6d4", "#ec4899", "#84cc16"]
DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
NOT_MEASURED = "Not measured yet"
FIRST_GPU = "H100"  # the GPU whose results come first: its tab, its file in lists
PROSE_GPU = "H200"  # the GPU whose results the figures in the lessons' prose read (its records are the current ones)


# ---------------------------------------------------------------- stages, problems and results files

@dataclass(frozen=True)
class StageInfo:
    number: int
    name: str      # the directory: "stage3_pipeline"
    title: str     # "Stage 3 — an asynchronous cp.async pipeline with swizzled shared memory"
    idea: str      # the title after its dash: what the stage adds
    summary: str   # the docstring's first paragraph after the title


@dataclass(frozen=True)
class Panel:
    """One panel of the ladder: the stages solving these problems, compared in one metric."""
    title: str
    problems: tuple[str, ...]
    metric: str    # a key of METRICS


METRICS = {"tflops": "TFLOP/s", "pct_bandwidth": "% of bandwidth", "ktokens_per_s": "thousand tokens/s"}
PANELS = (
    Panel("Attention forward", ("attention",), "tflops"),
    Panel("Attention backward", ("attention_backward",), "tflops"),
    Panel("MoE routing: memory-bound, so in % of the memory bandwidth", ("moe_routing",), "pct_bandwidth"),
    Panel("MoE expert GEMMs, and the whole layer", ("moe_experts", "moe_layer"), "tflops"),
    Panel("Expert parallelism: the MoE layer in the grader's world of one", ("moe_expert_parallel",), "tflops"),
    Panel("The whole model: thousands of tokens per second (prefill)", ("model",), "ktokens_per_s"),
    Panel("Decode attention over a paged KV cache: memory-bound, so in % of the memory bandwidth", ("decode_attention",),
          "pct_bandwidth"),
)


def stage_number(name: str) -> int:
    m = STAGE_DIR.match(name)
    return int(m[1]) if m else 1_000


def stage_dirs(root: Path = ROOT) -> list[StageInfo]:
    """Every stages/stage<N>_*/ directory, in stage order, described by its __init__.py docstring."""
    found = []
    for d in (root / "stages").glob("stage*_*"):
        if d.is_dir() and STAGE_DIR.fullmatch(d.name):
            try:
                doc = ast.get_docstring(ast.parse((d / "__init__.py").read_text())) or d.name
            except (OSError, SyntaxError):
                doc = d.name
            heading, _, rest = doc.strip().partition("\n")
            summary = " ".join(rest.strip().split("\n\n")[0].split())
            found.append(StageInfo(stage_number(d.name), d.name, short_title(heading), idea_of(heading), summary))
    return sorted(found, key=lambda info: info.number)


def short_title(title: str) -> str:
    """"Stage 0 — naive attention: scores in global memory" -> "Stage 0 — naive attention"."""
    return title.split(": ")[0]


def idea_of(title: str) -> str:
    """"Stage 2 — tensor cores with mma.sync" -> "tensor cores with mma.sync"."""
    return title.partition(" — ")[2].strip().rstrip(".") or title


def stage_name(key: str) -> str:
    """"stage3_pipeline" -> "Stage 3"; a rung, "stage6_grouped_gemm:mma_sync" -> "Stage 6 · mma_sync rung"."""
    name, rung = split_key(key)
    stage = f"Stage {stage_number(name)}" if STAGE_DIR.match(name) else name
    return f"{stage} · {rung} rung" if rung else stage


def split_key(key: str) -> tuple[str, str]:
    """"stage6_grouped_gemm:mma_sync" -> ("stage6_grouped_gemm", "mma_sync"); a stage's own: (name, "")."""
    name, _, rung = key.partition(":")
    return name, rung


def possessive(key: str) -> str:
    """"stage6_grouped_gemm:mma_sync" -> "stage 6's mma_sync rung"; a stage's own key -> "stage 6"."""
    name, rung = split_key(key)
    return f"{stage_name(name).lower()}'s {rung} rung" if rung else stage_name(name).lower()


def short_key(key: str) -> str:
    """What the grader takes on its command line: "stage6_grouped_gemm:mma_sync" -> "stage6:mma_sync"."""
    name, rung = split_key(key)
    return name.split("_")[0] + (f":{rung}" if rung else "")


def below_name(previous: str, key: str) -> str:
    """The step below `key`, as a sentence names it: "the mma_sync rung" within one ladder, else "stage 2"."""
    (name, rung), (below, below_rung) = split_key(key), split_key(previous)
    return f"the {below_rung} rung" if below_rung and below == name else stage_name(previous).lower()


# What a step of a ladder adds over the step below it (a rung's key; a stage's own key: over its highest
# rung), for the "what each stage bought" figures, where the stage's idea would not say it; and what a
# ladder's top (the stage's own kernel) multiplies with, to tell it from its rungs in the charts.
LADDER_STEPS = {
    "stage4_hopper:wgmma": "wgmma: a warpgroup multiplies 64 rows from shared memory (stage 3's cp.async loads)",
    "stage4_hopper:tma": "TMA: one thread copies whole tiles, which land on mbarriers",
    "stage4_hopper:warp_specialized": "warp specialization: a producer warpgroup copies, two consumers compute",
    "stage4_hopper": "ping-pong consumers, S beside the previous P·V, and a persistent grid",
    "stage6_grouped_gemm:mma_sync": "the tensor cores: mma.sync fed by ldmatrix from a cp.async ring (stages 2 and 3)",
    "stage6_grouped_gemm": "Hopper's wgmma, from shared memory that TMA fills (stage 4's machinery)",
    "stage7_moe_layer": "stage 6's wgmma GEMMs in place of its mma_sync rung's",
}
LADDER_TOPS = {"stage4_hopper": "ping-pong", "stage6_grouped_gemm": "wgmma", "stage7_moe_layer": "wgmma"}


@functools.lru_cache(maxsize=None)
def ladder_of(name: str, root: Path = ROOT) -> tuple[str, ...]:
    """A stage's key, then its rungs' from the highest down, as the module's RUNGS lists them (read
    with ast: `rung("mma_sync", ...)` or `Stage(..., rung="mma_sync")`, here or in the module RUNGS is
    imported from), else its ladder package's (stages/<name>/ladder/, as stages.rungs finds them); just
    the stage where it has no ladder."""
    def rungs_in(path: Path) -> list[str]:
        try:
            tree = ast.parse(path.read_text())
        except (OSError, SyntaxError):
            return []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and any(a.name == "RUNGS" for a in node.names) and node.module:
                module = root / node.module.replace(".", "/")
                return rungs_in(module / "__init__.py" if module.is_dir() else module.with_suffix(".py"))
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "RUNGS" for t in node.targets):
                found = []
                for call in getattr(node.value, "elts", []):
                    given = [k.value for k in getattr(call, "keywords", []) if k.arg == "rung"] or getattr(call, "args", [])[:1]
                    if given and isinstance(given[0], ast.Constant) and isinstance(given[0].value, str):
                        found.append(given[0].value)
                return found
        return []

    folder = root / "stages" / name
    found = rungs_in(folder / "__init__.py") or rungs_in(folder / "ladder" / "__init__.py")  # stages.rungs' order
    return (name, *(f"{name}:{rung}" for rung in found))


def ladder_keys(name: str, run: dict | None = None) -> list[str]:
    """ladder_of(name), then the rungs of it that a run holds and the stage's module does not name."""
    known = list(ladder_of(name))
    extra = sorted(k for k in (run or {}).get("stages", {}) if split_key(k)[0] == name and k not in known)
    return known + extra


def ladder_index(key: str, run: dict | None = None) -> int:
    """0 for a stage's own kernel, 1 for its highest rung, and so on down."""
    return ladder_keys(split_key(key)[0], run).index(key)


def results_folder() -> tuple[Path, bool]:
    """The results folder, and whether it is the repository's own (where prose figures must exist)."""
    override = os.environ.get("FLASHMOE_RESULTS_DIR")
    return (Path(override), False) if override else (ROOT / "results", True)


def load_runs() -> list[dict]:
    """Every results/*.json, the H100 first: one "run" per GPU ("_file": the file's name)."""
    folder, _ = results_folder()
    runs = [current_only({**json.loads(p.read_text()), "_file": p.name}) for p in sorted(folder.glob("*.json"))]
    return sorted(runs, key=lambda run: FIRST_GPU not in str(run.get("gpu")))


def current_only(run: dict) -> dict:
    """A run without the stage entries marked stale (measured on older sources): not the kernels' figures.
    Their profiles are kept apart ("stale_profiles"), shown as an earlier kernel's (profile_md)."""
    stages = run.get("stages", {})
    return {**run, "stages": {k: v for k, v in stages.items() if not v.get("stale")},
            "stale_profiles": {k: v for k, v in stages.items() if v.get("stale") and v.get("profile")}}


def gpu_of(run: dict) -> str:
    return str(run.get("gpu") or "unknown GPU")


def ordered_stages(run: dict) -> list[tuple[str, dict]]:
    """The run's stages in stage order, each followed by its rungs from the highest down."""
    stages = run.get("stages", {})
    return sorted(stages.items(), key=lambda kv: (stage_number(kv[0]), split_key(kv[0])[0], ladder_index(kv[0], run)))


def timed(st: dict) -> list[dict]:
    """The stage's benchmark rows that have a time (not those that failed)."""
    return timed_rows(st.get("benchmarks") or [])


def timed_rows(benches: list[dict]) -> list[dict]:
    return [with_token_rate(b) for b in benches if "failure" not in b and b.get("ms")]


def with_token_rate(bench: dict) -> dict:
    """A whole-model row with its rate in thousands of tokens per second (B·S tokens over the time)."""
    shape = bench.get("shape") or {}
    if "model" not in shape:
        return bench
    return dict(bench, ktokens_per_s=shape["B"] * shape["S"] / bench["ms"])


def bench_at(st: dict, shape: str) -> dict | None:
    return next((b for b in timed(st) if label(b) == shape), None)


def panel_of(problem: str | None) -> Panel:
    return next((p for p in PANELS if problem in p.problems), Panel(problem or "Other", (problem or "",), "tflops"))


def run_panels(run: dict) -> list[tuple[Panel, list[tuple[str, dict]]]]:
    """The run's timed stages grouped by panel, the panels in the order of their first stage; in a
    panel each stage's rungs come before it, from the lowest up (simt, mma_sync, then the stage)."""
    groups: dict[Panel, list[tuple[str, dict]]] = {}
    for key, st in ordered_stages(run):
        if timed(st):
            groups.setdefault(panel_of(st.get("problem")), []).append((key, st))
    rising = lambda kv: (stage_number(kv[0]), split_key(kv[0])[0], -ladder_index(kv[0], run))
    return [(panel, sorted(stages, key=rising)) for panel, stages in groups.items()]


def all_panels(runs: list[dict]) -> list[Panel]:
    """The panels any run has, in the order of PANELS, then any other in the order found."""
    found = list(dict.fromkeys(panel for run in runs for panel, _ in run_panels(run)))
    return sorted(found, key=lambda p: PANELS.index(p) if p in PANELS else len(PANELS))


# ---------------------------------------------------------------- one tab per GPU

TAB_INPUT = "fm-gpu-input"
_tab_sets = itertools.count(1)


def gpu_label(run: dict) -> str:
    """A tab's label: "NVIDIA H100 80GB HBM3" -> "H100 80GB HBM3"."""
    return gpu_of(run).removeprefix("NVIDIA ").strip()


def gpu_tabs(items: list[tuple[dict, str]]) -> str:
    """Markdown content per run: one run's as it is, several as Material's tabs, one per GPU in the
    runs' order (the H100's first). The tabs' HTML is pymdownx.tabbed's, written out with md_in_html
    because tabbed's own syntax indents the content, and indented raw HTML (the charts) is not kept
    as HTML; Material links the tabs of one label across the page (content.tabs.link)."""
    if len(items) == 1:
        return items[0][1]
    n = next(_tab_sets)
    inputs = "".join(f'<input class="{TAB_INPUT}" {"checked " * (i == 0)}id="fm-gpu-{n}-{i}" name="fm-gpu-{n}" type="radio" />'
                     for i in range(len(items)))
    labels = "".join(f'<label for="fm-gpu-{n}-{i}">{html.escape(gpu_label(run))}</label>' for i, (run, _) in enumerate(items))
    blocks = "".join(f'<div class="tabbed-block" markdown>\n\n{text}\n\n</div>\n' for _, text in items)
    return (f'\n\n<div class="tabbed-set tabbed-alternate fm-gpus" data-tabs="{n}:{len(items)}" markdown>\n\n{inputs}\n\n'
            f'<div class="tabbed-labels">{labels}</div>\n<div class="tabbed-content" markdown>\n{blocks}</div>\n</div>\n\n')


SVG_OPEN = re.compile(r'<svg class="(fm-chart[^"]*|fm-diagram)" viewBox="0 0 ([\d.]+) ([\d.]+)"')
# The head of every arrow of the lessons' diagrams (course.css ends each `.fm-diagram .arrow` in
# url(#fm-arrow)): defined once per page, outside any diagram, so that an arrow finds it wherever
# its diagram is (a figure, a tab, a folded details block) and no two diagrams define the same id.
ARROWHEAD = ('<svg class="fm-markers" width="0" height="0" aria-hidden="true" focusable="false" '
             'xmlns="http://www.w3.org/2000/svg"><defs><marker id="fm-arrow" viewBox="0 0 10 10" refX="9" refY="5" '
             'markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"/></marker>'
             '</defs></svg>\n')


def on_page_content(html_text, page, config, files):
    """Markdown wraps the tabs' radio buttons in a paragraph; Material's tabs want them as the tab
    set's own children. Every chart and diagram is drawn at least at its own size (one unit of its
    viewBox a pixel, so that its text, 11 units and up, is 11 px and up on screen): on a narrow
    screen a chart shows its narrow drawing (figure()) and a diagram's figure scrolls sideways
    (course.css), rather than shrink the text. A page with arrows gets their arrowhead (ARROWHEAD)."""
    html_text = re.sub(rf'<p>((?:<input class="{TAB_INPUT}"[^>]*>)+)</p>', r"\1", html_text)
    if 'class="arrow"' in html_text:
        html_text = ARROWHEAD + html_text
    return SVG_OPEN.sub(lambda m: f'{m[0]} style="min-width: {float(m[2]):g}px"', html_text)


# ---------------------------------------------------------------- mkdocs events

def on_config(config):
    ladder_of.cache_clear()  # `mkdocs serve` builds again after a change to stages/
    pages = [{info.title: f"stages/stage{info.number}.md"} for info in stage_dirs()]
    notebooks = [{f"Stage {info.number}": f"notebook/stage{info.number}.md"} for info in stage_dirs()]
    for entry in config.nav or []:
        if isinstance(entry, dict) and "Stages" in entry:
            entry["Stages"] = pages
        if isinstance(entry, dict) and "Lab notebook" in entry:  # what the nav names there first stays first
            entry["Lab notebook"] = [e for e in entry["Lab notebook"] or [] if e not in notebooks] + notebooks
    return config


def on_page_markdown(markdown, page, config, files):
    if not PLACEHOLDER.search(markdown):
        return markdown
    runs = load_runs()

    def fill(m):
        if m[1] == "stage-list":  # links are relative to the page: the home page, docs/index.md
            return "\n".join(f"- [**{s.title}**](stages/stage{s.number}.md). {s.summary}" for s in stage_dirs())
        if m[1] == "ladder":
            return ladder_md(runs)
        if m[1] == "gpus":
            return gpus_md(runs)
        if m[1] == "stall-reasons":
            return stall_reasons_md()
        if m[1] == "expert-parallel-records":
            return expert_parallel_md()
        if m[1] == "training-records":
            return training_md()
        if m[1] == "ops-figures":
            return ops_md(runs)
        if m[2]:
            return results_md(m[2], runs)
        if m[3]:
            return rungs_md(m[3], runs)
        if m[7]:
            return profile_md(m[7], runs)
        if m[8]:
            return measured_md(runs, m[8], m[9], m[10], page.file.src_path)
        return figure_md(runs, m[4], m[5], m[6], page.file.src_path)

    return PLACEHOLDER.sub(fill, markdown)


# ---------------------------------------------------------------- formatting

def num(value, fmt: str = ".2f", unit: str = "") -> str:
    return "—" if value is None else f"{value:{fmt}}{unit}"


def sig3(value: float) -> str:
    """Three significant digits, no exponent: 0.344, 6.92, 53.8, 678, 1,235."""
    if value == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def ratio(value: float) -> str:
    return f"{value:.2f}×" if value < 10 else f"{value:.1f}×"


def shape_label(bench: dict) -> str:
    """{"B": 16, "S": 2048, "causal": False} and dtype "float16" -> "B16 S2048 non-causal fp16"."""
    shape = dict(bench.get("shape") or {})
    dtype = bench.get("dtype") or shape.get("dtype")
    shape.pop("dtype", None)
    parts = [(k if v else f"non-{k}") if isinstance(v, bool) else f"{k}{v}" for k, v in shape.items()]
    return " ".join(parts + ([DTYPES.get(dtype, dtype)] if dtype else []))


def label(bench: dict) -> str:
    return bench.get("label") or shape_label(bench)


def mib(nbytes) -> str:
    return "—" if nbytes is None else "0" if nbytes == 0 else f"{nbytes / 2**20:,.1f} MiB"


def kib(nbytes) -> str:
    return "—" if nbytes is None else "0" if nbytes == 0 else f"{nbytes / 1024:,.1f} KiB"


def at_time(bench: dict, metric: str, ms):
    """The metric had the same work taken `ms` (TFLOP/s and % of bandwidth are both work over time)."""
    return bench[metric] * bench["ms"] / ms if ms and bench.get(metric) and bench.get("ms") else None


def is_yardstick(baseline: str) -> bool:
    """A baseline timed for scale, not as a rival: the whole MoE layer beside the routing."""
    return baseline.startswith("layer_")


# A chart is drawn twice: WIDE units wide, its labels beside its bars, and NARROW, its labels above its
# bars, which course.css shows instead where the figure is narrower than WIDE px (the column of a 400 px
# phone is about 360 px, of a 320 px one 288). Each drawing is at least its own size on screen
# (on_page_content), so that no text is under 11 px.
WIDE, NARROW = 760, 280


def figure(svg: str, caption: str, narrow: str = "") -> str:
    """A chart's figure: its drawing, or its wide and narrow drawings (course.css shows one), and the caption."""
    # A raw HTML block for Python-Markdown: no blank line inside, blank lines around.
    cls, drawings = ("fm-figure fm-two-widths", f"{svg}\n{narrow}") if narrow else ("fm-figure", svg)
    return f'\n\n<figure class="{cls}">\n{drawings}\n<figcaption>{caption}</figcaption>\n</figure>\n\n'


def svg_root(cls: str, width: int, height: float, aria: str, body: list[str]) -> str:
    return (f'<svg class="fm-chart {cls}" viewBox="0 0 {width} {height:.0f}" role="img" '
            f'xmlns="http://www.w3.org/2000/svg" aria-label="{html.escape(aria)}">{"".join(body)}</svg>')


def wrapped(text: str, size: int, width: float = NARROW) -> list[str]:
    """The words of `text` in lines that fit `width` at `size` px (0.6 em a character: wide for a sans font)."""
    return textwrap.wrap(text, max(8, int(width / (0.6 * size)))) or [""]


def lines_text(cls: str, x: float, y: float, lines: list[str], step: float) -> str:
    """One <text> of several lines, the first's baseline at y, each `step` below the one before."""
    spans = "".join(f'<tspan x="{x:g}" dy="{step if i else 0:g}">{html.escape(line)}</tspan>' for i, line in enumerate(lines))
    return f'<text class="{cls}" x="{x:g}" y="{y:.1f}">{spans}</text>'


def text_width(text: str, size: int) -> float:
    return 0.6 * size * len(text)


def swatch(color: str, text: str, cls: str = "fm-swatch") -> str:
    return f'<span class="fm-key"><span class="{cls}" style="--c:{color}"></span>{html.escape(text)}</span>'


def palette(n: int) -> list[str]:
    """n distinct colours: the course's eight, or evenly spaced hues beyond eight."""
    return COLORS[:n] if n <= len(COLORS) else [f"hsl({360 * i // n}, 70%, 50%)" for i in range(n)]


PROVENANCE = (("gpu", "{}"), ("sm_clock_mhz", "SM clock {} MHz"), ("driver", "driver {}"),
              ("driver_cuda", "driver CUDA {}"), ("cuda", "CUDA {}"), ("nvrtc", "NVRTC {}"), ("torch", "torch {}"),
              ("cuda_core", "cuda.core {}"))


def measured(run: dict, st: dict) -> dict:
    """Where and with what a stage was measured: its own record, else the run's."""
    return st.get("measured") or run.get("provenance") or {}


def environment(p: dict, keys=None) -> str:
    """The GPU, clock, driver and library versions of a provenance record (only `keys`, if given)."""
    return ", ".join(text.format(p[key]) for key, text in PROVENANCE if p.get(key) and (keys is None or key in keys))


def when(p: dict) -> str:
    """"commit `82792ab` on 2026-11-23 12:28 UTC", or what of it is known."""
    bits = []
    if p.get("commit"):
        bits.append(f"commit `{str(p['commit'])[:7]}`" + (" (with local changes)" if p.get("dirty") else ""))
    if p.get("date"):
        bits.append(f"on {readable_date(p['date'])}")
    return " ".join(bits) or "no commit recorded"


def readable_date(iso: str) -> str:
    """"2026-11-23T12:28:00+00:00" -> "2026-11-23 12:28 UTC"; a day alone as it is."""
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(iso)):
        return str(iso)
    try:
        stamp = datetime.fromisoformat(str(iso))
    except ValueError:
        return str(iso)
    utc = stamp.utcoffset() is not None and stamp.utcoffset().total_seconds() == 0
    return stamp.strftime("%Y-%m-%d %H:%M") + (" UTC" if utc else "")


# ---------------------------------------------------------------- what each stage bought

@dataclass(frozen=True)
class Step:
    """A stage's (or rung's) speed-up over the step below it at one shape."""
    previous: str        # the step below's key: a lower rung of the same ladder, or an earlier stage
    speedup: float
    side_by_side: bool   # both timed in one run (the row's previous_stage), or two separate runs' medians
    detail: str          # where the two times come from, for a tooltip


def previous_stage(run: dict, key: str) -> str | None:
    """The step below `key` in this run, as the grader's stages.previous walks: the next lower rung of
    its ladder that has timings, else the last earlier stage (its own kernel, not a rung) that solves
    the same problem and has timings."""
    stages = run["stages"]
    ladder = ladder_keys(split_key(key)[0], run)
    below = [k for k in ladder[ladder.index(key) + 1:] if k in stages and timed(stages[k])]
    if below:
        return below[0]
    problem = stages[key].get("problem")
    before = [k for k, st in ordered_stages(run) if stage_number(k) < stage_number(key) and not split_key(k)[1]
              and st.get("problem") == problem and timed(st)]
    return before[-1] if before else None


def step_at(run: dict, key: str, bench: dict) -> Step | None:
    """What `key` bought at this shape: the previous stage timed beside it in the same run (the
    row's "previous_stage") where the grader did that, else the ratio of the two recorded medians."""
    side = bench.get("previous_stage") or {}
    if side.get("stage") and (side.get("speedup") or side.get("ms")):
        speedup = side.get("speedup") or side["ms"] / bench["ms"]
        return Step(side["stage"], speedup, True,
                    f"{stage_name(side['stage'])} timed side by side in the same run: {num(side.get('ms'), '.3f')} ms")
    previous = previous_stage(run, key)
    other = bench_at(run["stages"][previous], label(bench)) if previous else None
    if not other:
        return None
    p = measured(run, run["stages"][previous])
    return Step(previous, other["ms"] / bench["ms"], False,
                f"separate runs: {stage_name(previous)} {other['ms']:.3f} ms, measured {when(p).replace('`', '')}")


# ---------------------------------------------------------------- the ladder (home page)

def gpus_md(runs: list[dict]) -> str:
    """"the NVIDIA H100 80GB HBM3 (`results/h100-sxm.json`) and the NVIDIA H200 (`results/h200.json`)"."""
    files = [f"the {gpu_of(run)} (`results/{run.get('_file', '?')}`)" for run in runs]
    if not files:
        return "no GPU yet (`results/` holds no results file: not measured yet)"
    return files[0] if len(files) == 1 else ", ".join(files[:-1]) + " and " + files[-1]


def ladder_md(runs: list[dict]) -> str:
    """Per panel, its charts on each GPU (a tab each where there are several), then the grades."""
    runs = [run for run in runs if run.get("stages")]
    if not runs:
        return (f'\n\n!!! note "{NOT_MEASURED}"\n    No stage has recorded results in `results/*.json`: '
                "not measured yet.\n\n")
    out = [f"Measured on {gpus_md(runs)}." if len(runs) == 1 else
           f"Measured on {len(runs)} GPUs: {gpus_md(runs)}. Each chart and table has a tab per GPU; choosing "
           "a GPU's tab shows its results everywhere on the page."]
    panels = {run_index: dict(run_panels(run)) for run_index, run in enumerate(runs)}
    for p, panel in enumerate(all_panels(runs)):
        out.append(f"#### {panel.title}\n" + gpu_tabs([
            (run, panel_md(run, panel, panels[r][panel], f"fm-hatch-{r}-{p}"))
            for r, run in enumerate(runs) if panel in panels[r]]))
    out.append("#### Grades, and where each stage was measured\n"
               + gpu_tabs([(run, grades_table(run)) for run in runs]))
    return "\n\n" + "\n\n".join(out) + "\n\n"


def panel_md(run: dict, panel: Panel, stages: list[tuple[str, dict]], hatch: str) -> str:
    shapes, others = panel_shapes(stages)
    colors = dict(zip(shapes, palette(len(shapes))))
    text = ladder_figure(panel, stages, shapes, colors)
    if others:
        text += ("Measured by only some of these stages, so not drawn (see their pages): "
                 + ", ".join(html.escape(s) for s in others) + ".\n\n")
    return text + steps_figure(run, stages, shapes, colors, hatch)


def panel_shapes(stages: list[tuple[str, dict]]) -> tuple[list[str], list[str]]:
    """The shapes every stage of the panel measured (in the first stage's order) and the others; if
    no shape is common to all, every shape, drawn with its gaps."""
    per_stage = [[label(b) for b in timed(st)] for _, st in stages]
    every = [s for s in per_stage[0] if all(s in other for other in per_stage[1:])]
    others = [s for s in dict.fromkeys(s for labels in per_stage for s in labels) if s not in every]
    return (every, others) if every else (others, [])


def value_axis(values: list[float], metric: str, length: float):
    """A map from values to 0..length pixels, its ticks, and whether it is logarithmic: log where
    the values span more than a factor of 20, else linear from 0 (% of bandwidth: up to 100 at least)."""
    lo, hi = min(values), max(values)
    if metric == "tflops" and hi / lo > 20:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        b += b == a
        return (lambda v: (math.log10(v) - a) / (b - a) * length), [10.0 ** k for k in range(a, b + 1)], True
    hi = max(hi, 100.0) if metric == "pct_bandwidth" else hi
    step = nice_step(hi / 4)
    top = step * math.ceil(hi / step - 1e-9)
    return (lambda v: v / top * length), [step * k for k in range(round(top / step) + 1)], False


def nice_step(x: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is >= x."""
    power = 10.0 ** math.floor(math.log10(x))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= x)


def ladder_figure(panel: Panel, stages: list[tuple[str, dict]], shapes: list[str], colors: dict) -> str:
    """Grouped bars: one group per stage, one bar per shape, the reference (and flash) as ticks."""
    metric, unit = panel.metric, METRICS[panel.metric]
    marks = [v for _, st in stages for s in shapes if (b := bench_at(st, s))
             for v in (b.get(metric), at_time(b, metric, (b.get("reference") or {}).get("ms")),
                       at_time(b, metric, (b.get("baselines") or {}).get("flash"))) if v]
    if not marks:
        return f"<p>No {unit} recorded.</p>\n\n"
    subs = [kernel_note(key, stages) for key, _ in stages]  # a second line under a group: which rung
    W, H, left, right, top, bottom = 760, 300, 58, 10, 14, 58 if any(subs) else 44
    scale, ticks, log = value_axis(marks, metric, H - top - bottom)
    y = lambda v: H - bottom - scale(v)
    middle = (top + H - bottom) / 2
    body = [f'<text class="fm-axis" x="14" y="{middle}" transform="rotate(-90 14 {middle})" text-anchor="middle">'
            f'{html.escape(unit)}{" (log scale)" if log else ""}</text>']
    for t in ticks:
        body.append(f'<line class="fm-grid" x1="{left}" x2="{W - right}" y1="{y(t):.1f}" y2="{y(t):.1f}"/>'
                    f'<text class="fm-axis" x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    group = (W - left - right) / len(stages)
    bar = min(26.0, group * 0.8 / len(shapes))
    for g, (key, st) in enumerate(stages):
        x0 = left + g * group + (group - bar * len(shapes)) / 2
        for i, shape in enumerate(shapes):
            body += ladder_bar(stage_name(key), bench_at(st, shape), shape, metric, colors[shape], x0 + i * bar, bar, y, H - bottom)
        cx, grade_y = left + (g + 0.5) * group, H - bottom + (46 if any(subs) else 32)
        body.append(f'<text class="fm-label" x="{cx:.1f}" y="{H - bottom + 16}" text-anchor="middle">{stage_name(split_key(key)[0])}</text>'
                    + (f'<text class="fm-label fm-rung" x="{cx:.1f}" y="{H - bottom + 31}" text-anchor="middle">{html.escape(subs[g])}</text>'
                       if subs[g] else "")
                    + f'<text class="fm-axis" x="{cx:.1f}" y="{grade_y}" text-anchor="middle">grade {st.get("grade", "—")}</text>')
    svg = svg_root("fm-ladder", W, H, f"{unit} of each stage at each shape", body)
    narrow = ladder_narrow(metric, stages, shapes, colors, marks, subs)
    keys = [swatch(colors[s], s) for s in shapes] + [swatch("", "the reference: the fastest library baseline", "fm-swatch fm-ref-key")]
    if any(at_time(b, metric, (b.get("baselines") or {}).get("flash")) for _, st in stages for b in timed(st)):
        keys.append(swatch("", "SDPA flash backend", "fm-swatch fm-flash-key"))
    rungs = " A stage's rungs stand before it, from the lowest up." if any(split_key(k)[1] for k, _ in stages) else ""
    return figure(svg, f"{html.escape(unit)} of each stage at the same shapes{', log scale' if log else ''}.{rungs} "
                  + " ".join(keys), narrow)


def ladder_narrow(metric: str, stages: list[tuple[str, dict]], shapes: list[str], colors: dict, marks: list[float],
                  subs: list[str]) -> str:
    """The ladder at NARROW: one row of bars per stage, across, its name and grade above them; the
    reference (and flash) as ticks across a bar, its value after it."""
    unit = METRICS[metric]
    left, bar, head, gap = 12, 13, 18, 8  # left: room for half the first tick's label
    right = max(text_width(sig3(v), 11) for v in marks) + 8
    scale, ticks, log = value_axis(marks, metric, NARROW - left - right)
    x = lambda v: left + scale(v)
    body, spans, y = [], [], 0.0
    for g, (key, st) in enumerate(stages):
        name = stage_name(split_key(key)[0]) + (f" · {subs[g]}" if subs[g] else "")
        body.append(f'<text class="fm-label" x="0" y="{y + 13:.1f}">{html.escape(name)}'
                    f'<tspan class="fm-axis" dx="8">grade {html.escape(str(st.get("grade", "—")))}</tspan></text>')
        y += head
        spans.append((y - 2, y + len(shapes) * bar + 1))
        for shape in shapes:
            body += ladder_row(stage_name(key), bench_at(st, shape), shape, metric, colors[shape], x, left, y, bar - 1)
            y += bar
        y += gap
    grid = [f'<line class="fm-grid" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{a:.1f}" y2="{b:.1f}"/>' for t in ticks for a, b in spans]
    body = grid + body + [f'<text class="fm-axis" x="{x(t):.1f}" y="{y + 6:.1f}" text-anchor="middle">{t:g}</text>' for t in ticks]
    body.append(f'<text class="fm-axis" x="0" y="{y + 22:.1f}">{html.escape(unit)}{" (log scale)" if log else ""}</text>')
    return svg_root("fm-ladder fm-narrow", NARROW, y + 28, f"{unit} of each stage at each shape", body)


def bar_tip(name: str, bench: dict, shape: str, metric: str) -> str:
    """A ladder bar's tooltip: its value and the reference's at the same shape."""
    unit, ref = METRICS[metric], bench.get("reference") or {}
    return (f"{name}, {shape}: {sig3(bench[metric])} {unit}; "
            f"the reference ({ref.get('name', '—')}): {num(at_time(bench, metric, ref.get('ms')), '.1f')} {unit}")


def reference_ticks(bench: dict, metric: str) -> list[tuple[float | None, str]]:
    """(value, CSS class) of a ladder bar's ticks: the reference's and FlashAttention's, None where absent."""
    return [(at_time(bench, metric, (bench.get("reference") or {}).get("ms")), "fm-ref"),
            (at_time(bench, metric, (bench.get("baselines") or {}).get("flash")), "fm-flash")]


def ladder_row(name: str, bench: dict | None, shape: str, metric: str, color: str, x, left: float, y: float, height: float) -> list[str]:
    """One bar of the narrow ladder, across, with its reference ticks and its value, or a marked gap."""
    if not bench or not bench.get(metric):
        return [f'<text class="fm-axis" x="{left + 2:g}" y="{y + height - 1:.1f}">'
                f'×<title>{html.escape(name)}: not measured at {html.escape(shape)}</title></text>']
    tip = bar_tip(name, bench, shape, metric)
    end = x(bench[metric])
    out = [f'<rect x="{left:g}" y="{y:.1f}" width="{max(end - left, 1):.1f}" height="{height:g}" fill="{color}">'
           f'<title>{html.escape(tip)}</title></rect>']
    for value, cls in reference_ticks(bench, metric):
        if value:
            out.append(f'<line class="{cls}" x1="{x(value):.1f}" x2="{x(value):.1f}" y1="{y - 1:.1f}" y2="{y + height + 1:.1f}"/>')
            end = max(end, x(value))
    out.append(f'<text class="fm-axis" x="{end + 4:.1f}" y="{y + height - 1:.1f}">{sig3(bench[metric])}</text>')
    return out


def kernel_note(key: str, stages: list[tuple[str, dict]]) -> str:
    """Under a group of the ladder: "mma_sync rung" for a rung, what the stage's own kernel uses
    ("wgmma") where its rungs stand beside it; "" for a stage without rungs in the chart."""
    name, rung = split_key(key)
    if rung:
        return f"{rung} rung"
    return LADDER_TOPS.get(name, "own kernel") if any(split_key(k)[0] == name and split_key(k)[1] for k, _ in stages) else ""


def ladder_bar(name: str, bench: dict | None, shape: str, metric: str, color: str, x: float, width: float, y, base: float) -> list[str]:
    """One bar and its reference ticks, or a marked gap where the stage has no time at this shape."""
    if not bench or not bench.get(metric):
        return [f'<text class="fm-axis" x="{x + width / 2 - 1:.1f}" y="{base - 3}" text-anchor="middle">'
                f'×<title>{html.escape(name)}: not measured at {html.escape(shape)}</title></text>']
    tip = bar_tip(name, bench, shape, metric)
    out = [f'<rect x="{x:.1f}" y="{y(bench[metric]):.1f}" width="{width - 2:.1f}" height="{base - y(bench[metric]):.1f}" '
           f'fill="{color}"><title>{html.escape(tip)}</title></rect>']
    for value, cls in reference_ticks(bench, metric):
        if value:
            out.append(f'<line class="{cls}" x1="{x - 1:.1f}" x2="{x + width - 1:.1f}" y1="{y(value):.1f}" y2="{y(value):.1f}"/>')
    return out


def steps_figure(run: dict, stages: list[tuple[str, dict]], shapes: list[str], colors: dict, hatch: str) -> str:
    """Horizontal bars, log scale: each stage's (and rung's) speed-up over the step below it, shape by shape."""
    groups = [(key, found) for key, st in stages
              if (found := [(s, step) for s in shapes if (b := bench_at(st, s)) and (step := step_at(run, key, b))])]
    if not groups:
        return ""
    ideas = {info.name: info.idea for info in stage_dirs()}
    speedups = [step.speedup for _, found in groups for _, step in found]
    mixed = any(len({step.previous for _, step in found}) > 1 for _, found in groups)  # bars then name their stage
    longest = max(len(shape) for _, found in groups for shape, _ in found)  # the shapes' labels, right-aligned
    W, left, right, row, head, gap = 760, max(190, 12 + 6 * longest), 170 if mixed else 60, 13, 34, 8
    lo, hi = min(1.0, min(speedups)) / 1.1, max(2.0, max(speedups)) * 1.1
    x = lambda r: left + math.log(r / lo) / math.log(hi / lo) * (W - left - right)
    body = [f'<defs><pattern id="{hatch}" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
            '<rect width="3" height="6" fill="#fff" fill-opacity="0.55"/></pattern></defs>']
    y, spans, ticks = 6.0, [], [2.0 ** k for k in range(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1)]
    for key, found in groups:
        body.append(step_heading(key, [step for _, step in found], step_idea(run, key, [s for _, s in found], ideas), y))
        y += head
        spans.append((y - 2, y + len(found) * row))  # the grid lines run behind the bars, not the headings
        for shape, step in found:
            body += step_bar(key, shape, step, len({s.previous for _, s in found}) > 1, x, y, row - 2, colors[shape], hatch)
            y += row
        y += gap
    body[1:1] = [f'<line class="fm-grid{" fm-one" if t == 1 else ""}" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{a:.1f}" y2="{b:.1f}"/>'
                 for t in ticks for a, b in spans]
    body += [f'<text class="fm-axis" x="{x(t):.1f}" y="{y + 12:.1f}" text-anchor="middle">{t:g}×</text>' for t in ticks]
    svg = svg_root("fm-steps", W, y + 18, "Speed-up of each stage over the one before it", body)
    narrow = steps_narrow(run, groups, ideas, lo, hi, ticks, colors, hatch)
    return figure(svg, "What each stage bought: its speed-up over the step below it (the stage before it, or the next "
                  "lower rung of its ladder) at the same shape on the same GPU "
                  "(log scale; colours: the shapes, as above). Solid bars: the two kernels timed side by side in one "
                  "grader run; hatched bars: the ratio of the medians the two stages recorded in separate runs, each "
                  "at its own commit and date (in the table below). Hover over a bar for both times.", narrow)


def steps_narrow(run: dict, groups: list, ideas: dict[str, str], lo: float, hi: float, ticks: list[float], colors: dict,
                 hatch: str) -> str:
    """What each stage bought, at NARROW: the headings wrapped, each shape's label above its bar."""
    right = max(text_width(ratio(step.speedup), 11) for _, found in groups for _, step in found) + 8
    left, row = 10, 13  # left: room for half the first tick's label
    x = lambda r: left + math.log(r / lo) / math.log(hi / lo) * (NARROW - left - right)
    hatch = f"{hatch}-narrow"  # the wide drawing's pattern is not drawn where this one is
    body = [f'<defs><pattern id="{hatch}" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
            '<rect width="3" height="6" fill="#fff" fill-opacity="0.55"/></pattern></defs>']
    y, spans = 0.0, []
    for key, found in groups:
        steps = [step for _, step in found]
        heading, idea = wrapped(step_title(key, steps), 12), wrapped(step_idea(run, key, steps, ideas), 11)
        body.append(lines_text("fm-label", 0, y + 13, heading, 15))
        y += 15 * len(heading) + 3
        body.append(lines_text("fm-axis", 0, y + 11, idea, 14))
        y += 14 * len(idea) + 4
        name_it = len({s.previous for s in steps}) > 1
        for shape, step in found:
            label = wrapped(shape + (f" ({step_note(step, True, key)})" if name_it else ""), 11)
            body.append(lines_text("fm-axis", 0, y + 11, label, 14))
            y += 14 * len(label)
            spans.append((y - 1, y + row - 1))
            x0, x1 = sorted((x(1.0), x(step.speedup)))
            tip = html.escape(f"{shape}: {ratio(step.speedup)} ({step.detail})")
            body.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 1):.1f}" height="{row - 2}" fill="{colors[shape]}"><title>{tip}</title></rect>')
            if not step.side_by_side:
                body.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 1):.1f}" height="{row - 2}" fill="url(#{hatch})"><title>{tip}</title></rect>')
            body.append(f'<text class="fm-axis" x="{x(max(1.0, step.speedup)) + 4:.1f}" y="{y + row - 3:.1f}">{ratio(step.speedup)}</text>')
            y += row + 2
        y += 8
    body[1:1] = [f'<line class="fm-grid{" fm-one" if t == 1 else ""}" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{a:.1f}" y2="{b:.1f}"/>'
                 for t in ticks for a, b in spans]
    every = math.ceil(36 / max(x(ticks[1]) - x(ticks[0]), 1)) if len(ticks) > 1 else 1  # the ticks' labels 36 px apart at least
    body += [f'<text class="fm-axis" x="{x(t):.1f}" y="{y + 4:.1f}" text-anchor="middle">{t:g}×</text>' for t in ticks[::every]]
    return svg_root("fm-steps fm-narrow", NARROW, y + 10, "Speed-up of each stage over the one before it", body)


def step_idea(run: dict, key: str, steps: list[Step], ideas: dict[str, str]) -> str:
    """What `key` adds over the step below: LADDER_STEPS says for a rung, and for a stage's own kernel
    over a rung of its ladder; else the stage's idea."""
    name, rung = split_key(key)
    if key in LADDER_STEPS and (rung or all(split_key(step.previous)[0] == name for step in steps)):
        return LADDER_STEPS[key]
    return (ideas.get(name) if not rung else None) or idea_of(run["stages"][key].get("title", key))


def step_title(key: str, steps: list[Step]) -> str:
    """"Stage 3 over stage 2 (timed side by side in one run)", "Stage 6 over the mma_sync rung (...)"."""
    previous, side = sorted({step.previous for step in steps}), {step.side_by_side for step in steps}
    source = ("timed side by side in one run" if side == {True} else "the ratio of medians from separate runs"
              if side == {False} else "hatched: separate runs")
    over = " and ".join(below_name(p, key) for p in previous)
    return f"{stage_name(key)} over {over} ({source})"


def step_heading(key: str, steps: list[Step], idea: str, y: float) -> str:
    """The step's title, and the idea that the step adds."""
    return (f'<text class="fm-label" x="0" y="{y + 13:.1f}">{step_title(key, steps)}</text>'
            f'<text class="fm-axis" x="0" y="{y + 27:.1f}">{html.escape(idea)}</text>')


def step_note(step: Step, name_it: bool, key: str) -> str:
    """"same run" or "separate runs", and which step below where a table or chart mixes two."""
    return (f"over {below_name(step.previous, key)}, " if name_it else "") + ("same run" if step.side_by_side else "separate runs")


def step_bar(key: str, shape: str, step: Step, name_it: bool, x, y: float, height: float, color: str, hatch: str) -> list[str]:
    x0, x1 = sorted((x(1.0), x(step.speedup)))
    tip = html.escape(f"{shape}: {ratio(step.speedup)} ({step.detail})")
    out = [f'<text class="fm-axis" x="{x(min(1.0, step.speedup)) - 6:.1f}" y="{y + height - 1:.1f}" text-anchor="end">{html.escape(shape)}</text>',
           f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 1):.1f}" height="{height}" fill="{color}"><title>{tip}</title></rect>']
    if not step.side_by_side:
        out.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0, 1):.1f}" height="{height}" fill="url(#{hatch})"><title>{tip}</title></rect>')
    text = ratio(step.speedup) + (f" ({step_note(step, True, key)})" if name_it else "")
    out.append(f'<text class="fm-axis" x="{x(max(1.0, step.speedup)) + 4:.1f}" y="{y + height - 1:.1f}">{text}</text>')
    return out


def grades_table(run: dict) -> str:
    """One row per stage, its rungs under it: grade, score, goal, % of the reference, cases, and where
    it was measured; a rung of a stage the run holds that the run does not: "not measured yet"."""
    names = list(dict.fromkeys(split_key(key)[0] for key, _ in ordered_stages(run)))
    keys = [key for name in names for key in ladder_keys(name, run)]
    stages = run.get("stages", {})
    records = [measured(run, stages[key]) for key in keys if key in stages]
    shared = [key for key, _ in PROVENANCE if len({str(p.get(key)) for p in records}) == 1]
    rows = ["| Stage | Grade (score) | Goal | % of the reference | Correct | Commit, date |", "|---|---|---|--:|--:|---|"]
    for key in keys:
        link = f"[{stage_name(key)}](stages/stage{stage_number(key)}.md)"
        if key not in stages:
            rows.append(f"| {link} | {NOT_MEASURED.lower()} | | | | |")
            continue
        st, p = stages[key], measured(run, stages[key])
        pct = [b["pct_of_reference"] for b in timed(st) if b.get("pct_of_reference")]
        geo = math.exp(sum(map(math.log, pct)) / len(pct)) if pct else None
        c = st.get("correctness") or {}
        own = environment(p, [k for k, _ in PROVENANCE if k not in shared])
        score = 100 * st["score"] if st.get("score") is not None else None
        rows.append(f"| {link} | **{st.get('grade', '—')}** ({num(score, '.0f', ' %')}) "
                    f"| {(st.get('goal') or {}).get('text', '—')} | {num(geo, '.1f', ' %')} "
                    f"| {c.get('passed', '—')} / {(c.get('passed') or 0) + (c.get('failed') or 0)} "
                    f"| {commit_and_day(p)}{'; ' + own if own else ''} |")
    common = environment(records[0], shared) if records else ""
    rungs = (" A rung is a lower step of its stage's ladder: the same problem with an earlier stage's technique, "
             "graded against its own goal." if any(split_key(k)[1] for k in keys) else "")
    missing = [k for k in keys if k not in stages]
    if missing:
        rungs += (f" {NOT_MEASURED} on this GPU: "
                  + ", ".join(f"{possessive(k)} (`python -m grader {short_key(k)}`)" for k in missing) + ".")
    return ('<div class="fm-results" markdown>\n\n' + "\n".join(rows) + "\n\n</div>\n\n<small>"
            + f"On the {gpu_of(run)}. Each stage was graded at its own commit and date. "
            + (f"All with {common}. " if common else "")
            + f"Both percentages are geometric means over the stage's benchmark shapes.{rungs}</small>\n")


def commit_and_day(p: dict) -> str:
    """"`82792ab`, 2026-11-23" (the date never split across lines): a short form of when() for a table."""
    commit = f"`{str(p['commit'])[:7]}`" + ("+" if p.get("dirty") else "") if p.get("commit") else "—"
    return commit + (f', <span class="fm-nowrap">{str(p["date"])[:10]}</span>' if p.get("date") else "")


# ---------------------------------------------------------------- one stage's results

def results_md(key: str, runs: list[dict]) -> str:
    """A stage's (or rung's) results on each GPU that measured it, a tab each where there are several."""
    found = [run for run in runs if key in run.get("stages", {})]
    if not found and key not in ladder_of(split_key(key)[0]):
        raise PluginError(f"<!-- results:{key} -->: no such stage or rung (stages/{split_key(key)[0]}/ names "
                          f"{', '.join(ladder_of(split_key(key)[0]))})")
    if not found:
        what = f"the {split_key(key)[1]} rung" if split_key(key)[1] else "the stage"
        return (f'\n\n!!! note "{NOT_MEASURED}"\n    `results/*.json` has no entry for `{key}`: not measured yet. '
                f"Grade {what} on your own GPU to see its numbers (`python -m grader {short_key(key)} --solution`).\n\n")
    return gpu_tabs([(run, stage_run_md(run, key)) for run in found])


def stage_run_md(run: dict, key: str) -> str:
    st = run["stages"][key]
    c, goal, p = st.get("correctness") or {}, st.get("goal") or {}, measured(run, st)
    benches = st.get("benchmarks") or []
    metric = panel_of(st.get("problem")).metric
    score = f"{100 * st['score']:.0f} % of the goal" if st.get("score") is not None else "no score"
    rung = split_key(key)[1]
    out = [f"\n\nOn the **{gpu_of(run)}** (`results/{run.get('_file', '?')}`)"
           + (f", {stage_name(key)} (`python -m grader {short_key(key)}`)" if rung else "") + ": "
           f"**Grade {st.get('grade', '—')}**: {score} ({goal.get('text', '—')}). "
           f"Correctness: {c.get('passed', '—')} cases passed, {c.get('failed', '—')} failed. "
           f"Measured {when(p)}, with {environment(p) or 'no environment recorded'}.\n",
           '<div class="fm-results" markdown>\n']
    out += speed_table(run, key, benches, metric)
    out += timing_details(benches)
    out += forward_backward_details(benches)
    out.append(stage_figure(timed(st), metric))
    out += launches_table(timed(st))
    out += resources_table(st.get("resources") or {})
    out.append("\n</div>")
    out += cases_details(c)
    return "\n".join(out) + "\n\n"


# ---------------------------------------------------------------- a stage's profile beside the reference's

NOT_PROFILED = "Not profiled yet"


def module_at(path: Path, name: str):
    """The module in the file at `path`, loaded by itself (not through its package, whose __init__ may import
    torch or grow imports): the course's files the hook reads import only the standard library at their top."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def profile_helpers():
    """grader/profile.py (module_at): its report's pure helpers (table_rows, heading, short_name, top_stalls,
    verdict, _cell) and STALL_REASONS, so that the site shows what `python -m grader stageN --profile` prints."""
    return module_at(ROOT / "grader" / "profile.py", "flashmoe_grader_profile")


def stall_reasons_md() -> str:
    """grader/profile.py's STALL_REASONS as a table: the reason, and what it means and what to do."""
    P = profile_helpers()
    rows = [f"| `{reason}` | {html.escape(why)}"
            + (" (counted on sm_90 only)" if reason in P.STALLS_ONLY_ON else "") + " |"
            for reason, why in P.STALL_REASONS.items()]
    return ('\n\n<div class="fm-results" markdown>\n\n| Reason | What the warp waits for, and what to try |\n|---|---|\n'
            + "\n".join(rows) + "\n\n</div>\n\n")


# ---------------------------------------------------------------- stage 11's records across GPUs

EXPERT_PARALLEL_RECORDS = ROOT / "stages" / "stage11_expert_parallel" / "records.py"


@functools.lru_cache(maxsize=None)
def expert_parallel_records():
    """stages/stage11_expert_parallel/records.py (module_at): plain JSON and text, the tables the runner prints."""
    return module_at(EXPERT_PARALLEL_RECORDS, "flashmoe_expert_parallel_records")


def expert_parallel_md() -> str:
    """The records of results/expert-parallel/ ($FLASHMOE_RESULTS_DIR/expert-parallel/ with the override):
    each record's tables under a heading of its own, or "Not measured yet." without records."""
    tables = expert_parallel_records().lesson_tables(results_folder()[0] / "expert-parallel")
    return f'\n\n<div class="fm-results" markdown>\n\n{tables}\n\n</div>\n\n'


# ---------------------------------------------------------------- stage 10's training records

TRAINING_RECORDS = ROOT / "stages" / "stage10_model" / "records.py"
TRAIN_COMMAND = "python -m stages.stage10_model.train"


@functools.lru_cache(maxsize=None)
def training_records():
    """stages/stage10_model/records.py (module_at): the sizes trained, the ways' names, the records files."""
    return module_at(TRAINING_RECORDS, "flashmoe_training_records")


def training_md() -> str:
    """The records of results/training/ ($FLASHMOE_RESULTS_DIR/training/ with the override), a tab per GPU
    (the H100's first): each run's loss curves and tokens/s, then the sizes not measured on that GPU; a note
    where no file is."""
    R = training_records()
    found = R.load(results_folder()[0] / "training")
    if not found:
        return (f'\n\n!!! note "{NOT_MEASURED}"\n    No `results/training/*.json` holds a training run: '
                f"{unmeasured_md(list(R.TRAINED))}\n\n")
    return gpu_tabs([(file, training_file_md(file)) for file in sorted(found, key=lambda f: FIRST_GPU not in gpu_of(f))])


def unmeasured_md(names: list[str]) -> str:
    """"Not measured yet: llama (...), moe-llama (...); `python -m ... --model llama moe-llama` measures them"."""
    R = training_records()
    sizes = "; ".join(f"**{name}** ({html.escape(R.describe(name), quote=False)})" for name in names)
    return (f"{NOT_MEASURED}: {sizes}. `{TRAIN_COMMAND} --model {' '.join(names)} --json results/training/<gpu>.json` "
            "measures them.")


def training_file_md(file: dict) -> str:
    """One GPU's runs, in the order of TRAINED's sizes (then any other), then the sizes it lacks."""
    R = training_records()
    order = {name: i for i, name in enumerate(R.TRAINED)}
    runs = sorted(file.get("runs", []), key=lambda r: (order.get(r.get("model"), len(order)), r.get("batch", 0)))
    out = [f"\n\nOn the **{gpu_of(file)}** (`results/training/{file.get('_file', '?')}`).\n"]
    out += [training_run_md(run) for run in runs]
    if missing := R.unmeasured(runs):
        out.append(unmeasured_md(missing))
    return "\n\n".join(out) + "\n\n"


def training_run_md(run: dict) -> str:
    """A run's heading line, its loss curves (loss_chart) and its table of tokens/s."""
    R = training_records()
    ways = [w for w in R.WAYS if w in run.get("ways", {})] + [w for w in run.get("ways", {}) if w not in R.WAYS]
    where = ", ".join(bit for bit in (when(run), f"torch {run['torch']}" if run.get("torch") else "", run.get("machine", ""))
                      if bit)
    head = (f"**{html.escape(str(run.get('model')), quote=False)}**: {html.escape(str(run.get('label', '')), quote=False)}, "
            f"{run.get('steps')} "
            f"steps, AdamW lr {run.get('lr', '—')}; {where}. `{run.get('command', '')}`")
    notes = [f"{way_name(w)}: skipped ({html.escape(str(why))})." for w, why in (run.get("skipped") or {}).items()]
    notes += [f"{way_name(w)}: failed ({html.escape(str(why))})." for w, why in (run.get("failed") or {}).items()]
    notes += [f"{way_name(w)}: {r['cudagraph_skips']} of its compiled graphs ran without CUDA graphs."
              for w, r in run["ways"].items() if r.get("cudagraph_skips")]
    return "\n\n".join([head, loss_chart(run, ways), training_table(run, ways)] + notes)


def way_name(way: str) -> str:
    return html.escape(training_records().WAYS.get(way, way), quote=False)


def way_colors() -> dict:
    """Each way's colour, the same in every chart."""
    names = list(training_records().WAYS)
    return dict(zip(names, palette(len(names))))


def logged_steps(run: dict) -> list[int]:
    """The steps whose losses a run logged: 0, every, 2·every, ... and the last."""
    steps, every = run["steps"], run["every"]
    return [*range(0, steps, every)] + ([steps - 1] if (steps - 1) % every else [])


def loss_chart(run: dict, ways: list[str]) -> str:
    """Each way's cross-entropy by step, a line each, the compiled ways' dashed: drawn wide and narrow."""
    if not any(run["ways"][w]["losses"] for w in ways):
        return ""
    colors = way_colors()
    keys = " ".join(swatch(colors.get(w, "#888"), training_records().WAYS.get(w, w)) for w in ways)
    return figure(loss_drawing(run, ways, WIDE),
                  f"The cross-entropy of each way, logged every {run['every']} steps (compiled ways dashed). " + keys,
                  narrow=loss_drawing(run, ways, NARROW, " fm-narrow"))


def loss_drawing(run: dict, ways: list[str], W: int, narrow: str = "") -> str:
    """loss_chart's drawing, W wide."""
    xs = logged_steps(run)
    curves = {w: list(zip(xs, run["ways"][w]["losses"])) for w in ways}
    values = [loss for curve in curves.values() for _, loss in curve]
    H, left, right, top, bottom = 260, 58, 12, 12, 40
    step = nice_step(max(max(values) - min(values), 1e-3) / 4)
    lo, hi = step * math.floor(min(values) / step), step * math.ceil(max(values) / step)
    x = lambda s: left + s / max(xs[-1], 1) * (W - left - right)  # noqa: E731
    y = lambda v: H - bottom - (v - lo) / (hi - lo) * (H - top - bottom)  # noqa: E731
    middle = (top + H - bottom) / 2
    body = [f'<text class="fm-axis" x="14" y="{middle}" transform="rotate(-90 14 {middle})" text-anchor="middle">'
            "cross-entropy (nats)</text>",
            f'<text class="fm-axis" x="{(left + W - right) / 2}" y="{H - 6}" text-anchor="middle">step</text>']
    for k in range(round((hi - lo) / step) + 1):
        t = lo + k * step
        body.append(f'<line class="fm-grid" x1="{left}" x2="{W - right}" y1="{y(t):.1f}" y2="{y(t):.1f}"/>'
                    f'<text class="fm-axis" x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    every_x = nice_step(max(xs[-1], 1) / (5 if W == WIDE else 2))
    body += [f'<text class="fm-axis" x="{x(s):.1f}" y="{H - bottom + 16}" text-anchor="middle">{s:g}</text>'
             for s in (every_x * k for k in range(int(xs[-1] // every_x) + 1))]
    colors = way_colors()
    for w, curve in curves.items():
        dash = ' stroke-dasharray="6 3"' if "compile" in w else ""
        points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in curve)
        body.append(f'<polyline fill="none" stroke="{colors.get(w, "#888")}" stroke-width="1.5"{dash} points="{points}">'
                    f"<title>{way_name(w)}: {curve[0][1]:.3f} at step 0, {curve[-1][1]:.3f} at step {curve[-1][0]}"
                    "</title></polyline>")
    return svg_root("fm-training" + narrow, W, H, f"The loss of each way by step: {run.get('model')}", body)


def training_table(run: dict, ways: list[str]) -> str:
    """tokens/s after the warm-up, against PyTorch eager's; the warm-up's seconds; the last loss and the
    largest gap to PyTorch eager's loss at a logged step."""
    R = training_records()
    base = run["ways"].get(R.BASELINE)
    rows = ["| way | tokens/s | × PyTorch eager | warm-up s | last loss | largest gap to PyTorch eager's loss |",
            "|---|--:|--:|--:|--:|--:|"]
    for w in ways:
        r = run["ways"][w]
        speed = times(r["tokens_per_s"] / base["tokens_per_s"] if base and w != R.BASELINE else None)
        gap = (max(abs(a - b) for a, b in zip(r["losses"], base["losses"])) if base and w != R.BASELINE else None)
        rows.append(f"| {way_name(w)} | {r['tokens_per_s']:,.0f} | {speed} | {num(r.get('warmup_s'), '.1f')} "
                    f"| {r['losses'][-1]:.3f} | {num(gap, '.3f')} |")
    return '<div class="fm-results" markdown>\n\n' + "\n".join(rows) + "\n\n</div>"


# ---------------------------------------------------------------- `python -m grader ops` (docs/pytorch.md)

def ops_of(run: dict) -> dict:
    """The run's "ops" entry (grader/ops_benchmark.py's figures), {} where it has none or one marked stale."""
    ops = run.get("ops") or {}
    return {} if ops.get("stale") else ops


def ops_md(runs: list[dict]) -> str:
    """The ops' figures of each results file that has them, a tab per GPU where there are several."""
    found = [run for run in runs if ops_of(run)]
    if not found:
        return (f'\n\n!!! note "{NOT_MEASURED}"\n    {NOT_MEASURED}. No `results/*.json` holds the figures of '
                "`python -m grader ops`: run `python -m grader ops --json results/<gpu>.json` on your GPU to "
                "see them.\n\n")
    return gpu_tabs([(run, ops_run_md(run)) for run in found])


def us(value) -> str:
    return "—" if value is None else f"{value:,.0f}"


def ms3(value) -> str:
    return "—" if value is None else sig3(value)


def times(value) -> str:
    return "—" if not value else ratio(value)


def attention_shape(shape: dict) -> str:
    """{"B": 2, "H": 32, "Hkv": 8, "S": 2048, "D": 64} -> "B2 H32/8 S2048 D64"."""
    heads = f"H{shape.get('H')}" + (f"/{shape['Hkv']}" if shape.get("Hkv") not in (None, shape.get("H")) else "")
    return f"B{shape.get('B')} {heads} S{shape.get('S')} D{shape.get('D')}"


def ops_run_md(run: dict) -> str:
    ops = ops_of(run)
    p = ops.get("provenance") or run.get("provenance") or {}
    out = [f"\n\nOn the **{gpu_of(run)}** (`results/{run.get('_file', '?')}`), measured by `python -m grader ops` at {when(p)}, "
           f"with {environment(p, ('sm_clock_mhz', 'driver', 'torch', 'cuda_core')) or 'no environment recorded'}. "
           "Medians of side-by-side rounds; ms is wall time per call of a loop of calls.\n",
           '<div class="fm-results" markdown>\n']
    out += ops_attention_table(ops.get("attention") or [])
    out += ops_breakdown_table(ops.get("host_breakdown") or {}, ops.get("attention") or [])
    out += ops_tiny_table(ops.get("tiny") or [])
    out += ops_moe_table(ops.get("moe_layer") or [])
    out += ops_models_table(ops.get("models") or [])
    out.append("\n</div>")
    return "\n".join(out) + "\n\n"


def ops_attention_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    dtype = DTYPES.get((rows[0].get("shape") or {}).get("dtype"), "")
    out = [f"\n**`ops.attention`** ({dtype}, causal, q, k, v as the `[B, H, S, D]` views of `[B, S, H, D]` "
           "projections), course / SDPA:\n",
           "| shape | host µs forward | host µs backward | fwd + bwd ms | × SDPA |", "|---|--:|--:|--:|--:|"]
    for row in rows:
        host, ms = row.get("host_us") or {}, row.get("ms") or {}
        out.append(f"| {attention_shape(row.get('shape') or {})} "
                   f"| {us(host.get('course_forward'))} / {us(host.get('sdpa_forward'))} "
                   f"| {us(host.get('course_backward'))} / {us(host.get('sdpa_backward'))} "
                   f"| {ms3(ms.get('course_forward_backward'))} / {ms3(ms.get('sdpa_forward_backward'))} "
                   f"| {times(row.get('speedup_forward_backward'))} |")
    return out


def ops_breakdown_table(pieces: dict, attention: list[dict]) -> list[str]:
    """The host µs of one forward and one backward call, whole and by piece (the pieces the benchmark
    names, in its order); the shape is the first attention shape's (ops_benchmark.host_breakdown's default)."""
    directions = [d for d in ("forward", "backward") if isinstance(pieces.get(d), dict)]
    if not directions:
        return []
    shape = pieces.get("shape") or (attention[0].get("shape") if attention else None)
    at = f" at {attention_shape(shape)}" if shape else ""
    names = list(dict.fromkeys(name for d in directions for name in pieces[d]))
    out = [f"\nThe host time of one `ops.attention` call{at}, by piece (µs: the pieces of the call whose whole "
           "time is the median of 30, timed inside it; a \"rest\" is what a piece spent outside the pieces "
           "below it):\n",
           "| piece | " + " | ".join(directions) + " |", "|---|" + "--:|" * len(directions)]
    for name in names:
        cells = " | ".join(us(pieces[d].get(name)) for d in directions)
        out.append(f"| {'**whole call**' if name == 'whole' else html.escape(name, quote=False)} | {cells} |")
    return out


def ops_tiny_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["\nThe tiny shapes (fp16, D 64, forward):\n",
           "| shape | course ms | SDPA ms | × SDPA |", "|---|--:|--:|--:|"]
    for row in rows:
        out.append(f"| {shape_label(row)} | {ms3(row.get('course_ms'))} | {ms3(row.get('sdpa_ms'))} "
                   f"| {times(row.get('ratio'))} |")
    return out


def ops_moe_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    first = rows[0].get("shape") or {}
    others = list(dict.fromkeys(k for row in rows for k in (row.get("ms") or {}) if k != "course"))
    out = [f"\n**`ops.moe_layer`** ({moe_shape(first)}), forward:\n",
           "| tokens | host µs | course ms | " + " | ".join(f"{name} ms | × {name}" for name in others) + " |",
           "|--:|--:|--:|" + "--:|--:|" * len(others)]
    for row in rows:
        ms = row.get("ms") or {}
        cells = "".join(f" {ms3(ms.get(name))} | {times(ms[name] / ms['course'] if ms.get(name) and ms.get('course') else None)} |"
                        for name in others)
        out.append(f"| {(row.get('shape') or {}).get('tokens', '—')} | {us(row.get('host_us'))} "
                   f"| {ms3(ms.get('course'))} |{cells}")
    return out


def moe_shape(shape: dict) -> str:
    """{"hidden": 4096, "inter": 14336, "experts": 8, "top_k": 2, "dtype": "bfloat16"} ->
    "hidden 4096, inter 14336, 8 experts, top-2, bf16"."""
    bits = [f"hidden {shape['hidden']}" if "hidden" in shape else "", f"inter {shape['inter']}" if "inter" in shape else "",
            f"{shape['experts']} experts" if "experts" in shape else "", f"top-{shape['top_k']}" if "top_k" in shape else "",
            DTYPES.get(shape.get("dtype"), shape.get("dtype") or "")]
    return ", ".join(b for b in bits if b)


def ops_models_table(rows: list[dict]) -> list[str]:
    """Whole transformers models: the course's ops registered in them, beside SDPA and eager attention
    (for the Mixtral block, "eager" is the block's own forward); a skipped measurement says why."""
    timed_models = [row for row in rows if row.get("course_ms")]
    skipped = [row["skipped"] for row in rows if row.get("skipped")]
    out = [f"\nWhole models: not measured ({html.escape(str(why))})." for why in skipped]
    out += [f"\nWhole models, compiled, {row['batch']} × {row['seq']}: failed ({html.escape(str(row['failed']))})."
            for row in rows if row.get("failed")]
    if not timed_models:
        return out
    out += ["\nWhole transformers models, with the course's ops in them (ms per step):\n",
            "| model | tokens | course ms | SDPA ms | eager ms | × SDPA | × eager |", "|---|--:|--:|--:|--:|--:|--:|"]
    for row in timed_models:
        name = str(row.get("model", "?"))
        what = name.split(" ")[0] + (" forward" if "(forward)" in name else " forward + backward") + \
            (", compiled" if row.get("compiled") else "")
        tokens = f"{row['batch']} × {row['seq']}" if row.get("batch") else str(row.get("tokens", "—"))
        course, sdpa_ms, eager = row.get("course_ms"), row.get("sdpa_ms"), row.get("eager_ms")
        out.append(f'| <span title="{html.escape(name)}">{html.escape(what, quote=False)}</span> | {tokens} | {ms3(course)} '
                   f"| {ms3(sdpa_ms)} | {ms3(eager)} | {times(sdpa_ms / course if sdpa_ms else None)} "
                   f"| {times(eager / course if eager else None)} |")
    out.append("\n<small>Hover a model for its configuration. For a MoE block, \"eager\" is the block's own "
               "forward. Compiled: `torch.compile(model, fullgraph=True)` in its default mode, the course's "
               "attention against SDPA, each compiled once.</small>")
    return out


def profile_md(key: str, runs: list[dict]) -> str:
    """A stage's (or rung's) profile on each GPU whose results hold the stage, a tab each where there
    are several; a GPU whose entry has no profile says so."""
    name, rung = split_key(key)
    if key not in ladder_of(name) and not any(key in run.get("stages", {}) for run in runs):
        raise PluginError(f"<!-- profile:{key} -->: no such stage or rung (stages/{name}/ names "
                          f"{', '.join(ladder_of(name))})")
    found = [run for run in runs if key in run.get("stages", {})]
    earlier = [run for run in runs if key not in run.get("stages", {}) and key in run.get("stale_profiles", {})]
    command = f"`python -m grader {short_key(key)} --profile`"
    if not any((run["stages"][key].get("profile") or {}).get("kernels") for run in found) and not earlier:
        return (f'\n\n!!! note "{NOT_PROFILED}"\n    `results/*.json` has no profile of `{key}`: not profiled yet. '
                f"Profile it on your own GPU with {command} (Nsight Compute must be installed; see "
                "[Reading a profile](../grading.md#reading-a-profile)).\n\n")
    return gpu_tabs([(run, profile_run_md(run, key)) for run in found] +
                    [(run, earlier_profile_md(run, key)) for run in earlier])


def earlier_profile_md(run: dict, key: str) -> str:
    """The profile of a stage entry marked stale: an earlier kernel's, said so with the entry's reason."""
    entry = run["stale_profiles"][key]
    note = (f'\n\n!!! note "An earlier kernel\'s profile"\n    Profiled with the sources of '
            f"{when(measured(run, entry)).replace('`', '')}; the record is stale since: {entry['stale']}.\n")
    return note + profile_run_md({**run, "stages": {key: entry}}, key)


def profile_run_md(run: dict, key: str) -> str:
    P = profile_helpers()
    st = run["stages"][key]
    p = st.get("profile") or {}
    where = f"the **{gpu_of(run)}** (`results/{run.get('_file', '?')}`)"
    if not p.get("kernels"):
        return (f"\n\nNot profiled on {where}: `python -m grader {short_key(key)} --profile --json "
                f"results/{run.get('_file', '<gpu>.json')}` would add it.\n\n")
    ref = p.get("reference") or {}
    ref_name = ref.get("name") or "the reference"
    settings = p.get("settings") or {}
    kernels = p["kernels"]
    shape = " ".join(filter(None, [p.get("label"), DTYPES.get(p.get("dtype"), p.get("dtype"))]))
    index = p.get("shape_index")
    ref_ms = f", {ref['ms']:.3f} ms in the grader's timing" if ref.get("ms") else ""
    out = [f"\n\nOn {where}: Nsight Compute at **{html.escape(shape)}**"
           + (f" (benchmark shape {index}: `python -m grader {short_key(key)} --profile {index}`)" if index is not None else "")
           + f", beside **{html.escape(ref_name)}**, the fastest library baseline{ref_ms}. "
           f"Settings: {settings.get('text') or P.SETTINGS_TEXT}; ncu {settings.get('ncu') or 'version not recorded'}; "
           f"profiled {when(p.get('measured') or measured(run, st))}. "
           "How to read it: [Reading a profile](../grading.md#reading-a-profile).\n",
           '<div class="fm-results fm-profile" markdown>\n']

    def column(k: dict) -> str:
        who = "ours" if k.get("side") == "kernel" else ref_name
        other = str(k.get("name", "")).startswith("other")
        short = k.get("name") if other else P.short_name(str(k.get("name", "?")), 24)
        launches = f" ×{k['launches']}" if (k.get("launches") or 1) > 1 and not other else ""
        return (f'{html.escape(who)}<br><span title="{html.escape(str(k.get("name", "")))}">'
                f"{html.escape(short).replace('_', '_<wbr>')}</span>{launches}").replace("|", "&#124;")

    cells = [P.table_rows(k.get("metrics") or {}) for k in kernels]
    out += ["| Metric | " + " | ".join(column(k) for k in kernels) + " |", "|---|" + "--:|" * len(kernels)]
    out += ["| " + " | ".join([row, *[c[i][1] for c in cells]]) + " |" for i, (row, _) in enumerate(cells[0])]
    totals = p.get("totals") or {}
    ours, theirs = (totals.get("kernel") or {}), (totals.get("reference") or {})
    if ours.get("duration") and theirs.get("duration"):
        out += ["", f"All the profiled launches: ours {P._cell(ours['duration'], 'ns')} in {ours.get('launches', '—')} "
                f"launch{'es' * (ours.get('launches') != 1)}, {html.escape(ref_name)} {P._cell(theirs['duration'], 'ns')} "
                f"in {theirs.get('launches', '—')}: ours take {ratio(ours['duration'] / theirs['duration'])} "
                f"{html.escape(ref_name)}'s time "
                f"at base clocks. DRAM traffic: ours {P._cell(ours.get('dram_bytes'), 'bytes')}, "
                f"{html.escape(ref_name)} {P._cell(theirs.get('dram_bytes'), 'bytes')}."]
    stalls = {id(k): k.get("top_stalls") or P.top_stalls(k.get("stalls") or {}) for k in kernels}
    out += ["", "| Kernel | Top warp stalls (share of the stalled cycles) |", "|---|---|"]
    out += [f"| {column(k).replace('<br>', ' ')} | "
            + (" · ".join(f"`{s['reason']}` {s['share']:.0f}%" for s in stalls[id(k)]) or "—") + " |" for k in kernels]
    out.append("\n</div>\n")
    seen = list(dict.fromkeys(s["reason"] for k in kernels for s in stalls[id(k)]))
    out += [f"- `{reason}`: {html.escape(P.STALL_REASONS.get(reason, '(no explanation recorded)'))}" for reason in seen]
    out += ["", "The verdicts (see [the rule](../grading.md#reading-a-profile)):", ""]
    for k in kernels:
        v = k.get("verdict") or P.verdict(k.get("metrics") or {}, k.get("stalls") or {})
        out.append(f"- **{column(k).replace('<br>', ' ')}**: {v['bound']}-bound ({v['why']}). "
                   f"First look at: {html.escape(v['first'])}.")
    return "\n".join(out) + "\n\n"


# ---------------------------------------------------------------- a stage and its rungs side by side

def rungs_md(name: str, runs: list[dict]) -> str:
    """The stage and the rungs of its ladder at each shape, on each GPU that measured any of them."""
    if len(ladder_of(name)) == 1:
        raise PluginError(f"<!-- rungs:{name} -->: stages/{name}/ has no ladder (no RUNGS)")
    found = [run for run in runs if any(k in run.get("stages", {}) for k in ladder_keys(name, run))]
    if not found:
        commands = ", ".join(f"`python -m grader {short_key(k)}`" for k in reversed(ladder_of(name)))
        return (f'\n\n!!! note "{NOT_MEASURED}"\n    `results/*.json` has no entry for {stage_name(name).lower()} '
                f"or its rungs: not measured yet. Grade them on your own GPU: {commands}.\n\n")
    return gpu_tabs([(run, rungs_table(run, name)) for run in found])


def kernel_label(key: str) -> str:
    """A step of a ladder in a table: "mma_sync rung", or "Stage 6 (wgmma)" for the stage's own kernel."""
    name, rung = split_key(key)
    return f"{rung} rung" if rung else f"{stage_name(name)} ({LADDER_TOPS.get(name, 'own kernel')})"


def rungs_table(run: dict, name: str) -> str:
    """Rows of shapes, each with the ladder's kernels from the lowest up: time, speed, and the
    speed-up over the row above (the step below); each kernel's own table has the rest."""
    stages = run["stages"]
    keys = [k for k in reversed(ladder_keys(name, run)) if k in stages]  # the lowest rung first
    metric = panel_of(stages[keys[-1]].get("problem")).metric
    benches = {k: {label(b): b for b in stages[k].get("benchmarks") or []} for k in keys}
    shapes = list(dict.fromkeys(shape for k in reversed(keys) for shape in benches[k]))  # the stage's order first
    rows = [f"| Shape, kernel | ms | {METRICS[metric]} | × the rung below |", "|---|--:|--:|--:|"]
    for shape in shapes:  # a row naming the shape, then one per kernel: four columns fit beside the nav
        rows.append(f"| **{shape}** | | | |")
        below = None
        for key in keys:
            b, cells = benches[key].get(shape), [f"&emsp;{kernel_label(key)}"]
            if b is None:
                cells += ["not timed at this shape", "", ""]
            elif "failure" in b or not b.get("ms"):
                cells += [f"failed: {html.escape(str(b.get('failure', 'no time')))}", "", ""]
            else:
                step = step_at(run, key, b)
                cells += [num(b.get("ms"), ".3f"), num(b.get(metric), ".1f"),
                          f"{ratio(step.speedup)} <small>{step_note(step, step.previous != below, key)}</small>" if step else ""]
                below = key
            rows.append("| " + " | ".join(cells) + " |")
    grades = "; ".join(f"{kernel_label(k)} **{stages[k].get('grade', '—')}** (goal: {(stages[k].get('goal') or {}).get('text', '—')})"
                       for k in keys)
    missing = [k for k in reversed(ladder_keys(name, run)) if k not in stages]
    text = (f"\n\nOn the **{gpu_of(run)}** (`results/{run.get('_file', '?')}`): {grades}.\n\n"
            + '<div class="fm-results" markdown>\n\n' + "\n".join(rows) + "\n\n</div>\n\n<small>"
            + "× the rung below: timed side by side in one grader run (same run), or the ratio of the medians "
              "recorded in separate runs (separate runs).</small>\n")
    if missing:
        text += (f"\n{NOT_MEASURED} on the {gpu_of(run)}: "
                 + ", ".join(f"{kernel_label(k)} (`python -m grader {short_key(k)}`)" for k in missing) + ".\n")
    return text + "\n"


def speed_table(run: dict, key: str, benches: list[dict], metric: str) -> list[str]:
    """The key columns only, so that they fit a laptop's screen; the rest is in the details below."""
    if not benches:
        return ["No benchmark was timed (the grader times a stage only once every correctness case passes)."]
    steps = {label(b): step_at(run, key, b) for b in timed_rows(benches)}
    previous = {step.previous for step in steps.values() if step}
    refs = {(b.get("reference") or {}).get("name", "—") for b in benches if "failure" not in b}
    one_ref = next(iter(refs)) if len(refs) == 1 else None  # then named once, in the header: a narrower column
    head = ["Shape", "ms", METRICS[metric], f"% of the reference{f' ({one_ref})' if one_ref else ''}", "× naive"]
    if previous:
        head.append(f"× {below_name(next(iter(previous)), key)}" if len(previous) == 1 else "× the step below")
    out = ["| " + " | ".join(head) + " |", "|---|" + "--:|" * (len(head) - 1)]
    for b in benches:
        if "failure" in b:
            out.append(f"| {label(b)} | failed: {html.escape(str(b['failure']))} |" + " |" * (len(head) - 2))
            continue
        b = with_token_rate(b)
        ref = b.get("reference") or {}
        cells = [label(b), num(b.get("ms"), ".3f"), num(b.get(metric), ".1f"),
                 num(b.get('pct_of_reference'), '.1f') + ("" if one_ref else f" ({ref.get('name', '—')})"),
                 num(b.get("speedup_vs_naive"), ".2f", "×")]
        if previous:
            step = steps.get(label(b))
            cells.append(f"{ratio(step.speedup)} <small>{step_note(step, len(previous) > 1, key)}</small>" if step else "—")
        out.append("| " + " | ".join(cells) + " |")
    remarks = [f"- {label(b)}: {text}" for b in benches for text in (b.get("flags") or []) + (b.get("notes") or [])]
    return out + (["", "The grader noted:", ""] + remarks if remarks else [])


def timing_details(benches: list[dict]) -> list[str]:
    """Minimum, spread, peak, bandwidth, memory, and every baseline's time, in a collapsed block."""
    rows = timed_rows(benches)
    if not rows:
        return []
    table = ["| Shape | Median ms | Min ms | Spread | TFLOP/s | % of peak | % of bandwidth | Extra memory |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for b in rows:
        spread = None if b.get("spread") is None else 100 * b["spread"]
        table.append(f"| {label(b)} | {num(b.get('ms'), '.3f')} | {num(b.get('ms_min'), '.3f')} | {num(spread, '.1f', ' %')} "
                     f"| {num(b.get('tflops'), '.1f')} | {num(b.get('pct_peak'), '.1f')} | {num(b.get('pct_bandwidth'), '.1f')} "
                     f"| {mib(b.get('extra_memory_bytes'))} |")
    names = list(dict.fromkeys(n for b in rows for n in (b.get("baselines") or {})))
    if names:
        table += ["", "Median milliseconds of this kernel and of the baselines, timed in the same loop "
                  "(—: not timed, e.g. the backend does not take the shape or would run out of memory):", "",
                  "| Shape | This kernel | " + " | ".join(names) + " |", "|---|--:|" + "--:|" * len(names)]
        table += [f"| {label(b)} | {num(b.get('ms'), '.3f')} | "
                  + " | ".join(num((b.get("baselines") or {}).get(n), ".3f") for n in names) + " |" for b in rows]
    return ["", '??? info "Timing details: minimum and spread, % of peak and bandwidth, extra memory, the baselines\' times"',
            ""] + ["    " + line if line else "" for line in table]


def forward_backward_details(benches: list[dict]) -> list[str]:
    """A backward's stage: the course's forward kernel then this one, against each library's forward +
    backward, timed in the same loop (the rows' "forward_backward"), in a collapsed block."""
    rows = [(label(b), b["forward_backward"]) for b in timed_rows(benches) if isinstance(b.get("forward_backward"), dict)]
    if not rows:
        return []
    names = list(dict.fromkeys(n for _, both in rows for n in (both.get("baselines") or {})))
    forward = next((both.get("stage") for _, both in rows if both.get("stage")), None)
    first = f"{possessive(forward)}'s forward kernel" if forward else "the course's forward kernel"
    table = [f"Forward + backward: {first}, then "
             "this kernel, against each library's forward and backward, timed in the same loop (median ms; TFLOP/s: "
             "the forward's and the backward's FLOPs over the time; —: not timed):", "",
             "| Shape | This course | TFLOP/s | " + " | ".join(names) + " |", "|---|--:|--:|" + "--:|" * len(names)]
    table += [f"| {shape} | {num(both.get('ms'), '.3f')} | {num(both.get('tflops'), '.1f')} | "
              + " | ".join(num((both.get("baselines") or {}).get(n), ".3f") for n in names) + " |" for shape, both in rows]
    return ["", '??? info "Forward + backward: the course\'s forward and backward kernels against each library\'s"',
            ""] + ["    " + line if line else "" for line in table]


def stage_figure(benches: list[dict], metric: str) -> str:
    """Horizontal bars per shape: this kernel and each baseline (not the yardsticks) in the metric, each
    shape's label left of its bars (and above them in the narrow drawing)."""
    names = [n for n in dict.fromkeys(n for b in benches for n in (b.get("baselines") or {})) if not is_yardstick(n)]
    series = ["this kernel"] + names
    rows = [(label(b), [b.get(metric)] + [at_time(b, metric, (b.get("baselines") or {}).get(n)) for n in names]) for b in benches]
    top = max((v for _, vs in rows for v in vs if v), default=None)
    if not top:
        return ""
    unit = METRICS[metric]
    aria = f"{unit} of this stage and the baselines"
    longest = max(len(text) for text, _ in rows)  # the shapes' labels, right-aligned left of the bars: 12 px text
    left, right, bar, gap = max(260, 16 + 7 * longest), 56, 13, 12  # bar: the 11 px values beside them
    W = max(WIDE, left + 300 + right)
    H = 8 + len(rows) * (len(series) * bar + gap)
    scale = (W - left - right) / top
    body, y = [], 8
    for text, values in rows:
        body.append(f'<text class="fm-label" x="{left - 8}" y="{y + len(series) * bar / 2 + 4:.1f}" text-anchor="end">{html.escape(text)}</text>')
        for i, v in enumerate(values):
            if v:
                body += stage_bar(series[i], v, unit, COLORS[i % len(COLORS)], left, y, bar, scale)
            y += bar
        y += gap
    keys = " ".join(swatch(COLORS[i % len(COLORS)], s) for i, s in enumerate(series))
    work = "FLOP count" if metric == "tflops" else "fewest bytes the problem must move"
    return figure(svg_root("fm-stage", W, H, aria, body),
                  f"{html.escape(unit)} at each benchmark shape (a baseline's: the same {work} over its own time). {keys}",
                  stage_narrow(rows, series, unit, top, aria, bar, gap))


def stage_bar(name: str, value: float, unit: str, color: str, x: float, y: float, bar: float, scale: float) -> list[str]:
    """A bar from x, and its value after it."""
    return [f'<rect x="{x:g}" y="{y:g}" width="{max(value * scale, 1):.1f}" height="{bar - 1}" fill="{color}">'
            f'<title>{html.escape(name)}: {value:.1f} {unit}</title></rect>'
            f'<text class="fm-axis" x="{x + value * scale + 4:.1f}" y="{y + bar - 3:g}">{value:.1f}</text>']


def stage_narrow(rows: list[tuple[str, list]], series: list[str], unit: str, top: float, aria: str, bar: float, gap: float) -> str:
    """The stage's chart at NARROW: each shape's label above its bars, the bars across the width less their values'."""
    scale = (NARROW - text_width(f"{top:.1f}", 11) - 6) / top
    body, y = [], 0.0
    for text, values in rows:
        lines = wrapped(text, 12)
        body.append(lines_text("fm-label", 0, y + 12, lines, 15))
        y += 15 * len(lines) + 4
        for i, v in enumerate(values):
            if v:
                body += stage_bar(series[i], v, unit, COLORS[i % len(COLORS)], 0, y, bar, scale)
            y += bar
        y += gap
    return svg_root("fm-stage fm-narrow", NARROW, y - gap + 4, aria, body)


def launches_table(benches: list[dict]) -> list[str]:
    """How each kernel was launched, and what fits on an SM: one row per kernel and configuration."""
    configs: dict[tuple, list[tuple[str, list]]] = {}
    for b in benches:
        for kernel, launch in (b.get("launches") or {}).items():
            config = (kernel, tuple(launch.get("block") or ()), launch.get("smem"), launch.get("blocks_per_sm"),
                      launch.get("warps_per_sm"), launch.get("occupancy"))
            configs.setdefault(config, []).append((label(b), launch.get("grid") or []))
    if not configs:
        return []
    out = ["", "How each kernel was launched: the grid and block, the dynamic shared memory asked at launch, and how "
           "many blocks and warps of it fit on one SM at once ([occupancy](../glossary.md#occupancy): those warps over "
           "the most an SM can hold):", "",
           "| Kernel | Shapes | Grid | Block | Dynamic shared memory | Per SM (occupancy) |", "|---|---|--:|--:|--:|--:|"]
    every = [label(b) for b in benches]
    kernels = list(dict.fromkeys(config[0] for config in configs))  # in launch order, each kernel's rows together
    for (kernel, block, smem, blocks, warps, occupancy), uses in sorted(configs.items(), key=lambda kv: kernels.index(kv[0][0])):
        per_sm = f"{blocks} blocks, {warps} warps ({num(None if occupancy is None else 100 * occupancy, '.0f', ' %')})"
        out.append(f"| `{kernel}` | {shapes_phrase([s for s, _ in uses], every, benches)} | {grid_text([g for _, g in uses])} "
                   f"| {' × '.join(map(str, block)) or '—'} | {kib(smem)} | {per_sm} |")
    return out


def grid_text(grids: list[list[int]]) -> str:
    distinct = list(dict.fromkeys(tuple(g) for g in grids))
    if len(distinct) == 1:
        return " × ".join(f"{n:,}" for n in distinct[0]) or "—"
    blocks = [math.prod(g) for g in distinct]
    return f"{min(blocks):,} – {max(blocks):,} blocks"


def shapes_phrase(shapes: list[str], every: list[str], benches: list[dict]) -> str:
    """"all", "the D128 shapes" when one shape parameter picks exactly these, else the labels."""
    if sorted(shapes) == sorted(every):
        return "all"
    first = next(b.get("shape") or {} for b in benches if label(b) == shapes[0])
    for name, value in reversed(first.items()):  # the last parameters (the head dimension) first
        picked = [label(b) for b in benches if (b.get("shape") or {}).get(name) == value]
        if sorted(picked) == sorted(shapes) and not isinstance(value, bool):
            return f"the {name}{value} shapes"
    return ", ".join(shapes)


def variant_parts(key: str) -> tuple[str, str]:
    """"ELEM_T=__half,HEAD_DIM=64" -> ("fp16", "D64"), as the grader's report writes it."""
    parts = dict(item.split("=", 1) for item in key.split(",") if "=" in item)
    elem = {"__half": "fp16", "__nv_bfloat16": "bf16"}.get(parts.pop("ELEM_T", ""), "")
    return elem, " ".join(("D" if k == "HEAD_DIM" else f"{k}=") + v for k, v in parts.items())


def resources_table(resources: dict) -> list[str]:
    """{variant: {kernel: info}} (or {kernel: info}) as one table, the variants that compiled alike
    (fp16 and bf16, usually) in one row: what ptxas and the SASS say."""
    rows: dict[tuple, list[str]] = {}
    for variant, kernels in resources.items():
        if "registers" in kernels:  # the flat form: {kernel: info}
            rows.setdefault((variant, "", json.dumps(kernels, sort_keys=True)), [])
            continue
        elem, rest = variant_parts(variant)
        for kernel, info in kernels.items():
            rows.setdefault((kernel, rest, json.dumps(info, sort_keys=True)), []).append(elem)
    if not rows:
        return []
    out = ["", "What the compiler made of each kernel ([static shared memory](../glossary.md#shared-memory): the "
           "`__shared__` arrays ptxas sees; what a launch asks for at run time is in the launches table):", "",
           "| Kernel | Variant | Registers / thread | Static shared memory | Spills (stores / loads) | Key SASS instructions |",
           "|---|---|--:|--:|--:|---|"]
    for (kernel, rest, info_json), elems in rows.items():
        r = json.loads(info_json)
        mix = " ".join(f"`{op}` {n}" for op, n in (r.get("sass") or {}).items())
        variant = " ".join(filter(None, ["/".join(elems), rest])) or "—"
        out.append(f"| `{kernel}` | {variant} | {r.get('registers', '—')} | {kib(r.get('shared_bytes'))} "
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


# ---------------------------------------------------------------- figures in a lesson's prose

class MissingFigure(PluginError):
    """A lesson quotes a figure that the results do not hold (or a field the hook does not know)."""


FIELDS = {  # name: (kind, what it is); "{}": the field's argument, a baseline or a key (a stage, or stage:rung)
    "ms": ("ms", "the median time"),
    "tflops": ("tflops", "TFLOP/s"),
    "pct_of_reference": ("pct", "% of the reference's speed"),
    "pct_bandwidth": ("pct", "% of the memory bandwidth"),
    "pct_peak": ("pct", "% of the tensor cores' peak"),
    "speedup_vs_naive": ("ratio", "the speed-up over naive PyTorch"),
    "previous_stage": ("ratio", "the speed-up over the step below (the previous stage, or the rung below), "
                                "timed side by side in the same run"),
    "baseline": ("ms", "the median time of {}"),
    "x": ("ratio", "the speed-up over {}"),
    "pct_of": ("pct", "% of the speed of {}"),
    "tflops_of": ("tflops", "the TFLOP/s of {} (the same FLOPs over its time)"),
    "share_of": ("pct", "the time as a % of the time of {}"),
    "vs": ("ratio", "the speed-up over {}'s recorded median (separate runs)"),
}
TAKES_ARGUMENT = {"baseline", "x", "pct_of", "tflops_of", "share_of", "vs"}


def figure_value(run: dict, stage: str, shape: str, field: str) -> float:
    """One figure of the results, e.g. ("stage5_moe_routing", "T32768 ...", "share_of.layer_grouped_mm");
    MissingFigure if the results do not hold it, or the field is unknown."""
    name, _, arg = field.partition(".")
    if name not in FIELDS or (name in TAKES_ARGUMENT) != bool(arg):
        raise MissingFigure(f"unknown field {field!r}; the fields: " + ", ".join(
            f"{n}.<{'key' if n == 'vs' else 'baseline'}>" if n in TAKES_ARGUMENT else n for n in FIELDS))
    st = (run.get("stages") or {}).get(stage)
    if st is None:
        raise MissingFigure(f"no results for {stage}")
    bench = bench_at(st, shape)
    if bench is None:
        raise MissingFigure(f"{stage} has no timed shape {shape!r} (it has: {', '.join(label(b) for b in timed(st))})")
    value = raw_figure(run, bench, name, arg)
    if not value:
        raise MissingFigure(f"{stage} at {shape!r} has no {field!r}")
    return value


def raw_figure(run: dict, bench: dict, name: str, arg: str):
    if name == "previous_stage":
        side = bench.get("previous_stage") or {}
        return side.get("speedup") or (side.get("ms") and side["ms"] / bench["ms"])
    if name not in TAKES_ARGUMENT:
        return bench.get(name)
    if name == "vs":
        other = bench_at(run["stages"].get(arg) or {}, label(bench))
        return other and other["ms"] / bench["ms"]
    base = (bench.get("baselines") or {}).get(arg)
    return base and {"baseline": base, "x": base / bench["ms"], "pct_of": 100 * base / bench["ms"],
                     "tflops_of": at_time(bench, "tflops", base), "share_of": 100 * bench["ms"] / base}[name]


def written(value: float, kind: str) -> str:
    return {"ms": f"{sig3(value)} ms", "tflops": f"{sig3(value)} TFLOP/s", "pct": f"{sig3(value)}%"}.get(kind) or ratio(value)


def measured_md(runs: list[dict], key: str, shape: str, fields: str, page: str = "") -> str:
    """A measured cell of a lesson's table (<!-- measured: -->): `fields` ("ms+pct_of.cudnn") of `key` at
    `shape`, from the first GPU's results that hold the key (and a "vs." field's other key), with the GPU
    named: unlike figure:, which quotes the PROSE_GPU alone, a cell that fills in wherever the step is first
    recorded. "not measured yet" while no file holds it; a key that is no stage or rung of the course,
    an unknown field, or a shape or field the results hold the key without, fails the build."""
    wanted = fields.split("+")
    where = f"{page}: <!-- measured:{key}:{shape}:{fields} -->"
    for field in wanted:
        name, _, arg = field.partition(".")
        if name not in FIELDS or (name in TAKES_ARGUMENT) != bool(arg):
            raise MissingFigure(f"{where}: unknown field {field!r}")
    needed = {key} | {field.partition(".")[2] for field in wanted if field.startswith("vs.")}
    unknown = [k for k in needed if not (ROOT / "stages" / split_key(k)[0]).is_dir() or k not in ladder_of(split_key(k)[0])]
    if unknown:
        raise MissingFigure(f"{where}: no such stage or rung: {', '.join(sorted(unknown))}")
    run = next((r for r in runs if needed <= set(r.get("stages", {}))), None)
    if run is None:
        return f'<span class="fm-missing">{NOT_MEASURED.lower()}</span>'
    try:
        values = [(figure_value(run, key, shape, field), field) for field in wanted]
    except MissingFigure as missing:
        if results_folder()[1]:
            raise MissingFigure(f"{where}: {missing}") from None
        return f'<span class="fm-missing">{NOT_MEASURED.lower()}</span>'
    shown = " · ".join(written(value, FIELDS[field.partition(".")[0]][0]) for value, field in values)
    tip = (f"{stage_name(key)}, {shape}, measured on the {gpu_of(run)}, "
           f"{when(measured(run, run['stages'][key])).replace('`', '')}")
    return f'<span class="fm-figure-value" title="{html.escape(tip)}">{shown}</span> <small>{html.escape(gpu_label(run))}</small>'


def prose_run(runs: list[dict]) -> dict:
    """The results the lessons' prose quotes: the PROSE_GPU's, never another GPU's."""
    return next((r for r in runs if PROSE_GPU in gpu_of(r)), {"gpu": f"no {PROSE_GPU} results", "stages": {}})


def figure_md(runs: list[dict], stage: str, shape: str, field: str, page: str = "") -> str:
    """The figure from the PROSE_GPU's results (prose_run), with its provenance and GPU on hover."""
    run = prose_run(runs)
    try:
        value = figure_value(run, stage, shape, field)
    except MissingFigure as missing:
        if results_folder()[1]:
            raise MissingFigure(f"{page}: <!-- figure:{stage}:{shape}:{field} -->: {missing}") from None
        return '<span class="fm-missing">not measured</span>'
    p = measured(run, run["stages"][stage])
    name, _, arg = field.partition(".")
    kind, what = FIELDS[name]
    tip = f"{stage_name(stage)}, {shape}: {what.format(arg)}, measured on the {gpu_of(run)}, {when(p).replace('`', '')}"
    return f'<span class="fm-figure-value" title="{html.escape(tip)}">{written(value, kind)}</span>'
