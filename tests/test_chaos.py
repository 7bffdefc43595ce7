"""Faults against real processes and a real redis-server, through the chaos harness.

Every test asserts the harness's invariants: nothing acknowledged is lost, the run finishes,
every learner ends with the same global values, versions only increase, and a learner that was
restarted (or paused, or cut off) contributes again.
"""

from __future__ import annotations

import pytest

from ops.chaos.harness import Fault, run_chaos
from pipeline import config as cfgmod

TINY = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
    "data": {"max_bytes": 600_000, "eval_batches": 2},
    "inner": {"lr": 3e-3, "warmup_steps": 5, "batch_size": 8},
    "sync": {"fragments": 2, "sync_every": 10},
    "broker": {"heartbeat_s": 0.25, "heartbeat_ttl_s": 1.5, "lease_ms": 2000,
               "claim_idle_ms": 2000, "snapshot_timeout_s": 2.0},
    "learners": 3, "steps": 10**6,
}


def chaos(tmp_path, faults: list[Fault], duration_s: float, **overrides) -> dict:
    raw = {**TINY, **{k: v for k, v in overrides.items() if k in TINY}}
    kwargs = {k: v for k, v in overrides.items() if k not in TINY}
    cfg = cfgmod.from_dict(raw)
    return run_chaos(cfg, tmp_path / "run", "chaos", faults, duration_s,
                     pace_s=kwargs.pop("pace_s", 0.05), **kwargs)


def check(rep: dict, learners: int = 3) -> None:
    assert rep["lost"] == 0, rep["lost_keys"]
    assert rep["merged_twice"] == 0, rep["merged_twice_keys"]
    assert rep["dropped_by_guard"] == 0, rep  # honest learners: the poison guard refuses none
    assert rep["crashes"] == {}, rep["crashes"]  # nothing died that the harness did not kill
    assert rep["learners_finished"] == [f"L{m}" for m in range(learners)], rep["exit_codes"]
    assert rep["identical_final_values"], rep["learner_hashes"]
    assert rep["versions_increase"]
    assert rep["rejoins_never"] == 0, rep
    assert rep["merged"] > 0 and rep["rounds"] > 0
    assert rep["pushes_acked"] <= rep["pushes_attempted"]


@pytest.mark.slow
def test_learner_kill_pause_partition_and_syncer_kill(tmp_path):
    """With warm spares (`diloco chaos --spares`): each learner has a `--standby` process,
    and the killed learner is brought back by activating its spare (no process start, data
    load or compilation in between); a new spare follows later. The syncer's kill is a plain
    restart."""
    faults = [Fault(10, "kill-learner", "L1", 3), Fault(16, "pause-learner", "L2", 3),
              Fault(22, "kill-syncer", "", 2), Fault(28, "partition-learner", "L0", 3)]
    rep = chaos(tmp_path, faults, 38, spares=True)
    check(rep)
    assert [f["kind"] for f in rep["faults"]] == [f.kind for f in faults]
    assert rep["rejoins"] >= 3  # L1, L2 and L0 each came back and contributed again
    # the killed learner resumed its checkpoint, unpushed progress included
    assert [(r["learner"], r["source"], r["progress"]) for r in rep["resumes"]] == [
        ("L1", "checkpoint", True)], rep["resumes"]
    # …as its warm spare (spares L0.spare1, L1.spare2, L2.spare3 started with the learners)
    assert [(t["learner"], t["spare"]) for t in rep["spares_took_over"]] == [
        ("L1", "L1.spare2")], rep["spares_took_over"]
    assert rep["spares_not_ready"] == []
    logs = tmp_path / "run" / "logs"
    assert "a warm spare, took over at" in (logs / "L1.spare2.log").read_text()
    assert (logs / "L1.spare4.log").exists()  # L1's next spare, 10 s after the takeover
    # the spares that never took over are not part of the run's exit codes
    assert sorted(rep["exit_codes"]) == ["L0", "L1", "L2", "syncer-0"], rep["exit_codes"]


@pytest.mark.slow
def test_three_syncers_share_eight_fragments_and_one_dies(tmp_path):
    """Three syncers started without a fragment list share 8 fragments; one is SIGKILLed for
    good mid-run and the other two take its fragments over (within its lease), claim what it
    had read and never committed, and finish the run: nothing lost, nothing merged twice."""
    rep = chaos(tmp_path, [Fault(10, "takeover", "syncer-1", 1)], 24, syncers=3,
                sync={"fragments": 8, "sync_every": 16})
    check(rep)
    by = rep["rounds_by_syncer"]
    assert sorted(by) == ["syncer-0", "syncer-1", "syncer-2"], by
    # the killed syncer's fragments went on without it: every fragment has rounds of a
    # survivor, and the survivors together cover all 8
    assert all(by["syncer-0"][p] + by["syncer-2"][p] > 0 for p in range(8)), by


@pytest.mark.slow
def test_syncer_killed_after_commit_lost_zmq_messages_redis_killed_and_a_long_pause(tmp_path):
    """One run, four faults: a syncer killed between its commit and its publish (its restart
    dies the same way once more), then one learner's ZeroMQ cut for 5 s — both repaired
    (re-publish on restart; the snapshot after snapshot_timeout_s); then redis-server
    SIGKILLed and restarted from its AOF, then a learner paused for longer than max_staleness
    (1) rounds: its late pushes are merged as stale or dropped, with reasons, and it rejoins."""
    over = {"sync": {**TINY["sync"], "max_staleness": 1}}
    faults = [Fault(8, "kill-syncer-after-commit", "", 1), Fault(15, "cut-zmq-learner", "L1", 5),
              Fault(23, "kill-redis", "", 3), Fault(30, "pause-learner", "L1", 6)]
    rep = chaos(tmp_path, faults, 44, **over)
    check(rep)
    assert [f["kind"] for f in rep["faults"]] == [f.kind for f in faults]
    # the restart died after its first commit, and the plain command took over
    assert [(e["syncer"], e["code"]) for e in rep["syncer_fault_exits"]] == [("syncer-0", 18)]


def test_random_schedules_are_poisson_and_a_rate_of_zero_means_none():
    from ops.chaos import random_schedule

    kills = random_schedule(1, 300.0, {"kill-learner": 30.0}, 5.0, quiet_tail_s=15.0)
    assert kills == random_schedule(1, 300.0, {"kill-learner": 30.0}, 5.0, quiet_tail_s=15.0)
    assert 2 <= len(kills) <= 25 and all(0 < f.at_s < 280 for f in kills)
    assert [f.at_s for f in kills] == sorted(f.at_s for f in kills)
    # `diloco bench s1 --kill-every-s 0`: no faults (it used to loop for ever at t = 0)
    assert random_schedule(1, 300.0, {"kill-learner": 0.0, "pause-learner": -1.0}, 5.0,
                           quiet_tail_s=15.0) == []


def test_a_push_written_twice_its_first_copy_dropped_and_trimmed_is_accounted(tmp_path,
                                                                             redis_url):
    """An XADD that landed but whose reply was lost (a link coming back) is sent again: the
    syncer drops the first copy (stale, say) and the second as a duplicate, and the stream is
    trimmed before the ledger runs. The learner's log knows only the second copy's id; the
    first copy's drop event names the push, so the ledger accounts for it (the lab's partition
    run once counted it lost)."""
    import json

    from broker import registry
    from broker.connection import connect
    from broker.keys import RunKeys
    from ops.chaos.ledger import account

    r, keys = connect(redis_url), RunKeys("twice")
    key = {"learner": "L1", "fragment": 0, "base_version": 49, "step": 550}
    (tmp_path / "L1.acked.jsonl").write_text(json.dumps(
        {"id": "200-0", "run": "h", "repush": False, **key}) + "\n")
    registry.event(r, keys, "join", learner="L1")
    registry.event(r, keys, "dropped", fragment=0, entry="100-0", reason="stale: base version "
                   "49, global version 87, max_staleness 4", learner="L1", base_version=49,
                   step=550)  # the first copy: not in any log, its entry trimmed
    registry.event(r, keys, "dropped", fragment=0, entry="200-0", reason="duplicate")
    rep = account(r, "twice", 1, tmp_path, learners=1, frag_weights=[1.0], t_start=0.0,
                  t_end=1.0, restarts=[], window_s=1.0)
    assert rep["lost"] == 0 and rep["duplicated"] == 1 and rep["dropped_stale"] == 1, rep
