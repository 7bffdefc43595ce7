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

import bisect
import itertools
import json
import logging
import math
import os
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
SHOWN = 500  # points of one curve in a response (evenly thinned)
LEARNERS_MAX = 256  # learner ids tracked and shown (a learner credential can invent ids)
EVENTS = 500  # timeline entries kept
PAGE = 200  # stream entries read per poll and stream
TEXT_MAX = 200  # characters of one event field shown
LINE_MAX = 1 << 20  # a metrics.jsonl line longer than this is skipped
READ_MAX = 8 << 20  # bytes of metrics.jsonl read per poll
CLOCK_RANGE_S = 366 * 86_400  # a time further back than this (or ahead) is not believed

log = logging.getLogger(__name__)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _text(v: Any, limit: int = TEXT_MAX) -> str:
    s = as_text(v) if isinstance(v, bytes) else str(v)
    s = "".join(c if c.isprintable() else "?" for c in s[:limit + 1])
    return s if len(s) <= limit else s[:limit] + "…"


def _when(t: float | None, now: float) -> float | None:
    """`t` if it is a believable wall-clock time, else None."""
    return t if t is not None and now - CLOCK_RANGE_S <= t <= now + 60 else None


def _thin(points: deque | list, n: int = SHOWN) -> list:
    """At most `n` of `points`, evenly spaced, the last one kept."""
    points = list(points)
    if len(points) <= n:
        return points
    step = len(points) / n
    return [points[int(i * step)] for i in range(n - 1)] + [points[-1]]


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
        self.loss: dict[str, deque] = {}  # learner → (t, step, loss), in time order
        self.eval: deque = deque(maxlen=HISTORY)  # (t, tokens, loss)
        self.bytes: deque = deque(maxlen=HISTORY)  # (t, up, down)
        self.events: deque = deque(maxlen=EVENTS)
        self._events_from = "-"
        self._rounds_from = ["-"] * len(self.ctx.fragments)
        self._unreadable: set[str] = set()  # streams whose next read Redis refuses
        self._joins: dict[str, float] = {}  # learner → when its first join was written
        self._work: deque = deque(maxlen=1_000_000)  # (round time, weighted learner-seconds)
        self.goodput: float | None = None
        self._was_live: dict[str, bool] = {}
        self._acked: dict[str, tuple[int, float]] = {}  # learner → (pushes acked, when it grew)
        # learner → bytes (up, down) its earlier processes counted (a restart counts from 0)
        self._carried: dict[str, tuple[int, int]] = {}
        self._counted: dict[str, tuple[int, int]] = {}
        self._rounds: dict[str, tuple[int, float]] = {}  # syncer → (rounds, t) of last poll
        self._rate: dict[str, float] = {}
        self._file: tuple[int, int] | None = None  # metrics.jsonl's (device, inode)
        self._offset = 0
        self._skipping = False  # inside a line longer than any read: skipped to its end
        self.snapshot: dict = {}
        self.error: str | None = None
        self.polled_at: float | None = None

    # ------------------------------------------------------------------ reading
    def poll(self) -> None:
        """One read of everything; a failed read keeps the last state and says why."""
        now = time.time()
        try:
            snap = collect(self.redis_url, self.run, ctx=self.ctx)
        except (redis.RedisError, BrokerError, OSError) as e:
            with self._lock:
                self.error = f"{type(e).__name__}: {_text(e)}"
            return
        snap["learners"] = self._tracked(snap["learners"])
        events = self._read(self.ctx.keys.events, self._events_from)
        rounds = [self._read(self.ctx.keys.fragment(p).rounds, start)
                  for p, start in enumerate(self._rounds_from)]
        with self._lock:
            self.error = None
            self.polled_at = now
            self._read_run_dir(now)  # first: a run folder's history goes before live points
            self._take_events(events, now)
            self._take_rounds(rounds)
            self._take_learners(snap, now)
            self._take_syncers(snap, now)
            self._goodput(snap, now)
            self.snapshot = snap

    def _read(self, key: str, start: str) -> list:
        """The next page of a stream (nothing, once Redis refuses to read on: an entry of the
        largest id, which a learner credential may write, ends the range)."""
        if key in self._unreadable:
            return []
        try:
            return self.ctx.r.xrange(key, min=start, count=PAGE)
        except redis.ResponseError as e:
            self._unreadable.add(key)
            log.warning("dashboard: %s cannot be read on (%s)", key, e)
            return []
        except (redis.RedisError, OSError):
            return []

    @staticmethod
    def _tracked(learners: dict) -> dict:
        """The learner records shown: ids bounded, at most `LEARNERS_MAX` (verified first)."""
        rows = sorted(learners.items(), key=lambda kv: (kv[1].get("verified") is False,
                                                        not kv[1].get("live"), kv[0]))
        return {_text(k, 64): v for k, v in rows[:LEARNERS_MAX]}

    def _take_events(self, entries: list, now: float) -> None:
        for entry_id, fields in entries:
            eid = as_text(entry_id)
            self._events_from = "(" + eid
            f = {_text(k, 40): _text(v) for k, v in itertools.islice(fields.items(), 16)}
            f.pop("t", None)  # the writer's clock: the entry id's (Redis's) is used instead
            t = _when(_float(eid.partition("-")[0]) / 1000 if eid[:1].isdigit() else None,
                      now) or now
            kind = f.pop("kind", "?")
            if kind == "join" and "learner" in f:
                self._joins.setdefault(f["learner"], t)
            self.events.append({"t": t, "kind": kind, "detail": f})

    def _take_rounds(self, pages: list) -> None:
        for p, page in enumerate(pages):
            for entry_id, fields in page:
                self._rounds_from[p] = "(" + as_text(entry_id)
                try:
                    rec = RoundRecord.from_fields(fields, lenient=True)
                except DecodeError:
                    continue
                work = sum(s for s in rec.seconds if _num(s) is not None and s >= 0)
                if rec.t is not None and work:
                    self._work.append((rec.t, self.frag_share[p] * work))

    def _goodput(self, snap: dict, now: float) -> None:
        """The chaos ledger's goodput, read live: learner-seconds merged (weighted by fragment
        size) over learner-seconds allocated, from when every expected learner (among the
        verified ones) had joined to now, or to the last round once the run is done."""
        verified = {k for k, v in snap["learners"].items() if v.get("verified") is not False}
        joins = sorted(t for k, t in self._joins.items() if k in verified)
        learners = self.ctx.cfg.learners
        if len(joins) < learners:
            self.goodput = None
            return
        start = joins[learners - 1]
        end = max((t for t, _ in self._work), default=now) if snap.get("done") else now
        merged = sum(w for t, w in self._work if start <= t <= end)
        self.goodput = min(1.0, merged / (learners * max(end - start, 1e-9)))

    def _take_learners(self, snap: dict, now: float) -> None:
        up = down = 0
        for name, rec in snap["learners"].items():
            if rec.get("verified") is False:  # another key's heartbeat: no curve, no event
                continue
            live = bool(rec.get("live")) and not rec.get("finished")
            was = self._was_live.get(name)
            if was and not live and not rec.get("finished"):
                self.events.append({"t": now, "kind": "down", "detail": {
                    "learner": name, "why": "its heartbeat expired"}})
            elif was is False and live:
                self.events.append({"t": now, "kind": "back", "detail": {"learner": name}})
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
        curve = self.loss.get(name)
        if curve is None:
            if len(self.loss) >= LEARNERS_MAX:
                return
            curve = self.loss[name] = deque(maxlen=HISTORY)
        if not curve or point[0] > curve[-1][0]:
            if not curve or point[1] != curve[-1][1]:  # one point per step seen
                curve.append(point)
            return
        # older than the newest point (the run folder's history): in time order, once per step
        i = bisect.bisect([p[0] for p in curve], point[0])
        if all(p[1] != point[1] for p in curve) and len(curve) < HISTORY:
            curve.insert(i, point)

    def _take_syncers(self, snap: dict, now: float) -> None:
        for name, rec in list(snap["syncers"].items())[:LEARNERS_MAX]:
            rounds = int(_num(rec.get("rounds")) or 0)
            last = self._rounds.get(name)
            if last is not None and now > last[1]:
                self._rate[name] = max(0.0, (rounds - last[0]) / (now - last[1]))
            self._rounds[name] = (rounds, now)

    def _read_run_dir(self, now: float) -> None:
        path = self.run_dir / "metrics.jsonl" if self.run_dir else None
        if path is None:
            return
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                if self._file != (st.st_dev, st.st_ino) or st.st_size < self._offset:
                    self._file, self._offset, self._skipping = (st.st_dev, st.st_ino), 0, False
                fh.seek(self._offset)
                data = fh.read(READ_MAX)
        except OSError:  # not there (yet), or replaced meanwhile
            return
        end = data.rfind(b"\n")
        if end < 0:  # no line end yet: a line still being written, or one past all bounds
            if len(data) == READ_MAX:
                self._offset += READ_MAX
                self._skipping = True
            return
        self._offset += end + 1
        lines = data[:end].split(b"\n")
        if self._skipping:  # the rest of a line too long to read
            lines, self._skipping = lines[1:], False
        for line in lines:
            if not line.strip() or len(line) > LINE_MAX:
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict):
                self._take_record(rec, now)

    def _take_record(self, rec: dict, now: float) -> None:
        t = _when(_num(rec.get("t")), now)
        if t is None:
            return
        if rec.get("kind") == "eval":
            tokens, loss = _num(rec.get("tokens")), _num(rec.get("eval_loss"))
            if tokens is not None and loss is not None:
                self.eval.append((t, tokens, loss))
        elif rec.get("kind") == "progress" and isinstance(rec.get("learners"), dict):
            for name, hb in itertools.islice(rec["learners"].items(), LEARNERS_MAX):
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
                state = ("finished" if rec.get("finished") else
                         "unverified" if rec.get("verified") is False else
                         "live" if rec.get("live") else "down")
                lag = [x for x in rec.get("version_lag") or [] if _num(x) is not None]
                acked, since = self._acked.get(name, (0, None))
                learners.append({
                    "id": name, "state": state, "step": _num(rec.get("step")),
                    "tokens_per_s": _num(rec.get("tokens_per_s")),
                    "loss": _num(rec.get("loss")), "pushes_acked": acked,
                    "last_push_s": (now - since) if since and acked else None,
                    "staleness": max(lag) if lag else None,
                    "host": _text(rec.get("host") or "", 64),
                    "heartbeat_age_s": _num(rec.get("last_heartbeat_age_s"))})
            frags = snap.get("fragments") or []
            syncers = []
            for name, rec in list((snap.get("syncers") or {}).items())[:LEARNERS_MAX]:
                held = {p for p in rec.get("fragments") or [] if isinstance(p, int)}
                syncers.append({
                    "id": _text(name, 64), "fragments": sorted(held),
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
            up, down = (self.bytes[-1][1:] if self.bytes else (0, 0))
            return {
                "run": _text(self.run, 64), "now": now, "error": self.error,
                "run_dir": self.run_dir is not None,
                "mode": snap.get("mode"), "learners_expected": self.ctx.cfg.learners,
                "rounds": snap.get("rounds"), "done": bool(snap.get("done")),
                "learners": learners, "syncers": syncers, "fragments": fragments,
                "loss": {k: _thin(v) for k, v in self.loss.items()},
                "eval": _thin(self.eval), "bytes": _thin(self.bytes),
                "bytes_up": up, "bytes_down": down, "goodput": self.goodput,
                "events": list(self.events)[-200:],
            }


def _float(v: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None
