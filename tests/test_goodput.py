"""Tests of the goodput simulator (ops/sim/simulator.py) and `diloco goodput`
(ops/cli/goodput.py)."""

from __future__ import annotations

import json
import math

import pytest

from ops.sim.simulator import (
    PUBLISHED,
    TABLE_CHIPS,
    TABLE_SETUPS,
    YEAR_S,
    Assumptions,
    Setup,
    dp_goodput_closed_form,
    expected_max_normal,
    lost_work_s,
    make_setup,
    simulate_cell,
    simulate_run,
    simulate_table,
    straggler_efficiency,
)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from ops.cli import main

    code = main(argv)
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", ["dp", "elastic-dp", "M=1", "M=8"])
def test_no_failures_gives_full_goodput(name: str) -> None:
    a = Assumptions(mtbi_s=math.inf)
    cell = simulate_cell(make_setup(name, a), 1_200_000, a, seeds=2)
    assert cell.goodput == pytest.approx(1.0)
    assert cell.uptime == pytest.approx(1.0)
    assert cell.failures_per_hour == 0


def test_dp_closed_form_limits() -> None:
    a = Assumptions(checkpoint_s=1e-6)
    lam = 600_000 / a.mtbi_s
    assert dp_goodput_closed_form(600_000, a) == pytest.approx(1 / (1 + lam * a.restart_s))
    # Small checkpoint interval: (1 - lambda C / 2) / (1 + lambda R) to first order in lambda C,
    # which is 1 / (1 + lambda (R + C / 2)) to first order in lambda.
    a = Assumptions(checkpoint_s=2.0, restart_s=60.0)
    lam = 1_200_000 / YEAR_S
    g = dp_goodput_closed_form(1_200_000, a)
    assert g == pytest.approx((1 - lam * 1.0) / (1 + lam * 60.0), abs=1e-3)
    a = Assumptions(checkpoint_s=2.0, restart_s=60.0)
    lam = 10_000 / YEAR_S
    g = dp_goodput_closed_form(10_000, a)
    assert g == pytest.approx(1 / (1 + lam * 61.0), abs=1e-5)


@pytest.mark.parametrize(("chips", "checkpoint_s", "restart_s"),
                         [(150_000, 1.0, 74.0), (1_200_000, 1.0, 74.0), (600_000, 30.0, 40.0)])
def test_dp_matches_analytic_expectation(chips: int, checkpoint_s: float,
                                         restart_s: float) -> None:
    a = Assumptions(checkpoint_s=checkpoint_s, restart_s=restart_s)
    cell = simulate_cell(make_setup("dp", a), chips, a, seeds=6, target_failures=3000)
    expected = dp_goodput_closed_form(chips, a)
    assert abs(cell.goodput - expected) < max(3 * cell.goodput_ci, 0.01)
    lam = chips / a.mtbi_s
    assert cell.uptime == pytest.approx(1 / (1 + lam * restart_s), abs=0.015)


def test_lost_work_per_fragment() -> None:
    assert lost_work_s(25.0, 10.0) == pytest.approx(5.0)
    assert lost_work_s(7.0, 10.0) == pytest.approx(7.0)
    assert lost_work_s(123.0, 0.0) == 0.0
    # Two fragments pushed at 5 s and 10 s after a resume, then every 10 s.
    assert lost_work_s(4.0, 10.0, 2) == pytest.approx(4.0)
    assert lost_work_s(7.0, 10.0, 2) == pytest.approx((2.0 + 7.0) / 2)
    assert lost_work_s(27.0, 10.0, 2) == pytest.approx((2.0 + 7.0) / 2)


def test_straggler_efficiency() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=0.03)
    assert expected_max_normal(1e6) == pytest.approx(4.86, abs=0.05)
    assert straggler_efficiency(1_000, 0.0) == 1.0
    assert straggler_efficiency(100_000, 0.01) < straggler_efficiency(1_000, 0.01) < 1.0


def test_speed_variance_favours_smaller_synchronous_groups() -> None:
    a = Assumptions(mtbi_s=1e30, speed_cv=0.01)
    dp = simulate_cell(make_setup("dp", a), 1_200_000, a, seeds=1)
    m16 = simulate_cell(make_setup("M=16", a), 1_200_000, a, seeds=1)
    assert dp.goodput < m16.goodput < 1.0


def test_determinism_for_a_seed() -> None:
    a = Assumptions()
    s = make_setup("M=4", a)
    r1 = simulate_run(s, 600_000, a, seed=7, horizon_s=20_000, warmup_s=2_000)
    r2 = simulate_run(s, 600_000, a, seed=7, horizon_s=20_000, warmup_s=2_000)
    r3 = simulate_run(s, 600_000, a, seed=8, horizon_s=20_000, warmup_s=2_000)
    assert r1 == r2
    assert r1 != r3
    c1 = simulate_cell(s, 600_000, a, seeds=3, seed=5, target_failures=300)
    c2 = simulate_cell(s, 600_000, a, seeds=3, seed=5, target_failures=300)
    assert c1 == c2


def test_monotone_in_chips_and_learners() -> None:
    setups = ("dp", "elastic-dp", "M=2", "M=4", "M=8", "M=16")
    cells = simulate_table(setups=setups, seeds=4, target_failures=800)
    g = {(c.setup, c.chips): c.goodput for c in cells}
    for s in setups:
        row = [g[(s, n)] for n in TABLE_CHIPS]
        assert all(x > y for x, y in zip(row, row[1:], strict=False)), (s, row)
    for n in TABLE_CHIPS:
        col = [g[(s, n)] for s in setups]
        assert all(x < y for x, y in zip(col, col[1:], strict=False)), (n, col)


def test_quorum_blocks_learners() -> None:
    a1, a4 = Assumptions(quorum=1), Assumptions(quorum=4)
    free = simulate_cell(make_setup("M=4", a1), 2_400_000, a1, seeds=3, target_failures=800)
    strict = simulate_cell(make_setup("M=4", a4), 2_400_000, a4, seeds=3, target_failures=800)
    assert strict.goodput < free.goodput
    assert strict.uptime < free.uptime
    assert free.uptime > 0.98


def test_restarting_learners_lose_their_round() -> None:
    a = Assumptions()
    cheap = Setup("r", 8, False, 20.0, 0.0, 0.0, 10.0)
    costly = Setup("r", 8, False, 20.0, 0.0, 0.0, 200.0)
    streamed = Setup("r", 8, False, 20.0, 0.0, 0.0, 200.0, 1, 4)
    g = [simulate_cell(s, 1_200_000, a, seeds=3, target_failures=800).goodput
         for s in (cheap, costly, streamed)]
    assert g[1] < g[2] < g[0]


def test_unknown_setup() -> None:
    with pytest.raises(ValueError):
        make_setup("pipeline", Assumptions())


def test_table_json_shape_and_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(["goodput", "--table", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    rows = doc["rows"]
    assert len(rows) == len(TABLE_SETUPS) * len(TABLE_CHIPS)
    assert {r["setup"] for r in rows} == {"dp", "elastic-dp", "M=2", "M=4", "M=8", "M=16"}
    assert {r["chips"] for r in rows} == set(TABLE_CHIPS)
    for r in rows:
        assert 0.0 <= r["goodput"] <= 1.0
        assert r["published"] == PUBLISHED[r["setup"]][TABLE_CHIPS.index(r["chips"])]
        # The documented assumptions put every cell within 5 points of the published one.
        assert abs(r["goodput"] - r["published"]) <= 0.05, r
    assert doc["max_abs_deviation"] <= 0.05


def test_table_text_and_plot(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "goodput.png"
    code, out = _cli(["goodput", "--table", "--seeds", "2", "--failures", "300",
                      "--plot", str(png)], capsys)
    assert code == 0
    assert "published" in out and "M=16" in out and "2.4M" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scenario_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(["goodput", "--chips", "300000", "--chips-per-learner", "75000",
                      "--seeds", "2", "--failures", "200", "--json"], capsys)
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [r["setup"] for r in rows] == ["dp", "elastic-dp", "M=4"]
    assert all(r["published"] == PUBLISHED[r["setup"]][1] for r in rows)


def test_projection(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["goodput", "--project", "--step-s", "2", "--round-s", "60", "--chips", "1200000",
            "--learners", "8", "--seeds", "3", "--failures", "400", "--json"]
    code, out = _cli([*base, "--rejoin-s", "10"], capsys)
    assert code == 0
    fast = {r["setup"]: r["goodput"] for r in json.loads(out)["rows"]}
    code, out = _cli([*base, "--rejoin-s", "120"], capsys)
    slow = {r["setup"]: r["goodput"] for r in json.loads(out)["rows"]}
    assert set(fast) == {"dp", "elastic-dp", "M=8", "impl M=8"}
    assert slow["impl M=8"] < fast["impl M=8"] < 1.0
    assert fast["dp"] == slow["dp"]
    code, out = _cli(["goodput", "--project", "--step-s", "2", "--rejoin-s", "30", "--round-s",
                      "60", "--chips", "150000", "--seeds", "2", "--failures", "100"], capsys)
    assert code == 0
    assert "impl M=8" in out and "30 inner steps per round" in out


def test_projection_needs_its_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    from ops.cli import main

    assert main(["goodput", "--project", "--step-s", "2", "--rejoin-s", "30"]) == 2
    assert "--round-s" in capsys.readouterr().err
