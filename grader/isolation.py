"""Run GPU work in a child process with a time limit, so a bad kernel cannot take the grader down.

The child (`grader/worker.py`) prints JSON events; `run_job` hands each to a callback and waits at
most `timeout_s` for the next one. If the child hangs it is killed; if it dies, its last words
(the error event, or the tail of its stderr) say why. Jobs that go through a list of items
(`run_items`) start a new child after a crash and go on with the item after the one that crashed.

The grader's own worker serves job after job (`--serve`: job files named on its stdin, "job_end" after
each): starting Python, PyTorch and a CUDA context costs seconds, and a stage's grading runs several jobs,
the GPU tests dozens. A worker that hung, died, reported an error or failed an item is not used again
(its CUDA context may be gone, or a wrong kernel may have written where it should not); the next job gets
a fresh one. Other commands (the tests' stand-ins, the worker under Nsight Compute) run one job each.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from grader.protocol import JOB_END, NOTE

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Failure:
    kind: str            # "crash", "timeout", "error"
    message: str


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


WORKER = [sys.executable, "-m", "grader.worker"]


class _Child:
    """A worker process, the queue its stdout's lines arrive on, and the file its stderr goes to."""

    def __init__(self, command: list[str]):
        self.stderr = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(self.process.stdout, self.lines), daemon=True).start()

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        return "\n".join(self.stderr.read().strip().splitlines()[-5:])

    def end(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.stderr.close()


# command -> its serving workers: the one kept from the last job first, then spares starting up
_serving: dict[tuple, list[_Child]] = {}
# Spare workers to keep starting up beside the kept one, for callers that run many jobs in which kernels
# fail (the GPU tests: each wrong kernel's worker is not used again), so that the next job finds one that has
# already imported PyTorch and made its CUDA context. None for the grader: after a failed case it stops.
SPARES = 0


@atexit.register
def _end_serving() -> None:
    for children in _serving.values():
        for child in children:
            child.end()
    _serving.clear()


def run_job(job: dict, on_event, timeout_s: float, worker: list[str] = WORKER,
            serves: bool | None = None) -> Failure | None:
    """Run one job on `worker`; None if it finished cleanly, else the Failure that ended it. A worker that
    `serves` (by default the grader's own) is kept for the next job when it can take one, and used again."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    serves = worker == WORKER if serves is None else serves
    child = _serving_worker(worker) if serves else _Child([*worker, f.name])
    if serves:
        try:
            child.process.stdin.write(f.name + "\n")
            child.process.stdin.flush()
        except OSError:  # it died while it waited: the reading below finds its exit status
            pass
    failure, reusable = None, False
    try:
        failure, reusable = _follow(child, on_event, timeout_s)
    finally:
        os.unlink(f.name)
        if reusable and serves:
            _serving[tuple(worker)].insert(0, child)
        else:
            child.end()
            if serves:
                start_spares(worker)
    return failure


def _serving_worker(worker: list[str]) -> _Child:
    """A live serving worker of `worker`: the kept one, else a spare, else a new one."""
    children = _serving.setdefault(tuple(worker), [])
    while children:
        child = children.pop(0)
        if child.process.poll() is None:
            return child
        child.end()
    return _Child([*worker, "--serve"])


def start_spares(worker: list[str] = WORKER) -> None:
    """Start serving workers until `worker` has SPARES of them (with the kept one), each warming up."""
    children = _serving.setdefault(tuple(worker), [])
    children.extend(_Child([*worker, "--serve"]) for _ in range(SPARES - len(children)))


def _follow(child: _Child, on_event, timeout_s: float) -> tuple[Failure | None, bool]:
    """Hand the child's events to `on_event` until its job ends: (the Failure, or None; whether the child
    is alive, clean and waiting for another job)."""
    while True:
        try:
            line = child.lines.get(timeout=timeout_s)
        except queue.Empty:
            child.process.kill()
            return Failure("timeout", f"no progress for {timeout_s:.0f} s: the kernel hangs (killed)"), False
        if line is None:
            break
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # something the stage printed; not ours
        if event["event"] == "error":
            return Failure("error", _describe_error(event)), False
        if event["event"] == JOB_END:
            return None, event.get("clean", False)
        on_event(event)
    code = child.process.wait()
    if code != 0:
        return Failure("crash", f"the worker died (exit status {code}): {child.stderr_tail() or 'no message'}"), False
    return None, False


def _describe_error(event: dict) -> str:
    message = event["message"]
    for code, plain in (("ILLEGAL_ADDRESS", "illegal memory address"), ("illegal memory access", "illegal memory address"),
                        ("MISALIGNED", "misaligned address"), ("LAUNCH_OUT_OF_RESOURCES", "too many resources requested"),
                        ("out of memory", "out of memory")):
        if code in message:
            return f"CUDA error ({plain}): {message.splitlines()[0]}"
    return f"{event['kind']}: {message.splitlines()[0] if message else ''}"


def run_items(job: dict, key: str, items: list, on_done, timeout_s: float, worker: list[str] = WORKER,
              on_progress=lambda event: None, serves: bool | None = None,
              stop_after_failure: bool = False) -> dict[int, Failure]:
    """Run a job over `items` ([(index, item)] under job[key]); a crash fails that item and a new
    worker carries on with the next. Returns {index: Failure} for the items that did not finish.
    `on_done` hears each item's "_done" event; `on_progress` its "_start" and the notes in between."""
    failures: dict[int, Failure] = {}
    remaining = list(items)
    while remaining:
        state = {"current": None, "done": set()}

        def on_event(event):
            if event["event"].endswith("_start"):
                state["current"] = event["index"]
                on_progress(event)
            elif event["event"] == NOTE:
                on_progress(event)
            elif event["event"].endswith("_done"):
                state["done"].add(event["index"])
                on_done(event)

        failure = run_job(dict(job, **{key: remaining}), on_event, timeout_s, worker, serves)
        if failure is None:
            break
        if state["current"] is None or state["current"] in state["done"]:
            # the worker failed before any item started (or between items): nothing will go better
            for index, _ in remaining:
                if index not in state["done"]:
                    failures[index] = failure
            break
        failures[state["current"]] = failure
        if stop_after_failure:
            break
        position = [i for i, _ in remaining].index(state["current"])
        remaining = remaining[position + 1:]
    return failures
