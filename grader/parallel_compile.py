"""Compiles on every CPU core at once: NVRTC compiles one variant at a time, and a stage has up to 16.

Each job is a compile_cubin call (the kernel's path, the arch, the -D macros, the source appended), run on
a pool of threads: NVRTC releases Python's lock while it compiles, and each call has its own program, so
the compiles run side by side (stage 12's 16 variants: 11.8 s one after the other, 6.5 s on two threads,
on a 2-core CPU, on 2026-11-27), and make the same cubins as one after the other. The cubins land in the
compile cache (stages/common/compiler.py), where later compile_cubin calls find them. A job that fails is
returned, not raised: the caller says it, in its words. Processes that share the cache (the tests, run on
every core) compile a job one at a time: the second waits for the first's cubin, and its SASS where it is
made (a lock file per job).

Each cubin's SASS instruction mix (grader/sass.py), which every grade reports, and the digest of its
machine code, which a record's runs digest is made of, are made here too, where the caller reads them
(with_sass; compile_all always): nvdisasm takes 0.4-0.7 s a cubin on an H100 machine's host (the GPU tests'
durations, 2026-11-27; 0.6 s on a 2-core CPU, as long as NVRTC's compile of many a variant), and the GPU
tests grade about 240 cubins, one after the other: counted, about 100 s of their time, here a few seconds
on every core.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grader import sass

THREADS: int | None = None  # a pool's threads where the caller names none; None: one per CPU core


def _compile(job: tuple, with_sass: bool = False) -> tuple:
    """(the job's Cubin, its SASS mix and machine-code digest made beside it if asked, or the exception
    compile_cubin raised; seconds)."""
    from stages.common.compiler import compile_cubin

    start = time.perf_counter()
    # The SASS is made under the job's lock too: a process that waited for another's compile then finds its SASS
    # mix and digest kept, rather than running nvdisasm on the same cubin beside it.
    with _one_at_a_time(job):
        try:
            cubin = compile_cubin(*job)
        except Exception as failure:  # the caller says it, in its words
            return failure, time.perf_counter() - start
        if with_sass:
            _make_sass(cubin)
    return cubin, time.perf_counter() - start


def _make_sass(cubin) -> None:
    """The cubin's SASS mix and machine-code digest, kept beside it, where the grade's own calls find them."""
    try:
        sass.instruction_mix(cubin.path)
        sass.code_digest(cubin)
    except (OSError, RuntimeError, subprocess.CalledProcessError):
        pass  # no nvdisasm here, or it failed: the grade's own call says so, in its words


@contextlib.contextmanager
def _one_at_a_time(job: tuple):
    """Held while a job compiles and its SASS is made: a lock file (empty, left there) named by the job, under the
    compile cache, so that processes sharing the cache do each once (the second then finds the first's). Without fcntl
    (not Linux or macOS), no lock."""
    from stages.common import compiler

    try:
        import fcntl
    except ImportError:
        yield
        return
    path, arch, defines, extra = job
    name = hashlib.sha256(repr((str(Path(path).resolve()), arch, sorted((defines or {}).items()), extra)).encode())
    locks = compiler.CACHE_DIR.parent / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name.hexdigest()[:24]}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        yield


def compile_each(jobs: list[tuple], threads: int | None = None, stop_at_failure: bool = False,
                 with_sass: bool = False) -> list[tuple]:
    """Each job's (Cubin or the exception its compile raised, seconds), in the jobs' order, compiled on
    `threads` threads (default: THREADS). With stop_at_failure, the jobs not begun when one fails are left
    out, (None, 0.0): a learner's compile error is said as soon as the variant that has it is done. With
    with_sass, each cubin's SASS mix and machine-code digest are made beside it."""
    import cuda.core

    cuda.core.Program  # imported here, once: compile_cubin's import is not safe from several threads at once
    threads = min(threads or THREADS or os.cpu_count() or 1, len(jobs))
    found = []
    if threads <= 1:
        for job in jobs:
            found.append(_compile(job, with_sass))
            if stop_at_failure and isinstance(found[-1][0], Exception):
                break
        return found + [(None, 0.0)] * (len(jobs) - len(found))
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(_compile, job, with_sass) for job in jobs]
        for future in futures:
            if stop_at_failure and isinstance(future.result()[0], Exception):
                for later in futures:
                    later.cancel()  # those begun finish; the others never start
                break
    return [(None, 0.0) if future.cancelled() else future.result() for future in futures]


def compile_all(jobs: list[tuple], threads: int | None = None) -> list[tuple[str, float, str | None]]:
    """Each job's (name, seconds, error or None), compiled on `threads` threads (default: THREADS), each
    cubin's SASS mix and machine-code digest made beside it."""
    return [(f"{Path(path).name} {arch} {defines}", seconds,
             f"{type(found).__name__}: {found}" if isinstance(found, Exception) else None)
            for (path, arch, defines, _), (found, seconds) in zip(jobs, compile_each(jobs, threads, with_sass=True))]
