"""The poison guard: what a contribution may claim and how large it may be.

Two bounds, both on by default (``sync.guard``):

* **tokens** — a contribution of ``steps`` inner steps may claim at most ``steps ×`` its
  learner's maximum tokens per step (the run's tokens per step, or what the learner declared
  when it joined: islands and library learners may differ). The merge weighs contributions by
  tokens² / steps, so an inflated count would buy an arbitrary weight.
* **norm** — a contribution whose ‖δ‖ per inner step exceeds ``k ×`` the median of the
  fragment's recently accepted ones (``sync.guard_norm_k``, default 10) is dropped, or clipped
  to that bound (``sync.guard_action``). Per step, so long or late pushes are not penalised.
  The median is taken over the last `WINDOW` accepted contributions once `MIN_HISTORY` have
  been accepted. Before that — the first rounds, when a poisoned learner present from the
  start would otherwise go unjudged — the bound per step is the prior
  ``sync.guard_prior × inner.lr × √n`` for a fragment of n values: an AdamW step moves each
  coordinate by at most a few learning rates (`prior_step_norm`).

The guard is part of the fragment's state (its recent norms survive a syncer restart) and of
replay: replay offers the merged entries in order, so it rebuilds the same history and reaches
the same decisions. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping

from pipeline.config import RunConfig

WINDOW = 64
MIN_HISTORY = 8


def prior_step_norm(guard_prior: float, lr: float, n_values: int) -> float | None:
    """The norm bound per inner step before a fragment has a history (None: no prior)."""
    if guard_prior <= 0 or n_values <= 0:
        return None
    return guard_prior * lr * math.sqrt(n_values)


def fragment_prior(cfg: RunConfig, shapes: Mapping[str, tuple[int, ...]]) -> float | None:
    """`prior_step_norm` of a fragment of these tensors under a run's configuration."""
    n = sum(math.prod(s) for s in shapes.values())
    return prior_step_norm(cfg.sync.guard_prior, cfg.inner.lr, n)


class NormGuard:
    """The recent accepted norms per inner step of one fragment, and the bound they imply.

    Args:
        k: The bound is k × the median of the recent norms per step.
        prior: The bound per step before `MIN_HISTORY` norms are known (None: none).
        history: Norms per step to start from (a restored state), oldest first.
    """

    def __init__(self, k: float, prior: float | None = None, history: Iterable[float] = ()):
        self.k = k
        self.prior = prior
        self.recent: deque[float] = deque(history, maxlen=WINDOW)

    def bound(self, steps: int) -> float | None:
        """The largest ‖δ‖ a contribution of `steps` inner steps may have (None: no bound
        yet: fewer than `MIN_HISTORY` accepted and no prior)."""
        if len(self.recent) < MIN_HISTORY:
            return None if self.prior is None else self.prior * steps
        return self.k * statistics.median(self.recent) * steps

    def describe(self) -> str:
        """What the bound is made of (for a drop's reason)."""
        if len(self.recent) < MIN_HISTORY:
            return f"the prior bound {self.prior:.4g} per step"
        return f"{self.k:g} × the recent median {statistics.median(self.recent):.4g}"

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
