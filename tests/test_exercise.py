"""Exercise copies: generated from the solutions by markers, and they compile."""
import pytest

import stages
from conftest import compiles_as_graded
from grader import exercise

SOURCE = """int a;
    // EXERCISE: compute b from a,
    // then double it.
    // STUB: int b = 0;
    int b = a + 1;
    b *= 2;
    // END EXERCISE
int c = b;
"""


def test_markers_remove_the_solution_and_keep_hint_and_stub():
    out = exercise.make_exercise(SOURCE)
    assert "// TODO(exercise): compute b from a," in out
    assert "then double it." in out
    assert "    int b = 0;" in out
    assert "a + 1" not in out and "b *= 2" not in out
    assert out.startswith("int a;") and out.rstrip().endswith("int c = b;")


def test_removed_lines_count_the_solutions_logic_only():
    assert exercise.removed_lines(SOURCE) == 2  # not the hint, the stub, the markers or the code around them
    padded = SOURCE.replace("    b *= 2;\n", "    b *= 2;\n#pragma unroll\n    // why\n    {\n    }\n\n")
    assert exercise.removed_lines(padded) == 2


@pytest.mark.parametrize("bad", [SOURCE.replace("// END EXERCISE", ""), SOURCE + "// END EXERCISE\n",
                                 SOURCE.replace("int b = a + 1;", "// EXERCISE: nested")])
def test_broken_markers_are_errors(bad):
    with pytest.raises(exercise.MarkerError):
        exercise.make_exercise(bad)


@pytest.mark.parametrize("name", stages.stage_names())
def test_every_stage_has_an_exercise_that_compiles(name, tmp_path):
    stage = stages.load(name)
    source = stage.source_path.read_text()
    assert exercise.count_exercises(source) >= 1
    made = exercise.make_exercise(source)
    assert "TODO(exercise)" in made and made != source
    path = tmp_path / stage.source
    path.write_text(made)
    assert compiles_as_graded(stage, path, stage.archs[-1]).path.is_file()


# The least each exercise removes, in lines of the solution's logic (exercise.removed_lines): what each
# removes today, so that none shrinks unnoticed; 8 for the stages whose exercise is a kernel's whole idea
# (stage 10's fused add and RMSNorm, stage 14's SwiGLU backward per element), and for a stage not listed.
MIN_REMOVED = {"stage0_naive": 3, "stage1_tiled": 8, "stage2_warp": 7, "stage3_pipeline": 5, "stage4_hopper": 7,
               "stage5_moe_routing": 24, "stage6_grouped_gemm": 2, "stage7_moe_layer": 11, "stage8_backward": 4,
               "stage9_hopper_backward": 4, "stage10_model": 8, "stage11_expert_parallel": 13,
               "stage12_block_sparse": 9, "stage13_block_sparse_backward": 4, "stage14_moe_backward": 8}
NEW_STAGE_MIN_REMOVED = 8


@pytest.mark.parametrize("name", stages.stage_names())
def test_every_exercise_removes_enough_of_the_solution(name):
    removed = exercise.removed_lines(stages.load(name).source_path.read_text())
    least = MIN_REMOVED.get(name, NEW_STAGE_MIN_REMOVED)
    assert removed >= least, f"{name}'s exercise leaves out {removed} lines of the solution's logic, fewer than {least}"


def test_init_writes_the_workspace_copy_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMOE_WORKSPACE", str(tmp_path))
    stage = stages.load("stage0")
    path = exercise.init(stage)
    assert path == tmp_path / stage.name / stage.source
    made = path.read_text()
    assert made == exercise.make_exercise(stage.source_path.read_text()) and "TODO(exercise)" in made
    path.write_text("my work")
    with pytest.raises(FileExistsError):
        exercise.init(stage)
    assert path.read_text() == "my work"  # kept without --force
    exercise.init(stage, force=True)
    assert path.read_text() == made       # rewritten with it
