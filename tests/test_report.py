"""The report a learner reads, rendered from a result of the shape run.py returns."""
import pytest
from rich.console import Console

from grader import grading, report
from grader.gpus import spec_for
from stages import Goal


# A long mix, as stage 4's: at 80 columns a table cell would cut it to "HGM…".
SASS_MIX = {"HGMMA": 32, "HMMA": 64, "FFMA": 237, "MUFU": 204, "LDGSTS": 12, "UTMALDG": 3, "STG": 18, "SHFL": 12,
            "BAR": 8}
# Every figure the report exists to show, as it must appear: whole, on one line.
FIGURES = ("Stage 9 — a test", "stages/x/attention.cu", "NVRTC 13.5", "fp16 D64", "128", "49152 B",
           *[f"{op}:{n}" for op, n in SASS_MIX.items()], "B1 H1 Sq17 Skv17 D64 full fp16", "B1 H1 Sq1 Skv1 D64 full fp16",
           "4.20e-04", "1.00e-05", "3.00e-04", "1.90e-03", "acceptable", "timeout: no progress for 60 s",
           "B16 H16 S2048 D64", "1.234", "1.190", "1.2%", "222.9", "cudnn 0.620 ms", "50.2", "9.24x", "2 blk/SM",
           "out of memory", "11.400; 2,048 MiB", "Grade A", "0.9 × the flash baseline", "A > 80%")


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
              "arch": "sm_90a", "nvrtc": "13.5",
              "resources": {"ELEM_T=__half,HEAD_DIM=64": {"attention_fwd": {
                  "registers": 128, "shared_bytes": 49152, "stack_bytes": 0, "spill_stores": 0, "spill_loads": 0,
                  "sass": SASS_MIX}}},
              "correctness": {"passed": 1, "failed": 1, "seed": 0, "trials": 2, "cases": [
                  {"name": "B1 H1 Sq17 Skv17 D64 full fp16", "passed": True, "inputs_unmodified": True, "checks": [check]},
                  {"name": "B1 H1 Sq1 Skv1 D64 full fp16", "passed": False, "failure": "timeout: no progress for 60 s"}]},
              "benchmarks": [bench]}
    result.update(grading.grade(Goal("flash", 0.9), [bench]))
    return result


def rendered(width: int) -> str:
    console = Console(record=True, width=width)
    report.console = console
    report.print_stage(fake_result(), "NVIDIA H100 80GB HBM3")
    return console.export_text()


@pytest.mark.parametrize("width", [220, 120, 80, 60])
def test_report_shows_every_figure_whole_at_any_width(width):
    text = rendered(width)
    lines = text.splitlines()
    for expected in FIGURES:
        assert any(expected in line for line in lines), f"{expected!r} is not whole on a line at {width} columns"
    assert all(len(line.rstrip()) <= width for line in lines)
    cut = [line for line in lines if "…" in line and "sha256" not in line]  # the digest is shortened on purpose
    assert not cut, cut


def test_wide_terminals_get_tables_narrow_ones_records():
    assert "┃ variant" in rendered(220)
    narrow = rendered(80)
    assert "┃ variant" not in narrow and "fp16 D64 attention_fwd" in narrow.splitlines()
    assert "┃ shape             ┃    cudnn" in narrow  # the baselines' table fits 80 columns: kept


FORWARD_BACKWARD = {"stage": "stage4_hopper", "ms": 4.321, "tflops": 312.4, "skipped": {"math": "out of memory"},
                    "baselines": {"cudnn": 5.678, "flash": 6.789, "naive": 40.5, "math": None}}


@pytest.mark.parametrize("width", [220, 120, 80, 60])
def test_a_backwards_forward_and_backward_are_shown_whole_at_any_width(width, monkeypatch):
    result = fake_result()
    result["benchmarks"][0]["forward_backward"] = FORWARD_BACKWARD
    monkeypatch.setattr(report, "console", Console(record=True, width=width))
    report.print_stage(result, "NVIDIA H100 80GB HBM3")
    lines = report.console.export_text().splitlines()
    for expected in ("Forward + backward", "stage4_hopper", "4.321", "312.4", "5.678", "6.789", "40.500",
                     "out of memory", "1.31x vs cudnn"):
        assert any(expected in line for line in lines), f"{expected!r} is not whole on a line at {width} columns"
    assert all(len(line.rstrip()) <= width for line in lines)


def test_a_forward_only_stage_has_no_forward_and_backward_table():
    assert "Forward + backward" not in rendered(220)
