"""Tests of pipeline.policy: every branch of `decide` on a hand-driven clock, grace windows."""

from __future__ import annotations

import pytest

from pipeline.policy import (
    Decision,
    RoundPolicy,
    RoundView,
    decide,
    effective_quorum,
    grace_window_s,
)

LIVE3 = frozenset({"a", "b", "c"})


def view(contributors, first=None, quorum=None) -> RoundView:
    return RoundView(frozenset(contributors), first, quorum)


# -- grace_window_s -------------------------------------------------------------------------------


def test_grace_window_hand_value():
    # γ = 0.5, τ = 2, step 1.0 s, quorum_time 0.2 s, sync 0.3 s:
    # slack = 2·1.0 − 0.2 − 0.3 = 1.5 s; grace = 0.5·1.5 = 0.75 s (< grace_max 30)
    p = RoundPolicy(quorum=2, grace_gamma=0.5, grace_max_s=30.0, overlap_steps=2)
    assert grace_window_s(p, 1.0, 0.2, 0.3) == pytest.approx(0.75, rel=1e-12)


def test_grace_window_clamped_at_grace_max():
    # γ = 2, τ = 4, step 1 s, no quorum/sync time: 2·4 = 8 s, clamped to grace_max 3 s
    p = RoundPolicy(quorum=1, grace_gamma=2.0, grace_max_s=3.0, overlap_steps=4)
    assert grace_window_s(p, 1.0, 0.0, 0.0) == 3.0


def test_grace_window_clamped_at_zero_on_negative_slack():
    # τ = 1, step 0.1 s, quorum_time 0.5 s, sync 0.2 s: slack = 0.1 − 0.7 = −0.6 -> 0
    p = RoundPolicy(quorum=1, grace_gamma=0.5, grace_max_s=30.0, overlap_steps=1)
    assert grace_window_s(p, 0.1, 0.5, 0.2) == 0.0


def test_grace_window_zero_overlap_gives_zero():
    p = RoundPolicy(quorum=1, grace_gamma=0.5, grace_max_s=30.0, overlap_steps=0)
    assert grace_window_s(p, 1.0, 0.0, 0.0) == 0.0


# -- effective_quorum -----------------------------------------------------------------------------


def test_effective_quorum():
    p = RoundPolicy(quorum=3)
    assert effective_quorum(p, LIVE3) == 3
    assert effective_quorum(p, frozenset({"a", "b"})) == 2  # capped by live learners
    assert effective_quorum(p, frozenset({"a"})) == 1
    assert effective_quorum(p, frozenset()) == 3  # nobody known live: configured K
    assert effective_quorum(RoundPolicy(quorum=1), LIVE3) == 1


# -- decide ---------------------------------------------------------------------------------------


def test_no_contributions():
    d = decide(10.0, RoundView(), LIVE3, RoundPolicy(quorum=1), 1.0, 0.0)
    assert d == Decision(False, "no contributions yet")
    assert d.wait_until_s is None and d.grace_s == 0.0


def test_all_live_contributed_closes_at_once():
    # K = 3 reached at 5.0 with a long grace window, but nobody is left to wait for.
    p = RoundPolicy(quorum=3, grace_gamma=1.0, grace_max_s=30.0, overlap_steps=10)
    d = decide(5.0, view("abc", 4.0, 5.0), LIVE3, p, 1.0, 0.0)
    assert d.close
    assert "all 3 live learners contributed" in d.reason


def test_all_live_contributed_closes_even_below_configured_quorum():
    # K = 3 but only a and b are alive and both contributed
    p = RoundPolicy(quorum=3, grace_gamma=1.0, grace_max_s=30.0, overlap_steps=10)
    d = decide(5.0, view("ab", 4.0, None), frozenset("ab"), p, 1.0, 0.0)
    assert d.close
    assert "all 2 live learners contributed" in d.reason


def test_below_quorum_waits():
    p = RoundPolicy(quorum=2, grace_gamma=0.5, grace_max_s=30.0, overlap_steps=2)
    d = decide(100.0, view("a", 1.0, None), LIVE3, p, 1.0, 0.0)
    assert not d.close
    assert d.wait_until_s is None  # no deadline: wait for the next contribution
    assert "waiting for quorum" in d.reason and "1/2" in d.reason


def test_quorum_count_but_quorum_time_unknown_waits():
    # n >= K but quorum_reached_s was never set: still waiting
    p = RoundPolicy(quorum=2)
    d = decide(100.0, view("ab", 1.0, None), LIVE3, p, 1.0, 0.0)
    assert not d.close
    assert "waiting for quorum: 2/2" in d.reason


def _grace_case():
    # K = 2 of 3 live; first arrival 10.0, quorum at 10.2 -> quorum_time 0.2 s;
    # γ = 0.5, τ = 2, step 1.0 s, sync 0.3 s -> grace = 0.5·(2 − 0.2 − 0.3) = 0.75 s;
    # deadline = 10.2 + 0.75 = 10.95 s
    p = RoundPolicy(quorum=2, grace_gamma=0.5, grace_max_s=30.0, overlap_steps=2)
    return p, view("ab", 10.0, 10.2)


def test_quorum_reached_in_grace_window_waits_until_deadline():
    p, v = _grace_case()
    for now in (10.2, 10.5, 10.949):
        d = decide(now, v, LIVE3, p, 1.0, 0.3)
        assert not d.close
        assert d.wait_until_s == pytest.approx(10.95, abs=1e-12)
        assert d.grace_s == pytest.approx(0.75, abs=1e-12)
        assert "quorum 2/2 reached" in d.reason
        assert "grace window until 10.950 s" in d.reason
        assert "1 live learner(s) missing" in d.reason


def test_grace_over_closes():
    p, v = _grace_case()
    for now in (10.95, 11.0, 50.0):
        d = decide(now, v, LIVE3, p, 1.0, 0.3)
        assert d.close
        assert d.grace_s == pytest.approx(0.75, abs=1e-12)
        assert d.wait_until_s is None
        assert "grace window of 750 ms over with 2 contribution(s)" in d.reason
        assert "1 live learner(s) left for next round" in d.reason


def test_grace_max_zero_closes_at_quorum():
    p = RoundPolicy(quorum=2, grace_gamma=0.5, grace_max_s=0.0, overlap_steps=2)
    d = decide(10.2, view("ab", 10.0, 10.2), LIVE3, p, 1.0, 0.3)
    assert d.close
    assert d.grace_s == 0.0
    assert "quorum 2/2 reached, no grace window" in d.reason
    assert "1 live learner(s) left for next round" in d.reason


def test_grace_clamped_at_grace_max_in_decide():
    # γ = 1, τ = 10, step 1 s: unclamped 10 − 0 − 0 = 10 s, clamped to 2 s;
    # quorum at 5.0 -> deadline 7.0
    p = RoundPolicy(quorum=1, grace_gamma=1.0, grace_max_s=2.0, overlap_steps=10)
    v = view("a", 5.0, 5.0)
    d = decide(6.0, v, LIVE3, p, 1.0, 0.0)
    assert not d.close and d.wait_until_s == 7.0 and d.grace_s == 2.0
    d = decide(7.0, v, LIVE3, p, 1.0, 0.0)
    assert d.close and d.grace_s == 2.0 and "2000 ms" in d.reason


def test_negative_slack_closes_at_quorum():
    # quorum took 3 s (first 1.0, quorum 4.0) but τ·step = 2·1.0 = 2 s: slack = 2 − 3 − 0 < 0
    # -> grace clamped to 0: close as soon as the quorum is there
    p = RoundPolicy(quorum=2, grace_gamma=0.5, grace_max_s=30.0, overlap_steps=2)
    d = decide(4.0, view("ab", 1.0, 4.0), LIVE3, p, 1.0, 0.0)
    assert d.close and d.grace_s == 0.0
    assert "no grace window" in d.reason


def test_dead_learner_leaves_quorum_arithmetic():
    p = RoundPolicy(quorum=3, grace_gamma=0.5, grace_max_s=30.0, overlap_steps=2)
    # all three alive, a and b contributed: 2 < K = 3 -> wait
    d = decide(10.0, view("ab", 9.0, None), LIVE3, p, 1.0, 0.0)
    assert not d.close and "2/3" in d.reason
    # c died: live = {a, b} ⊆ contributors -> close
    d = decide(10.0, view("ab", 9.0, None), frozenset("ab"), p, 1.0, 0.0)
    assert d.close
    # a and a now-dead learner x contributed; live = {a, b}: K = min(3, 2) = 2 reached at 9.5,
    # quorum_time 0.5, grace = 0.5·(2·1.0 − 0.5 − 0) = 0.75 -> deadline 10.25
    live = frozenset("ab")
    d = decide(10.0, view("ax", 9.0, 9.5), live, p, 1.0, 0.0)
    assert not d.close and "quorum 2/2" in d.reason
    assert d.wait_until_s == pytest.approx(10.25, abs=1e-12)
    d = decide(10.25, view("ax", 9.0, 9.5), live, p, 1.0, 0.0)
    assert d.close


def test_empty_live_set_uses_configured_quorum():
    # nobody known live (e.g. all heartbeats lost): K stays 2
    p = RoundPolicy(quorum=2, grace_gamma=0.5, grace_max_s=0.0, overlap_steps=2)
    d = decide(1.0, view("a", 1.0, 1.0), frozenset(), p, 1.0, 0.0)
    assert not d.close and "1/2" in d.reason
    d = decide(1.0, view("ab", 1.0, 1.0), frozenset(), p, 1.0, 0.0)
    assert d.close


def test_reasons_are_non_empty_and_informative():
    p, v = _grace_case()
    cases = [
        decide(0.0, RoundView(), LIVE3, p, 1.0, 0.3),
        decide(0.0, view("a", 0.5, None), LIVE3, p, 1.0, 0.3),
        decide(10.5, v, LIVE3, p, 1.0, 0.3),
        decide(11.0, v, LIVE3, p, 1.0, 0.3),
        decide(11.0, view("abc", 10.0, 10.2), LIVE3, p, 1.0, 0.3),
        decide(11.0, v, LIVE3, RoundPolicy(quorum=2, grace_max_s=0.0), 1.0, 0.3),
    ]
    reasons = [d.reason for d in cases]
    assert all(isinstance(r, str) and len(r) > 10 for r in reasons)
    assert len(set(reasons)) == len(reasons)  # every branch says something different


def test_first_arrival_at_time_zero():
    # BUG (pipeline/policy.py, decide: `view.first_arrival_s or view.quorum_reached_s`): a first
    # arrival at t = 0.0 is falsy, so quorum_time is taken as 0 instead of 0.2 − 0.0 = 0.2.
    # Expected grace = 0.5·(2·1.0 − 0.2 − 0.3) = 0.75 s, deadline 0.95 s -> at now = 1.0 the
    # round closes. Actual: grace = 0.5·(2 − 0 − 0.3) = 0.85 s, deadline 1.05 s -> keeps waiting.
    p = RoundPolicy(quorum=2, grace_gamma=0.5, grace_max_s=30.0, overlap_steps=2)
    d = decide(1.0, view("ab", 0.0, 0.2), LIVE3, p, 1.0, 0.3)
    assert d.grace_s == pytest.approx(0.75, abs=1e-12)
    assert d.close


def test_synchronous_quorum_waits_for_dead_learners():
    """elastic=False (the sync-diloco baseline): K is not capped by the live learners."""
    from pipeline.policy import RoundPolicy, RoundView, decide

    pol = RoundPolicy(quorum=3, grace_gamma=0.5, grace_max_s=0.0, overlap_steps=0,
                      elastic=False)
    live = frozenset({"a", "b"})  # "c" is dead
    view = RoundView(frozenset({"a", "b"}), 0.0, None)
    d = decide(10.0, view, live, pol, step_time_s=1.0, sync_time_s=0.0)
    assert not d.close and "2/3" in d.reason
    full = RoundView(frozenset({"a", "b", "c"}), 0.0, 5.0)
    assert decide(10.0, full, live, pol, 1.0, 0.0).close
    elastic = RoundPolicy(quorum=3, grace_max_s=0.0, overlap_steps=0)
    assert decide(10.0, view, live, elastic, 1.0, 0.0).close
