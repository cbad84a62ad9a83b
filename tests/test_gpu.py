"""On a GPU: every stage passes every correctness case, the wrong kernels fail, and a crashing or
hanging kernel is reported without taking the grader down. Skipped, with the reason, without a GPU."""
import pytest

import stages
from conftest import gpu
from grader import exercise
from grader.grading import BANDS
from grader.run import grade_stage
from mutations import mutate

pytestmark = pytest.mark.gpu


def _grade(stage, path, bench=False, **kw):
    found, _ = gpu()
    return grade_stage(stage, path, found, stages.arch_for(found, stage.archs), bench=bench, **kw)


def _runnable(name):
    found, _ = gpu()
    try:
        stages.arch_for(found, stages.load(name).archs)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("name", stages.stage_names())
def test_stage_passes_every_case(name):
    if not _runnable(name):
        pytest.skip(f"{name} does not run on this GPU")
    stage = stages.load(name)
    result = _grade(stage, stage.source_path)
    failed = [c["name"] for c in result["correctness"]["cases"] if not c["passed"]]
    assert not failed, f"{name} fails {failed}"


LETTERS = [letter for letter, _ in BANDS] + ["F"]


@pytest.mark.parametrize("name", stages.stage_names())
def test_an_untouched_exercise_fails_or_grades_two_bands_below_the_solution(name, tmp_path, monkeypatch):
    """An exercise done before the learner starts teaches nothing: `init`'s copy, graded as it is,
    must fail correctness, or grade at least two bands below the course's kernel."""
    if not _runnable(name):
        pytest.skip(f"{name} does not run on this GPU")
    stage = stages.load(name)
    monkeypatch.setenv("FLASHMOE_WORKSPACE", str(tmp_path))
    untouched = _grade(stage, exercise.init(stage), bench=True)
    if untouched["correctness"]["failed"]:
        return
    solution = _grade(stage, stage.source_path, bench=True)
    gap = LETTERS.index(untouched["grade"]) - LETTERS.index(solution["grade"])
    assert gap >= 2, (f"{name}'s untouched exercise passes every case and grades {untouched['grade']}, "
                      f"the solution {solution['grade']}")


@pytest.mark.parametrize("mutation,cases", [("no_max_subtraction", "x10"), ("half_written_output", "Sq17|Sq239"),
                                            ("causal_off_by_one", "causal"), ("swiglu_halves_swapped", "T1000 E32"),
                                            ("tile_in_wrong_expert", "T1000 E32"),
                                            ("backward_causal_off_by_one", "causal"), ("backward_dq_half_added", "Sq1000")])
def test_wrong_kernels_fail(mutation, cases, tmp_path):
    stage, path = mutate(mutation, tmp_path)
    if not _runnable(stage.name):
        pytest.skip(f"{stage.name} does not run on this GPU")
    result = _grade(stage, path, only=cases)
    assert result["correctness"]["failed"] > 0
    failed = [c for c in result["correctness"]["cases"] if not c["passed"]]
    assert all("failure" not in c for c in failed), "a wrong result must fail the check, not crash"


def test_a_crashing_kernel_is_reported_and_the_next_case_still_runs(tmp_path):
    stage, path = mutate("crash", tmp_path)
    result = _grade(stage, path, only="Skv17 |Skv239 ")
    cases = result["correctness"]["cases"]
    assert len(cases) >= 3 and all(not c["passed"] for c in cases)
    assert all("illegal memory address" in c["failure"] or "CUDA error" in c["failure"] for c in cases), cases


def test_a_hanging_kernel_is_killed_and_reported(tmp_path):
    stage, path = mutate("hang", tmp_path)
    result = _grade(stage, path, only="Sq17 Skv17 D64", timeout_s=20)
    (case,) = result["correctness"]["cases"]
    assert not case["passed"] and case["failure"].startswith("timeout")
