"""The syncer's intake: entries read from the fragment streams, verified, parsed, fenced and
offered to their fragment's open round — or deferred, acknowledged as drops, or dead-lettered
with a reason. Nothing an entry holds may stop the syncer."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import redis

from broker import registry, signing
from broker.entries import parse_entry, payload_size, peek_key
from broker.errors import DecodeError
from broker.records import Drop, Refusal
from broker.streams import Entry
from pipeline.contribution import Contribution, PushHeader
from workers.syncer_state import FragState, SyncerShared, payload_digest

log = logging.getLogger("diloco.syncer")


class Intake:
    """Entries in (see module docstring)."""

    def __init__(self, sh: SyncerShared):
        self.sh = sh
        self._hasher: ThreadPoolExecutor | None = None
        self._next_claim = 0.0
        self._unverified_seen: set[str] = set()

    def handle(self, entries: list[Entry], check_deliveries: bool = False) -> None:
        """Offer each entry; one delivered more than `broker.max_deliveries` times (it made
        a syncer fail before) is dead-lettered instead."""
        digests = self._digests(entries)
        counts: dict[int, dict[str, int]] = {}
        if check_deliveries:
            for p in {e.fragment for e in entries}:
                counts[p] = self.sh.streams.delivery_counts(
                    p, [e.entry_id for e in entries if e.fragment == p])
        most = self.sh.bcfg.max_deliveries
        for e, digest in zip(entries, digests, strict=True):
            if counts.get(e.fragment, {}).get(e.entry_id, 0) > most:
                self.dead_letter(e, f"delivered more than {most} times")
                continue
            self.offer(e, digest)

    def _digests(self, entries: list[Entry]):
        """The payload SHA-256 of each entry, in order, computed on worker threads (hashlib
        releases the GIL) while this thread merges the entries before it; None for entries
        not ours or already known to wait unparsed for the next round."""
        if len(entries) < 2:
            return [None] * len(entries)
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sha256")
        limit = self.sh.bcfg.max_payload_bytes
        skip = [(f := self.sh.frags.get(e.fragment)) is None or defer_unparsed(f, e)
                for e in entries]
        return self._hasher.map(lambda e, s: None if s else payload_digest(e, limit), entries, skip)

    def dead_letter(self, e: Entry, reason: str, keep_payload: bool = True) -> None:
        log.warning("fragment %d entry %s dead-lettered: %s", e.fragment, e.entry_id, reason)
        self.sh.streams.dead_letter(e.fragment, e, reason, keep_payload)
        self.sh.stats.dead_lettered += 1
        self.sh.event("dead-letter", fragment=e.fragment, entry=e.entry_id, reason=reason)

    def offer(self, e: Entry, digest: str | None = None) -> None:
        """Verify, parse and offer one entry to its fragment's open round."""
        f = self.sh.frags.get(e.fragment)
        if f is None or e.entry_id in f.entries:
            return  # not ours, or re-delivered while already held in the open round
        if self.sh.verifier is not None:  # before anything else reads the entry
            try:
                self.sh.verifier.verify(self.sh.ctx.keys.run, e.fields)
            except signing.SignatureError as err:
                self.dead_letter(e, f"signature: {err}", keep_payload=False)
                return
        if defer_unparsed(f, e):
            f.deferred.append(e)
            return
        try:
            meta, tensors = parse_entry(e.fields, max_bytes=self.sh.bcfg.max_payload_bytes,
                                        payload_sha256=digest)
            if meta.fragment != e.fragment:
                raise DecodeError(f"entry says fragment {meta.fragment}, stream is {e.fragment}")
        except (DecodeError, ValueError) as err:
            self.dead_letter(e, f"malformed entry: {err}")
            return
        if self._fenced(e, meta):
            return
        c = Contribution.of(meta, tensors, entry_id=e.entry_id, nbytes=payload_size(e.fields))
        limit = self.sh.declared.get(meta.learner) or self.sh.ctx.task.tokens_per_step()
        try:
            ok, reason = f.core.offer(c, time.monotonic(), limit)
        except Exception as err:  # noqa: BLE001 - no entry may stop the syncer
            log.exception("fragment %d entry %s: offering it failed", e.fragment, e.entry_id)
            self.dead_letter(e, f"offer failed: {type(err).__name__}: {err}")
            return
        if not ok and reason.kind is Drop.DEFER:
            f.deferred.append(e)
            return
        if meta.final:
            f.final_seen.add(meta.learner)
        if ok:
            f.entries[e.entry_id] = meta  # the payload is merged: only the fields are kept
            return
        # duplicates and drops are acknowledged in the next commit; drops are recorded
        if reason.kind is Drop.DUPLICATE:
            f.core.note_duplicate(e.entry_id)
            self.sh.stats.duplicated += 1
        else:  # the learner may be waiting for this push's merged value: tell it
            self.note_refused(meta.learner, e.fragment, meta.base_version, meta.step, reason)
        f.ack_extra.append(e.entry_id)
        f.drop_keys[e.entry_id] = (meta.learner, meta.base_version, meta.step)
        self.sh.stats.dropped += 1

    def _fenced(self, e: Entry, meta: PushHeader) -> bool:
        """Dead-letter an entry of a learner process superseded by a newer one of the same id
        (an older epoch than the newest this syncer has seen of it): two processes running
        as one learner must not both contribute. Not a refusal: the learner id's refusal
        record belongs to the newer process."""
        newest = self.sh.epochs.get(meta.learner, 0)
        if meta.epoch >= newest:
            self.sh.epochs[meta.learner] = meta.epoch
            return False
        self.sh.stats.fenced += 1
        self.dead_letter(e, f"fenced: learner {meta.learner!r} epoch {meta.epoch}, superseded "
                            f"by its epoch {newest} (another process joined as this learner)")
        return True

    def note_refused(self, learner: str, p: int, base_version: int, step: int,
                     reason: str) -> None:
        if learner not in self.sh.known:  # only registered learners wait for their pushes
            return
        try:
            registry.note_refused(self.sh.ctx.r, self.sh.ctx.keys, learner, p,
                                  Refusal(base_version, step, str(reason)[:500]))
        except redis.RedisError as err:  # the drop itself is recorded with the next commit
            log.warning("could not record the refusal of %s's push: %s", learner, err)

    def note_unverified(self, names: Iterable[str]) -> None:
        """A warning, once per learner id, for a live heartbeat its learner's key does not
        sign: a process with a learner credential but not that learner's signing key."""
        for name in sorted(set(names) - self._unverified_seen):
            self._unverified_seen.add(name)
            log.warning("learner %r has a live heartbeat its signing key does not sign: not "
                        "counted (a process with a learner credential and no key of its own?)",
                        name[:64])

    def claim(self, force: bool = False) -> None:
        """Keep the entries held here from looking idle, and claim those another consumer
        read and left idle longer than `broker.claim_idle_ms`."""
        now = time.monotonic()
        if not force and now < self._next_claim:
            return
        self._next_claim = now + self.sh.bcfg.claim_idle_ms / 2000
        me = self.sh.cfg.syncer_id
        for p in self.sh.owned:
            f = self.sh.frags[p]
            held = list(f.entries) + [e.entry_id for e in f.deferred]
            self.sh.streams.touch(p, me, held)  # ours are not idle, just waiting
            claimed, deleted = self.sh.streams.autoclaim(me, p, self.sh.bcfg.claim_idle_ms)
            self.lost(p, deleted)
            mine = set(held)
            self.handle([e for e in claimed if e.entry_id not in mine], check_deliveries=True)

    def lost(self, p: int, ids: list[str]) -> None:
        """Pending entries that vanished from the stream before being merged: say so loudly."""
        if not ids:
            return
        log.error("fragment %d: %d pending entries were deleted before merging: %s", p,
                  len(ids), ids[:5])
        self.sh.stats.lost += len(ids)
        self.sh.event("lost", fragment=p, entries=ids,
                      reason="deleted from the stream before merging (retention cap)")
        self.sh.streams.ack_only(p, ids)

    def reopen(self, p: int) -> None:
        """A stream an entry of the largest id blocks (a learner credential may name ids) is
        set back, so learners' pushes go in again."""
        back = self.sh.streams.reopen_exhausted(p)
        if back is not None:
            self.sh.stats.dead_lettered += 1
            log.warning("fragment %d: an entry with the largest stream id blocked every push; "
                        "dead-lettered, the stream set back to %s", p, back)
            self.sh.event("stream-reopened", fragment=p, to=back)


def defer_unparsed(f: FragState, e: Entry) -> bool:
    """The state machine's deferral rule, judged from the plain fields before parsing: a
    learner several rounds ahead is not re-verified and re-decoded at every close. Anything
    unusual goes the normal way (parse, then the state machine decides)."""
    key = peek_key(e.fields)
    return key is not None and f.core.waits_for_next_round(key[0], key)
