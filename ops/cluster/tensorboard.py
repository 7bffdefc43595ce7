"""A run's metrics as TensorBoard event files (the ``[tensorboard]`` extra), written with
TensorBoard's own numpy-only writer (`tensorboard.summary.Writer`) from the records of
``metrics.jsonl``: the same records, so `diloco run --tensorboard DIR` (live, from the
launcher's loop, never a training thread) and `diloco tensorboard RUN_DIR` (afterwards, from
the file, for any run folder: distributed, in-process, chaos) give the same curves. `diloco run
--wandb` logs the same scalars to Weights & Biases (`WandbLog`, the ``[wandb]`` extra), each
family against its own axis (``eval/tokens``, ``learner/<id>/step``, ``fragment/<p>/version``).
The sinks are `workers.scalars`'s, which the learners and syncers write their own curves with.

Scalars (the step axis in brackets):

* ``eval/loss``, ``eval/accuracy`` [tokens of all learners];
* ``learner/<id>/loss``, ``…/tokens_per_s``, ``…/bytes_sent``, ``…/bytes_received``
  [that learner's step];
* ``fragment/<p>/merged``, ``…/merge_s``, ``…/grace_wait_s`` [the round's version];
* ``summary/<name>`` of the run's summary numbers [0].
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# the extras' messages, re-exported for the command line
from workers.scalars import (  # noqa: F401
    TENSORBOARD_EXTRA,
    WANDB_EXTRA,
    TensorBoardSink,
    WandbSink,
)

_MAX_LINE = 16 * 2**20  # a metrics line longer than this is skipped, not parsed


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _natural(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 else None


def scalars(kind: str, rec: Mapping[str, Any]) -> Iterator[tuple[str, float, int]]:
    """(tag, value, step) of one metrics record; anything not a finite number is skipped."""
    if kind == "eval":
        step = _natural(rec.get("tokens"))
        for name, tag in (("eval_loss", "eval/loss"), ("eval_accuracy", "eval/accuracy")):
            x = _number(rec.get(name))
            if step is not None and x is not None:
                yield tag, x, step
    elif kind == "progress" and isinstance(rec.get("learners"), dict):
        for learner, hb in rec["learners"].items():
            step = _natural(hb.get("step")) if isinstance(hb, dict) else None
            if step is None or not isinstance(learner, str):
                continue
            for name in ("loss", "tokens_per_s", "bytes_sent", "bytes_received"):
                x = _number(hb.get(name))
                if x is not None:
                    yield f"learner/{learner[:64]}/{name}", x, step
    elif kind == "round":
        p, version = _natural(rec.get("fragment")), _natural(rec.get("version"))
        if p is None or version is None:
            return
        included = rec.get("included")
        if isinstance(included, list):
            yield f"fragment/{p}/merged", float(len(included)), version
        for name in ("merge_s", "grace_wait_s", "quorum_wait_s"):
            x = _number(rec.get(name))
            if x is not None:
                yield f"fragment/{p}/{name}", x, version
    elif kind == "summary":
        for name, v in rec.items():
            x = _number(v)
            if x is not None and name != "t":
                yield f"summary/{name}", x, 0


class TensorBoardLog:
    """Scalars of metrics records into event files under `out`."""

    def __init__(self, out: str | Path):
        self._sink = TensorBoardSink(out)

    def write(self, kind: str, rec: Mapping[str, Any]) -> None:
        t = _number(rec.get("t"))
        self._sink.write([(tag, x, step, t) for tag, x, step in scalars(kind, rec)])

    def close(self) -> None:
        self._sink.close()


class WandbLog:
    """The scalars of metrics records logged to a W&B run (`workers.scalars.WandbSink`, its
    files in `out`), each family against its own axis."""

    def __init__(self, name: str, config: Mapping[str, Any], out: str | Path):
        self._sink = WandbSink(name, config, out, group=name, axes=_AXIS)

    def write(self, kind: str, rec: Mapping[str, Any]) -> None:
        self._sink.write([(tag, x, step, None) for tag, x, step in scalars(kind, rec)])

    def close(self) -> None:
        self._sink.close()


_AXIS = {"eval": "tokens", "learner": "step", "fragment": "version"}  # a family's x-axis


def convert(run_dir: str | Path, out: str | Path) -> int:
    """Event files under `out` from `run_dir`'s ``metrics.jsonl`` (read as untrusted: a line
    that is not a JSON object, or too long, is skipped); the number of records written."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist (is {run_dir} a run folder?)")
    tb, n = TensorBoardLog(out), 0
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                if len(raw) > _MAX_LINE:
                    continue
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("kind"), str):
                    tb.write(rec["kind"], rec)
                    n += 1
    finally:
        tb.close()
    return n
