"""When a round closes: a pure function of the clock, the round and the live learners.

Close at once when every live learner has contributed. Otherwise, once at least K have
contributed (K capped at the number of live learners: a dead learner leaves the quorum
arithmetic), wait an adaptive grace window

    grace = clamp(γ · (τ·step_time − quorum_time − sync_time), 0, grace_max)

counted from the moment the quorum was reached: it spends only the slack that the learners'
τ-step overlap already hides. `decide` returns the decision and a reason string that goes
straight into the log and the round record.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundPolicy:
    """Quorum K, grace factor γ, grace cap (s) and the overlap τ (inner steps)."""

    quorum: int = 1
    grace_gamma: float = 0.5
    grace_max_s: float = 30.0
    overlap_steps: int = 2
    elastic: bool = True  # K capped by the live learners (False: synchronous, wait for all K)


@dataclass(frozen=True)
class RoundView:
    """What the policy needs to know about the open round."""

    contributors: frozenset[str] = frozenset()
    first_arrival_s: float | None = None
    quorum_reached_s: float | None = None  # when the K-th distinct contributor arrived


@dataclass(frozen=True)
class Decision:
    close: bool
    reason: str
    wait_until_s: float | None = None  # when to decide again (grace deadline), if known
    grace_s: float = 0.0


def grace_window_s(policy: RoundPolicy, step_time_s: float, quorum_time_s: float,
                   sync_time_s: float) -> float:
    """clamp(γ·(τ·step_time − quorum_time − sync_time), 0, grace_max)."""
    slack = policy.overlap_steps * step_time_s - quorum_time_s - sync_time_s
    return min(max(policy.grace_gamma * slack, 0.0), policy.grace_max_s)


def effective_quorum(policy: RoundPolicy, live: frozenset[str]) -> int:
    if not policy.elastic:
        return policy.quorum
    return max(1, min(policy.quorum, len(live))) if live else policy.quorum


def decide(now_s: float, view: RoundView, live: frozenset[str], policy: RoundPolicy,
           step_time_s: float, sync_time_s: float) -> Decision:
    """Should the open round close now?"""
    n = len(view.contributors)
    if n == 0:
        return Decision(False, "no contributions yet")
    k = effective_quorum(policy, live)
    if live and live <= view.contributors and (policy.elastic or n >= k):
        return Decision(True, f"all {len(live)} live learners contributed")
    if n < k or view.quorum_reached_s is None:
        return Decision(False, f"waiting for quorum: {n}/{k} contributions")
    first = view.first_arrival_s if view.first_arrival_s is not None else view.quorum_reached_s
    quorum_time = view.quorum_reached_s - first
    grace = grace_window_s(policy, step_time_s, quorum_time, sync_time_s)
    deadline = view.quorum_reached_s + grace
    missing = len(live - view.contributors)
    if now_s >= deadline:
        if grace <= 0:
            return Decision(True, f"quorum {n}/{k} reached, no grace window; "
                                  f"{missing} live learner(s) left for next round", grace_s=0.0)
        return Decision(True, f"grace window of {grace * 1000:.0f} ms over with {n} "
                              f"contribution(s); {missing} live learner(s) left for next round",
                        grace_s=grace)
    return Decision(False, f"quorum {n}/{k} reached, in grace window until "
                           f"{deadline:.3f} s ({missing} live learner(s) missing)",
                    wait_until_s=deadline, grace_s=grace)
