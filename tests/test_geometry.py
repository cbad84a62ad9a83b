"""Launch geometry has one home, the kernel: each stage's launch declares the values it launches with
(Stage.geometry: tiles, threads, shared memory, limits), and the grader checks them against the
kernel's constants whenever it compiles it. A kernel whose constants disagree with its launch fails
to compile with one line per constant, not with wrong results."""
import pytest

import reference
import stages
from grader.compiler import compile_cubin
from grader.run import GraderError, compile_stage, geometry_checks

STAGE_NAMES = stages.stage_names()


@pytest.mark.parametrize("name", STAGE_NAMES)
def test_every_variant_declares_its_geometry_and_the_kernel_agrees(name):
    stage = stages.load(name)
    for defines in stage.variants(reference.load(stage.problem).dtypes):
        declared = stage.geometry(defines)
        assert declared and all(isinstance(v, int) for v in declared.values()), (name, defines)
    compile_stage(stage, stage.source_path, stage.archs[-1])  # the checks are compiled in: no GraderError


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
    from grader.compiler import CompileError
    stage, mine = stage0_copy(tmp_path, lambda source: source.replace("#define TILE 32", "#define TILE 16 +"))
    with pytest.raises(CompileError):
        compile_stage(stage, mine, "sm_80")


# Stage 6's ladder is launched by ladder/run.py, whose constants must be the rungs' .cu constants.
def ladder_geometry(rung) -> dict:
    from stages.stage6_grouped_gemm.ladder import run as ladder

    up, down = "expert_up_swiglu", "expert_down"
    return {"NUM_THREADS": ladder.THREADS,
            "SHARED_BYTES<true>": rung.shared_bytes[up], "SHARED_BYTES<false>": rung.shared_bytes[down],
            "BLOCKS_PER_SM<true>": rung.blocks_per_sm[up], "BLOCKS_PER_SM<false>": rung.blocks_per_sm[down]}


@pytest.mark.parametrize("source", ["simt.cu", "mma_sync.cu"])
def test_the_ladders_launch_agrees_with_its_kernels(source):
    from stages.stage6_grouped_gemm.ladder import run as ladder

    rung = next(r for r in ladder.RUNGS if r.source.name == source)
    stage = stages.load("stage6")
    for defines in stage.variants(reference.load(stage.problem).dtypes):
        compile_cubin(rung.source, "sm_90a", defines, geometry_checks(ladder_geometry(rung)))


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
