"""What a syncer keeps besides its fragments' algorithm state (`pipeline.syncer`): what its
parts share (`SyncerShared`), its counters, each owned fragment's bookkeeping of entries,
acknowledgements, recent commits and checkpoints, and the payload digest its intake hashes
entries by."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from broker import codec, registry, signing
from broker.entries import payload_pieces, pieces_sha256
from broker.errors import DecodeError
from broker.pubsub import Publisher
from broker.records import SyncerInfo
from broker.streams import Entry, FragmentStreams
from pipeline.contribution import PushHeader
from pipeline.downlink import full_value
from pipeline.fragments import fragment_sizes
from pipeline.quant import QTensor, tensors_hash
from pipeline.syncer import FragmentSyncer
from workers.common import RunContext
from workers.scalars import ScalarLog
from workers.syncer_config import SyncerConfig

log = logging.getLogger("diloco.syncer")


@dataclass
class SyncerStats:
    """The syncer's counters (its registry record, status and metrics read them)."""

    rounds: int = 0          # rounds committed and published
    commits: int = 0         # rounds merged (the fault seam counts these)
    merged: int = 0          # contributions merged
    dropped: int = 0         # contributions refused (stale, duplicate, invalid)
    duplicated: int = 0      # duplicate pushes recognised
    dead_lettered: int = 0   # entries moved to a dead-letter stream
    fenced: int = 0          # of those: entries of a superseded learner process (an old epoch)
    lost: int = 0            # pending entries deleted before merging
    quorum_wait_s: float = 0.0   # last round: first arrival to quorum
    grace_wait_s: float = 0.0    # last round: quorum to close
    last_reason: str = ""        # last round: why it closed


@dataclass
class FragState:
    core: FragmentSyncer
    entries: dict[str, PushHeader] = field(default_factory=dict)   # entry id → open-round entry
    ack_extra: list[str] = field(default_factory=list)            # duplicates/drops to ack
    # of those: entry id → its push's (learner, base version, step), named in its drop event
    # (the entry itself may be trimmed before anyone reads the event)
    drop_keys: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    deferred: list[Entry] = field(default_factory=list)
    final_seen: set[str] = field(default_factory=set)
    finished: bool = False
    # (version, oldest entry id) of recent rounds
    recent_min_ids: list[tuple[int, str]] = field(default_factory=list)
    # recent round records with their acknowledged ids and merge records, and the snapshots
    # of recent versions (`keep_snapshot`): enough to re-commit what Redis lost if it restarts
    # from an AOF missing its last second
    recent: deque = field(default_factory=lambda: deque(maxlen=64))
    snapshots: dict[int, memoryview] = field(default_factory=dict)
    ckpt_version: int = 0      # the version of the fragment's last checkpoint (full state)
    ckpt_t: float = 0.0        # when it was written (monotonic)
    sent_floor: int = 0        # the oldest `sent:<v>` snapshot Redis may still hold


    def keep_snapshot(self, version: int, blob: memoryview) -> None:
        """Keep `version`'s packed snapshot, with the newest ``max_staleness + 1`` — except
        under the delta down link: a snapshot is then the fp32 reference the core keeps in
        its history, packed again bit for bit when a re-commit needs it
        (`snapshots_since`)."""
        if self.core.sync_cfg.down_delta:
            return
        self.snapshots[version] = blob
        self.snapshots.pop(version - self.core.sync_cfg.max_staleness - 1, None)

    def snapshots_since(self, stored: int, run: str) -> dict[int, memoryview]:
        """The packed snapshots of the versions after `stored` that this syncer can still
        rebuild (a re-commit of rounds Redis lost)."""
        out = {v: b for v, b in self.snapshots.items() if v > stored}
        if self.core.sync_cfg.down_delta:  # as the rounds wrote them: a delta as sent when
            # the version before is in Redis (or written with it), else the whole value
            h = self.core.history
            for v, values in h.items():
                if v <= stored or v in out:
                    continue
                delta = h.delta(v) if v - 1 >= stored else None
                out[v] = (whole_snapshot(run, self.core.fragment, v, values) if delta is None
                          else delta_snapshot(run, self.core.fragment, v, delta,
                                              tensors_hash(values)))
        return dict(sorted(out.items()))


def delta_snapshot(run: str, fragment: int, version: int,
                   delta: Mapping[str, QTensor], value: str) -> memoryview:
    """A version kept as the delta against the version before that it went out as (`value`:
    the SHA-256 of the value it makes), as ``sent:<version>`` holds it."""
    return codec.pack_snapshot(run, fragment, version, delta, base=version - 1, value=value)


def whole_snapshot(run: str, fragment: int, version: int,
                   values: Mapping[str, np.ndarray]) -> memoryview:
    """A version's value learners held, as a whole fp32 snapshot (in name order, as
    `FragmentSyncer.snapshot_tensors`: the same bytes and hash as its round's)."""
    t = full_value(values)
    return codec.pack_snapshot(run, fragment, version, {k: t[k] for k in sorted(t)})


def payload_digest(e: Entry, limit: int) -> str | None:
    """sha256 hex of an entry's payload; None when it is missing or oversized (parse_entry
    then reports it)."""
    try:
        parts = payload_pieces(e.fields)
    except DecodeError:
        return None
    return None if sum(map(len, parts)) > limit else pieces_sha256(parts)


class SyncerShared:
    """What the syncer's parts (intake, rounds, commits, ownership; `workers.syncer`) share:
    the run, the fragment streams and publisher, the fragments this syncer serves, its
    counters, and what it knows of the learners (refreshed by the loop)."""

    def __init__(self, cfg: SyncerConfig, ctx: RunContext, pub: Publisher,
                 scalars: ScalarLog | None = None):
        self.cfg = cfg
        self.ctx = ctx
        self.run_cfg = ctx.cfg
        self.sync = ctx.cfg.effective_sync()
        self.bcfg = ctx.cfg.broker
        self.streams = FragmentStreams(ctx.r, ctx.keys, max_entries=self.bcfg.stream_max_entries,
                                       piece_bytes=self.bcfg.piece_bytes)
        self.store = self.streams.state  # leases, commits, checkpoints (`broker.commit`)
        self.pub = pub
        self.verifier = signing.Verifier(cfg.sign_keys, heartbeat_max_age_s=(  # a replayed one
            self.bcfg.heartbeat_ttl_s + signing.CLOCK_SKEW_S)) if cfg.sign_keys else None
        # no fragment list: the fragments are shared with the run's other such syncers
        # (`workers.syncer_ownership`); else exactly these, standing by while another holds them
        self.auto = not cfg.fragments
        self.sizes = dict(enumerate(fragment_sizes(ctx.shapes, ctx.fragments)))
        self.owned: list[int] = []
        self.frags: dict[int, FragState] = {}
        self.stats = SyncerStats()
        self.phase = "starting"  # → "standing by" (another syncer holds a lease) → "active"
        self.last_tick = time.monotonic()  # the loop's last round (the liveness probe)
        self.live: frozenset[str] = frozenset()   # learners with a fresh (verified) heartbeat
        self.known: frozenset[str] = frozenset()  # learners with a heartbeat record
        self.step_time_s = 1.0
        # learner → the most tokens one of its steps may claim (its heartbeat's declaration)
        self.declared: dict[str, int] = {}
        # learner → the newest epoch of its entries seen: entries of older epochs are fenced
        self.epochs: dict[str, int] = {}
        self.scalars = scalars  # its curves (`workers.scalars`; None: not asked for)

    def event(self, kind: str, **fields) -> None:
        registry.event(self.ctx.r, self.ctx.keys, kind, **fields)

    def shapes(self, p: int) -> dict[str, tuple[int, ...]]:
        return {n: self.ctx.shapes[n] for n in self.ctx.fragments[p]}

    def verified(self, reports: dict, kind: str) -> dict:
        """With signed contributions on, the end-of-run reports signed by their learner's
        key (a learner credential can write any field of the shared ``done`` hash)."""
        if self.verifier is None:
            return reports
        return {n: rec for n, rec in reports.items()
                if self.verifier.record_ok(self.ctx.keys.run, kind, n, rec)}

    def forget(self, p: int, how: str) -> None:
        """Stop serving fragment p at once (its lease is lost or released). Entries read and
        not committed stay pending here; the next owner claims them when it adopts it."""
        f = self.frags.pop(p)
        self.owned.remove(p)
        log.info("fragment %d: handed over at v%d (%s)", p, f.core.version, how)

    def info(self) -> SyncerInfo:
        """This syncer's registry record (`diloco status`, the dashboard, the metrics)."""
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
