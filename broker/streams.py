"""Fragment streams: pushes in, consumer-group reads, dead letters, and the round commit.

Delivery is at-least-once. A learner's XADD may be retried and duplicated (the syncer
dedupes). The syncer reads with XREADGROUP into the open round and acknowledges entries only
inside the round's commit, a single MULTI/EXEC on keys that share the fragment's hash tag,
fenced by the fragment lease (WATCH): the published snapshot, the round record and the XACKs
(and, every few rounds, the fragment's full state: a checkpoint) land together or not at all.
A syncer that dies before its commit leaves its entries pending; on restart it drains its own
pending list, and XAUTOCLAIM takes entries idle past the longest legitimate wait from
consumers that never came back.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis
from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    TryAgainError,
)

from broker import pieces
from broker.errors import BrokerError
from broker.ids import as_text, id_key
from broker.keys import GROUP, RunKeys

MAX_ID = 2**64 - 1  # either part of a stream id

Fields = dict[bytes, bytes]


class StreamExhausted(BrokerError):
    """A fragment stream takes no new entry: one was added with the largest possible id
    (`FragmentStreams.reopen_exhausted`, which the fragment's syncer runs, undoes it)."""


def _exhausted(p: int, e: redis.ResponseError) -> StreamExhausted | None:
    if "last possible ID" not in str(e):
        return None
    return StreamExhausted(f"fragment {p}: its stream takes no new entry (an entry was added "
                           f"with the largest id); the syncer that owns it sets it back")
log = logging.getLogger("diloco.streams")

# a cluster's answers while a slot changes master (a failover): not a refusal
_SLOT_MOVING = (MovedError, AskError, TryAgainError, ClusterDownError)
# a syncer on a Redis Cluster polls its fragments' streams this often when all are idle
CLUSTER_IDLE_MS = 10

# Extend the lease only if we still hold it (atomic compare-and-expire).
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class NotDurable(redis.ConnectionError):
    """A push that fewer replicas than asked acknowledged in time (``broker.wait_replicas``):
    treated as not written, like a push to an unreachable server."""


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


@dataclass
class Entry:
    fragment: int
    entry_id: str
    fields: Fields


class FragmentStreams:
    """Redis stream operations of one run's fragments."""

    def __init__(self, r: redis.Redis, keys: RunKeys, *, max_entries: int = 100_000,
                 wait_replicas: int = 0, wait_timeout_ms: int = 1000,
                 piece_bytes: int = pieces.PIECE_BYTES):
        self.r = r
        self.piece_bytes = piece_bytes  # a larger value is stored in pieces (`broker.pieces`)
        self.keys = keys
        self.max_entries = max_entries
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._renew = r.register_script(_RENEW)
        self.cluster = isinstance(r, RedisCluster)

    # -- learner side ---------------------------------------------------------------------------

    def push(self, p: int, fields: Mapping[str, bytes | str | int]) -> str:
        """XADD one contribution (bounded retention); returns the entry id.

        With `wait_replicas` the XADD is followed, on the same connection, by ``WAIT
        wait_replicas wait_timeout_ms``: the push counts as acknowledged only once that many
        replicas hold it (a failover cannot lose it).

        Raises:
            NotDurable: fewer replicas acknowledged it in time (push it again: a duplicate is
                deduped by the syncer).
        """
        key = self.keys.fragment(p).frags
        if not self.wait_replicas:
            try:
                return as_text(self.r.xadd(key, dict(fields), maxlen=self.max_entries,
                                           approximate=True))
            except redis.ResponseError as e:
                raise _exhausted(p, e) or e from e
        try:
            client = self.r
            if self.cluster:  # WAIT counts this connection's writes: the slot's master
                client = self.r.get_redis_connection(self.r.get_node_from_key(key))
            pipe = client.pipeline(transaction=False)
            pipe.xadd(key, dict(fields), maxlen=self.max_entries, approximate=True)
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            entry_id, replicas = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as e:
            moved = isinstance(e, _SLOT_MOVING) or str(e).split(" ", 1)[0] in (
                "MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
            if isinstance(e, redis.ResponseError) and not moved:
                raise _exhausted(p, e) or e from e  # a real refusal (NOPERM, …), not an outage
            if self.cluster:  # the slot's master died or moved: read the slot map again
                try:
                    self.r.nodes_manager.initialize()
                except (redis.RedisError, RedisClusterException) as err:
                    log.warning("fragment %d: the cluster's slot map could not be read again "
                                "(%s); the next push asks again", p, err)
            raise NotDurable(f"fragment {p}: push not written ({e})") from e
        if int(replicas) < self.wait_replicas:
            raise NotDurable(f"fragment {p}: push {as_text(entry_id)} reached {replicas} of "
                             f"{self.wait_replicas} replicas within {self.wait_timeout_ms} ms")
        return as_text(entry_id)

    def read_global(self, p: int, max_bytes: int) -> bytes | bytearray | None:
        return pieces.read(self.r, self.keys.fragment(p).global_, max_bytes=max_bytes,
                           what=f"fragment {p}'s snapshot")

    # -- syncer side ----------------------------------------------------------------------------

    def ensure_group(self, p: int) -> None:
        try:
            self.r.xgroup_create(self.keys.fragment(p).frags, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def read_new(self, consumer: str, fragments: Iterable[int], count: int,
                 block_ms: int) -> list[Entry]:
        """New entries of `fragments` for this consumer (blocks up to block_ms).

        On a Redis Cluster the fragments' streams live in different slots, which one
        XREADGROUP may not name together: each is read without blocking (one pipeline, split
        by node), and when none has anything the call waits `CLUSTER_IDLE_MS` (at most
        block_ms) before returning nothing."""
        by_key = {self.keys.fragment(p).frags: p for p in fragments}
        if self.cluster and len(by_key) > 1:
            pipe = self.r.pipeline(transaction=False)
            for key in by_key:
                pipe.xreadgroup(GROUP, consumer, {key: ">"}, count=count)
            out = [e for reply in pipe.execute() for e in self._entries(reply, by_key)]
            if not out and block_ms:
                time.sleep(min(block_ms, CLUSTER_IDLE_MS) / 1000)
            return out
        streams = dict.fromkeys(by_key, ">")
        reply = self.r.xreadgroup(GROUP, consumer, streams, count=count, block=block_ms)
        return self._entries(reply, by_key)

    def read_pending(self, consumer: str, p: int, count: int = 1000) -> list[Entry]:
        """This consumer's own pending entries of fragment p (delivered, never acked).

        Entries deleted from the stream while pending come back without fields; they are
        returned too (with empty fields) so the caller can account for them.
        """
        key = self.keys.fragment(p).frags
        out, start = [], "0"
        while True:
            reply = self.r.xreadgroup(GROUP, consumer, {key: start}, count=count)
            batch = self._entries(reply, {key: p})
            if not batch:
                return out
            out += batch
            start = batch[-1].entry_id

    def delivery_counts(self, p: int, ids: list[str]) -> dict[str, int]:
        if not ids:
            return {}
        rows = self.r.xpending_range(self.keys.fragment(p).frags, GROUP,
                                     min=min(ids, key=id_key), max=max(ids, key=id_key),
                                     count=len(ids) + 1000)
        return {as_text(row["message_id"]): int(row["times_delivered"]) for row in rows}

    def autoclaim(self, consumer: str, p: int, min_idle_ms: int,
                  count: int = 100) -> tuple[list[Entry], list[str]]:
        """Take over entries idle longer than `min_idle_ms` (their consumer is gone).

        Returns the claimed entries and the ids of pending entries that no longer exist in
        the stream (Redis removes those from the pending list; the caller accounts for them).
        """
        key = self.keys.fragment(p).frags
        out, deleted, start = [], [], "0-0"
        while True:
            reply = self.r.xautoclaim(key, GROUP, consumer, min_idle_ms, start_id=start,
                                      count=count)
            start, claimed = as_text(reply[0]), reply[1]
            out += [Entry(p, as_text(i), f) for i, f in claimed if f]
            if len(reply) > 2:
                deleted += [as_text(i) for i in reply[2]]
            if start == "0-0":
                return out, deleted

    def claim_others(self, p: int, consumer: str, page: int = 1000
                     ) -> tuple[list[Entry], list[str]]:
        """Take every entry of fragment p pending on another consumer, at once (XCLAIM with
        no idle time): the caller has just taken the fragment's lease, so they were read by a
        previous owner, which can no longer commit them.

        Returns the claimed entries and the ids of those no longer in the stream (the caller
        accounts for them as lost).
        """
        key = self.keys.fragment(p).frags
        out, deleted, start = [], [], "-"
        while True:
            rows = self.r.xpending_range(key, GROUP, min=start, max="+", count=page)
            ids = [as_text(row["message_id"]) for row in rows
                   if as_text(row["consumer"]) != consumer]
            if ids:
                claimed = self.r.xclaim(key, GROUP, consumer, 0, ids)
                got = {as_text(i): f for i, f in claimed if f}
                out += [Entry(p, i, got[i]) for i in ids if i in got]
                deleted += [i for i in ids if i not in got]
            if len(rows) < page:
                return out, deleted
            start = "(" + as_text(rows[-1]["message_id"])

    def touch(self, p: int, consumer: str, ids: list[str]) -> None:
        """Reset the idle time of entries this consumer holds (XCLAIM JUSTID: no new delivery),
        so a round that waits long is not mistaken for a dead consumer's."""
        if ids:
            self.r.xclaim(self.keys.fragment(p).frags, GROUP, consumer, 0, ids, justid=True)

    def dead_letter(self, p: int, entry: Entry, reason: str, keep_payload: bool = True) -> None:
        """Move an entry to the fragment's DLQ with its reason, and acknowledge it, atomically
        (without its payload when not `keep_payload`: a flood of forged entries does not
        double in the DLQ)."""
        fk = self.keys.fragment(p)
        fields = {k: v for k, v in entry.fields.items()
                  if keep_payload or not (k == b"payload" or k.startswith(b"payload:"))}
        fields.update({b"dlq_reason": reason.encode(), b"dlq_source_id": entry.entry_id.encode()})
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(fk.dlq, fields, maxlen=self.max_entries, approximate=True)
        pipe.xack(fk.frags, GROUP, entry.entry_id)
        pipe.execute()

    def ack_only(self, p: int, ids: list[str]) -> None:
        if ids:
            self.r.xack(self.keys.fragment(p).frags, GROUP, *ids)

    def acquire_lease(self, p: int, owner: str, lease_ms: int) -> bool:
        """Take the fragment's lease if free (or extend it if ours)."""
        key = self.keys.fragment(p).lease
        if self.r.set(key, owner.encode(), nx=True, px=lease_ms):
            return True
        return bool(self._renew(keys=[key], args=[owner.encode(), lease_ms]))

    def lease_holder(self, p: int) -> str | None:
        """The id of the syncer holding the fragment's lease (None: nobody)."""
        holder = self.r.get(self.keys.fragment(p).lease)
        return None if holder is None else as_text(holder)

    def release_lease(self, p: int, owner: str) -> None:
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

    def commit_round(self, p: int, owner: str, *, state: bytes | None, snapshot: bytes,
                     version: int, record: Mapping[str, str | int | float], ack_ids: list[str],
                     drop_sent_versions: Iterable[int] = (),
                     extra_sent: Mapping[int, bytes] | None = None,
                     earlier_records: list[Mapping] | None = None,
                     after: int | None = None,
                     merged: Mapping[str, str] | None = None) -> str:
        """Commit one closed round atomically, fenced by the lease. Returns the record id.

        A round writes its record, its acknowledgements and its published value (`snapshot`,
        as ``sent:<version>`` and ``global``: one copy sent, the second made by the server);
        a checkpoint round also the fragment's full `state` (None: not a checkpoint).
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

        Raises:
            LeaseLost: another syncer holds the fragment; nothing was written.
            RoundsLost: Redis lacks the rounds before this one; nothing was written.
        """
        fk = self.keys.fragment(p)
        values = {fk.sent(version): snapshot, **({} if state is None else {fk.state: state}),
                  **{fk.sent(v): blob for v, blob in (extra_sent or {}).items()}}
        staged = self._stage(values)
        pipe = self.r.pipeline(transaction=True)
        try:
            pipe.watch(fk.lease, fk.rounds)
            self._check_lease(pipe.get(fk.lease), owner, p)
            if after is not None:
                self._require_rounds(pipe, fk.rounds, p, after,
                                     f"the commit of v{version} follows v{after}")
            pieces.watch_staged(pipe, staged.values())
            pipe.multi()
            for key, blob in values.items():
                pieces.queue_put(pipe, key, blob, staged[key])
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
        except redis.WatchError as e:
            raise _fenced(e, p, "the commit") from e
        finally:
            pipe.reset()
            pieces.drop_staged(self.r, staged.values())
        for res in result:
            if isinstance(res, redis.ResponseError) and "equal or smaller" not in str(res):
                raise res  # anything but "this round record exists already"
        return f"{int(record['version'])}-0"

    def checkpoint(self, p: int, owner: str, *, state: bytes, version: int,
                   drop_sent_versions: Iterable[int] = ()) -> None:
        """Write the fragment's full state at its committed `version` outside a round (the
        end of a run, a hand-over), fenced by the lease; Redis must hold that version's round
        record (a checkpoint ahead of the rounds stream could not be recovered from).

        Raises:
            LeaseLost: another syncer holds the fragment; nothing was written.
            RoundsLost: Redis lacks rounds up to `version`; nothing was written.
        """
        fk = self.keys.fragment(p)
        staged = self._stage({fk.state: state})
        pipe = self.r.pipeline(transaction=True)
        try:
            pipe.watch(fk.lease, fk.rounds)
            self._check_lease(pipe.get(fk.lease), owner, p)
            self._require_rounds(pipe, fk.rounds, p, version,
                                 f"the checkpoint is of v{version}")
            pieces.watch_staged(pipe, staged.values())
            pipe.multi()
            pieces.queue_put(pipe, fk.state, state, staged[fk.state])
            drop = [fk.sent(v) for v in drop_sent_versions if v >= 0 and v != version]
            if drop:
                pipe.delete(*drop)
            pipe.execute()
            staged.clear()
        except redis.WatchError as e:
            raise _fenced(e, p, "the checkpoint") from e
        finally:
            pipe.reset()
            pieces.drop_staged(self.r, staged.values())

    def init_fragment(self, p: int, owner: str, *, state: bytes, snapshot: bytes) -> bool:
        """Write version 0 if the fragment has no state yet (fenced by the lease)."""
        fk = self.keys.fragment(p)
        if self.r.exists(fk.state):
            return False
        values = {fk.state: state, fk.sent(0): snapshot}
        staged = self._stage(values)
        pipe = self.r.pipeline(transaction=True)
        try:
            pipe.watch(fk.lease, fk.state)
            self._check_lease(pipe.get(fk.lease), owner, p)
            if pipe.exists(fk.state):
                return False
            pieces.watch_staged(pipe, staged.values())
            pipe.multi()
            for key, blob in values.items():
                pieces.queue_put(pipe, key, blob, staged[key])
            pipe.copy(fk.sent(0), fk.global_, replace=True)
            pipe.execute()
            staged.clear()
            return True
        except redis.WatchError as e:
            raise _fenced(e, p, "initialisation") from e
        finally:
            pipe.reset()
            pieces.drop_staged(self.r, staged.values())

    def _stage(self, values: Mapping[str, bytes | bytearray | memoryview]) -> dict[str, str | None]:
        """Each value's staging key (`broker.pieces.stage`; None: written whole)."""
        staged: dict[str, str | None] = {}
        try:
            for key, blob in values.items():
                staged[key] = pieces.stage(self.r, key, blob, self.piece_bytes)
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

    def reopen_exhausted(self, p: int) -> str | None:
        """Undo an entry added with the largest possible id (a learner credential may name an
        explicit id; after it no `XADD *` succeeds on the stream): it is copied to the
        dead-letter stream and deleted, the stream's last id set back to its newest other
        entry (or 0-1), and the consumer group's last-delivered id with it. None when the
        stream is not exhausted; else the id it was set back to."""
        fk = self.keys.fragment(p)
        try:
            last = as_text(self.r.xinfo_stream(fk.frags)["last-generated-id"])
        except redis.ResponseError:  # no stream yet
            return None
        if id_key(last) != (MAX_ID, MAX_ID):
            return None
        for entry_id, fields in self.r.xrange(fk.frags, min=last, max=last):
            self.dead_letter(p, Entry(p, as_text(entry_id), fields or {}),
                             "an entry with the largest stream id (no push could follow it)",
                             keep_payload=False)
            self.r.xdel(fk.frags, entry_id)
        top = self.r.xrevrange(fk.frags, count=1)
        back = as_text(top[0][0]) if top else "0-1"
        self.r.execute_command("XSETID", fk.frags, back)
        for g in self.r.xinfo_groups(fk.frags):
            if as_text(g["name"]) == GROUP and id_key(as_text(g["last-delivered-id"])) > \
                    id_key(back):
                self.r.xgroup_setid(fk.frags, GROUP, back)
        return back

    def trim(self, p: int, min_id: str) -> int:
        """Drop fragment entries older than `min_id` (merged long enough ago)."""
        return int(self.r.xtrim(self.keys.fragment(p).frags, minid=min_id, approximate=False))

    @staticmethod
    def _entries(reply, by_key: Mapping[str, int]) -> list[Entry]:
        out = []
        for key, items in reply or []:
            p = by_key[as_text(key)]
            for entry_id, fields in items:
                out.append(Entry(p, as_text(entry_id), fields or {}))
        return out
