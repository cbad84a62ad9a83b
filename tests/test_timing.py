"""The timing loop's stopping rule (grader/timing.py's `enough`): whole turns only, every candidate settled."""
from grader.timing import enough

STEADY, NOISY = [1.0] * 10, [1.0, 2.0] * 5  # 10 rounds; relative standard error 0 and about 11%
RULE = dict(target_rel_se=0.005, min_reps=5, max_reps=500)


def rounds(n, *series):
    return {f"c{i}": list(s[:n]) for i, s in enumerate(series)}


def test_it_stops_once_every_candidate_has_settled_after_a_whole_turn():
    assert enough(rounds(6, STEADY, STEADY, STEADY), past_deadline=False, **RULE)


def test_a_settled_candidate_does_not_end_the_loop_for_a_noisy_one():
    assert not enough(rounds(6, STEADY, NOISY, STEADY), past_deadline=False, **RULE)


def test_it_never_stops_between_turns_even_past_the_deadline():
    assert not enough(rounds(5, STEADY, NOISY, STEADY), past_deadline=True, **RULE)
    assert enough(rounds(6, STEADY, NOISY, STEADY), past_deadline=True, **RULE)


def test_it_wants_min_reps_when_settled_and_three_runs_past_the_deadline():
    assert not enough(rounds(2, STEADY, STEADY), past_deadline=False, **RULE)
    assert not enough(rounds(2, STEADY, STEADY), past_deadline=True, **RULE)
    assert enough(rounds(4, STEADY, NOISY), past_deadline=True, **RULE)
    assert not enough(rounds(4, STEADY, STEADY), past_deadline=False, **RULE)


def test_max_reps_ends_it_whatever_the_turn():
    assert enough(rounds(7, NOISY * 2, NOISY * 2, NOISY * 2), past_deadline=False, target_rel_se=0.005,
                  min_reps=5, max_reps=7)
