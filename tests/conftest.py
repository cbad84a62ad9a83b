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
