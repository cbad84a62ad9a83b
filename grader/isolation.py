"""Run GPU work in a child process with a time limit, so a bad kernel cannot take the grader down.

The child (`grader/worker.py`) prints JSON events; `run_job` hands each to a callback and waits at
most `timeout_s` for the next one. If the child hangs it is killed; if it dies, its last words
(the error event, or the tail of its stderr) say why. Jobs that go through a list of items
(`run_items`) start a new child after a crash and go on with the item after the one that crashed.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from grader.protocol import NOTE

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


def run_job(job: dict, on_event, timeout_s: float, worker: list[str] = WORKER) -> Failure | None:
    """Run one worker (`worker` + the job file); None if it finished cleanly, else the Failure that ended it."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    stderr = tempfile.TemporaryFile("w+")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = subprocess.Popen([*worker, f.name], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(child.stdout, lines), daemon=True).start()
    failure = None
    try:
        while True:
            try:
                line = lines.get(timeout=timeout_s)
            except queue.Empty:
                child.kill()
                failure = Failure("timeout", f"no progress for {timeout_s:.0f} s: the kernel hangs (killed)")
                break
            if line is None:
                break
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # something the stage printed; not ours
            if event["event"] == "error":
                failure = Failure("error", _describe_error(event))
            else:
                on_event(event)
        code = child.wait()
        if failure is None and code != 0:
            stderr.seek(0)
            tail = "\n".join(stderr.read().strip().splitlines()[-5:])
            failure = Failure("crash", f"the worker died (exit status {code}): {tail or 'no message'}")
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        os.unlink(f.name)
        stderr.close()
    return failure


def _describe_error(event: dict) -> str:
    message = event["message"]
    for code, plain in (("ILLEGAL_ADDRESS", "illegal memory address"), ("illegal memory access", "illegal memory address"),
                        ("MISALIGNED", "misaligned address"), ("LAUNCH_OUT_OF_RESOURCES", "too many resources requested"),
                        ("out of memory", "out of memory")):
        if code in message:
            return f"CUDA error ({plain}): {message.splitlines()[0]}"
    return f"{event['kind']}: {message.splitlines()[0] if message else ''}"


def run_items(job: dict, key: str, items: list, on_done, timeout_s: float, worker: list[str] = WORKER,
              on_progress=lambda event: None) -> dict[int, Failure]:
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

        failure = run_job(dict(job, **{key: remaining}), on_event, timeout_s, worker)
        if failure is None:
            break
        if state["current"] is None or state["current"] in state["done"]:
            # the worker failed before any item started (or between items): nothing will go better
            for index, _ in remaining:
                if index not in state["done"]:
                    failures[index] = failure
            break
        failures[state["current"]] = failure
        position = [i for i, _ in remaining].index(state["current"])
        remaining = remaining[position + 1:]
    return failures
