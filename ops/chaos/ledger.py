"""Jepsen-style accounting of a chaos run, from independent records.

Sources: each learner's log of pushes Redis acknowledged (``<state>/<id>.acked.jsonl``, written
by the learner's network thread right after XADD returns), the syncers' round records
(included entries with the seconds of work each carries, dropped entries with reasons), the
dead-letter streams and the events stream. A push is identified by (learner, fragment,
base_version, step), so a push that Redis lost in a restart and the learner pushed again counts
once.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import redis

from broker.keys import RunKeys
from workers.learner_net import read_push_log

Key = tuple[str, int, int, int]


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


IdMap = dict[tuple[int, str], Key]  # (fragment, entry id) → key: ids are unique per stream only


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
    f = got[0][1]
    return (_s(f[b"learner"]), int(f[b"fragment"]), int(f[b"base_version"]), int(f[b"step"]))


def account(r: redis.Redis, run: str, n_fragments: int, state_dir: Path, *, learners: int,
            frag_weights: list[float], t_start: float, t_end: float,
            restarts: list[tuple[str, float]], window_s: float) -> dict:
    """The chaos report (see module docstring); `restarts` are (learner, unix time) pairs."""
    keys = RunKeys(run)
    id_key, acked, repushes, attempted = read_acked(state_dir)
    merged: set[Key] = set()
    dropped_stale: set[Key] = set()
    dropped_other: set[Key] = set()
    duplicated = 0
    dead: set[Key] = set()
    round_times: list[float] = []
    useful_s = 0.0
    contributed: dict[str, list[float]] = defaultdict(list)
    joins: dict[str, float] = {}
    for _, f in r.xrange(keys.events):
        if _s(f.get(b"kind", b"")) == "join":
            joins.setdefault(_s(f[b"learner"]), float(f[b"t"]))
    if len(joins) >= learners:
        # allocation starts when the last learner joined: from then on every learner-second is
        # allocated, and the seconds an entry carries (first, compiling step included) all
        # come after its learner's join
        t_start = max(joins.values())
    for p in range(n_fragments):
        fk = keys.fragment(p)
        for _, f in r.xrange(fk.rounds):
            t = float(f[b"t"])
            round_times.append(t)
            seconds = json.loads(f.get(b"seconds", b"[]"))
            for i, (entry_id, learner, *_rest) in enumerate(json.loads(f[b"included"])):
                k = _key_of(r, keys, p, entry_id, id_key) or (learner, p, -1, -1)
                merged.add(k)
                contributed[learner].append(t)
                if i < len(seconds) and t >= t_start:  # inside the accounting window
                    useful_s += frag_weights[p] * float(seconds[i])
            for entry_id, reason in json.loads(f[b"dropped"]):
                if reason == "duplicate":
                    duplicated += 1
                    continue
                k = _key_of(r, keys, p, entry_id, id_key)
                if k is not None:
                    (dropped_stale if reason.startswith("stale") else dropped_other).add(k)
        for _, f in r.xrange(fk.dlq):
            k = _key_of(r, keys, p, _s(f.get(b"dlq_source_id", b"")), id_key)
            if k is None and b"learner" in f:
                try:
                    k = (_s(f[b"learner"]), int(f[b"fragment"]), int(f[b"base_version"]),
                         int(f[b"step"]))
                except ValueError:
                    k = None
            if k is not None:
                dead.add(k)
    for _, f in r.xrange(keys.events):
        if _s(f.get(b"kind", b"")) == "dropped":
            fr = int(f[b"fragment"])
            k = _key_of(r, keys, fr, _s(f[b"entry"]), id_key)
            if k is not None:
                if _s(f[b"reason"]) == "duplicate":
                    duplicated += 1
                else:
                    dropped_stale.add(k) if _s(f[b"reason"]).startswith("stale") else \
                        dropped_other.add(k)
    t_end = max([t_end, *round_times])  # the final flush merges work done before the stop
    accounted = merged | dropped_stale | dropped_other | dead
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
    return {
        "pushes_attempted": len(attempted | acked),
        "pushes_acked": len(acked),
        "merged": len(merged & acked) + len(merged - acked),
        "dropped_stale": len(dropped_stale - merged),
        "dropped_other": len(dropped_other - merged - dropped_stale),
        "dead_lettered": len(dead),
        "duplicated": duplicated + repushes,
        "repushed_after_redis_loss": repushes,
        "lost": len(lost),
        "lost_keys": [list(k) for k in lost[:20]],
        "rounds": len(round_times),
        "availability": min(1.0, len(busy) / windows),
        "goodput": useful_s / (learners * wall),
        "rejoins": len(rejoin),
        "rejoins_never": len(rejoin) - len(finite),
        "rejoin_s_p50": float(np.median(finite)) if finite else None,
        "rejoin_s_max": float(max(finite)) if finite else None,
        "wall_s": wall,
    }
