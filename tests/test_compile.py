"""Every stage compiles with NVRTC for every architecture it declares (no GPU needed), with the
signatures its launch code uses, no spills, and the instructions its lesson is about."""
import pytest

import reference
import stages
from conftest import REPO
from grader import sass
from grader.run import compile_stage, resources
from stages.common import compiler

# What each stage teaches must show in its SASS (nvdisasm of the cubin), on every arch it declares.
TEACHES = {
    "stage2_warp": {"HMMA", "LDSM"},
    "stage3_pipeline": {"HMMA", "LDSM", "LDGSTS"},
    "stage4_hopper": {"HGMMA", "UTMALDG"},
    "stage6_grouped_gemm": {"HGMMA", "UTMALDG"},
    "stage7_moe_layer": {"HGMMA", "UTMALDG"},
    "stage8_backward": {"HMMA", "LDSM", "LDGSTS"},
    "stage9_hopper_backward": {"HGMMA", "UTMALDG"},
    "stage11_expert_parallel": {"HGMMA", "UTMALDG"},
    "stage12_block_sparse": {"HGMMA", "UTMALDG"},
    "stage13_block_sparse_backward": {"HGMMA", "UTMALDG"},
    "stage14_moe_backward": {"HGMMA", "UTMALDG"},
    "stage15_decode": {"HMMA", "LDSM", "LDGSTS"},
}

PAIRS = [(name, arch) for name in stages.stage_names() for arch in stages.load(name).archs]


def assert_no_local_memory(info: dict, where: str) -> None:
    """No spills and no stack frame in ptxas's report (local memory is the stack: a frame without spills is an
    array the kernel indexes at run time), and, where the SASS was read, no local-memory loads or stores in it."""
    assert info["spill_stores"] == 0 and info["spill_loads"] == 0, f"{where} spills"
    assert info["stack_bytes"] == 0, f"{where} uses local memory ({info['stack_bytes']} bytes of stack frame)"
    assert "LDL" not in info.get("sass", ()) and "STL" not in info.get("sass", ()), f"{where} uses local memory"


def ptxas_resources(cubins: dict) -> dict:
    """{variant: {kernel: ptxas's registers, shared memory, stack frame, spills}}, without the SASS: nvdisasm takes
    half a second a cubin, and a stage whose lesson names no instruction has none to look for."""
    return {variant: sass.resources(cubin.ptxas_log) for variant, cubin in cubins.items()}


@pytest.mark.parametrize("name,arch", PAIRS, ids=[f"{n}-{a}" for n, a in PAIRS])
def test_stage_compiles_without_spills(name, arch):
    stage = stages.load(name)
    cubins = compile_stage(stage, stage.source_path, arch, with_sass=name in TEACHES)
    found = resources(cubins) if name in TEACHES else ptxas_resources(cubins)
    # fp16 and bf16 × each specialization's values (D = 64 and 128; stage 12: × its 4 element masks)
    assert len(found) == len(stage.variants(reference.load(stage.problem)))
    for variant, kernels in found.items():
        assert set(kernels) == set(stage.kernels), variant
        for kernel, info in kernels.items():
            assert_no_local_memory(info, f"{name} {arch} {variant} {kernel}")
        instructions = set().union(*(info.get("sass", ()) for info in kernels.values()))
        missing = TEACHES.get(name, set()) - instructions
        assert not missing, f"{name} {arch} {variant}: no {missing} in the SASS"


def test_sass_parser_reads_real_cubins():
    stage = stages.load("stage0")
    cubin = next(iter(compile_stage(stage, stage.source_path, "sm_80").values()))
    mix = sass.parse_listing(sass.disassemble(cubin.path))  # not the cached mix: the parser itself
    assert set(mix) == set(stage.kernels)
    assert mix["attention_scores"]["FFMA"] > 0 and mix["attention_softmax"]["SHFL"] > 0
    info = sass.resources(cubin.ptxas_log)
    assert info["attention_softmax"]["shared_bytes"] == 128  # block_reduce's 32 floats


def test_the_sass_mix_is_kept_beside_the_cubin(monkeypatch):
    stage = stages.load("stage0")
    cubin = next(iter(compile_stage(stage, stage.source_path, "sm_86").values()))
    listed = sass.parse_listing(sass.disassemble(cubin.path))
    assert sass.instruction_mix(cubin.path) == listed  # computed, or read back from an earlier run
    assert cubin.path.with_suffix(f".sass{sass.MIX_FORMAT}.json").is_file()
    monkeypatch.setattr(sass, "disassemble", lambda path: pytest.fail("nvdisasm ran for a cubin it had read"))
    assert sass.instruction_mix(cubin.path) == listed


# The ladders' lower rungs compile without spills, for sm_80 and sm_90a where they run there, with the
# instructions of their step and none of a higher one's. Stage 6's (and stage 7's) on CUDA cores only (simt)
# or on mma.sync with ldmatrix and cp.async (mma_sync), never with Hopper's instructions; stage 4's with
# wgmma fed by cp.async (wgmma), then by TMA (tma, warp_specialized: stage 4's TMA loads, no cp.async).
RUNG_SASS = {"simt": ({"FFMA"}, {"HMMA", "HGMMA"}), "mma_sync": ({"HMMA", "LDSM", "LDGSTS"}, {"HGMMA", "UTMALDG"}),
             "wgmma": ({"HGMMA", "LDGSTS"}, {"HMMA", "UTMALDG"}), "tma": ({"HGMMA", "UTMALDG"}, {"HMMA", "LDGSTS"}),
             "warp_specialized": ({"HGMMA", "UTMALDG"}, {"HMMA", "LDGSTS"})}
MULTIPLYING = {"expert_up_swiglu", "expert_down", "attention_fwd"}  # stage 7's rung also routes, on CUDA cores
RUNGS = [rung.key for name in stages.stage_names() for rung in stages.rungs(name)]
RUNG_PAIRS = [(key, arch) for key in RUNGS for arch in ("sm_80", "sm_90a") if arch in stages.load(key).archs]


@pytest.mark.parametrize("key,arch", RUNG_PAIRS, ids=[f"{k}-{a}" for k, a in RUNG_PAIRS])
def test_ladder_rungs_compile_without_spills(key, arch):
    rung = stages.load(key)
    found = resources(compile_stage(rung, rung.source_path, arch))
    assert len(found) == len(rung.variants(reference.load(rung.problem)))  # fp16 and bf16 (× D)
    needs, forbidden = RUNG_SASS[rung.rung]
    for variant, kernels in found.items():
        assert set(kernels) == set(rung.kernels), variant
        for kernel, info in kernels.items():
            where = f"{key} {arch} {variant} {kernel}"
            assert_no_local_memory(info, where)
            assert not forbidden & set(info["sass"]), f"{where}: {forbidden & set(info['sass'])} in the SASS"
            if kernel in MULTIPLYING:
                assert needs <= set(info["sass"]), f"{where}: no {needs - set(info['sass'])} in the SASS"


def test_the_compiler_finds_the_repository_and_its_headers():
    assert compiler.REPO == REPO and (REPO / "pyproject.toml").is_file()
    assert compiler.SEARCH_DIRS == (REPO / "stages" / "common", REPO / "stages")
