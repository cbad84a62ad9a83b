"""What a stage's grading says while it runs, and what it records of its time: the worker's notes reach
the grader as progress (a baseline's first call may compile for minutes), and each stage's result holds
the wall seconds of its grading and of its phases."""
import sys

from grader.isolation import run_items

# A worker that says what it is doing within each item, as grader/worker.py does in a benchmark.
NOTING_WORKER = """
import json, sys
from grader.protocol import NOTE, emit
for index, item in json.load(open(sys.argv[1]))["items"]:
    emit("item_start", index=index)
    emit(NOTE, text=f"first call of {item}")
    emit("item_done", index=index)
"""


def test_the_workers_notes_and_starts_reach_the_grader_as_progress(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(NOTING_WORKER)
    heard, done = [], []
    failures = run_items({"items": None}, "items", [(0, "compile"), (1, "eager")], done.append, 30.0,
                         worker=[sys.executable, str(script)], on_progress=heard.append)
    assert not failures and [e["index"] for e in done] == [0, 1]
    assert [(e["event"], e.get("index"), e.get("text")) for e in heard] == [
        ("item_start", 0, None), ("note", None, "first call of compile"),
        ("item_start", 1, None), ("note", None, "first call of eager")]


def test_a_stages_result_holds_the_seconds_of_its_grading_and_its_phases():
    import stages
    from grader.__main__ import grade_one, parser

    result, status = grade_one(stages.load("stage0"), parser().parse_args(["stage0", "--arch", "sm_80"]), None)
    assert status == 0 and result["seconds"] >= result["phase_seconds"]["compile"] >= 0
    assert list(result["phase_seconds"]) == ["compile"]  # no GPU: nothing else ran
