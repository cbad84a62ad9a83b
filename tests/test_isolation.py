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


def _pids(items, **kw) -> list[int]:
    done = []
    run_items({}, "items", list(enumerate(items)), done.append, timeout_s=5, worker=FAKE, serves=True, **kw)
    return [e["pid"] for e in done]


def test_a_serving_worker_takes_job_after_job_in_one_process():
    first, second = _pids(["ok", "ok"]), _pids(["ok"])
    assert len(set(first + second)) == 1


def test_after_a_hang_a_crash_an_error_or_a_failed_item_the_next_job_gets_a_new_worker():
    before = _pids(["ok"])
    for bad in ("hang", "crash", "error", "wrong"):
        _pids([bad])  # on the worker kept from the job before
        after = _pids(["ok"])
        assert after != before, f"the worker that met {bad!r} took the next job"
        assert _pids(["ok"]) == after  # a clean job's worker is kept
        before = after


def test_each_bad_item_fails_alone_on_a_serving_worker_too():
    items = list(enumerate(["ok", "hang", "ok", "crash", "ok", "error", "ok"]))
    done = []
    failures = run_items({}, "items", items, lambda e: done.append(e["index"]), timeout_s=5, worker=FAKE,
                         serves=True)
    assert done == [0, 2, 4, 6] and set(failures) == {1, 3, 5}


def test_after_a_worker_is_not_kept_spares_start_for_the_next_jobs(monkeypatch):
    from grader import isolation

    monkeypatch.setattr(isolation, "SPARES", 2)
    _pids(["wrong"])
    spares = isolation._serving[tuple(FAKE)]
    assert len(spares) == isolation.SPARES and all(c.process.poll() is None for c in spares)
    first_spare = spares[0].process.pid
    assert _pids(["ok"]) == [first_spare]


def test_stop_after_failure_runs_no_item_after_a_crash():
    done = []
    failures = run_items({}, "items", list(enumerate(["ok", "crash", "ok"])), lambda e: done.append(e["index"]),
                         timeout_s=5, worker=FAKE, stop_after_failure=True)
    assert done == [0] and set(failures) == {1}


def test_a_kept_worker_that_died_while_it_waited_fails_the_job_as_a_crash(monkeypatch):
    from grader import isolation

    dead = isolation._Child([sys.executable, "-c", "import sys; sys.exit(7)"])
    dead.process.wait()
    monkeypatch.setattr(isolation, "_serving_worker", lambda worker: dead)
    failures = run_items({}, "items", [(0, "ok")], lambda e: None, timeout_s=5, worker=FAKE, serves=True)
    assert failures[0].kind == "crash" and "exit status 7" in failures[0].message
