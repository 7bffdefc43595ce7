"""A learner's reads of fragments' snapshots from Redis, to repair a gap in its merged values
(a missed message, a delta whose base it lacks, a value whose hash is not the syncer's).

Run by the learner's network thread (`workers.learner_net.LearnerNet`). With CURVE a snapshot
is taken only as the syncers attested it (`broker.attest`): one not attested yet is kept,
decoded, and checked again as attestations arrive — it is read again only when a newer
version is attested, or after `broker.attest.READ_AGAIN_S` — and one that is not what they
attested is refused (a `bad-global` event) and read again 5 s later.
"""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

from broker import attest, codec
from broker.errors import DecodeError

if TYPE_CHECKING:
    from workers.learner_net import LearnerNet

WAIT_S = 5.0  # how long a snapshot not attested yet is kept before it is read again


class SnapshotRepair:
    """The fragments whose snapshot the learner wants (`requests`), read and handed to the
    network thread's delivery once they pass (see module docstring)."""

    def __init__(self, net: LearnerNet):
        self.net = net
        self.requests: queue.Queue = queue.Queue()
        self.again: dict[int, float] = {}  # fragment → when to read a refused one again
        # fragment → (header, tensors, until when): read, not attested yet
        self.unattested: dict[int, tuple] = {}

    def serve(self) -> None:
        """Read what is wanted, check what waits for its attestation, deliver what passes."""
        wanted, now = set(), time.monotonic()
        while True:
            try:
                wanted.add(self.requests.get_nowait())
            except queue.Empty:
                break
        for p in [p for p, at in self.again.items() if at <= now]:
            del self.again[p]
            wanted.add(p)
        for p, (header, tensors, until) in list(self.unattested.items()):
            verdict = self.net.attested.snapshot(p, header)
            if p in wanted or (verdict == attest.UNKNOWN and now < until):
                continue
            del self.unattested[p]
            self._take(p, header, tensors, verdict, now)
        for p in sorted(wanted):
            got = self._read(p)
            if got is not None:
                self.unattested.pop(p, None)
                self._take(p, *got, self.net.attested.snapshot(p, got[0]), now)

    def _read(self, p: int) -> tuple | None:
        net = self.net
        try:
            blob = net.streams.read_global(p, net.bcfg.max_payload_bytes)
            if blob is None:
                return None
            net.stats.snapshots_read += 1
            net.stats.snapshot_bytes += len(blob)
            return codec.unpack_snapshot(blob, max_bytes=net.bcfg.max_payload_bytes)
        except DecodeError as e:
            net._reject(p, f"malformed snapshot: {e}")
            return None

    def _take(self, p: int, header, tensors: dict, verdict: str, now: float) -> None:
        if verdict == attest.OK:
            self.net._deliver(header, tensors)
        elif verdict == attest.UNKNOWN:
            self.unattested[p] = (header, tensors, now + WAIT_S)
        else:
            self.again[p] = now + attest.READ_AGAIN_S[verdict]
            if verdict == attest.FORGED:
                self.net._reject(p, attest.refusal(header.version))
