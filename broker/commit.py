"""A fragment's committed state: its lease, the fenced round commit, checkpoints, version 0,
and reading them back.

Every write here is one MULTI/EXEC on keys that share the fragment's hash tag, fenced by the
fragment lease (WATCH): the published snapshot, the round record and the XACKs (and, every
few rounds, the fragment's full state: a checkpoint) land together or not at all. Values
larger than ``broker.piece_bytes`` are staged in pieces first (`broker.pieces`) and named in
that transaction.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import redis

from broker import pieces
from broker.errors import BrokerError
from broker.ids import as_text
from broker.keys import GROUP, RunKeys

log = logging.getLogger("diloco.streams")

# Extend the lease only if we still hold it (atomic compare-and-expire).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class RoundsLost(BrokerError):
    """Redis lacks rounds this syncer committed (a failover or a restart lost them)."""


class LeaseLost(BrokerError):
    """The fragment's lease is held by another syncer: this one must stop committing."""


def _fenced(e: redis.WatchError, p: int, what: str) -> Exception:
    """What a failed fenced write means: another syncer changed the lease (`LeaseLost`) —
    unless redis-py raised the WatchError because the connection died while watching (a
    value over Redis's limits, a restart): that is an outage, retried as one, not a lost lease.
    """
    if "occurred while watching" in str(e):
        return redis.ConnectionError(f"fragment {p}: the connection to Redis dropped during "
                                     f"{what} ({e})")
    return LeaseLost(f"fragment {p}: lease changed during {what}")



class FencedState:
    """The fenced writes and reads of a fragment's committed state (the `state` of
    :class:`broker.streams.FragmentStreams`)."""

    r: redis.Redis
    keys: RunKeys
    piece_bytes: int

    def __init__(self, r: redis.Redis, keys: RunKeys, piece_bytes: int):
        self.r = r
        self.keys = keys
        self.piece_bytes = piece_bytes  # a larger value is stored in pieces (`broker.pieces`)
        self._renew = r.register_script(_RENEW)
        self._lease_ms = 0  # as last taken (`acquire_lease`): staging extends it by as much
        self._held: dict[int, str] = {}  # fragment → owner, of the leases taken here

    def acquire_lease(self, p: int, owner: str, lease_ms: int) -> bool:
        """Take the fragment's lease if free (or extend it if ours)."""
        key = self.keys.fragment(p).lease
        self._lease_ms = lease_ms
        got = bool(self.r.set(key, owner.encode(), nx=True, px=lease_ms)
                   or self._renew(keys=[key], args=[owner.encode(), lease_ms]))
        if got:
            self._held[p] = owner
        else:
            self._held.pop(p, None)
        return got

    def _extend_held(self, also: Mapping[int, str] | None = None) -> None:
        """Each lease taken here (and `also`'s) extended by the period last taken, where its
        owner still holds it (`_RENEW`: a lease another syncer holds now is left alone)."""
        if self._lease_ms:
            for q, who in {**self._held, **(also or {})}.items():
                self._renew(keys=[self.keys.fragment(q).lease],
                            args=[who.encode(), self._lease_ms])

    @contextmanager
    def leases_kept(self, limit_s: float) -> Iterator[None]:
        """The leases taken here extended every lease period / 3 by a thread while the block
        runs (the close of a fragment of 100M+ values outlasts a lease: without this its
        commit would find the lease expired), for `limit_s` at most: a block that hangs loses
        its leases as a stalled syncer does."""
        stop = threading.Event()

        def keep() -> None:
            deadline = time.monotonic() + limit_s
            while not stop.wait(max(self._lease_ms, 300) / 3000) and \
                    time.monotonic() < deadline:
                try:
                    self._extend_held()
                except redis.RedisError:  # an outage: the syncer's loop handles it
                    return

        thread = threading.Thread(target=keep, name="lease-keeper", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def lease_holder(self, p: int) -> str | None:
        """The id of the syncer holding the fragment's lease (None: nobody)."""
        holder = self.r.get(self.keys.fragment(p).lease)
        return None if holder is None else as_text(holder)

    def release_lease(self, p: int, owner: str) -> None:
        self._held.pop(p, None)
        key = self.keys.fragment(p).lease
        pipe = self.r.pipeline(transaction=True)
        try:
            pipe.watch(key)
            if pipe.get(key) == owner.encode():
                pipe.multi()
                pipe.delete(key)
                pipe.execute()
        except redis.WatchError:
            pass
        finally:
            pipe.reset()

    def has_state(self, p: int) -> bool:
        return bool(self.r.exists(self.keys.fragment(p).state))

    def load_state(self, p: int, max_bytes: int) -> bytes | bytearray | None:
        """The fragment's checkpoint (None: none yet), of at most `max_bytes` bytes."""
        return pieces.read(self.r, self.keys.fragment(p).state, max_bytes=max_bytes,
                           what=f"fragment {p}'s state")

    def load_sent(self, p: int, versions: Iterable[int],
                  max_bytes: int) -> dict[int, bytes | bytearray]:
        fk = self.keys.fragment(p)
        vs = list(versions)
        blobs = pieces.read_many(self.r, [fk.sent(v) for v in vs], max_bytes=max_bytes,
                                 what=f"fragment {p}'s snapshot")
        return {v: b for v, b in zip(vs, blobs, strict=True) if b is not None}

    def commit_round(self, p: int, owner: str, *, state: bytes | memoryview | None,
                     snapshot: bytes | memoryview, sent: bytes | memoryview | None = None,
                     version: int, record: Mapping[str, str | int | float], ack_ids: list[str],
                     drop_sent_versions: Iterable[int] = (),
                     extra_sent: Mapping[int, bytes | memoryview] | None = None,
                     earlier_records: list[Mapping] | None = None,
                     after: int | None = None,
                     merged: Mapping[str, str] | None = None, retake: bool = False) -> str:
        """Commit one closed round atomically, fenced by the lease. Returns the record id.

        A round writes its record, its acknowledgements and its published value (`snapshot`,
        as ``global``, and as ``sent:<version>`` unless `sent` is given: one copy sent, the
        second made by the server); a checkpoint round also the fragment's full `state`
        (None: not a checkpoint). `sent`: the value as ``sent:<version>`` keeps it when that
        is not `snapshot` — under the delta down link the delta as sent, rebuilt from the
        version before. `extra_sent` are more snapshots (version → blob): rounds Redis lost.
        `drop_sent_versions` are snapshots no longer needed (older than the staleness window
        of both the version and the checkpoint). `merged` (learner → JSON of
        `broker.records.Merged`) updates the fragment's merge records in the same transaction:
        whoever reads the round's value, from the snapshot or from the published message, finds
        the records of the pushes it merged.

        Round records get the stream id ``<version>-0`` (``XRANGE …:rounds 12 12`` is round
        12), which makes a commit idempotent: re-committing a round whose record already exists
        (a retried EXEC, or a re-commit after Redis lost its last second) rewrites the same
        values and skips the record. `earlier_records` re-adds records Redis lost. With `after`
        (the version before this one) the commit checks that Redis holds that round's record
        (or none at all for version 0): a round lost in a failover is not skipped over.
        `retake`: as `_fenced_write`'s (a re-commit of the rounds Redis lost, with the state).

        Raises:
            LeaseLost: another syncer holds the fragment; nothing was written.
            RoundsLost: Redis lacks the rounds before this one; nothing was written.
        """
        fk = self.keys.fragment(p)
        values = {**{fk.sent(v): blob for v, blob in (extra_sent or {}).items()},
                  fk.sent(version): snapshot if sent is None else sent,
                  **({} if sent is None else {fk.global_: snapshot}),
                  **({} if state is None else {fk.state: state})}
        with self._fenced_write(p, owner, values, "the commit", fk.rounds,
                                retake=retake) as (pipe, staged):
            if after is not None:
                self._require_rounds(pipe, fk.rounds, p, after,
                                     f"the commit of v{version} follows v{after}")
            pipe.multi()
            for key, blob in values.items():
                pieces.queue_put(pipe, key, blob, staged[key])
            if sent is None:
                pipe.copy(fk.sent(version), fk.global_, replace=True)
            drop = [fk.sent(v) for v in drop_sent_versions if v >= 0 and v != version]
            if drop:
                pipe.delete(*drop)
            records = [*(earlier_records or []), record]
            for rec in records:
                pipe.xadd(fk.rounds, {k: (json.dumps(v) if isinstance(v, list | dict) else v)
                                      for k, v in rec.items()}, id=f"{int(rec['version'])}-0")
            if merged:
                pipe.hset(fk.merged, mapping=dict(merged))
            if ack_ids:
                pipe.xack(fk.frags, GROUP, *ack_ids)
            result = pipe.execute(raise_on_error=False)
            staged.clear()
        for res in result:
            if isinstance(res, redis.ResponseError) and "equal or smaller" not in str(res):
                raise res  # anything but "this round record exists already"
        return f"{int(record['version'])}-0"

    def put_sent(self, p: int, owner: str, version: int, snapshot: bytes | memoryview, *,
                 retake: bool = False) -> None:
        """Replace ``sent:<version>`` by `snapshot`, fenced by the lease: the same value in
        another form (a delta made whole before a checkpoint makes it the oldest kept).
        `retake` as :meth:`_fenced_write`'s (before a checkpoint that would retake it).

        Raises:
            LeaseLost: another syncer holds the fragment; nothing was written.
        """
        key = self.keys.fragment(p).sent(version)
        with self._fenced_write(p, owner, {key: snapshot}, "a snapshot",
                                retake=retake) as (pipe, staged):
            pipe.multi()
            pieces.queue_put(pipe, key, snapshot, staged[key])
            pipe.execute()
            staged.clear()

    def checkpoint(self, p: int, owner: str, *, state: bytes | memoryview, version: int,
                   drop_sent_versions: Iterable[int] = ()) -> None:
        """Write the fragment's full state at its committed `version` outside a round (the
        end of a run, a hand-over), fenced by the lease; Redis must hold that version's round
        record (a checkpoint ahead of the rounds stream could not be recovered from).

        Raises:
            LeaseLost: another syncer holds the fragment; nothing was written.
            RoundsLost: Redis lacks rounds up to `version`; nothing was written.
        """
        fk = self.keys.fragment(p)
        with self._fenced_write(p, owner, {fk.state: state}, "the checkpoint", fk.rounds,
                                retake=True) as (pipe, staged):
            self._require_rounds(pipe, fk.rounds, p, version,
                                 f"the checkpoint is of v{version}")
            pipe.multi()
            pieces.queue_put(pipe, fk.state, state, staged[fk.state])
            drop = [fk.sent(v) for v in drop_sent_versions if v >= 0 and v != version]
            if drop:
                pipe.delete(*drop)
            pipe.execute()
            staged.clear()

    def init_fragment(self, p: int, owner: str, *, state: bytes | memoryview,
                      snapshot: bytes | memoryview) -> bool:
        """Write version 0 if the fragment has no state yet (fenced by the lease)."""
        fk = self.keys.fragment(p)
        if self.r.exists(fk.state):
            return False
        values = {fk.state: state, fk.sent(0): snapshot}
        with self._fenced_write(p, owner, values, "initialisation", fk.state) as (pipe, staged):
            if pipe.exists(fk.state):
                return False
            pipe.multi()
            for key, blob in values.items():
                pieces.queue_put(pipe, key, blob, staged[key])
            pipe.copy(fk.sent(0), fk.global_, replace=True)
            pipe.execute()
            staged.clear()
            return True

    @contextmanager
    def _fenced_write(self, p: int, owner: str,
                      values: Mapping[str, bytes | bytearray | memoryview], what: str,
                      *watch: str, retake: bool = False
                      ) -> Iterator[tuple[Any, dict[str, str | None]]]:
        """A transaction fenced by fragment p's lease: `values` staged (`_stage`), then a
        pipeline WATCHing the lease, `watch` and the staging keys, the lease checked. The
        caller checks what else it must, queues its writes after ``pipe.multi()``, executes,
        and clears the staging map once they are named: staging keys left in it are deleted.

        With `retake`, a lease that expired meanwhile (a long write on a loaded host) and that
        nobody has taken since is taken again (a round commit raises instead: the syncer then
        re-commits the round with its state, `retake` set).

        Raises:
            LeaseLost: another syncer holds the fragment (or took it meanwhile).
        """
        staged = self._stage(values, p, owner)
        lease = self.keys.fragment(p).lease
        if retake and self._lease_ms and self.r.set(lease, owner.encode(), nx=True,
                                                    px=self._lease_ms):
            log.warning("fragment %d: lease expired during %s; taken again", p, what)
        pipe = self.r.pipeline(transaction=True)
        try:
            pipe.watch(lease, *watch)
            self._check_lease(pipe.get(lease), owner, p)
            pieces.watch_staged(pipe, staged.values())
            yield pipe, staged
        except redis.WatchError as e:
            raise _fenced(e, p, what) from e
        finally:
            pipe.reset()
            pieces.drop_staged(self.r, staged.values())

    def _stage(self, values: Mapping[str, bytes | bytearray | memoryview], p: int,
               owner: str) -> dict[str, str | None]:
        """Each value's staging key (`broker.pieces.stage`; None: written whole). Staging
        takes as long as sending the values: after each piece every lease taken here (this
        fragment's, and the others this syncer owns) is extended where its owner still holds
        it, as the syncer's loop would."""
        staged: dict[str, str | None] = {}
        try:
            for key, blob in values.items():
                staged[key] = pieces.stage(self.r, key, blob, self.piece_bytes,
                                           lambda: self._extend_held({p: owner}))
        except BaseException:
            pieces.drop_staged(self.r, staged.values())
            raise
        return staged

    @staticmethod
    def _require_rounds(pipe, key: str, p: int, version: int, what: str) -> None:
        """Raise RoundsLost unless the rounds stream `key` (WATCHed by `pipe`) reaches
        `version` (0: nothing needed)."""
        last = pipe.xrevrange(key, "+", "-", count=1)
        have = int(as_text(last[0][0]).split("-")[0]) if last else 0
        if have < version:
            raise RoundsLost(f"fragment {p}: Redis holds rounds up to v{have}, {what}")

    @staticmethod
    def _check_lease(holder: bytes | None, owner: str, p: int) -> None:
        if holder is None:
            raise LeaseLost(f"fragment {p}: lease expired (not renewed within broker.lease_ms)")
        if holder != owner.encode():
            raise LeaseLost(f"fragment {p}: lease held by {holder.decode()!r}")
