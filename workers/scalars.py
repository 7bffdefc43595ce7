"""A process's own curves for TensorBoard and Weights & Biases, written off its hot thread.

`ScalarLog.add` is what a training or merge loop calls: it puts one small tuple on a bounded
queue and returns (a full queue drops the row and counts it; the loop never waits). A daemon
thread takes the rows and hands them to the sinks:

* `TensorBoardSink`: event files written with TensorBoard's own numpy-only writer
  (`tensorboard.summary.Writer`, the ``[tensorboard]`` extra);
* `WandbSink`: a W&B run (the ``[wandb]`` extra; W&B's own settings apply: ``WANDB_MODE=offline``
  keeps it on disk, online needs the user's key, ``WANDB_PROJECT`` names the project, default
  ``diloco``), each family of tags (the tag up to its last ``/``) against its own axis.

A learner (`--tensorboard DIR`, `IslandConfig.tensorboard`) writes ``learner/…`` against its
step; a syncer writes ``fragment/<p>/…`` against each round's version. `diloco run
--tensorboard DIR` gives each process a folder of its own under DIR, so TensorBoard shows
them as runs side by side (`ops.cluster.tensorboard` writes the launcher's).
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("diloco.scalars")

TENSORBOARD_EXTRA = "TensorBoard event files need its extra: pip install " \
                    "'decoupled-diloco[tensorboard]'"
WANDB_EXTRA = "W&B logging needs its extra: pip install 'decoupled-diloco[wandb]'"

Row = tuple[str, float, int, float | None]  # (tag, value, step, wall time or None)


def event_writer(out: str | Path):
    """TensorBoard's writer of event files in `out` (made if missing).

    Raises:
        ValueError: The ``[tensorboard]`` extra is not installed (the message says so).
    """
    try:
        from tensorboard.summary import Writer
    except ImportError as e:
        raise ValueError(TENSORBOARD_EXTRA) from e
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        return Writer(str(out))
    except OSError as e:
        raise ValueError(f"TensorBoard event files cannot go in {out}: {e}") from e


class TensorBoardSink:
    """Rows into event files under `out`."""

    def __init__(self, out: str | Path):
        self._w = event_writer(out)

    def write(self, rows: list[Row]) -> None:
        for tag, x, step, t in rows:
            self._w.add_scalar(tag, x, step, wall_time=t)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbSink:
    """Rows into a W&B run (see module docstring). `axes` names each top-level family's x-axis
    (default ``step``); tags under ``summary/`` go to the run's summary."""

    def __init__(self, name: str, config: Mapping[str, Any], out: str | Path, *,
                 group: str | None = None, axes: Mapping[str, str] | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ValueError(WANDB_EXTRA) from e
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
            # a run of its own, also beside another sink of this process (W&B's default
            # would hand back the process's first run)
            self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "diloco"),
                                   name=name, group=group, config=dict(config), dir=str(out),
                                   reinit="create_new")
        except Exception as e:  # noqa: BLE001 - W&B raises its own kinds (no key, no network)
            raise ValueError(f"W&B run {name!r} cannot start: {type(e).__name__}: {e}") from e
        WandbSink._open += 1
        self._axes_of = dict(axes or {})
        self._axes: set[str] = set()

    def write(self, rows: list[Row]) -> None:
        by_point: dict[tuple[str, int], dict[str, float]] = {}  # one W&B row per axis and step
        for tag, x, step, _ in rows:
            if tag.startswith("summary/"):
                self._run.summary[tag] = x
                continue
            family = tag.rpartition("/")[0]
            axis = f"{family}/{self._axes_of.get(tag.split('/', 1)[0], 'step')}"
            by_point.setdefault((axis, step), {axis: step})[tag] = x
        for (axis, _), row in by_point.items():
            if axis not in self._axes:
                self._run.define_metric(axis)
                self._run.define_metric(f"{axis.rpartition('/')[0]}/*", step_metric=axis)
                self._axes.add(axis)
            self._run.log(row)

    _open = 0  # W&B runs of this process not finished yet

    def close(self) -> None:
        import wandb

        self._run.finish()
        WandbSink._open -= 1
        if not WandbSink._open:  # its service process ends with the last run, not at exit
            wandb.teardown()


class ScalarLog:
    """Rows from a hot thread to `sinks`, written by a daemon thread (see module docstring)."""

    def __init__(self, sinks: list, *, max_rows: int = 65_536):
        self.sinks = sinks
        self.dropped = 0  # rows dropped because the queue was full (a sink slower than the loop)
        self._q: queue.Queue = queue.Queue(maxsize=max_rows)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scalars", daemon=True)
        self._thread.start()

    def add(self, prefix: str, step: int, values: Mapping[str, Any],
            t: float | None = None) -> None:
        """``prefix/name`` = value at `step` for every finite number in `values` (anything
        else is skipped). Never blocks."""
        rows = [(f"{prefix}/{k}", float(v), int(step), t) for k, v in values.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
        if rows:
            try:
                self._q.put_nowait(rows)
            except queue.Full:
                self.dropped += len(rows)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (for at most `timeout_s`), then close the sinks. A sink still
        writing then (a stalled disk) is left to its thread, which is a daemon: its rows are
        given up, and nothing here waits for it."""
        self._stop.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass  # the thread sees the stop once the queue is drained
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("curves: a sink is still writing after %.0f s; %d queued rows given "
                        "up", timeout_s, self._q.qsize())
            return
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # noqa: BLE001 - a sink's failure must not fail the role
                log.warning("closing %s failed: %s", type(sink).__name__, e)

    def _run(self) -> None:
        while True:
            try:
                rows = self._q.get(timeout=0.5)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if rows is None:
                return
            while True:  # what else is queued goes in the same write (one flush)
                try:
                    more = self._q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._write(rows)
                    return
                rows += more
            self._write(rows)

    def _write(self, rows: list[Row]) -> None:
        for sink in self.sinks:
            try:
                sink.write(rows)
            except Exception as e:  # noqa: BLE001 - the curves must never stop the role
                log.warning("writing %d scalars to %s failed: %s", len(rows),
                            type(sink).__name__, e)


def open_log(out: str | None, *, wandb: bool = False, name: str = "", group: str | None = None,
             config: Mapping[str, Any] | None = None,
             axes: Mapping[str, str] | None = None) -> ScalarLog | None:
    """A log to event files in `out` (None: none) and, with `wandb`, a W&B run named `name`
    in `group` (its local files under `out`, else W&B's own ``WANDB_DIR``); None when neither.

    Raises:
        ValueError: An extra that is needed is not installed (the message names it).
    """
    sinks: list = []
    if out:
        sinks.append(TensorBoardSink(out))
    if wandb:
        try:
            sinks.append(WandbSink(name, config or {}, out or os.environ.get("WANDB_DIR", "."),
                                   group=group, axes=axes))
        except ValueError:
            for sink in sinks:
                sink.close()
            raise
    return ScalarLog(sinks) if sinks else None


def add_args(ap) -> None:
    """A role's `--tensorboard DIR` and `--wandb` (`diloco learner`, `diloco syncer`)."""
    ap.add_argument("--tensorboard", metavar="DIR", default=None,
                    help="write this process's curves as TensorBoard event files in DIR, off "
                         "its hot thread (the [tensorboard] extra)")
    ap.add_argument("--wandb", action="store_true",
                    help="log them to a W&B run as well, named by this process's id and "
                         "grouped by the run (the [wandb] extra; W&B's own WANDB_MODE, "
                         "WANDB_PROJECT and WANDB_DIR apply; its files go in --tensorboard's "
                         "DIR when given)")


def missing_extra(tensorboard: str | None, wandb: bool) -> str | None:
    """The message naming the extra the options need and that is not installed (None: fine)."""
    import importlib.util

    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        return TENSORBOARD_EXTRA
    if wandb and importlib.util.find_spec("wandb") is None:
        return WANDB_EXTRA
    return None
