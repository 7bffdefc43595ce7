"""The records that cross process boundaries, one type each, with their encoding.

A stream entry's plain fields (a contribution) are :class:`pipeline.contribution.PushHeader`,
encoded by :func:`broker.entries.entry_fields` and decoded by :func:`broker.entries.parse_entry`.
This module holds the others:

* :class:`RoundRecord` — one closed round, an entry of a fragment's ``:rounds`` stream;
* :class:`Heartbeat` — a learner's last heartbeat, a field of the run's ``:learners`` hash;
* :class:`SyncerInfo` — a syncer's record (PUB endpoint, fragments, counters), a field of the
  run's ``:syncers`` hash;
* the end-of-run reports in the run's ``:done`` hash: :class:`FinalPushes` (which fragments a
  learner pushed a final contribution for), :class:`LearnerFinal` (a learner's totals and the
  hashes of its final values) and :class:`SyncerFinal` (the final versions of a syncer's
  fragments);
* :class:`~pipeline.contribution.Drop`, the kind of a refused contribution (re-exported here).

Every reader decodes through these types; a malformed record raises
:class:`~broker.errors.DecodeError`. Values read from Redis may be bytes or str.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis

from broker.errors import DecodeError
from broker.ids import as_text
from broker.keys import FragmentKeys
from broker.untrusted.values import (
    MAX_ITEMS,
    bounded_json,
    bounded_text,
    finite_number,
    nonneg_int,
    record_from_json,
    typed,
)
from pipeline.contribution import Drop, Reason

__all__ = ["Drop", "Reason", "RoundRecord", "Included", "Heartbeat", "SyncerInfo",
           "FinalPushes", "LearnerFinal", "SyncerFinal", "read_rounds"]


class Included(NamedTuple):
    """One merged contribution of a round: its entry, learner, weight and staleness."""

    entry_id: str
    learner: str
    weight: float
    staleness: int


@dataclass(frozen=True)
class RoundRecord:
    """One closed round of one fragment (stream id ``<version>-0`` of its ``:rounds`` stream).

    ``hash`` is the SHA-256 of the published (down-link) value (:func:`pipeline.quant.
    tensors_hash`); ``scale`` the share of an outer step taken; ``seconds`` the learner wall
    time each included contribution carries, in the order of ``included``, less what its
    learner's earlier merged push that it repeats carried (`pipeline.syncer`); ``steps`` and
    ``tokens`` are counted the same way.
    """

    version: int
    fragment: int
    reason: str
    included: tuple[Included, ...]
    dropped: tuple[tuple[str, Reason], ...]
    hash: str
    tokens: int | None = None
    steps: int | None = None
    scale: float = 1.0
    seconds: tuple[float, ...] = ()
    quorum_wait_s: float = 0.0
    grace_wait_s: float = 0.0
    merge_s: float = 0.0
    syncer: str = ""
    t: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (a metrics.jsonl ``round`` record)."""
        d = dataclasses.asdict(self)
        d["included"] = [[i.entry_id, i.learner, i.weight, i.staleness] for i in self.included]
        d["dropped"] = [[i, str(why)] for i, why in self.dropped]
        d["seconds"] = list(self.seconds)
        return {k: v for k, v in d.items() if v is not None}

    def to_fields(self) -> dict[str, str | int | float]:
        """The stream entry's fields (lists as JSON; readable with redis-cli)."""
        return {k: (json.dumps(v) if isinstance(v, list | dict) else v)
                for k, v in self.to_dict().items()}

    @classmethod
    def from_fields(cls, fields: Mapping, *, lenient: bool = False) -> RoundRecord:
        """Decode a round record from stream fields or :meth:`to_dict`'s data.

        Args:
            fields: Field → value (bytes or str keys; lists as JSON text or as lists).
            lenient: For tools that show what they can (plots, inspect): only ``version``
                is required, a malformed list reads as empty and a bad number as its default.

        Raises:
            DecodeError: A required field is missing or malformed.
        """
        f = _Fields(fields, lenient)
        included = f.rows("included", _included_row, required=True)
        dropped = f.rows("dropped", _dropped_row)
        seconds = f.rows("seconds", _seconds_item)
        if len({i.entry_id for i in included}) != len(included) and not lenient:
            raise DecodeError(f"round record {f.version} lists an entry twice")
        return cls(
            version=f.version, fragment=f.get("fragment", _fragment, -1, required=True),
            reason=f.text("reason"), included=included, dropped=dropped,
            hash=f.text("hash", required=True), tokens=f.get("tokens", nonneg_int, None),
            steps=f.get("steps", nonneg_int, None), scale=f.get("scale", _nonneg, 1.0),
            seconds=seconds, quorum_wait_s=max(0.0, f.get("quorum_wait_s", finite_number, 0.0)),
            grace_wait_s=max(0.0, f.get("grace_wait_s", finite_number, 0.0)),
            merge_s=f.get("merge_s", finite_number, 0.0), syncer=f.text("syncer"),
            t=f.get("t", finite_number, None))


def _fragment(v: Any, what: str) -> int:
    x = nonneg_int(v, what)
    if x > 9999:
        raise DecodeError(f"{what}: above 9999")
    return x


def _nonneg(v: Any, what: str) -> float:
    x = finite_number(v, what)
    if x < 0:
        raise DecodeError(f"{what}: negative")
    return x


def _included_row(row: Any, what: str) -> Included:
    if not isinstance(row, list) or len(row) != 4:
        raise DecodeError(f"{what}: a row is not a list of 4")
    entry_id, learner, weight, staleness = row
    return Included(typed(entry_id, str, what), typed(learner, str, what),
                    _nonneg(typed(weight, float, what), what),
                    nonneg_int(typed(staleness, int, what), what))


def _dropped_row(row: Any, what: str) -> tuple[str, Reason]:
    if not isinstance(row, list) or len(row) != 2:
        raise DecodeError(f"{what}: a row is not a list of 2")
    why = typed(row[1], str, what)
    if not why:  # Reason.of("") would read as "other": not what was written
        raise DecodeError(f"{what}: an empty reason")
    return typed(row[0], str, what), Reason.of(why)


def _seconds_item(v: Any, what: str) -> float:
    return _nonneg(typed(v, float, what), what)


class _Fields:
    """The fields of one round record being decoded: strict (every problem raises
    DecodeError) or lenient (a missing or bad value reads as its default, a bad row is left
    out); ``version`` is required either way. Only DecodeError is raised."""

    def __init__(self, fields: Mapping, lenient: bool):
        if not isinstance(fields, Mapping):
            raise DecodeError(f"a round record must be a mapping, got {type(fields).__name__}")
        if len(fields) > 1024:
            raise DecodeError(f"a round record of {len(fields)} fields")
        self.f = {}
        for k, v in fields.items():
            if isinstance(k, bytes | bytearray | str):
                try:
                    self.f[bounded_text(k, "a field name", 64)] = v
                except DecodeError:
                    pass  # not a field of ours
        self.lenient = lenient
        if "version" not in self.f:
            raise DecodeError("round record without a version")
        self.version = nonneg_int(self.f["version"], "version")

    def _bad(self, what: str, cause: Exception | None = None) -> None:
        if not self.lenient:
            raise DecodeError(f"round record {self.version}: {what}") from cause

    def get(self, key: str, conv, default, required: bool = False):
        if key not in self.f:
            if required:
                self._bad(f"no {key}")
            return default
        try:
            return conv(self.f[key], key)
        except DecodeError as e:
            self._bad(str(e), e)
            return default

    def text(self, key: str, required: bool = False) -> str:
        return self.get(key, bounded_text, "", required)

    def rows(self, key: str, build, required: bool = False) -> tuple:
        """A list field's rows, each checked and built by `build(row, what)`."""
        value = self.get(key, functools.partial(bounded_json, max_depth=2,
                                                max_containers=MAX_ITEMS + 1,
                                                max_items=5 * MAX_ITEMS), [], required)
        if not isinstance(value, list) or len(value) > MAX_ITEMS:
            self._bad(f"{key} is not a list of at most {MAX_ITEMS} rows")
            return ()
        out = []
        for row in value:
            try:
                out.append(build(row, key))
            except DecodeError as e:
                self._bad(str(e), e)
        return tuple(out)


def read_rounds(r: redis.Redis, fk: FragmentKeys, *, start: str = "-",
                page: int = 1000) -> Iterator[RoundRecord]:
    """Every round record of a fragment, oldest first, read in pages.

    Raises:
        DecodeError: A record is malformed.
    """
    while True:
        batch = r.xrange(fk.rounds, min=start, max="+", count=page)
        for _, fields in batch:
            yield RoundRecord.from_fields(fields)
        if len(batch) < page:
            return
        start = "(" + as_text(batch[-1][0])


class _JsonRecord:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, raw: Any, what: str = ""):
        """Decode; raises DecodeError on anything but a JSON object of this record."""
        return record_from_json(cls, raw, what or cls.__name__)


@dataclass(frozen=True)
class Heartbeat(_JsonRecord):
    """A learner's last heartbeat (its step, throughput, versions, loss and byte counters)."""

    t: float = 0.0
    step: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    versions: list[int] = field(default_factory=list)
    loss: float | None = None
    pid: int | None = None
    host: str | None = None
    shard: int | None = None
    pushes_attempted: int = 0
    pushes_acked: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    snapshots_read: int = 0
    devices: int = 1  # the learner's island: local devices it trains on
    # the most tokens one inner step of this learner trains on, declared when it joins: a
    # contribution of n steps may not claim more than n times this
    max_tokens_per_step: int = 0
    # syncer endpoint → why its CURVE handshake fails (broker.pubsub.Subscriber): empty when
    # every handshake succeeds
    handshake_failures: dict[str, str] = field(default_factory=dict)
    sig: str = ""  # the learner's signature (broker/signing.py), when it signs


@dataclass(frozen=True)
class SyncerInfo(_JsonRecord):
    """A syncer's registry record: where learners subscribe, what it owns, its counters."""

    t: float = 0.0
    endpoint: str = ""
    fragments: list[int] = field(default_factory=list)
    pid: int | None = None
    host: str | None = None
    rounds: int = 0
    versions: dict[str, int] = field(default_factory=dict)
    last_reason: str = ""
    merged: int = 0
    dropped: int = 0
    dead_lettered: int = 0
    quorum_wait_s: float = 0.0
    grace_wait_s: float = 0.0
    sync_time_s: float = 0.0
    # signed runs: the syncer verifies learners' heartbeats; these are the learners whose
    # heartbeat its key signs (`diloco status` counts only those as live)
    signed: bool = False
    verified: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FinalPushes(_JsonRecord):
    """A learner finished training: the fragments it pushed a final contribution for."""

    final: list[int] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    sig: str = ""  # the learner's signature (broker/signing.py), when it signs


@dataclass(frozen=True)
class LearnerFinal(_JsonRecord):
    """A learner's end-of-run report: totals, and the hash of each fragment's final value."""

    hashes: dict[str, str] = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    pushes_attempted: int = 0
    pushes_acked: int = 0
    zmq_gaps: int = 0
    snapshots_read: int = 0
    step_s: float = 0.0
    train_s: float = 0.0
    steps_per_s: float = 0.0
    # seconds the training thread spent in the island's own work after steps (pushes, merged
    # values, heartbeats, checkpoints): time the learner did not train
    sync_s: float = 0.0
    rejected: int = 0  # merged values that failed a check (never applied)
    # superseding pushes that found their predecessor merged (and rebased first)
    rebased_merged: int = 0
    sig: str = ""  # the learner's signature (broker/signing.py), when it signs


@dataclass(frozen=True)
class Refusal(_JsonRecord):
    """The syncer refused a learner's push (`pipeline.contribution.Drop`: stale, the poison
    guard, …): the push's base version and step, and the reason. A learner waiting for the
    merged value of that push (the final flush, or a blocking mode's wait) stops waiting."""

    base_version: int = 0
    step: int = 0
    reason: str = ""


@dataclass(frozen=True)
class Merged(_JsonRecord):
    """A round merged a learner's push (its base version and step) into `version`. A learner
    about to push again over a push whose merged value never reached it rebases onto that
    version first, so the new push carries only progress not merged yet."""

    base_version: int = 0
    step: int = 0
    version: int = 0


@dataclass(frozen=True)
class SyncerFinal(_JsonRecord):
    """A syncer closed the final rounds of its fragments: fragment → final version."""

    versions: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
