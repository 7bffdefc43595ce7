"""A fragment's committed state, rebuilt from its last checkpoint and the rounds since.

The syncer writes the full fp32 state of a fragment (Θ, the outer momentum, the dedupe keys:
``ddl:{<run>/fNNNN}:state``) only every ``broker.checkpoint_rounds`` rounds or
``broker.checkpoint_s`` seconds; every round in between commits its round record, its
acknowledgements and its published value. The rounds stream is a bit-exact log: the state at
the latest committed version is the checkpoint plus the rounds recorded after it, each one
replayed by offering the entries its record lists, in the recorded order, to the checkpoint's
:class:`pipeline.syncer.FragmentSyncer` and closing the round with the recorded reason and
share — the same code ``diloco replay`` runs from version 0 (:func:`replay_round`), and every
replayed round's value hash must equal the recorded one.

Three readers: a syncer that takes over or restarts (:func:`recover`), the tools that need
full-precision values (``diloco export``, the harness's evaluations: :func:`recover` too), and
``diloco replay`` (:func:`iter_records`, :func:`fetch_entries`, :func:`replay_round`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis

from broker import archive as archmod
from broker import codec, pieces
from broker.entries import parse_entry, payload_size
from broker.errors import BrokerError, DecodeError
from broker.ids import as_text
from broker.keys import FragmentKeys
from broker.records import RoundRecord
from broker.state import unpack_state
from pipeline import capacity, quant
from pipeline.config import RunConfig
from pipeline.contribution import Contribution
from pipeline.downlink import apply_delta, full_value
from pipeline.guard import fragment_prior
from pipeline.history import History
from pipeline.syncer import FragmentSyncer, RoundResult

_PAGE = 500


class RecoveryError(BrokerError):
    """The rounds since the checkpoint cannot be replayed (an entry is gone, a record is
    malformed, or a replayed value differs from the recorded one)."""


def iter_records(r: redis.Redis, fk: FragmentKeys, after: int | None = None
                 ) -> Iterator[tuple[str, RoundRecord]]:
    """The fragment's round records (``(id, record)``, oldest first; only versions above
    `after` when given), in pages of XRANGE.

    Raises:
        DecodeError: A record is malformed.
    """
    start = "-" if after is None else f"{after + 1}-0"
    while True:
        page = r.xrange(fk.rounds, start, "+", count=_PAGE)
        for rid, fields in page:
            try:
                rec = RoundRecord.from_fields(fields)
            except DecodeError as e:
                raise DecodeError(f"round record {as_text(rid)} is malformed: {e}") from e
            yield as_text(rid), rec
        if len(page) < _PAGE:
            return
        start = "(" + as_text(page[-1][0])


def committed_version(r: redis.Redis, fk: FragmentKeys) -> int | None:
    """The fragment's latest committed version: its last round record's (None: no round
    recorded yet — the committed version is the state's)."""
    last = r.xrevrange(fk.rounds, "+", "-", count=1)
    return int(as_text(last[0][0]).split("-")[0]) if last else None


def fetch_entries(r: redis.Redis, fk: FragmentKeys, ids: list[str],
                  archived: Mapping[str, dict] | None = None
                  ) -> tuple[dict[str, tuple[dict, str]], list[str]]:
    """Entry id → (raw fields, "redis" | "archive"), and the ids found in neither."""
    pipe = r.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xrange(fk.frags, entry_id, entry_id)
    found, missing = {}, []
    for entry_id, rows in zip(ids, pipe.execute(), strict=True):
        if rows and rows[0][1]:
            found[entry_id] = (rows[0][1], "redis")
        elif archived and entry_id in archived:
            found[entry_id] = (archived[entry_id], "archive")
        else:
            missing.append(entry_id)
    return found, missing


@dataclass
class RoundCheck:
    """One replayed round: per input a row (see `ops.tools.replay`'s divergence ``inputs``),
    every difference from the record in words (``problems``; ``kind`` names the first), and
    the closed round (None when nothing could be merged)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    kind: str = ""
    result: RoundResult | None = None

    def bad(self, kind: str, text: str) -> None:
        self.kind = self.kind or kind
        self.problems.append(text)


def replay_round(core: FragmentSyncer, rec: RoundRecord, inputs: Mapping[str, tuple[dict, str]],
                 max_bytes: int) -> RoundCheck:
    """Offer the entries `rec` lists (every one must be in `inputs`) to `core` in the recorded
    order, close the round with the recorded reason and share, and compare with the record:
    version, each entry's weight and staleness, the value hash, the token and step totals."""
    check = RoundCheck()
    if rec.version != core.version + 1:
        check.bad("version", f"record says version {rec.version}, replay is at {core.version}")
    p = core.fragment
    for entry_id, learner, weight, staleness in rec.included:
        fields, source = inputs[entry_id]
        row = {"entry_id": entry_id, "source": source, "learner": learner,
               "recorded_weight": weight, "recorded_staleness": staleness, "weight": None,
               "staleness": None, "base_version": None, "step": None, "steps": None,
               "tokens": None, "accepted": False, "refusal": None}
        check.rows.append(row)
        try:
            meta, tensors = parse_entry(fields, max_bytes=max_bytes)
        except DecodeError as e:
            row["refusal"] = f"malformed entry: {e}"
            check.bad("decode", f"entry {entry_id}: {e}")
            continue
        row.update(base_version=meta.base_version, step=meta.step, steps=meta.steps,
                   tokens=meta.tokens)
        if meta.fragment != p or meta.learner != learner:
            check.bad("entry", f"entry {entry_id} is learner {meta.learner!r} fragment "
                      f"{meta.fragment}, the record says learner {learner!r} fragment {p}")
        c = Contribution.of(meta, tensors, entry_id=entry_id, nbytes=payload_size(fields))
        ok, why = core.offer(c, 0.0)
        row["accepted"], row["refusal"] = ok, None if ok else why
        if not ok:
            check.bad("refused", f"entry {entry_id} was merged by the syncer, replay refuses "
                      f"it: {why}")
    if not any(row["accepted"] for row in check.rows):
        if not check.problems:
            check.bad("record", "the record lists no merged entries")
        return check
    result = check.result = core.close(0.0, rec.reason, rec.scale)
    merged = {entry_id: (w, s) for entry_id, _, w, s in result.included}
    for row in check.rows:
        if row["entry_id"] not in merged:
            continue
        row["weight"], row["staleness"] = merged[row["entry_id"]]
        if row["weight"] != row["recorded_weight"]:
            check.bad("weight", f"entry {row['entry_id']}: weight {row['weight']!r}, "
                      f"recorded {row['recorded_weight']!r}")
        if row["staleness"] != row["recorded_staleness"]:
            check.bad("staleness", f"entry {row['entry_id']}: staleness {row['staleness']}, "
                      f"recorded {row['recorded_staleness']}")
    if result.sent_hash != rec.hash:
        check.bad("hash", f"value hash {result.sent_hash} differs from the recorded {rec.hash}")
    for name in ("tokens", "steps"):
        got, recorded = getattr(result, name), getattr(rec, name)
        if recorded is not None and got != recorded:
            check.bad("totals", f"{name}: {got}, recorded {recorded}")
    return check


@dataclass
class Recovered:
    """A fragment's state at its latest committed version."""

    core: FragmentSyncer
    checkpoint_version: int   # the version of the checkpoint it started from
    replayed: int             # rounds replayed on top of it
    seconds: float            # time the replay took


def restore_checkpoint(state: dict, cfg: RunConfig, shapes: Mapping[str, tuple[int, ...]],
                       is_embedding: Callable[[str], bool], sent: Mapping[int, bytes],
                       max_bytes: int) -> FragmentSyncer:
    """A fragment's :class:`FragmentSyncer` from its checkpoint `state` (`read_checkpoint`'s)
    and the snapshots of the versions before it that `sent` holds (version → snapshot blob:
    the values stale contributions are anchored at).

    Raises:
        DecodeError: A snapshot is malformed.
    """
    history = history_from_snapshots(sent, max_bytes, shapes)
    if history is None or int(state["version"]) not in history:
        raise DecodeError(f"the snapshot of the checkpoint's version {state['version']} is "
                          f"missing")
    state["history"] = history
    return FragmentSyncer.from_state_dict(state, cfg.outer, cfg.effective_sync(), is_embedding,
                                          fragment_prior(cfg, shapes))


def history_from_snapshots(sent: Mapping[int, bytes | bytearray], max_bytes: int,
                           shapes: Mapping[str, tuple[int, ...]]) -> History | None:
    """The values of consecutive versions (version → ``sent:<v>`` blob) as learners held
    them: a whole snapshot as it is, a delta (the delta down link keeps each version but the
    oldest as it was sent) applied to the version before and checked against the hash of the
    value it makes. A version whose chain is broken (a delta without the version before it)
    is left out, with those before it: a stale push anchored there is refused as
    unanchored. None when no version is left.

    Raises:
        DecodeError: A snapshot is malformed, names another version or other tensors than the
            fragment's `shapes`, or a delta does not make the value its header names.
    """
    history: History | None = None
    want = {k: tuple(s) for k, s in shapes.items()}
    for v in sorted(sent):
        header, tensors = codec.unpack_snapshot(sent[v], max_bytes=max_bytes, delta_ok=True)
        if header.version != v:
            raise DecodeError(f"snapshot sent:{v} holds version {header.version}")
        if {k: tuple(q.shape) for k, q in tensors.items()} != want:
            raise DecodeError(f"snapshot sent:{v}: tensors do not match the fragment's names "
                              f"and shapes")
        if header.base < 0:
            values = {k: quant.dequantize(q) for k, q in tensors.items()}
            if history is None:
                history = History(v, values)
            else:
                history.add(v, values, {}, -1)
            continue
        if history is None or header.base != v - 1 or header.base not in history:
            history = None  # the chain restarts at the next whole value
            continue
        values = apply_delta(history[header.base], tensors)
        if quant.tensors_hash(values) != header.value:
            raise DecodeError(f"snapshot sent:{v}: its delta does not make the value it names")
        history.add(v, values, tensors, header.base)
    return history


def committed_theta(r: redis.Redis, fk: FragmentKeys, cfg: RunConfig,
                    shapes: Mapping[str, tuple[int, ...]], is_embedding: Callable[[str], bool],
                    archive_dir: str | Path | None = None) -> tuple[dict[str, np.ndarray], int]:
    """(Θ in fp32, version) of the fragment at its latest committed version, holding no more
    than that needs: the checkpoint's Θ when no round was committed after it (the end of every
    run writes one), else :func:`recover`'s (the checkpoint, the snapshots stale rounds are
    anchored at, the rounds since).

    Raises:
        RecoveryError: As :func:`recover`.
    """
    state = read_checkpoint(r, fk, shapes)
    last = committed_version(r, fk)
    if last is None or last <= state["version"]:
        return state["theta"], int(state["version"])
    rec = recover(r, fk, cfg, shapes, is_embedding, archive_dir=archive_dir, state=state)
    return rec.core.theta, rec.core.version


def read_checkpoint(r: redis.Redis, fk: FragmentKeys, shapes: Mapping[str, tuple[int, ...]],
                    blob: bytes | bytearray | None = None) -> dict:
    """The fragment's checkpoint decoded (`broker.state.unpack_state`): `blob`, or read from
    Redis (in pieces or whole) when not given.

    Raises:
        RecoveryError: No checkpoint, or one that does not decode.
    """
    limit = capacity.state_limit(shapes)
    try:
        if blob is None:
            blob = pieces.read(r, fk.state, max_bytes=limit,
                               what=f"fragment {fk.fragment}'s state")
        if blob is None:
            raise RecoveryError(f"fragment {fk.fragment}: no checkpoint")
        return unpack_state(blob, max_bytes=limit, shapes=shapes)
    except DecodeError as e:
        raise RecoveryError(f"fragment {fk.fragment}: the checkpoint cannot be read: {e}") from e


def recover(r: redis.Redis, fk: FragmentKeys, cfg: RunConfig,
            shapes: Mapping[str, tuple[int, ...]], is_embedding: Callable[[str], bool],
            archive_dir: str | Path | None = None, blob: bytes | None = None,
            state: dict | None = None) -> Recovered:
    """The fragment's state at its latest committed version: the checkpoint (`state` decoded
    already, else `blob`, else read from Redis), then every round recorded after it replayed
    and verified.

    With the delta down link the recovered value is re-published whole (as a restored one
    always was: a delta is no use to a learner that missed its base).

    Raises:
        RecoveryError: No checkpoint, an entry of a round since it is in neither the stream
            nor the archive, a malformed record or snapshot, or a replayed round that differs
            from its record.
    """
    max_bytes = cfg.broker.max_payload_bytes
    if state is None:
        state = read_checkpoint(r, fk, shapes, blob)
    del blob  # decoded: its arrays are the state's now
    try:
        version = int(state["version"])
        lo = max(0, version - cfg.effective_sync().max_staleness)
        vs = list(range(lo, version + 1))
        sent = {v: b for v, b in zip(vs, pieces.read_many(
            r, [fk.sent(v) for v in vs], max_bytes=max_bytes, what="snapshot"), strict=True)
                if b is not None}
        core = restore_checkpoint(state, cfg, shapes, is_embedding, sent, max_bytes)
    except DecodeError as e:
        raise RecoveryError(f"fragment {fk.fragment}: the checkpoint cannot be read: {e}") from e
    out = Recovered(core, version, 0, 0.0)
    t0 = time.monotonic()
    archived: dict | None = None
    try:
        for rid, rec in iter_records(r, fk, after=version):
            ids = [row[0] for row in rec.included]
            inputs, missing = fetch_entries(r, fk, ids, archived)
            if missing and archive_dir and archived is None:
                archived = archmod.load_archive(archive_dir, fk.run, fk.fragment)
                inputs, missing = fetch_entries(r, fk, ids, archived)
            if missing:
                raise RecoveryError(
                    f"fragment {fk.fragment}: round {rid} merged entries that are neither in "
                    f"the stream nor in the archive ({', '.join(missing[:5])}): the rounds "
                    f"since the checkpoint at v{version} cannot be replayed")
            check = replay_round(core, rec, inputs, max_bytes)
            if check.problems:
                raise RecoveryError(f"fragment {fk.fragment}: replaying round {rid} since the "
                                    f"checkpoint at v{version}: " + "; ".join(check.problems))
            out.replayed += 1
    except DecodeError as e:
        raise RecoveryError(f"fragment {fk.fragment}: {e}") from e
    if out.replayed and core.sync_cfg.down_delta:
        core.sent, core.sent_base = full_value(core.sent_values), -1
    out.seconds = time.monotonic() - t0
    return out
