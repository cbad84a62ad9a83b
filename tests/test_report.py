"""The report a learner reads, rendered from a result of the shape run.py returns."""
from rich.console import Console

from grader import grading, report
from grader.gpus import spec_for
from stages import Goal


def fake_result():
    shape = dict(B=16, H=16, Sq=2048, Skv=2048, D=64, causal=False)
    baselines = {"cudnn": 0.62, "flash": 1.05, "naive": 11.4}
    bench = {"label": "B16 H16 S2048 D64", "shape": shape, "dtype": "float16", "ms_min": 1.19, "spread": 0.012,
             "reps": 40, "baselines": baselines, "skipped": {"math": "out of memory"},
             "baseline_extra_memory_bytes": {"cudnn": 0, "flash": 0, "naive": 2 << 30}, "extra_memory_bytes": 0,
             "launches": {"attention_fwd": {"blocks_per_sm": 2}}}
    bench.update(grading.benchmark_figures(shape, 1.234, baselines, 2.75e11, 1.7e8, spec_for("NVIDIA H100 80GB HBM3")))
    check = {"output": "o", "passed": True, "tolerance": 1.9e-3, "quality": "acceptable",
             "kernel": {"max_abs": 4.2e-4, "mean_abs": 1e-5, "max_rel": 3e-4, "finite": True}}
    result = {"title": "Stage 9 — a test", "kernel_path": "stages/x/attention.cu", "source_sha256": "ab" * 32,
              "arch": "sm_90a",
              "resources": {"ELEM_T=__half,HEAD_DIM=64": {"attention_fwd": {
                  "registers": 128, "shared_bytes": 49152, "stack_bytes": 0, "spill_stores": 0, "spill_loads": 0,
                  "sass": {"HMMA": 64, "LDGSTS": 12}}}},
              "correctness": {"passed": 1, "failed": 1, "seed": 0, "trials": 2, "cases": [
                  {"name": "B1 H1 Sq17 Skv17 D64 full fp16", "passed": True, "inputs_unmodified": True, "checks": [check]},
                  {"name": "B1 H1 Sq1 Skv1 D64 full fp16", "passed": False, "failure": "timeout: no progress for 60 s"}]},
              "benchmarks": [bench]}
    result.update(grading.grade(Goal("flash", 0.9), [bench]))
    return result


def test_report_shows_what_was_measured():
    console = Console(record=True, width=220)
    report.console = console
    report.print_stage(fake_result(), "NVIDIA H100 80GB HBM3")
    text = console.export_text()
    for expected in ("Stage 9 — a test", "stages/x/attention.cu", "fp16 D64", "HMMA:64", "LDGSTS:12",
                     "4.20e-04", "acceptable", "timeout: no progress", "1.234", "222.9",  # 2.75e11 / 1.234 ms
                     "cudnn 0.620 ms", "50.2", "9.24x", "2 blk/SM", "out of memory", "Grade",
                     "0.9 × the flash baseline", "A > 80%"):
        assert expected in text, expected
