"""A run's metrics as TensorBoard event files (the ``[tensorboard]`` extra), written with
TensorBoard's own numpy-only writer (`tensorboard.summary.Writer`) from the records of
``metrics.jsonl``: the same records, so `diloco run --tensorboard DIR` (live, from the
launcher's loop, never a training thread) and `diloco tensorboard RUN_DIR` (afterwards, from
the file, for any run folder: distributed, in-process, chaos) give the same curves. `diloco run
--wandb` logs the same scalars to Weights & Biases (`WandbLog`, the ``[wandb]`` extra), each
family against its own axis (``eval/tokens``, ``learner/<id>/step``, ``fragment/<p>/version``).

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

TENSORBOARD_EXTRA = "TensorBoard event files need its extra: pip install " \
                    "'decoupled-diloco[tensorboard]'"
_MAX_LINE = 16 * 2**20  # a metrics line longer than this is skipped, not parsed


def _writer(out: Path):
    try:
        from tensorboard.summary import Writer
    except ImportError as e:
        raise ValueError(TENSORBOARD_EXTRA) from e
    out.mkdir(parents=True, exist_ok=True)
    return Writer(str(out))


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
        self._w = _writer(Path(out))

    def write(self, kind: str, rec: Mapping[str, Any]) -> None:
        t = _number(rec.get("t"))
        for tag, x, step in scalars(kind, rec):
            self._w.add_scalar(tag, x, step, wall_time=t)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


WANDB_EXTRA = "W&B logging needs its extra: pip install 'decoupled-diloco[wandb]'"
_AXIS = {"eval": "tokens", "learner": "step", "fragment": "version"}  # a family's x-axis


class WandbLog:
    """The scalars of metrics records logged to a W&B run (`wandb.init` in `out`; W&B's own
    settings apply: ``WANDB_MODE=offline`` keeps the run on disk, online needs the user's
    key, ``WANDB_PROJECT`` names the project, default ``diloco``)."""

    def __init__(self, name: str, config: Mapping[str, Any], out: str | Path):
        try:
            import wandb
        except ImportError as e:
            raise ValueError(WANDB_EXTRA) from e
        import os

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "diloco"), name=name,
                               config=dict(config), dir=str(out))
        self._axes: set[str] = set()

    def write(self, kind: str, rec: Mapping[str, Any]) -> None:
        rows: dict[str, dict[str, float]] = {}
        for tag, x, step in scalars(kind, rec):
            family, _, _ = tag.rpartition("/")
            if tag.startswith("summary/"):
                self._run.summary[tag] = x
                continue
            axis = f"{family}/{_AXIS.get(tag.split('/', 1)[0], 'step')}"
            rows.setdefault(axis, {axis: step})[tag] = x
        for axis, row in rows.items():
            if axis not in self._axes:
                self._run.define_metric(axis)
                self._run.define_metric(f"{axis.rpartition('/')[0]}/*", step_metric=axis)
                self._axes.add(axis)
            self._run.log(row)

    def close(self) -> None:
        import wandb

        self._run.finish()
        wandb.teardown()  # its service process ends with the run, not at interpreter exit


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
