"""The committed results: measured by the grader on a GPU, for the kernels as they are now."""
import json

import pytest

import reference
import stages
from grader import results
from grader.runs_digest import is_current
from stages.common.compiler import nvrtc_version

RECORDED = results.load_all()
# Problems with no plain-PyTorch ("naive") baseline: block-sparse attention's plain form is a Python walk
# over 800 query blocks at its benchmark shape (seconds a call); FlexAttention's is its yardstick.
WITHOUT_NAIVE = {"block_sparse_attention", "block_sparse_attention_backward"}  # the backward: the same walk


def test_there_are_recorded_results():
    assert RECORDED, "no results/*.json: run python -m grader all --json results/<gpu>.json on a GPU"


@pytest.mark.parametrize("gpu", sorted(RECORDED))
def test_results_match_the_current_sources(gpu):
    """Each entry's sources are the tree's, or else what runs is the same (grader/runs_digest.py)."""
    data = RECORDED[gpu]
    for name, entry in data["stages"].items():
        stage = stages.load(name)
        if entry.get("stale"):  # measured on older sources and said so: not shown as the kernel's figures
            continue
        assert is_current(entry, stage), (
            f"{name} changed since it was measured on {data['gpu']} (its sources, and what runs: its machine "
            f"code or launch by NVRTC {nvrtc_version()}, where it has their digest): measure it again "
            f"(python -m grader {name} --json results/{gpu}.json)")


@pytest.mark.parametrize("gpu", sorted(RECORDED))
def test_current_results_are_keyed_on_what_runs_too(gpu):
    """A current entry carries its runs digest (the grader writes it; python -m grader rekey adds it)."""
    unkeyed = [name for name, entry in RECORDED[gpu]["stages"].items()
               if not entry.get("stale") and not entry.get("runs_digest")]
    assert not unkeyed, f"no runs digest: {unkeyed} (python -m grader rekey results/{gpu}.json)"


@pytest.mark.parametrize("gpu", sorted(RECORDED))
def test_every_stage_and_rung_the_gpu_runs_is_recorded(gpu):
    from grader.__main__ import everything, runs_here
    from grader.device import GpuInfo

    data = RECORDED[gpu]
    major, minor = map(int, data["provenance"]["compute_capability"].split("."))
    here = GpuInfo(data["gpu"], major, minor, 0, 0, 0, 0, "")
    runnable = {stage.key for stage in everything() if runs_here(stage, here, None)}
    missing = data.get("not_measured", {})  # stages not measured on this GPU yet, each with its reason
    assert all(isinstance(why, str) and why for why in missing.values()) and not set(missing) & set(data["stages"])
    assert runnable <= set(data["stages"]) | set(missing), \
        f"not recorded on {data['gpu']}: {sorted(runnable - set(data['stages']) - set(missing))}"


@pytest.mark.parametrize("gpu", sorted(RECORDED))
def test_results_have_the_fields_other_tools_read(gpu):
    data = RECORDED[gpu]
    assert data["gpu"] and data["stages"]
    for name, entry in data["stages"].items():
        assert entry["correctness"]["passed"] > 0 and entry["correctness"]["failed"] == 0, name
        assert entry["grade"] in ("A", "B", "C", "D", "F")  # one letter ("" or "AB" are not grades)
        assert entry["benchmarks"], name
        for bench in entry["benchmarks"]:
            shape = set(bench["shape"])
            assert {"B", "H", "D", "causal"} <= shape or {"B", "H", "D", "mask"} <= shape or "tokens" in shape \
                or {"model", "B", "S"} <= shape or {"B", "H", "D", "page_size"} <= shape
            assert bench["dtype"] and bench["ms"] > 0 and bench["tflops"] > 0
            assert {"name", "ms", "tflops"} <= set(bench["reference"])
            assert "naive" in bench["baselines"] or entry["problem"] in WITHOUT_NAIVE, name
        assert entry["measured"]["gpu"] == data["gpu"]


@pytest.mark.parametrize("gpu", sorted(RECORDED))
def test_current_results_are_timed_at_every_shape_of_their_stage(gpu):
    """A shape added to a stage's (extra_benchmarks) leaves its record current (grader/runs_digest.py): the
    record must then be timed at it (python -m grader STAGE --shapes LABEL merges it in), or name it
    under "untimed_shapes" with the reason."""
    from grader.run import benchmark_shapes

    for name, entry in RECORDED[gpu]["stages"].items():
        if entry.get("stale"):
            continue
        stage = stages.load(name)
        problem = reference.load(stage.problem)
        wanted = {problem.shape_label(shape) for shape in benchmark_shapes(stage)}
        timed = {bench["label"] for bench in entry["benchmarks"]} | set(entry.get("untimed_shapes", {}))
        assert wanted <= timed, f"{name} on {RECORDED[gpu]['gpu']} is not timed at {sorted(wanted - timed)}"


def test_a_stage_recorded_is_no_longer_named_not_measured(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"gpu": "G", "provenance": {}, "stages": {},
                                "not_measured": {"stage13_x": "why", "stage14_y": "why"}}))
    results.write(path, "G", {}, {"stage13_x": {"grade": "A"}})
    assert json.loads(path.read_text())["not_measured"] == {"stage14_y": "why"}
    results.write(path, "G", {}, {"stage14_y": {"grade": "A"}})
    assert "not_measured" not in json.loads(path.read_text())


def test_write_keeps_other_stages_of_the_same_gpu(tmp_path):
    path = tmp_path / "r.json"
    results.write(path, "GPU X", {"p": 1}, {"stage1_a": {"grade": "A"}})
    results.write(path, "GPU X", {"p": 2}, {"stage0_b": {"grade": "B"}})
    data = json.loads(path.read_text())
    assert list(data["stages"]) == ["stage0_b", "stage1_a"] and data["provenance"] == {"p": 2}
    results.write(path, "GPU Y", {}, {"stage2_c": {}})
    assert list(json.loads(path.read_text())["stages"]) == ["stage2_c"]


def test_a_new_run_keeps_the_profile_of_the_same_source_only(tmp_path):
    path = tmp_path / "r.json"
    results.write(path, "GPU X", {}, {"stage1_a": {"source_sha256": "s", "profile": {"p": 1}}})
    results.write(path, "GPU X", {}, {"stage1_a": {"source_sha256": "s", "grade": "A"}})
    assert json.loads(path.read_text())["stages"]["stage1_a"]["profile"] == {"p": 1}
    results.write(path, "GPU X", {}, {"stage1_a": {"source_sha256": "t", "grade": "A"}})
    assert "profile" not in json.loads(path.read_text())["stages"]["stage1_a"]


def test_digest_follows_the_kernel_its_headers_and_launch_code():
    stage = stages.load("stage0")
    names = {p.name for p in results.source_files(stage)}
    # attention.py: head_slices; it holds the Hopper forward's parameter struct too (launcher.py, head_rows.py)
    assert names == {"attention.cu", "__init__.py", "attention.cuh", "attention.py", "launcher.py", "head_rows.py"}


def test_a_rungs_digest_counts_its_ladders_launch_and_the_stages_does_not():
    """Stage 4's rungs live in stages/stage4_hopper/ladder/, which stage 4's module does not import: each
    rung's digest holds the ladder's launch code and shared header, stage 4's holds neither (its records
    stay valid when its ladder changes)."""
    ladder = stages.STAGES_DIR / "stage4_hopper" / "ladder"
    for rung in stages.rungs("stage4_hopper"):
        files = results.source_files(rung)
        assert ladder / "__init__.py" in files and ladder / "forward.cuh" in files, rung.key
    assert not [p for p in results.source_files(stages.load("stage4")) if ladder in p.parents]
