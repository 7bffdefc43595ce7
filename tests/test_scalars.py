"""A process's own curves (`workers.scalars`): rows queued by the hot thread, written by a
thread of their own, read back with TensorBoard's own reader; a loop is never held up by
them — a full queue drops rows and counts them, a failing sink is logged and skipped."""

from __future__ import annotations

import threading

import pytest
from test_tensorboard import _scalars

from workers.scalars import ScalarLog, TensorBoardSink, WandbSink, open_log


def test_rows_reach_the_event_files_and_what_is_not_a_finite_number_is_skipped(tmp_path):
    log = open_log(str(tmp_path / "L0"))
    for step in range(1, 6):
        log.add("learner", step, {"loss": 3.0 - 0.25 * step, "tokens_per_s": 100 * step,
                                  "nan": float("nan"), "flag": True, "text": "x"}, t=1e9 + step)
    log.close()
    got = _scalars(tmp_path / "L0")
    assert sorted(got) == ["learner/loss", "learner/tokens_per_s"]
    assert got["learner/loss"] == [(s, 3.0 - 0.25 * s) for s in range(1, 6)]
    assert got["learner/tokens_per_s"][-1] == (5, 500.0)
    assert open_log(None) is None  # neither event files nor W&B: no thread at all


class _Slow:
    """A sink that holds its first write until released (a disk that stalls)."""

    def __init__(self):
        self.release, self.rows = threading.Event(), []

    def write(self, rows):
        self.release.wait(10)
        self.rows += rows

    def close(self):
        pass


class _Broken:
    def write(self, rows):
        raise OSError("disk full")

    def close(self):
        raise OSError("disk full")


def test_a_stalled_sink_never_blocks_the_loop_and_a_broken_one_is_skipped(tmp_path, caplog):
    slow = _Slow()
    log = ScalarLog([_Broken(), slow, TensorBoardSink(tmp_path / "tb")], max_rows=4)
    for step in range(100):  # the writer holds its first batch: the queue fills, rows drop
        log.add("fragment/0", step, {"merged": 2})
    assert log.dropped > 0
    slow.release.set()
    log.close()
    kept = [step for _, _, step, _ in slow.rows]
    assert len(kept) == 100 - log.dropped and kept == sorted(kept) and kept[0] == 0
    assert _scalars(tmp_path / "tb")["fragment/0/merged"][0] == (0, 2.0)
    assert "disk full" in caplog.text


def test_a_missing_extra_is_one_line_naming_it(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tensorboard(name, *a, **k):
        if name.startswith("tensorboard"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ValueError, match=r"pip install 'decoupled-diloco\[tensorboard\]'"):
        open_log("anywhere")


def test_a_processs_wandb_run_holds_its_curves_against_their_own_axes(tmp_path, monkeypatch):
    """`--wandb` of a learner or a syncer: its own W&B run in the run's group (offline mode,
    read back from the run's file)."""
    from test_tensorboard import _wandb_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "syncer-0"
    log = ScalarLog([TensorBoardSink(out), WandbSink("syncer-0", {"learners": 2}, out,
                                                     group="demo", axes={"fragment": "version"})])
    for v in (1, 2, 3):
        log.add("fragment/1", v, {"merged": v % 2 + 1, "merge_s": 0.01 * v})
    log.close()
    (wb,) = (tmp_path / "syncer-0" / "wandb").glob("offline-run-*/run-*.wandb")
    rows, _ = _wandb_history(wb)
    assert [(r["fragment/1/version"], r["fragment/1/merged"]) for r in rows] == [
        (1, 2), (2, 1), (3, 2)]
    assert _scalars(tmp_path / "syncer-0")["fragment/1/merged"][-1] == (3, 2.0)


def test_a_folder_that_cannot_be_had_is_refused_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="TensorBoard event files cannot go in"):
        open_log(str(tmp_path / "file" / "tb"))
