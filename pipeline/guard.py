"""The poison guard: what a contribution may claim and how large it may be.

Two bounds, both on by default (``sync.guard``):

* **tokens** — a contribution of ``steps`` inner steps may claim at most ``steps ×`` its
  learner's maximum tokens per step (the run's tokens per step, or what the learner declared
  when it joined: islands and library learners may differ). The merge weighs contributions by
  tokens² / steps, so an inflated count would buy an arbitrary weight.
* **norm** — a contribution whose ‖δ‖ per inner step exceeds ``k ×`` the median of the
  fragment's recently accepted ones (``sync.guard_norm_k``, default 10) is dropped, or clipped
  to that bound (``sync.guard_action``). Per step, so long or late pushes are not penalised.
  The median is taken over the last `WINDOW` accepted contributions and applies only once
  `MIN_HISTORY` have been accepted: the first rounds of a run are not judged.

The guard is part of the fragment's state (its recent norms survive a syncer restart) and of
replay: replay offers the merged entries in order, so it rebuilds the same history and reaches
the same decisions. Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable

WINDOW = 64
MIN_HISTORY = 8


class NormGuard:
    """The recent accepted norms per inner step of one fragment, and the bound they imply.

    Args:
        k: The bound is k × the median of the recent norms per step.
        history: Norms per step to start from (a restored state), oldest first.
    """

    def __init__(self, k: float, history: Iterable[float] = ()):
        self.k = k
        self.recent: deque[float] = deque(history, maxlen=WINDOW)

    def bound(self, steps: int) -> float | None:
        """The largest ‖δ‖ a contribution of `steps` inner steps may have (None: no bound
        yet, fewer than `MIN_HISTORY` accepted)."""
        if len(self.recent) < MIN_HISTORY:
            return None
        return self.k * statistics.median(self.recent) * steps

    def median(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None

    def accepted(self, norm: float, steps: int, bound: float | None) -> None:
        """Record an accepted contribution's ‖δ‖ (clipped to `bound` when it was clipped)."""
        if bound is not None:
            norm = min(norm, bound)
        self.recent.append(norm / max(steps, 1))


def token_bound(steps: int, max_tokens_per_step: int | None) -> int | None:
    """The most tokens `steps` steps can have trained on (None: no bound known)."""
    if not max_tokens_per_step or max_tokens_per_step <= 0:
        return None
    return steps * max_tokens_per_step
