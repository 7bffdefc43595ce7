"""The syncer role: merge fragment streams into rounds, commit them in Redis, publish over ZeroMQ.

A loop around the pure per-fragment state machine (`pipeline.syncer`), the Redis stream adapter
(`broker.streams`) and the ZeroMQ publisher (`broker.pubsub`). A round's effects (state,
snapshot, round record, XACKs) commit in one MULTI/EXEC fenced by the fragment lease; publishing
follows the commit, so a crash between the two only delays it (a restart re-publishes).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import redis
import zmq

from broker import archive, codec, registry, signing
from broker.commit import LeaseLost, RoundsLost
from broker.connection import OUTAGE, value_limits
from broker.entries import EntryMeta, parse_entry, payload_size, peek_key
from broker.errors import DecodeError
from broker.ids import id_key
from broker.pubsub import Publisher
from broker.records import (
    Drop,
    Included,
    Merged,
    Refusal,
    RoundRecord,
    SyncerFinal,
    SyncerInfo,
)
from broker.state import pack_state, unpack_state
from broker.streams import Entry, FragmentStreams
from pipeline import capacity, kernels
from pipeline.fragments import assign, fragment_sizes
from pipeline.guard import fragment_prior
from pipeline.syncer import FINAL_FLUSH, FragmentSyncer, RoundRefused, RoundResult
from workers import heap, native, recovery
from workers.common import RunContext, apply_environment, open_run

# the command line and the configuration, re-exported: `workers.syncer.parse_args`, and
# `SyncerConfig` for the users that build one in code
from workers.syncer_config import (  # noqa: F401
    CommitFaults,
    SyncerConfig,
    add_args,
    config_from_args,
    curve_server,
    parse_args,
)
from workers.syncer_state import FragState, SyncerStats, payload_digest

log = logging.getLogger("diloco.syncer")

# rounds of one fragment one poll may close back to back (deferred entries fill the next)
_CLOSES_PER_POLL = 8


class Syncer:
    """State and loop of one syncer process (see module docstring)."""

    def __init__(self, cfg: SyncerConfig, ctx: RunContext, ctx_zmq: zmq.Context):
        self.cfg = cfg
        self.ctx = ctx
        self.run_cfg = ctx.cfg
        self.sync = ctx.cfg.effective_sync()
        self.bcfg = ctx.cfg.broker
        self.streams = FragmentStreams(ctx.r, ctx.keys, max_entries=self.bcfg.stream_max_entries,
                                       piece_bytes=self.bcfg.piece_bytes)
        # no fragment list: the fragments are shared with the run's other such syncers
        # (`_rebalance`); else exactly these, standing by while another syncer holds them
        self.auto = not cfg.fragments
        self.owned: list[int] = []
        n_frags = len(ctx.fragments)
        bad = [p for p in cfg.fragments if not 0 <= p < n_frags]
        self.sizes = dict(enumerate(fragment_sizes(ctx.shapes, ctx.fragments)))
        self._init: dict[str, np.ndarray] | None = None
        self._next_balance = 0.0
        self._unwanted: dict[int, float] = {}  # fragment → since when another should own it
        if bad:
            raise ValueError(f"--fragments {bad}: the run has fragments "
                             f"0..{len(ctx.fragments) - 1}")
        self.pub = Publisher(ctx_zmq, cfg.bind, cfg.advertise_host, hwm=self.bcfg.zmq_hwm,
                             curve=cfg.curve)
        self.verifier = signing.Verifier(cfg.sign_keys, heartbeat_max_age_s=(  # a replayed one
            self.bcfg.heartbeat_ttl_s + signing.CLOCK_SKEW_S)) if cfg.sign_keys else None
        self.frags: dict[int, FragState] = {}
        self.live: frozenset[str] = frozenset()
        self._unverified_seen: set[str] = set()
        self.step_time_s = 1.0
        self.stats = SyncerStats()
        self.phase = "starting"  # → "standing by" (another syncer holds a lease) → "active"
        self.last_tick = time.monotonic()  # the loop's last round (the liveness probe)
        self._next_live = 0.0
        self._next_lease = 0.0
        self._next_claim = 0.0
        self._hasher: ThreadPoolExecutor | None = None
        # learner → the most tokens one of its steps may claim (its heartbeat's declaration)
        self.declared: dict[str, int] = {}
        # learner → the newest epoch of its entries seen: entries of older epochs are fenced
        self.epochs: dict[str, int] = {}
        self.known: frozenset[str] = frozenset()  # learners with a heartbeat record

    # -- start -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self.auto:
            self._rebalance(force=True)
        else:
            for p in self.cfg.fragments:
                if not self.streams.has_state(p):
                    self._init_params()  # before any lease: JAX can outlast a short lease
            for p in self.cfg.fragments:
                while not self.streams.acquire_lease(p, self.cfg.syncer_id, self.bcfg.lease_ms):
                    log.info("fragment %d is leased by another syncer; standing by", p)
                    self.phase, self.last_tick = "standing by", time.monotonic()
                    time.sleep(self.bcfg.lease_ms / 3000)
            self._adopt(list(self.cfg.fragments))
        registry.register_syncer(self.ctx.r, self.ctx.keys, self.cfg.syncer_id, self._info())
        registry.event(self.ctx.r, self.ctx.keys, "syncer-start", syncer=self.cfg.syncer_id,
                       fragments=self.owned, endpoint=self.pub.endpoint)
        self._claim(force=True)
        self.phase = "active" if self.owned else "standing by"

    def _init_params(self) -> dict[str, np.ndarray]:
        """The run's initial parameters (for fragments without state yet), built once."""
        if self._init is None:
            self._init = {k: np.asarray(v) for k, v in self.ctx.task.init_params(
                self.run_cfg.seed).items()}
        return self._init

    def _adopt(self, ps: list[int]) -> None:
        """Take fragments whose leases this syncer holds now: their state at the latest
        committed version (initialised if they have none), re-published; then the entries read
        and never acknowledged — by this consumer before a crash, or by a previous owner —
        merged once (an owner that lost its lease cannot commit them)."""
        for p in ps:
            self.streams.ensure_group(p)
            state_blob = self.streams.load_state(p, limit := capacity.state_limit(self._shapes(p)))
            if state_blob is None:
                init = self._init_params()
                core = FragmentSyncer(p, {n: init[n] for n in self.ctx.fragments[p]},
                                      self.run_cfg.outer, self.sync,
                                      is_embedding=self.ctx.task.is_embedding,
                                      prior_step_norm=self._prior(p))
                self.streams.acquire_lease(p, self.cfg.syncer_id, self.bcfg.lease_ms)
                self.streams.init_fragment(p, self.cfg.syncer_id, state=self._state_blob(core),
                                           snapshot=self._snapshot(core))
                state_blob = self.streams.load_state(p, limit)
            f = self.frags[p] = self._recover(p, state_blob)
            f.keep_snapshot(f.core.version, self._snapshot(f.core))
            f.final_seen |= self._finals_done(p)
            self.owned.append(p)
        self.owned.sort()
        self._init = None  # the whole model's initial values: built again only if needed
        for p in ps:  # re-publish what is committed (a restart after a crash, a takeover)
            self._publish(p, self.frags[p].core)
        for p in ps:  # recovery may have outlasted a lease: claim nothing for a lost one
            if not self.streams.acquire_lease(p, self.cfg.syncer_id, self.bcfg.lease_ms):
                if not self.auto:
                    raise LeaseLost(f"fragment {p}: lease lost while recovering it")
                log.warning("fragment %d: lease lost while recovering it; another syncer "
                            "serves it", p)
                self._drop(p, release=False)
        for p in [p for p in ps if p in self.frags]:
            pending = self.streams.read_pending(self.cfg.syncer_id, p)
            self._lost(p, [e.entry_id for e in pending if not e.fields])
            self._handle([e for e in pending if e.fields], check_deliveries=True)
            claimed, deleted = self.streams.claim_others(p, self.cfg.syncer_id)
            self._lost(p, deleted)
            self._handle(claimed, check_deliveries=True)

    def _finals_done(self, p: int) -> set[str]:
        """The learners whose final push to fragment p a previous owner merged or refused (a
        syncer that takes a fragment over during the final flush never reads those): its
        dedupe keys as recovered (rounds committed), or the merge and refusal records."""
        out = set()
        pushed = self._verified(registry.final_pushes(self.ctx.r, self.ctx.keys), "final-pushes")
        seen = self.frags[p].core.seen
        for name, rep in pushed.items():
            if p not in rep.final:
                continue
            if any(k[0] == name and k[2] >= rep.steps for k in seen):
                out.add(name)
                continue
            for rec in (registry.merged(self.ctx.r, self.ctx.keys, name, p),
                        registry.refusal(self.ctx.r, self.ctx.keys, name, p)):
                if rec is not None and rec.step >= rep.steps:
                    out.add(name)
        return out

    def _drop(self, p: int, *, release: bool) -> None:
        """Stop serving fragment p. With `release` (this syncer still holds the lease): a
        checkpoint first (the next owner replays nothing), then the lease. Entries read and not
        committed stay pending here; the next owner claims them when it adopts the fragment."""
        f = self.frags[p]
        if release:
            try:
                if f.ckpt_version < f.core.version:
                    self._checkpoint(p, f)
            except LeaseLost:
                release = False  # not ours any more: the next owner replays the rounds
            else:
                self.streams.release_lease(p, self.cfg.syncer_id)
        if p not in self.frags:  # the checkpoint's resync found another syncer serving it
            return
        del self.frags[p]
        self.owned.remove(p)
        self._unwanted.pop(p, None)
        log.info("fragment %d: handed over at v%d (%s)", p, f.core.version,
                 "released" if release else "lease lost")

    def _closed(self) -> set[int]:
        """Fragments whose final round a syncer has recorded (the run is over for them)."""
        closed: set[int] = set()
        for rep in registry.syncer_final_reports(self.ctx.r, self.ctx.keys).values():
            closed |= {int(p) for p in rep.versions}
        return closed

    def _rebalance(self, force: bool = False) -> None:
        """Share the run's open fragments among the live syncers, balanced by size
        (`pipeline.fragments.assign`; every syncer computes the same answer): hand over the
        fragments another syncer should own (once their open round is empty, or after a lease
        period), take the free ones this one should own. A dead syncer's fragments are taken
        when its lease and membership run out; a syncer that leaves hands them over at once."""
        now = time.monotonic()
        if not force and now < self._next_balance:
            return
        self._next_balance = now + self.bcfg.lease_ms / 3000
        me = self.cfg.syncer_id
        members = registry.syncer_alive(self.ctx.r, self.ctx.keys, me, self.bcfg.lease_ms)
        closed = self._closed()
        mine = set(assign({p: n for p, n in self.sizes.items() if p not in closed},
                          members).get(me, ()))
        before = list(self.owned)
        for p in list(self.owned):
            f = self.frags[p]
            if p in mine or f.finished:
                self._unwanted.pop(p, None)
                continue
            since = self._unwanted.setdefault(p, now)
            if not f.core.contributors or now - since > self.bcfg.lease_ms / 1000:
                self._drop(p, release=True)
        want = sorted(mine - set(self.owned) - closed)
        if want and not all(self.streams.has_state(p) for p in want):
            self._init_params()  # before any lease: JAX can outlast a short lease
        got = [p for p in want if self.streams.acquire_lease(p, me, self.bcfg.lease_ms)]
        if got:
            self._adopt(got)
            log.info("took fragments %s (syncers %s; now owns %s)", got, members, self.owned)
            registry.event(self.ctx.r, self.ctx.keys, "rebalance", syncer=me, took=got,
                           owns=self.owned, syncers=members)
        self.phase = "active" if self.owned else "standing by"
        if self.owned != before:  # `diloco status` shows who owns what
            registry.register_syncer(self.ctx.r, self.ctx.keys, me, self._info())

    def run_finished(self) -> bool:
        """True when the run is over: every learner has its final report and the final rounds
        of this syncer's fragments are recorded (a syncer started afterwards has no work)."""
        reports = self._verified(registry.learner_final_reports(self.ctx.r, self.ctx.keys), "final")
        if len(reports) < self.run_cfg.learners:
            return False
        return set(self.cfg.fragments or self.sizes) <= self._closed()

    def _reopen(self, p: int) -> None:
        """A stream an entry of the largest id blocks (a learner credential may name ids) is
        set back, so learners' pushes go in again."""
        back = self.streams.reopen_exhausted(p)
        if back is not None:
            self.stats.dead_lettered += 1
            log.warning("fragment %d: an entry with the largest stream id blocked every push; "
                        "dead-lettered, the stream set back to %s", p, back)
            registry.event(self.ctx.r, self.ctx.keys, "stream-reopened", fragment=p, to=back)

    def _note_unverified(self, names: Iterable[str]) -> None:
        """A warning, once per learner id, for a live heartbeat its learner's key does not
        sign: a process with a learner credential but not that learner's signing key."""
        for name in sorted(set(names) - self._unverified_seen):
            self._unverified_seen.add(name)
            log.warning("learner %r has a live heartbeat its signing key does not sign: not "
                        "counted (a process with a learner credential and no key of its own?)",
                        name[:64])

    def _verified(self, reports: dict, kind: str) -> dict:
        """With signed contributions on, the end-of-run reports signed by their learner's
        key (a learner credential can write any field of the shared ``done`` hash)."""
        if self.verifier is None:
            return reports
        return {n: rec for n, rec in reports.items()
                if self.verifier.record_ok(self.ctx.keys.run, kind, n, rec)}

    def _recover(self, p: int, blob: bytes) -> FragState:
        """The fragment at its latest committed version: its checkpoint, then the rounds
        committed since replayed (`workers.recovery`)."""
        rec = recovery.recover(self.ctx.r, self.ctx.keys.fragment(p), self.run_cfg,
                               self._shapes(p), self.ctx.task.is_embedding,
                               archive_dir=self.bcfg.archive_dir or None, blob=blob)
        if rec.replayed:
            log.info("fragment %d: checkpoint v%d + %d round(s) replayed in %.2f s → v%d", p,
                     rec.checkpoint_version, rec.replayed, rec.seconds, rec.core.version)
            registry.event(self.ctx.r, self.ctx.keys, "recovered", fragment=p,
                           syncer=self.cfg.syncer_id, checkpoint=rec.checkpoint_version,
                           rounds=rec.replayed, seconds=round(rec.seconds, 3),
                           version=rec.core.version)
        return FragState(rec.core, ckpt_version=rec.checkpoint_version, ckpt_t=time.monotonic(),
                     sent_floor=max(0, rec.checkpoint_version - self.sync.max_staleness))

    def _shapes(self, p: int) -> dict[str, tuple[int, ...]]:
        return {n: self.ctx.shapes[n] for n in self.ctx.fragments[p]}

    def _prior(self, p: int) -> float | None:
        return fragment_prior(self.run_cfg, {n: self.ctx.shapes[n]
                                             for n in self.ctx.fragments[p]})

    def _state_blob(self, core: FragmentSyncer) -> bytes:
        d = core.state_dict()
        d.pop("history")  # kept as per-version snapshots (the `sent:<v>` keys)
        return pack_state(d)

    def _snapshot(self, core: FragmentSyncer) -> bytes:
        return codec.pack_snapshot(self.ctx.keys.run, core.fragment, core.version,
                                   core.snapshot_tensors)

    def _info(self) -> SyncerInfo:
        st = self.stats
        return SyncerInfo(
            endpoint=self.pub.endpoint, fragments=list(self.owned), pid=os.getpid(),
            host=socket.gethostname(), rounds=st.rounds,
            versions={str(p): f.core.version for p, f in self.frags.items()},
            last_reason=st.last_reason, merged=st.merged, dropped=st.dropped,
            dead_lettered=st.dead_lettered, quorum_wait_s=st.quorum_wait_s,
            grace_wait_s=st.grace_wait_s, sync_time_s=max(
                (f.core.sync_time_s for f in self.frags.values()), default=0.0),
            signed=self.verifier is not None,
            verified=sorted(self.known) if self.verifier is not None else [])

    # -- entries ---------------------------------------------------------------------------------

    def _handle(self, entries: list[Entry], check_deliveries: bool = False) -> None:
        digests = self._digests(entries)
        counts: dict[int, dict[str, int]] = {}
        if check_deliveries:
            for p in {e.fragment for e in entries}:
                counts[p] = self.streams.delivery_counts(
                    p, [e.entry_id for e in entries if e.fragment == p])
        for e, digest in zip(entries, digests, strict=True):
            if counts.get(e.fragment, {}).get(e.entry_id, 0) > self.bcfg.max_deliveries:
                self._dead_letter(e, f"delivered more than {self.bcfg.max_deliveries} times")
                continue
            self._offer(e, digest)

    def _digests(self, entries: list[Entry]):
        """The payload SHA-256 of each entry, in order, computed on worker threads (hashlib
        releases the GIL) while this thread merges the entries before it; None for entries
        not ours or already known to wait unparsed for the next round."""
        if len(entries) < 2:
            return [None] * len(entries)
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sha256")
        limit = self.bcfg.max_payload_bytes
        skip = [(f := self.frags.get(e.fragment)) is None or self._defer_unparsed(f, e)
                for e in entries]
        return self._hasher.map(lambda e, s: None if s else payload_digest(e, limit), entries, skip)

    def _dead_letter(self, e: Entry, reason: str, keep_payload: bool = True) -> None:
        log.warning("fragment %d entry %s dead-lettered: %s", e.fragment, e.entry_id, reason)
        self.streams.dead_letter(e.fragment, e, reason, keep_payload)
        self.stats.dead_lettered += 1
        registry.event(self.ctx.r, self.ctx.keys, "dead-letter", fragment=e.fragment,
                       entry=e.entry_id, reason=reason)

    def _offer(self, e: Entry, digest: str | None = None) -> None:
        f = self.frags.get(e.fragment)
        if f is None or e.entry_id in f.entries:
            return  # not ours, or re-delivered while already held in the open round
        if self.verifier is not None:  # before anything else reads the entry
            try:
                self.verifier.verify(self.ctx.keys.run, e.fields)
            except signing.SignatureError as err:
                self._dead_letter(e, f"signature: {err}", keep_payload=False)
                return
        if self._defer_unparsed(f, e):
            f.deferred.append(e)
            return
        try:
            meta, tensors = parse_entry(e.fields, max_bytes=self.bcfg.max_payload_bytes,
                                              payload_sha256=digest)
            if meta.fragment != e.fragment:
                raise DecodeError(f"entry says fragment {meta.fragment}, stream is {e.fragment}")
        except (DecodeError, ValueError) as err:
            self._dead_letter(e, f"malformed entry: {err}")
            return
        if self._fenced(e, meta):
            return
        c = meta.contribution(tensors, entry_id=e.entry_id,
                              nbytes=payload_size(e.fields))
        limit = self.declared.get(meta.learner) or self.ctx.task.tokens_per_step()
        try:
            ok, reason = f.core.offer(c, time.monotonic(), limit)
        except Exception as err:  # noqa: BLE001 - no entry may stop the syncer
            log.exception("fragment %d entry %s: offering it failed", e.fragment, e.entry_id)
            self._dead_letter(e, f"offer failed: {type(err).__name__}: {err}")
            return
        if not ok and reason.kind is Drop.DEFER:
            f.deferred.append(e)
            return
        if meta.final:
            f.final_seen.add(meta.learner)
        if ok:
            f.entries[e.entry_id] = meta  # the payload is merged: only the fields are kept
        else:
            # duplicates and drops are acknowledged in the next commit; drops are recorded
            if reason.kind is Drop.DUPLICATE:
                f.core.note_duplicate(e.entry_id)
                self.stats.duplicated += 1
            else:  # the learner may be waiting for this push's merged value: tell it
                self._note_refused(meta.learner, e.fragment, meta.base_version, meta.step, reason)
            f.ack_extra.append(e.entry_id)
            self.stats.dropped += 1

    def _fenced(self, e: Entry, meta: EntryMeta) -> bool:
        """Dead-letter an entry of a learner process superseded by a newer one of the same id
        (an older epoch than the newest this syncer has seen of it): two processes running
        as one learner must not both contribute. Not a refusal: the learner id's refusal
        record belongs to the newer process."""
        newest = self.epochs.get(meta.learner, 0)
        if meta.epoch >= newest:
            self.epochs[meta.learner] = meta.epoch
            return False
        self.stats.fenced += 1
        self._dead_letter(e, f"fenced: learner {meta.learner!r} epoch {meta.epoch}, superseded "
                             f"by its epoch {newest} (another process joined as this learner)")
        return True

    @staticmethod
    def _defer_unparsed(f: FragState, e: Entry) -> bool:
        """The state machine's deferral rule, judged from the plain fields before parsing: a
        learner several rounds ahead is not re-verified and re-decoded at every close. Anything
        unusual goes the normal way (parse, then the state machine decides)."""
        key = peek_key(e.fields)
        return key is not None and f.core.waits_for_next_round(key[0], key)

    def _claim(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_claim:
            return
        self._next_claim = now + self.bcfg.claim_idle_ms / 2000
        for p in self.owned:
            f = self.frags[p]
            held = list(f.entries) + [e.entry_id for e in f.deferred]
            self.streams.touch(p, self.cfg.syncer_id, held)  # ours are not idle, just waiting
            claimed, deleted = self.streams.autoclaim(self.cfg.syncer_id, p,
                                                      self.bcfg.claim_idle_ms)
            self._lost(p, deleted)
            mine = set(held)
            self._handle([e for e in claimed if e.entry_id not in mine], check_deliveries=True)

    def _lost(self, p: int, ids: list[str]) -> None:
        """Pending entries that vanished from the stream before being merged: say so loudly."""
        if not ids:
            return
        log.error("fragment %d: %d pending entries were deleted before merging: %s", p,
                  len(ids), ids[:5])
        self.stats.lost += len(ids)
        registry.event(self.ctx.r, self.ctx.keys, "lost", fragment=p, entries=ids,
                       reason="deleted from the stream before merging (retention cap)")
        self.streams.ack_only(p, ids)

    # -- rounds ----------------------------------------------------------------------------------

    def _refresh(self) -> None:
        now = time.monotonic()
        if now >= self._next_live:
            self._next_live = now + min(0.25, self.bcfg.heartbeat_s / 2)
            self.live = registry.live_learners(self.ctx.r, self.ctx.keys)
            recs = registry.learner_records(self.ctx.r, self.ctx.keys)
            if self.verifier is not None:  # only heartbeats signed by their learner count
                recs = {n: rec for n, rec in recs.items()
                        if self.verifier.record_ok(self.ctx.keys.run, "heartbeat", n, rec)}
                self._note_unverified(self.live - set(recs))
                self.live = frozenset(n for n in self.live if n in recs)
            self.known = frozenset(recs)
            self.declared = {n: rec.max_tokens_per_step for n, rec in recs.items()
                             if rec.max_tokens_per_step > 0}
            times = [recs[n].step_s for n in self.live if n in recs]
            times = [t for t in times if t]
            if times:
                self.step_time_s = min(times)
        if now >= self._next_lease:
            self._next_lease = now + self.bcfg.lease_ms / 3000
            for p in list(self.owned):
                if not self.streams.acquire_lease(p, self.cfg.syncer_id, self.bcfg.lease_ms):
                    if not self.auto:
                        raise LeaseLost(f"fragment {p}: lease lost")
                    log.warning("fragment %d: lease lost (this syncer stalled longer than "
                                "broker.lease_ms?); another syncer serves it", p)
                    self._drop(p, release=False)
            if self._behind():
                self._resync()
            if self.auto:
                self._rebalance(force=True)
            for p in list(self.owned):
                self._reopen(p)
            registry.register_syncer(self.ctx.r, self.ctx.keys, self.cfg.syncer_id, self._info())

    def _maybe_close(self, p: int, final_expected: set[str] | None) -> bool:
        """Close the fragment's open round if it is due. True when a round was closed (or
        refused)."""
        f = self.frags[p]
        if not f.core.contributors:
            if f.ack_extra and not f.entries:
                self._commit_drops_only(p)
            return False
        now = time.monotonic()
        if final_expected is not None and final_expected <= f.final_seen:
            reason = FINAL_FLUSH
        else:
            d = f.core.decide(now, f.core.counted(self.live), self.step_time_s)
            if not d.close:
                return False
            reason = d.reason
        try:
            self._close(p, reason, now)
        except RoundRefused as e:
            # the merged value would not be finite: nothing is committed, the round's entries
            # are acknowledged as drops with the reason, the fragment keeps its value
            log.error("%s; the round's entries are dropped", e)
            registry.event(self.ctx.r, self.ctx.keys, "round-refused", fragment=p,
                           version=f.core.version, entries=list(f.entries), reason=str(e))
            self.stats.dropped += len(f.entries)
            for meta in f.entries.values():
                self._note_refused(meta.learner, p, meta.base_version, meta.step, str(e))
            f.ack_extra.extend(f.entries)
            f.entries = {}
            self._commit_drops_only(p)
        return True

    def _note_refused(self, learner: str, p: int, base_version: int, step: int,
                      reason: str) -> None:
        if learner not in self.known:  # only registered learners wait for their pushes
            return
        try:
            registry.note_refused(self.ctx.r, self.ctx.keys, learner, p,
                                  Refusal(base_version, step, str(reason)[:500]))
        except redis.RedisError as err:  # the drop itself is recorded with the next commit
            log.warning("could not record the refusal of %s's push: %s", learner, err)

    def _commit_drops_only(self, p: int) -> None:
        """Acknowledge refused entries when no round is open (their drop reasons are logged)."""
        f = self.frags[p]
        for entry_id, reason in f.core.take_drops():
            registry.event(self.ctx.r, self.ctx.keys, "dropped", fragment=p, entry=entry_id,
                           reason=reason)
        self.streams.ack_only(p, f.ack_extra)
        f.ack_extra = []

    def _close(self, p: int, reason: str, now: float) -> None:
        f = self.frags[p]
        t0 = time.monotonic()
        result = f.core.close(now, reason,
                              f.core.round_share(len(f.core.counted(self.live))))
        self.stats.commits += 1
        self.cfg.faults.at("before", self.stats.commits)
        record = self._record(result, t0)
        snapshot = self._snapshot(f.core)
        acks = list(f.entries) + f.ack_extra
        # each included learner's merge record, committed with the round: a learner that
        # receives the value or reads its snapshot finds what it merged
        merged = {n: Merged(f.entries[e].base_version, f.entries[e].step,
                            result.version).to_json()
                  for e, n, *_ in result.included if e in f.entries}
        f.recent.append((record, acks, merged))
        f.keep_snapshot(result.version, snapshot)
        checkpoint = (reason == FINAL_FLUSH or self._checkpoint_due(f))
        floor = self._sent_floor(f, result.version if checkpoint else f.ckpt_version)
        try:
            self.streams.commit_round(
                p, self.cfg.syncer_id, state=self._state_blob(f.core) if checkpoint else None,
                snapshot=snapshot, version=result.version, record=record.to_fields(),
                ack_ids=acks, drop_sent_versions=range(f.sent_floor, floor),
                after=result.version - 1, merged=merged)
            if checkpoint:
                f.ckpt_version, f.ckpt_t = result.version, time.monotonic()
            f.sent_floor = max(f.sent_floor, floor)
        except RoundsLost as e:  # this round is in f.recent: re-committed with the lost ones
            log.error("%s; re-committing", e)
            self._resync()
        except LeaseLost:
            if self.streams.lease_holder(p) is not None:
                if not self.auto:
                    raise  # another syncer owns the fragment now: this one stops
                # sharing: that syncer serves it now (its entries of this round are pending
                # here, and it claims them); this round was not committed
                log.warning("fragment %d: another syncer holds the lease; v%d not committed, "
                            "fragment handed over", p, result.version)
                self._drop(p, release=False)
                return
            # The lease expired under us: Redis was down (redis-py's retries hid it) or came
            # back from its AOF without it. Retake every lease and re-commit what Redis lacks,
            # this round included (it is in f.recent), as after an outage.
            log.warning("fragment %d: lease expired before the commit of v%d; retaking it and "
                        "re-committing", p, result.version)
            self._resync()
        if p not in self.frags:  # the resync found another syncer serving it
            return
        self.cfg.faults.at("after", self.stats.commits)
        self._publish(p, f.core)
        f.core.record_sync_time(time.monotonic() - t0)
        st = self.stats
        st.rounds += 1
        st.merged += len(result.included)
        st.quorum_wait_s, st.grace_wait_s = record.quorum_wait_s, record.grace_wait_s
        st.last_reason = reason
        self._trim(p, f)
        f.entries, f.ack_extra = {}, []
        log.info("fragment %d v%d: %d merged, %d dropped (%s)", p, result.version,
                 len(result.included), len(result.dropped), reason)
        if result.clipped:
            registry.event(self.ctx.r, self.ctx.keys, "clipped", fragment=p,
                           version=result.version, entries=result.clipped,
                           reason=f"norm above {self.sync.guard_norm_k:g} × the recent median")
        if result.outvoted:
            log.warning("fragment %d v%d: %d contribution(s) left out of the robust merge "
                        "(opposed the others): %s", p, result.version, len(result.outvoted),
                        ", ".join(result.outvoted))
            registry.event(self.ctx.r, self.ctx.keys, "outvoted", fragment=p,
                           version=result.version, entries=result.outvoted,
                           reason="direction opposed the consensus of the round's others")
        deferred, f.deferred = f.deferred, []
        for e in deferred:
            self._offer(e)

    def _checkpoint_due(self, f: FragState) -> bool:
        """Whether the round being committed writes the fragment's full state."""
        b = self.bcfg
        return (f.core.version - f.ckpt_version >= b.checkpoint_rounds
                or (b.checkpoint_s > 0 and time.monotonic() - f.ckpt_t >= b.checkpoint_s))

    def _sent_floor(self, f: FragState, ckpt_version: int) -> int:
        """The oldest snapshot to keep: the anchors of stale contributions to the current
        version and to the checkpoint's (recovery replays from there)."""
        return max(0, min(f.core.version, ckpt_version) - self.sync.max_staleness)

    def checkpoint_all(self) -> None:
        """Write the full state of every fragment whose checkpoint is behind its version (the
        end of the run: export and evaluation then read it without replaying)."""
        for p, f in list(self.frags.items()):
            if f.ckpt_version < f.core.version:
                self._checkpoint(p, f)

    def _checkpoint(self, p: int, f: FragState) -> None:
        floor = self._sent_floor(f, f.core.version)
        try:
            self.streams.checkpoint(p, self.cfg.syncer_id, state=self._state_blob(f.core),
                                    version=f.core.version,
                                    drop_sent_versions=range(f.sent_floor, floor))
        except RoundsLost as e:  # a failover lost rounds: re-commit them (a checkpoint too)
            log.error("%s; re-committing", e)
            self._resync()
            return
        f.ckpt_version, f.ckpt_t = f.core.version, time.monotonic()
        f.sent_floor = max(f.sent_floor, floor)

    def _record(self, r: RoundResult, t0: float) -> RoundRecord:
        return RoundRecord(
            version=r.version, fragment=r.fragment, reason=r.reason,
            included=tuple(Included(*x) for x in r.included), dropped=tuple(r.dropped),
            hash=r.sent_hash, tokens=r.tokens, steps=r.steps, scale=r.scale,
            seconds=tuple(r.seconds),
            quorum_wait_s=r.quorum_s - r.first_arrival_s,
            grace_wait_s=max(0.0, r.closed_s - r.quorum_s),
            merge_s=time.monotonic() - t0, syncer=self.cfg.syncer_id, t=time.time())

    def _trim(self, p: int, f: FragState) -> None:
        ids = list(f.entries)
        if not ids:
            return
        f.recent_min_ids.append((f.core.version, min(ids, key=id_key)))
        keep = self.bcfg.keep_rounds
        # the entries of rounds after the checkpoint stay: recovery replays them
        if keep and len(f.recent_min_ids) > keep and f.recent_min_ids[0][0] <= f.ckpt_version + 1:
            _, cut = f.recent_min_ids.pop(0)
            pending = [e.entry_id for e in f.deferred]
            after = [m for v, m in f.recent_min_ids if v > f.ckpt_version]
            floor = min([cut, *after, *pending], key=id_key)
            if self.bcfg.archive_dir:
                try:
                    archive.archive_below(self.ctx.r, self.ctx.keys, p, floor,
                                          self.bcfg.archive_dir)
                except (OSError, ValueError) as e:
                    log.error("fragment %d: archiving before the trim failed (%s); entries kept",
                              p, e)
                    return
            self.streams.trim(p, floor)

    def _publish(self, p: int, core: FragmentSyncer) -> None:
        """Publish the fragment's current value: whole, or a delta with the value's hash."""
        delta = core.sync_cfg.down_delta
        self.pub.publish(codec.global_frames(self.ctx.keys.run, p, core.version, core.sent,
                                             base=core.sent_base,
                                             value=core.sent_hash if delta else ""))

    # -- loop ------------------------------------------------------------------------------------

    def poll_once(self) -> bool:
        """One iteration: read, merge, close due rounds, finish the run. True when done."""
        self.last_tick = time.monotonic()
        self._refresh()
        if self.owned:
            entries = self.streams.read_new(self.cfg.syncer_id, self.owned, count=8,
                                            block_ms=self.bcfg.block_ms)
            self._handle(entries)
        else:  # every fragment is served by another syncer: stand by
            time.sleep(self.bcfg.block_ms / 1000)
        pushed = self._verified(registry.final_pushes(self.ctx.r, self.ctx.keys),
                                "final-pushes")
        final = len(pushed) >= self.run_cfg.learners
        expected = {p: {n for n, rep in pushed.items() if p in rep.final}
                    for p in self.owned} if final else {}
        for p in list(self.owned):
            # a close offers the deferred entries of learners that were a round ahead: their
            # round may be due at once (never wait for the next read's block_ms)
            for _ in range(_CLOSES_PER_POLL):
                if (p not in self.frags or self.frags[p].finished
                        or not self._maybe_close(p, expected.get(p))):
                    break
        self._claim()
        if final and self._finish(expected):
            return True
        if self.cfg.max_rounds and self.stats.rounds >= self.cfg.max_rounds:
            return True
        return registry.stop_requested(self.ctx.r, self.ctx.keys)

    def _finish(self, expected: dict[int, set[str]]) -> bool:
        """After every learner's final pushes: publish final values, record the versions."""
        for p in self.owned:
            f = self.frags[p]
            if (not f.finished and expected[p] <= f.final_seen and not f.core.contributors
                    and not f.deferred):
                f.finished = True
                self._publish(p, f.core)
        if not all(self.frags[p].finished for p in self.owned):
            return False
        self.checkpoint_all()
        versions = {str(p): self.frags[p].core.version for p in self.owned}
        if versions or not self.auto:
            # a report of this syncer from before a restart or a hand-over may name other
            # fragments: kept, so they stay closed
            earlier = registry.syncer_final_reports(self.ctx.r, self.ctx.keys).get(
                self.cfg.syncer_id)
            if earlier is not None:
                versions = {**earlier.versions, **versions}
            registry.mark_syncer_final(self.ctx.r, self.ctx.keys, self.cfg.syncer_id,
                                       SyncerFinal(versions=versions, rounds=self.stats.rounds))
        registry.register_syncer(self.ctx.r, self.ctx.keys, self.cfg.syncer_id, self._info())
        # sharing the fragments: stop once every fragment's final round is recorded (until
        # then, take over the fragments of a syncer that dies before closing them)
        return not self.auto or set(self.sizes) <= self._closed()

    def run_forever(self) -> int:
        """Poll until the run ends; ride out Redis outages (backoff, then resync)."""
        backoff_s, outage_since = 0.1, None
        while True:
            try:
                if outage_since is not None:
                    self._resync()
                    registry.event(self.ctx.r, self.ctx.keys, "syncer-reconnect",
                                   syncer=self.cfg.syncer_id,
                                   down_s=round(time.monotonic() - outage_since, 3))
                    log.warning("Redis is back after %.1f s; state resynced",
                                time.monotonic() - outage_since)
                    outage_since, backoff_s = None, 0.1
                if self.poll_once():
                    self._checkpoint_at_exit()
                    return 0
            except (*OUTAGE, redis.OutOfMemoryError) as e:
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.warning("Redis unreachable (%s); retrying with backoff", e)
                time.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, 2.0)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                outage_since = outage_since or time.monotonic()  # the stream vanished: resync

    def _behind(self) -> bool:
        """Whether Redis lost rounds this syncer committed without it noticing an outage (a
        failover to a replica that had not received them yet; an AOF restart the client's
        retries hid): its last round record is older than this syncer's version."""
        for p, f in self.frags.items():
            if f.core.version == 0:
                continue
            v = recovery.committed_version(self.ctx.r, self.ctx.keys.fragment(p))
            if v is None or v < f.core.version:
                log.error("fragment %d: Redis holds rounds up to v%s, this syncer committed "
                          "v%d", p, v, f.core.version)
                return True
        return False

    def _checkpoint_at_exit(self) -> None:
        """A last checkpoint of every fragment (a restart then replays nothing)."""
        try:
            self.checkpoint_all()
        except (LeaseLost, redis.RedisError) as e:
            log.warning("no checkpoint at exit (%s): a successor replays the rounds since the "
                        "last one", e)

    def _committed_version(self, p: int) -> int:
        """The version Redis holds for fragment p: its last round record's, else its
        checkpoint's (-1: nothing)."""
        v = recovery.committed_version(self.ctx.r, self.ctx.keys.fragment(p))
        if v is not None:
            return v
        blob = self.streams.load_state(p, limit := capacity.state_limit(self._shapes(p)))
        return -1 if blob is None else int(unpack_state(
            blob, max_bytes=limit, shapes=self._shapes(p))["version"])

    def _resync(self) -> None:
        """After an outage: re-create groups, retake leases, re-commit rounds Redis lost."""
        for p, f in list(self.frags.items()):
            self.streams.ensure_group(p)
            if not self.streams.acquire_lease(p, self.cfg.syncer_id, self.bcfg.lease_ms):
                if not self.auto:
                    raise LeaseLost(f"fragment {p}: another syncer took over during the outage")
                self._drop(p, release=False)
                continue
            stored = self._committed_version(p)
            if stored >= f.core.version:
                continue
            lost = [(rec, acks, m) for rec, acks, m in f.recent if rec.version > stored]
            log.error("fragment %d: Redis is at version %d, this syncer at %d; re-committing "
                      "%d round(s)", p, stored, f.core.version, len(lost))
            if not lost or lost[-1][0].version != f.core.version:
                raise LeaseLost(f"fragment {p}: cannot rebuild rounds Redis lost")
            sent = f.snapshots_since(stored, self.ctx.keys.run)
            self.streams.commit_round(
                p, self.cfg.syncer_id, state=self._state_blob(f.core),
                snapshot=sent[f.core.version], version=f.core.version,
                record=lost[-1][0].to_fields(),
                earlier_records=[rec.to_fields() for rec, *_ in lost[:-1]],
                ack_ids=[i for _, acks, _ in lost for i in acks], extra_sent=sent,
                merged={n: m for *_, ms in lost for n, m in ms.items()})  # the latest wins
            f.ckpt_version, f.ckpt_t = f.core.version, time.monotonic()
            registry.event(self.ctx.r, self.ctx.keys, "recommit", fragment=p,
                           redis_version=stored, version=f.core.version)


# /healthz fails when the syncer's loop (or its standby wait) has not gone round for this long
LIVENESS_S = 60.0


def main(cfg: SyncerConfig) -> int:
    """Run one syncer until the run ends (or `max_rounds`). Returns the exit code."""
    heap.return_freed_memory()  # before the merge threads: what a round frees goes back
    native.install()
    kernels.set_threads(cfg.merge_threads or min(8, len(os.sched_getaffinity(0))))
    apply_environment()
    ctx = open_run(cfg.redis_url, cfg.run, wait_s=cfg.wait_config_s, task=cfg.task)
    # a run stored without the check (an earlier version's `init`) meets it here, before any
    # value is written: one line naming the setting, not a broken pipe at version 0
    refused = capacity.check(ctx.cfg, ctx.shapes, ctx.task.is_embedding, value_limits(
        ctx.r, ctx.cfg.broker.max_payload_bytes, ctx.cfg.broker.piece_bytes))
    if refused:
        log.error("run %r cannot start: %s", cfg.run, refused)
        return 2
    zctx = zmq.Context()
    s = Syncer(cfg, ctx, zctx)
    if cfg.metrics_port:
        from workers.metrics import serve, stalled, syncer_spec

        serve(cfg.metrics_port, "diloco_syncer", syncer_spec(s), addr=cfg.metrics_host,
              live=stalled(lambda: s.last_tick, lambda: LIVENESS_S, "the syncer loop"),
              ready=lambda: None if s.phase in ("active", "standing by") else "starting")
    try:
        if s.run_finished():
            log.info("run %r has finished (every learner's final report is in and the final "
                     "rounds of fragments %s are closed): nothing to do", cfg.run, s.owned)
            return 0
        s.start()
        return s.run_forever()
    finally:
        s.pub.close()
        try:
            for p in s.owned:
                s.streams.release_lease(p, cfg.syncer_id)
            if s.auto:
                registry.syncer_leave(s.ctx.r, s.ctx.keys, cfg.syncer_id)
        except redis.RedisError as e:
            log.warning("could not hand over the fragments at exit (%s): the others take them "
                        "when the leases run out", e)
        zctx.term()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.exit(main(parse_args()))
