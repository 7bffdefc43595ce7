"""The default-model quality table's run plan (ops/bench/quality_default.py): which runs it
wants next given the finished ones — the same learning-rate sweep rule for data parallel and
the candidate, extended until each one's best rate is bracketed."""
from __future__ import annotations

import fcntl
import math
from pathlib import Path

import pytest

from ops.bench.quality_default import (
    CAND,
    DDP,
    H100,
    SHIPPED,
    command,
    inner_again,
    losses,
    main,
    momentum_sweep,
    name,
    outer_sweep,
    plan,
    sweep,
    with_outer,
)


def _done(rows: dict[tuple[str, float, int], float]) -> dict[str, float]:
    return {name(r): loss for r, loss in rows.items()}


def test_an_empty_table_starts_with_the_sweep_interleaved():
    assert plan({}) == [(DDP, 1e-3, 0), (CAND, 1e-3, 0), (DDP, 4e-4, 0), (CAND, 4e-4, 0),
                        (DDP, 2e-3, 0), (CAND, 2e-3, 0)]


def test_a_best_rate_at_the_top_of_the_sweep_extends_it_before_any_seed():
    done = _done({(DDP, 1e-3, 0): 1.077, (DDP, 4e-4, 0): 1.331, (DDP, 2e-3, 0): 0.997,
                  (CAND, 1e-3, 0): 1.124, (CAND, 4e-4, 0): 1.297})
    assert sweep(done, DDP) == ([4e-3], None)
    assert plan(done) == [(DDP, 4e-3, 0), (CAND, 2e-3, 0)]
    # the extension is worse: 2e-3 is bracketed; data parallel's seeds wait for the
    # candidate's outer screen (which decides data parallel's extra rates)
    done[name((DDP, 4e-3, 0))] = 1.02
    assert sweep(done, DDP) == ([], 2e-3)
    assert plan(done) == [(CAND, 2e-3, 0)]


def test_the_sweep_extends_downwards_and_stops_at_the_grid_ends():
    done = _done({(CAND, 1e-3, 0): 1.2, (CAND, 4e-4, 0): 1.1, (CAND, 2e-3, 0): 1.3})
    assert sweep(done, CAND) == ([2e-4], None)
    done[name((CAND, 2e-4, 0))] = 1.0
    assert sweep(done, CAND) == ([], 2e-4)  # the grid's lowest rate
    up = _done({(DDP, lr, 0): 2.0 - lr * 10 for lr in (4e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)})
    assert sweep(up, DDP) == ([], 1.6e-2)


def test_a_diverged_run_counts_as_worst_and_malformed_rows_are_ignored():
    results = {name((DDP, 1e-3, 0)): {"final_eval_loss": 1.1},
               name((DDP, 4e-4, 0)): {"final_eval_loss": 1.3},
               name((DDP, 2e-3, 0)): {"final_eval_loss": float("nan")},
               "junk": [1, 2], "bool": {"final_eval_loss": True}, "none": {}}
    done = losses(results)
    assert set(done) == {name((DDP, lr, 0)) for lr in (1e-3, 4e-4, 2e-3)}
    assert math.isinf(done[name((DDP, 2e-3, 0))])
    assert sweep(done, DDP) == ([], 1e-3)


def _swept(cand_best: float = 1e-3) -> dict[str, float]:
    """Both inner sweeps done: data parallel's best 1e-3, the candidate's `cand_best`."""
    done = _done({(DDP, lr, 0): loss for lr, loss in ((4e-4, 1.3), (1e-3, 1.0), (2e-3, 1.2))})
    done.update(_done({(CAND, lr, 0): 1.0 if lr == cand_best else 1.25
                       for lr in (4e-4, 1e-3, 2e-3, 4e-3)}))
    return done


def test_the_outer_screen_runs_beside_as_many_extra_rates_for_data_parallel():
    done = _swept(cand_best=2e-3)
    want = plan(done)
    # the candidate at outer lr 0.4 and 1.0 (0.7 is its plain run), data parallel at the two
    # rates between its grid's nearest its best, interleaved; no seeds before they end
    assert want == [(DDP, 1.5e-3, 0), (with_outer(CAND, 0.4), 2e-3, 0), (DDP, 6e-4, 0),
                    (with_outer(CAND, 1.0), 2e-3, 0)]
    assert name(want[1]) == "frontier H=50 int4/int4Δ olr=0.4 lr=0.002 seed=0"
    # 1.0 is best, at the top of the screen: it extends to 1.4; data parallel gets no third
    # extra rate: its two are all that lie between its best's neighbours on the grid
    done.update({name((with_outer(CAND, 0.4), 2e-3, 0)): 1.1,
                 name((with_outer(CAND, 1.0), 2e-3, 0)): 0.9})
    assert outer_sweep(done, 2e-3) == ([1.4], None, 3)
    assert plan(done) == [(DDP, 1.5e-3, 0), (with_outer(CAND, 1.4), 2e-3, 0),
                          (DDP, 6e-4, 0)]
    # 1.4 is worse: 1.0 is bracketed; a finer rate beats data parallel's grid best
    done.update({name((with_outer(CAND, 1.4), 2e-3, 0)): 0.95,
                 name((DDP, 1.5e-3, 0)): 0.98, name((DDP, 6e-4, 0)): 1.1,
                 name((DDP, 3e-3, 0)): 1.05})
    assert outer_sweep(done, 2e-3) == ([], 1.0, 3)
    # then the outer momentum at the best outer lr: 0.5 and 0.7 beside the default 0.9
    cand = with_outer(CAND, 1.0)
    assert plan(done) == [(with_outer(CAND, 1.0, 0.5), 2e-3, 0),
                          (with_outer(CAND, 1.0, 0.7), 2e-3, 0)]
    assert name(plan(done)[0]) == "frontier H=50 int4/int4Δ om=0.5 olr=1 lr=0.002 seed=0"
    # both worse: the default 0.9 is the grid's top, so the screen ends there; the outer lr
    # moved, so the inner rate is swept again at it from 2e-3's neighbours
    done.update({name((with_outer(CAND, 1.0, 0.5), 2e-3, 0)): 0.97,
                 name((with_outer(CAND, 1.0, 0.7), 2e-3, 0)): 0.96})
    assert momentum_sweep(done, 2e-3, 1.0) == ([], 0.9, 2)
    assert plan(done) == [(cand, 4e-3, 0), (cand, 1e-3, 0)]
    done.update({name((cand, 4e-3, 0)): 0.93, name((cand, 1e-3, 0)): 0.95})
    assert inner_again(done, cand, 2e-3) == ([], 2e-3, 2)
    want = plan(done)
    assert want[:4] == [(DDP, 1.5e-3, 1), (cand, 2e-3, 1), (DDP, 1.5e-3, 2), (cand, 2e-3, 2)]
    # the shipped and H = 100 rows at the candidate's outer lr too
    assert want[4:] == [(f"{v} olr=1", 2e-3, s) for v in (SHIPPED, H100) for s in (0, 1, 2)]
    cmd = command(want[4], Path("out"))
    assert cmd[cmd.index("--only") + 1] == SHIPPED and cmd[cmd.index("--outer-lrs") + 1] == "1"
    # the shipped row measures the shipped apply rule; the others the quality tables' one
    assert cmd[cmd.index("--set") + 1] == 'sync.apply="rebase"'
    assert "--set" not in command(want[7], Path("out"))


def test_the_shipped_and_h100_rows_run_at_the_candidates_rates_after_its_seeds():
    done = _swept()
    done.update({name((with_outer(CAND, o), 1e-3, 0)): 1.1 for o in (0.4, 1.0)})
    done.update({name((DDP, lr, 0)): 1.1 for lr in (1.5e-3, 6e-4)})
    # the outer lr stays the default 0.7; momentum 0.5 is best, at the screen's low end:
    # it extends to 0.3, which is worse, so 0.5 is bracketed
    cand = with_outer(CAND, 0.7, 0.5)
    assert cand == "frontier H=50 int4/int4Δ om=0.5"
    assert plan(done) == [(cand, 1e-3, 0), (with_outer(CAND, 0.7, 0.7), 1e-3, 0)]
    done.update({name((cand, 1e-3, 0)): 0.9, name((with_outer(CAND, 0.7, 0.7), 1e-3, 0)): 0.93})
    assert plan(done) == [(with_outer(CAND, 0.7, 0.3), 1e-3, 0)]
    done.update({name((with_outer(CAND, 0.7, 0.3), 1e-3, 0)): 0.95})
    assert momentum_sweep(done, 1e-3, 0.7) == ([], 0.5, 3)
    # the inner rate again at momentum 0.5: 2e-3 is better, then 4e-3 worse
    assert plan(done) == [(cand, 2e-3, 0), (cand, 4e-4, 0)]
    done.update({name((cand, 2e-3, 0)): 0.85, name((cand, 4e-4, 0)): 1.0})
    assert plan(done) == [(cand, 4e-3, 0)]
    done[name((cand, 4e-3, 0))] = 0.88
    assert inner_again(done, cand, 1e-3) == ([], 2e-3, 3)
    want = plan(done)
    assert want[:4] == [(DDP, 1e-3, 1), (cand, 2e-3, 1), (DDP, 1e-3, 2), (cand, 2e-3, 2)]
    assert want[4:] == [(f"{v} om=0.5", 2e-3, s) for v in (SHIPPED, H100) for s in (0, 1, 2)]
    cmd = command(want[4], Path("out"))
    assert "--outer-lrs" not in cmd and cmd[cmd.index("--outer-momenta") + 1] == "0.5"
    assert cmd[cmd.index("--only") + 1] == SHIPPED
    done.update({name(r): 1.0 for r in want})
    assert plan(done) == []


def test_at_the_default_outer_settings_the_inner_sweep_is_not_repeated():
    done = _swept()
    done.update({name((with_outer(CAND, o), 1e-3, 0)): 1.1 for o in (0.4, 1.0)})
    done.update({name((with_outer(CAND, 0.7, m), 1e-3, 0)): 1.1 for m in (0.5, 0.7)})
    assert inner_again(done, CAND, 1e-3) == ([], 1e-3, 0)
    # four screens beyond the defaults, but only two rates lie between data parallel's best
    # (1e-3) and its grid neighbours: those two; the candidate's seeds meanwhile
    assert plan(done)[:4] == [*((DDP, r, 0) for r in (1.5e-3, 6e-4)),
                              (CAND, 1e-3, 1), (CAND, 1e-3, 2)]
    done.update({name((DDP, r, 0)): 1.2 for r in (1.5e-3, 6e-4)})
    assert plan(done)[:2] == [(DDP, 1e-3, 1), (CAND, 1e-3, 1)]


def test_a_second_planner_on_the_same_folder_is_refused(tmp_path, capsys):
    """Two planners on one folder would run every wanted run twice, each at half speed."""
    with open(tmp_path / "planner.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as e:
            main(["--out", str(tmp_path)])
        assert e.value.code == 2
        assert "another planner is running" in capsys.readouterr().err
        # the dry run only reads, so it goes on beside a running planner
        assert main(["--out", str(tmp_path), "--dry-run"]) == 0


def test_the_plans_default_momentum_is_the_quality_bases():
    """Runs named without " om=" run at the quality bases' outer momentum, pinned to what the
    kept runs were measured with (not the shipped default, which moved to 0.7)."""
    from ops.bench import quality
    from ops.bench.quality_default import MOMENTUM_DEFAULT
    assert MOMENTUM_DEFAULT == quality.QUALITY_MOMENTUM == 0.9
    assert quality.default_model_config().outer.momentum == MOMENTUM_DEFAULT
    assert quality.bench_model_config().outer.momentum == MOMENTUM_DEFAULT


def test_the_longer_plan_runs_the_seeds_then_brackets_both_rates_again():
    """At another run length (`--steps`): the three seeds of both at their 2,000-step rates,
    then each one's two neighbouring rates on seed 0 (extended until bracketed), then seeds 1
    and 2 of a best that moved; the candidate runs with the shipped plain final step."""
    from ops.bench.quality_default import plan_long
    cand = with_outer(CAND, 0.7, 0.7)
    assert plan_long({}) == [(DDP, 8e-3, 0), (cand, 4e-3, 0), (DDP, 8e-3, 1), (cand, 4e-3, 1),
                             (DDP, 8e-3, 2), (cand, 4e-3, 2), (DDP, 1.2e-2, 0),
                             (cand, 8e-3, 0), (DDP, 6e-3, 0), (cand, 2e-3, 0)]
    done = _done({(v, lr, s): 0.8 for v, lr in ((DDP, 8e-3), (cand, 4e-3)) for s in (0, 1, 2)})
    # data parallel is better at 6e-3, the lower end: 4e-3 next; the candidate's 4e-3 holds
    done.update(_done({(DDP, 1.2e-2, 0): 0.9, (DDP, 6e-3, 0): 0.79, (cand, 8e-3, 0): 0.85,
                       (cand, 2e-3, 0): 0.82}))
    assert plan_long(done) == [(DDP, 4e-3, 0)]
    done[name((DDP, 4e-3, 0))] = 0.795
    assert plan_long(done) == [(DDP, 6e-3, 1), (DDP, 6e-3, 2)]
    done.update(_done({(DDP, 6e-3, 1): 0.8, (DDP, 6e-3, 2): 0.8}))
    assert plan_long(done) == []
    cmd = command((cand, 4e-3, 1), Path("out"), 6000)
    assert cmd[cmd.index("--steps") + 1] == "6000"
    assert cmd[cmd.index("--set") + 1] == 'sync.final_step="plain"'
    assert cmd[cmd.index("--outer-momenta") + 1] == "0.7"
    ddp = command((DDP, 8e-3, 0), Path("out"), 6000)
    assert "--set" not in ddp and ddp[ddp.index("--steps") + 1] == "6000"
    assert "--steps" not in command((DDP, 8e-3, 0), Path("out"))  # the 2,000-step table's


def test_the_longer_plans_dry_run_names_its_own_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--steps", "6000", "--dry-run"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[:2] == ["ddp lr=0.008 seed=0", "frontier H=50 int4/int4Δ om=0.7 lr=0.004 seed=0"]
    assert (tmp_path / "runs/bench-quality-default-6000").is_dir()
