"""Compiles on every CPU core at once: NVRTC compiles one variant at a time, and a stage has up to 16.

Each job is a compile_cubin call (the kernel's path, the arch, the -D macros, the source appended), run on
a pool of threads: NVRTC releases Python's lock while it compiles, and each call has its own program, so
the compiles run side by side (stage 12's 16 variants: 11.8 s one after the other, 6.5 s on two threads,
on a 2-core CPU, on 2026-11-27), and make the same cubins as one after the other. The cubins land in the
compile cache (stages/common/compiler.py), where the caller's own compile_cubin calls then find them. A job that fails is reported, not raised: the caller's own call raises it, in its words.

Each cubin's SASS instruction mix (grader/sass.py), which every grade reports, and the digest of its
machine code, which a record's runs digest is made of, are made here too: nvdisasm
takes 0.4-0.7 s a cubin on an H100 machine's host (the GPU tests' durations, 2026-11-27), and the GPU tests
grade about 240 cubins, one after the other: counted, about 100 s of their time, here a few seconds on
every core.
"""
from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grader import sass


def _compile(job: tuple) -> tuple[str, float, str | None]:
    from stages.common.compiler import compile_cubin

    path, arch, defines, extra = job
    name, start = f"{Path(path).name} {arch} {defines}", time.perf_counter()
    try:
        cubin = compile_cubin(path, arch, defines, extra)
    except Exception as failure:  # the caller's own compile reports it
        return name, time.perf_counter() - start, f"{type(failure).__name__}: {failure}"
    try:
        sass.instruction_mix(cubin.path)  # both kept beside the cubin, where the grade's own calls find them
        sass.code_digest(cubin)
    except (OSError, RuntimeError, subprocess.CalledProcessError):
        pass  # no nvdisasm here, or it failed: the grade's own call says so, in its words
    return name, time.perf_counter() - start, None


def compile_all(jobs: list[tuple], threads: int | None = None) -> list[tuple[str, float, str | None]]:
    """Each job's (name, seconds, error or None), compiled on `threads` threads (default: one per CPU core)."""
    import cuda.core

    cuda.core.Program  # imported here, once: compile_cubin's import is not safe from several threads at once
    threads = min(threads or os.cpu_count() or 1, len(jobs))
    if threads <= 1:
        return [_compile(job) for job in jobs]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(_compile, jobs))
