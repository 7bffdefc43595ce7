"""The live progress view of `diloco run`, `chaos`, `bench` and `status --watch`.

`LiveView` draws progress snapshots (built by `ops.tools.status.snapshot` from the run registry
in Redis): one view redrawn in place on a terminal, a compact throttled line elsewhere, or
nothing. It never reads Redis.

A snapshot has the keys ``t_s``, ``total_steps``, ``expected_learners``, ``learners`` (list of
``{id, state, step, tokens_per_s, loss, versions}``), ``syncers`` (list of ``{id, rounds,
quorum_wait_s, grace_wait_s, last_reason, done}``), ``progress`` (0..1), ``eta_s`` (None or
seconds) and, when the caller sets it, ``eval_loss``.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ops.tools import STATES, natural_key, snapshot

_SHORT = {"training": "train", "finished": "fin", "restarting": "restart", "gone": "gone"}
_STYLE = {"training": "green", "finished": "cyan", "restarting": "yellow", "gone": "red"}
_DASH = "–"
_LINE_MAX = 120
MODES = ("auto", "tty", "line", "quiet")


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    x = _number(v)
    return _DASH if x is None else format(x * scale, spec)


def _duration(v: Any) -> str:
    s = _number(v)
    if s is None or not math.isfinite(s):
        return _DASH
    s = max(s, 0.0)
    if s < 120:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s // 60:.0f} m {s % 60:02.0f} s"
    return f"{s // 3600:.0f} h {s % 3600 // 60:02.0f} m"


def _versions(v: Any) -> str:
    if isinstance(v, Mapping):
        v = [v[k] for k in sorted(v, key=natural_key)]
    if not isinstance(v, list | tuple) or not v:
        return _DASH
    return " ".join(str(x) for x in v)


def _pct(snap: Mapping) -> str:
    p = _number(snap.get("progress"))
    return _DASH if p is None else f"{100 * p:.0f}%"


def _rows(snap: Mapping, key: str) -> list[Mapping]:
    rows = snap.get(key)
    return [r for r in rows if isinstance(r, Mapping)] if isinstance(rows, list) else []


def format_line(snap: Mapping, title: str = "") -> str:
    """One compact status line; learners collapse to counts when the line would pass 120 chars.

    Args:
        snap: a snapshot (missing keys render as "–").
        title: optional prefix.
    """
    head = (f"{title} " if title else "") + (
        f"[{_fmt(snap.get('t_s'), '6.1f')} s] {_pct(snap)} eta {_duration(snap.get('eta_s'))}")
    learners = _rows(snap, "learners")
    tail = []
    syncers = _rows(snap, "syncers")
    if syncers:
        rounds = [_number(s.get("rounds")) for s in syncers]
        total = _DASH if None in rounds else f"{sum(rounds):.0f}"
        tail.append(f"syncer{'s' if len(syncers) > 1 else ''} rounds {total}")
    if _number(snap.get("eval_loss")) is not None:
        tail.append(f"eval {_fmt(snap['eval_loss'], '.2f')}")
    each = [f"{ln.get('id', '?')} {_SHORT.get(ln.get('state'), ln.get('state', _DASH))} "
            f"{_fmt(ln.get('step'), '.0f')}" for ln in learners]
    line = " | ".join([head, *each, *tail])
    if len(line) <= _LINE_MAX or len(learners) <= 4:
        return line
    counts = {s: sum(ln.get("state") == s for ln in learners) for s in STATES}
    steps = [x for x in (_number(ln.get("step")) for ln in learners) if x is not None]
    summary = f"{len(learners)} learners " + " ".join(
        f"{n} {_SHORT[s]}" for s, n in counts.items() if n)
    if steps:
        summary += f" step {min(steps):.0f}–{max(steps):.0f}"
    return " | ".join([head, summary, *tail])


def render_rich(snap: Mapping, title: str = "") -> Group:
    """The terminal view of a snapshot: progress bar, learner table, syncer table, eval loss.

    Args:
        snap: a snapshot (missing keys render as "–").
        title: shown before the progress bar.
    """
    progress = _number(snap.get("progress"))
    header = Table.grid(padding=(0, 1))
    parts: list[Any] = [Text(title, style="bold")] if title else []
    parts += [ProgressBar(total=1.0, completed=min(max(progress or 0.0, 0.0), 1.0), width=40),
              Text(_pct(snap), style="bold"), Text(f"eta {_duration(snap.get('eta_s'))}"),
              Text(f"{_fmt(snap.get('t_s'), '.1f')} s elapsed", style="dim")]
    header.add_row(*parts)
    total = _fmt(snap.get("total_steps"), ".0f")
    learners = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in (("learner", "left"), ("state", "left"), (f"step /{total}", "right"),
                          ("tok/s", "right"), ("loss", "right"), ("versions", "left")):
        learners.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
    for ln in _rows(snap, "learners"):
        state = str(ln.get("state", _DASH))
        learners.add_row(Text(str(ln.get("id", "?"))), Text(state, style=_STYLE.get(state, "")),
                         Text(_fmt(ln.get("step"), ".0f")),
                         Text(_fmt(ln.get("tokens_per_s"), ",.0f")),
                         Text(_fmt(ln.get("loss"), ".3f")), Text(_versions(ln.get("versions"))))
    out: list[Any] = [header, learners]
    syncers = _rows(snap, "syncers")
    if syncers:
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for name, justify in (("syncer", "left"), ("rounds", "right"), ("quorum wait ms", "right"),
                              ("grace wait ms", "right"), ("last reason", "left")):
            table.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
        for s in syncers:
            sid = str(s.get("id", "?")) + (" (done)" if s.get("done") else "")
            table.add_row(Text(sid), Text(_fmt(s.get("rounds"), ".0f")),
                          Text(_fmt(s.get("quorum_wait_s"), ".0f", 1000.0)),
                          Text(_fmt(s.get("grace_wait_s"), ".0f", 1000.0)),
                          Text(str(s.get("last_reason") or _DASH)))
        out.append(table)
    if _number(snap.get("eval_loss")) is not None:
        out.append(Text(f"eval loss {_fmt(snap['eval_loss'], '.4f')}", style="bold"))
    return Group(*out)


def chaos_view(view: LiveView) -> Callable[[Any, float], None]:
    """A chaos run's progress callback that draws `view`: progress in time to the run's
    duration, learners the harness took down shown as restarting."""
    def update(chaos: Any, t_s: float) -> None:
        snap = snapshot(chaos.r, chaos.keys, expected_learners=chaos.cfg.learners,
                        total_steps=chaos.cfg.steps, restarting=chaos.restarting(), t_s=t_s)
        if chaos.duration_s > 0:
            snap["progress"] = min(1.0, t_s / chaos.duration_s)
            snap["eta_s"] = max(0.0, chaos.duration_s - t_s)
        if chaos.history:
            snap["eval_loss"] = chaos.history[-1]["eval_loss"]
        view.update(snap)
    return update


class LiveView:
    """Draws snapshots: in place on a terminal ("tty"), as throttled lines ("line"), or not.

    Args:
        stream: where to draw; nothing else is written anywhere.
        mode: "auto" (tty if ``stream.isatty()`` else line), "tty", "line" or "quiet".
        line_interval_s: least seconds between two lines in line mode.
        title: shown at the head of the view.
        clock: monotonic clock in seconds (tests inject one).
    """

    def __init__(self, stream: TextIO = sys.stderr, mode: str = "auto",
                 line_interval_s: float = 5.0, title: str = "",
                 clock: Callable[[], float] = time.monotonic):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: use one of {', '.join(MODES)}")
        is_tty = bool(getattr(stream, "isatty", lambda: False)())
        self.mode = ("tty" if is_tty else "line") if mode == "auto" else mode
        self.stream, self.title, self.clock = stream, title, clock
        self.line_interval_s = line_interval_s
        self._live: Live | None = None
        self._last_line_t: float | None = None
        self._pending: Mapping | None = None  # last snapshot not yet printed in line mode
        self._is_tty = is_tty
        self._closed = False

    def update(self, snap: Mapping) -> None:
        """Show a snapshot (line mode: only if `line_interval_s` passed since the last line).

        Args:
            snap: a snapshot from `snapshot`; missing keys render as "–".
        """
        if self._closed or self.mode == "quiet":
            return
        if self.mode == "line":
            now = self.clock()
            if self._last_line_t is None or now - self._last_line_t >= self.line_interval_s:
                self._last_line_t = now
                self._pending = None
                self._write_line(snap)
            else:
                self._pending = snap
            return
        if self._live is None:
            console = (Console(file=self.stream) if self._is_tty
                       else Console(file=self.stream, force_terminal=True, width=100))
            # redirecting sys.stdout/stderr only makes sense when a person watches a terminal
            self._live = Live(render_rich(snap, self.title), console=console,
                              auto_refresh=False, transient=False,
                              redirect_stdout=self._is_tty, redirect_stderr=self._is_tty)
            self._live.start(refresh=True)
        else:
            self._live.update(render_rich(snap, self.title), refresh=True)

    def close(self) -> None:
        """Leave the last view on screen; in line mode print the last throttled snapshot."""
        if self._closed:
            return
        self._closed = True
        if self._live is not None:
            self._live.stop()
        if self._pending is not None:
            self._write_line(self._pending)
            self._pending = None

    def _write_line(self, snap: Mapping) -> None:
        self.stream.write(format_line(snap, self.title) + "\n")
        self.stream.flush()

    def __enter__(self) -> LiveView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
