"""On a GPU: every stage passes every correctness case, the wrong kernels fail, and a crashing or
hanging kernel is reported without taking the grader down. Skipped, with the reason, without a GPU.

Kept short (the whole GPU half in about 5 minutes): a check that only needs one wrong answer runs one
trial; a grade that only needs to be two bands apart is timed with a short budget per shape. Every kernel
graded here is compiled before the first test, in parallel (conftest.py, gpu_kernels.py): the exercises and
the wrong kernels are written to the session's `kernel_dir`, where the compiles found them."""
import pytest
import torch

import stages
from conftest import gpu
from grader import exercise
from grader.grading import BANDS
from grader.run import benchmark, compile_stage, grade_stage, graded
from mutations import MUTATIONS, mutate, regroup_in_pytorch, regroup_piece

pytestmark = pytest.mark.gpu

QUICK_BUDGET_S = 0.5  # seconds of timing per shape where a grade only needs to be two bands apart
# Seconds without progress after which a kernel expected to fail counts as hanging (a correctness case
# takes under 3 s, a worker's start-up about 7; the grader's own limit, 60 s, is for kernels expected to
# pass). An untouched exercise, which may hang in every case, waits twice as long.
HANG_S = 10


def _grade(stage, path, bench=False, **kw):
    found, _ = gpu()
    return grade_stage(stage, path, found, stages.arch_for(found, stage.archs), bench=bench, **kw)


def _quick_grade(stage, path) -> str:
    """The grade of the kernel at `path`, timed briefly, its correctness taken as checked elsewhere."""
    found, _ = gpu()
    cubins = compile_stage(stage, path, stages.arch_for(found, stage.archs))
    return graded(stage, {"benchmarks": benchmark(stage, cubins, found, timeout_s=120.0, budget_s=QUICK_BUDGET_S,
                                                  progress=lambda *a: None)})["grade"]


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
    # One trial of fresh inputs per case: the grader's second trial is for the record, not for this test.
    result = _grade(stage, stage.source_path, trials=1)
    failed = [c["name"] for c in result["correctness"]["cases"] if not c["passed"]]
    assert not failed, f"{name} fails {failed}"


LETTERS = [letter for letter, _ in BANDS] + ["F"]


@pytest.mark.parametrize("name", stages.stage_names())
def test_an_untouched_exercise_fails_or_grades_two_bands_below_the_solution(name, kernel_dir, monkeypatch):
    """An exercise done before the learner starts teaches nothing: `init`'s copy, graded as it is,
    must fail correctness, or grade at least two bands below the course's kernel."""
    if not _runnable(name):
        pytest.skip(f"{name} does not run on this GPU")
    stage = stages.load(name)
    monkeypatch.setenv("FLASHMOE_WORKSPACE", str(kernel_dir / "workspace"))
    untouched = exercise.init(stage, force=True)  # where the session compiled it (conftest.py)
    if _grade(stage, untouched, trials=1, timeout_s=2 * HANG_S, first_failure=True)["correctness"]["failed"]:
        return
    mine, solution = _quick_grade(stage, untouched), _quick_grade(stage, stage.source_path)
    gap = LETTERS.index(mine) - LETTERS.index(solution)
    assert gap >= 2, f"{name}'s untouched exercise passes every case and grades {mine}, the solution {solution}"


@pytest.mark.parametrize("mutation", [name for name, m in MUTATIONS.items() if m.cases is not None])
def test_wrong_kernels_fail(mutation, kernel_dir):
    stage, path = mutate(mutation, kernel_dir)
    if not _runnable(stage.name):
        pytest.skip(f"{stage.name} does not run on this GPU")
    result = _grade(stage, path, only=MUTATIONS[mutation].cases, trials=1)
    assert result["correctness"]["failed"] > 0
    failed = [c for c in result["correctness"]["cases"] if not c["passed"]]
    assert all("failure" not in c for c in failed), "a wrong result must fail the check, not crash"


@pytest.mark.parametrize("ranks,local", [(2, 3), (8, 4)])
def test_a_row_taken_from_the_wrong_rank_is_caught(ranks, local, kernel_dir):
    """Stage 11's regroup with the last row of each source rank's bucket read from the next rank's
    (mutations.py): unlike PyTorch's regroup_index on the same counts. (The grader's world has one rank.)"""
    from cuda.core import Device

    from stages.common.launcher import KernelSet
    from stages.stage11_expert_parallel import KernelParts

    stage, path = mutate("row_from_wrong_rank", kernel_dir)
    if not _runnable(stage.name):
        pytest.skip(f"{stage.name} does not run on this GPU")
    found, _ = gpu()
    cubins = compile_stage(stage, path, stages.arch_for(found, stage.archs))
    torch.cuda.init()
    Device().set_current()  # PyTorch's primary context, as stages.ops loads kernels
    parts = KernelParts(KernelSet(next(iter(cubins.values())).path, stage.kernels, stage.param_structs), None, None,
                        None, None, 1)
    parts.align = 1  # no padding rows: every grouped row is a received one
    mutated = [t.cpu().long() for t in parts.regroup_index(regroup_piece(ranks, local, "cuda"))]
    expected = [t.long() for t in regroup_in_pytorch(regroup_piece(ranks, local, "cpu"))]
    assert not all(torch.equal(m, e) for m, e in zip(mutated, expected))


def test_a_crashing_kernel_is_reported_and_the_next_case_still_runs(kernel_dir):
    stage, path = mutate("crash", kernel_dir)
    result = _grade(stage, path, only="Skv17 |Skv239 ", trials=1)
    cases = result["correctness"]["cases"]
    assert len(cases) >= 3 and all(not c["passed"] for c in cases)
    assert all("illegal memory address" in c["failure"] or "CUDA error" in c["failure"] for c in cases), cases


def test_a_hanging_kernel_is_killed_and_reported(kernel_dir):
    stage, path = mutate("hang", kernel_dir)
    result = _grade(stage, path, only="Sq17 Skv17 D64", timeout_s=HANG_S, trials=1)
    (case,) = result["correctness"]["cases"]
    assert not case["passed"] and case["failure"].startswith("timeout")
