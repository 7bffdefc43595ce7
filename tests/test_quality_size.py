"""The quality-versus-size study's plan (ops/bench/quality_size.py): both sides swept by the
same rule at every size, seed 1 at each one's best, data parallel's default-model rows reused
and marked, and the summary's gaps over the seeds both ran."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.bench.quality_default import name
from ops.bench.quality_size import (
    DDP,
    SHIP,
    SIZES,
    command,
    main,
    plan,
    resume_from,
    reuse_ddp,
    summary,
)
from pipeline.model import ModelConfig, n_params


def test_each_size_has_the_parameters_it_is_named_for_and_spans_16x():
    for overrides, params in SIZES.values():
        m = ModelConfig(**{k.split(".")[1]: v for k, v in overrides.items()})
        assert n_params(m) == params
    counts = [p for _, p in SIZES.values()]
    assert counts == sorted(counts) and counts[-1] / counts[0] >= 16
    assert counts[-1] == n_params(ModelConfig())  # ending at the default model


def test_both_sides_are_swept_by_one_rule_then_seed_1_at_each_best():
    assert plan({}) == [(DDP, 1e-3, 0), (SHIP, 1e-3, 0), (DDP, 4e-4, 0), (SHIP, 4e-4, 0),
                        (DDP, 2e-3, 0), (SHIP, 2e-3, 0)]
    done = {name((DDP, lr, 0)): loss for lr, loss in ((1e-3, 1.2), (4e-4, 1.4), (2e-3, 1.1))}
    done |= {name((SHIP, lr, 0)): loss for lr, loss in ((1e-3, 1.2), (4e-4, 1.4), (2e-3, 1.3))}
    # data parallel's best is at the top: extended; ours is bracketed: its seed 1 may start
    assert plan(done) == [(DDP, 4e-3, 0), (SHIP, 1e-3, 1)]
    done[name((DDP, 4e-3, 0))] = 1.15
    assert plan(done) == [(DDP, 2e-3, 1), (SHIP, 1e-3, 1)]
    done[name((DDP, 2e-3, 1))], done[name((SHIP, 1e-3, 1))] = 1.12, 1.25
    assert plan(done) == []


def test_a_best_rate_at_the_top_of_the_shared_grid_extends_above_it():
    done = {name((DDP, lr, 0)): 2.0 - lr for lr in (4e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)}
    assert plan(done)[0] == (DDP, 3.2e-2, 0)
    done[name((DDP, 3.2e-2, 0))] = 2.0  # worse: 1.6e-2 is bracketed, its seed 1 may start
    assert (DDP, 1.6e-2, 1) in plan(done)


def test_the_command_runs_the_shipped_base_at_the_sizes_model():
    cmd = command("0.05M", (SHIP, 2e-3, 1), Path("/o"))
    i = cmd.index("--model")
    assert cmd[i + 1] == "shipped"
    assert "model.d_model=32" in cmd and "model.n_layers=3" in cmd
    assert cmd[cmd.index("--only") + 1] == SHIP
    assert (cmd[cmd.index("--lrs") + 1], cmd[cmd.index("--seeds") + 1]) == ("0.002", "1")
    assert not [x for x in command("0.84M", (DDP, 1e-3, 0), Path("/o")) if "model." in x]


def _row(loss: float, **extra) -> dict:
    return {"final_eval_loss": loss, "bandwidth_ratio_binding": 500.0, **extra}


def test_reused_rows_are_marked_and_the_summary_compares_seeds_both_ran(tmp_path):
    src = tmp_path / "src.json"
    src.write_text(json.dumps({name((DDP, lr, 0)): _row(loss) for lr, loss in
                               ((4e-4, 1.4), (1e-3, 1.2), (2e-3, 1.0), (4e-3, 1.1))}
                              | {name((DDP, 2e-3, 1)): _row(1.02),
                                 "frontier H=50 int4/int4Δ lr=0.001 seed=0": _row(9.9)}))
    out = tmp_path / "out"
    assert reuse_ddp(out, "0.84M", src) == 5
    assert reuse_ddp(out, "0.84M", src) == 0  # once
    big = json.loads((out / "0.84M" / "results.json").read_text())
    assert all(v["reused_from"] == str(src) for v in big.values()) and len(big) == 5
    big |= {name((SHIP, lr, 0)): _row(loss) for lr, loss in
            ((4e-4, 1.3), (1e-3, 1.1), (2e-3, 1.15))} | {name((SHIP, 1e-3, 1)): _row(1.12)}
    (out / "0.84M" / "results.json").write_text(json.dumps(big))
    # a size whose sweeps are not done has no row
    (out / "0.05M").mkdir()
    (out / "0.05M" / "results.json").write_text(json.dumps({name((DDP, 1e-3, 0)): _row(2.0)}))
    rows = summary(out)
    assert list(rows) == ["0.84M"]
    r = rows["0.84M"]
    assert (r["ddp_lr"], r["ship_lr"], r["seeds"]) == (2e-3, 1e-3, [0, 1])
    assert r["gap_mean"] == pytest.approx((1.1 + 1.12) / (1.0 + 1.02) - 1)
    assert r["gap_worst_seed"] == pytest.approx(max(1.1 / 1.0, 1.12 / 1.02) - 1)
    assert r["ddp_reused"] and r["binding_ratio"] == 500.0


def test_the_report_writes_the_table_and_the_plot(tmp_path, capsys):
    out = tmp_path / "out"
    for size in ("0.05M", "0.2M"):
        rows = {name((v, lr, 0)): _row(loss + (0.1 if v == SHIP else 0)) for v in (DDP, SHIP)
                for lr, loss in ((4e-4, 1.4), (1e-3, 1.2), (2e-3, 1.3))}
        rows |= {name((v, 1e-3, 1)): _row(1.25) for v in (DDP, SHIP)}
        (out / size).mkdir(parents=True)
        (out / size / "results.json").write_text(json.dumps(rows))
    assert main(["--out", str(out), "--report"]) == 0
    text = capsys.readouterr().out
    assert "| 0.05M (49,600) |" in text and "| 0.2M (222,336) |" in text
    assert (out / "gap_vs_size.png").stat().st_size > 1000
    assert set(json.loads((out / "summary.json").read_text())) == {"0.05M", "0.2M"}


def test_a_new_checkout_resumes_from_the_committed_raw_file(tmp_path):
    """`--resume-from`: the finished runs of the committed raw file are copied in where
    missing (a run already in OUT stays as it is); sizes the study does not know are left out,
    and then the plan wants only what is still missing."""
    raw = tmp_path / "raw.json"
    done = {name((SHIP, 1e-3, 0)): _row(1.11), name((SHIP, 4e-4, 0)): _row(1.35)}
    raw.write_text(json.dumps({"status": "…", "runs": {"0.84M": done, "9M": done}}))
    out = tmp_path / "out"
    (out / "0.84M").mkdir(parents=True)
    (out / "0.84M" / "results.json").write_text(json.dumps({name((SHIP, 1e-3, 0)): _row(1.0)}))
    assert resume_from(out, raw) == 1
    assert resume_from(out, raw) == 0  # once
    got = json.loads((out / "0.84M" / "results.json").read_text())
    assert got[name((SHIP, 1e-3, 0))]["final_eval_loss"] == 1.0  # OUT's own run kept
    assert got[name((SHIP, 4e-4, 0))]["final_eval_loss"] == 1.35
    assert not (out / "9M").exists()
    assert all(r[0] != SHIP or r[1] not in (1e-3, 4e-4) for r in plan(
        {k: v["final_eval_loss"] for k, v in got.items()}))

