"""The learner's state machine: what to push after a step, when to apply a merged value.

Per fragment p the learner keeps the base value it last received Θ̃_p (at base_version[p]),
step and token counters since then, the contribution in flight, and a received value waiting
to be applied. After each inner step `after_step` returns the pushes that are due; `on_global`
takes a merged value, which is applied τ steps after the push (or at once if it arrives later).
No I/O and no clock: the in-process engine and ``workers/learner.py`` drive it.

A push is superseded when its merged value has not arrived H steps later: the next push of
the fragment goes out anyway. If the old push was merged meanwhile, the learner first rebases
onto the version that merge produced, so the new push carries only the progress not merged
yet — in δ, in its steps and in its tokens — never the merged part twice. The core asks, and
never reads anything itself (`pipeline.learner_questions`): the question goes out, the push
waits, and the driver's answer (from the syncer's merge records, read off the training thread)
lets it go at the next step (`resume` at once, for a driver that answers at once). A driver
that cannot tell now (its broker is unreachable) answers `DEFER`: the push waits for the
fragment's next turn.

Under ``apply = "rebase"`` a value is applied according to what it holds of this learner's
pushes (`on_global`'s `merged`, which the driver reads from the merge records as the value
arrives): the push in flight (keep the progress since the push), an older push that it
superseded, or none (a round that closed before the push arrived: keep all the progress the
value lacks, and leave the push in flight for its own round's value).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from pipeline import quant
from pipeline.config import SyncConfig
from pipeline.contribution import MergeRecord, Push
from pipeline.fragments import due_fragment
from pipeline.learner_questions import DEFER, MergeQuestions
from pipeline.model import Params

# `on_global`'s `merged` when the driver cannot tell which of this learner's pushes a value
# holds (its broker is unreachable, a value restored from a checkpoint): the "rebase" rule
# then takes the value as holding the push in flight
UNKNOWN = "unknown"


class MergedValue(NamedTuple):
    """A merged value on its way to the training loop (the network thread's inbox, then the
    core's pending value of its fragment): the fragment, its version, its fp32 values, and
    this learner's last push of the fragment that a round merged as of that version (None:
    none; `UNKNOWN`: the driver cannot tell)."""

    fragment: int
    version: int
    value: dict[str, np.ndarray]
    merged: MergeRecord | str | None = UNKNOWN


def _fp32(names: list[str], value: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: np.asarray(value[n], np.float32) for n in names}


def _seconds(v) -> float:
    """A checkpoint's count of learner-seconds: finite and not negative."""
    x = float(v)
    if not np.isfinite(x) or x < 0:
        raise ValueError(f"checkpoint holds {x!r} learner-seconds")
    return x


def _chain(v, step: int) -> int | None:
    """A checkpoint's chain of a push in flight at `step`: None or an int in [0, step]."""
    if v is None:
        return None
    if type(v) is not int or not 0 <= v <= step:
        raise ValueError(f"checkpoint's push in flight at step {step} has chain {v!r}")
    return v


@dataclass
class _InFlight:
    step: int
    base_version: int
    theta_at_push: dict[str, np.ndarray] | None  # kept only for the "rebase" apply rule
    steps_at_push: int = 0
    tokens_at_push: int = 0
    # δ as pushed (quantised, or decoded after a restore): a superseding push that finds this
    # one merged rebases onto base − δ (`rebase_merged`); None in checkpoints that lack it
    pushed: Mapping[str, quant.QTensor | np.ndarray] | None = None
    # up-link error feedback: the residual this push carried in (δ + carried was quantised);
    # a push that turns out not merged gives it back (`LearnerCore.residual`)
    carried: dict[str, np.ndarray] | None = None
    seconds_at_push: float = 0.0  # the learner-seconds of work the push carried
    # a push taken up again at a restore (`LearnerCore.resume_pushed`): the step it was sent
    # at, when `step` is the restore's (so that its merged value applies τ steps after it)
    sent_step: int | None = None
    # the step of the first push of its chain (`Push.chain`): a push superseding this one
    # while it is not known to be merged carries its progress and continues the chain
    chain: int | None = None

    @property
    def key(self) -> tuple[int, int]:
        """(base_version, step) as the push was sent: what merge and refusal records name."""
        return self.base_version, self.step if self.sent_step is None else self.sent_step

    @property
    def chain_step(self) -> int:
        """The step of its chain's first push (its own when it began a chain; for a push taken
        up at a restore, the restore's step: a new process's pushes are never netted against
        an older one's, and a chain must not begin after the pushes that continue it)."""
        return self.step if self.chain is None else self.chain

    def pushed_values(self) -> dict[str, np.ndarray]:
        assert self.pushed is not None
        return {n: v if isinstance(v, np.ndarray) else quant.dequantize(v)
                for n, v in self.pushed.items()}


class LearnerCore:
    """Sync bookkeeping of one learner around its parameters.

    Args:
        learner_id: the learner's name.
        fragments: tensor names of each fragment.
        sync_cfg: the (effective) sync policy.
        base: the global value of every tensor the learner starts from (already decoded).
        base_versions: the version of each fragment's base.
    """

    def __init__(self, learner_id: str, fragments: list[list[str]], sync_cfg: SyncConfig,
                 base: Mapping[str, np.ndarray], base_versions: list[int]):
        self.id = learner_id
        self.fragments = fragments
        self.cfg = sync_cfg
        P = len(fragments)
        self.base = [{n: np.asarray(base[n], np.float32) for n in f} for f in fragments]
        self.base_version = list(base_versions)
        self.steps = [0] * P
        self.tokens = [0] * P
        # learner-seconds of work in each fragment's progress (counted like tokens: the push
        # carries them; a merged value that keeps the progress since the push keeps only its
        # seconds, one that overwrites it drops them with it)
        self.seconds = [0.0] * P
        self.inflight: list[_InFlight | None] = [None] * P
        # per fragment, the merged value taken and not applied yet, with what the driver knew
        # of it: the last push of this learner merged up to it (`on_global`'s `merged`)
        self.pending: list[MergedValue | None] = [None] * P
        self.applied = 0
        self.questions = MergeQuestions()  # the driver takes them and answers
        self.rebased_merged = 0  # superseding pushes that found their predecessor merged
        # per fragment, the chain a forgotten push (`forget_push`) leaves to the next push: its
        # progress, possibly part merged by the chain's earlier pushes, goes out again in it
        self.chain_next: list[int | None] = [None] * P
        # up-link error feedback (sync.up_feedback): per fragment, the part of the pushes'
        # δ + e that their quantisation dropped (None: zero); it goes out with the next push
        self.residual: list[dict[str, np.ndarray] | None] = [None] * P

    def after_step(self, step: int, tokens: int, params: Params,
                   seconds: float = 0.0) -> tuple[Params, list[Push]]:
        """Count the step (`seconds`: the learner's time for it), apply merged values that are
        due, return the pushes that are due."""
        for p in range(len(self.fragments)):
            self.steps[p] += 1
            self.tokens[p] += tokens
            self.seconds[p] += seconds
        params = self.apply_due(step, params)
        due = due_fragment(step, self.cfg.delta_h, len(self.fragments))
        return self.resume(step, params, due)

    def resume(self, step: int, params: Params,
               due: int | None = None) -> tuple[Params, list[Push]]:
        """The pushes of fragment `due`'s turn and of those that waited for answers (a driver
        that answers at once calls this in the step it answered; otherwise the next
        `after_step` takes them up)."""
        pushes = []
        for p in sorted(self.questions.waiting | ({due} if due is not None else set())):
            params, push = self._turn(p, step, params)
            if push is not None:
                pushes.append(push)
        return params, pushes

    def _turn(self, p: int, step: int, params: Params) -> tuple[Params, Push | None]:
        """Fragment p's turn to push: over a push in flight whose value is H steps late, only
        once the driver has said whether a round merged it."""
        f = self.inflight[p]
        if not (f is not None and self._superseding(p, step) and f.pushed is not None
                and self.questions.on and self.pending[p] is None):
            self.questions.drop(p)
        else:
            answered, found = self.questions.answered(p, f.key)
            if not answered:
                return params, None
            if found == DEFER:
                return params, None
            if found is not None and found[0] > self.base_version[p]:
                params = self.rebase_merged(p, found[0], found[1], params)
                self.questions.used.append((p, found[0], found[1]))
            elif found is None:
                # not merged: the new δ holds the old one whole, so the residual it
                # carried in is what the rounds have still not seen
                self.residual[p] = f.carried
        return params, self._maybe_push(p, step, params)

    def push_all(self, step: int, params: Params) -> list[Push]:
        """Final flush: push every fragment that has progress and nothing in flight."""
        out = []
        for p in range(len(self.fragments)):
            if self.inflight[p] is None and self.steps[p] > 0:
                out.append(self._push(p, step, params))
        return out

    def _superseding(self, p: int, step: int) -> bool:
        """Is a push of p due over one in flight whose merged value is H steps late?"""
        f = self.inflight[p]
        return f is not None and step - f.step > self.cfg.sync_every and self.steps[p] > 0

    def rebase_merged(self, p: int, version: int, value: Mapping[str, np.ndarray],
                      params: Params) -> Params:
        """The push in flight of fragment p was merged into `version` (`value`: that version's
        value or a later one's) though the value never arrived: rebase onto it keeping only the
        progress made since the push, θ ← value + (θ − (base − δ_pushed)), and count only the
        steps and tokens since the push. The next push then carries just that progress (and
        the quantisation error of the merged push, which the round never saw)."""
        f = self.inflight[p]
        assert f is not None and f.pushed is not None
        pushed = f.pushed_values()
        self.base[p] = {n: self.base[p][n] - pushed[n] for n in self.fragments[p]}
        # base − θ now holds the merged push's quantisation error (δ + carried − pushed) less
        # the residual it carried in: carrying that in again sends exactly the error. A push
        # taken up at a restore holds no error here (its δ is exact) and the real push already
        # carried the residual into a round: nothing to carry
        self.residual[p] = f.carried if f.sent_step is None else None
        self._count_since(p, f)
        self.inflight[p] = None
        self.pending[p] = MergedValue(p, version, _fp32(self.fragments[p], value),
                                      MergeRecord(*f.key, version))
        self.rebased_merged += 1
        return self._apply(p, params)

    def _maybe_push(self, p: int, step: int, params: Params) -> Push | None:
        f = self.inflight[p]
        if f is not None and step - f.step <= self.cfg.sync_every:
            return None  # still waiting for the merged value of the last push
        if self.steps[p] == 0:
            return None
        return self._push(p, step, params)

    def _push(self, p: int, step: int, params: Params) -> Push:
        # copies: the push keeps θ, and a training step may reuse (donate) the buffers of
        # `params`
        theta = {n: np.array(params[n], np.float32) for n in self.fragments[p]}
        delta = {n: self.base[p][n] - theta[n] for n in self.fragments[p]}
        carried = None
        feedback = self.cfg.up_feedback and self.cfg.codec_up != "fp32"  # fp32 has no error
        if feedback:
            carried = self.residual[p]
            if carried is not None:
                delta = {n: delta[n] + carried[n] for n in self.fragments[p]}
        payload = {n: quant.quantize(delta[n], self.cfg.codec_up, self.cfg.quant_block)
                   for n in self.fragments[p]}
        if feedback:
            self.residual[p] = {n: delta[n] - quant.dequantize(payload[n])
                                for n in self.fragments[p]}
        keep = theta if self.cfg.apply == "rebase" else None
        # a push in flight here is superseded and not known to be merged (one found merged
        # was rebased past): this push holds its progress too, so it continues its chain
        before = self.inflight[p]
        chain = before.chain_step if before is not None else (
            step if self.chain_next[p] is None else self.chain_next[p])
        self.chain_next[p] = None
        self.inflight[p] = _InFlight(step, self.base_version[p], keep, self.steps[p],
                                     self.tokens[p], payload, carried,
                                     seconds_at_push=self.seconds[p], chain=chain)
        return Push(self.id, p, self.base_version[p], step, self.steps[p], self.tokens[p],
                    self.seconds[p], chain, payload=payload)

    def on_global(self, p: int, version: int, value: Mapping[str, np.ndarray],
                  merged: MergeRecord | str | None = UNKNOWN) -> bool:
        """Take a merged value of fragment p; False if it is not newer than what we have.

        `merged` (read by the driver when the value arrived, used by the "rebase" rule): the
        last push of this learner to p that a round merged, as (base_version, step, version),
        None if none was, `UNKNOWN` if the driver cannot tell. A value older than that
        round's is dropped: the round's own value is on its way, and only it holds the push.
        """
        if not (merged is None or isinstance(merged, MergeRecord) or merged == UNKNOWN):
            raise TypeError(f"merged must be a MergeRecord, None or UNKNOWN, got {merged!r}")
        newest = self.pending[p].version if self.pending[p] else self.base_version[p]
        if version <= newest:
            return False
        if (self.cfg.apply == "rebase" and isinstance(merged, MergeRecord)
                and merged.version > version):
            return False
        self.pending[p] = MergedValue(p, version, _fp32(self.fragments[p], value), merged)
        return True

    def apply_at(self, p: int) -> int | None:
        """Step at which fragment p's pending value is applied (None: nothing pending)."""
        if self.pending[p] is None:
            return None
        f = self.inflight[p]
        if f is not None:
            return f.step + self.cfg.overlap_steps
        return 0  # nothing in flight: rebase onto it at once (see `_apply`)

    def blocked(self, step: int) -> bool:
        """Strict/sync modes: must the learner wait for a merged value before `step + 1`?"""
        if not self.cfg.strict:
            return False
        for p, f in enumerate(self.inflight):
            due = f is not None and step >= f.step + self.cfg.overlap_steps
            if due and self.pending[p] is None:
                return True
        return False

    def apply_due(self, step: int, params: Params) -> Params:
        """Apply every pending merged value whose time has come."""
        for p in range(len(self.fragments)):
            at = self.apply_at(p)
            if at is not None and step >= at:
                params = self._apply(p, params)
        return params

    def _apply(self, p: int, params: Params) -> Params:
        _, version, value, _ = self.pending[p]
        f = self.inflight[p]
        a = self.cfg.mix_alpha
        if f is None:
            # A round this learner had no part in: move onto the new global value but keep the
            # local progress since the old base, θ ← Θ_new + (θ − base). δ = base − θ is
            # unchanged and now anchored at the new version, so the next push is fresh (not
            # stale) and no inner step is thrown away.
            params = self._moved(p, params, value, self.base[p])
            self._take(p, version, value)
            return params
        rebase = self.cfg.apply == "rebase" and f.theta_at_push is not None
        if rebase:
            held = self._holds(p, f)
            if held != "push":
                return self._apply_without(p, f, params, held == "older")
            params = self._moved(p, params, value, f.theta_at_push)
        else:
            params = dict(params)
            for n in self.fragments[p]:
                new = a * np.asarray(params[n]) + (1 - a) * value[n] if a > 0 else value[n]
                params[n] = jnp.asarray(new, jnp.float32)
        if self.cfg.apply == "rebase":
            # the progress made since the push is kept on top of the new base: count it
            self._count_since(p, f)
        else:
            self._count_none(p)
        self.inflight[p] = None
        self._take(p, version, value)
        return params

    def _moved(self, p: int, params: Params, value: Mapping[str, np.ndarray],
               anchor: Mapping[str, np.ndarray]) -> Params:
        """Fragment p moved onto `value` keeping the progress since `anchor`: θ ← Θ + (θ − a).
        Written this way round, a learner with no progress since the anchor (θ = a) lands on
        Θ exactly, as one that overwrites does: θ + (Θ − a) can differ from Θ in the last bit,
        and learners would end a run with values that differ by rounding."""
        params = dict(params)
        for n in self.fragments[p]:
            params[n] = jnp.asarray(value[n] + (np.asarray(params[n]) - anchor[n]), jnp.float32)
        return params

    def _take(self, p: int, version: int, value: dict[str, np.ndarray]) -> None:
        """Fragment p's pending value is applied: it is the base now."""
        self.base[p] = value
        self.base_version[p] = version
        self.pending[p] = None
        self.applied += 1

    def _holds(self, p: int, f: _InFlight) -> str:
        """What fragment p's pending value holds of this learner's pushes: "push" (the one in
        flight, or the driver cannot tell), "older" (an earlier push that the one in flight
        superseded, not the one in flight) or "none" (nothing since the base)."""
        m = self.pending[p].merged
        if m == UNKNOWN or (isinstance(m, MergeRecord) and (m.base_version, m.step) == f.key):
            return "push"
        if isinstance(m, MergeRecord) and m.version > self.base_version[p]:
            return "older"
        return "none"

    def _apply_without(self, p: int, f: _InFlight, params: Params, older: bool) -> Params:
        """The "rebase" rule for a value that does not hold the push in flight (a round that
        closed before it arrived): move onto the value keeping the progress the value lacks
        and leave the push in flight (its own round's value comes later). With `older`, the
        value holds an earlier push that this one superseded: keep the progress since the
        push in flight, θ ← Θ_new + (θ − θ_at_push) (what lies between the two comes back
        with the push's round); otherwise it holds none of this learner's progress since the
        base: θ ← Θ_new + (θ − base). θ_at_push moves with θ, so that the push's own value
        later keeps exactly the progress made since the push. Counters stay: the push in
        flight still carries what it carried."""
        _, version, value, _ = self.pending[p]
        anchor = f.theta_at_push if older else self.base[p]
        params = self._moved(p, params, value, anchor)
        f.theta_at_push = value if older else {
            n: value[n] + (f.theta_at_push[n] - anchor[n]) for n in self.fragments[p]}
        self._take(p, version, value)
        return params

    def _count_since(self, p: int, f: _InFlight) -> None:
        """Fragment p's counters hold only the progress made since push `f` (what it carried
        is taken by a round)."""
        self.chain_next[p] = None
        self.steps[p] -= f.steps_at_push
        self.tokens[p] -= f.tokens_at_push
        self.seconds[p] = max(0.0, self.seconds[p] - f.seconds_at_push)

    def _count_none(self, p: int) -> None:
        """Fragment p has no progress of its own any more (overwritten or dropped)."""
        self.chain_next[p] = None
        self.steps[p], self.tokens[p], self.seconds[p] = 0, 0, 0.0

    # -- checkpointing ---------------------------------------------------------------------------

    def state_dict(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(plain JSON-able data, name → array) for a learner checkpoint
        (`pipeline.learner_state.core_state`)."""
        from pipeline.learner_state import core_state

        return core_state(self)

    def load_state(self, meta: Mapping, arrays: Mapping[str, np.ndarray]) -> None:
        """Restore what `state_dict` saved (`pipeline.learner_state.restore_core`).

        Raises:
            ValueError: the checkpoint does not match this learner's fragments.
        """
        from pipeline.learner_state import restore_core

        restore_core(self, meta, arrays)

    def adopt_base(self, p: int, params: Params) -> Params:
        """End of run: fragment p's last push was never merged (refused) and no later version
        will come: take the base value (the final global one), dropping the progress since."""
        params = dict(params)
        for n in self.fragments[p]:
            params[n] = jnp.asarray(self.base[p][n], jnp.float32)
        self.inflight[p] = None
        self._count_none(p)
        return params

    def resume_pushed(self, p: int, base_version: int, sent_step: int, step: int,
                      params: Params) -> None:
        """A restore from a checkpoint at `step`: fragment p was pushed after it (at
        `sent_step`, on `base_version`; Redis acknowledged it), so that push holds all of
        p's progress in the checkpoint. Take it as the push in flight, as if sent now with
        δ = base − θ: its merged value (or any newer one) applies τ steps from now, keeping
        only the progress since (``apply = "rebase"``) or none (``"overwrite"``); if it was
        merged but the value never comes, the superseding push rebases past it
        (`rebase_merged`); only if it was not merged does the progress go out again. The
        residual the real push carried in is not known: the checkpoint's goes back if it was
        not merged. The driver checks first that the push belongs to this run and learner,
        is not older than the checkpoint's base, and (strict modes, which wait for its value)
        that it was merged."""
        theta = {n: np.array(params[n], np.float32) for n in self.fragments[p]}  # kept
        self.inflight[p] = _InFlight(
            step, base_version, theta if self.cfg.apply == "rebase" else None, self.steps[p],
            self.tokens[p], {n: self.base[p][n] - theta[n] for n in self.fragments[p]},
            self.residual[p], seconds_at_push=self.seconds[p], sent_step=sent_step)
        self.residual[p] = None

    def forget_push(self, p: int) -> None:
        """Treat fragment p's contribution in flight as never sent (its entry is not in Redis):
        its progress stays counted and goes out with the next push."""
        f = self.inflight[p]
        if f is not None and self.cfg.up_feedback:
            self.residual[p] = f.carried
        if f is not None:  # the next push carries its progress: it continues its chain
            self.chain_next[p] = f.chain_step
        self.inflight[p] = None
