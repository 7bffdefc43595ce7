"""What a syncer keeps besides its fragments' algorithm state (`pipeline.syncer`): its
counters, each owned fragment's bookkeeping of entries, acknowledgements, recent commits and
checkpoints, and the payload digest its intake hashes entries by."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from broker.entries import EntryMeta, payload_pieces, pieces_sha256
from broker.errors import DecodeError
from broker.streams import Entry
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
    # recent round records with their acknowledged ids and merge records, and recent
    # snapshots: enough to re-commit what Redis lost if it restarts from an AOF missing its
    # last second
    recent: deque = field(default_factory=lambda: deque(maxlen=64))
    snapshots: dict[int, bytes] = field(default_factory=dict)
    ckpt_version: int = 0      # the version of the fragment's last checkpoint (full state)
    ckpt_t: float = 0.0        # when it was written (monotonic)
    sent_floor: int = 0        # the oldest `sent:<v>` snapshot Redis may still hold


def payload_digest(e: Entry, limit: int) -> str | None:
    """sha256 hex of an entry's payload; None when it is missing or oversized (parse_entry
    then reports it)."""
    try:
        parts = payload_pieces(e.fields)
    except DecodeError:
        return None
    return None if sum(map(len, parts)) > limit else pieces_sha256(parts)
