"""The GPU tests' kernels compiled up front (tests/gpu_kernels.py, conftest.py): on the CPU, that the warm-up
compiles exactly what the GPU tests then ask the compiler for, so that their compiles all find the cache."""
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import stages
from grader import exercise, run, sass
from mutations import MUTATIONS, mutate
import gpu_kernels
from grader.parallel_compile import compile_all

H100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0)  # as grader.device.probe's GpuInfo


def graded_by_the_gpu_tests(kernel_dir: Path, names=None) -> list:
    """The kernels tests/test_gpu.py, test_block_sparse_stage.py and test_block_sparse_backward_stage.py grade
    on an H100, where they put them: (stage, path) of each solution, untouched exercise and mutation of the
    stages `names` (all by default)."""
    names = stages.stage_names() if names is None else names
    kernels = []
    for name in names:
        stage = stages.load(name)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("FLASHMOE_WORKSPACE", str(kernel_dir / "workspace"))
            kernels += [(stage, stage.source_path), (stage, exercise.init(stage, force=True))]
    kernels += [mutate(m, kernel_dir) for m, mutation in MUTATIONS.items() if stages.load(mutation.stage).name in names]
    return kernels


def test_the_warm_up_lists_every_compile_of_the_grader_on_an_h100_and_no_other(tmp_path, monkeypatch):
    asked = set()

    def recorded(path, arch, defines=None, extra_source=""):
        asked.add((str(Path(path).resolve()), arch, tuple(sorted(defines.items())), extra_source))
        return None
    monkeypatch.setattr(run, "compile_cubin", recorded)
    monkeypatch.setattr(run, "compile_each", lambda jobs, **_: [(None, 0.0)] * len(jobs))  # each call recorded
    for stage, path in graded_by_the_gpu_tests(tmp_path):
        run.compile_stage(stage, path, stages.arch_for(H100, stage.archs))
    listed = {(str(Path(p).resolve()), arch, tuple(sorted(d.items())), extra)
              for p, arch, d, extra in gpu_kernels.builds(H100, *gpu_kernels.copies(tmp_path))}
    graders = {job for job in listed if job[3]}  # the grader's carry its checks; the ops' and stage 11's none
    assert graders == asked
    without_checks = listed - graders
    assert {Path(p).parent.name for p, *_ in without_checks} == \
        {"stage4_hopper", "stage7_moe_layer", "stage9_hopper_backward", "stage11_expert_parallel", "stage12_block_sparse",
         "stage13_block_sparse_backward", "stage14_moe_backward", "stage15_decode"}


def test_the_gpu_tests_grade_each_stage_s_solution_exercise_and_mutations(tmp_path):
    kernels = graded_by_the_gpu_tests(tmp_path, ["stage0_naive"])
    assert len(kernels) == 2 + sum(m.stage == "stage0" for m in MUTATIONS.values())


def test_after_the_warm_up_the_gpu_tests_compiles_all_find_the_cache(tmp_path, monkeypatch):
    """Stage 0's solution, exercise and one of its mutations, compiled by the warm-up's threads; then the grader's
    own compile of each finds every cubin in the cache (NVRTC is not called), and the cache holds no other; and
    the grade's report finds each cubin's instruction mix made (nvdisasm is not called). One mutation stands for
    them all: each is compiled as the others are, and each of stage 0's costs the test 4 compiles and 4 nvdisasm."""
    from stages.common import compiler

    cache = tmp_path / "cache"
    monkeypatch.setattr(compiler, "CACHE_DIR", cache / "cubin")
    names = ["stage0_naive"]
    exercises, mutations = gpu_kernels.copies(tmp_path / "kernels")
    mutation = next(name for name, m in MUTATIONS.items() if m.stage == "stage0")
    jobs = gpu_kernels.builds(H100, exercises, {mutation: mutations[mutation]}, names=names)
    results = compile_all(jobs, threads=2)
    assert [error for *_, error in results if error] == []

    import cuda.core

    monkeypatch.setattr(cuda.core, "Program", lambda *a, **k: pytest.fail("compiled again: not in the cache"))
    left_out = {name for name, m in MUTATIONS.items() if m.stage == "stage0"} - {mutation}
    kernels = [(stage, path) for stage, path in graded_by_the_gpu_tests(tmp_path / "kernels", names)
               if path.stem not in left_out]
    assert len(kernels) == 3
    cubins = [c for stage, path in kernels for c in run.compile_stage(stage, path, "sm_90a").values()]
    assert len(cubins) == len(jobs) and len(list((cache / "cubin").glob("*.cubin"))) == len(jobs)
    monkeypatch.setattr(sass, "disassemble", lambda cubin: pytest.fail(f"{cubin} disassembled again"))
    assert all(run.resources({c.path.name: c}) for c in cubins)


def test_a_stage_compiles_all_its_variants_at_once(monkeypatch):
    """compile_stage: every variant goes to the thread pool at once, stopping at the first failure (a cached
    variant is found there at once)."""
    from stages.common.compiler import Cubin

    stage = stages.load("stage12")
    builds = run.stage_builds(stage)
    pooled = []

    def compile_each(jobs, stop_at_failure=False, with_sass=False):
        pooled.append(([defines for _, _, defines, _ in jobs], stop_at_failure, with_sass))
        return [(Cubin(Path(path), arch, tuple(sorted(d.items())), ""), 1.0) for path, arch, d, _ in jobs]

    monkeypatch.setattr(run, "compile_each", compile_each)
    monkeypatch.setattr(run, "compile_cubin", lambda *job: pytest.fail("compiled outside the pool"))
    assert len(run.compile_stage(stage, stage.source_path, "sm_90a")) == len(builds) > 2
    assert len(run.compile_stage(stage, stage.source_path, "sm_90a", with_sass=False)) == len(builds)
    assert pooled == [([d for d, _ in builds], True, True), ([d for d, _ in builds], True, False)]


def test_a_compile_error_is_the_first_variants(tmp_path):
    """Every variant compiled at once: the error said is still the first variant's, in NVRTC's words."""
    from stages.common.compiler import CompileError

    stage = stages.load("stage0")
    mine = tmp_path / "attention.cu"
    mine.write_text(stage.source_path.read_text().replace("float row_sum = 0.0f;", "float row_sum = 0.0f +;"))
    with pytest.raises(CompileError) as error:
        run.compile_stage(stage, mine, "sm_80")
    assert "attention.cu(" in error.value.log and error.value.arch == "sm_80"


def test_compile_each_leaves_out_the_jobs_not_begun_at_the_first_failure(tmp_path):
    from grader.parallel_compile import compile_each
    from stages.common.compiler import CompileError

    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void k() { this is not C; }')
    good = tmp_path / "good.cu"
    good.write_text('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }')
    found = compile_each([(bad, "sm_80", {"N": "0"}, "")] + [(good, "sm_80", {"N": str(n)}, "") for n in range(4)],
                         threads=1, stop_at_failure=True)
    assert isinstance(found[0][0], CompileError) and [f for f, _ in found[1:]] == [None] * 4


def test_one_kernel_compiled_twice_at_once_is_compiled_once(tmp_path, monkeypatch):
    """Processes sharing the compile cache (the tests, run on every core), or threads: the second compile of a
    job waits for the first's cubin instead of compiling it again."""
    import cuda.core

    from grader.parallel_compile import compile_each
    from stages.common import compiler

    monkeypatch.setattr(compiler, "CACHE_DIR", tmp_path / "cache" / "cubin")
    real, made = cuda.core.Program, []

    def counted(*args, **kwargs):
        made.append(args)
        time.sleep(0.5)  # long enough for the other call to arrive while this one compiles
        return real(*args, **kwargs)

    monkeypatch.setattr(cuda.core, "Program", counted)
    kernel = tmp_path / "k.cu"
    kernel.write_text('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }')
    found = compile_each([(kernel, "sm_80", {"N": "1"}, "")] * 2, threads=2)
    assert len(made) == 1 and found[0][0].path == found[1][0].path and found[0][0].path.is_file()


def test_one_kernels_sass_asked_twice_at_once_is_made_once(tmp_path, monkeypatch):
    """As its compile: the second call waits for the first's SASS mix and digest, kept beside the cubin, instead
    of running nvdisasm on the same cubin beside it."""
    from grader.parallel_compile import compile_each
    from stages.common import compiler

    monkeypatch.setattr(compiler, "CACHE_DIR", tmp_path / "cache" / "cubin")
    real, listed = sass.disassemble, []

    def counted(path):
        listed.append(Path(path))
        time.sleep(0.5)  # long enough for the other call to arrive while this one disassembles
        return real(path)

    monkeypatch.setattr(sass, "disassemble", counted)
    kernel = tmp_path / "k.cu"
    kernel.write_text('extern "C" __global__ void k(float* x) { x[0] = 1.0f; }')
    found = compile_each([(kernel, "sm_80", {"N": "1"}, "")] * 2, threads=2, with_sass=True)
    assert listed == [found[0][0].path] * 2  # the first call's mix and digest; the second found both kept
