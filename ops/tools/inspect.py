"""`diloco inspect`: the entries in flight in a run's fragment streams, and one payload's numbers.

Without ``--entry`` it lists, per fragment stream (and its dead-letter stream), every entry's
plain fields (learner, base version, steps, tokens, codec, size), its age (from the entry id's
millisecond timestamp against Redis ``TIME``), whether it is pending in the ``syncers`` consumer
group (XPENDING: consumer, delivery count, idle time) and what became of it (``state``: unread,
pending, merged into round v, dropped by round v with a reason, acknowledged, dead-lettered).

With ``--entry ID --fragment P`` it decodes one entry (``broker.entries.parse_entry``), dequantises
every tensor (``pipeline.quant.dequantize``) and prints per tensor its codec, shape, L2 norm,
min, max and whether every value is finite. Raw payload bytes are never printed.

The ``--json`` output (keys documented on :func:`collect` and :func:`entry_stats`) is stable.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import redis

from broker.entries import parse_entry, payload_size
from broker.errors import DecodeError
from broker.ids import as_text, id_key
from broker.keys import GROUP, FragmentKeys, RunKeys
from broker.records import RoundRecord
from pipeline.quant import dequantize
from workers.common import open_run

_PAGE = 64  # entries per XRANGE call: bounds the memory held by payloads in flight
_CLOCK_SKEW_S = 300.0  # tolerated difference between the Redis and the syncer clocks


# ----------------------------------------------------------------------------- run access


def id_ms(entry_id: str) -> int:
    """The millisecond timestamp part of a stream id (``"1712345678901-0"`` → 1712345678901)."""
    return int(entry_id.partition("-")[0])


def redis_time_s(r: redis.Redis) -> float:
    """Redis server time (unix seconds): ages are measured against it, not the local clock."""
    got = r.time()
    if isinstance(got, dict):  # a cluster client asked several nodes: any one will do
        got = next(iter(got.values()))
    sec, usec = got
    return float(sec) + float(usec) / 1e6


def _int(fields: dict, key: str) -> int | None:
    try:
        return int(fields[key.encode()])
    except (KeyError, ValueError, TypeError):
        return None


def _float(fields: dict, key: str) -> float | None:
    try:
        return float(fields[key.encode()])
    except (KeyError, ValueError, TypeError):
        return None


# ----------------------------------------------------------------------------- listing


def _group_info(r: redis.Redis, key: str) -> dict[str, Any]:
    """The ``syncers`` group of a stream: pending count and last delivered id (or Nones)."""
    try:
        for g in r.xinfo_groups(key):
            if as_text(g["name"]) == GROUP:
                return {"pending": int(g["pending"]),
                        "last_delivered_id": as_text(g["last-delivered-id"])}
    except redis.ResponseError:  # no stream yet
        pass
    return {"pending": 0, "last_delivered_id": None}


def _pending_rows(r: redis.Redis, key: str, count: int) -> dict[str, dict]:
    """XPENDING rows of the stream's group, by entry id."""
    if count <= 0:
        return {}
    try:
        rows = r.xpending_range(key, GROUP, min="-", max="+", count=count)
    except redis.ResponseError:
        return {}
    return {as_text(row["message_id"]): row for row in rows}


def _round_outcomes(r: redis.Redis, fk: FragmentKeys, oldest_id: str | None) -> dict:
    """entry id → (state, version, reason) from the round records that may list entries at or
    after ``oldest_id``.

    Round records (stream ids ``<version>-0``) are walked newest first. A round closes after
    every entry it lists arrived, so the walk stops at the first record whose close time ``t``
    is older than the oldest entry's id timestamp by more than ``_CLOCK_SKEW_S`` (the ids come
    from the Redis clock, ``t`` from the syncer's).
    """
    out: dict[str, tuple[str, int | None, str | None]] = {}
    if oldest_id is None:
        return out
    floor_s = id_ms(oldest_id) / 1000.0 - _CLOCK_SKEW_S
    end = "+"
    while True:
        batch = r.xrevrange(fk.rounds, max=end, min="-", count=200)
        if not batch:
            return out
        for _, fields in batch:
            try:
                rec = RoundRecord.from_fields(fields, lenient=True)
            except DecodeError:
                continue  # no version: it says nothing about any entry
            if rec.t is not None and rec.t < floor_s:
                return out
            for inc in rec.included:
                out.setdefault(inc.entry_id, ("merged", rec.version, None))
            for entry_id, reason in rec.dropped:
                out.setdefault(entry_id, ("dropped", rec.version, str(reason)))
        end = "(" + as_text(batch[-1][0])


def _read_stream(r: redis.Redis, key: str, limit: int) -> list[tuple[str, dict]]:
    """The stream's entries, oldest first; only the newest ``limit`` when ``limit`` > 0."""
    out: list[tuple[str, dict]] = []
    if limit > 0:
        end = "+"
        while len(out) < limit:
            batch = r.xrevrange(key, max=end, min="-", count=min(_PAGE, limit - len(out)))
            if not batch:
                break
            out += [(as_text(i), f) for i, f in batch]
            end = "(" + out[-1][0]
        return out[::-1]
    start = "-"
    while True:
        batch = r.xrange(key, min=start, max="+", count=_PAGE)
        if not batch:
            return out
        out += [(as_text(i), f) for i, f in batch]
        start = "(" + out[-1][0]


def _entry_record(p: int, entry_id: str, fields: dict, now_s: float) -> dict[str, Any]:
    """The documented per-entry record, before group and round information is added."""
    codec = as_text(fields.get(b"codec"))
    return {
        "id": entry_id, "fragment": p, "learner": as_text(fields.get(b"learner")),
        "base_version": _int(fields, "base_version"), "step": _int(fields, "step"),
        "steps": _int(fields, "steps"), "tokens": _int(fields, "tokens"), "codec": codec,
        "payload_bytes": payload_size(fields),
        "entry_bytes": sum(len(k) + len(v) for k, v in fields.items()),
        "seconds": _float(fields, "seconds"), "final": _int(fields, "final") == 1,
        "epoch": _int(fields, "epoch"), "chain": _int(fields, "chain"),
        "age_s": max(0.0, now_s - id_ms(entry_id) / 1000.0),
        "pending": False, "consumer": None, "deliveries": None, "idle_s": None,
        "state": "acked", "version": None, "dropped_reason": None,
        "dead_letter": False, "dlq_reason": None, "source_id": None,
    }


def fragment_report(r: redis.Redis, keys: RunKeys, p: int, now_s: float,
                    limit: int = 0) -> dict[str, Any]:
    """Everything `inspect` lists for fragment ``p`` (see :func:`collect`)."""
    fk = keys.fragment(p)
    group = _group_info(r, fk.frags)
    rows = _read_stream(r, fk.frags, limit)
    dlq_rows = _read_stream(r, fk.dlq, limit)
    oldest = rows[0][0] if rows else None
    outcomes = _round_outcomes(r, fk, oldest)
    pending = _pending_rows(r, fk.frags, group["pending"])
    last_delivered = group["last_delivered_id"]
    entries = []
    for entry_id, fields in rows:
        rec = _entry_record(p, entry_id, fields, now_s)
        if entry_id in pending:
            row = pending[entry_id]
            rec.update(pending=True, consumer=as_text(row["consumer"]), state="pending",
                       deliveries=int(row["times_delivered"]),
                       idle_s=int(row["time_since_delivered"]) / 1000.0)
        elif entry_id in outcomes:
            state, version, reason = outcomes[entry_id]
            rec.update(state=state, version=version, dropped_reason=reason)
        elif last_delivered is None or id_key(entry_id) > id_key(last_delivered):
            rec["state"] = "unread"
        entries.append(rec)
    for entry_id, fields in dlq_rows:
        rec = _entry_record(p, entry_id, fields, now_s)
        rec.update(state="dead_letter", dead_letter=True,
                   dlq_reason=as_text(fields.get(b"dlq_reason")),
                   source_id=as_text(fields.get(b"dlq_source_id")))
        entries.append(rec)
    last_round = r.xrevrange(fk.rounds, count=1)
    return {
        "fragment": p, "stream": fk.frags, "dlq_stream": fk.dlq,
        "length": int(r.xlen(fk.frags)), "dlq_length": int(r.xlen(fk.dlq)),
        "pending": group["pending"], "last_delivered_id": last_delivered,
        "version": _int(last_round[0][1], "version") if last_round else None,
        "shown": len(entries), "entries": entries,
    }


def collect(redis_url: str, run: str, fragment: int | None = None,
            limit: int = 0) -> dict[str, Any]:
    """The listing (the stable ``inspect --json`` output).

    Returns:
        ``{"run", "redis_time_s", "fragments": [...]}``; each fragment has ``fragment``,
        ``stream``, ``dlq_stream``, ``length`` and ``dlq_length`` (entries in Redis),
        ``pending`` (group PEL size), ``last_delivered_id``, ``version`` (latest round's,
        or None), ``shown`` and ``entries``. Each entry: ``id``, ``fragment``, ``learner``,
        ``base_version``, ``step``, ``steps``, ``tokens``, ``codec``, ``payload_bytes``,
        ``entry_bytes`` (all fields), ``seconds``, ``final``, ``epoch`` (its learner
        process's epoch; None: the entry has none), ``chain`` (the step of the first push
        of the chain it continues; None: the entry has none), ``age_s``, ``pending``,
        ``consumer``, ``deliveries`` and ``idle_s`` (from XPENDING; None unless pending),
        ``state`` (``unread`` | ``pending`` | ``merged`` | ``dropped`` | ``acked`` |
        ``dead_letter``), ``version`` (of the round that merged or dropped it),
        ``dropped_reason``, ``dead_letter``, ``dlq_reason`` and ``source_id`` (the original
        id of a dead-lettered entry). Stream entries come first, oldest first, then the
        dead-letter entries.

    Raises:
        BrokerError: The run has no configuration; ValueError: bad fragment index.
    """
    ctx = open_run(redis_url, run, wait_s=0, verify=False)
    r, keys, n_frags = ctx.r, ctx.keys, len(ctx.fragments)
    try:
        if fragment is not None and not 0 <= fragment < n_frags:
            raise ValueError(f"--fragment {fragment}: run {run!r} has fragments 0..{n_frags - 1}")
        now_s = redis_time_s(r)
        frags = [fragment] if fragment is not None else list(range(n_frags))
        return {"run": run, "redis_time_s": now_s,
                "fragments": [fragment_report(r, keys, p, now_s, limit) for p in frags]}
    finally:
        r.close()


# ----------------------------------------------------------------------------- one entry


def tensor_stats(name: str, q) -> dict[str, Any]:
    """Statistics of one dequantised tensor; min, max and norm cover its finite values only."""
    x = dequantize(q)
    flat = np.asarray(x, np.float32).reshape(-1)
    finite = np.isfinite(flat)
    n_bad = int(flat.size - int(finite.sum()))
    vals = flat[finite] if n_bad else flat
    v64 = vals.astype(np.float64)
    return {
        "name": name, "codec": q.codec, "block": int(q.block),
        "shape": [int(d) for d in q.shape], "numel": int(flat.size),
        "wire_bytes": int(q.data.nbytes) + (int(q.scales.nbytes) if q.scales is not None else 0),
        "l2_norm": float(np.sqrt(np.dot(v64, v64))),
        "min": float(vals.min()) if vals.size else None,
        "max": float(vals.max()) if vals.size else None,
        "mean_abs": float(np.abs(v64).mean()) if vals.size else None,
        "finite": n_bad == 0, "nonfinite": n_bad,
    }


def _find_entry(r: redis.Redis, fk: FragmentKeys, entry_id: str,
                dead_letter: bool) -> tuple[dict, bool] | None:
    """The fields of ``entry_id`` and whether they came from the dead-letter stream.

    Stream ids are per stream, so the same id can name a stream entry and a dead letter: the
    fragment stream is searched first unless ``dead_letter``; the dead-letter stream matches its
    own ids and the original ids of its entries.
    """
    if not dead_letter:
        rows = r.xrange(fk.frags, min=entry_id, max=entry_id, count=1)
        if rows:
            return rows[0][1], False
    rows = r.xrange(fk.dlq, min=entry_id, max=entry_id, count=1)
    if rows:
        return rows[0][1], True
    for _, fields in _read_stream(r, fk.dlq, 0):
        if as_text(fields.get(b"dlq_source_id")) == entry_id:
            return fields, True
    return None


def entry_stats(redis_url: str, run: str, fragment: int, entry_id: str,
                dead_letter: bool = False) -> dict[str, Any]:
    """One entry's payload statistics (the stable ``inspect --entry --json`` output).

    The entry is looked up in the fragment stream, then in its dead-letter stream (by id or
    original id); with ``dead_letter`` only in the dead-letter stream.

    Returns:
        ``{"run", "fragment", "id", "dead_letter", "dlq_reason", "learner", "base_version",
        "step", "steps", "tokens", "epoch", "chain", "codec", "payload_bytes",
        "decode_error", "tensors", "total"}`` (``epoch``, ``chain`` None: the entry has none;
        ``chain``: the step of the first push of the chain it continues): ``decode_error`` is None
        or the reason the payload did not decode (then ``tensors`` is empty); each tensor
        has ``name``, ``codec``, ``block``, ``shape``, ``numel``, ``wire_bytes``,
        ``l2_norm``, ``min``, ``max``, ``mean_abs`` (after dequantising, over finite values),
        ``finite`` and ``nonfinite`` (count); ``total`` has ``numel``, ``l2_norm`` (of all
        tensors together) and ``finite``.

    Raises:
        KeyError: No such entry in the fragment's stream or dead-letter stream.
    """
    ctx = open_run(redis_url, run, wait_s=0, verify=False)
    r, keys, n_frags = ctx.r, ctx.keys, len(ctx.fragments)
    try:
        if not 0 <= fragment < n_frags:
            raise ValueError(f"--fragment {fragment}: run {run!r} has fragments 0..{n_frags - 1}")
        found = _find_entry(r, keys.fragment(fragment), entry_id, dead_letter)
    finally:
        r.close()
    if found is None:
        raise KeyError(f"entry {entry_id} is in neither the stream nor the dead-letter stream "
                       f"of fragment {fragment}")
    fields, dead = found
    out: dict[str, Any] = {
        "run": run, "fragment": fragment, "id": entry_id, "dead_letter": dead,
        "dlq_reason": as_text(fields.get(b"dlq_reason")),
        "learner": as_text(fields.get(b"learner")),
        **{k: _int(fields, k) for k in ("base_version", "step", "steps", "tokens", "epoch",
                                        "chain")},
        "codec": as_text(fields.get(b"codec")),
        "payload_bytes": payload_size(fields),
        "decode_error": None, "tensors": [], "total": {"numel": 0, "l2_norm": 0.0,
                                                       "finite": True},
    }
    try:
        _, tensors = parse_entry(fields)
        out["tensors"] = [tensor_stats(n, q) for n, q in tensors.items()]
    except (DecodeError, ValueError) as e:
        out["decode_error"] = str(e)
        out["total"]["finite"] = False
        return out
    ts = out["tensors"]
    out["total"] = {"numel": sum(t["numel"] for t in ts),
                    "l2_norm": float(np.sqrt(sum(t["l2_norm"] ** 2 for t in ts))),
                    "finite": all(t["finite"] for t in ts)}
    return out


# ----------------------------------------------------------------------------- rendering


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _v(x: Any) -> str:
    return "-" if x is None else str(x)


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def render(rep: dict[str, Any]) -> str:
    """The listing as text, one table per fragment."""
    lines = [f"run {rep['run']}: {len(rep['fragments'])} fragment(s)"]
    head = (f"  {'ID':17s} {'LEARNER':8s} {'BASE':>4s} {'STEPS':>5s} {'TOKENS':>8s} "
            f"{'CODEC':5s} {'SIZE':>10s} {'AGE':>9s} {'DELIV':>5s}  STATE")
    for f in rep["fragments"]:
        lines.append(f"fragment {f['fragment']}: version {_v(f['version'])}, stream "
                     f"{f['length']} entries, {f['pending']} pending, dead letters "
                     f"{f['dlq_length']}" + ("" if f["shown"] >= f["length"] + f["dlq_length"]
                                             else f" (showing {f['shown']})"))
        if not f["entries"]:
            continue
        lines.append(head)
        for e in f["entries"]:
            state = e["state"]
            if state in ("merged", "dropped"):
                state += f" v{_v(e['version'])}"
            if e["dropped_reason"]:
                state += f": {e['dropped_reason']}"
            if e["dead_letter"]:
                state = f"DEAD LETTER ({e['dlq_reason']}) from {_v(e['source_id'])}"
            if e["pending"]:
                state += f" on {e['consumer']}, idle {e['idle_s']:.1f} s"
            lines.append(f"  {e['id']:17s} {_v(e['learner']):8s} {_v(e['base_version']):>4s} "
                         f"{_v(e['steps']):>5s} {_v(e['tokens']):>8s} {_v(e['codec']):5s} "
                         f"{_size(e['payload_bytes']):>10s} {e['age_s']:>7.1f} s "
                         f"{_v(e['deliveries']):>5s}  {state}{' final' if e['final'] else ''}")
    return "\n".join(lines)


def render_entry(rep: dict[str, Any]) -> str:
    """One entry's statistics as text."""
    tag = " DEAD LETTER (" + str(rep["dlq_reason"]) + ")" if rep["dead_letter"] else ""
    lines = [f"fragment {rep['fragment']} entry {rep['id']}{tag}: learner {_v(rep['learner'])}, "
             f"base v{_v(rep['base_version'])}, {_v(rep['steps'])} steps, "
             f"{_v(rep['tokens'])} tokens, {_v(rep['codec'])}, payload "
             f"{_size(rep['payload_bytes'])}"
             + (f", epoch {rep['epoch']}" if rep["epoch"] is not None else "")
             + (f", chain {rep['chain']}" if rep.get("chain") is not None else "")]
    if rep["decode_error"]:
        lines.append(f"  payload does not decode: {rep['decode_error']}")
        return "\n".join(lines)
    lines.append(f"  {'TENSOR':20s} {'CODEC':5s} {'SHAPE':>12s} {'L2 NORM':>11s} "
                 f"{'MIN':>11s} {'MAX':>11s}  FINITE")
    for t in rep["tensors"]:
        shape = "x".join(str(d) for d in t["shape"]) or "scalar"
        finite = "yes" if t["finite"] else f"NO ({t['nonfinite']} non-finite)"
        lines.append(f"  {t['name']:20s} {t['codec']:5s} {shape:>12s} {t['l2_norm']:11.4g} "
                     f"{_g(t['min']):>11s} {_g(t['max']):>11s}  {finite}")
    tot = rep["total"]
    lines.append(f"  total: {tot['numel']:,} values, L2 norm {tot['l2_norm']:.4g}, "
                 f"{'all finite' if tot['finite'] else 'NON-FINITE values present'}")
    return "\n".join(lines)
