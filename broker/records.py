"""The records that cross process boundaries, one type each, with their encoding.

A stream entry's plain fields (a contribution) are :class:`broker.codec.EntryMeta`, encoded by
:func:`broker.codec.entry_fields` and decoded by :func:`broker.codec.parse_entry`. This module
holds the others:

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
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis

from broker.errors import DecodeError
from broker.ids import as_text
from broker.keys import FragmentKeys
from pipeline.contribution import Drop, Reason

__all__ = ["Drop", "Reason", "RoundRecord", "Included", "Heartbeat", "SyncerInfo",
           "FinalPushes", "LearnerFinal", "SyncerFinal", "read_rounds"]


def _num(v: Any, what: str) -> float:
    try:
        x = float(as_text(v))
    except (TypeError, ValueError) as e:
        raise DecodeError(f"{what}: not a number: {str(v)[:40]!r}") from e
    if not math.isfinite(x):
        raise DecodeError(f"{what}: not finite")
    return x


def _int(v: Any, what: str) -> int:
    x = _num(v, what)
    if x != int(x):
        raise DecodeError(f"{what}: not an integer")
    return int(x)


def _json(v: Any, what: str) -> Any:
    v = as_text(v)
    if not isinstance(v, str):
        return v
    try:
        return json.loads(v)
    except ValueError as e:
        raise DecodeError(f"{what}: not JSON") from e


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
    time each included contribution carries, in the order of ``included``.
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
        included = f.rows("included", 4, lambda e, who, w, s: Included(str(e), str(who),
                                                                        float(w), int(s)))
        dropped = f.rows("dropped", 2, lambda e, why: (str(e), Reason.of(str(why))))
        seconds = f.rows("seconds", None, float)
        if len({i.entry_id for i in included}) != len(included) and not lenient:
            raise DecodeError(f"round record {f.version} lists an entry twice")
        return cls(
            version=f.version, fragment=f.get("fragment", _int, -1, required=True),
            reason=f.text("reason"), included=included, dropped=dropped,
            hash=f.text("hash", required=True), tokens=f.get("tokens", _int, None),
            steps=f.get("steps", _int, None), scale=f.get("scale", _num, 1.0),
            seconds=seconds, quorum_wait_s=max(0.0, f.get("quorum_wait_s", _num, 0.0)),
            grace_wait_s=max(0.0, f.get("grace_wait_s", _num, 0.0)),
            merge_s=f.get("merge_s", _num, 0.0), syncer=f.text("syncer"),
            t=f.get("t", _num, None))


class _Fields:
    """The fields of one round record being decoded: strict (every problem raises
    DecodeError) or lenient (a missing or bad value reads as its default, a bad row is left
    out); ``version`` is required either way."""

    def __init__(self, fields: Mapping, lenient: bool):
        self.f = {as_text(k): v for k, v in fields.items()}
        self.lenient = lenient
        if "version" not in self.f:
            raise DecodeError("round record without a version")
        self.version = _int(self.f["version"], "version")

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
        if key not in self.f and required:
            self._bad(f"no {key}")
        return str(as_text(self.f.get(key, "")))

    def rows(self, key: str, width: int | None, build) -> tuple:
        """A list field's rows, each built by `build` (from a list of `width` items, or from
        the item itself when `width` is None)."""
        value = self.get(key, _json, [], required=key == "included")
        if not isinstance(value, list):
            self._bad(f"{key} is not a list")
            return ()
        out = []
        for row in value:
            try:
                if width is None:
                    out.append(build(row))
                elif isinstance(row, list) and len(row) == width:
                    out.append(build(*row))
                else:
                    raise ValueError(f"a row is not a list of {width}")
            except (TypeError, ValueError) as e:
                self._bad(f"{key}: {e}", e)
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


def _from_json(cls, raw: Any, what: str):
    """A record dataclass from its JSON text: known fields only, numbers checked."""
    data = _json(raw, what)
    if not isinstance(data, dict):
        raise DecodeError(f"{what}: expected a JSON object")
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            continue  # written by a newer process: ignored
        if names[k].type in ("int", "float") and not (
                isinstance(v, int | float) and not isinstance(v, bool)):
            raise DecodeError(f"{what}: {k} must be a number")
        kwargs[k] = v
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise DecodeError(f"{what}: {e}") from e


class _JsonRecord:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, raw: Any, what: str = ""):
        """Decode; raises DecodeError on anything but a JSON object of this record."""
        return _from_json(cls, raw, what or cls.__name__)


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


@dataclass(frozen=True)
class FinalPushes(_JsonRecord):
    """A learner finished training: the fragments it pushed a final contribution for."""

    final: list[int] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0


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


@dataclass(frozen=True)
class SyncerFinal(_JsonRecord):
    """A syncer closed the final rounds of its fragments: fragment → final version."""

    versions: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
