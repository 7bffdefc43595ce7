"""Values of any size in Redis, carried and stored in pieces of bounded size.

A value of at most ``broker.piece_bytes`` is one string, as it always was (``GET`` reads it;
runs recorded before pieces hold nothing else). A larger value is a hash: field ``m`` holds
its manifest, the JSON ``{"v": 1, "bytes": N, "piece_bytes": P, "sha256": [...]}`` (each
piece's SHA-256, in order; ``redis-cli HGET <key> m`` shows it), and fields ``0`` … ``n-1``
its pieces, each of P bytes but the last. No command and no reply carries more than one
piece, so neither Redis's ``proto-max-bulk-len`` nor its query buffer bounds a value.

Writing is two steps. :func:`stage` writes the pieces, outside any transaction and one piece
per command, to a staging key of the same hash slot (``<key>:staging:<token>``) that expires
unless it is committed: a writer that dies between pieces leaves nothing visible, and nothing
behind after the TTL. :func:`queue_put`, inside the caller's fenced MULTI/EXEC, renames the
staging key over the value and clears its TTL, so a reader sees the whole old value or the
whole new one. On a Redis Cluster the pieces are fields of one key: they move together when
the slot moves (``MIGRATE`` carries the key whole, so moving a slot that holds a fragment's
state takes as long as copying that state).

Reading (:func:`read`) takes the manifest, checks it against the caller's bound before it
allocates anything, then reads the pieces one by one into one buffer, checking each one's size
and SHA-256. A value replaced between two piece reads fails that check and is read again from
its new manifest; a value that never checks out raises :class:`~broker.errors.DecodeError`.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis

from broker.errors import DecodeError
from broker.keys import staging
from broker.untrusted import bounded_json, check_blob

PIECE_BYTES = 64 * 2**20  # broker.piece_bytes' default: far below Redis's 512 MB per value
MANIFEST = b"m"
STAGE_TTL_MS = 600_000  # a staging key unnamed this long after its last piece is dropped
READ_TRIES = 3
_MAX_PIECES = 2**16  # 4 TiB in pieces of 64 MiB


@dataclass(frozen=True)
class Manifest:
    nbytes: int
    piece_bytes: int
    sha256: tuple[str, ...]

    def to_json(self) -> bytes:
        return json.dumps({"v": 1, "bytes": self.nbytes, "piece_bytes": self.piece_bytes,
                           "sha256": list(self.sha256)}, separators=(",", ":")).encode()

    def span(self, i: int) -> tuple[int, int]:
        """(offset, length) of piece `i`."""
        start = i * self.piece_bytes
        return start, min(self.piece_bytes, self.nbytes - start)


def parse_manifest(raw: object, max_bytes: int, what: str) -> Manifest:
    """The manifest `raw` (Redis's bytes), checked: a value of at most `max_bytes` bytes, in
    as many pieces as its piece size makes, each with a hex SHA-256.

    Raises:
        DecodeError: On anything else.
    """
    doc = bounded_json(raw, f"{what}: manifest", max_depth=2, max_containers=2)
    if not isinstance(doc, dict) or set(doc) != {"v", "bytes", "piece_bytes", "sha256"} or \
            doc["v"] != 1:
        raise DecodeError(f"{what}: manifest must hold v (1), bytes, piece_bytes and sha256")
    nbytes, piece, shas = doc["bytes"], doc["piece_bytes"], doc["sha256"]
    if not all(type(x) is int for x in (nbytes, piece)) or not 1 <= piece <= nbytes:
        raise DecodeError(f"{what}: manifest sizes must be ints with 1 <= piece_bytes <= bytes")
    if nbytes > max_bytes:
        raise DecodeError(f"{what} of {nbytes} bytes exceeds the limit of {max_bytes}")
    n = math.ceil(nbytes / piece)
    if n > _MAX_PIECES or not isinstance(shas, list) or len(shas) != n or not all(
            isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)
            for s in shas):
        raise DecodeError(f"{what}: manifest must list one hex SHA-256 for each of its "
                          f"{min(n, _MAX_PIECES + 1)} pieces")
    return Manifest(nbytes, piece, tuple(shas))


def _pieces(blob: bytes | bytearray | memoryview, piece_bytes: int) -> Iterable[memoryview]:
    view = memoryview(blob).cast("B")
    for start in range(0, len(view), piece_bytes):
        yield view[start:start + piece_bytes]


def stage(r: redis.Redis, key: str, blob: bytes | bytearray | memoryview,
          piece_bytes: int, after_piece: Callable[[], object] | None = None) -> str | None:
    """Write `blob` in pieces to a staging key beside `key` (one piece per command, each
    followed by a renewal of the key's TTL, then by `after_piece`: the caller renews its own
    lease there), for :func:`queue_put` to name. None when `blob` fits one piece:
    `queue_put` then writes it whole, as a string.

    Raises:
        redis.RedisError: Redis refused a piece or dropped the connection (the staging key
            expires by itself).
    """
    if len(blob) <= piece_bytes:
        return None
    staged = staging(key, secrets.token_hex(8))
    shas = []
    for i, piece in enumerate(_pieces(blob, piece_bytes)):
        shas.append(hashlib.sha256(piece).hexdigest())
        pipe = r.pipeline(transaction=False)
        pipe.hset(staged, str(i), piece)
        pipe.pexpire(staged, STAGE_TTL_MS)
        pipe.execute()
        if after_piece is not None:
            after_piece()
    manifest = Manifest(len(blob), piece_bytes, tuple(shas))
    r.pipeline(transaction=False).hset(staged, MANIFEST, manifest.to_json()).pexpire(
        staged, STAGE_TTL_MS).execute()
    return staged


def watch_staged(pipe, staged: Iterable[str | None]) -> None:
    """WATCH the staging keys about to be named and check they are still there (an expired
    one would make the commit's RENAME fail after the rest of the transaction ran).

    Raises:
        redis.ConnectionError: a staging key expired (the write is retried like an outage).
    """
    keys = [k for k in staged if k]
    if not keys:
        return
    pipe.watch(*keys)
    missing = [k for k in keys if not pipe.exists(k)]
    if missing:
        raise redis.ConnectionError(f"staged pieces expired before their commit: {missing[0]}")


def queue_put(pipe, key: str, blob: bytes | bytearray | memoryview, staged: str | None) -> None:
    """Queue, in the caller's MULTI, the write of `blob` as `key`'s value: the string itself,
    or the renaming of its staging key (:func:`stage`) over `key`."""
    if staged is None:
        pipe.set(key, blob)
    else:
        # (the command itself: redis-py's cluster pipeline blocks its `rename` method, though
        # both keys share one slot)
        pipe.execute_command("RENAME", staged, key)
        pipe.persist(key)


def drop_staged(r: redis.Redis, staged: Iterable[str | None]) -> None:
    """Delete staging keys a failed commit did not name (best effort: they expire anyway)."""
    keys = [k for k in staged if k]
    try:
        for k in keys:
            r.delete(k)
    except redis.RedisError:
        pass


def read(r: redis.Redis, key: str, *, max_bytes: int, what: str = "value") -> \
        bytes | bytearray | None:
    """`key`'s value, whole: a string as it is, a value in pieces joined into one buffer
    (each piece checked). None when the key does not exist.

    Raises:
        DecodeError: The value is larger than `max_bytes`, its manifest is malformed, or its
            pieces did not match their manifest in `READ_TRIES` reads.
    """
    problem = ""
    for _ in range(READ_TRIES):
        try:
            blob = r.get(key)
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
        else:
            if blob is not None:
                check_blob(blob, max_bytes, what)
            return blob
        try:
            raw = r.hget(key, MANIFEST)
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
            raise DecodeError(f"{what} at {key}: neither a string nor a value in pieces") from e
        if raw is None:
            problem = "it has no manifest"
            continue  # replaced by a string, or deleted, since the GET
        man = parse_manifest(raw, max_bytes, what)
        out = bytearray(man.nbytes)
        view = memoryview(out)
        for i, sha in enumerate(man.sha256):
            start, length = man.span(i)
            try:
                piece = r.hget(key, str(i))
            except redis.ResponseError as e:  # replaced by a string since the manifest
                if "WRONGTYPE" not in str(e):
                    raise
                piece = None
            if piece is None or len(piece) != length or \
                    hashlib.sha256(piece).hexdigest() != sha:
                problem = f"piece {i} does not match the manifest"
                break
            view[start:start + length] = piece
        else:
            return out
    raise DecodeError(f"{what} at {key}: {problem} ({READ_TRIES} reads)")


def read_many(r: redis.Redis, keys: list[str], *, max_bytes: int,
              what: str = "value") -> list[bytes | bytearray | None]:
    """:func:`read` of each key; the strings among them in one round trip (MGET answers
    None for a hash, read then on its own)."""
    if not keys:
        return []
    got = r.mget(keys)
    for blob in got:
        if blob is not None:
            check_blob(blob, max_bytes, what)
    return [blob if blob is not None else read(r, k, max_bytes=max_bytes, what=what)
            for k, blob in zip(keys, got, strict=True)]


def nbytes(r: redis.Redis, key: str) -> int:
    """The size of `key`'s value in bytes (0: no such key), from its manifest when in pieces."""
    try:
        return int(r.strlen(key))
    except redis.ResponseError as e:
        if "WRONGTYPE" not in str(e):
            raise
    raw = r.hget(key, MANIFEST)
    return 0 if raw is None else parse_manifest(raw, 2**62, key).nbytes
