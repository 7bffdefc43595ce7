"""What `diloco dashboard` shows: a run read from Redis (and its run folder, when given) into
one JSON document, with the history a single read cannot give.

`Board.poll` reads, with reader credentials only, what `diloco status` reads (learners,
syncers, fragments), the run's events stream and its fragments' round records since the last
poll, and the new lines of ``RUN_DIR/metrics.jsonl`` (the launcher's evaluation records and
heartbeat copies). It keeps, in bounded buffers:

* each learner's training loss by time (from its heartbeats, and the run folder's copies of
  them, so a finished run shows its curves), the global evaluation loss (run folder only: the
  launcher evaluates; a run of separate hosts has no evaluator), bytes up and down;
* a timeline: the events stream (joins, rejoins, dead letters, guard refusals, hand-overs,
  the chaos harness's faults), and what no process writes down — a learner whose heartbeat
  expired ("down") and came back ("back");
* goodput: learner-seconds the round records say were merged (each weighted by its
  fragment's share of the parameters) over learner-seconds allocated since every expected
  learner had joined, the chaos ledger's definition read live.

Everything read from Redis or the file is untrusted: texts are bounded, numbers checked
finite, and the page renders every value as text (never as markup).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import redis

from broker.errors import BrokerError, DecodeError
from broker.ids import as_text
from broker.records import RoundRecord
from ops.tools.status import collect
from workers.common import open_run

HISTORY = 2_000  # points kept per curve
EVENTS = 500  # timeline entries kept
PAGE = 500  # stream entries read per poll and stream
TEXT_MAX = 200  # characters of one event field shown
LINE_MAX = 1 << 20  # a metrics.jsonl line longer than this is skipped
READ_MAX = 8 << 20  # bytes of metrics.jsonl read per poll
CLOCK_RANGE_S = 366 * 86_400  # an event stamped further back than this is shown at its reading


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _text(v: Any, limit: int = TEXT_MAX) -> str:
    s = as_text(v) if isinstance(v, bytes) else str(v)
    s = "".join(c if c.isprintable() else "?" for c in s[:limit + 1])
    return s if len(s) <= limit else s[:limit] + "…"


class Board:
    """The dashboard's model of one run; `poll` refreshes it, `state` is the page's JSON.

    Args:
        redis_url: the run's Redis (a reader's URL is enough).
        run: run name.
        run_dir: the run folder of a `diloco run`/`chaos` (its metrics.jsonl), if any.
    """

    def __init__(self, redis_url: str, run: str, run_dir: str | Path | None = None):
        self.redis_url, self.run = redis_url, run
        self.ctx = open_run(redis_url, run, wait_s=0, verify=False)
        self.run_dir = Path(run_dir) if run_dir else None
        sizes = [sum(math.prod(self.ctx.shapes[n]) for n in names)
                 for names in self.ctx.fragments]
        self.frag_share = [s / max(sum(sizes), 1) for s in sizes]
        self._lock = threading.Lock()
        self.loss: dict[str, deque] = {}  # learner → (t, step, loss)
        self.eval: deque = deque(maxlen=HISTORY)  # (t, tokens, loss)
        self.bytes: deque = deque(maxlen=HISTORY)  # (t, up, down)
        self.events: deque = deque(maxlen=EVENTS)
        self._events_from = "-"
        self._rounds_from = ["-"] * len(self.ctx.fragments)
        self._joins: dict[str, float] = {}
        self._merged_s = 0.0  # fragment-weighted learner-seconds merged after all joined
        self._was_live: dict[str, bool] = {}
        self._acked: dict[str, tuple[int, float]] = {}  # learner → (pushes acked, when it grew)
        # learner → bytes (up, down) its earlier processes counted (a restart counts from 0)
        self._carried: dict[str, tuple[int, int]] = {}
        self._counted: dict[str, tuple[int, int]] = {}
        self._rounds: dict[str, tuple[int, float]] = {}  # syncer → (rounds, t) of last poll
        self._rate: dict[str, float] = {}
        self._offset = 0
        self.snapshot: dict = {}
        self.error: str | None = None
        self.polled_at: float | None = None

    # ------------------------------------------------------------------ reading
    def poll(self) -> None:
        """One read of everything; a failed read keeps the last state and says why."""
        now = time.time()
        try:
            snap = collect(self.redis_url, self.run, ctx=self.ctx)
            events = self.ctx.r.xrange(self.ctx.keys.events, min=self._events_from, count=PAGE)
            rounds = [self.ctx.r.xrange(self.ctx.keys.fragment(p).rounds, min=start, count=PAGE)
                      for p, start in enumerate(self._rounds_from)]
        except (redis.RedisError, BrokerError, OSError) as e:
            with self._lock:
                self.error = f"{type(e).__name__}: {_text(e)}"
            return
        with self._lock:
            self.error = None
            self.polled_at = now
            self._take_events(events)
            self._take_rounds(rounds)
            self._take_learners(snap, now)
            self._take_syncers(snap, now)
            self._read_run_dir()
            self.snapshot = snap

    def _take_events(self, entries: list) -> None:
        for entry_id, fields in entries:
            self._events_from = "(" + as_text(entry_id)
            f = {_text(k, 40): _text(v) for k, v in list(fields.items())[:16]}
            now, t = time.time(), _num(_float(f.pop("t", None)))
            if t is None or not now - CLOCK_RANGE_S <= t <= now + 60:  # a bogus stamp
                t = now
            kind = f.pop("kind", "?")
            if kind == "join" and "learner" in f:
                self._joins.setdefault(f["learner"], t)
            self.events.append({"t": t, "kind": kind, "detail": f})

    def _take_rounds(self, pages: list) -> None:
        all_joined = len(self._joins) >= self.ctx.cfg.learners
        start = max(self._joins.values()) if all_joined else None
        for p, page in enumerate(pages):
            for entry_id, fields in page:
                self._rounds_from[p] = "(" + as_text(entry_id)
                try:
                    rec = RoundRecord.from_fields(fields, lenient=True)
                except DecodeError:
                    continue
                if start is not None and (rec.t or 0.0) >= start:
                    self._merged_s += self.frag_share[p] * sum(
                        s for s in rec.seconds if _num(s) is not None and s >= 0)

    def _take_learners(self, snap: dict, now: float) -> None:
        up = down = 0
        for name, rec in snap["learners"].items():
            live = bool(rec.get("live")) and not rec.get("finished")
            was = self._was_live.get(name)
            if was and not live and not rec.get("finished"):
                self.events.append({"t": now, "kind": "down", "detail": {
                    "learner": _text(name), "why": "its heartbeat expired"}})
            elif was is False and live:
                self.events.append({"t": now, "kind": "back", "detail": {
                    "learner": _text(name)}})
            self._was_live[name] = live
            loss, step = _num(rec.get("loss")), _num(rec.get("step"))
            if loss is not None and step is not None and live:
                self._point(name, (now, step, loss))
            acked = int(_num(rec.get("pushes_acked")) or 0)
            if acked != self._acked.get(name, (None, 0.0))[0]:
                self._acked[name] = (acked, now)
            sent = int(_num(rec.get("bytes_sent")) or 0)
            received = int(_num(rec.get("bytes_received")) or 0)
            last, carried = self._counted.get(name, (0, 0)), self._carried.get(name, (0, 0))
            if sent < last[0] or received < last[1]:  # a new process: its counters restart
                carried = self._carried[name] = (carried[0] + last[0], carried[1] + last[1])
            self._counted[name] = (sent, received)
            up += carried[0] + sent
            down += carried[1] + received
        self.bytes.append((now, up, down))

    def _point(self, name: str, point: tuple[float, float, float]) -> None:
        curve = self.loss.setdefault(name, deque(maxlen=HISTORY))
        if not curve or (point[1] != curve[-1][1] and point[0] > curve[-1][0]):  # one per step
            curve.append(point)

    def _take_syncers(self, snap: dict, now: float) -> None:
        for name, rec in snap["syncers"].items():
            rounds = int(_num(rec.get("rounds")) or 0)
            last = self._rounds.get(name)
            if last is not None and now > last[1]:
                self._rate[name] = max(0.0, (rounds - last[0]) / (now - last[1]))
            self._rounds[name] = (rounds, now)

    def _read_run_dir(self) -> None:
        path = self.run_dir / "metrics.jsonl" if self.run_dir else None
        if path is None or not path.is_file():
            return
        with open(path, "rb") as fh:
            fh.seek(self._offset)
            data = fh.read(READ_MAX)
        end = data.rfind(b"\n")
        if end < 0:  # no line end yet: a line still being written, or one past all bounds
            if len(data) == READ_MAX:
                self._offset += READ_MAX  # skipped; its tail fails to parse and is skipped too
            return
        self._offset += end + 1
        for line in data[:end].split(b"\n"):
            if not line.strip() or len(line) > LINE_MAX:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                self._take_record(rec)

    def _take_record(self, rec: dict) -> None:
        t = _num(rec.get("t"))
        if t is None:
            return
        if rec.get("kind") == "eval":
            tokens, loss = _num(rec.get("tokens")), _num(rec.get("eval_loss"))
            if tokens is not None and loss is not None:
                self.eval.append((t, tokens, loss))
        elif rec.get("kind") == "progress" and isinstance(rec.get("learners"), dict):
            for name, hb in list(rec["learners"].items())[:1000]:
                if isinstance(hb, dict) and isinstance(name, str):
                    step, loss = _num(hb.get("step")), _num(hb.get("loss"))
                    if step is not None and loss is not None:
                        self._point(_text(name, 64), (t, step, loss))

    # ------------------------------------------------------------------ the page's JSON
    def state(self) -> dict:
        """Everything the page draws, as JSON-able data."""
        with self._lock:
            snap, now = self.snapshot, self.polled_at or time.time()
            learners = []
            for name, rec in (snap.get("learners") or {}).items():
                state = ("finished" if rec.get("finished") else "live" if rec.get("live")
                         else "unverified" if rec.get("verified") is False else "down")
                lag = [x for x in rec.get("version_lag") or [] if _num(x) is not None]
                acked, since = self._acked.get(name, (0, None))
                learners.append({
                    "id": _text(name, 64), "state": state, "step": _num(rec.get("step")),
                    "tokens_per_s": _num(rec.get("tokens_per_s")),
                    "loss": _num(rec.get("loss")), "pushes_acked": acked,
                    "last_push_s": (now - since) if since and acked else None,
                    "staleness": max(lag) if lag else None,
                    "host": _text(rec.get("host") or "", 64),
                    "heartbeat_age_s": _num(rec.get("last_heartbeat_age_s"))})
            frags = snap.get("fragments") or []
            syncers = []
            for name, rec in (snap.get("syncers") or {}).items():
                held = [p for p in rec.get("fragments") or [] if isinstance(p, int)]
                syncers.append({
                    "id": _text(name, 64), "fragments": held,
                    "rounds": _num(rec.get("rounds")), "rounds_per_s": self._rate.get(name),
                    "lag": sum(f.get("lag") or 0 for f in frags if f["fragment"] in held),
                    "leases": [f["fragment"] for f in frags if f.get("lease") == name],
                    "host": _text(rec.get("host") or "", 64),
                    "last_reason": _text(rec.get("last_reason") or "")})
            fragments = [{"fragment": f["fragment"], "version": f.get("version"),
                          "last_size": f.get("last_included"),
                          "last_reason": _text(f.get("last_reason") or ""),
                          "lag": f.get("lag"), "dead_letters": f.get("dlq_length"),
                          "lease": _text(f.get("lease") or "")} for f in frags]
            allocated = None
            if len(self._joins) >= self.ctx.cfg.learners and self._joins:
                allocated = self.ctx.cfg.learners * max(now - max(self._joins.values()), 1e-9)
            up, down = (self.bytes[-1][1:] if self.bytes else (0, 0))
            return {
                "run": _text(self.run, 64), "now": now, "error": self.error,
                "run_dir": self.run_dir is not None,
                "mode": snap.get("mode"), "learners_expected": self.ctx.cfg.learners,
                "rounds": snap.get("rounds"), "done": bool(snap.get("done")),
                "learners": learners, "syncers": syncers, "fragments": fragments,
                "loss": {k: list(v) for k, v in self.loss.items()},
                "eval": list(self.eval), "bytes": list(self.bytes),
                "bytes_up": up, "bytes_down": down,
                "goodput": (min(1.0, self._merged_s / allocated) if allocated else None),
                "events": list(self.events)[-200:],
            }


def _float(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None
