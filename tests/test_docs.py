"""The documentation site: it builds with --strict, every stage has its lesson, the charts and tables
come from results/*.json (through docs/hooks/course.py), and the pages work in a real browser.

The browser test needs Chromium and chromedriver (Debian: apt-get install chromium chromium-driver) and
selenium; it is skipped, with the reason, where they are missing, and fails instead when $CI is set.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import types
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGE_DIRS = sorted((d for d in (ROOT / "stages").glob("stage*_*") if d.is_dir() and re.fullmatch(r"stage\d+_\w+", d.name)),
                    key=lambda d: int(re.match(r"stage(\d+)", d.name)[1]))


def stage_page(stage_dir: Path) -> str:
    """stages/stage3_pipeline -> "stages/stage3" (docs/stages/stage3.md, built to site/stages/stage3/)."""
    return "stages/" + re.match(r"stage\d+", stage_dir.name)[0]


# ---------------------------------------------------------------- a fake results file
# In the form grader/results.py writes (stages 0, 2, 5), and the older flat form (stage 6).

def _bench(shape, label, ms, tflops, pct_ref, baselines, ref=("cudnn", 0.5, 600.0), **extra):
    return {"shape": shape, "label": label, "dtype": "float16", "ms": ms, "ms_min": round(ms * 0.98, 3), "spread": 0.012,
            "tflops": tflops, "pct_peak": round(tflops / 9.894, 1), "pct_bandwidth": 3.0, "pct_of_reference": pct_ref,
            "speedup_vs_naive": 2.5, "extra_memory_bytes": 0, "flags": [],
            "reference": {"name": ref[0], "ms": ref[1], "tflops": ref[2]}, "baselines": baselines, **extra}


def _launch(grid, block, smem, blocks, warps):
    return {"grid": grid, "block": block, "smem": smem, "blocks_per_sm": blocks, "warps_per_sm": warps,
            "occupancy": round(warps / 64, 3)}


def _measured(commit, date):
    return {"gpu": "NVIDIA H100 80GB HBM3", "sm_clock_mhz": 1980, "driver": "580.65.06", "driver_cuda": "13.0",
            "nvrtc": "13.0", "torch": "2.9.0", "cuda_core": "0.4.0", "commit": commit, "dirty": False, "date": date}


def _stage(key, title, grade, benches, goal="the naive baseline", problem="attention", measured=None):
    check = {"output": "o", "passed": True, "tolerance": 9.8e-4, "quality": "acceptable",
             "kernel": {"max_abs": 1.2e-4, "mean_abs": 3e-5, "max_rel": 2e-4, "finite": True}}
    return {"title": title, "problem": problem, "kernel_path": f"stages/{key}/attention.cu", "source_sha256": "0" * 64,
            "grade": grade, "score": 0.734, "goal": {"baseline": "naive", "fraction": 1.0, "text": goal},
            "measured": measured or _measured("0123456789abcdef", "2025-01-01T00:00:00+00:00"),
            "correctness": {"passed": 23, "failed": 1, "seed": 0, "trials": 2, "cases": [
                {"name": "B1 H1 Sq1 Skv1 D64 full fp16", "seed": 0, "passed": True, "inputs_unmodified": True,
                 "checks": [check, dict(check, output="lse", quality="n/a")]},
                {"name": "B2 H3 Sq17 Skv17 D64 causal fp16", "seed": 2, "passed": False,
                 "failure": "error: CUDA error (illegal memory address)"}]},
            "resources": {variant: {"attention_fwd": {
                "registers": 168, "shared_bytes": 49152, "stack_bytes": 0, "spill_stores": 0, "spill_loads": 0,
                "sass": {"HMMA": 64, "LDSM": 24}}} for variant in ("ELEM_T=__half,HEAD_DIM=64", "ELEM_T=__nv_bfloat16,HEAD_DIM=64")},
            "benchmarks": benches}


ATTN = {"B": 16, "H": 16, "Sq": 2048, "Skv": 2048, "D": 64, "causal": False}
ROUTING = {"tokens": 32768, "experts": 32, "top_k": 2, "block": 128, "hidden": 4096}
FAKE = {
    "gpu": "NVIDIA H100 80GB HBM3",
    "provenance": _measured("fedcba9876543210", "2025-01-03T00:00:00+00:00"),
    "stages": {
        "stage0_naive": _stage("stage0_naive", "Stage 0 — naive attention: three kernels", "D", [
            _bench(ATTN, "B16 H16 S2048 D64", 12.345, 11.1, 1.9,
                   {"cudnn": 0.5, "flash": 0.61, "efficient": 1.1, "math": None, "naive": 14.2}),
            _bench({**ATTN, "causal": True}, "B16 H16 S2048 D64 causal", 7.5, 9.4, 2.2,
                   {"cudnn": 0.3, "flash": 0.36, "efficient": 0.7, "math": None, "naive": 9.9}),
            _bench({**ATTN, "B": 4}, "B4 H16 S2048 D64", 3.1, 11.0, 1.9, {"cudnn": 0.13, "naive": 3.6})],
            measured=_measured("aaaaaaa1111111", "2025-01-01T10:00:00+00:00")),
        "stage2_warp": _stage("stage2_warp", "Stage 2 — tensor cores", "B", [
            # timed beside stage 1's kernel in the same run: what stage 2 bought, side by side
            _bench(ATTN, "B16 H16 S2048 D64", 0.734, 187.3, 68.1,
                   {"cudnn": 0.5, "flash": 0.61, "efficient": 1.1, "math": 20.0, "naive": 14.2},
                   previous_stage={"stage": "stage1_tiled", "ms": 0.98, "speedup": 1.335},
                   launches={"attention_fwd": _launch([32, 256], [128], 27648, 3, 12)}),
            # no previous_stage: the ratio of stage 0's and stage 2's separately recorded medians
            _bench({**ATTN, "causal": True}, "B16 H16 S2048 D64 causal", 0.45, 153.2, 66.7,
                   {"cudnn": 0.3, "flash": 0.36, "naive": 9.9},
                   launches={"attention_fwd": _launch([32, 256], [128], 27648, 3, 12)})],
            goal="0.6 × the flash baseline", measured=_measured("bbbbbbb2222222", "2025-01-02T11:30:00+00:00")),
        "stage5_moe_routing": _stage("stage5_moe_routing", "Stage 5 — MoE routing: top-k", "A", [
            dict(_bench(ROUTING, "T32768 E32 k2 block128 hidden4096", 0.344, 1.58, 985.7,
                        {"torch": 3.39, "naive": 10.8, "layer_grouped_mm": 34.02}, ref=("torch", 3.39, 0.16)),
                 pct_bandwidth=70.3, notes=["routing + permutation + combine = 1.01% of the whole layer"])],
            goal="the fastest library baseline", problem="moe_routing"),
        "stage6_grouped_gemm": {
            "title": "Stage 6 — grouped GEMM", "problem": "moe_experts", "grade": "C", "score": 0.65,
            "goal": {"baseline": "reference", "fraction": 1.0, "text": "the fastest library baseline"},
            "correctness": {"passed": 20, "failed": 0, "cases": [
                {"name": "tokens 17", "passed": True, "max_abs": 1e-3, "mean_abs": 1e-4, "max_rel": 1e-3,
                 "tolerance": 2e-3, "quality": "acceptable"}]},
            "resources": {"grouped_gemm": {"registers": 90, "shared_bytes": 1024, "spill_stores": 0, "spill_loads": 0}},
            "benchmarks": [
                {"shape": {"T": 4096, "E": 8, "k": 2, "hidden": 4096, "inter": 14336}, "dtype": "bfloat16",
                 "ms": 3.21, "ms_min": 3.2, "spread": 0.01, "tflops": 321.9, "pct_peak": 32.5, "pct_bandwidth": None,
                 "pct_of_reference": 77.7, "speedup_vs_naive": None, "extra_memory_bytes": None,
                 "reference": {"name": "torch_grouped_mm", "ms": 2.5, "tflops": 413.0},
                 "baselines": {"torch_grouped_mm": 2.5}}]},
    },
}


# Stage 6's ladder as the grader records it: each rung an entry of its own ("stage6_grouped_gemm:mma_sync",
# with "rung"), its rows timed beside the step below (stage 6 over its mma_sync rung, that over its simt
# rung, stage 7 over its mma_sync rung); stage 7's rung is left out on the H100, measured on the H200.
MOE = {"T": 4096, "E": 8, "k": 2, "hidden": 4096, "inter": 14336}
MOE_LABEL = "T4096 E8 k2 hidden4096 inter14336 bf16"  # the label stage 6's flat entry gets from its shape


def _moe(key, grade, goal, ms, tflops, pct_ref, below=None, problem="moe_experts", measured=None):
    name, _, rung = key.partition(":")
    bench = _bench(MOE, MOE_LABEL, ms, tflops, pct_ref, {"torch_grouped_mm": 2.5}, ref=("torch_grouped_mm", 2.5, 413.0),
                   launches={"expert_up_swiglu": _launch([132], [256], 99328, 1, 8)})
    if below:
        bench["previous_stage"] = {"stage": below[0], "ms": below[1], "speedup": below[1] / ms}
    entry = _stage(name, f"Stage {name[5]} — MoE" + (f" ({rung} rung)" if rung else ""), grade, [bench], goal=goal,
                   problem=problem, measured=measured)
    return dict(entry, rung=rung) if rung else entry


FAKE["stages"]["stage6_grouped_gemm"]["benchmarks"][0]["previous_stage"] = {
    "stage": "stage6_grouped_gemm:mma_sync", "ms": 7.9, "speedup": 7.9 / 3.21}
FAKE["stages"].update({
    "stage6_grouped_gemm:mma_sync": _moe("stage6_grouped_gemm:mma_sync", "B", "0.6 × the fastest library baseline",
                                         7.8, 132.4, 32.1, below=("stage6_grouped_gemm:simt", 61.0)),
    "stage6_grouped_gemm:simt": _moe("stage6_grouped_gemm:simt", "C", "0.06 × the fastest library baseline", 60.3, 17.1, 4.1),
    "stage7_moe_layer": _moe("stage7_moe_layer", "A", "the fastest library baseline", 3.5, 295.1, 71.4,
                             below=("stage7_moe_layer:mma_sync", 8.1), problem="moe_layer"),
})
# The same stages measured on an H200, a little faster, with stage 7's mma_sync rung.
FAKE_H200 = copy.deepcopy(FAKE)
FAKE_H200["gpu"] = "NVIDIA H200"
FAKE_H200["provenance"] = dict(FAKE["provenance"], gpu="NVIDIA H200")
for _entry in FAKE_H200["stages"].values():
    for _b in _entry["benchmarks"]:
        _b["ms"] = round(_b["ms"] * 0.8, 4)
        _b["tflops"] = round(_b["tflops"] / 0.8, 1)
    if "measured" in _entry:
        _entry["measured"] = dict(_entry["measured"], gpu="NVIDIA H200", date="2025-02-01T00:00:00+00:00")
FAKE_H200["stages"]["stage7_moe_layer:mma_sync"] = _moe("stage7_moe_layer:mma_sync", "B", "0.6 × the fastest library baseline",
                                                        6.5, 158.9, 38.5, problem="moe_layer",
                                                        measured=dict(_measured("0123456789abcdef", "2025-02-01T00:00:00+00:00"),
                                                                      gpu="NVIDIA H200"))
H200_MS = FAKE_H200["stages"]["stage6_grouped_gemm:mma_sync"]["benchmarks"][0]["ms"]  # 6.24


def load_hook():
    spec = importlib.util.spec_from_file_location("course_hook", ROOT / "docs" / "hooks" / "course.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def build(out: Path, results_dir: Path | None = None, search: bool = True) -> Path:
    """The site built by mkdocs into `out`, from `results_dir`'s results (the repository's by default); without
    `search`, without its search index (almost half a build's time), for tests that read no page in a browser."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", FLASHMOE_SITE_SEARCH="true" if search else "false")
    env.pop("FLASHMOE_RESULTS_DIR", None)
    if results_dir is not None:
        env["FLASHMOE_RESULTS_DIR"] = str(results_dir)
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site as CI builds it, from the committed results/."""
    return build(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def fake_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("results")
    (folder / "h100-sxm.json").write_text(json.dumps(FAKE))
    (folder / "h200.json").write_text(json.dumps(FAKE_H200))
    return folder


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory, fake_results):
    return build(tmp_path_factory.mktemp("fake_site"), fake_results, search=False)


@pytest.fixture(scope="module")
def empty_site(tmp_path_factory):
    return build(tmp_path_factory.mktemp("empty_site"), tmp_path_factory.mktemp("no_results"), search=False)


# ---------------------------------------------------------------- the build

def test_site_builds_strictly(site):
    """--strict turns every warning into an error: a broken link, a missing snippet file or section,
    a page named in the nav that does not exist."""
    for page in ["", "setup/", "grading/", "glossary/"] + [stage_page(d) + "/" for d in STAGE_DIRS]:
        assert (site / page / "index.html").is_file(), page


def test_every_stage_has_a_lesson_in_the_nav(site):
    assert STAGE_DIRS, "no stages/stage<N>_*/ directory found"
    nav = (site / "index.html").read_text()
    for d in STAGE_DIRS:
        assert (ROOT / "docs" / f"{stage_page(d)}.md").is_file(), f"{d.name} has no lesson: write docs/{stage_page(d)}.md"
        assert f'href="{stage_page(d)}/"' in nav, f"{d.name}'s lesson is not in the nav"


def test_lessons_include_the_real_kernels(site):
    for d in STAGE_DIRS:
        markdown = (ROOT / "docs" / f"{stage_page(d)}.md").read_text()
        assert f'--8<-- "stages/{d.name}/' in markdown, f"{stage_page(d)}.md includes no code from stages/{d.name}/"
        assert f"<!-- results:{d.name} -->" in markdown, f"{stage_page(d)}.md has no results placeholder"
        html = (site / stage_page(d) / "index.html").read_text()
        assert "--8<--" not in html and 'class="highlight"' in html
        assert '<svg class="fm-diagram"' in html, f"{stage_page(d)}.md has no diagram"


def test_diagrams_arrowheads_and_narrow_charts_in_the_built_pages(site):
    """Every diagram in a figure (which scrolls sideways where the column is narrower, course.css); a page
    with arrows holds their arrowhead once (the hook's ARROWHEAD); every chart is drawn wide and narrow,
    in one figure (course.css shows the narrow drawing on a phone)."""
    problems = []
    for path in sorted(site.rglob("index.html")):
        page, text = str(path.parent.relative_to(site)), path.read_text()
        for m in re.finditer(r'<svg class="fm-diagram"[^>]*>', text):
            if not text[:m.start()].endswith('<figure class="fm-figure">\n'):
                problems.append(f"{page}: a diagram not in <figure class=\"fm-figure\">: {m[0][:120]}")
        arrows, arrowheads = text.count('class="arrow"'), text.count('id="fm-arrow"')
        if arrowheads != (1 if arrows else 0):
            problems.append(f"{page}: {arrows} arrows, {arrowheads} arrowheads")
        charts = re.findall(r'<svg class="fm-chart ([\w -]+)"', text)
        figures = re.findall(r'<figure class="fm-figure fm-two-widths">\n<svg class="fm-chart ([\w-]+)"[^\n]*\n'
                             r'<svg class="fm-chart ([\w-]+) fm-narrow"', text)
        if len(charts) != 2 * len(figures) or any(wide != narrow for wide, narrow in figures):
            problems.append(f"{page}: {len(charts)} chart drawings, {len(figures)} figures with a wide and a narrow one")
    assert not problems, "\n".join(problems)


def test_every_lesson_shows_its_profile(site):
    """Each lesson has its stage's profile placeholder; stage 0's built page holds the committed profile:
    one table with the course's kernels beside the reference's, the stalls and the verdicts."""
    for d in STAGE_DIRS:
        markdown = (ROOT / "docs" / f"{stage_page(d)}.md").read_text()
        assert f"<!-- profile:{d.name} -->" in markdown, f"{stage_page(d)}.md has no <!-- profile:{d.name} --> placeholder"
    profile = json.loads((ROOT / "results" / "h100-sxm.json").read_text())["stages"]["stage0_naive"]["profile"]
    html = (site / "stages" / "stage0" / "index.html").read_text()
    block = re.search(r'<div class="fm-results fm-profile">(.*?)</div>', html, re.S)
    assert block, "stage 0's page has no profile table"
    table = block[1]
    sides = {k["side"] for k in profile["kernels"]}
    assert sides == {"kernel", "reference"}
    for k in profile["kernels"]:
        assert f'title="{k["name"]}"' in table, f"{k['name']} is not a column of stage 0's profile"
    assert "ours<br" in table and profile["reference"]["name"] + "<br" in table
    for row in ("duration", "SM throughput", "memory throughput", "tensor pipe", "DRAM bytes", "L1 / L2 hit rate",
                "occupancy achieved / theoretical", "registers per thread", "shared memory per block", "waves"):
        assert f"<td>{row}</td>" in table, row
    assert profile["settings"]["text"] in html and profile["settings"]["ncu"] in html
    assert "memory-bound (SM" in html and "latency-bound (SM" in html and "long_scoreboard</code>: waiting" in html


def test_a_stage_without_a_profile_says_so(fake_results, monkeypatch):
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="stages/stage0.md"))
    assert "not profiled yet" in hook.on_page_markdown("<!-- profile:stage0_naive -->", page, None, None)
    results = json.loads((ROOT / "results" / "h100-sxm.json").read_text())
    profiled = copy.deepcopy(FAKE)
    profiled["stages"]["stage0_naive"]["profile"] = results["stages"]["stage0_naive"]["profile"]
    (fake_results.parent / "profiled").mkdir(exist_ok=True)
    (fake_results.parent / "profiled" / "h100-sxm.json").write_text(json.dumps(profiled))
    (fake_results.parent / "profiled" / "h200.json").write_text(json.dumps(FAKE_H200))
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results.parent / "profiled"))
    text = hook.on_page_markdown("<!-- profile:stage0_naive -->", page, None, None)
    assert "fm-profile" in text and "| Metric |" in text
    if "stage0_naive" in FAKE_H200["stages"]:
        assert "Not profiled on the **NVIDIA H200**" in text
    with pytest.raises(hook.PluginError, match="no such stage"):
        hook.on_page_markdown("<!-- profile:stage0_naive:nope -->", page, None, None)
    assert "`barrier`" in hook.on_page_markdown("<!-- stall-reasons -->", page, None, None)


def test_stage11s_records_across_gpus_become_its_lessons_tables(tmp_path, monkeypatch):
    """<!-- expert-parallel-records -->: the tables of results/expert-parallel/*.json, as the runner prints
    them (records.lesson_tables), one heading per record; "Not measured yet." where there are none."""
    monkeypatch.delenv("FLASHMOE_RESULTS_DIR", raising=False)
    hook = load_hook()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="stages/stage11.md"))
    assert "<!-- expert-parallel-records -->" in (ROOT / "docs" / "stages" / "stage11.md").read_text()
    text = hook.on_page_markdown("<!-- expert-parallel-records -->", page, None, None)
    records = [json.loads(p.read_text()) for p in sorted((ROOT / "results" / "expert-parallel").glob("*.json"))]
    assert records, "no records in results/expert-parallel/"
    assert 'class="fm-results"' in text and "Not measured yet" not in text
    for rec in records:
        assert f"#### {rec['world']} × {rec['gpu']}" in text and f"commit {rec['commit']}" in text
        for c in rec["configs"]:
            assert f"**{c['config']}**: hidden {c['shape']['hidden']}" in text
            for name, ms in c["layer_ms"].items():
                assert f"| {name} | {ms:.3f} | {c['one_gpu_stage7_ms'] / ms:.2f} |" in text, (rec["world"], name)
            for transport, p in c["phases_ms"].items():
                assert f"| {transport} | {p['route']:.3f} | {p['plan']:.3f} | {p['dispatch']:.3f} |" in text
            assert "| ms | " + " | ".join(f"{ms:.3f}" for ms in c["costs_ms"].values()) + " |" in text
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(tmp_path))  # another results folder, without records
    assert "Not measured yet." in hook.on_page_markdown("<!-- expert-parallel-records -->", page, None, None)


def test_the_records_of_stages_10_and_11_load_without_torch():
    """The hook reads stage 10's and stage 11's records.py by their paths: the docs build needs no torch."""
    script = ("import importlib.util, sys, types\n"
              f"spec = importlib.util.spec_from_file_location('course_hook', {str(ROOT / 'docs' / 'hooks' / 'course.py')!r})\n"
              "hook = importlib.util.module_from_spec(spec); sys.modules[spec.name] = hook; spec.loader.exec_module(hook)\n"
              "page = types.SimpleNamespace(file=types.SimpleNamespace(src_path='stages/stage11.md'))\n"
              "assert '####' in hook.on_page_markdown('<!-- expert-parallel-records -->', page, None, None)\n"
              "assert 'fm-training' in hook.on_page_markdown('<!-- training-records -->', page, None, None)\n"
              "assert 'torch' not in sys.modules, 'the records pulled torch in'\n")
    env = {k: v for k, v in os.environ.items() if k != "FLASHMOE_RESULTS_DIR"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_built_lesson_shows_stage11s_records(site):
    html = (site / "stages" / "stage11" / "index.html").read_text()
    for path in sorted((ROOT / "results" / "expert-parallel").glob("*.json")):
        rec = json.loads(path.read_text())
        for c in rec["configs"]:
            assert re.search(rf">{c['layer_ms']['NVLink kernels']:.3f}</td>", html), (path.name, c["config"])


# ---------------------------------------------------------------- stage 10's training records

def _way(tokens_per_s, losses, **more):
    return {"losses": losses, "tokens_per_s": tokens_per_s, "warmup_s": 12.34, **more}


def _training_run(model, label, ways, **more):
    return {"model": model, "label": label, "batch": 4, "seq": 2048, "steps": 30, "every": 10, "lr": 3e-4,
            "gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "commit": "0123456789abcdef", "dirty": False,
            "date": "2026-12-01T10:00:00+00:00", "command": f"python -m stages.stage10_model.train --model {model}",
            "ways": ways, "skipped": {}, "failed": {}, **more}


FAKE_TRAINING = {"gpu": "NVIDIA H200", "runs": [_training_run("llama", "llama L4 hidden2048 H32/8 inter5632 B4 S2048", {
    "course": _way(61000.0, [5.6, 3.1, 2.5, 2.25]),
    "pytorch": _way(50000.0, [5.6, 3.0, 2.6, 2.2]),
    "pytorch-compiled": _way(55000.0, [5.6, 3.05, 2.55, 2.2], graphs=2, cudagraph_skips=1),
    "course-compiled": _way(66000.0, [5.6, 3.1, 2.5, 2.21], graphs=2, cudagraph_skips=0)},
    failed={"nothing": "RuntimeError: a made-up failure"})]}
FAKE_TRAINING_H100 = {"gpu": "NVIDIA H100 80GB HBM3", "runs": [dict(_training_run("small", "small L2 B8 S256", {
    "pytorch": _way(200000.0, [6.1, 3.0, 2.0, 1.7])}, gpu="NVIDIA H100 80GB HBM3"), batch=8, seq=256)]}


def test_stage10s_training_records_become_its_lessons_charts_and_tables(tmp_path, monkeypatch):
    """<!-- training-records -->: a tab per GPU, the H100's first; per run a line chart of each way's losses
    (the compiled ways dashed) and a table of tokens/s against PyTorch eager's, the warm-up, the last loss
    and the largest gap to PyTorch eager's loss; then the sizes the GPU's file lacks."""
    hook = load_hook()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="stages/stage10.md"))
    assert "<!-- training-records -->" in (ROOT / "docs" / "stages" / "stage10.md").read_text()
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(tmp_path))
    empty = hook.on_page_markdown("<!-- training-records -->", page, None, None)
    assert hook.NOT_MEASURED in empty and all(f"**{name}**" in empty for name in ("small", "moe", "llama", "moe-llama"))
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "h200.json").write_text(json.dumps(FAKE_TRAINING))
    (tmp_path / "training" / "h100-sxm.json").write_text(json.dumps(FAKE_TRAINING_H100))
    text = hook.on_page_markdown("<!-- training-records -->", page, None, None)
    h100, h200 = text.split('<div class="tabbed-block" markdown>')[1:]
    assert "NVIDIA H100" in h100 and "NVIDIA H200" in h200 and 'class="tabbed-set' in text
    assert h200.count('<svg class="fm-chart fm-training"') == 1 and h200.count("<polyline") == 2 * 4  # wide, narrow
    assert h200.count('stroke-dasharray="6 3"') == 2 * 2  # the compiled ways, wide and narrow
    assert "| course | 61,000 | 1.22× | 12.3 | 2.250 | 0.100 |" in h200
    assert "| PyTorch eager | 50,000 | — | 12.3 | 2.200 | — |" in h200
    assert "| course, compiled | 66,000 | 1.32× | 12.3 | 2.210 | 0.100 |" in h200
    assert "PyTorch compiled: 1 of its compiled graphs ran without CUDA graphs." in h200
    assert "nothing: failed (RuntimeError: a made-up failure)." in h200
    assert "commit `0123456` on 2026-12-01 10:00 UTC, torch 2.11.0+cu130" in h200
    lacking = h200[h200.index(hook.NOT_MEASURED):]
    assert all(f"**{name}**" in lacking for name in ("small", "moe", "moe-llama")) and "**llama**" not in lacking
    assert "--model small moe moe-llama --json" in lacking
    assert "| PyTorch eager | 200,000 |" in h100 and "**llama**" in h100[h100.index(hook.NOT_MEASURED):]


def test_stage10s_committed_training_records_in_its_lesson(monkeypatch):
    monkeypatch.delenv("FLASHMOE_RESULTS_DIR", raising=False)
    hook = load_hook()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="stages/stage10.md"))
    text = hook.on_page_markdown("<!-- training-records -->", page, None, None)
    R = hook.training_records()
    files = R.load()
    assert files, "no records in results/training/"
    for file in files:
        for run in file["runs"]:
            assert f"**{run['model']}**: {run['label']}" in text
            for way in run["ways"].values():
                assert f"| {way['tokens_per_s']:,.0f} |" in text
        if missing := R.unmeasured(file["runs"]):
            assert f"--model {' '.join(missing)} --json" in text


def test_the_built_lesson_shows_stage10s_training_records(site):
    html = (site / "stages" / "stage10" / "index.html").read_text()
    runs = [run for file in load_hook().training_records().load() for run in file["runs"]]
    assert html.count('<svg class="fm-chart fm-training"') == len(runs) and "<!-- training-records -->" not in html


# ---------------------------------------------------------------- the results, through the hook

# ---------------------------------------------------------------- `python -m grader ops` (docs/pytorch.md)

FAKE_OPS = {
    "provenance": {"gpu": "NVIDIA H100 80GB HBM3", "commit": "abcdef0123456789", "dirty": False,
                   "date": "2026-01-02T03:04:05+00:00", "torch": "2.11.0+cu130"},
    "attention": [{"shape": {"B": 2, "H": 32, "Hkv": 8, "S": 2048, "D": 64, "causal": True, "dtype": "bfloat16"},
                   "host_us": {"course_forward": 44.6, "course_backward": 123.4, "sdpa_forward": 51.2,
                               "sdpa_backward": 143.5},
                   "ms": {"course_forward_backward": 0.41234, "sdpa_forward_backward": 0.4635},
                   "speedup_forward_backward": 1.12406, "kernels": {"names": {}, "copies": 0}}],
    "host_breakdown": {"forward": {"whole": 44.6, "checks": 7.2, "ops, rest (autograd, dispatch)": 2.6},
                       "backward": {"whole": 123.4, "autograd's engine, rest": 88.8}},
    "tiny": [{"shape": {"B": 1, "H": 1, "S": 128, "D": 64, "dtype": "float16"}, "course_ms": 0.0123456,
              "sdpa_ms": 0.0234567, "ratio": 1.9}],
    "moe_layer": [{"shape": {"tokens": 128, "hidden": 4096, "inter": 14336, "experts": 8, "top_k": 2, "dtype": "bfloat16"},
                   "host_us": 87.4, "ms": {"course": 1.0095, "grouped_mm": 1.2775}}],
    "models": [{"model": "LlamaForCausalLM hidden_size 2048", "batch": 2, "seq": 2048, "course_ms": 25.0,
                "sdpa_ms": 27.5, "eager_ms": 56.66, "speedup": 1.1},
               {"model": "LlamaForCausalLM hidden_size 2048", "batch": 2, "seq": 2048, "compiled": True,
                "course_ms": 20.0, "sdpa_ms": 23.0, "speedup": 1.15},
               {"model": "LlamaForCausalLM hidden_size 2048", "batch": 8, "seq": 512, "compiled": True,
                "failed": "BackendCompilerFailed: boom"},
               {"model": "MixtralSparseMoeBlock (forward) {'hidden': 4096}", "tokens": 4096, "course_ms": 4.4718,
                "eager_ms": 8.7284, "speedup": 1.95}],
}


def ops_page():
    return types.SimpleNamespace(file=types.SimpleNamespace(src_path="pytorch.md"))


def test_ops_figures_from_a_fixture(tmp_path, monkeypatch):
    """<!-- ops-figures -->: the "ops" entry of each results file as tables, µs without decimals, ms to three
    significant figures, ratios to two decimals; the GPU and the commit and date the figures were measured at;
    a file without "ops" (here the H200's) gets no tab."""
    h100 = dict(copy.deepcopy(FAKE), ops=FAKE_OPS)
    (tmp_path / "h100-sxm.json").write_text(json.dumps(h100))
    (tmp_path / "h200.json").write_text(json.dumps(FAKE_H200))
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(tmp_path))
    hook = load_hook()
    text = hook.on_page_markdown("<!-- ops-figures -->", ops_page(), None, None)
    assert "Not measured yet" not in text and "fm-gpus" not in text and "H200" not in text
    assert "On the **NVIDIA H100 80GB HBM3** (`results/h100-sxm.json`)" in text
    assert "commit `abcdef0` on 2026-01-02 03:04 UTC" in text
    for row in ("| B2 H32/8 S2048 D64 | 45 / 51 | 123 / 144 | 0.412 / 0.464 | 1.12× |",  # (a) attention
                "| **whole call** | 45 | 123 |", "| checks | 7 | — |",                        # (b) by piece
                "| ops, rest (autograd, dispatch) | 3 | — |", "| autograd's engine, rest | — | 89 |",
                "| B1 H1 S128 D64 fp16 | 0.0123 | 0.0235 | 1.90× |",                       # (c) tiny shapes
                "| 128 | 87 | 1.01 | 1.28 | 1.27× |",                                     # (d) ops.moe_layer
                "| 2 × 2048 | 25.0 | 27.5 | 56.7 | 1.10× | 2.27× |",                       # (e) models
                "| 4096 | 4.47 | — | 8.73 | — | 1.95× |",
                "LlamaForCausalLM forward + backward, compiled</span> | 2 × 2048 | 20.0 | 23.0 | — | 1.15× | — |",
                "Whole models, compiled, 8 × 512: failed (BackendCompilerFailed: boom)."):
        assert row in text, row
    assert "(hidden 4096, inter 14336, 8 experts, top-2, bf16)" in text
    assert "by piece" in text and "at B2 H32/8 S2048 D64" in text

    h200 = dict(copy.deepcopy(FAKE_H200), ops=dict(FAKE_OPS, provenance=dict(FAKE_OPS["provenance"], gpu="NVIDIA H200")))
    (tmp_path / "h200.json").write_text(json.dumps(h200))
    text = hook.on_page_markdown("<!-- ops-figures -->", ops_page(), None, None)
    assert "fm-gpus" in text  # a tab per GPU, the H100's first
    assert text.index("On the **NVIDIA H100 80GB HBM3**") < text.index("On the **NVIDIA H200**")

    models = dict(FAKE_OPS, models=[{"skipped": "transformers is not installed"}])
    (tmp_path / "h100-sxm.json").write_text(json.dumps(dict(copy.deepcopy(FAKE), ops=models)))
    text = hook.on_page_markdown("<!-- ops-figures -->", ops_page(), None, None)
    assert "Whole models: not measured (transformers is not installed)." in text


def test_without_ops_figures_the_page_says_not_measured(tmp_path, monkeypatch):
    (tmp_path / "h100-sxm.json").write_text(json.dumps(FAKE))
    (tmp_path / "h200.json").write_text(json.dumps(dict(copy.deepcopy(FAKE_H200), ops=dict(FAKE_OPS, stale=True))))
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(tmp_path))
    hook = load_hook()
    text = hook.on_page_markdown("<!-- ops-figures -->", ops_page(), None, None)
    assert "Not measured yet." in text and "| shape |" not in text


def committed_ops() -> list[tuple[str, dict]]:
    """(GPU, "ops") of each committed results file that has figures of `python -m grader ops`."""
    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "results").glob("*.json"))]
    return [(run["gpu"], run["ops"]) for run in runs if run.get("ops") and not run["ops"].get("stale")]


def test_ops_figures_from_the_committed_results(monkeypatch):
    """docs/pytorch.md's section on `grader ops` holds the placeholder; it becomes the committed figures."""
    monkeypatch.delenv("FLASHMOE_RESULTS_DIR", raising=False)
    markdown = (ROOT / "docs" / "pytorch.md").read_text()
    assert "<!-- ops-figures -->" in markdown.split("## What a call costs")[1]
    found = committed_ops()
    assert found, "no results/*.json holds \"ops\""
    text = load_hook().on_page_markdown("<!-- ops-figures -->", ops_page(), None, None)
    for gpu, ops in found:
        assert f"On the **{gpu}**" in text and f"commit `{ops['provenance']['commit'][:7]}`" in text
        for row in ops["attention"]:
            host = row["host_us"]
            assert f"| {host['course_forward']:.0f} / {host['sdpa_forward']:.0f} | {host['course_backward']:.0f} / " \
                   f"{host['sdpa_backward']:.0f} |" in text, (gpu, row["shape"])
            assert f"| {row['speedup_forward_backward']:.2f}× |" in text
        for row in ops["tiny"]:
            assert f"| {row['ratio']:.2f}× |" in text
        for row in ops["moe_layer"]:
            assert f"| {row['shape']['tokens']} | {row['host_us']:.0f} |" in text
        for row in ops["models"]:
            if row.get("sdpa_ms"):
                assert f"| {row['sdpa_ms'] / row['course_ms']:.2f}× |" in text, row["model"]


def test_the_built_pytorch_page_shows_the_ops_figures(site, empty_site):
    html = (site / "pytorch" / "index.html").read_text()
    assert "<!-- ops-figures -->" not in html and "Not measured yet" not in html
    for gpu, ops in committed_ops():
        assert f"<strong>{gpu}</strong>" in html
        for row in ops["attention"]:
            assert re.search(rf"<td[^>]*>{row['speedup_forward_backward']:.2f}×</td>", html), row["shape"]
        for row in ops["moe_layer"]:
            assert re.search(rf"<td[^>]*>{row['host_us']:.0f}</td>", html)
    assert "Not measured yet." in (empty_site / "pytorch" / "index.html").read_text()


def test_ladder_and_tables_show_the_recorded_numbers(fake_site):
    home = (fake_site / "index.html").read_text()
    assert '<svg class="fm-chart fm-ladder"' in home and '<svg class="fm-chart fm-steps"' in home
    for number in ("11.1 TFLOP/s", "187 TFLOP/s", "322 TFLOP/s", "70.3 % of bandwidth", "Stage 6"):  # in the bars' tooltips
        assert number in home, number
    for d in STAGE_DIRS:
        html = (fake_site / stage_page(d) / "index.html").read_text()
        if d.name in FAKE["stages"]:
            bench = FAKE["stages"][d.name]["benchmarks"][0]
            assert f"{bench['ms']:.3f}" in html and f"{bench['tflops']:.1f}" in html
            assert '<svg class="fm-chart fm-stage"' in html
        else:
            assert "not measured yet" in html


def test_results_markdown_from_the_hook(fake_results, monkeypatch):
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    runs = hook.load_runs()
    stage0 = hook.results_md("stage0_naive", runs)
    assert "12.345" in stage0 and "Grade D" in stage0 and "NVIDIA H100 80GB HBM3" in stage0
    assert "B16 H16 S2048 D64 causal" in stage0 and "fp16/bf16 D64" in stage0 and "`HMMA` 64" in stage0
    assert "| 1.100 | — | 14.200 |" in stage0  # efficient, the math baseline that did not run, naive
    assert "illegal memory address" in stage0 and "1.2 %" in stage0  # a failed case; the spread
    assert "commit `aaaaaaa` on 2025-01-01 10:00 UTC" in stage0  # the stage's own provenance, not the run's
    moe = hook.results_md("stage6_grouped_gemm", runs)
    assert "T4096 E8 k2 hidden4096 inter14336 bf16" in moe and "321.9" in moe
    assert "not measured yet" in hook.results_md("stage9_missing", runs)
    ladder = hook.ladder_md(runs)
    assert "<svg" in ladder and "187" in ladder and "Grade" in ladder


def test_the_key_columns_come_first_and_the_details_fold(fake_results, monkeypatch):
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    stage2 = hook.results_md("stage2_warp", hook.load_runs())
    header = next(line for line in stage2.splitlines() if line.startswith("| Shape | ms |"))
    assert header == "| Shape | ms | TFLOP/s | % of the reference (cudnn) | × naive | × the step below |"
    assert '??? info "Timing details' in stage2 and "    | Shape | Median ms | Min ms |" in stage2


def test_launches_and_static_shared_memory(fake_results, monkeypatch):
    """ptxas's shared memory is the static part; the dynamic part and the occupancy come from the launches."""
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    stage2 = hook.results_md("stage2_warp", hook.load_runs())
    assert "| `attention_fwd` | all | 32 × 256 | 128 | 27.0 KiB | 3 blocks, 12 warps (19 %) |" in stage2
    assert "Static shared memory" in stage2 and "| `attention_fwd` | fp16/bf16 D64 | 168 | 48.0 KiB |" in stage2


def test_what_each_stage_bought(fake_results, monkeypatch):
    """A row's previous_stage (timed side by side) wins over the ratio of separately recorded medians,
    and each figure says which it is."""
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    run = hook.load_runs()[0]
    bench, causal = FAKE["stages"]["stage2_warp"]["benchmarks"]
    side = hook.step_at(run, "stage2_warp", bench)
    assert (side.previous, side.speedup, side.side_by_side) == ("stage1_tiled", 1.335, True)
    apart = hook.step_at(run, "stage2_warp", causal)
    assert apart.previous == "stage0_naive" and not apart.side_by_side
    assert apart.speedup == pytest.approx(7.5 / 0.45)
    stage2 = hook.results_md("stage2_warp", [run])
    assert "1.33× <small>over stage 1, same run</small>" in stage2 and "16.7× <small>over stage 0, separate runs</small>" in stage2
    steps = hook.steps_figure(run, list(hook.ordered_stages(run))[:2], [bench["label"], causal["label"]],
                              {bench["label"]: "#000", causal["label"]: "#111"}, "h")
    assert "Stage 2 over stage 0 and stage 1" in steps and 'fill="url(#h)"' in steps  # the separate-runs bar is hatched


def test_one_panel_per_problem(fake_results, monkeypatch):
    """Attention in TFLOP/s at the shapes all its stages measured, routing in % of bandwidth, each
    panel's shapes in distinct colours, and every stage's own commit in the grades table."""
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    run = hook.load_runs()[0]
    panels = {panel.problems: (panel, stages) for panel, stages in hook.run_panels(run)}
    attention, stages = panels[("attention",)]
    shapes, others = hook.panel_shapes(stages)
    assert shapes == ["B16 H16 S2048 D64", "B16 H16 S2048 D64 causal"] and others == ["B4 H16 S2048 D64"]
    assert panels[("moe_routing",)][0].metric == "pct_bandwidth"
    assert len(set(hook.palette(12))) == 12
    ladder = hook.ladder_md([run])
    assert "% of bandwidth" in ladder and "layer_grouped_mm" not in ladder  # a yardstick, not a rival
    assert "Measured by only some of these stages, so not drawn" in ladder and "B4 H16 S2048 D64" in ladder
    for stage, commit, day in (("0", "aaaaaaa", "2025-01-01"), ("2", "bbbbbbb", "2025-01-02"), ("5", "0123456", "2025-01-01"),
                               ("6", "fedcba9", "2025-01-03")):  # stage 6 has no record of its own: the run's
        assert re.search(rf"\[Stage {stage}\]\(stages/stage{stage}\.md\) \|.*\| `{commit}`, <span[^>]*>{day}</span> \|",
                         ladder), stage


def test_nulls_and_a_second_gpu(tmp_path, monkeypatch):
    other = copy.deepcopy(FAKE)
    other["gpu"] = "NVIDIA A100-SXM4-80GB"
    bench = other["stages"]["stage2_warp"]["benchmarks"][0]
    bench.update(tflops=None, reference=None, baselines={"flash": None})
    (tmp_path / "a100.json").write_text(json.dumps(other))
    (tmp_path / "h100.json").write_text(json.dumps(FAKE))
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(tmp_path))
    hook = load_hook()
    runs = hook.load_runs()
    assert [r["gpu"] for r in runs] == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]  # the H100 first
    text = hook.results_md("stage2_warp", runs) + hook.ladder_md(runs)
    assert "On the NVIDIA A100-SXM4-80GB" in text and "On the NVIDIA H100 80GB HBM3" in text


# ---------------------------------------------------------------- the ladders' rungs, and a tab per GPU

def test_the_hook_reads_each_stages_ladder():
    hook = load_hook()
    assert hook.ladder_of("stage6_grouped_gemm") == (
        "stage6_grouped_gemm", "stage6_grouped_gemm:mma_sync", "stage6_grouped_gemm:simt")
    assert hook.ladder_of("stage7_moe_layer") == ("stage7_moe_layer", "stage7_moe_layer:mma_sync")
    assert hook.ladder_of("stage4_hopper") == (  # from its ladder package, which its module does not import
        "stage4_hopper", "stage4_hopper:warp_specialized", "stage4_hopper:tma", "stage4_hopper:wgmma")
    assert hook.ladder_of("stage0_naive") == ("stage0_naive",)
    assert hook.stage_name("stage6_grouped_gemm:mma_sync") == "Stage 6 · mma_sync rung"
    assert hook.stage_name("stage6_grouped_gemm") == "Stage 6"
    assert hook.short_key("stage6_grouped_gemm:simt") == "stage6:simt" and hook.short_key("stage7_moe_layer") == "stage7"


def test_the_hooks_ladders_are_the_graders():
    """The hook reads each module's RUNGS with ast (the site builds without importing torch); the
    grader imports them. Both must name the same rungs in the same order."""
    pytest.importorskip("torch")
    import stages
    hook = load_hook()
    for name in stages.stage_names():
        assert list(hook.ladder_of(name)) == [s.key for s in stages.with_rungs(name)], name


def test_grades_list_rungs_under_their_stage(fake_results, monkeypatch):
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    table = hook.grades_table(hook.load_runs()[0])
    rows = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines() if line.startswith("| [Stage")]
    assert rows == [f"[{name}](stages/stage{n}.md)" for name, n in (
        ("Stage 0", 0), ("Stage 2", 2), ("Stage 5", 5), ("Stage 6", 6), ("Stage 6 · mma_sync rung", 6),
        ("Stage 6 · simt rung", 6), ("Stage 7", 7), ("Stage 7 · mma_sync rung", 7))]
    assert "| **B** (73 %) | 0.6 × the fastest library baseline |" in table  # the mma_sync rung's own goal
    # stage 7's rung is not in the H100's file: its row, and the note, say so
    assert re.search(r"\| \[Stage 7 · mma_sync rung\]\(stages/stage7\.md\) \| not measured yet \|", table)
    assert "stage 7's mma_sync rung (`python -m grader stage7:mma_sync`)" in table
    h200 = hook.grades_table(hook.load_runs()[1])
    assert "not measured yet" not in h200 and "On the NVIDIA H200." in h200


def test_the_ladder_shows_rungs_beside_their_stage_from_the_lowest_up(fake_results, monkeypatch):
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    run = hook.load_runs()[0]
    panels = {panel.problems: stages for panel, stages in hook.run_panels(run)}
    moe = panels[("moe_experts", "moe_layer")]
    assert [key for key, _ in moe] == ["stage6_grouped_gemm:simt", "stage6_grouped_gemm:mma_sync", "stage6_grouped_gemm",
                                       "stage7_moe_layer"]
    panel = next(p for p in hook.PANELS if p.problems == ("moe_experts", "moe_layer"))
    chart = hook.ladder_figure(panel, moe, [MOE_LABEL], {MOE_LABEL: "#000"})
    groups = re.findall(r'text-anchor="middle">(Stage \d)</text>(?:<text class="fm-label fm-rung"[^>]*>([^<]*)</text>)?', chart)
    assert groups == [("Stage 6", "simt rung"), ("Stage 6", "mma_sync rung"), ("Stage 6", "wgmma"), ("Stage 7", "")]
    assert len(set(groups)) == len(groups)  # no two bars under the same name
    assert "Stage 6 · mma_sync rung, " + MOE_LABEL + ": 132 TFLOP/s" in chart  # a bar's tooltip names its rung
    steps = hook.steps_figure(run, moe, [MOE_LABEL], {MOE_LABEL: "#000"}, "h")
    headings = re.findall(r'<text class="fm-label" x="0" y="[\d.]+">([^<]*)</text>', steps)
    assert headings == ["Stage 6 · mma_sync rung over the simt rung (timed side by side in one run)",
                        "Stage 6 over the mma_sync rung (timed side by side in one run)",
                        "Stage 7 over the mma_sync rung (timed side by side in one run)"]
    assert "7.82×" in steps and "2.46×" in steps and "2.31×" in steps


def test_a_rung_without_a_side_by_side_time_steps_down_its_ladder(fake_results, monkeypatch):
    """Without previous_stage, the step below a stage is its highest rung that has times (separate
    runs), below the lowest rung there is none (stage 5 solves another problem), and a stage whose
    rungs are missing has none either."""
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    run = copy.deepcopy(hook.load_runs()[0])
    for entry in run["stages"].values():
        for bench in entry["benchmarks"]:
            bench.pop("previous_stage", None)
    stage6 = run["stages"]["stage6_grouped_gemm"]["benchmarks"][0]
    step = hook.step_at(run, "stage6_grouped_gemm", stage6)
    assert (step.previous, step.side_by_side) == ("stage6_grouped_gemm:mma_sync", False)
    assert step.speedup == pytest.approx(7.8 / 3.21)
    assert hook.previous_stage(run, "stage6_grouped_gemm:mma_sync") == "stage6_grouped_gemm:simt"
    assert hook.previous_stage(run, "stage6_grouped_gemm:simt") is None
    assert hook.previous_stage(run, "stage2_warp") == "stage0_naive"  # attention: the stage before, as ever
    del run["stages"]["stage6_grouped_gemm:mma_sync"]
    assert hook.previous_stage(run, "stage6_grouped_gemm") == "stage6_grouped_gemm:simt"
    del run["stages"]["stage6_grouped_gemm:simt"]
    assert hook.previous_stage(run, "stage6_grouped_gemm") is None


def test_a_stage_and_its_rungs_side_by_side(fake_results, monkeypatch):
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    runs = hook.load_runs()
    table = hook.rungs_table(runs[0], "stage6_grouped_gemm")
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0] == "| Shape, kernel | ms | TFLOP/s | × the rung below |"
    assert rows[1] == f"| **{MOE_LABEL}** | | | |"
    assert rows[2] == "| &emsp;simt rung | 60.300 | 17.1 |  |"
    assert rows[3] == "| &emsp;mma_sync rung | 7.800 | 132.4 | 7.82× <small>same run</small> |"
    assert rows[4] == "| &emsp;Stage 6 (wgmma) | 3.210 | 321.9 | 2.46× <small>same run</small> |"
    assert "simt rung **C** (goal: 0.06 × the fastest library baseline)" in table
    stage7 = hook.rungs_table(runs[0], "stage7_moe_layer")  # its rung is missing on the H100
    assert "Not measured yet on the NVIDIA H100 80GB HBM3: mma_sync rung (`python -m grader stage7:mma_sync`)" in stage7
    # the rung it was timed beside has no row here: the cell names it
    assert "| &emsp;Stage 7 (wgmma) | 3.500 | 295.1 | 2.31× <small>over the mma_sync rung, same run</small> |" in stage7
    both = hook.rungs_md("stage6_grouped_gemm", runs)  # a tab per GPU, the H100's first
    assert both.index(">H100 80GB HBM3</label>") < both.index(">H200</label>")
    assert f"| &emsp;mma_sync rung | {H200_MS:.3f} |" in both
    with pytest.raises(hook.PluginError, match="no ladder"):
        hook.rungs_md("stage2_warp", runs)


def test_rung_placeholders(fake_results, monkeypatch):
    """results: and figure: take a rung's key; rungs: a stage's directory."""
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="stages/stage6.md"))
    fill = lambda text: hook.on_page_markdown(text, page, None, None)
    results = fill("<!-- results:stage6_grouped_gemm:mma_sync -->")
    assert "Stage 6 · mma_sync rung (`python -m grader stage6:mma_sync`)" in results and "7.800" in results
    assert "× the simt rung" in results and "7.82× <small>same run</small>" in results
    key = "stage6_grouped_gemm:mma_sync"
    for field, shown in (("tflops", "166 TFLOP/s"), ("ms", "6.24 ms"), ("previous_stage", "7.82×"),  # the H200's
                         ("vs.stage6_grouped_gemm:simt", "7.73×")):
        value = fill(f"<!-- figure:{key}:{MOE_LABEL}:{field} -->")
        assert re.fullmatch(rf'<span class="fm-figure-value" title="Stage 6 · mma_sync rung, [^"]+">{re.escape(shown)}</span>', value), value
    assert "| &emsp;Stage 6 (wgmma) |" in fill("<!-- rungs:stage6_grouped_gemm -->")
    with pytest.raises(hook.PluginError, match="no such stage or rung"):  # a typo fails the build
        fill("<!-- results:stage6_grouped_gemm:nosuchrung -->")


def test_measured_cells_fill_in_where_a_step_is_first_recorded(fake_results, monkeypatch):
    """measured: is a table's cell beside predicted ones: the figures from the first GPU's file that holds
    the key (the H100's first), the GPU named; "not measured yet" where none does; a typo fails the build."""
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="stages/stage4.md"))
    fill = lambda text: hook.on_page_markdown(text, page, None, None)
    h100 = fill(f"<!-- measured:stage6_grouped_gemm:mma_sync:{MOE_LABEL}:ms+pct_of_reference -->")
    assert re.fullmatch(r'<span class="fm-figure-value" title="Stage 6 · mma_sync rung, [^"]+">7\.80 ms · 32\.1%</span> '
                        r'<small>H100 80GB HBM3</small>', h100), h100
    h200 = fill(f"<!-- measured:stage7_moe_layer:mma_sync:{MOE_LABEL}:ms -->")  # only the H200 measured it
    assert ">6.50 ms</span> <small>H200</small>" in h200 and "measured on the NVIDIA H200" in h200
    over = fill(f"<!-- measured:stage6_grouped_gemm:mma_sync:{MOE_LABEL}:vs.stage6_grouped_gemm:simt -->")
    assert ">7.73×</span>" in over
    assert fill("<!-- measured:stage4_hopper:wgmma:B16 H16 S2048 D64:ms -->") == \
        '<span class="fm-missing">not measured yet</span>'
    for typo in ("stage4_hopper:nosuchrung:B16 H16 S2048 D64:ms", "stage4_hopper:wgmma:B16 H16 S2048 D64:msec"):
        with pytest.raises(hook.MissingFigure):
            fill(f"<!-- measured:{typo} -->")


def test_without_the_rungs_tables_say_not_measured_but_a_figure_fails(tmp_path, monkeypatch):
    """The repository's own results before the rungs were graded: the tables say "not measured yet",
    a figure a lesson quotes from a rung fails the build."""
    old = copy.deepcopy(FAKE)
    old["stages"] = {k: v for k, v in old["stages"].items() if ":" not in k}
    (tmp_path / "h100-sxm.json").write_text(json.dumps(old))
    monkeypatch.delenv("FLASHMOE_RESULTS_DIR", raising=False)
    hook = load_hook()
    monkeypatch.setattr(hook, "results_folder", lambda: (tmp_path, True))  # as if they were results/
    runs = hook.load_runs()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="stages/stage6.md"))
    fill = lambda text: hook.on_page_markdown(text, page, None, None)
    grades = hook.grades_table(runs[0])
    assert "| [Stage 6 · mma_sync rung](stages/stage6.md) | not measured yet |" in grades
    assert "| [Stage 6 · simt rung](stages/stage6.md) | not measured yet |" in grades
    assert "Not measured yet on the NVIDIA H100 80GB HBM3: simt rung (`python -m grader stage6:simt`), " \
           "mma_sync rung (`python -m grader stage6:mma_sync`)" in fill("<!-- rungs:stage6_grouped_gemm -->")
    assert "not measured yet" in fill("<!-- results:stage6_grouped_gemm:simt -->")
    with pytest.raises(hook.MissingFigure, match="stages/stage6.md.*no results for stage6_grouped_gemm:mma_sync"):
        fill(f"<!-- figure:stage6_grouped_gemm:mma_sync:{MOE_LABEL}:tflops -->")
    (tmp_path / "h100-sxm.json").unlink()
    assert "not measured yet" in fill("<!-- rungs:stage6_grouped_gemm -->")  # no results at all


def test_prose_figures_read_the_prose_gpus_file(fake_results, monkeypatch):
    """Whatever other GPUs' files hold: the PROSE_GPU's (the H200's) figure, its GPU named on hover; a figure
    only another GPU measured is not quoted."""
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))
    hook = load_hook()
    runs = hook.load_runs()  # the H100's first: the figure still reads the H200's
    value = hook.figure_md(runs, "stage6_grouped_gemm:mma_sync", MOE_LABEL, "ms")
    assert ">6.24 ms<" in value and "measured on the NVIDIA H200" in value
    del next(run for run in runs if "H200" in run["gpu"])["stages"]["stage6_grouped_gemm:mma_sync"]
    assert "not measured" in hook.figure_md(runs, "stage6_grouped_gemm:mma_sync", MOE_LABEL, "ms")  # the H100's only


def test_the_lessons_say_which_gpu_a_figure_is_from():
    """A paragraph that quotes a figure from the results names the GPU those figures come from."""
    hook = load_hook()
    unnamed = [f"{page.relative_to(ROOT)}: {' '.join(block.split())[:120]}"
               for page in PAGES for block in re.split(r"\n[ \t]*\n", FENCED.sub("", page.read_text()))
               if FIGURE.search(block) and hook.PROSE_GPU not in block]
    assert not unnamed, "say which GPU (\"on the H200\") beside these figures:\n" + "\n".join(unnamed)


def test_every_gpu_has_a_tab(fake_site):
    """Both results files on the site: a tab per GPU wherever a chart or table is drawn, the H100's
    first and checked, the radio buttons children of the tab set as Material's tabs want them."""
    home = (fake_site / "index.html").read_text()
    sets = re.findall(r'<div class="tabbed-set tabbed-alternate fm-gpus" data-tabs="[\d:]+">(.*?)<div class="tabbed-labels">'
                      r'(.*?)</div>', home, re.S)
    assert len(sets) == 4  # attention, routing, the MoE GEMMs and layer, the grades
    for inputs, labels in sets:
        assert re.fullmatch(r'\s*<input class="fm-gpu-input" checked id="[\w-]+" name="[\w-]+" type="radio" />'
                            r'<input class="fm-gpu-input" id="[\w-]+" name="[\w-]+" type="radio" />\s*', inputs), inputs
        assert re.findall(r">([^<]+)</label>", labels) == ["H100 80GB HBM3", "H200"]
    assert "<p><input" not in home
    assert "Measured on 2 GPUs: the NVIDIA H100 80GB HBM3 (<code>results/h100-sxm.json</code>) and the NVIDIA H200" in home
    stage6 = (fake_site / "stages" / "stage6" / "index.html").read_text()
    assert stage6.count('class="tabbed-set tabbed-alternate fm-gpus"') == 4  # the side-by-side table, stage 6, 2 rungs
    assert f"{H200_MS:.3f}" in stage6 and "On the <strong>NVIDIA H200</strong>" in stage6
    stage7 = (fake_site / "stages" / "stage7" / "index.html").read_text()
    assert stage7.count('class="tabbed-set tabbed-alternate fm-gpus"') == 2  # its rung only on the H200: no tabs
    assert "On the <strong>NVIDIA H200</strong> (<code>results/h200.json</code>), Stage 7 · mma_sync rung" in stage7



def test_without_results_the_pages_say_not_measured(empty_site):
    assert "not measured yet" in (empty_site / "index.html").read_text()
    assert "fm-ladder" not in (empty_site / "index.html").read_text()
    for d in STAGE_DIRS:
        assert "not measured yet" in (empty_site / stage_page(d) / "index.html").read_text(), d.name


# ---------------------------------------------------------------- measured figures in the lessons' prose
# A measured figure in a lesson comes from the results when the site is built, through a placeholder
# `<!-- figure:<stage>:<shape label>:<field> -->` (docs/hooks/course.py lists the fields), or sits in
# a passage labelled as a dated measurement the results do not hold: "A/B on an H100, 2026-11-22
# (`665357d`): ...", "Profile on the H100, 2026-11-24 ...", "Measured on the H100, 2026-11-24 ...": most
# of those live in a stage's lab notebook (docs/notebook/), the lesson keeping the current figures.
# A passage of datasheet values, goals or arithmetic says so in an HTML comment, `<!-- not measured:
# why -->`. A table takes the label of the paragraph just before it.

FIGURE = re.compile(r"<!-- figure:(\w+(?::\w+)?):([^:>]+):([\w.:]+) -->")
MEASURED_LOOKING = re.compile(r"\d+(?:\.\d+)? ?(?:ms\b|TFLOP/s|x\b|%|×(?! ?(?:\d|[A-Z]\b)))")  # not "16 × 8", "64 × D"
DATED = re.compile(r"\b(?:A/B|[Pp]rofile|[Mm]easured)\s+on\s+(?:an|the)\s+[\w\s]+?,\s+\d{4}-\d{2}-\d{2}")
NOT_MEASURED = re.compile(r"<!-- not measured: [^>]+-->")
FENCED = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.S | re.M)
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def bare_figures(markdown: str) -> list[str]:
    """Measured-looking numbers outside placeholders, code and labelled passages, with their context."""
    found, labelled = [], False
    for block in re.split(r"\n[ \t]*\n", FENCED.sub("", markdown)):
        is_table = block.lstrip().startswith("|")
        labelled = bool(DATED.search(block) or NOT_MEASURED.search(block)) or (is_table and labelled)
        if labelled:
            continue
        prose = re.sub(r"<!--.*?-->|`[^`\n]*`", "", block, flags=re.S)
        found += [f"{m[0]!r} in: {' '.join(prose[max(0, m.start() - 70):m.end() + 20].split())}"
                  for m in MEASURED_LOOKING.finditer(prose)]
    return found


def test_no_bare_measured_figures_in_the_lessons():
    stale = [f"{page.relative_to(ROOT)}: {text}" for page in PAGES for text in bare_figures(page.read_text())]
    assert not stale, ("a measured-looking figure that is neither a <!-- figure:... --> placeholder nor in a "
                       "labelled passage (see the comment above bare_figures):\n" + "\n".join(stale))


def test_the_scan_catches_bare_figures():
    assert bare_figures("Stage 6 runs at 656 TFLOP/s, 1.2× the library.") == [
        "'656 TFLOP/s' in: Stage 6 runs at 656 TFLOP/s, 1.2× the library.",
        "'1.2×' in: Stage 6 runs at 656 TFLOP/s, 1.2× the library."]
    assert bare_figures("It takes 0.25 ms, under 1% of the layer.") != []
    assert bare_figures("A/B on the H100, 2026-11-22 (`665357d`): 28.5 vs 27.4 ms.\n\n| a | 3 ms |") == []
    assert bare_figures("A/B on the H100, 2026-11-22.\n\nThen 27.4 ms.") != []  # one paragraph only
    assert bare_figures("A/B on the H100: 28.5 vs 27.4 ms.") != []  # undated
    assert bare_figures("<!-- not measured: the datasheet -->\n989 TFLOP/s of tensor math") == []
    assert bare_figures("A 16 × 8 tile, 64 × D values, `x % 8`, <!-- figure:s:t:ms -->.\n\n```\n3 ms\n```") == []


def test_prose_figures_come_from_the_results(monkeypatch):
    """Every placeholder in the lessons names a stage, shape and field that results/*.json holds."""
    monkeypatch.delenv("FLASHMOE_RESULTS_DIR", raising=False)
    hook = load_hook()
    runs = hook.load_runs()
    missing = []
    for page in PAGES:
        for stage, shape, field in FIGURE.findall(page.read_text()):
            run = next((r for r in runs if stage in r.get("stages", {})), {})
            try:
                hook.figure_value(run, stage, shape, field)
            except hook.MissingFigure as error:
                missing.append(f"{page.relative_to(ROOT)}: {error}")
    assert not missing, "\n".join(missing)


def test_a_figure_the_results_lack_fails_the_build(monkeypatch, fake_results):
    monkeypatch.delenv("FLASHMOE_RESULTS_DIR", raising=False)
    hook = load_hook()
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_path="stages/stage6.md"))
    stage6 = hook.prose_run(hook.load_runs())["stages"]["stage6_grouped_gemm"]["benchmarks"][0]["label"]
    good = hook.on_page_markdown(f"<!-- figure:stage6_grouped_gemm:{stage6}:tflops -->", page, None, None)
    assert re.fullmatch(r'<span class="fm-figure-value" title="[^"]+">[\d.,]+ TFLOP/s</span>', good)
    for wrong in (f"stage6_grouped_gemm:T1 E1 k1:ms", f"stage9_missing:{stage6}:ms", f"stage6_grouped_gemm:{stage6}:gflops",
                  f"stage6_grouped_gemm:{stage6}:x.no_such_baseline", f"stage6_grouped_gemm:{stage6}:previous_stage.x"):
        with pytest.raises(hook.MissingFigure, match="stages/stage6.md"):
            hook.on_page_markdown(f"<!-- figure:{wrong} -->", page, None, None)
    monkeypatch.setenv("FLASHMOE_RESULTS_DIR", str(fake_results))  # someone else's results: no failure
    assert "not measured" in hook.on_page_markdown("<!-- figure:stage6_grouped_gemm:T1 E1 k1:ms -->", page, None, None)


# ---------------------------------------------------------------- in a browser

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,1000"]


def missing(reason: str):
    """Skip with the reason locally; in CI, which installs Chromium, fail instead."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the browser test must run)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """One headless Chromium for the module's browser tests. Nothing of a test's pages reaches the next: each
    test serves its site on a port of its own, another origin (its storage, its cache), and `browser` sets the
    window's size."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        missing("Chromium or chromedriver not found: apt-get install chromium chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing("selenium is not installed: pip install 'selenium>=4.20'")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium') / 'profile'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def browser(chromium):
    """The module's Chromium, at the size CHROMIUM_FLAGS gives it."""
    chromium.set_window_size(1400, 1000)
    return chromium


# Material's search builds its index of the whole site (the lessons' text, 1.3 MB) in a worker on every page
# load: half of Chromium's CPU time in these tests (254 s with the whole index on every page, 130 s without,
# on a 2-core CPU), for a search box only test_pages_in_a_browser types in. The index feeds the search's
# results alone, which show once a query is typed; the other tests' pages get an index of no page, in the
# site's own form (an index that does not load stops Material's scripts: its linked tabs no longer switch).
SEARCH_INDEX = "/search/search_index.json"


def an_index_of_no_page(folder: Path) -> bytes:
    index = json.loads((folder / SEARCH_INDEX.lstrip("/")).read_text())
    return json.dumps(dict(index, docs=[])).encode()


@contextlib.contextmanager
def serve(folder: Path, search: bool = False):
    """The built site at `folder`, on a port of its own; without `search`, its search index of no page (a site
    built without search has none to load)."""
    empty_index = None if search or not (folder / SEARCH_INDEX.lstrip("/")).is_file() else an_index_of_no_page(folder)

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if empty_index is None or self.path.split("?")[0] != SEARCH_INDEX:
                return super().do_GET()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(empty_index)))
            self.end_headers()
            self.wfile.write(empty_index)

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def served(fake_site):
    with serve(fake_site) as url:
        yield url


@pytest.fixture
def served_with_search(site):
    with serve(site, search=True) as url:
        yield url


@pytest.mark.browser
def test_pages_in_a_browser(browser, served_with_search):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(served_with_search + "/")
    bars = browser.find_elements(By.CSS_SELECTOR, "svg.fm-ladder rect")
    assert bars and bars[0].size["height"] > 0, "the ladder chart is missing or not drawn"

    if STAGE_DIRS:
        browser.get(f"{served_with_search}/{stage_page(STAGE_DIRS[0])}/")
        code = " ".join(block.text for block in browser.find_elements(By.CSS_SELECTOR, ".highlight code"))
        assert "__global__" in code, "no kernel code rendered from the snippets"
        diagrams = browser.find_elements(By.CSS_SELECTOR, "svg.fm-diagram")
        assert diagrams and diagrams[0].size["width"] > 100, "no diagram drawn"

    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()
    box.send_keys("softmax")
    WebDriverWait(browser, 20).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".md-search-result__item"),
                                     "search gave no results")


# A table wider than the page scrolls sideways inside the box Material wraps it in.
OVERFLOWING_TABLES = """return Array.from(document.querySelectorAll('.fm-results table'))
    .filter(t => !t.closest('details') || t.closest('details').open)
    .filter(t => { const box = t.closest('.md-typeset__scrollwrap') || t; return box.scrollWidth > box.clientWidth + 1; })
    .map(t => t.rows[0].innerText.replace(/\\s+/g, ' '))"""


def results_tables(browser) -> dict | None:
    """A page's results tables as they first show: None where it has none; else whether the table of contents shows
    beside them, and the heading rows of those that scroll sideways."""
    from selenium.webdriver.common.by import By

    if not browser.find_elements(By.CSS_SELECTOR, ".fm-results"):
        return None
    return {"toc": browser.find_element(By.CSS_SELECTOR, ".md-sidebar--secondary").is_displayed(),
            "overflowing": browser.execute_script(OVERFLOWING_TABLES)}


@pytest.mark.browser
def test_results_tables_fit_a_1400_pixel_window(site_loaded):
    """The recorded results, as CI builds them: at 1400 px, with the nav and the table of contents
    beside it, no visible results table scrolls sideways, so its key columns are on screen."""
    found = site_loaded(1400)
    # the home page's grades, each stage's results, the ops' figures
    for page in [""] + [stage_page(d) for d in STAGE_DIRS] + ["pytorch"]:
        if (tables := found[page]["tables"]) is not None:
            assert tables["toc"], f"/{page}: no table of contents beside the results"
            assert tables["overflowing"] == [], f"/{page}: a results table scrolls sideways"


CLICK_TAB = """const label = Array.from(document.querySelectorAll('.fm-gpus .tabbed-labels label'))
    .find(l => l.innerText.trim() === arguments[0]); label.click(); return !!label;"""
SHOWN_TABS = """return Array.from(document.querySelectorAll('.fm-gpus')).map(set =>
    Array.from(set.querySelectorAll(':scope > .tabbed-content > .tabbed-block')).map(b => b.offsetHeight > 0))"""


@pytest.mark.browser
def test_gpu_tabs_in_a_browser(browser, served):
    """The H100's tab shows first; choosing the H200's in one tab set shows the H200's results in
    every set of the page (Material's linked tabs)."""
    import time

    from selenium.webdriver.common.by import By

    browser.get(served + "/")
    assert browser.execute_script(SHOWN_TABS) == [[True, False]] * 4
    h100_bars = [b for b in browser.find_elements(By.CSS_SELECTOR, "svg.fm-ladder rect") if b.size["height"] > 0]
    assert h100_bars, "the H100's ladder is not drawn"
    assert browser.execute_script(CLICK_TAB, "H200")
    for _ in range(50):  # Material switches the linked tab sets from a script
        if browser.execute_script(SHOWN_TABS) == [[False, True]] * 4:
            break
        time.sleep(0.1)
    assert browser.execute_script(SHOWN_TABS) == [[False, True]] * 4
    shown = [b for b in browser.find_elements(By.CSS_SELECTOR, "svg.fm-ladder rect") if b.size["height"] > 0]
    assert shown and not set(shown) & set(h100_bars), "the H200's ladder is not drawn in its tab"


@pytest.mark.browser
def test_rung_and_gpu_tables_fit_a_1400_pixel_window(browser, served):
    """With rungs and two GPUs: the grades, the side-by-side tables and the rungs' results fit in
    each GPU's tab at 1400 px."""
    browser.set_window_size(1400, 1000)
    for page in ["", "stages/stage6/", "stages/stage7/"]:
        browser.get(f"{served}/{page}")
        for gpu in ("H100 80GB HBM3", "H200"):
            assert browser.execute_script(CLICK_TAB, gpu)
            assert browser.execute_script(OVERFLOWING_TABLES) == [], f"/{page} on the {gpu}: a results table scrolls sideways"


# Every chart and diagram on a page: its text inside the drawing (not clipped at its edge), no two texts
# over each other, and none under 11 px on screen (the drawing is never shrunk below its own size: on a
# narrow screen a chart shows its narrow drawing and a diagram's figure scrolls sideways instead;
# course.css and the hook's figure and on_page_content). A chart's drawing not shown has no width: skipped.
CHART_TEXT = """document.querySelectorAll('details').forEach(d => d.open = true);
const found = {charts: 0, outside: [], small: [], overlapping: [], shrunk: []};
for (const svg of document.querySelectorAll('svg.fm-chart, svg.fm-diagram')) {
  const box = svg.getBoundingClientRect();
  if (box.width === 0) continue;  // in a tab that is not shown
  found.charts++;
  const scale = svg.getScreenCTM().a, name = svg.getAttribute('aria-label') || svg.getAttribute('class');
  if (box.width < svg.viewBox.baseVal.width - 1) found.shrunk.push(name);
  const texts = Array.from(svg.querySelectorAll('text')).map(t => [t, t.getBoundingClientRect()]).filter(([t, r]) => r.width > 0);
  for (const [t, r] of texts) {
    const px = parseFloat(getComputedStyle(t).fontSize) * scale;
    if (px < 11 - 0.01) found.small.push(`${name}: "${t.textContent.slice(0, 40)}" ${px.toFixed(1)} px`);
    if (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1 || r.bottom > box.bottom + 1)
      found.outside.push(`${name}: "${t.textContent.slice(0, 40)}"`);
  }
  for (let i = 0; i < texts.length; i++) for (let j = i + 1; j < texts.length; j++) {
    const a = texts[i][1], b = texts[j][1];
    if (Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1 && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 3)
      found.overlapping.push(`${name}: "${texts[i][0].textContent.slice(0, 30)}" / "${texts[j][0].textContent.slice(0, 30)}"`);
  }
}
return found;"""


def pages_with_charts(site: Path) -> list[str]:
    return sorted(str(p.parent.relative_to(site)).replace(".", "") for p in site.rglob("index.html")
                  if re.search(r'<svg class="fm-(?:chart|diagram)', p.read_text()))


@pytest.mark.browser
@pytest.mark.parametrize("width", [1400, 400])
def test_chart_text_is_inside_and_legible(site_loaded, site, width):
    """At 1400 px (the nav and the table of contents beside the page) and at 400 px (a phone), on
    every page with a chart or diagram: no text clipped or overlapping, none under 11 px."""
    pages = pages_with_charts(site)
    assert "stages/stage10" in pages and "stages/stage11" in pages and "" in pages
    problems = []
    for page in pages:
        found = site_loaded(width)[page]["charts"]
        assert found["charts"], f"/{page}: no chart drawn"
        problems += [f"/{page} at {width} px, {kind}: {item}" for kind in ("outside", "small", "overlapping", "shrunk")
                     for item in found[kind]]
    assert not problems, "\n".join(problems[:40])


# Every page at a phone's width and a desktop's: the page never scrolls sideways (a wide diagram, table or
# code block scrolls inside its own box), each diagram sits in its figure, each arrow has its arrowhead,
# and each chart fits its figure, its bars and their values on screen. Every <details> is opened and every
# GPU's tab shown at once, so that nothing is checked only in the first tab.
LAYOUT = """document.querySelectorAll('details').forEach(d => d.open = true);
const all = document.createElement('style');
all.textContent = '.md-typeset .tabbed-content > .tabbed-block { display: block !important; }';
document.head.appendChild(all);
const root = document.documentElement, width = root.clientWidth;
const name = el => el.getAttribute('aria-label') || el.getAttribute('class') || el.tagName;
const scrolls = el => { for (let e = el.parentElement; e && e !== document.body; e = e.parentElement)
  if (getComputedStyle(e).overflowX !== 'visible') return true; return false; };
const found = {scroll: [], bare: [], arrows: 0, headless: [], charts: 0, cut: []};
if (root.scrollWidth > width)
  found.scroll = [`${root.scrollWidth} px wide in ${width} px`].concat(Array.from(document.body.querySelectorAll('*'))
    .filter(el => el.getBoundingClientRect().right > width + 1 && !scrolls(el)).slice(0, 3)
    .map(el => `${el.tagName.toLowerCase()} ${name(el)}`));
for (const svg of document.querySelectorAll('svg.fm-diagram')) {
  if (!svg.parentElement.matches('figure.fm-figure')) found.bare.push(name(svg));
  for (const el of svg.querySelectorAll('path, line, polyline')) {
    const style = getComputedStyle(el), ends = [style.markerStart, style.markerEnd].filter(m => m && m !== 'none');
    if (el.matches('.fm-diagram .arrow')) {
      found.arrows++;
      if (!ends.length) found.headless.push(`${name(svg)}: an arrow without a marker`);
    }
    for (const url of ends) {
      const id = /url\\("?#([^")]+)"?\\)/.exec(url), marker = id && document.getElementById(id[1]);
      if (!marker || marker.tagName !== 'marker') found.headless.push(`${name(svg)}: ${url} names no marker`);
      else if (document.querySelectorAll(`[id="${id[1]}"]`).length > 1) found.headless.push(`${name(svg)}: ${url} names two elements`);
      else if (!marker.querySelector('path') || getComputedStyle(marker.querySelector('path')).fill === 'none')
        found.headless.push(`${name(svg)}: ${url} draws nothing`);
    }
  }
}
for (const svg of document.querySelectorAll('svg.fm-chart')) {
  const box = svg.getBoundingClientRect();
  if (box.width === 0) continue;  // the other width's drawing of the chart
  found.charts++;
  const figure = svg.closest('figure'), fig = figure.getBoundingClientRect();
  const left = fig.left + figure.clientLeft, right = left + figure.clientWidth;
  if (box.left < left - 1 || box.right > right + 1)
    found.cut.push(`${name(svg)}: ${box.width.toFixed(0)} px wide in a figure of ${figure.clientWidth} px`);
  const bars = Array.from(svg.querySelectorAll('rect')).filter(r => !r.closest('defs'));
  if (!bars.length && !svg.querySelector('polyline')) found.cut.push(`${name(svg)}: no bars or lines`);
  const off = bars.filter(bar => { const r = bar.getBoundingClientRect();
    return r.width <= 0 || r.height <= 0 || r.left < left - 1 || r.right > right + 1 || r.right > width + 1; });
  if (off.length) found.cut.push(`${name(svg)}: ${off.length} of ${bars.length} bars off screen or not drawn, the first: `
                                 + (off[0].querySelector('title')?.textContent || ''));
}
return found;"""


def site_pages(site: Path) -> list[str]:
    return sorted(str(p.parent.relative_to(site)).replace(".", "") for p in site.rglob("index.html"))


# What the tests of the site as CI builds it read of each page, in this order on one load: the results tables as
# they first show, then the charts' text (which opens every <details>), then the layout (every tab shown too).
PAGE_CHECKS = {"tables": results_tables, "charts": lambda browser: browser.execute_script(CHART_TEXT),
               "layout": lambda browser: browser.execute_script(LAYOUT)}


@pytest.fixture(scope="module")
def site_loaded(chromium, site):
    """site_loaded(width): {page: {check: what it found}} of every page of the site as CI builds it, each loaded once
    at that width (on a port of its own) for all of PAGE_CHECKS: each page's load and drawing is most of a browser
    test's time, and three tests read the same pages at the same widths."""
    @functools.cache
    def loaded(width: int) -> dict:
        chromium.set_window_size(width, 1000)
        found = {}
        with serve(site) as url:
            for page in site_pages(site):
                chromium.get(f"{url}/{page}/" if page else url + "/")
                found[page] = {check: read(chromium) for check, read in PAGE_CHECKS.items()}
        return found
    return loaded


@pytest.mark.browser
@pytest.mark.parametrize("width", [1400, 400])
def test_pages_fit_a_phone_and_a_desktop(site_loaded, site, width):
    """At 400 px (a phone) and at 1400 px, every page of the site: no sideways scroll of the page, every
    diagram in its figure with its arrowheads, every chart within its figure with its bars visible."""
    pages = site_pages(site)
    expected = ["", "setup", "grading", "pytorch", "glossary", "notebook/grading"] + [
        page for d in STAGE_DIRS for page in (stage_page(d), stage_page(d).replace("stages/", "notebook/"))]
    assert not set(expected) - set(pages), f"pages not built: {sorted(set(expected) - set(pages))}"
    problems, arrows, charts = [], 0, 0
    for page in pages:
        found = site_loaded(width)[page]["layout"]
        arrows, charts = arrows + found["arrows"], charts + found["charts"]
        problems += [f"/{page} at {width} px, {kind}: {item}" for kind in ("scroll", "bare", "headless", "cut")
                     for item in found[kind]]
    assert arrows and charts, "no arrows or no charts found: the checks looked at nothing"
    problems = [f"{p} (×{n})" if n > 1 else p for p, n in collections.Counter(problems).items()]
    assert not problems, "\n".join(problems[:60])
