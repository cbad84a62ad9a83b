"""The child-process isolation, on the CPU: a hang is killed, a crash or a CUDA error fails only its
item, and a new worker goes on with the next item."""
import sys
from pathlib import Path

from grader.isolation import run_items

FAKE = [sys.executable, str(Path(__file__).with_name("fake_worker.py"))]


def test_each_bad_item_fails_alone_and_the_rest_still_run():
    items = list(enumerate(["ok", "hang", "ok", "crash", "ok", "error", "ok"]))
    done = []
    failures = run_items({}, "items", items, lambda e: done.append(e["index"]), timeout_s=5, worker=FAKE)
    assert done == [0, 2, 4, 6]
    assert failures[1].kind == "timeout" and "hangs" in failures[1].message
    assert failures[3].kind == "crash" and "139" in failures[3].message
    assert failures[5].kind == "error" and "illegal memory address" in failures[5].message
    assert set(failures) == {1, 3, 5}


def test_a_worker_that_cannot_start_fails_every_item_once():
    broken = [sys.executable, "-c", "import sys; sys.exit(1)"]
    failures = run_items({}, "items", list(enumerate(["a", "b"])), lambda e: None, timeout_s=5, worker=broken)
    assert set(failures) == {0, 1} and failures[0].kind == "crash"
