"""The syncer's state machine for one fragment: accept contributions, decide, close rounds.

No I/O: the distributed syncer (``workers/syncer.py``) and the in-process engine feed it
contributions (quantised, as they came off the wire) and the clock, persist what `close`
returns and publish it. State that must survive a crash is exported by `state_dict` and
restored by `from_state_dict`.

A push superseding an earlier one of its learner (sent because the earlier one's merged value
was late, and not known to be merged) carries the earlier one's progress too; the two are one
*chain* (`PushHeader.chain`: the step of the chain's first push), whether or not the learner
took a value, and so moved its base, in between. If a round merged the earlier one first, the
later one repeats its steps, tokens and seconds: the syncer remembers each learner's last
merged push (its `PushHeader`) and counts, weights and records only what a push of the same
chain, of the same learner process, adds to it; an earlier push of the chain that arrives after
a later one was merged is refused as superseded (its progress is merged already).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import jax
import numpy as np

from pipeline import quant
from pipeline.config import OuterConfig, SyncConfig
from pipeline.contribution import Contribution, Drop, PushHeader, Reason
from pipeline.downlink import encode_down, full_value
from pipeline.guard import NormGuard, token_bound
from pipeline.history import History
from pipeline.merge import (
    NonFiniteContribution,
    NormExceeded,
    StreamingMerge,
    TrimmedMerge,
    make_merge,
    token_weight,
)
from pipeline.outer import (
    init_state,
    make_outer_step,
    outer_optimizer,
    outer_step,
    partial_outer_step,
    plain_outer_step,
)
from pipeline.policy import Decision, RoundPolicy, RoundView, decide

# the reason of a fragment's last round, closed once every learner's final push is in
FINAL_FLUSH = "final flush"


@dataclass
class RoundResult:
    """Everything a closed round produced; the I/O layer commits it atomically."""

    fragment: int
    version: int
    theta: dict[str, np.ndarray]          # new fp32 global value
    sent: dict[str, quant.QTensor]        # what learners receive (down-link codec)
    sent_hash: str                        # of the value learners hold (`snapshot_tensors`)
    included: list[tuple[str, str, float, int]]  # (entry_id, learner, weight, staleness)
    dropped: list[tuple[str, Reason]]     # (entry_id, reason)
    reason: str
    first_arrival_s: float
    quorum_s: float
    closed_s: float
    tokens: int
    steps: int
    scale: float = 1.0  # the share of an outer step taken (FragmentSyncer.round_share)
    clipped: list[str] = field(default_factory=list)  # entries the guard scaled down
    # entries merge = "robust" left out of the merge (they opposed the others' consensus)
    outvoted: list[str] = field(default_factory=list)
    sent_base: int = -1  # `sent` is a delta against this version (-1: the whole value)
    # learner-seconds of new progress each included contribution carried (its own, less the
    # merged push of its learner it repeats), in `included`'s order
    seconds: list[float] = field(default_factory=list)


# learners whose last merged push a syncer remembers (the most recently merged): a few per
# live learner would do; the bound keeps a run whose learner names churn from growing it
MAX_MERGED_KEPT = 4096


class RoundRefused(ValueError):
    """`FragmentSyncer.close` refused to commit a round whose merged value would not be finite:
    nothing changed but the open round, whose contributions are now drops (`take_drops`)."""


@dataclass
class _Round:
    merge: StreamingMerge | TrimmedMerge
    contributors: dict[str, Contribution] = field(default_factory=dict)
    first_arrival_s: float | None = None
    quorum_reached_s: float | None = None
    dropped: list[tuple[str, Reason]] = field(default_factory=list)
    included: list[tuple[str, str, float, int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # new learner-seconds, as `included`
    tokens: int = 0
    steps: int = 0
    anchors: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    norms: list[tuple[float, int, float | None]] = field(default_factory=list)  # ‖δ‖, steps, bound
    clipped: list[str] = field(default_factory=list)  # entry ids scaled down by the guard
    keys: set[tuple[str, int, int]] = field(default_factory=set)  # dedupe keys first seen here


class FragmentSyncer:
    """Rounds of one fragment: version v, global Θ(v), outer momentum, recent sent values.

    Args:
        fragment: fragment index.
        theta: the initial global value (version 0) or the restored one.
        outer_cfg, sync_cfg: outer optimiser and sync policy (quorum, grace, codecs).
        version: the version of `theta`.
        is_embedding: which tensors are embeddings (the run's task's).
        prior_step_norm: the poison guard's norm bound per step before the fragment has a
            history (`pipeline.guard.prior_step_norm` of the run's configuration).
    """

    def __init__(self, fragment: int, theta: Mapping[str, np.ndarray], outer_cfg: OuterConfig,
                 sync_cfg: SyncConfig, version: int = 0, *,
                 is_embedding: Callable[[str], bool], prior_step_norm: float | None = None,
                 history: History | None = None, opt_state=None):
        self.fragment = fragment
        self.is_embedding = is_embedding
        self.sync_cfg = sync_cfg
        self.outer_cfg = outer_cfg
        self.version = version
        self.theta = {k: np.asarray(v, np.float32) for k, v in theta.items()}
        self.shapes = {k: v.shape for k, v in self.theta.items()}
        self._opt = outer_optimizer(outer_cfg)
        self._outer_step = make_outer_step(self._opt)
        self.opt_state = init_state(self._opt, self.theta) if opt_state is None else opt_state
        if history is not None:  # restored (`from_state_dict`): its value re-published
            sent_values = history[version]
            self.sent = (full_value(sent_values) if sync_cfg.down_delta else
                         encode_down(self.theta, sync_cfg.codec_down, sync_cfg.quant_block)[0])
        elif sync_cfg.down_delta:  # the first value goes out whole, in fp32
            sent_values = {k: v.copy() for k, v in self.theta.items()}
            self.sent = full_value(sent_values)  # views of the history's copy
        else:
            self.sent, sent_values = encode_down(self.theta, sync_cfg.codec_down,
                                                 sync_cfg.quant_block)
        # the version `sent` is a delta against (-1: `sent` is the whole value)
        self.sent_base = -1
        self._hash: tuple[int, str] = (-1, "")  # (version, sent_hash) cached
        # version → the dequantised value learners received for it (anchors stale contributions)
        self.history = history if history is not None else History(version, sent_values)
        self.seen: set[tuple[str, int, int]] = set()
        # learner → its last push merged here, least recently merged first: a later push of
        # its chain repeats it
        self.last_merged: OrderedDict[str, PushHeader] = OrderedDict()
        # under sync.final_step = "plain", the learners whose last push of the fragment
        # (`Contribution.final`) a round merged, first merged first: a later push of theirs
        # is refused, so that a learner gets at most one plain round (under "nesterov" the
        # flag changes no step; runs recorded before the set replay as "nesterov")
        self.finished: dict[str, None] = {}
        self.policy = RoundPolicy(sync_cfg.quorum, sync_cfg.grace_gamma, sync_cfg.grace_max_s,
                                  sync_cfg.overlap_steps, sync_cfg.elastic_quorum)
        self.sync_time_s = 0.0  # EMA of merge+publish time, feeds the grace window
        self.guard = NormGuard(sync_cfg.guard_norm_k, prior_step_norm) if sync_cfg.guard else None
        # learners whose last contribution the guard refused: not counted as live for the
        # quorum, the grace window and a round's share of an outer step until one is accepted
        self.suspects: set[str] = set()
        self._round = self._new_round()

    def _new_round(self) -> _Round:
        return _Round(merge=make_merge(self.shapes, self.sync_cfg.merge, self.is_embedding,
                                      self.sync_cfg.trim))

    @property
    def sent_values(self) -> dict[str, np.ndarray]:
        return self.history[self.version]

    @property
    def snapshot_tensors(self) -> dict[str, quant.QTensor]:
        """The current value as snapshots store it: what was sent, or with the delta down link
        the reference itself in fp32 (a delta is no use to a learner that missed the last); in
        name order, so that the snapshot's SHA-256 is `sent_hash` (hashed once a version)."""
        t = full_value(self.sent_values) if self.sync_cfg.down_delta else self.sent
        return {k: t[k] for k in sorted(t)}

    @property
    def sent_hash(self) -> str:
        """SHA-256 of the current published value as snapshots hold it (`snapshot_tensors`):
        round records carry it, replay recomputes it, delta learners check their value by it."""
        if self._hash[0] != self.version:
            self._hash = (self.version, quant.tensors_hash(self.snapshot_tensors))
        return self._hash[1]

    @property
    def contributors(self) -> frozenset[str]:
        return frozenset(self._round.contributors)

    def offer(self, c: Contribution, now_s: float, max_tokens_per_step: int | None = None
              ) -> tuple[bool, str | Reason]:
        """Accumulate a contribution into the open round, or say why not.

        `max_tokens_per_step` is what the contribution's learner can train on in one step (the
        poison guard's token bound, `pipeline.guard`; None: not checked).

        Returns ``(accepted, reason)``: ``"accepted"``, or a :class:`Reason` whose ``kind`` is a
        duplicate (seen before: not recorded until :meth:`note_duplicate`), already represented
        in this round (``Drop.DEFER``: offer it again after the close), or a drop (recorded in
        the next round record with its reason).
        """
        if c.key in self.seen:
            return False, Reason(Drop.DUPLICATE)
        if self.waits_for_next_round(c.learner, c.key):
            return False, Reason(Drop.DEFER, "defer: learner already contributed to the open "
                                 "round")
        staleness = self.version - c.base_version
        repeats = self._repeats(c)
        reason = None
        if c.base_version not in self.history and 0 <= staleness <= self.sync_cfg.max_staleness:
            reason = Reason(Drop.UNANCHORED, f"base version {c.base_version} no longer held")
        if staleness > self.sync_cfg.max_staleness:
            reason = Reason(Drop.STALE, f"stale: base version {c.base_version}, global version "
                            f"{self.version}, max_staleness {self.sync_cfg.max_staleness}")
        elif staleness < 0:
            reason = Reason(Drop.AHEAD, f"base version {c.base_version} is ahead of global "
                            f"version {self.version}")
        elif repeats is not None and c.step <= repeats.step:
            reason = Reason(Drop.SUPERSEDED, f"superseded: its learner's push at step "
                            f"{repeats.step} of the same chain, merged, holds its progress")
        elif c.steps <= 0 or c.tokens <= 0:
            reason = Reason(Drop.EMPTY, f"empty contribution (steps {c.steps}, tokens "
                            f"{c.tokens})")
        elif repeats is not None and (c.steps <= repeats.steps or c.tokens <= repeats.tokens):
            reason = Reason(Drop.EMPTY, f"empty contribution beyond its learner's merged push "
                            f"(steps {c.steps} of {repeats.steps}, tokens {c.tokens} of "
                            f"{repeats.tokens})")
        elif set(c.delta) != set(self.shapes) or any(
                c.delta[k].shape != s for k, s in self.shapes.items()):
            reason = Reason(Drop.SHAPE, "tensors do not match the fragment's names and shapes")
        elif self.guard is not None and c.tokens > (
                token_bound(c.steps, max_tokens_per_step) or c.tokens):
            reason = Reason(Drop.TOKENS, f"tokens {c.tokens} exceed {c.steps} steps × "
                            f"{max_tokens_per_step} tokens per step")
        if c.learner in self.finished:
            reason = Reason(Drop.FINISHED, "finished: its learner's last push of the fragment "
                            "(final) is merged")
        self.seen.add(c.key)
        self._round.keys.add(c.key)
        if reason:
            if reason.kind is Drop.TOKENS:
                self.suspects.add(c.learner)
            return self._drop(c, reason)
        # what it adds to the merged push it repeats (δ itself is a position: it holds both)
        steps, tokens, seconds = c.steps, c.tokens, c.seconds
        if repeats is not None:
            steps, tokens = steps - repeats.steps, tokens - repeats.tokens
            seconds = max(0.0, seconds - repeats.seconds)
        weight = token_weight(tokens, steps)
        anchor = self._round.anchors.get(c.base_version)
        if anchor is None:  # Θ(v) − Θ̃(b), shared by every contribution anchored at b
            anchor = self._round.anchors[c.base_version] = {
                k: self.theta[k] - h for k, h in self.history[c.base_version].items()}
        bound = self.guard.bound(c.steps) if self.guard is not None else None
        try:
            norm = self._round.merge.add(c.delta, weight, anchor, anchor_id=c.base_version,
                                         max_norm=bound,
                                         clip=self.sync_cfg.guard_action == "clip")
        except NormExceeded as e:
            self.suspects.add(c.learner)
            return self._drop(c, Reason(Drop.NORM, f"norm {e.norm / c.steps:.4g} per step "
                                        f"exceeds {self.guard.describe()}"))
        except NonFiniteContribution:
            return self._drop(c, Reason(Drop.NON_FINITE, "non-finite values in the contribution"))
        except ValueError as err:  # an internally inconsistent quantised tensor
            return self._drop(c, Reason(Drop.MALFORMED, f"malformed tensors: {err}"))
        r = self._round
        self.suspects.discard(c.learner)
        r.norms.append((norm, c.steps, bound))
        if bound is not None and norm > bound:
            r.clipped.append(c.entry_id)
        r.contributors[c.learner] = c
        r.included.append((c.entry_id, c.learner, weight, staleness))
        r.seconds.append(seconds)
        r.tokens += tokens
        r.steps += steps
        if r.first_arrival_s is None:
            r.first_arrival_s = now_s
        if r.quorum_reached_s is None and len(r.contributors) >= self.policy.quorum:
            r.quorum_reached_s = now_s
        return True, "accepted"

    def _repeats(self, c: Contribution) -> PushHeader | None:
        """The merged push of c's learner whose progress c holds (or, if c is older, which
        holds c's): one of the same process (epoch) and chain. An entry without a chain (a
        version before chains) takes its learner's pushes on its base as its chain. None for
        a learner without epochs (0): its pushes cannot be told from a restarted process's."""
        m = self.last_merged.get(c.learner)
        if m is None or c.epoch == 0 or m.epoch != c.epoch:
            return None
        if c.chain is None:
            return m if (m.chain, m.base_version) == (None, c.base_version) else None
        return m if m.chain == c.chain else None

    def waits_for_next_round(self, learner: str, key: tuple[str, int, int]) -> bool:
        """True when a contribution (not a duplicate) comes from a learner already in the open
        round: it is offered again after the close."""
        return key not in self.seen and learner in self._round.contributors

    def _drop(self, c: Contribution, reason: Reason) -> tuple[bool, Reason]:
        self._round.dropped.append((c.entry_id, reason))
        return False, reason

    def note_duplicate(self, entry_id: str) -> None:
        """Record a refused duplicate in the next round record (the I/O layer acknowledges
        it with that round's commit, so the record accounts for the entry)."""
        self._round.dropped.append((entry_id, Reason(Drop.DUPLICATE)))

    def counted(self, live: frozenset[str]) -> frozenset[str]:
        """The live learners that count for quorum, grace and a round's share: the live ones
        but those whose last contribution the poison guard refused."""
        return live - self.suspects if self.suspects else live

    def view(self, live: frozenset[str]) -> RoundView:
        r = self._round
        q = r.quorum_reached_s
        if q is None and r.contributors and self.policy.elastic and len(
                r.contributors) >= min(self.policy.quorum, max(1, len(live))):
            # the quorum shrank (learners died) after contributions arrived
            q = max(r.first_arrival_s or 0.0, 0.0)
        return RoundView(frozenset(r.contributors), r.first_arrival_s, q)

    def decide(self, now_s: float, live: frozenset[str], step_time_s: float) -> Decision:
        return decide(now_s, self.view(live), live, self.policy, step_time_s, self.sync_time_s)

    @property
    def pending_drops(self) -> list[tuple[str, Reason]]:
        """The refusals the next round record will list (a copy)."""
        return list(self._round.dropped)

    def round_share(self, live_learners: int) -> float:
        """How much of an outer step the open round takes (`sync.round_step`).

        "share": n/L when n of the L live learners contributed (1 when all did), so the outer
        optimiser advances by one step per full round of work whether the learners' pushes
        come together or apart (K=1 rounds of one learner each would otherwise apply M full
        steps per window, and compound them through the momentum). "full": always 1, one
        step per round as in synchronous DiLoCo.
        """
        n = len(self._round.contributors)
        if self.sync_cfg.round_step == "full" or n == 0 or live_learners <= n:
            return 1.0
        return n / live_learners

    def close(self, now_s: float, reason: str, share: float = 1.0) -> RoundResult:
        """Merge, take `share` ∈ (0, 1] of an outer step on the merged Δ (see
        `pipeline.outer.partial_outer_step`), advance the version and open a new round.
        Under ``sync.final_step = "plain"`` a round of the end-of-run flush (one that merges
        a learner's last push of the fragment, `Contribution.final`, or is closed as
        `FINAL_FLUSH`) takes a plain step instead: the momentum's look-ahead, which no later
        round would correct, left out. Replay closes a round again from its entries (their
        ``final`` flags) and its recorded reason and share, to the same value."""
        r = self._round
        outer_grad = r.merge.result()
        if self.sync_cfg.final_step == "plain" and (
                reason == FINAL_FLUSH or any(c.final for c in r.contributors.values())):
            theta, opt_state = plain_outer_step(self.outer_cfg, self.theta, outer_grad,
                                                self.opt_state, share)
        elif share == 1.0:
            theta, opt_state = outer_step(self._opt, self.theta, outer_grad, self.opt_state,
                                          self._outer_step)
        else:
            theta, opt_state = partial_outer_step(self.outer_cfg, self.theta, outer_grad,
                                                  self.opt_state, share)
        del outer_grad  # not held through the encoding below
        try:
            sent, sent_values = encode_down(
                theta, self.sync_cfg.codec_down, self.sync_cfg.quant_block,
                self.sent_values if self.sync_cfg.down_delta else None)
            finite = all(np.isfinite(v).all() for v in (*theta.values(), *sent_values.values()))
        except (ValueError, FloatingPointError):
            finite = False
        if not finite:
            why = Reason(Drop.ROUND, f"round value would not be finite (v{self.version + 1} "
                         f"not committed)")
            dropped = r.dropped + [(entry_id, why) for entry_id, *_ in r.included]
            self._round = self._new_round()
            self._round.dropped = dropped
            raise RoundRefused(f"fragment {self.fragment}: the merged value of "
                               f"{len(r.included)} contributions would not be finite")
        self.theta, self.opt_state = theta, opt_state
        if self.guard is not None:
            for norm, steps, bound in r.norms:
                self.guard.accepted(norm, steps, bound)
        self.sent_base = self.version if self.sync_cfg.down_delta else -1
        self.version += 1
        self.sent = sent
        self.history.add(self.version, sent_values, sent, self.sent_base)
        self.history.keep_last(self.sync_cfg.max_staleness + 1)
        oldest = self.version - self.sync_cfg.max_staleness - 1
        self.seen = {k for k in self.seen if k[1] >= oldest}
        for c in r.contributors.values():
            self.last_merged.pop(c.learner, None)
            self.last_merged[c.learner] = c.header()
        # not pruned by staleness: a chain goes on over newer bases (a push of it can repeat a
        # merged push whose own base is long stale)
        while len(self.last_merged) > MAX_MERGED_KEPT:
            self.last_merged.popitem(last=False)
        if self.sync_cfg.final_step == "plain":
            self.finished.update((c.learner, None) for c in r.contributors.values() if c.final)
            while len(self.finished) > MAX_MERGED_KEPT:
                del self.finished[next(iter(self.finished))]
        result = RoundResult(
            fragment=self.fragment, version=self.version, theta=self.theta, sent=self.sent,
            sent_hash=self.sent_hash, included=r.included, dropped=r.dropped,
            reason=reason,
            first_arrival_s=now_s if r.first_arrival_s is None else r.first_arrival_s,
            quorum_s=now_s if r.quorum_reached_s is None else r.quorum_reached_s,
            closed_s=now_s, tokens=r.tokens,
            steps=r.steps, scale=share, clipped=list(r.clipped),
            outvoted=[r.included[i][0] for i in getattr(r.merge, "excluded", ())],
            sent_base=self.sent_base, seconds=r.seconds)
        self._round = self._new_round()
        return result

    def take_drops(self) -> list[tuple[str, Reason]]:
        """Drops recorded while no round is open with contributions (flushed by the caller)."""
        drops, self._round.dropped = self._round.dropped, []
        return drops

    def record_sync_time(self, seconds: float, alpha: float = 0.3) -> None:
        self.sync_time_s = seconds if self.sync_time_s == 0 else (
            (1 - alpha) * self.sync_time_s + alpha * seconds)

    # -- persistence -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Plain data (numpy arrays, ints, lists) for the crash-safe commit."""
        leaves = jax.tree_util.tree_leaves(self.opt_state)
        state = {
            "fragment": self.fragment,
            "version": self.version,
            "theta": self.theta,
            "momentum": [np.asarray(x) for x in leaves],
            "history": {str(v): h for v, h in self.history.items()},
            # as of the last close: a state written while a round is open (a checkpoint at a
            # hand-over or an exit) must not make its successor refuse that round's entries,
            # which it merges again, as duplicates
            "seen": sorted([list(k) for k in self.seen - self._round.keys]),
            "sync_time_s": self.sync_time_s,
            "norms": list(self.guard.recent) if self.guard is not None else [],
            "merged_pushes": [[n, m.epoch, m.base_version, m.step, m.steps, m.tokens, m.seconds,
                               m.chain] for n, m in self.last_merged.items()],
        }
        if self.finished:  # only then: a syncer of an earlier version reads the rest
            state["finished"] = list(self.finished)
        return state

    @classmethod
    def from_state_dict(cls, d: dict, outer_cfg: OuterConfig, sync_cfg: SyncConfig,
                        is_embedding: Callable[[str], bool],
                        prior_step_norm: float | None = None) -> FragmentSyncer:
        # the optimiser state's structure from scalars (no value-sized array built to be
        # thrown away): the checkpoint's arrays go in as they are
        treedef = jax.tree_util.tree_structure(init_state(
            outer_optimizer(outer_cfg), {k: np.zeros((), np.float32) for k in d["theta"]}))
        history = d["history"] if isinstance(d["history"], History) else History.from_values(
            {int(v): {k: np.asarray(a, np.float32) for k, a in h.items()}
             for v, h in d["history"].items()})
        # re-published whole under the delta down link: the delta that made it is not kept
        s = cls(int(d["fragment"]), d["theta"], outer_cfg, sync_cfg, int(d["version"]),
                is_embedding=is_embedding, prior_step_norm=prior_step_norm, history=history,
                opt_state=jax.tree_util.tree_unflatten(
                    treedef, [np.asarray(x) for x in d["momentum"]]))
        s.seen = {(str(a), int(b), int(c)) for a, b, c in d["seen"]}
        s.sync_time_s = float(d.get("sync_time_s", 0.0))
        # broker.state.unpack_state reads the older form ("merged_last", without chains)
        s.last_merged = OrderedDict(
            (str(n), PushHeader(str(n), s.fragment, int(b), int(st), int(k), int(t), float(x),
                                None if chain is None else int(chain), epoch=int(e)))
            for n, e, b, st, k, t, x, chain in d.get("merged_pushes", ())[-MAX_MERGED_KEPT:])
        s.finished = dict.fromkeys(str(n) for n in d.get("finished", ())[-MAX_MERGED_KEPT:])
        if s.guard is not None:
            s.guard.recent.extend(float(x) for x in d.get("norms", ()))
        return s
