"""Launch geometry has one home, the kernel: each stage's launch declares the values it launches with
(Stage.geometry: tiles, threads, shared memory, limits), and the grader checks them against the
kernel's constants whenever it compiles it. A kernel whose constants disagree with its launch fails
to compile with one line per constant, not with wrong results."""
import pytest

import reference
import stages
from grader.run import GraderError, compile_stage

KEYS = [stage.key for name in stages.stage_names() for stage in stages.with_rungs(name)]


@pytest.mark.parametrize("key", KEYS)
def test_every_variant_declares_its_geometry_and_the_kernel_agrees(key):
    stage = stages.load(key)
    for defines in map(stage.defines, stage.variants(reference.load(stage.problem))):
        declared = stage.geometry(defines)
        assert declared and all(isinstance(v, int) for v in declared.values()), (key, defines)
    compile_stage(stage, stage.source_path, stage.archs[-1], with_sass=False)  # the checks are compiled in: no GraderError


def stage0_copy(tmp_path, edit) -> tuple:
    stage = stages.load("stage0")
    mine = tmp_path / "attention.cu"
    mine.write_text(edit(stage.source_path.read_text()))
    return stage, mine


def test_a_constant_that_disagrees_with_the_launch_is_one_line(tmp_path):
    stage, mine = stage0_copy(tmp_path, lambda source: source.replace("#define TILE 32", "#define TILE 16"))
    with pytest.raises(GraderError) as error:
        compile_stage(stage, mine, "sm_80")
    assert str(error.value) == (f"{mine}: the launch uses TILE = 32 for ELEM_T=__half,HEAD_DIM=64; "
                                "the kernel says 16")


def test_a_constant_the_kernel_lacks_is_one_line(tmp_path):
    stage, mine = stage0_copy(tmp_path, lambda source: source.replace("THREADS_Y", "ROWS_Y"))
    with pytest.raises(GraderError) as error:
        compile_stage(stage, mine, "sm_80")
    assert str(error.value).endswith("the launch uses THREADS_Y = 8 for ELEM_T=__half,HEAD_DIM=64; "
                                     "the kernel does not define THREADS_Y")


def test_the_learners_own_errors_keep_nvrtcs_log(tmp_path):
    from stages.common.compiler import CompileError
    stage, mine = stage0_copy(tmp_path, lambda source: source.replace("#define TILE 32", "#define TILE 16 +"))
    with pytest.raises(CompileError):
        compile_stage(stage, mine, "sm_80")


def test_the_routing_cases_reach_the_kernels_limits():
    """The problem's cases probe the MoE kernels' limits (stages/common/moe.py, checked against moe.cuh)
    exactly: the most experts and the largest k the kernels take, and no more."""
    from stages.common.moe import MAX_EXPERTS, MAX_TOP_K

    cases = reference.load("moe_routing").cases()
    assert max(c.shape["experts"] for c in cases) == MAX_EXPERTS
    assert max(c.shape["top_k"] for c in cases) == MAX_TOP_K


def test_the_experts_problem_pads_segments_to_stage_6s_tile():
    """reference/moe_experts.py pads each expert's segment to BLOCK rows, as stage 5 pads it for the
    grouped GEMM's tiles: the BLOCK_M of stage 6's launch (and so of experts.cu)."""
    from reference.moe_experts import BLOCK
    from stages.stage6_grouped_gemm import BLOCK_M

    assert BLOCK == BLOCK_M
