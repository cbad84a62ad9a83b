"""The timing loop's stopping rule (grader/timing.py's `enough`): whole turns only, every candidate's
median settled (its 95% interval from the order statistics within 1%), or the budget spent; and its
rounds' order (`round_order`)."""
import collections
import random

from grader.timing import enough, median_interval, median_settled, round_order

STEADY, NOISY = [1.0] * 12, [1.0, 2.0] * 6  # 12 rounds: every time alike; half of them twice as long
# Mostly 1.0 within 0.2%, with every fifth run a slow outlier: the mean's standard error stays near 10%,
# the median settles.
TAILED = [1.0 + 0.002 * (i % 3) if i % 5 else 3.0 for i in range(30)]
RULE = dict(target_rel=0.01, max_reps=500)


def rounds(n, *series):
    return {f"c{i}": list(s[:n]) for i, s in enumerate(series)}


def test_the_medians_interval_needs_eight_times_and_holds_the_median():
    assert median_interval([1.0] * 7) is None
    times = [random.Random(seed).gauss(1.0, 0.1) for seed in range(101)]
    low, high = median_interval(times)
    assert low < sorted(times)[50] < high and high - low < 0.1


def test_a_few_slow_outliers_do_not_unsettle_the_median():
    assert median_settled(TAILED, 0.01) and not median_settled(NOISY, 0.01)


def test_it_stops_once_every_candidate_has_settled_after_a_whole_turn():
    assert enough(rounds(9, STEADY, STEADY, STEADY), past_deadline=False, **RULE)
    assert enough(rounds(30, TAILED, TAILED, STEADY), past_deadline=False, **RULE)


def test_a_settled_candidate_does_not_end_the_loop_for_a_noisy_one():
    assert not enough(rounds(12, STEADY, NOISY, STEADY), past_deadline=False, **RULE)


def test_it_never_stops_between_turns_even_past_the_deadline():
    assert not enough(rounds(10, STEADY, STEADY, STEADY), past_deadline=True, **RULE)
    assert enough(rounds(6, STEADY, NOISY, STEADY), past_deadline=True, **RULE)


def test_too_few_runs_to_settle_and_three_past_the_deadline():
    assert not enough(rounds(6, STEADY, STEADY), past_deadline=False, **RULE)
    assert not enough(rounds(2, STEADY, STEADY), past_deadline=True, **RULE)
    assert enough(rounds(4, STEADY, NOISY), past_deadline=True, **RULE)


def test_max_reps_ends_it_whatever_the_turn():
    assert enough(rounds(7, NOISY, NOISY, NOISY), past_deadline=False, target_rel=0.01, max_reps=7)


def test_each_candidate_goes_first_in_turn_and_follows_every_other_about_equally_often():
    names, shuffles = [f"c{i}" for i in range(5)], random.Random(0)
    orders = [round_order(names, r, shuffles) for r in range(200)]
    assert all(sorted(order) == names for order in orders)
    assert [order[0] for order in orders[:10]] == names[1:] + names + names[:1]  # a whole turn: each first once
    follows = collections.Counter((order[i - 1], order[i]) for order in orders for i in range(1, len(order)))
    assert len(follows) == 20 and min(follows.values()) > 0.6 * max(follows.values())  # every ordered pair
