"""Jepsen-style accounting of a chaos run, from independent records.

Sources: each learner's log of pushes Redis acknowledged (``<state>/<id>.acked.jsonl``, written
by the learner's network thread right after XADD returns), the syncers' round records
(included entries with the seconds of work each carries, dropped entries with reasons), the
dead-letter streams and the events stream. A push is identified by (learner, fragment,
base_version, step), so a push that Redis lost in a restart and the learner pushed again counts
once.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import redis

from broker.entries import peek_key
from broker.ids import as_text
from broker.keys import RunKeys
from broker.records import Drop, Reason, read_rounds
from workers.learner_net import read_push_log

Key = tuple[str, int, int, int]


IdMap = dict[tuple[int, str], Key]  # (fragment, entry id) → key: ids are unique per stream only


_GUARD = (Drop.TOKENS, Drop.NORM, Drop.ROUND)  # the poison guard's refusals

def read_acked(state_dir: Path) -> tuple[IdMap, set[Key], int, set[Key]]:
    """(entry id → key, acknowledged keys, re-pushes, attempted keys) from the learners' logs."""
    id_key: IdMap = {}
    keys: set[Key] = set()
    attempted: set[Key] = set()
    repushes = 0
    for path in sorted(state_dir.glob("*.acked.jsonl")):
        for rec in read_push_log(path):
            k = (rec["learner"], int(rec["fragment"]), int(rec["base_version"]), int(rec["step"]))
            if rec.get("attempt"):
                attempted.add(k)
                continue
            id_key[(int(rec["fragment"]), rec["id"])] = k
            keys.add(k)
            repushes += bool(rec.get("repush"))
    return id_key, keys, repushes, attempted


def _key_of(r: redis.Redis, keys: RunKeys, p: int, entry_id: str, id_key: IdMap) -> Key | None:
    if (p, entry_id) in id_key:
        return id_key[(p, entry_id)]
    got = r.xrange(keys.fragment(p).frags, entry_id, entry_id)
    if not got:
        return None
    peek = peek_key(got[0][1])
    return None if peek is None else (peek[0], p, peek[1], peek[2])


def _event_key(f: dict, p: int) -> Key | None:
    """The push a drop event names (the syncer writes its learner, base version and step): the
    key of an entry trimmed since, whose reply never reached its learner (so no acked log has
    it) — an XADD that landed twice, its first copy dropped, the second a duplicate."""
    try:
        learner = as_text(f[b"learner"])
        base, step = int(f[b"base_version"]), int(f[b"step"])
    except (KeyError, ValueError):
        return None
    return (learner, p, base, step) if learner and base >= 0 and step >= 0 else None


def account(r: redis.Redis, run: str, n_fragments: int, state_dir: Path, *, learners: int,
            frag_weights: list[float], t_start: float, t_end: float,
            restarts: list[tuple[str, float]], window_s: float) -> dict:
    """The chaos report (see module docstring); `restarts` are (learner, unix time) pairs."""
    keys = RunKeys(run)
    id_key, acked, repushes, attempted = read_acked(state_dir)
    merged: set[Key] = set()
    times_merged: dict[Key | tuple[int, str], int] = defaultdict(int)
    dropped_stale: set[Key] = set()
    dropped_other: set[Key] = set()
    guard: set[Key] = set()  # refused by the poison guard (tokens, norm) or a refused round
    duplicated = 0
    dead: set[Key] = set()
    deduped: list[Key] = []  # pushes refused as duplicates of an earlier copy
    keyless: dict[tuple[str, int], int] = defaultdict(int)  # merged entries without a key
    round_times: list[float] = []
    useful_s = 0.0
    contributed: dict[str, list[float]] = defaultdict(list)
    joins: dict[str, float] = {}
    for _, f in r.xrange(keys.events):
        if as_text(f.get(b"kind", b"")) == "join":
            joins.setdefault(as_text(f[b"learner"]), float(f[b"t"]))
    if len(joins) >= learners:
        # allocation starts when the last learner joined: from then on every learner-second is
        # allocated, and the seconds an entry carries (first, compiling step included) all
        # come after its learner's join
        t_start = max(joins.values())
    for p in range(n_fragments):
        fk = keys.fragment(p)
        for rec in read_rounds(r, fk):
            t = rec.t or 0.0
            round_times.append(t)
            for i, inc in enumerate(rec.included):
                found = _key_of(r, keys, p, inc.entry_id, id_key)
                times_merged[found or (p, inc.entry_id)] += 1
                k = found or (inc.learner, p, -1, -1)
                if found is None:  # trimmed, never acknowledged to its learner: keyless
                    keyless[(inc.learner, p)] += 1
                merged.add(k)
                contributed[inc.learner].append(t)
                if i < len(rec.seconds) and t >= t_start:  # inside the accounting window
                    useful_s += frag_weights[p] * rec.seconds[i]
            for entry_id, reason in rec.dropped:
                if reason.kind is Drop.DUPLICATE:
                    duplicated += 1
                    # the syncer dedupes a push it has seen before: an earlier copy, maybe
                    # written by an XADD whose answer never came back (and trimmed since)
                    k = _key_of(r, keys, p, entry_id, id_key)
                    if k is not None:
                        deduped.append(k)
                    continue
                k = _key_of(r, keys, p, entry_id, id_key)
                if k is not None:
                    (dropped_stale if reason.kind is Drop.STALE else dropped_other).add(k)
                    if reason.kind in _GUARD:
                        guard.add(k)
        for _, f in r.xrange(fk.dlq):
            k = _key_of(r, keys, p, as_text(f.get(b"dlq_source_id", b"")), id_key)
            if k is None and (peek := peek_key(f)) is not None:
                k = (peek[0], p, peek[1], peek[2])
            if k is not None:
                dead.add(k)
    for _, f in r.xrange(keys.events):
        if as_text(f.get(b"kind", b"")) == "dropped":
            fr = int(f[b"fragment"])
            k = _key_of(r, keys, fr, as_text(f[b"entry"]), id_key) or _event_key(f, fr)
            if k is not None:
                kind = Reason.of(as_text(f[b"reason"])).kind
                if kind is Drop.DUPLICATE:
                    duplicated += 1
                    deduped.append(k)
                else:
                    (dropped_stale if kind is Drop.STALE else dropped_other).add(k)
                    if kind in _GUARD:
                        guard.add(k)
    t_end = max([t_end, *round_times])  # the final flush merges work done before the stop
    accounted = merged | dropped_stale | dropped_other | dead
    # a duplicate accounts for its push only through its earlier copy: one the records name,
    # or a merged entry of the same learner and fragment whose key could not be read (each
    # such entry vouches for one push)
    for k in deduped:
        if k not in accounted and keyless[(k[0], k[1])] > 0:
            keyless[(k[0], k[1])] -= 1
            accounted.add(k)
    lost = sorted(acked - accounted)
    wall = max(t_end - t_start, 1e-9)
    windows = max(1, int(np.ceil(wall / window_s)))
    busy = {int((t - t_start) // window_s) for t in round_times if t_start <= t <= t_end}
    rejoin = []
    for learner, t_r in restarts:
        if not learner.startswith("L"):
            continue  # syncers and Redis come back too, but "contributing" is a learner's act
        later = [t for t in contributed.get(learner, []) if t >= t_r]
        rejoin.append(min(later) - t_r if later else float("inf"))
    finite = [x for x in rejoin if np.isfinite(x)]
    by_learner: dict[str, dict[str, int]] = {}
    for name, group in (("acked", acked), ("merged", merged),
                        ("dropped_by_guard", guard - merged), ("lost", set(lost))):
        for k in group:
            row = by_learner.setdefault(k[0], {"acked": 0, "merged": 0, "dropped_by_guard": 0,
                                               "lost": 0})
            row[name] += 1
    return {
        "pushes_attempted": len(attempted | acked),
        "pushes_acked": len(acked),
        "merged": len(merged & acked) + len(merged - acked),
        "dropped_stale": len(dropped_stale - merged),
        "dropped_other": len(dropped_other - merged - dropped_stale),
        "dropped_by_guard": len(guard - merged),
        "dead_lettered": len(dead),
        "duplicated": duplicated + repushes,
        "repushed_after_redis_loss": repushes,
        "lost": len(lost),
        "lost_keys": [list(k) for k in lost[:20]],
        # a push (or an entry) that two rounds merged: exactly-once broken
        "merged_twice": sum(1 for n in times_merged.values() if n > 1),
        "merged_twice_keys": [list(k) for k, n in times_merged.items() if n > 1][:20],
        "rounds": len(round_times),
        "availability": min(1.0, len(busy) / windows),
        "goodput": useful_s / (learners * wall),
        "rejoins": len(rejoin),
        "rejoins_never": len(rejoin) - len(finite),
        "rejoin_s_p50": float(np.median(finite)) if finite else None,
        "rejoin_s_max": float(max(finite)) if finite else None,
        "wall_s": wall,
        "by_learner": dict(sorted(by_learner.items())),
    }
