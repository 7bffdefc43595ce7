"""Learner islands over several devices in a real run: a 4-device island (forced host devices)
and a 1-device learner train one run, end with identical parameters, and the run replays —
with the final flush's rounds taking a plain outer step (`sync.final_step = "plain"`: replay
rebuilds them from the entries' `final` flags)."""

from __future__ import annotations

import sys

from helpers_broker import run_to_the_end
from test_user_task import ROOT, TINY, _spawn

from broker import registry
from ops.cluster import store_run_config
from ops.tools import replay
from pipeline import config as cfgmod
from workers.common import open_run


def test_islands_of_one_and_four_devices_complete_and_replay(redis_url, tmp_path,
                                                              monkeypatch):
    # 63 steps: three past the last scheduled push, so the final flush pushes every fragment
    cfg = cfgmod.from_dict({**TINY, "learners": 2, "steps": 63,
                            "sync": {**TINY["sync"], "final_step": "plain"}})
    assert store_run_config(redis_url, "islands", cfg)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    base = [sys.executable, "-m"]
    args = ["--redis-url", redis_url, "--run", "islands"]
    procs = {"syncer": _spawn(base + ["workers.syncer", *args], tmp_path / "syncer.log"),
             "L0": _spawn(base + ["workers.learner", *args, "--id", "L0"], tmp_path / "L0.log")}
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    procs["L1"] = _spawn(base + ["workers.learner", *args, "--id", "L1", "--devices", "4"],
                         tmp_path / "L1.log")
    run_to_the_end(procs, ("L0", "L1", "syncer"), tmp_path)
    ctx = open_run(redis_url, "islands", wait_s=0)
    reports = registry.learner_final_reports(ctx.r, ctx.keys)
    assert sorted(reports) == ["L0", "L1"]
    assert reports["L0"].hashes == reports["L1"].hashes and reports["L1"].steps == 63
    beats = registry.learner_records(ctx.r, ctx.keys)
    assert beats["L1"].devices == 4 and beats["L0"].devices == 1
    assert beats["L1"].max_tokens_per_step == 8 * 32
    assert replay.replay(redis_url, "islands")["status"] == "verified"
