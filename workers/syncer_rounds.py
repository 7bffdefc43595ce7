"""The syncer's rounds: close a fragment's open round when it is due (quorum, grace window,
final flush), have it committed (`workers.syncer_commits`), publish the merged value over
ZeroMQ, and offer the entries that waited for it. A round whose merged value would not be
finite is refused: its entries are acknowledged as drops and the fragment keeps its value."""

from __future__ import annotations

import logging
import time
from collections import deque

from broker import attest, codec
from broker.records import Drop, Included, Merged, RoundRecord
from pipeline.syncer import FINAL_FLUSH, FragmentSyncer, RoundRefused, RoundResult
from workers.syncer_commits import Commits
from workers.syncer_intake import Intake
from workers.syncer_state import FragState, SyncerShared

log = logging.getLogger("diloco.syncer")


class Rounds:
    """Close, commit, publish (see module docstring)."""

    def __init__(self, sh: SyncerShared, intake: Intake, commits: Commits):
        self.sh = sh
        self.intake = intake
        self.commits = commits
        self._sent: dict[int, deque] = {}  # fragment → the last (version, hash) published

    def maybe_close(self, p: int, final_expected: set[str] | None) -> bool:
        """Close the fragment's open round if it is due. True when a round was closed (or
        refused)."""
        f = self.sh.frags[p]
        if not f.core.contributors:
            if f.ack_extra and not f.entries:
                self.commit_drops_only(p)
            return False
        now = time.monotonic()
        if final_expected is not None and final_expected <= f.final_seen:
            reason = FINAL_FLUSH
        else:
            d = f.core.decide(now, f.core.counted(self.sh.live), self.sh.step_time_s)
            if not d.close:
                return False
            reason = d.reason
        try:
            self._close(p, f, reason, now)
        except RoundRefused as e:
            self._refuse(p, f, e)
        return True

    def _refuse(self, p: int, f: FragState, e: RoundRefused) -> None:
        """The merged value would not be finite: nothing is committed, the round's entries
        are acknowledged as drops with the reason, the fragment keeps its value."""
        log.error("%s; the round's entries are dropped", e)
        self.sh.event("round-refused", fragment=p, version=f.core.version,
                      entries=list(f.entries), reason=str(e))
        self.sh.stats.dropped += len(f.entries)
        for meta in f.entries.values():
            self.intake.note_refused(meta.learner, p, meta.base_version, meta.step, str(e))
        f.ack_extra.extend(f.entries)
        f.entries = {}
        self.commit_drops_only(p)

    def commit_drops_only(self, p: int) -> None:
        """Acknowledge refused entries when no round is open (their drop reasons are logged)."""
        f = self.sh.frags[p]
        for entry_id, reason in f.core.take_drops():
            self._dropped(p, entry_id, reason, f.drop_keys.get(entry_id, ("", -1, -1)))
        self.sh.streams.ack_only(p, f.ack_extra)
        f.ack_extra, f.drop_keys = [], {}

    def _close(self, p: int, f: FragState, reason: str, now: float) -> None:
        t0 = time.monotonic()
        # the leases kept while the round is computed (a large fragment's outlasts a lease),
        # for ten lease periods at most
        with self.sh.store.leases_kept(10 * self.sh.bcfg.lease_ms / 1000):
            result = f.core.close(now, reason,
                                  f.core.round_share(len(f.core.counted(self.sh.live))))
            snapshot = self.commits.snapshot(f.core)
        self.sh.stats.commits += 1
        self.sh.cfg.faults.at("before", self.sh.stats.commits)
        record = self._record(result, t0)
        acks = list(f.entries) + f.ack_extra
        # each included learner's merge record, committed with the round and published with
        # its value: a learner that receives the value or reads its snapshot finds what it
        # merged (from the message itself, or from Redis)
        pushes = {n: (f.entries[e].base_version, f.entries[e].step)
                  for e, n, *_ in result.included if e in f.entries}
        merged = {n: Merged(b, s, result.version).to_json() for n, (b, s) in pushes.items()}
        f.recent.append((record, acks, merged))
        f.keep_snapshot(result.version, snapshot)
        if not self.commits.commit(p, f, snapshot=snapshot, record=record.to_fields(),
                                   acks=acks, merged=merged, checkpoint=(
                                       reason == FINAL_FLUSH or self.commits.checkpoint_due(f))):
            return
        self.sh.cfg.faults.at("after", self.sh.stats.commits)
        self.publish(p, f.core, pushes)
        f.core.record_sync_time(time.monotonic() - t0)
        st = self.sh.stats
        st.rounds += 1
        st.merged += len(result.included)
        st.quorum_wait_s, st.grace_wait_s = record.quorum_wait_s, record.grace_wait_s
        st.last_reason = result.reason
        self.commits.trim(p, f)
        # the round record names its drops by entry id; their events name the pushes too, so
        # a drop stays accounted once its entry is trimmed
        drops = [(e, why, f.drop_keys[e]) for e, why in result.dropped
                 if why.kind is not Drop.DUPLICATE and e in f.drop_keys]
        f.entries, f.ack_extra, f.drop_keys = {}, [], {}
        self._report(result, record)  # (events reach Redis: after the round's own state)
        for entry_id, reason, key in drops:
            self._dropped(p, entry_id, reason, key, version=result.version)
        deferred, f.deferred = f.deferred, []
        for e in deferred:
            self.intake.offer(e)

    def _dropped(self, p: int, entry_id: str, reason: str, key: tuple[str, int, int],
                 **extra) -> None:
        """The event of a refused push, naming it (learner, base version, step): the chaos
        ledger accounts for it once its entry is trimmed."""
        learner, base_version, step = key
        self.sh.event("dropped", fragment=p, entry=entry_id, reason=reason, learner=learner,
                      base_version=base_version, step=step, **extra)

    def _report(self, result: RoundResult, record: RoundRecord) -> None:
        """A committed round's curves, log line and events."""
        p, v = result.fragment, result.version
        if self.sh.scalars is not None:  # written off this thread
            self.sh.scalars.add(f"fragment/{p}", v, {
                "merged": len(result.included), "dropped": len(result.dropped),
                "tokens": result.tokens, "merge_s": record.merge_s,
                "quorum_wait_s": record.quorum_wait_s, "grace_wait_s": record.grace_wait_s,
                "live_learners": len(self.sh.live)}, t=record.t)
        log.info("fragment %d v%d: %d merged, %d dropped (%s)", p, v, len(result.included),
                 len(result.dropped), result.reason)
        if result.clipped:
            self.sh.event("clipped", fragment=p, version=v, entries=result.clipped,
                          reason=f"norm above {self.sh.sync.guard_norm_k:g} × the recent median")
        if result.outvoted:
            log.warning("fragment %d v%d: %d contribution(s) left out of the robust merge "
                        "(opposed the others): %s", p, v, len(result.outvoted),
                        ", ".join(result.outvoted))
            self.sh.event("outvoted", fragment=p, version=v, entries=result.outvoted,
                          reason="direction opposed the consensus of the round's others")

    def _record(self, r: RoundResult, t0: float) -> RoundRecord:
        return RoundRecord(
            version=r.version, fragment=r.fragment, reason=r.reason,
            included=tuple(Included(*x) for x in r.included), dropped=tuple(r.dropped),
            hash=r.sent_hash, tokens=r.tokens, steps=r.steps, scale=r.scale,
            seconds=tuple(r.seconds),
            quorum_wait_s=r.quorum_s - r.first_arrival_s,
            grace_wait_s=max(0.0, r.closed_s - r.quorum_s),
            merge_s=time.monotonic() - t0, syncer=self.sh.cfg.syncer_id, t=time.time())

    def publish(self, p: int, core: FragmentSyncer,
                pushes: dict[str, tuple[int, int]] | None = None) -> None:
        """Publish the fragment's current value: whole, or a delta with the value's hash;
        with the round's merge records when it was just committed (`pushes`: learner → base
        version and step; None for a re-publish)."""
        run, v = self.sh.ctx.keys.run, core.version
        if core.sync_cfg.down_delta:  # a delta is another value than the one learners hold
            frames = codec.global_frames(run, p, v, core.sent, base=core.sent_base,
                                         value=core.sent_hash, merged=pushes)
        else:  # the whole value, in name order: its SHA-256 is the round's, hashed once
            frames = codec.global_frames(run, p, v, core.snapshot_tensors, merged=pushes,
                                         sha256=core.sent_hash)
        self.sh.pub.publish(frames)
        sent = self._sent.setdefault(p, deque(maxlen=attest.SENT))
        if not sent or sent[-1][0] != v:
            sent.append((v, core.sent_hash))

    def attest(self, p: int, core: FragmentSyncer) -> None:
        """Say over ZeroMQ which values the fragment's snapshots held lately, the current one
        last (`broker.attest`): with CURVE, a learner takes a snapshot from Redis only once a
        syncer said so."""
        sent = [h for h in self._sent.get(p, ()) if h[0] < core.version]
        self.sh.pub.publish(attest.frames(self.sh.ctx.keys.run, p,
                                          [*sent, (core.version, core.sent_hash)]))
