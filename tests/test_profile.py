"""--profile on the CPU: the ncu command line, parsing recorded raw CSVs, the verdicts, the one-line
errors (no ncu, no permission, a bad SHAPE), and the whole parent side against a fake ncu."""
import io
import json
import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

import stages
from conftest import REPO
from grader import profile, report, results
from grader.device import GpuInfo
from test_cli import assert_one_line_error, grader

FIXTURES = REPO / "tests" / "fixtures" / "ncu"
SYNTHETIC = FIXTURES / "synthetic_raw.csv"
# Every recorded raw CSV: the fixtures, and the profiles the grader saved next to the committed results.
RECORDED = sorted(FIXTURES.glob("*.csv")) + sorted((REPO / "results" / "profiles").glob("*/*.csv"))
H100 = GpuInfo("NVIDIA H100 80GB HBM3", 9, 0, 132, 50 << 20, 1980, 80 << 30, "13.0")


def rendered(fn, *args, width=80) -> str:
    """What fn prints on a console `width` columns wide."""
    out = io.StringIO()
    saved = report.console
    report.console = Console(file=out, width=width, highlight=False)
    try:
        fn(*args)
    finally:
        report.console = saved
    return out.getvalue()


def as_profile(records, reference="cudnn"):
    return {"label": "B16 H16 S2048 D64", "dtype": "float16", "reference": {"name": reference, "ms": 0.6},
            "settings": {"text": profile.SETTINGS_TEXT}, "raw_csv": "x.csv", **profile.summarize(records)}


# ---- the command line ----------------------------------------------------------------------------

def test_the_command_line_makes_figures_comparable_and_filters_by_nvtx(tmp_path):
    command = profile.ncu_command("/usr/local/cuda/bin/ncu", tmp_path / "p.csv", 9)
    text = " ".join(command)
    for option in ("--replay-mode kernel", "--clock-control base", "--cache-control all", "--nvtx",
                   f"--nvtx-include {profile.RANGES['kernel']}/", f"--nvtx-include {profile.RANGES['reference']}/",
                   f"--nvtx-include {profile.RANGES['kernel']} ", f"--nvtx-include {profile.RANGES['reference']} ",
                   "--csv", "--page raw", "--print-units base", f"--log-file {tmp_path / 'p.csv'}"):
        assert option in text, option
    metrics = command[command.index("--metrics") + 1].split(",")
    assert metrics == profile.metric_names(9) and len(set(metrics)) == len(metrics)
    assert all(name in metrics for name, _, _ in profile.METRICS.values())
    assert all(profile.STALL_METRIC.format(r) in metrics for r in profile.STALL_REASONS)


def test_wgmma_metrics_are_asked_of_hopper_only():
    gmma = profile.METRICS["tensor_gmma_pct"][0]
    assert gmma in profile.metric_names(9) and gmma not in profile.metric_names(8)
    assert profile.METRICS["tensor_hmma_pct"][0] in profile.metric_names(8)


# ---- finding ncu, and its errors -----------------------------------------------------------------

def test_ncu_is_found_on_path_then_in_cuda_home(tmp_path, monkeypatch):
    monkeypatch.setattr(profile, "NCU_FOLDERS", ("$CUDA_HOME/bin",))
    assert profile.find_ncu({"PATH": str(tmp_path)}) is None
    binary = tmp_path / "cuda" / "bin" / "ncu"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert profile.find_ncu({"PATH": "", "CUDA_HOME": str(tmp_path / "cuda")}) == str(binary)
    assert profile.find_ncu({"PATH": str(binary.parent)}) == str(binary)
    assert profile.find_ncu({"FLASHMOE_NCU": str(tmp_path / "nowhere")}) is None


def test_missing_ncu_is_one_line_saying_how_to_get_it():
    assert "\n" not in profile.NOT_FOUND
    assert "Nsight Compute (ncu) not found" in profile.NOT_FOUND and "PATH" in profile.NOT_FOUND
    assert "/usr/local/cuda/bin" in profile.NOT_FOUND


def test_no_permission_is_one_line_saying_how_to_enable_the_counters():
    log = ("==PROF== Connected to process 4242 (/usr/bin/python3)\n==ERROR== ERR_NVGPUCTRPERM - The user does not "
           "have permission to access NVIDIA GPU Performance Counters on the target device 0.\n")
    said = profile.ncu_problem(log)
    assert said == profile.NO_PERMISSION and "\n" not in said
    assert "NVreg_RestrictProfilingToAdminUsers=0" in said and "root" in said
    assert "https://developer.nvidia.com/ERR_NVGPUCTRPERM" in said


def test_an_unknown_metric_names_the_metric():
    said = profile.ncu_problem("==ERROR== Failed to find metric sm__pipe_tensor_op_gmma_cycles_active.avg.pct\n")
    assert "sm__pipe_tensor_op_gmma_cycles_active.avg.pct" in said and "METRICS" in said
    assert profile.ncu_problem("==PROF== Disconnected from process 1\n") is None


# ---- the shape -----------------------------------------------------------------------------------

LABELS = ["B16 H16 S2048 D64", "B16 H16 S2048 D64 causal", "B4 H16 S8192 D128"]


def test_shape_by_index_or_by_label():
    assert profile.pick_shape(None, LABELS) == 0 and profile.pick_shape("2", LABELS) == 2
    assert profile.pick_shape("causal", LABELS) == 1 and profile.pick_shape("S8192", LABELS) == 2
    with pytest.raises(ValueError, match=r"there are 3 benchmark shapes \(0 to 2\)"):
        profile.pick_shape("3", LABELS)
    with pytest.raises(ValueError, match="matches no benchmark shape"):
        profile.pick_shape("D256", LABELS)


def test_a_bad_shape_is_one_line():
    assert_one_line_error(grader("stage0", "--profile", "["), "--profile '[': neither a shape's index nor a regular")


def test_profile_takes_no_cases():
    assert_one_line_error(grader("stage0", "--profile", "--cases", "x10"), "--profile runs no correctness cases")


def test_beside_needs_profile():
    assert_one_line_error(grader("stage0", "--beside", "flash"), "--beside names the baseline")


def test_profile_without_a_gpu_compiles_only_and_says_so():
    r = grader("stage0", "--profile", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiling only" in r.stdout.splitlines()[0] and "--profile" in r.stdout.splitlines()[0]


# ---- parsing recorded output ---------------------------------------------------------------------

@pytest.mark.parametrize("path", RECORDED, ids=[p.name for p in RECORDED])
def test_every_recorded_csv_parses_into_both_sides(path):
    records = profile.parse_raw_csv(path.read_text())
    assert {r["side"] for r in records} == {"kernel", "reference"}, path
    for record in records:
        m = record["metrics"]
        assert m["duration"] and m["duration"] > 0
        for key, (_, _, kind) in profile.METRICS.items():
            if kind == "pct" and m.get(key) is not None:
                # ncu's sector counts put a hit rate a little over 100% on tiny kernels (stage 5's arange: 100.8)
                assert 0 <= m[key] <= 102, (record["name"], key, m[key])
        assert m["registers"] and m["block_size"]
        assert record["stalls"] and set(record["stalls"]) <= set(profile.STALL_REASONS) | {"misc"}
    summary = profile.summarize(records)
    assert all(k["verdict"]["bound"] in ("compute", "memory", "latency") for k in summary["kernels"])
    out = rendered(profile.print_profile, as_profile(records), "stage3_pipeline", H100.name)
    assert all(len(line) <= 80 for line in out.splitlines()), "a line wider than the terminal"
    assert "-bound" in out and "First:" in out


def test_the_synthetic_csv_reads_as_written():
    records = profile.parse_raw_csv(SYNTHETIC.read_text())
    assert [r["side"] for r in records] == ["kernel", "reference", "reference"]
    ours = records[0]
    assert ours["name"] == "attention_fwd" and ours["metrics"]["duration"] == 812345
    assert ours["metrics"]["dram_read_bytes"] == 67305472 and ours["metrics"]["registers"] == 255
    assert ours["metrics"]["smem_dynamic_bytes"] == 81920 and ours["stalls"]["barrier"] == 2.4
    kernels = profile.summarize(records)["kernels"]
    assert [(k["side"], k["short"]) for k in kernels] == [
        ("kernel", "attention_fwd"), ("reference", "cudnn_generated_fort_native_s…"),
        ("reference", "vectorized_elementwise_kernel")]
    assert [k["verdict"]["bound"] for k in kernels] == ["compute", "compute", "memory"]
    assert [s["reason"] for s in kernels[0]["top_stalls"]] == ["barrier", "long_scoreboard", "math_pipe_throttle"]


def test_units_are_scaled_to_ns_and_bytes():
    text = SYNTHETIC.read_text().replace('"nsecond"', '"usecond"', 1).replace('"byte"', '"Kbyte"', 1)
    ours = profile.parse_raw_csv(text)[0]["metrics"]
    assert ours["duration"] == 812345e3 and ours["dram_read_bytes"] == 67305472e3


def test_without_an_nvtx_column_the_stages_kernel_names_decide():
    lines = SYNTHETIC.read_text().replace("thread Domain:Push/Pop_Range", "Something Else").replace(
        '"flashmoe_kernel"', '""').replace('"flashmoe_reference"', '""')
    sides = [r["side"] for r in profile.parse_raw_csv(lines, our_kernels=("attention_fwd",))]
    assert sides == ["kernel", "reference", "reference"]


def test_not_a_raw_csv_is_a_value_error():
    with pytest.raises(ValueError, match="not ncu's raw CSV"):
        profile.parse_raw_csv("==PROF== Connected\n==ERROR== something\n")


def test_repeated_launches_are_one_column_and_the_rest_is_other():
    def launch(name, ns, sm):
        return {"id": "0", "side": "reference", "name": name, "stalls": {"wait": 1.0},
                "metrics": {"duration": ns, "sm_pct": sm, "dram_read_bytes": 10.0, "registers": 32}}
    records = [launch("a", 100.0, 10.0), launch("a", 300.0, 50.0), launch("b", 50.0, 0.0),
               launch("c", 20.0, 0.0), launch("d", 10.0, 0.0)]
    kernels = profile.kernels_of(records, "reference", columns=3)
    assert [k["name"] for k in kernels] == ["a", "b", "other (2 kernels)"]
    assert kernels[0]["launches"] == 2 and kernels[0]["metrics"]["duration"] == 400.0
    assert kernels[0]["metrics"]["sm_pct"] == pytest.approx(40.0)  # weighted by duration
    assert kernels[0]["metrics"]["dram_read_bytes"] == 20.0 and kernels[2]["metrics"]["duration"] == 30.0


# ---- verdicts on fixed numbers -------------------------------------------------------------------

def test_compute_bound_on_tensor_cores_and_off_them():
    v = profile.verdict({"sm_pct": 80, "memory_pct": 30, "tensor_gmma_pct": 70}, {})
    assert v["bound"] == "compute" and "tensor pipe is busy 70%" in v["first"]
    v = profile.verdict({"sm_pct": 80, "memory_pct": 30, "tensor_hmma_pct": 20}, {})
    assert v["bound"] == "compute" and "tensor pipe only 20%" in v["first"]
    assert "without tensor cores" in profile.verdict({"sm_pct": 70, "memory_pct": 10}, {})["first"]


def test_memory_bound_on_dram_and_on_chip():
    v = profile.verdict({"sm_pct": 20, "memory_pct": 85, "dram_pct": 84, "dram_read_bytes": 3e6}, {})
    assert v["bound"] == "memory" and "DRAM at 84%" in v["first"] and "3.0 MB" in v["first"]
    v = profile.verdict({"sm_pct": 20, "memory_pct": 85, "dram_pct": 10}, {})
    assert v["bound"] == "memory" and "on-chip" in v["first"]


def test_latency_bound_says_what_to_look_at_first():
    stalls = {"long_scoreboard": 3.0, "barrier": 1.0, "selected": 5.0}
    base = {"sm_pct": 30, "memory_pct": 40}
    assert "one wave" in profile.verdict(dict(base, waves=0.5), stalls)["first"]
    assert "achieved occupancy 20%" in profile.verdict(dict(base, achieved_occupancy_pct=20,
                                                            theoretical_occupancy_pct=50), stalls)["first"]
    low = dict(base, achieved_occupancy_pct=12, theoretical_occupancy_pct=12.5, limit_registers=2, limit_shared=3,
               limit_warps=16, limit_blocks=32)
    assert "limited by registers" in profile.verdict(low, stalls)["first"]
    v = profile.verdict(base, stalls)
    assert v["bound"] == "latency" and "long_scoreboard (75% of stalls)" in v["first"]
    assert profile.verdict({"sm_pct": 60, "memory_pct": 61}, {})["bound"] == "memory"  # the larger bound wins


def test_every_stall_reason_has_a_one_line_explanation():
    for reason, why in profile.STALL_REASONS.items():
        assert why and "\n" not in why, reason
    assert [s["reason"] for s in profile.top_stalls({"selected": 9.0, "wait": 1.0, "barrier": 3.0})] == ["barrier", "wait"]


# ---- the parent's side, against a fake ncu -------------------------------------------------------

def fake_ncu(tmp_path, monkeypatch, mode="ok") -> str:
    script = tmp_path / "ncu"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'fake_ncu.py'} \"$@\"\n")
    script.chmod(0o755)
    monkeypatch.setenv("FAKE_NCU", mode)
    monkeypatch.setenv("FAKE_NCU_CSV", str(SYNTHETIC))
    return str(script)


def test_run_profiles_through_ncu_and_saves_the_raw_csv(tmp_path, monkeypatch):
    ncu = fake_ncu(tmp_path, monkeypatch)
    csv_path = profile.csv_path_for("stage3_pipeline", tmp_path / "results" / "h100-sxm.json")
    assert csv_path == tmp_path / "results" / "profiles" / "h100-sxm" / "stage3_pipeline.csv"
    got = profile.run(stages.load("stage3"), {}, H100, "causal", csv_path, timeout_s=60, ncu=ncu)
    assert csv_path.read_text() == SYNTHETIC.read_text()
    assert got["shape_index"] == 1 and "causal" in got["label"] and got["reference"] == {"name": "cudnn", "ms": 0.63}
    assert got["settings"]["replay_mode"] == "kernel" and got["settings"]["clock_control"] == "base"
    assert got["settings"]["ncu"] == "2025.3.1.0" and "--cache-control" in got["settings"]["command"]
    assert [k["side"] for k in got["kernels"]] == ["kernel", "reference", "reference"]
    json.dumps(got)  # the JSON the site reads


def test_run_without_permission_is_the_one_line(tmp_path, monkeypatch):
    ncu = fake_ncu(tmp_path, monkeypatch, mode="noperm")
    with pytest.raises(profile.ProfileError) as error:
        profile.run(stages.load("stage3"), {}, H100, None, tmp_path / "p.csv", timeout_s=60, ncu=ncu)
    assert str(error.value) == profile.NO_PERMISSION


def test_run_without_ncu_is_the_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(profile, "find_ncu", lambda: None)
    with pytest.raises(profile.ProfileError, match="Nsight Compute \\(ncu\\) not found"):
        profile.run(stages.load("stage3"), {}, H100, None, tmp_path / "p.csv")


def test_the_profile_goes_into_the_stages_entry(tmp_path):
    path = tmp_path / "r.json"
    with pytest.raises(ValueError, match="has no results for stage3_pipeline"):
        results.add_profile(path, "GPU X", "stage3_pipeline", {"label": "x"})
    results.write(path, "GPU X", {"p": 1}, {"stage3_pipeline": {"grade": "A"}})
    results.add_profile(path, "GPU X", "stage3_pipeline", {"label": "x"})
    assert json.loads(path.read_text())["stages"]["stage3_pipeline"] == {"grade": "A", "profile": {"label": "x"}}
