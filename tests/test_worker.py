"""The worker's correctness loop on the CPU, with check_once standing in for a kernel's run and check:
what each case reports, when a job stops, and whether the process may serve another job."""
import pytest

import reference
from grader import worker as worker_module
from grader.worker import Worker


def _worker(outcomes: dict, trials=2, first_failure=False):
    """A Worker whose check_once gives outcomes[case name] ("pass", "fail", "writes inputs", "raises")."""
    worker = Worker.__new__(Worker)  # no GPU: nothing of __init__ is needed by the loop
    worker.job = {"cases": [(i, {"name": name, "seed": i}) for i, name in enumerate(outcomes)], "trials": trials,
                  "first_failure": first_failure}
    worker.clean = True

    def check_once(case, seed):
        outcome = outcomes[case["name"]]
        if outcome == "raises":
            raise ValueError("shape not supported")
        return [{"output": "o", "passed": outcome == "pass"}], outcome != "writes inputs"

    worker.check_once = check_once
    return worker


@pytest.fixture
def events(monkeypatch):
    heard = []
    monkeypatch.setattr(worker_module, "emit", lambda event, **fields: heard.append((event, fields)))
    return heard


def _done(events) -> dict:
    return {fields["index"]: fields for event, fields in events if event == "case_done"}


def test_every_case_is_reported_and_a_failed_one_makes_the_worker_unfit_for_another_job(events):
    worker = _worker({"a": "pass", "b": "fail", "c": "writes inputs", "d": "raises", "e": "pass"})
    worker.correctness()
    done = _done(events)
    assert [done[i]["passed"] for i in range(5)] == [True, False, False, False, True]
    assert done[2]["inputs_unmodified"] is False and "ValueError" in done[3]["failure"]
    assert not worker.clean


def test_a_clean_job_leaves_the_worker_fit(events):
    worker = _worker({"a": "pass", "b": "pass"})
    worker.correctness()
    assert worker.clean and all(fields["passed"] for fields in _done(events).values())


def test_first_failure_stops_the_job_after_the_first_failed_case(events):
    _worker({"a": "pass", "b": "writes inputs", "c": "fail"}, first_failure=True).correctness()
    assert sorted(_done(events)) == [0, 1]


def test_check_cases_with_first_failure_lists_the_cases_up_to_the_first_failed_one(monkeypatch):
    """The rows of the cases run (the worker stopped after case 1), none "not run" for the others."""
    import stages
    from grader import run

    def run_items(job, key, items, on_done, timeout_s, stop_after_failure=False):
        assert job["first_failure"] and stop_after_failure
        on_done({"index": 0, "passed": True, "inputs_unmodified": True, "checks": []})
        on_done({"index": 1, "passed": False, "inputs_unmodified": True, "checks": []})
        return {}

    monkeypatch.setattr(run, "run_items", run_items)
    stage = stages.load("stage0")
    result = run.check_cases(stage, {}, 0, 1, 5.0, lambda *a: None, first_failure=True)
    assert [c["passed"] for c in result["cases"]] == [True, False] and result["failed"] == 1
    assert result["not_run"] == len(reference.load(stage.problem).cases(0)) - 2


def test_the_report_says_how_many_cases_a_stop_at_the_first_failure_left(monkeypatch):
    from rich.console import Console

    from grader import report

    monkeypatch.setattr(report, "console", Console(record=True, width=200))
    report.print_correctness({"passed": 1, "failed": 1, "not_run": 32, "seed": 0, "trials": 2, "cases": [
        {"name": "a", "passed": True, "inputs_unmodified": True, "checks": []},
        {"name": "b", "passed": False, "failure": "timeout: no progress for 60 s"}]})
    assert "1 passed, 1 failed, 32 not run (stopped at the first failure)" in report.console.export_text()


def test_the_forward_then_backward_timing_runs_the_backward_on_what_the_forward_gives(monkeypatch):
    """forward_backward's kernel side: the forward's forward_for_backward (its outputs, and what it saves for
    the backward), then the backward's run_stage on the inputs with those in place of the inputs' own."""
    from types import SimpleNamespace

    from grader import timing

    calls = []

    class Forward:
        def allocate_outputs(self, inputs):
            return {"out": "poisoned"}

        def forward_for_backward(self, stage, kernels, inputs, outputs):
            calls.append(("forward", stage.key, kernels, outputs))
            return {"topk_ids": "the forward's", "h1": "kept by the forward"}

    class Backward:
        forward = "a forward"

        def run_stage(self, stage, kernels, inputs, outputs):
            calls.append(("backward", stage.key, kernels, inputs, outputs))

        def forward_backward_baselines(self, inputs):
            return {}

    worker = Worker.__new__(Worker)
    worker.problem, worker.stage = Backward(), SimpleNamespace(key="backward stage")
    worker.forward, worker.job = (SimpleNamespace(key="forward stage"), {}), {"l2_bytes": 0, "budget_s": 0}
    worker.kernels_for = lambda inputs, stage=None, cubins=None, problem=None: f"{stage.key}'s kernels"
    monkeypatch.setattr(reference, "load", lambda name: {"a forward": Forward()}[name])
    monkeypatch.setattr(timing, "time_side_by_side", lambda runs, l2_bytes, budget_s: {
        name: SimpleNamespace(as_dict=lambda: {}) for name, run in runs.items() if run() or True})
    inputs = {"x": "x", "topk_ids": "exact", "h1": "exact"}
    result = worker.forward_backward(inputs, {"dx": "poisoned"}, "backward stage's kernels")
    assert result == {"stage": "forward stage", "timings": {"kernel": {}}, "skipped": {}}
    assert calls == [("forward", "forward stage", "forward stage's kernels", {"out": "poisoned"}),
                     ("backward", "backward stage", "backward stage's kernels",
                      {"x": "x", "topk_ids": "the forward's", "h1": "kept by the forward"}, {"dx": "poisoned"})]
    assert inputs == {"x": "x", "topk_ids": "exact", "h1": "exact"}  # the inputs themselves unchanged


def test_an_input_holding_nan_is_unmodified_when_its_bits_are():
    """The unmodified-inputs check compares bits: NaN poison in an input (the MoE backward's h1) is not a write."""
    import torch

    from grader.worker import same_bits

    poisoned = torch.tensor([1.0, float("nan"), -0.0], dtype=torch.bfloat16)
    assert same_bits(poisoned, poisoned.clone())
    assert not same_bits(poisoned, torch.tensor([1.0, float("nan"), 0.0], dtype=torch.bfloat16))
    ids = torch.tensor([3, 1], dtype=torch.int32)
    assert same_bits(ids, ids.clone()) and not same_bits(ids, ids + 1)
