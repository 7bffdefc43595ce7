"""What a syncer keeps besides its fragments' algorithm state (`pipeline.syncer`): its
counters, each owned fragment's bookkeeping of entries, acknowledgements, recent commits and
checkpoints, and the payload digest its intake hashes entries by."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from broker import codec
from broker.entries import EntryMeta, payload_pieces, pieces_sha256
from broker.errors import DecodeError
from broker.streams import Entry
from pipeline.downlink import full_value
from pipeline.syncer import FragmentSyncer


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
    entries: dict[str, EntryMeta] = field(default_factory=dict)   # entry id → open-round entry
    ack_extra: list[str] = field(default_factory=list)            # duplicates/drops to ack
    deferred: list[Entry] = field(default_factory=list)
    final_seen: set[str] = field(default_factory=set)
    finished: bool = False
    # (version, oldest entry id) of recent rounds
    recent_min_ids: list[tuple[int, str]] = field(default_factory=list)
    # recent round records with their acknowledged ids and merge records, and the snapshots
    # of recent versions (`keep_snapshot`): enough to re-commit what Redis lost if it restarts
    # from an AOF missing its last second
    recent: deque = field(default_factory=lambda: deque(maxlen=64))
    snapshots: dict[int, bytes] = field(default_factory=dict)
    ckpt_version: int = 0      # the version of the fragment's last checkpoint (full state)
    ckpt_t: float = 0.0        # when it was written (monotonic)
    sent_floor: int = 0        # the oldest `sent:<v>` snapshot Redis may still hold


    def keep_snapshot(self, version: int, blob: bytes) -> None:
        """Keep `version`'s packed snapshot, with the newest ``max_staleness + 1`` — except
        under the delta down link: a snapshot is then the fp32 reference the core keeps in
        its history, packed again bit for bit when a re-commit needs it
        (`snapshots_since`)."""
        if self.core.sync_cfg.down_delta:
            return
        self.snapshots[version] = blob
        self.snapshots.pop(version - self.core.sync_cfg.max_staleness - 1, None)

    def snapshots_since(self, stored: int, run: str) -> dict[int, bytes]:
        """The packed snapshots of the versions after `stored` that this syncer can still
        rebuild (a re-commit of rounds Redis lost)."""
        out = {v: b for v, b in self.snapshots.items() if v > stored}
        if self.core.sync_cfg.down_delta:
            for v, values in self.core.history.items():
                if v > stored and v not in out:
                    out[v] = codec.pack_snapshot(run, self.core.fragment, v, full_value(values))
        return dict(sorted(out.items()))


def payload_digest(e: Entry, limit: int) -> str | None:
    """sha256 hex of an entry's payload; None when it is missing or oversized (parse_entry
    then reports it)."""
    try:
        parts = payload_pieces(e.fields)
    except DecodeError:
        return None
    return None if sum(map(len, parts)) > limit else pieces_sha256(parts)
