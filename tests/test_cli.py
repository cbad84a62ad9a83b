"""The command line, as a learner meets it: one-line errors, non-zero exits, compile-only without a GPU."""
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

import stages
from conftest import REPO
from grader import report, results
from grader.__main__ import main
from grader.report import variant_label
from grader.run import compile_stage, resources
from stages.common.compiler import nvrtc_version


def command_env(env_extra: dict | None, columns: int) -> dict:
    """The variables a run of the grader here has beyond the tests' own: no GPU, a terminal `columns` wide."""
    return dict(FLASHMOE_NO_GPU="1", COLUMNS=str(columns), **(env_extra or {}))


def grader_command(*args, env_extra=None, columns=160) -> subprocess.CompletedProcess:
    """`python -m grader ARGS`, run as a learner runs it: a new Python."""
    env = dict(os.environ, **command_env(env_extra, columns))
    return subprocess.run([sys.executable, "-m", "grader", *args], cwd=REPO, env=env, capture_output=True, text=True)


def grader(*args, env_extra=None, columns=160) -> subprocess.CompletedProcess:
    """What grader_command returns, from the command's main() run in this process, with its environment, its folder
    and a console made as grader/report.py makes it, what it prints caught: a new Python imports PyTorch again
    (seconds a run). Tests that run grader_command itself check that the command is this main()."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for name, value in command_env(env_extra, columns).items():
            patch.setenv(name, value)
        patch.chdir(REPO)
        patch.setattr(report, "console", Console(highlight=False))  # its width from COLUMNS, as in a new process
        try:
            status = main(list(args))
        except SystemExit as exit:  # argparse's --help, and its errors (the grader's Parser.error)
            status = exit.code
    return subprocess.CompletedProcess(["python", "-m", "grader", *args], status, out.getvalue(), err.getvalue())


def assert_one_line_error(r, *fragments):
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(r.stdout.strip().splitlines()) == 1 and r.stdout.startswith("error: "), r.stdout
    for fragment in fragments:
        assert fragment in r.stdout, r.stdout


def test_unknown_stage():
    assert_one_line_error(grader_command("stage42"), "unknown stage 'stage42'")


def test_missing_kernel_file():
    r = grader("stage0", "--kernel", "nowhere.cu")
    assert r.returncode == 2 and "error: stage0_naive: no such kernel file: nowhere.cu" in r.stdout


@pytest.mark.parametrize("args,said", [(("rekey",), "rekey needs a results file"),
                                       (("rekey", "nowhere.json"), "no such results file: nowhere.json")])
def test_rekey_without_a_results_file_is_one_line(args, said):
    assert_one_line_error(grader(*args), said)


def test_no_gpu_compiles_only_and_says_so(tmp_path):
    out = tmp_path / "r.json"
    r = grader_command("stage0", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "compiling only" in r.stdout and "attention_softmax" in r.stdout and "SHFL" in r.stdout
    assert not out.exists()


def test_gpu_only_options_without_a_gpu_are_named_in_one_line():
    r = grader("stage0", "--cases", "x10", "--no-bench")
    assert r.returncode == 0, r.stdout + r.stderr
    note = r.stdout.splitlines()[0]
    assert "compiling only" in note and "--cases --no-bench" in note and "Compiled for" in r.stdout


def test_first_failure_is_a_gpu_option_named_when_there_is_none():
    r = grader("stage0", "-x")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not used without a GPU run: --first-failure" in r.stdout.splitlines()[0]


def test_arch_option_compiles_for_that_arch():
    r = grader("stage0", "--arch", "sm_80")
    assert r.returncode == 0 and "Compiled for sm_80" in r.stdout


@pytest.mark.parametrize("stage,arch,fragment", [
    ("stage4", "sm_80", "stage4_hopper compiles for sm_90a only, not sm_80"),
    ("stage4", "sm_90", "stage4_hopper compiles for sm_90a only, not sm_90"),
    ("stage0", "sm_100a", "stage0_naive compiles for sm_80, sm_86, sm_89, sm_90a or a newer sm_NN, not sm_100a"),
    ("stage0", "sm_75", "--arch sm_75: the course's kernels need sm_80 or newer"),
    ("stage0", "foo", "--arch foo: not an architecture; write sm_NN or sm_NNa"),
])
def test_arch_is_checked_in_one_line(stage, arch, fragment):
    assert_one_line_error(grader(stage, "--arch", arch), fragment)


def test_a_newer_plain_arch_compiles_a_plain_stage():
    r = grader("stage0", "--arch", "sm_120")
    assert r.returncode == 0 and "Compiled for sm_120" in r.stdout


def test_cases_must_be_a_regular_expression():
    assert_one_line_error(grader("stage0", "--cases", "["), "--cases '[' is not a regular expression")


def test_shapes_must_be_a_regular_expression_and_not_beside_cases():
    assert_one_line_error(grader("stage0", "--shapes", "("), "--shapes '(' is not a regular expression")
    assert_one_line_error(grader("stage0", "--shapes", "S2048", "--cases", "x10"), "give one of them")


def test_shapes_keeps_the_matching_benchmark_shapes():
    from grader.run import benchmark_shapes

    every = benchmark_shapes(stages.load("stage8"))
    causal = benchmark_shapes(stages.load("stage8"), "causal")
    assert 0 < len(causal) < len(every) and all(s["causal"] for s in causal)


def test_a_run_at_some_shapes_is_merged_into_the_recorded_entry_of_the_same_source():
    from grader.run import benchmark_shapes, merge_benchmarks
    from reference import load

    stage = stages.load("stage8")
    labels = [load(stage.problem).shape_label(s) for s in benchmark_shapes(stage)]
    row = lambda label, ms: {"label": label, "ms": ms, "baselines": {"cudnn": 1.0}}  # noqa: E731
    recorded = {"source_sha256": "a", "benchmarks": [row(label, 2.0) for label in labels]}
    new = {"source_sha256": "a", "benchmarks": [row(labels[1], 1.0)]}
    merged = merge_benchmarks(stage, recorded, new)
    assert [b["label"] for b in merged["benchmarks"]] == labels
    assert [b["ms"] for b in merged["benchmarks"][:3]] == [2.0, 1.0, 2.0] and merged["grade"]
    assert merge_benchmarks(stage, dict(recorded, source_sha256="b"), new) == new  # another source: not merged


def test_several_stages_are_graded_in_turn():
    r = grader("stage0", "stage5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("Compiled for") == 2
    assert "stages/stage0_naive/attention.cu" in r.stdout and "stages/stage5_moe_routing/routing.cu" in r.stdout


@pytest.mark.parametrize("args", [("list", "stage0"), ("all", "stage0")])
def test_list_and_all_take_no_stage(args):
    assert_one_line_error(grader(*args), f"{args[0]} takes no stage")


def test_compile_error_points_at_the_learners_file_and_line(tmp_path):
    stage_source = (REPO / "stages/stage0_naive/attention.cu").read_text().splitlines()
    line = next(i for i, l in enumerate(stage_source) if "float row_sum = 0.0f;" in l)
    stage_source[line] = "    float row_sum = 0.0f +;"
    bad = tmp_path / "mine.cu"
    bad.write_text("\n".join(stage_source))
    r = grader("stage0", "--kernel", str(bad))
    assert r.returncode == 1
    assert f"mine.cu({line + 1}): error" in r.stdout
    assert "\0" not in r.stdout  # NVRTC's log ends with a NUL byte: grep would call the output binary


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


def test_a_kernel_without_extern_c_is_one_line(tmp_path):
    source = (REPO / "stages/stage0_naive/attention.cu").read_text()
    bad = tmp_path / "mine.cu"
    bad.write_text(source.replace('extern "C" __global__ void attention_softmax(', "__global__ void attention_softmax("))
    r = grader("stage0", "--kernel", str(bad))
    expected = 'kernel attention_softmax must be declared extern "C" __global__ void attention_softmax(float*, float*, int)'
    assert r.returncode == 2 and expected in r.stdout, r.stdout
    assert len([l for l in r.stdout.splitlines() if l.startswith("error:")]) == 1 and "_Z" not in r.stdout


def test_init_then_grade_uses_the_workspace_copy(tmp_path):
    env = {"FLASHMOE_WORKSPACE": str(tmp_path)}
    r = grader("init", "stage0", "stage5", env_extra=env)
    assert r.returncode == 0, r.stdout + r.stderr
    mine = tmp_path / "stage0_naive" / "attention.cu"
    for written in (mine, tmp_path / "stage5_moe_routing" / "routing.cu"):
        assert written.is_file() and f"Wrote {written}" in r.stdout
    r = grader("stage0", env_extra=env)
    assert f"Graded file: {mine}" in r.stdout
    r = grader("stage0", "--solution", env_extra=env)
    assert "Graded file: stages/stage0_naive/attention.cu" in r.stdout


def test_list_shows_stages_rungs_archs_and_nvrtc_versions():
    """One `grader list` for all its checks: it judges every record current or not, which compiles every
    stage (minutes with an empty compile cache)."""
    r = grader("list")
    assert r.returncode == 0 and "stage0_naive" in r.stdout and "sm_90a" in r.stdout
    assert f"NVRTC here: {nvrtc_version()}" in r.stdout
    for gpu, data in results.load_all().items():
        assert f"{gpu}'s results: NVRTC {data['provenance']['nvrtc']}" in r.stdout
    at = r.stdout.find("stage6_grouped_gemm:mma_sync")  # the ladders' rungs, each with its archs
    assert at >= 0 and "sm_80" in r.stdout[at:at + 300]
    assert "stage7_moe_layer:mma_sync" in r.stdout and "stage6_grouped_gemm:simt" in r.stdout
    marked = [key for data in results.load_all().values() for key, entry in data["stages"].items() if entry.get("stale")]
    assert not marked or "(stale: marked)" in r.stdout


def test_a_record_marked_stale_is_not_compiled_again_to_be_judged():
    from grader.__main__ import freshness

    def compiled(entry, stage):
        raise AssertionError("compiled to judge a record marked stale")
    assert freshness({"stale": "measured before ..."}, None, compiled) == " (stale: marked)"
    assert freshness({}, None, lambda entry, stage: True) == ""
    assert freshness({}, None, lambda entry, stage: False) == " (stale: kernel changed)"


def test_an_80_column_report_shows_every_figure_in_full():
    r = grader("stage0", "--arch", "sm_80", columns=80)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"by NVRTC {nvrtc_version()}" in r.stdout
    lines = r.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), "a line wider than the terminal"
    stage = stages.load("stage0")
    for variant, kernels in resources(compile_stage(stage, stage.source_path, "sm_80")).items():
        for kernel, info in kernels.items():
            record = lines.index(f"{variant_label(variant)} {kernel}")  # the record's heading line
            body = " ".join(lines[record + 1:record + 4])
            assert f"regs {info['registers']} " in body and f"smem {info['shared_bytes']} B" in body
            for op, count in info["sass"].items():
                assert f" {op}:{count}" in body, (variant, kernel, op)


def readme_block(marker: str) -> str:
    readme = (REPO / "README.md").read_text()
    block = re.search(rf"<!-- ci: {marker} -->\n```bash\n(.*?)^```$", readme, re.DOTALL | re.MULTILINE)
    assert block, f"README.md has no block marked <!-- ci: {marker} -->"
    return block[1]


def ci_prints(option: str, tmp_path) -> str:
    """What `.ci/run OPTION` prints, with only awk and dirname on PATH: a .ci/run that ignored the option
    could install nothing, nor run these tests."""
    tools = tmp_path / "bin"
    tools.mkdir(exist_ok=True)
    for tool in ("awk", "dirname"):
        if not (tools / tool).exists():
            (tools / tool).symlink_to(shutil.which(tool))
    ci = subprocess.run([shutil.which("bash"), ".ci/run", option], cwd=REPO, env={"PATH": str(tools)},
                        capture_output=True, text=True, timeout=60)
    assert ci.returncode == 0, ci.stdout + ci.stderr
    return ci.stdout


def test_ci_installs_exactly_as_the_readme_tells_a_learner_without_a_gpu(tmp_path):
    install = readme_block("cpu-install")
    assert re.search(r"torch==\d", install) and "://" not in install  # pinned; no package index's address named
    assert ci_prints("--print-install", tmp_path) == install
    assert "pip install" not in (REPO / ".ci/run").read_text()  # nothing installed but the README's block


def test_ci_tests_exactly_as_the_readme_tells_and_that_installs_nothing(tmp_path):
    """The README's test command runs in the environment as it is: on a GPU machine, a test command that
    installed the CPU build of torch would replace the CUDA build."""
    tests = readme_block("test")
    assert tests == ".venv/bin/python -m pytest -n auto\n"
    assert ci_prints("--print-test", tmp_path) == tests
    assert "pytest" not in (REPO / ".ci/run").read_text().replace("tests/test_cli.py", "")  # only the README's


def test_with_n_the_modules_whose_fixtures_are_costly_run_in_one_worker():
    """The README's `-n auto`: each test goes to the next free worker, but those of a module in ONE_WORKER go
    together (its module fixtures built once), and the longest modules' (LONG_FIRST) first; a module renamed without
    ONE_WORKER or LONG_FIRST would lose that silently."""
    from conftest import LONG_FIRST, ONE_WORKER, scope_of, sending_order

    assert all((REPO / module).is_file() for module in ONE_WORKER + LONG_FIRST)
    assert sending_order("tests/test_compile.py::x") < sending_order("tests/test_cli.py::test_unknown_stage") \
        < sending_order("tests/test_problem.py::x") == sending_order("tests/test_reference.py::x")
    assert scope_of("tests/test_docs.py::test_site_builds_strictly") == "tests/test_docs.py"
    assert scope_of("tests/test_expert_parallel.py::test_x[2 ranks-counts]") == "tests/test_expert_parallel.py"
    assert scope_of("tests/test_cli.py::test_unknown_stage") == "tests/test_cli.py::test_unknown_stage"


def test_a_rung_compiles_for_sm80_and_says_it_is_a_rung():
    r = grader("stage7:mma_sync", "--arch", "sm_80")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "lower rung of the stage's ladder (mma_sync)" in r.stdout and "Compiled for sm_80" in r.stdout


def test_an_unknown_rung_is_one_line():
    r = grader("stage6:tensor_magic")
    assert r.returncode == 2 and "unknown stage 'stage6:tensor_magic'" in r.stdout


def test_a_gpu_without_wgmma_grades_the_highest_rung_that_runs_there():
    import stages
    from grader.__main__ import instead_of, runs_here
    from grader.device import GpuInfo

    a100 = GpuInfo("NVIDIA A100-SXM4-80GB", 8, 0, 108, 40 << 20, 1410, 80 << 30, "12.4")
    h100 = GpuInfo("NVIDIA H100 80GB HBM3", 9, 0, 132, 50 << 20, 1980, 80 << 30, "13.0")
    assert instead_of(stages.load("stage6"), a100).key == "stage6_grouped_gemm:mma_sync"
    assert instead_of(stages.load("stage7"), a100).key == "stage7_moe_layer:mma_sync"
    assert instead_of(stages.load("stage6"), h100) is None and instead_of(stages.load("stage3"), a100) is None
    assert not runs_here(stages.load("stage4"), a100, None) and runs_here(stages.load("stage6:simt"), a100, None)
    assert not runs_here(stages.load("stage6"), None, "sm_80") and runs_here(stages.load("stage6:simt"), None, "sm_80")


def test_no_command_prints_the_usage_and_the_stages():
    r = grader()
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("usage: python -m grader STAGE") and "stage0_naive" in r.stdout and "required" not in r.stderr


def test_json_into_a_missing_folder_is_refused_before_any_work(tmp_path):
    r = grader("stage0", "--json", str(tmp_path / "nowhere" / "r.json"))
    assert_one_line_error(r, f"--json {tmp_path / 'nowhere' / 'r.json'}: no folder {tmp_path / 'nowhere'}")


def test_init_names_the_python_that_ran_it(tmp_path):
    r = grader("init", "stage0", env_extra={"FLASHMOE_WORKSPACE": str(tmp_path)})
    command = re.search(r"then run (\S+) -m grader stage0 ", r.stdout)
    assert r.returncode == 0 and command, r.stdout
    assert (REPO / command[1]).resolve() == Path(sys.executable).resolve()


@pytest.mark.parametrize("executable,expected", [(".venv/bin/python", ".venv/bin/python"), ("python", "./python"),
                                                 ("/usr/bin/python3", "/usr/bin/python3")])
def test_the_interpreter_is_shown_relative_where_shorter(executable, expected, tmp_path, monkeypatch):
    from grader.__main__ import interpreter

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", executable if executable.startswith("/") else str(tmp_path / executable))
    assert interpreter() == expected


def test_compile_only_shows_the_dynamic_shared_memory_of_the_launch():
    from stages.stage8_backward import GEOMETRY

    r = grader("stage8", "--arch", "sm_90a")
    assert r.returncode == 0, r.stdout + r.stderr
    dynamic = r.stdout[r.stdout.index("Dynamic shared memory per block"):]
    assert f"fp16 D128 {GEOMETRY[128]['SHARED_BYTES']:,} B" in dynamic.replace("\n", " ")
    assert "Dynamic shared memory" not in grader("stage0", "--arch", "sm_80").stdout  # all of it static


@pytest.mark.parametrize("variable", ["FLASHMOE_WORKSPACE", "FLASHMOE_CACHE"])
@pytest.mark.parametrize("under", [False, True], ids=["a-file", "under-a-file"])
def test_a_folder_variable_naming_a_file_is_one_line(variable, under, tmp_path):
    """FLASHMOE_WORKSPACE or FLASHMOE_CACHE pointing at a file, or at a folder below one: one line, before any
    work (both were tracebacks)."""
    a_file = tmp_path / "not_a_folder"
    a_file.write_text("")
    r = grader("init", "stage1", env_extra={variable: str(a_file / "sub" if under else a_file)})
    assert_one_line_error(r, variable, "not a folder", *([f"{a_file} is a file"] if under else []))


@pytest.mark.parametrize("value,pretends", [("1", True), ("0", False), ("", False)])
def test_no_gpu_variable_at_0_or_empty_pretends_nothing(value, pretends, monkeypatch):
    from grader import device

    monkeypatch.setenv("FLASHMOE_NO_GPU", value)
    assert (device.probe()[1] == "FLASHMOE_NO_GPU is set") == pretends


@pytest.mark.parametrize("args,fragment", [(("stage0", "--budget", "abc"), "argument --budget: invalid float value"),
                                           (("stage0", "--bogus"), "unrecognized arguments: --bogus")])
def test_a_mistyped_option_is_one_line(args, fragment):
    """argparse's own errors printed the six lines of the usage first."""
    assert_one_line_error(grader(*args), fragment, "python -m grader --help")


def test_help_names_the_environment_variables():
    r = grader_command("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m grader STAGE"), r.stdout + r.stderr
    for variable in ("FLASHMOE_WORKSPACE", "FLASHMOE_CACHE", "FLASHMOE_NO_GPU"):
        assert variable in r.stdout


def test_a_kernel_option_naming_a_folder_says_which_file_to_give():
    r = grader("stage1", "--kernel", "stages/stage1_tiled", "--arch", "sm_80")
    assert_one_line_error(r, "a folder", "stages/stage1_tiled/attention.cu")
