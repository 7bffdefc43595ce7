"""The live progress view: snapshot arithmetic and states, line/tty/quiet rendering, Redis reads."""

from __future__ import annotations

import io
import re
import time

import pytest
import redis

from broker import registry
from broker.keys import RunKeys
from broker.records import FinalPushes, Heartbeat, LearnerFinal, SyncerInfo
from ops.cli.live import LiveView, format_line
from ops.tools import build_snapshot, snapshot

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def four_learners(t_s: float = 42.0) -> dict:
    """L0 training, L1 finished, L2 restarting, L3 gone; 1000 steps each."""
    records = {"L0": {"step": 380, "tokens_per_s": 12345.6, "loss": 3.5, "versions": [3, 4]},
               "L1": {"step": 990, "tokens_per_s": 9000.0, "versions": [5, 5]},
               "L2": {"step": 210}, "L3": {"step": 0}}
    finals = {"L1": {"steps": 1000, "versions": [6, 6]}}
    syncers = {"S0": {"rounds": 12, "quorum_wait_s": 0.0123, "grace_wait_s": 0.5,
                      "last_reason": "quorum"}}
    snap = build_snapshot(records, {"L0", "L1"}, finals, syncers, syncers_done={"S0"},
                          expected_learners=4, total_steps=1000,
                          restarting=frozenset({"L2"}), t_s=t_s)
    snap["eval_loss"] = 3.41
    return snap


def test_states_order_and_fields():
    snap = four_learners()
    assert [(ln["id"], ln["state"]) for ln in snap["learners"]] == [
        ("L0", "training"), ("L1", "finished"), ("L2", "restarting"), ("L3", "gone")]
    l1 = snap["learners"][1]
    assert (l1["step"], l1["versions"], l1["loss"]) == (1000, [6, 6], None)  # final report wins
    assert snap["syncers"] == [{"id": "S0", "rounds": 12, "quorum_wait_s": 0.0123,
                                "grace_wait_s": 0.5, "last_reason": "quorum", "done": True}]
    # natural order, and a learner known only from its final report is listed
    snap = build_snapshot({"L10": {}, "L2": {}}, set(), {"L9": {}}, {},
                          expected_learners=3, total_steps=10, t_s=1.0)
    assert [ln["id"] for ln in snap["learners"]] == ["L2", "L9", "L10"]


def test_progress_and_eta():
    snap = four_learners(t_s=42.0)
    progress = (0.38 + 1.0 + 0.21 + 0.0) / 4
    assert snap["progress"] == pytest.approx(progress)
    assert snap["eta_s"] == pytest.approx(42.0 * (1 - progress) / progress)
    # learners not seen yet count 0; steps past the end are clamped; no ETA below 2 %
    snap = build_snapshot({"L0": {"step": 5000}}, {"L0"}, {}, {}, expected_learners=4,
                          total_steps=1000, t_s=10.0)
    assert snap["progress"] == pytest.approx(0.25)
    snap = build_snapshot({"L0": {"step": 2}}, {"L0"}, {}, {}, expected_learners=1,
                          total_steps=100, t_s=10.0)
    assert snap["eta_s"] is None
    done = build_snapshot({}, set(), {"L0": {}}, {}, expected_learners=1,
                          total_steps=100, t_s=10.0)
    assert (done["progress"], done["eta_s"]) == (1.0, 0.0)


def test_line_format_and_length():
    line = format_line(four_learners())
    for part in ("[  42.0 s]", "40%", "eta 64 s", "L0 train 380", "L1 fin 1000",
                 "L2 restart 210", "L3 gone 0", "syncer rounds 12", "eval 3.41"):
        assert part in line
    assert len(line) < 120
    many = build_snapshot({f"L{i}": {"step": 100 + i} for i in range(16)}, {"L0"}, {}, {},
                          expected_learners=16, total_steps=1000, t_s=5.0)
    line = format_line(many)
    assert len(line) < 120 and "16 learners 1 train 15 gone step 100–115" in line
    line = format_line({"learners": [{"id": "L0"}], "syncers": [{}]})  # missing keys
    assert line.startswith("[– s] – eta –") and "L0 – –" in line


def test_line_mode_throttles_and_flushes_on_close():
    now = [0.0]
    out = io.StringIO()
    with LiveView(out, mode="line", line_interval_s=5.0, clock=lambda: now[0]) as view:
        for t in (0.0, 1.0, 4.9, 5.0, 6.0, 10.5):
            now[0] = t
            view.update(four_learners(t_s=t))
        assert [ln[:10] for ln in out.getvalue().splitlines()] == [
            "[   0.0 s]", "[   5.0 s]", "[  10.5 s]"]
        now[0] = 11.0
        view.update(four_learners(t_s=11.0))
        assert len(out.getvalue().splitlines()) == 3
    assert out.getvalue().splitlines()[-1].startswith("[  11.0 s]")  # close shows the last


def test_tty_mode_draws_table():
    out = io.StringIO()
    with LiveView(out, mode="tty", title="run t") as view:
        view.update({})  # nothing known yet must not raise
        view.update(four_learners())
    text = ANSI.sub("", out.getvalue())
    for part in ("run t", "40%", "L0", "L1", "L2", "L3", "training", "finished", "restarting",
                 "gone", "12,346", "S0 (done)", "quorum", "12", "500", "eval loss 3.4100"):
        assert part in text


def test_quiet_and_auto_modes():
    out = io.StringIO()
    with LiveView(out, mode="quiet") as view:
        view.update(four_learners())
    assert out.getvalue() == ""
    view = LiveView(out)  # StringIO is not a terminal
    assert view.mode == "line"
    with pytest.raises(ValueError):
        LiveView(out, mode="fancy")


def test_snapshot_reads_redis(redis_url):
    r = redis.Redis.from_url(redis_url)
    keys = RunKeys("live")
    registry.heartbeat(r, keys, "L0", Heartbeat(step=50, tokens_per_s=10.0), ttl_s=60)
    registry.heartbeat(r, keys, "L1", Heartbeat(step=90), ttl_s=60)
    registry.mark_learner_final(r, keys, "L1", LearnerFinal(steps=100, versions=[7]))
    registry.mark_final_pushes(r, keys, "L0", FinalPushes(steps=50))  # not finished yet
    for lid in ("L2", "L3"):
        registry.heartbeat(r, keys, lid, Heartbeat(step=20), ttl_s=0.05)
    registry.register_syncer(r, keys, "S0", SyncerInfo(rounds=3, quorum_wait_s=0.01,
                                                       last_reason="grace"))
    deadline = time.monotonic() + 5.0
    while registry.live_learners(r, keys) != {"L0", "L1"} and time.monotonic() < deadline:
        time.sleep(0.02)
    snap = snapshot(r, keys, expected_learners=4, total_steps=100,
                    restarting=frozenset({"L2"}), t_s=9.0)
    assert {ln["id"]: ln["state"] for ln in snap["learners"]} == {
        "L0": "training", "L1": "finished", "L2": "restarting", "L3": "gone"}
    assert snap["progress"] == pytest.approx((0.5 + 1.0 + 0.2 + 0.2) / 4)
    assert [(s["id"], s["rounds"], s["done"]) for s in snap["syncers"]] == [("S0", 3, False)]
    r.close()
