"""TensorBoard event files of a run, read back with TensorBoard's own reader: live from
`diloco run --tensorboard DIR`, and afterwards from the run folder (`diloco tensorboard`)."""

from __future__ import annotations

import json

import numpy as np
from test_e2e import write_config

from ops.cli import main


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    # tensorboard.summary.Writer writes scalars as rank-0 tensors of the scalars plugin
    return {t: [(e.step, float(make_ndarray(e.tensor_proto))) for e in acc.Tensors(t)]
            for t in acc.Tags()["tensors"]}


def test_a_run_writes_its_curves_and_a_run_folder_converts_to_the_same(tmp_path, capsys):
    cfg = write_config(tmp_path, learners=2, steps=30)
    assert main(["run", "--engine", "inprocess", "--config", cfg, "--run", "tb", "--out",
                 str(tmp_path / "runs"), "--json", "--tensorboard", str(tmp_path / "live")]) == 0
    capsys.readouterr()
    evals = [json.loads(line) for line in (tmp_path / "runs" / "tb" / "metrics.jsonl")
             .read_text().splitlines() if '"kind": "eval"' in line]
    want = [(e["tokens"], np.float32(e["eval_loss"])) for e in evals]
    live = _scalars(tmp_path / "live")
    assert [(s, np.float32(v)) for s, v in live["eval/loss"]] == want and len(want) >= 2
    assert any(t.startswith("summary/") for t in live)
    assert main(["tensorboard", str(tmp_path / "runs" / "tb"), "--out",
                 str(tmp_path / "after"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] >= len(evals)
    after = _scalars(tmp_path / "after")
    assert after["eval/loss"] == live["eval/loss"]


def test_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    assert main(["tensorboard", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl does not exist" in err[0]


def test_lines_that_are_not_records_are_skipped(tmp_path):
    from ops.cluster.tensorboard import convert

    (tmp_path / "metrics.jsonl").write_text(
        '{"kind": "eval", "tokens": 10, "eval_loss": 2.5}\nnot json\n[1, 2]\n'
        '{"kind": "eval", "tokens": "x", "eval_loss": 1.0}\n'
        '{"kind": "eval", "tokens": 20, "eval_loss": NaN}\n'
        '{"kind": "round", "fragment": 1, "version": 3, "included": [1, 2], "merge_s": 0.5}\n')
    assert convert(tmp_path, tmp_path / "tb") == 4
    got = _scalars(tmp_path / "tb")
    assert got["eval/loss"] == [(10, 2.5)]
    assert got["fragment/1/merged"] == [(3, 2.0)] and got["fragment/1/merge_s"] == [(3, 0.5)]
