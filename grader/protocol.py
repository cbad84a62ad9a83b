"""What the grader and its child process (grader/worker.py) say to each other, shared by both sides.

The grader writes a job (a JSON file: the stage, the phase, the cubins, the items) and names it to
`python -m grader.worker --serve` (isolation.WORKER), a worker kept for the next job when it ends one
cleanly (JOB_END). The worker prints one JSON object per line, an
event: "ready"; per item, "<item>_start" then "<item>_done" with the item's results ("case", "bench",
"profile"); "note" for what it is doing within an item (a baseline's first call, which may compile for
minutes); "error" with the exception that ended it. Every event counts as progress for the grader's time
limit. The names below are the ones both sides must spell alike.
"""
from __future__ import annotations

import json

# The name under which the previous stage's kernel is timed beside this one (not a library baseline).
PREVIOUS = "previous stage"

# The NVTX ranges the worker wraps each side's launches in under Nsight Compute (grader/profile.py).
RANGES = {"kernel": "flashmoe_kernel", "reference": "flashmoe_reference"}

NOTE = "note"
JOB_END = "job_end"  # a serving worker's (`--serve`) last event of a job; "clean": whether it takes another


def emit(event: str, **fields) -> None:
    """One event, on its own line of stdout, flushed at once (the grader reads it as it comes)."""
    print(json.dumps({"event": event, **fields}, default=float), flush=True)
