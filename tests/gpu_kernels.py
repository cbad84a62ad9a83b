"""The kernels the GPU tests compile, compiled up front on every CPU core.

Each grading compiles every variant of a stage (dtype × head dim × ...) with NVRTC, one after the other; on
a fresh machine the GPU tests would spend most of their time there. `copies` writes the untouched exercises
and the wrong kernels (tests/mutations.py) once per test session, to fixed paths, so that the tests that
grade them share one compile; `builds` lists every compile_cubin call the GPU tests make (the grader's, with
its checks appended, and the ops' and stage 11's, without), and grader/parallel_compile.py makes them on a pool
of threads: the tests' own calls then find their cubins in the compile cache (stages/common/compiler.py),
whose key is the source, its headers, the options and the path NVRTC is given, exactly as a cold compile
would make them.
"""
from __future__ import annotations

import os
from pathlib import Path

import reference
import stages
from grader import exercise
from grader.run import stage_builds
from mutations import MUTATIONS, mutate

def copies(folder: Path) -> tuple[dict, dict]:
    """({stage name: its untouched exercise}, {mutation: (its stage, its kernel)}), written under `folder` as
    the GPU tests write them: each exercise by `init` into the workspace `folder`/workspace, each mutation
    into `folder`. A mutation whose text is gone is left out: the test that makes it says so."""
    folder = Path(folder)
    before = os.environ.get("FLASHMOE_WORKSPACE")
    os.environ["FLASHMOE_WORKSPACE"] = str(folder / "workspace")
    try:
        exercises = {name: exercise.init(stages.load(name), force=True) for name in stages.stage_names()}
    finally:
        if before is None:
            del os.environ["FLASHMOE_WORKSPACE"]
        else:
            os.environ["FLASHMOE_WORKSPACE"] = before
    mutations = {}
    for name in MUTATIONS:
        try:
            mutations[name] = mutate(name, folder)
        except AssertionError:
            continue
    return exercises, mutations


def runnable_arch(gpu, stage) -> str | None:
    try:
        return stages.arch_for(gpu, stage.archs)
    except ValueError:
        return None


def builds(gpu, exercises: dict, mutations: dict, names=None) -> list[tuple]:
    """(path, arch, defines, extra source) of each compile_cubin call the GPU tests make on `gpu`, once each:
    every stage's solution and untouched exercise and every mutation as the grader compiles them (all
    variants, its checks appended); the stages stages.ops runs (stage 10 through it) as it compiles them (every
    variant, no checks); stage 11 as its runner loads it (bf16, no checks). `names`: only these stages' (all by
    default)."""
    names = set(stages.stage_names() if names is None else names)
    jobs = []

    def graded(stage, path):
        if stage.name in names and (arch := runnable_arch(gpu, stage)):
            jobs.extend((Path(path), arch, defines, checks) for defines, checks in stage_builds(stage))

    for name in stages.stage_names():
        graded(stages.load(name), stages.load(name).source_path)
        if name in exercises:
            graded(stages.load(name), exercises[name])
    for stage, path in mutations.values():
        graded(stage, path)
    for problem in stages.OPS_STAGES:
        try:
            stage, arch = stages.ops_stage(problem, gpu)
        except RuntimeError:
            continue
        if stage.name in names:
            jobs.extend((stage.source_path, arch, stage.defines(v), "")
                        for v in stage.variants(reference.load(problem)))
    ep = stages.load("stage11")
    if ep.name in names and (arch := runnable_arch(gpu, ep)):
        jobs.append((ep.source_path, arch, ep.defines({"dtype": "bfloat16"}), ""))
    unique = {}
    for path, arch, defines, extra in jobs:
        unique.setdefault((str(path), arch, tuple(sorted(defines.items())), extra), (path, arch, defines, extra))
    return list(unique.values())
