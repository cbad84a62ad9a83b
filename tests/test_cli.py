"""The command line, as a learner meets it: one-line errors, non-zero exits, compile-only without a GPU."""
import json
import os
import subprocess
import sys

from conftest import REPO


def grader(*args, env_extra=None):
    env = dict(os.environ, FLASHMOE_NO_GPU="1", COLUMNS="160", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "grader", *args], cwd=REPO, env=env, capture_output=True, text=True)


def test_unknown_stage():
    r = grader("stage42")
    assert r.returncode == 2 and "unknown stage 'stage42'" in r.stdout and len(r.stdout.strip().splitlines()) == 1


def test_missing_kernel_file():
    r = grader("stage0", "--kernel", "nowhere.cu")
    assert r.returncode != 0 and "no such kernel file: nowhere.cu" in r.stdout


def test_no_gpu_compiles_only_and_says_so(tmp_path):
    out = tmp_path / "r.json"
    r = grader("stage0", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiling only" in r.stdout and "attention_softmax" in r.stdout and "SHFL" in r.stdout
    assert not out.exists()


def test_arch_option_compiles_for_that_arch():
    r = grader("stage0", "--arch", "sm_80")
    assert r.returncode == 0 and "Compiled for sm_80" in r.stdout


def test_compile_error_points_at_the_learners_file_and_line(tmp_path):
    stage_source = (REPO / "stages/stage0_naive/attention.cu").read_text().splitlines()
    line = next(i for i, l in enumerate(stage_source) if "float row_sum = 0.0f;" in l)
    stage_source[line] = "    float row_sum = 0.0f +;"
    bad = tmp_path / "mine.cu"
    bad.write_text("\n".join(stage_source))
    r = grader("stage0", "--kernel", str(bad))
    assert r.returncode == 1
    assert f"mine.cu({line + 1}): error" in r.stdout


def test_signature_mismatch_is_one_line(tmp_path):
    source = (REPO / "stages/stage0_naive/attention.cu").read_text()
    bad = tmp_path / "mine.cu"
    bad.write_text(source.replace("float* __restrict__ lse, int seq_kv)", "float* __restrict__ lse, long seq_kv)"))
    r = grader("stage0", "--kernel", str(bad))
    assert r.returncode == 2
    assert "kernel attention_softmax does not have the signature" in r.stdout
    assert "float*, float*, int" in r.stdout


def test_missing_kernel_is_one_line(tmp_path):
    source = (REPO / "stages/stage0_naive/attention.cu").read_text()
    bad = tmp_path / "mine.cu"
    bad.write_text(source.replace("void attention_pv(", "void attention_pv_renamed("))
    r = grader("stage0", "--kernel", str(bad))
    assert r.returncode == 2 and "no kernel named attention_pv" in r.stdout


def test_init_then_grade_uses_the_workspace_copy(tmp_path):
    env = {"HOME": str(tmp_path)}
    workspace = REPO / "workspace" / "stage0_naive" / "attention.cu"
    existed = workspace.exists()
    if not existed:
        r = grader("init", "stage0", env_extra=env)
        assert r.returncode == 0 and "workspace/stage0_naive/attention.cu" in r.stdout
    try:
        r = grader("stage0", env_extra=env)
        assert "Graded file: workspace/stage0_naive/attention.cu" in r.stdout
        r = grader("stage0", "--solution", env_extra=env)
        assert "Graded file: stages/stage0_naive/attention.cu" in r.stdout
    finally:
        if not existed:
            workspace.unlink()


def test_list_shows_stages_and_archs():
    r = grader("list")
    assert r.returncode == 0 and "stage0_naive" in r.stdout and "sm_90a" in r.stdout
