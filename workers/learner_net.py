"""The learner's network thread: pushes out, merged values in, heartbeats, snapshot repairs.

The training loop never waits on Redis or ZeroMQ: it hands pushes to this thread and drains
an inbox of decoded merged values between steps. The thread owns the SUB socket (ZeroMQ
sockets are not thread-safe). Redis outages are ridden out with backoff; pushes wait in an
in-memory queue until Redis takes them.

With the delta down link (`sync.down_delta`) a merged value arrives as a delta against the
previous version: the thread keeps the value it last delivered per fragment (the reference),
adds the delta and checks the result's SHA-256 against the one the syncer sent. A delta whose
base it does not hold (a missed message, or one that arrived before the learner's first
snapshot) is held back and the fragment's snapshot is read; held deltas that follow it are
then applied in order.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis
import zmq

from broker import attest, registry, signing
from broker.connection import OUTAGE
from broker.pubsub import CurveClient, Subscriber
from broker.records import Heartbeat
from broker.streams import FragmentStreams, StreamExhausted
from pipeline.contribution import MergeRecord
from pipeline.downlink import apply_delta
from pipeline.learner import UNKNOWN, MergedValue
from pipeline.quant import tensors_hash
from workers.common import RunContext, decode_values
from workers.learner_snapshots import SnapshotRepair

log = logging.getLogger("diloco.learner")


def read_push_log(path: Path):
    """The records of a learner's push log (attempts, acknowledgements), in order; a last line
    cut short by a crash is skipped (that XADD's result was never recorded), and so is any
    other line that is not JSON (bytes that are not UTF-8 included)."""
    for line in path.read_text(errors="replace").splitlines():
        try:
            yield json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue


@dataclass
class NetStats:
    pushes_attempted: int = 0
    rejected: int = 0  # merged values that failed a check (never applied)
    pushes_acked: int = 0
    push_errors: int = 0
    bytes_sent: int = 0
    snapshot_bytes: int = 0
    snapshots_read: int = 0
    repushed: int = 0
    zmq_gaps: int = 0
    deltas_held: int = 0  # delta values that arrived before their base (resolved by snapshot)
    merge_reads: int = 0  # merge records read from Redis (a join, a missed message, a snapshot)
    redis_down_s: float = 0.0


def _read_only(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`values`, made read-only: the delta down link's reference, whose arrays the trainer
    shares (one copy of each fragment, not two); a write into one raises instead of changing
    the value the next delta applies to."""
    for v in values.values():
        v.flags.writeable = False
    return values


class LearnerNet(threading.Thread):
    """Background I/O of one learner (see module docstring)."""

    def __init__(self, ctx: RunContext, learner_id: str, zctx: zmq.Context,
                 acked_log: Path | None = None, sub_endpoints: tuple[str, ...] = (),
                 curve: CurveClient | None = None):
        super().__init__(name=f"net-{learner_id}", daemon=True)
        self.ctx = ctx
        self.id = learner_id
        self.bcfg = ctx.cfg.broker
        self.streams = FragmentStreams(ctx.r, ctx.keys, max_entries=self.bcfg.stream_max_entries,
                                       wait_replicas=self.bcfg.wait_replicas,
                                       wait_timeout_ms=self.bcfg.wait_timeout_ms,
                                       piece_bytes=self.bcfg.piece_bytes)
        self.sub = Subscriber(zctx, range(len(ctx.fragments)), hwm=self.bcfg.zmq_hwm,
                              max_bytes=self.bcfg.max_payload_bytes, curve=curve)
        self.outbox: queue.Queue = queue.Queue()
        # merged values for the training loop, and the answers of `serve_lookups` (the
        # island's `MergedLookup.serve`, run on this thread)
        self.inbox: queue.Queue = queue.Queue()
        self.serve_lookups: Callable[[], None] | None = None
        # with CURVE, what the syncers attested (`broker.attest`): a snapshot read from Redis
        # is taken only when it is that (`workers.learner_snapshots`)
        sync = ctx.cfg.effective_sync()
        self.attested = attest.Attestations(ctx.keys.run, len(ctx.fragments), curve is not None,
                                            "fp32" if sync.down_delta else sync.codec_down)
        self.snapshots = SnapshotRepair(self)
        self.snapshot_requests = self.snapshots.requests
        self.progress: dict = {}  # the training loop's latest figures, sent with each heartbeat
        self.redis_down = False  # Redis failed this thread's last call (and no call since)
        self.stats = NetStats()
        self.stop_event = threading.Event()
        self.stop_seen = False
        self.finish_seen = False
        self.epoch = 0  # this process's epoch of its learner id (set at the join)
        self.sign_key: bytes | None = None  # signed runs: only a signed newer claim counts
        self._exhausted_said = 0.0  # when a blocked stream may be logged again
        self._push_again_at = 0.0  # pushes wait until then (a blocked stream)
        self._epoch_error = False  # logged once
        self.superseded: int | None = None  # a newer epoch seen: this thread stopped
        self._unsent: list[tuple[int, dict]] = []
        self._last_version: dict[int, int] = {}
        self._lock = threading.Lock()  # _last_version and _ref: joined_at runs in the trainer
        # fragment → the value last delivered (the delta down link's reference)
        self._ref: dict[int, dict[str, np.ndarray]] = {}
        self._delta = ctx.cfg.effective_sync().down_delta
        # the "rebase" apply rule needs to know which of this learner's pushes a value holds
        self._rebase = ctx.cfg.effective_sync().apply == "rebase"
        self._held: dict[int, dict[int, tuple]] = {}  # fragment → version → (header, tensors)
        # fragment → (version, this learner's last merged push as of that value)
        self._merged: dict[int, tuple[int, MergeRecord | None]] = {}
        self._last_push: dict[int, tuple[str, dict]] = {}  # fragment → (entry id, fields)
        self._acked_log = open(acked_log, "a", buffering=1) if acked_log else None
        self._sub_endpoints = list(sub_endpoints)
        self._flushed = threading.Condition()

    # -- called from the training thread -----------------------------------------------------

    def push(self, fragment: int, fields: dict) -> None:
        self.stats.pushes_attempted += 1
        if self._acked_log is not None:
            self._acked_log.write(json.dumps({
                "attempt": True, "fragment": fragment, "learner": self.id,
                "run": self.ctx.run_hash,
                "base_version": int(fields["base_version"]), "step": int(fields["step"]),
                "t": time.time()}) + "\n")
        self.outbox.put((fragment, fields))

    def report(self, **progress) -> None:
        """The training loop's latest figures (step, tokens, loss…) for the next heartbeat."""
        self.progress = progress

    def joined_at(self, fragment: int, version: int,
                  values: dict[str, np.ndarray] | None = None) -> None:
        """The learner started from `version` of `fragment` (read from its snapshot): an
        older value arriving later is not delivered, and `values` is the reference the next
        delta applies to."""
        with self._lock:
            if version >= self._last_version.get(fragment, -1):
                self._last_version[fragment] = version
                if values is not None and self._delta:
                    self._ref[fragment] = _read_only(  # shared with the trainer, as above
                        {k: np.asarray(v, np.float32) for k, v in values.items()})

    @property
    def bytes_received(self) -> int:
        """Bytes received: ZeroMQ frames of merged values plus snapshot reads."""
        return self.stats.snapshot_bytes + self.sub.received_bytes

    def request_snapshot(self, fragment: int) -> None:
        self.snapshot_requests.put(fragment)

    def wait_flushed(self, timeout_s: float) -> bool:
        """Block until every queued push is in Redis (or the timeout passes)."""
        deadline = time.monotonic() + timeout_s
        with self._flushed:
            while self.outbox.unfinished_tasks or self._unsent:
                left = deadline - time.monotonic()
                if left <= 0 or self.superseded is not None or (
                        self.ident is not None and not self.is_alive()):
                    return False  # (a stopped thread sends nothing more)
                self._flushed.wait(min(left, 0.1))
        return True

    # -- the thread --------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._loop()
        except zmq.ContextTerminated:
            # the island ended the ZeroMQ context while this thread was still in a Redis call
            # (close() stops waiting for it): the socket must still be closed, or the
            # context's termination waits for it forever
            log.info("%s: ZeroMQ context ended; network thread stopping", self.id)
        finally:
            self.sub.close()

    def _loop(self) -> None:
        next_hb = next_ep = 0.0
        down_since: float | None = None
        while not self.stop_event.is_set():
            now = time.monotonic()
            try:
                if now >= next_ep:
                    self.sub.connect(self._sub_endpoints
                                     or registry.endpoints(self.ctx.r, self.ctx.keys))
                    self.stop_seen = registry.stop_requested(self.ctx.r, self.ctx.keys)
                    self.finish_seen = registry.finish_requested(self.ctx.r, self.ctx.keys)
                    next_ep = now + 1.0
                if now >= next_hb:
                    if self._superseded():
                        return
                    registry.heartbeat(self.ctx.r, self.ctx.keys, self.id, Heartbeat(
                        **self.progress, **self._stats_info()), self.bcfg.heartbeat_ttl_s,
                        sign=self._sign_heartbeat if self.sign_key is not None else None)
                    next_hb = now + self.bcfg.heartbeat_s
                if now >= self._push_again_at:
                    self._send_pushes()
                if self.stop_event.is_set():  # superseded: nothing more, not even a repair
                    return
                self.snapshots.serve()
                if self.serve_lookups is not None:
                    self.serve_lookups()
                if down_since is not None:
                    self._verify_last_pushes()
                    self.stats.redis_down_s += now - down_since
                    registry.event(self.ctx.r, self.ctx.keys, "reconnect", learner=self.id,
                                   down_s=round(now - down_since, 3))
                    down_since = None
                    self.redis_down = False
            except StreamExhausted as e:  # the syncer sets the stream back: pushes stay queued
                if now >= self._exhausted_said:
                    log.warning("%s: %s; retrying", self.id, e)
                    self._exhausted_said = now + 30.0
                self._push_again_at = now + 1.0  # not the whole payload 50 times a second
            except (*OUTAGE, redis.OutOfMemoryError) as e:
                # unreachable, or full (maxmemory + noeviction): pushes stay queued
                if down_since is None:
                    down_since = now
                    self.redis_down = True
                    log.warning("%s: Redis unreachable (%s); training on, retrying", self.id, e)
                next_ep = now + 0.5
            self._receive(timeout_ms=20)

    def _sign_heartbeat(self, rec: Heartbeat) -> Heartbeat:
        assert self.sign_key is not None
        return signing.sign_record(self.sign_key, self.ctx.keys.run, "heartbeat", self.id, rec)

    def _stats_info(self) -> dict:
        s = self.stats
        return {"pushes_attempted": s.pushes_attempted, "pushes_acked": s.pushes_acked,
                "bytes_sent": s.bytes_sent, "bytes_received": self.bytes_received,
                "snapshots_read": s.snapshots_read,
                "handshake_failures": dict(self.sub.handshake_failures)}

    def _superseded(self) -> bool:
        """Whether a newer process has joined as this learner (a newer epoch in Redis): then
        this thread stops for good — no push, no heartbeat — and the island raises
        `Superseded` at its next look. Read before every heartbeat and every batch of
        pushes, so a partitioned learner coming back pushes nothing once replaced."""
        if not self.epoch:
            return False
        try:
            latest = registry.newer_epoch(self.ctx.r, self.ctx.keys, self.id, self.epoch,
                                          self.sign_key)
        except redis.ResponseError as e:  # a key of the wrong type: not a claim
            if not self._epoch_error:
                log.warning("%s: cannot read this learner's epoch (%s); ignored", self.id, e)
            self._epoch_error = True
            return False
        if latest is None:
            return False
        self.superseded = latest
        log.error("%s: another process joined the run as this learner (epoch %d, this one %d):"
                  " stopping, %d pushes not sent", self.id, latest, self.epoch,
                  len(self._unsent) + self.outbox.qsize())
        self.stop_event.set()
        return True

    def _send_pushes(self) -> None:
        if (self._unsent or not self.outbox.empty()) and self._superseded():
            return
        while True:
            if not self._unsent:
                try:
                    item = self.outbox.get_nowait()
                except queue.Empty:
                    return
                self._unsent.append(item)
                self.outbox.task_done()
            fragment, fields = self._unsent[0]
            entry_id = self.streams.push(fragment, fields)  # raises when Redis is down
            self._unsent.pop(0)
            self._acked(fragment, entry_id, fields)
            self.stats.bytes_sent += sum(len(k) + len(v if isinstance(v, bytes | str) else str(v))
                                         for k, v in fields.items())
            with self._flushed:
                self._flushed.notify_all()

    def _acked(self, fragment: int, entry_id: str, fields: dict, repush: bool = False) -> None:
        self.stats.pushes_acked += 1
        self._last_push[fragment] = (entry_id, fields)
        if self._acked_log is not None:  # the chaos harness's independent record of acks
            self._acked_log.write(json.dumps({
                "id": entry_id, "fragment": fragment, "learner": self.id,
                "run": self.ctx.run_hash,
                "base_version": int(fields["base_version"]), "step": int(fields["step"]),
                "repush": repush, "t": time.time()}) + "\n")

    def _verify_last_pushes(self) -> None:
        """After an outage: a push Redis acknowledged but lost (restart from an AOF missing its
        last second) is pushed again; the syncer dedupes if it was merged after all."""
        for p, (entry_id, fields) in list(self._last_push.items()):
            if self.ctx.r.xrange(self.ctx.keys.fragment(p).frags, entry_id, entry_id):
                continue
            new_id = self.streams.push(p, fields)
            self.stats.repushed += 1
            log.warning("%s: push %s of fragment %d vanished from Redis; pushed again as %s",
                        self.id, entry_id, p, new_id)
            registry.event(self.ctx.r, self.ctx.keys, "repush", learner=self.id, fragment=p,
                           lost_id=entry_id, new_id=new_id)
            self._acked(p, new_id, fields, repush=True)

    def _merged_push(self, p: int) -> MergeRecord | str | None:
        """This learner's last push of fragment p that a round merged (base version, step,
        the round's version), read when a value arrives: the syncer commits it with the round's
        value, so a value newer than the record's round holds no later push of this learner.
        `UNKNOWN` when Redis cannot say now (and for "overwrite", which does not ask)."""
        if not self._rebase or self.redis_down:
            return UNKNOWN
        try:
            self.stats.merge_reads += 1
            rec = registry.merged(self.ctx.r, self.ctx.keys, self.id, p)
        except (*OUTAGE, redis.RedisError) as e:
            log.warning("%s: could not read the merge record of fragment %d (%s)", self.id, p, e)
            return UNKNOWN
        return rec

    def _merged_as_of(self, header) -> MergeRecord | str | None:
        """This learner's last merged push of the value's fragment, at least as new as the
        value. A published message carries its round's merge records: following the value
        whose record this thread knows, it says the record without a Redis read. Otherwise
        (the first value, a missed one, a re-publish, a snapshot) it is read after the value:
        the syncer commits a round's records with its value, so the record read is at least
        as new as the value."""
        p, v = header.fragment, header.version
        known = self._merged.get(p)
        if header.merged is not None and known is not None and known[0] == v - 1:
            rec, mine = known[1], header.merged.get(self.id)
            if mine is not None and (rec is None or rec.version < v):
                rec = MergeRecord(*mine, v)
        else:
            rec = self._merged_push(p)
        if rec == UNKNOWN:
            self._merged.pop(p, None)
        else:
            self._merged[p] = (v, rec)
        return rec

    def _receive(self, timeout_ms: int) -> None:
        errors = self.sub.decode_errors
        msg = self.sub.recv(timeout_ms)
        if self.sub.decode_errors != errors:
            self._reject(None, f"malformed merged value: {self.sub.last_error}")
        if msg is None:
            return
        if isinstance(msg, attest.Attestation):
            return self.attested.note_all(msg)
        header, tensors = msg
        # a published value is the syncers' word on its version's hash, as an attestation is
        self.attested.note(header.run, header.fragment, header.version,
                           header.value or header.sha256)
        last = self._last_version.get(header.fragment)
        if last is not None and header.version > last + 1:
            # A missed message: the new one carries the whole value, so nothing is lost, but
            # it is counted (a steady gap rate means the HWM is too small for the link).
            self.stats.zmq_gaps += 1
        self._deliver(header, tensors)

    def _deliver(self, header, tensors: dict) -> None:
        """Hand a merged value (a message or a snapshot) to the training loop, once it has
        passed every check."""
        p, version = header.fragment, header.version
        if version <= self._last_version.get(p, -1):
            return
        problem = self.check_value(header, tensors)
        if problem:
            return self._reject(p, problem)
        with self._lock:
            if header.base >= 0:
                if header.base != self._last_version.get(p, -1) or p not in self._ref:
                    return self._hold(p, header, tensors)
                values = apply_delta(self._ref[p], tensors)
            else:
                values = decode_values(tensors)
            if not all(np.isfinite(v).all() for v in values.values()):
                return self._reject(p, f"non-finite values in version {version}")
            if header.value and tensors_hash(values) != header.value:
                self.snapshot_requests.put(p)
                return self._reject(p, f"version {version} decodes to a value whose SHA-256 "
                                    f"differs from the syncer's; reading the snapshot")
            self._last_version[p] = version
            if self._delta:  # the reference the next delta applies to: shared with the
                self._ref[p] = _read_only(values)  # trainer, which never writes into it
        self.inbox.put(MergedValue(p, version, values, self._merged_as_of(header)))
        held = self._held.get(p)
        if held:
            for v in [v for v in held if v <= version]:
                del held[v]
            if held:
                nxt = min(held)
                if held[nxt][0].base == version:
                    self._deliver(*held.pop(nxt))

    def check_value(self, header, tensors: dict) -> str | None:
        """Why a merged value (message or snapshot) is not one of this run's fragments'
        (None: it is): its run, fragment, tensor names and shapes."""
        p = header.fragment
        if header.run != self.ctx.keys.run:
            return f"a value of run {header.run!r}, not {self.ctx.keys.run!r}"
        if not 0 <= p < len(self.ctx.fragments):
            return f"fragment {p} is not one of the run's"
        want = {n: tuple(self.ctx.shapes[n]) for n in self.ctx.fragments[p]}
        got = {n: tuple(q.shape) for n, q in tensors.items()}
        if got != want:
            return "tensors do not match the fragment's names and shapes"
        return None

    def _hold(self, p: int, header, tensors: dict) -> None:
        """A delta whose base this learner does not hold: keep it (a bounded few per
        fragment) and read the fragment's snapshot, after which it may apply."""
        held = self._held.setdefault(p, {})
        if len(held) >= 16:
            held.pop(min(held))
        held[header.version] = (header, tensors)
        self.stats.deltas_held += 1
        self.snapshot_requests.put(p)

    def _reject(self, p: int | None, reason: str) -> None:
        """A merged value (message or snapshot) that fails a check: counted, logged and
        recorded as a `bad-global` event (the first 100), never applied."""
        self.stats.rejected += 1
        log.error("%s: rejected a merged value%s: %s", self.id,
                  "" if p is None else f" of fragment {p}", reason)
        if self.stats.rejected <= 100:
            try:
                registry.event(self.ctx.r, self.ctx.keys, "bad-global", learner=self.id,
                               fragment=-1 if p is None else p, reason=reason)
            except (redis.RedisError, *OUTAGE):
                pass  # the log line stands; Redis being away is handled by the loop

    def close_unstarted(self) -> None:
        """Release what the constructor opened, for a thread that was never started."""
        self.sub.close()
        if self._acked_log is not None:
            self._acked_log.close()

    def close(self, timeout_s: float = 5.0) -> None:
        self.stop_event.set()
        self.join(timeout_s)
        if self._acked_log is not None:
            self._acked_log.close()
