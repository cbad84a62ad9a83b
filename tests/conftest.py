import functools
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@functools.cache
def gpu():
    from grader import device
    return device.probe()


def pytest_collection_modifyitems(config, items):
    found, why = gpu()
    if found is None:
        skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU: {why}")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def kernel_dir(tmp_path_factory):
    """One folder per test session for the kernels the GPU tests write (untouched exercises under workspace/,
    the wrong kernels of mutations.py): at the same paths in every test, they compile once (the compile
    cache's key holds the path)."""
    return tmp_path_factory.mktemp("kernels")


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
