"""Merged values read from Redis, checked against what the syncers said over ZeroMQ.

A learner reads a fragment's whole value from Redis (the ``global`` snapshot) when it joins,
when it repairs a gap, and when it rebases onto the latest value. With CURVE on, ZeroMQ is
authenticated — a learner hears only the syncers' pinned key — and Redis is not: a credential
that may write ``global`` (the syncer and operator users) could feed a joining learner a
forged model. So a syncer with a CURVE server attests, every `ATTEST_S` for each fragment it
serves, the SHA-256 of the fragment's last `SENT` values as snapshots hold them
(`pipeline.syncer.FragmentSyncer.sent_hash`: the hash of the snapshot's tensors, which its
header's ``sha256`` carries); and every merged value it publishes says the same of its
version (``sha256`` of a whole value, ``value`` of a delta). A learner with a pinned syncer
key takes a snapshot only once its hash is the one attested for its version and its layout
is the one a syncer writes (`Attestations.snapshot`: the names in order, every tensor in the
run's snapshot codec — so the bytes the hash covers can only be cut into tensors one way): a
forged snapshot is refused, a snapshot of a version not attested yet waits for the
attestation (about `ATTEST_S` while a syncer serves the fragment), and an older one is read
again.

Frames: ``[topic(fragment), MARK, msgpack {"run", "fragment", "hashes": [[version, sha256],
…]}]`` — a global message's second frame is its msgpack header, never `MARK`, so the two
cannot be confused; a SUB socket subscribed to a fragment gets both. Learners and syncers of
one run must run the same version of this protocol (an older learner logs attestations as
malformed merged values).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import msgpack

from broker import codec
from broker.errors import DecodeError
from broker.untrusted import M_INT, MList, MMap, MStr, MTuple, as_buffer, unpack_checked
from pipeline.limits import MAX_FRAGMENT

MARK = b"diloco-attest-v1"
ATTEST_S = 0.5      # how often a syncer attests each fragment it serves
SENT = 4            # the last versions of a fragment each attestation names
KEEP = 16           # versions per fragment a learner remembers
_SCHEMA = MMap({"run": MStr(256), "fragment": M_INT,
                "hashes": MList(MTuple(M_INT, MStr(64)), SENT)})
_MAX_BYTES = 1024
_SHA = re.compile(r"[0-9a-f]{64}")

# what `Attestations.check` says of a snapshot, and when a learner reads a refused one again
OK, FORGED, OLDER, UNKNOWN = "ok", "forged", "older", "unknown"
READ_AGAIN_S = {FORGED: 5.0, OLDER: ATTEST_S, UNKNOWN: ATTEST_S}


@dataclass(frozen=True)
class Attestation:
    """A syncer's word on a fragment's values: each (version, sha256) of `hashes` says that
    version's snapshot hashes to that."""

    run: str
    fragment: int
    hashes: tuple[tuple[int, str], ...]


def frames(run: str, fragment: int, hashes: list[tuple[int, str]]) -> list[bytes]:
    """The ZeroMQ message attesting the (version, sha256) pairs of `fragment` (at most
    `SENT`: the newest)."""
    return [codec.topic(fragment), MARK, msgpack.packb(
        {"run": run, "fragment": fragment, "hashes": [list(h) for h in hashes[-SENT:]]})]


def parse(frames_: list) -> Attestation | None:
    """The attestation a ZeroMQ message holds; None when it is not one (a merged value).

    Raises:
        DecodeError: A message marked as an attestation that is not a valid one.
    """
    if len(frames_) < 2 or as_buffer(frames_[1]) != MARK:
        return None
    if len(frames_) != 3:
        raise DecodeError(f"an attestation has 3 frames, got {len(frames_)}")
    body = as_buffer(frames_[2])
    if body.nbytes > _MAX_BYTES:
        raise DecodeError(f"an attestation of {body.nbytes} bytes (at most {_MAX_BYTES})")
    raw = unpack_checked(body, _SCHEMA, "attestation")
    run, p, hashes = raw["run"], raw["fragment"], raw["hashes"]
    if not run or not codec.is_int(p) or not 0 <= p <= MAX_FRAGMENT:
        raise DecodeError(f"an attestation of run {run[:64]!r}, fragment {p!r}")
    for v, sha in hashes:
        if not codec.is_int(v) or not 0 <= v < 2**62:
            raise DecodeError(f"an attestation of version {v!r}")
        if not _SHA.fullmatch(sha):
            raise DecodeError("an attestation's sha256 must be 64 lowercase hex digits")
    if as_buffer(frames_[0]) != codec.topic(p):
        raise DecodeError("an attestation's topic is not its fragment's")
    return Attestation(run, int(p), tuple((int(v), sha) for v, sha in hashes))


def refusal(version: int) -> str:
    return (f"the snapshot of version {version} in Redis is not the value the syncers attested "
            f"over ZeroMQ (its SHA-256 or layout differs): refused")


class Attestations:
    """What a learner heard the syncers of run `run` (`fragments` fragments) attest — their
    attestations and published values: per fragment, the newest `KEEP` versions' hashes.
    `required` (CURVE on): `check` says `OK` only of an attested snapshot; otherwise of any.
    Thread-safe: the network thread notes, the joining thread waits."""

    def __init__(self, run: str, fragments: int, required: bool, codec: str = "fp32"):
        # `codec`: every tensor of a whole snapshot the syncers write (fp32 under the delta
        # down link, else `sync.codec_down`)
        self.run, self.fragments, self.required, self.codec = run, fragments, required, codec
        self._by: dict[int, dict[int, str]] = {}
        self._cond = threading.Condition()

    def note(self, run: str, fragment: int, version: int, sha256: str) -> None:
        """A syncer's word (heard over ZeroMQ) on `version`'s hash; another run's or fragment
        is ignored."""
        if run != self.run or not 0 <= fragment < self.fragments:
            return
        with self._cond:
            seen = self._by.setdefault(fragment, {})
            seen[version] = sha256
            while len(seen) > KEEP:
                del seen[min(seen)]
            self._cond.notify_all()

    def newest(self, fragment: int) -> int:
        """The newest version attested of `fragment` (-1: none yet)."""
        with self._cond:
            return max(self._by.get(fragment, {}), default=-1)

    def check(self, fragment: int, version: int, sha256: str) -> str:
        """`OK` (attested), `FORGED` (another hash was attested for that version), `OLDER`
        (older than every version remembered: read the snapshot again) or `UNKNOWN` (not
        attested yet)."""
        if not self.required:
            return OK
        with self._cond:
            seen = self._by.get(fragment, {})
            if version in seen:
                return OK if seen[version] == sha256 else FORGED
            return OLDER if seen and version < max(seen) else UNKNOWN

    def snapshot(self, fragment: int, header) -> str:
        """`check` of a whole snapshot (its `broker.codec.GlobalHeader`) read as `fragment`'s:
        `FORGED` as well when it names another fragment or run, or its layout is not the one
        a syncer writes (names in order, every tensor in `codec` with one block size) —
        else the same bytes could be cut into other tensors under the same hash."""
        if not self.required:
            return OK
        if (header.fragment != fragment or header.run != self.run or header.base != -1
                or list(header.names) != sorted(header.names)
                or set(header.codecs) - {self.codec} or len(set(header.blocks)) > 1):
            return FORGED
        return self.check(fragment, header.version, header.sha256)

    def note_all(self, a: Attestation) -> None:
        for version, sha256 in a.hashes:
            self.note(a.run, a.fragment, version, sha256)

    def wait(self, fragment: int, header, timeout_s: float) -> str:
        """`snapshot`, once it says anything but `UNKNOWN` or `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (verdict := self.snapshot(fragment, header)) == UNKNOWN:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return verdict
