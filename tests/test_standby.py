"""Warm spares (`diloco learner --standby FILE`): a process that is ready to take over a learner
the moment it dies, so that a restart does not pay for Python, JAX, the data and compilation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers_broker import (
    REPO,
    end_processes,
    poll_until,
    run_to_the_end,
    store_run,
    syncer_cmd,
    tiny_config,
)

from broker import registry
from broker.connection import connect
from broker.keys import PREFIX
from workers.learner import standby_ready_file


def _keyspace(r, run: str) -> dict[bytes, bytes]:
    """Every key of `run` (its own and its fragments') with its serialised value."""
    return {k: r.dump(k) for k in r.scan_iter(match=f"{PREFIX}:{{{run}*", count=1000)}


def _events(r, keys) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(keys.events)]


@pytest.mark.slow
def test_a_warm_spare_takes_over_a_killed_learner_without_compiling_and_the_others_exit(
        tmp_path, redis_url):
    """Real processes: two warm spares for L1 start first; once they are warm and waiting,
    Redis holds exactly what it held before they started. A syncer, L0 and L1 then train; L1
    is killed mid-run; one spare's file appears, it takes over as L1, resumes from L1's state
    folder without compiling its training step again (JAX logs every compilation), and the run
    ends with both learners on the same values. The other spare's file existed before it
    started (a leftover): it removes it instead of taking over, and exits 0 by itself once L1
    has finished."""
    r = connect(redis_url)
    steps = 160
    cfg = tiny_config(learners=2, steps=steps, sync={"quorum": 1})
    keys = store_run(r, "spare", cfg)
    state = tmp_path / "state"
    base = [sys.executable, "-m", "workers.learner", "--redis-url", redis_url, "--run", "spare",
            "--state-dir", str(state), "--delay-s", "0.03"]
    go = tmp_path / "go-a"
    (tmp_path / "go-b").touch()  # left over from an earlier takeover
    spares = {"spare-a": [*base, "--id", "L1", "--standby", str(go)],
              "spare-b": [*base, "--id", "L1", "--standby", str(tmp_path / "go-b")]}
    cmds = {"syncer": syncer_cmd(redis_url, "spare"), "L0": [*base, "--id", "L0"],
            "L1": [*base, "--id", "L1"]}
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in [*spares, *cmds]}
    env = {**os.environ, "JAX_LOG_COMPILES": "1"}
    keys_before = _keyspace(r, "spare")
    assert keys.config.encode() in keys_before
    procs = {n: subprocess.Popen(c, cwd=REPO, stdout=logs[n], stderr=subprocess.STDOUT,
                                 env=env) for n, c in spares.items()}

    def log_of(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    try:
        ready = {s: standby_ready_file(tmp_path / f"go-{s[-1]}") for s in ("spare-a", "spare-b")}
        assert poll_until(lambda: all(f.exists() for f in ready.values())
                          or any(procs[s].poll() is not None for s in ready),
                          timeout_s=120), log_of("spare-a")[-2000:]
        assert procs["spare-a"].poll() is None, log_of("spare-a")[-3000:]
        assert all(ready[s].read_text() == f"{procs[s].pid}\n" for s in ready)
        assert "waiting for" in log_of("spare-b")
        assert "existed before this spare started" in log_of("spare-b")
        assert not (tmp_path / "go-b").exists()
        time.sleep(1.5)  # a check of the run's state or two
        assert _keyspace(r, "spare") == keys_before  # the spares wrote nothing
        procs.update({n: subprocess.Popen(c, cwd=REPO, stdout=logs[n],
                                          stderr=subprocess.STDOUT, env=env)
                      for n, c in cmds.items()})

        def l1_step() -> int:
            rec = registry.learner_records(r, keys).get("L1")
            return rec.step if rec else 0

        assert poll_until(lambda: l1_step() >= 40 or procs["L1"].poll() is not None, 120)
        assert procs["L1"].poll() is None, log_of("L1")[-3000:]
        procs["L1"].send_signal(signal.SIGKILL)
        procs["L1"].wait()
        assert l1_step() < steps  # (its last heartbeat: the kill was mid-run)
        go.touch()
        procs["L1"] = procs.pop("spare-a")
        run_to_the_end(procs, ("L0", "L1", "syncer", "spare-b"), tmp_path, timeout_s=240)
    finally:
        end_processes(procs, logs)

    took = log_of("spare-a")
    assert not go.exists()  # the spare takes its file away
    assert not any(f.exists() for f in ready.values())
    before, after = took.split("standby: taking over", 1)
    # the log shows compilations: one of the step (the fresh optimizer state is committed
    # like the step's outputs and a restored one, so the first steps share one signature)…
    assert before.count("Compiling jit(step)") == 1
    assert log_of("L0").count("Compiling jit(step)") == 1  # a learner too
    assert "Compiling jit(step)" not in after  # …and the training step was not compiled again
    assert "a warm spare, took over at" in after
    assert "the run (or L1) ended before it was needed" in log_of("spare-b")
    joins = [e for e in _events(r, keys) if e.get("learner") == "L1"
             and e.get("kind") in ("join", "rejoin")]
    assert [e["pid"] for e in joins][-1] == str(procs["L1"].pid)
    resumed = [e for e in _events(r, keys) if e.get("kind") == "resume"
               and e.get("learner") == "L1"]
    assert resumed and 0 < int(resumed[-1]["step"]) < steps  # from L1's checkpoint
    reports = registry.learner_final_reports(r, keys)
    assert reports["L0"].hashes == reports["L1"].hashes
    assert reports["L1"].steps == steps


def test_an_island_that_never_joined_leaves_its_learners_heartbeat_alone(tmp_path, redis_url):
    """A spare that fails or is stopped before it takes over closes its island: the heartbeat
    of the learner it stands in for (alive, elsewhere) must stay."""
    from broker.records import Heartbeat
    from workers.island import Island, IslandConfig

    r = connect(redis_url)
    cfg = tiny_config(learners=2, steps=10)
    keys = store_run(r, "lonely", cfg)
    registry.heartbeat(r, keys, "L1", Heartbeat(step=5), ttl_s=30.0)
    island = Island(IslandConfig(redis_url, "lonely", "L1", state_dir=str(tmp_path)))
    island.close()
    assert registry.live_learners(r, keys) == {"L1"}
