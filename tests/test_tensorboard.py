"""TensorBoard event files of a run, read back with TensorBoard's own reader: live from
`diloco run --tensorboard DIR`, and afterwards from the run folder (`diloco tensorboard`); and
the same run's W&B run (`--wandb`, W&B's offline mode), read back from its run folder."""

from __future__ import annotations

import json
import struct

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


def _wandb_history(path) -> tuple[list[dict], dict]:
    """The logged rows and the summary of a W&B run file (``run-<id>.wandb``): W&B's records
    (its protobuf) in the LevelDB log layout W&B writes — a 7-byte file header, then 32 KiB
    blocks of chunks, each with a 7-byte header (CRC, length, type: full, first, middle,
    last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, rows, part, summary = path.read_bytes(), 32768, 7, [], b"", {}
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(part)
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in rec.history.item})
            elif kind == "summary":
                summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                for i in rec.summary.update})
    return rows, summary


def test_a_run_writes_its_curves_and_a_run_folder_converts_to_the_same(tmp_path, capsys,
                                                                       monkeypatch):
    cfg = write_config(tmp_path, learners=2, steps=30)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(["run", "--engine", "inprocess", "--config", cfg, "--run", "tb", "--out",
                 str(tmp_path / "runs"), "--json", "--tensorboard", str(tmp_path / "live"),
                 "--wandb"]) == 0
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
    # W&B: the same evaluation curve against tokens, and the run's summary numbers
    (wb,) = (tmp_path / "runs" / "tb" / "wandb").glob("offline-run-*/run-*.wandb")
    rows, summary = _wandb_history(wb)
    assert [(r["eval/tokens"], np.float32(r["eval/loss"])) for r in rows
            if "eval/loss" in r] == want
    assert np.float32(summary["summary/final_eval_loss"]) == want[-1][1]


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
