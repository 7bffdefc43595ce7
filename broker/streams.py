"""Fragment streams: pushes in, consumer-group reads, dead letters (the round commit that
acknowledges entries, and the rest of a fragment's committed state: `broker.commit`).

Delivery is at-least-once. A learner's XADD may be retried and duplicated (the syncer
dedupes). The syncer reads with XREADGROUP into the open round and acknowledges entries only
inside the round's commit, a single MULTI/EXEC fenced by the fragment lease.
A syncer that dies before its commit leaves its entries pending; on restart it drains its own
pending list, and XAUTOCLAIM takes entries idle past the longest legitimate wait from
consumers that never came back.
"""

from __future__ import annotations

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
from broker.commit import FencedState
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


class NotDurable(redis.ConnectionError):
    """A push that fewer replicas than asked acknowledged in time (``broker.wait_replicas``):
    treated as not written, like a push to an unreachable server."""


@dataclass
class Entry:
    fragment: int
    entry_id: str
    fields: Fields


class FragmentStreams:
    """Redis stream operations of one run's fragments; `state` holds their committed state
    (:class:`broker.commit.FencedState`: leases, commits, checkpoints)."""

    def __init__(self, r: redis.Redis, keys: RunKeys, *, max_entries: int = 100_000,
                 wait_replicas: int = 0, wait_timeout_ms: int = 1000,
                 piece_bytes: int = pieces.PIECE_BYTES):
        self.r = r
        self.keys = keys
        self.state = FencedState(r, keys, piece_bytes)
        self.max_entries = max_entries
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
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
