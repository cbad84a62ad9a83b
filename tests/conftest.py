import functools
import os
import runpy
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@functools.cache
def gpu():
    from grader import device
    return device.probe()


# With -n, the tests of each of these modules run in one worker, so that their module-scoped fixtures (the site's
# builds, the gloo process groups, a record's runs digest) are made once, not in every worker.
ONE_WORKER = ("tests/test_docs.py", "tests/test_expert_parallel.py", "tests/test_runs_digest.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n's scheduling: pytest-xdist's "load" (each test sent to the next free worker), but the tests of a module
    in ONE_WORKER sent together. (Its "loadgroup" does that by xdist_group marks, but on pytest 9.2, whose node
    ids it can no longer rename, it loses the groups.)"""
    if config.getvalue("dist") != "load":
        return None  # another --dist, asked for by name
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return Scheduling(config, log)


def scope_of(nodeid: str) -> str:
    """What -n sends to a worker with the test `nodeid`: its module where that is in ONE_WORKER, else itself."""
    module = nodeid.split("::", 1)[0]
    return module if module in ONE_WORKER else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): one worker per CPU core, as pytest-xdist's own rule, where there
    is no GPU; none where there is one: the GPU tests time kernels on it and keep spare child processes on it
    (compiled_up_front below), so the tests run in one process, one after the other, as without -n."""
    found, _ = gpu()
    return 0 if found is not None else None  # None: pytest-xdist's own count


def pytest_configure(config):
    """In a worker of `-n`, each compile's pool of threads (grader/parallel_compile.py) shares the CPU cores with
    the other workers': two threads each, or the cores' share where that is more, rather than a thread per core
    each; and PyTorch's CPU ops, in the worker and in the processes its tests start, its share of the cores:
    PyTorch's threads wait for each other spinning, and more of them than cores slow them all (two processes of
    two threads on a 2-core CPU: twice as long as two of one)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        from grader import parallel_compile
        share = max(1, (os.cpu_count() or 1) // workers)
        parallel_compile.THREADS = max(2, share)
        os.environ["OMP_NUM_THREADS"] = str(share)  # the processes the tests start (gloo ranks, the grader)
        torch.set_num_threads(share)


# With -n, the modules whose tests take longest (minutes of NVRTC's compiles with an empty compile cache, or a grader
# or a model run in a new process), sent first, in this order: each worker takes the next test as it frees, so that a
# long test sent last would leave the other cores idle while it ends the run. ONE_WORKER's modules go first anyway
# (pytest-xdist sends the groups of most tests first). test_compile.py's first: its tests compile every stage for
# every arch, each (stage, arch) once, side by side; the others' compiles then find most of their cubins in the
# cache, where sent first they waited on each other's (`grader list`, run by two tests of test_cli.py, compiles
# every stage at sm_90a: both at once, one waited on the other's lock files).
LONG_FIRST = ("tests/test_compile.py", "tests/test_gpu_kernels.py", "tests/test_cli.py", "tests/test_training.py",
              "tests/test_sass_identity.py", "tests/test_mutations.py", "tests/test_exercise.py", "tests/test_geometry.py")


def sending_order(nodeid: str) -> int:
    """Where the test `nodeid` comes in -n's order: its module's place in LONG_FIRST, after them the others'."""
    module = nodeid.split("::", 1)[0]
    return LONG_FIRST.index(module) if module in LONG_FIRST else len(LONG_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: sending_order(item.nodeid))  # stable: in a module, the tests' own order
    found, why = gpu()
    if found is None:
        skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU: {why}")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def run_as_command(module: str, *args: str) -> int:
    """`python -m module args` in this process, as -m runs it (runpy, argv, the module as __main__): its exit
    status, its output left to capsys. A new Python would spend seconds importing PyTorch again."""
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(sys, "argv", [module, *args])
        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)  # imported by the tests already
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else 1
    return 0


@pytest.fixture(scope="session")
def kernel_dir(tmp_path_factory):
    """One folder per test session for the kernels the GPU tests write (untouched exercises under workspace/,
    the wrong kernels of mutations.py): at the same paths in every test, they compile once (the compile
    cache's key holds the path)."""
    return tmp_path_factory.mktemp("kernels")


def kept_copy(kernel: Path) -> Path:
    """A copy of `kernel` in a folder beside the compile cache named by its bytes' digest, written once: the same
    kernel at the same path in every test session, where its compile is found in the cache (whose key holds the
    path) rather than made again for a new temporary file. Named by its bytes, a copy is never rewritten, so
    sessions of other trees sharing the cache do not race on it."""
    import hashlib

    from stages.common import compiler

    data = kernel.read_bytes()
    copy = compiler.CACHE_DIR.parent / "kernels" / hashlib.sha256(data).hexdigest()[:24] / kernel.name
    if not copy.is_file():
        copy.parent.mkdir(parents=True, exist_ok=True)
        partial = copy.with_name(f"{copy.name}.tmp{os.getpid()}")
        partial.write_bytes(data)
        partial.replace(copy)  # atomic: a parallel session reads the whole file or none
    return copy


def compiles_as_graded(stage, kernel: Path, arch: str):
    """A copy of a stage's kernel (an exercise, a mutation) compiled at `arch` as the grader compiles it (its
    signature and geometry checks appended), for the first of its variants only: the copy's edit is in its text,
    which every variant compiles, and the GPU tests compile each copy's every variant (gpu_kernels.py), as
    tests/test_compile.py does the stage's own kernel's for every arch. Every variant of every copy is 182
    compiles; their first variants, 36."""
    from grader.run import stage_builds
    from stages.common.compiler import compile_cubin

    defines, checks = stage_builds(stage)[0]
    return compile_cubin(kept_copy(kernel), arch, defines, checks)


@pytest.fixture(scope="session", autouse=True)
def compiled_up_front(request):
    """Where GPU tests run, every kernel they compile, compiled first over all CPU cores (gpu_kernels.py):
    graded one after the other, cold, the compiles alone took most of the GPU half's time."""
    found, _ = gpu()
    if found is None or not any("gpu" in item.keywords for item in request.session.items):
        return
    import gpu_kernels

    from grader import isolation
    from grader.parallel_compile import compile_all

    # Workers for the grades, starting up while the kernels compile: six in reserve. The untouched exercises
    # and the wrong kernels, about forty tests in a row, each retire their worker, and a worker takes about
    # 7 s to start (PyTorch, the CUDA context) where such a test takes 1 to 4: with three in reserve they
    # waited on start-ups. Each spare holds a CUDA context, about half a GB of the GPU's memory.
    isolation.SPARES = 6
    isolation.start_spares()
    jobs = gpu_kernels.builds(found, *gpu_kernels.copies(request.getfixturevalue("kernel_dir")))
    compile_all(jobs)
