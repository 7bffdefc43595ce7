"""Hostile input: the poison guard (token bound, norm bound), rounds whose value would not be
finite, hostile entries and records against a real syncer process, a syncer started on a
finished run, and learners that come back from a kill during a checkpoint write and from a
truncated checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers_broker import (
    REPO,
    contribution_fields,
    dlq_entries,
    end_processes,
    make_delta,
    push,
    run_to_the_end,
    store_run,
    syncer_cmd,
    tiny_config,
    wait_for,
)

from broker import registry
from broker.connection import connect
from pipeline import quant
from pipeline.config import OuterConfig, SyncConfig
from pipeline.contribution import Contribution, Drop
from pipeline.guard import MIN_HISTORY
from pipeline.model import is_embedding
from pipeline.syncer import FragmentSyncer, RoundRefused
from workers.common import NpzWriter, open_run

NAME = "h0.mlp.fc"
THETA0 = {NAME: np.zeros(64, np.float32)}


def _syncer(**sync) -> FragmentSyncer:
    cfg = SyncConfig(quorum=1, grace_max_s=0.0, codec_down="fp32", max_staleness=1000, **sync)
    return FragmentSyncer(0, dict(THETA0), OuterConfig(), cfg, is_embedding=is_embedding)


def _c(learner: str, i: int, scale: float = 1e-3, steps: int = 10, tokens: int = 2560,
       base: int = 0) -> Contribution:
    rng = np.random.default_rng(i)
    delta = (scale * rng.standard_normal(64)).astype(np.float32)
    return Contribution(learner, 0, base, 100 + i, steps, tokens,
                        delta={NAME: quant.quantize(delta, "fp32", 64)}, entry_id=f"{learner}-{i}")


def _honest_rounds(s: FragmentSyncer, n: int) -> None:
    for i in range(n):
        ok, why = s.offer(_c(f"L{i % 3}", i, base=s.version), float(i), 256)
        assert ok, why
        s.close(float(i), "test")


def test_the_norm_guard_drops_a_huge_contribution_only_after_it_has_a_history():
    s = _syncer()
    # before MIN_HISTORY accepted contributions nothing is judged
    ok, _ = s.offer(_c("L0", 0, scale=1.0, base=0), 0.0, 256)
    assert ok
    s.close(0.0, "test")
    _honest_rounds(s, MIN_HISTORY)
    ok, why = s.offer(_c("L9", 99, scale=1e-3 * 1e4, base=s.version), 0.0, 256)
    assert not ok and why.kind is Drop.NORM and "median" in why, why
    # per step: ten times the steps may carry ten times the norm
    ok, why = s.offer(_c("L8", 98, scale=5e-3, steps=100, tokens=25600, base=s.version),
                      0.0, 256)
    assert ok, why
    # the history survives the crash-safe state
    restored = FragmentSyncer.from_state_dict(s.state_dict(), OuterConfig(), s.sync_cfg,
                                              is_embedding)
    assert list(restored.guard.recent) == list(s.guard.recent)


def test_before_a_history_the_prior_bound_applies():
    cfg = SyncConfig(quorum=1, grace_max_s=0.0, codec_down="fp32", max_staleness=1000)
    prior = 10 * 1e-3 * np.sqrt(64)  # guard_prior × lr × √n
    s = FragmentSyncer(0, dict(THETA0), OuterConfig(), cfg, is_embedding=is_embedding,
                       prior_step_norm=prior)
    ok, why = s.offer(_c("L0", 0, scale=1e-3 * 1e4), 0.0, 256)  # a poisoned first push
    assert not ok and why.kind is Drop.NORM and "prior" in why, why
    assert s.offer(_c("L1", 1), 0.0, 256)[0]  # an honest one (‖δ‖/step ≈ 8e-4 < 0.08)


def test_clipping_scales_the_contribution_to_the_bound_and_records_it():
    s = _syncer(guard_action="clip")
    _honest_rounds(s, MIN_HISTORY + 1)
    v = s.version
    ok, _ = s.offer(_c("L9", 99, scale=1e-3 * 1e4, base=v), 0.0, 256)
    assert ok
    res = s.close(0.0, "test")
    assert res.clipped == ["L9-99"]
    assert np.isfinite(res.theta[NAME]).all()
    # the outer update is bounded by k × median, not by the attacker's 10⁴
    assert float(np.linalg.norm(res.theta[NAME])) < 1.0


def test_inflated_token_counts_are_refused():
    s = _syncer()
    ok, why = s.offer(_c("L0", 0, tokens=10**18, steps=1), 0.0, 256)
    assert not ok and why.kind is Drop.TOKENS
    ok, why = s.offer(_c("L1", 1, tokens=2560, steps=10), 0.0, 256)
    assert ok, why
    # guard off: the same claim is merged (with weight 1e36)
    off = _syncer(guard=False)
    assert off.offer(_c("L0", 0, tokens=10**18, steps=1), 0.0, 256)[0]


def test_a_round_whose_value_would_overflow_is_not_committed():
    s = _syncer(guard=False)
    big = Contribution("L0", 0, 0, 5, 1, 256, delta={NAME: quant.quantize(
        np.full(64, 3e38, np.float32), "fp32", 64)}, entry_id="big")
    ok, why = s.offer(big, 0.0, 256)
    assert ok, why  # finite values: the merge accepts them
    with pytest.raises(RoundRefused):
        s.close(0.0, "test")
    assert s.version == 0 and np.array_equal(s.theta[NAME], THETA0[NAME])
    drops = s.take_drops()
    assert drops and drops[0][0] == "big" and drops[0][1].kind is Drop.ROUND
    # the fragment carries on
    ok, _ = s.offer(_c("L1", 1), 0.0, 256)
    assert ok and s.close(0.0, "test").version == 1


# --------------------------------------------------------------- a real syncer process


def _start_syncer(url: str, run: str, log: Path) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen(syncer_cmd(url, run), cwd=REPO, stdout=fh,
                                stderr=subprocess.STDOUT)


def _versions(r, keys, p: int) -> int:
    recs = r.xrange(keys.fragment(p).rounds)
    return len(recs)


def test_hostile_entries_and_records_never_stop_a_real_syncer(tmp_path, redis_url):
    r = connect(redis_url)
    # no prior norm bound: the overflowing entry must reach the merge (with the default
    # prior the guard refuses it first, see test_before_a_history_the_prior_bound_applies)
    cfg = tiny_config(sync={"quorum": 1, "grace_max_s": 0.0, "guard_prior": 0.0},
                      broker={"block_ms": 50})
    keys = store_run(r, "hostile", cfg)
    proc = _start_syncer(redis_url, "hostile", tmp_path / "syncer.log")
    p = 1
    try:
        wait_for(lambda: r.get(keys.fragment(p).state), 60, what="the syncer's version 0")
        n = 0

        def honest(seed: int) -> None:
            nonlocal n
            v = int(open_run(redis_url, "hostile", wait_s=0).r.xlen(keys.fragment(p).rounds))
            push(r, keys, p, contribution_fields(f"L{seed % 2}", p, make_delta(cfg, p, seed),
                                                 base_version=v, step=10 * (seed + 1)))
            n += 1
            wait_for(lambda: _versions(r, keys, p) >= n, 30, what=f"honest round {n}")
            assert proc.poll() is None, (tmp_path / "syncer.log").read_text()[-3000:]

        honest(0)
        # 1. a field of the wrong type after a valid digest
        bad = contribution_fields("L0", p, make_delta(cfg, p, 1), base_version=1, step=11)
        bad["seconds"] = "abc"
        bad_id = push(r, keys, p, bad)
        # 2. a heartbeat record that is not an object
        r.hset(keys.learners, "L7", "[1]")
        # 3. finite values that overflow the merge (3e38), alone in their round
        big = {k: np.full_like(v, 3e38) for k, v in make_delta(cfg, p, 2).items()}
        big_id = push(r, keys, p, contribution_fields("L6", p, big, base_version=1, step=12))
        # 4. a stranger claiming 10¹⁸ tokens in one step
        toks_id = push(r, keys, p, contribution_fields("L5", p, make_delta(cfg, p, 3),
                                                       base_version=1, step=13, steps=1,
                                                       tokens=10**18))
        wait_for(lambda: any(e[b"kind"] == b"round-refused" for _, e in
                             r.xrange(keys.events)), 30, what="the refused round")
        honest(4)
        honest(5)
        assert proc.poll() is None
        dlq = {e[b"dlq_source_id"].decode(): e[b"dlq_reason"].decode()
               for e in dlq_entries(r, keys.fragment(p))}
        assert bad_id in dlq and "seconds" in dlq[bad_id], dlq
        events = [e for _, e in r.xrange(keys.events)]
        refused = [e for e in events if e[b"kind"] == b"round-refused"]
        assert big_id in refused[0][b"entries"].decode()
        dropped = {e[b"entry"].decode(): e[b"reason"].decode() for e in events
                   if e[b"kind"] == b"dropped"}
        dropped.update({entry: str(reason) for rec in _records(r, keys, p)
                        for entry, reason in rec})
        assert toks_id in dropped and dropped[toks_id].startswith("tokens "), dropped
        assert r.xpending(keys.fragment(p).frags, "syncers")["pending"] == 0
    finally:
        r.set(keys.stop, "1")
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, (tmp_path / "syncer.log").read_text()[-3000:]
    assert "Traceback" not in (tmp_path / "syncer.log").read_text()


def _records(r, keys, p):
    out = []
    for _, f in r.xrange(keys.fragment(p).rounds):
        out.append([tuple(x) for x in json.loads(f[b"dropped"])])
    return out


def test_a_syncer_started_on_a_finished_run_exits_0(tmp_path, redis_url):
    from test_e2e import write_config  # the e2e helpers

    cfg_path = write_config(tmp_path, learners=2, steps=20)
    out = subprocess.run([sys.executable, "-m", "ops.cli", "run", "--config", cfg_path,
                          "--redis-url", redis_url, "--run", "done", "--out",
                          str(tmp_path / "runs"), "--json"], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    t0 = time.monotonic()
    again = subprocess.run(syncer_cmd(redis_url, "done"), capture_output=True, text=True,
                           timeout=120, cwd=REPO)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "has finished" in again.stderr and time.monotonic() - t0 < 60
    ctx = open_run(redis_url, "done", wait_s=0)
    assert len(registry.learner_final_reports(ctx.r, ctx.keys)) == 2


def test_checkpoints_are_written_off_the_training_thread_one_at_a_time(tmp_path):
    """`NpzWriter`: submit returns before the file is written, the next submit waits for the
    write in progress (never two at once, never an older file over a newer one), and a failed
    write is raised by the next submit instead of passing unseen."""
    w = NpzWriter("test")
    path = tmp_path / "c.npz"
    big = np.arange(4_000_000, dtype=np.float32)  # 16 MB: the write takes a while
    w.submit(path, {"step": np.asarray(1), "x": big})
    w.submit(path, {"step": np.asarray(2), "x": big})  # after the first is whole
    assert w.wait(60)
    with np.load(path) as z:
        assert int(z["step"]) == 2 and np.array_equal(z["x"], big)
    assert not list(tmp_path.glob(".*.tmp"))
    w.submit(tmp_path / "missing" / "c.npz", {"step": np.asarray(3)})  # its folder is gone
    assert w.wait(60)
    with pytest.raises(FileNotFoundError):
        w.submit(path, {"step": np.asarray(4)})
    w.submit(path, {"step": np.asarray(5)})  # the error was raised once; writing goes on
    w.close()
    with np.load(path) as z:
        assert int(z["step"]) == 5


def test_learners_come_back_from_a_kill_during_a_checkpoint_write_and_a_truncated_one(
        tmp_path, redis_url):
    """L1 is killed (SIGKILL) halfway through writing its third checkpoint; L0 dies at step
    30 and its checkpoint is then torn in half. Both restart, resume (L1 from its last
    complete checkpoint, L0 from the latest global values), contribute, and finish with the
    same final values."""
    r = connect(redis_url)
    cfg = tiny_config(learners=2, steps=60, sync={"quorum": 1})
    keys = store_run(r, "ckpt", cfg)
    state = tmp_path / "state"
    base = [sys.executable, "-m", "workers.learner", "--redis-url", redis_url, "--run", "ckpt",
            "--state-dir", str(state), "--checkpoint-every", "5"]
    names = ("syncer", "L0", "L0b", "L1", "L1b")
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in names}

    def spawn(name: str, *args: str) -> subprocess.Popen:
        cmd = syncer_cmd(redis_url, "ckpt") if name == "syncer" else [*base, *args]
        return subprocess.Popen(cmd, cwd=REPO, stdout=logs[name], stderr=subprocess.STDOUT)

    procs = {"syncer": spawn("syncer")}
    try:
        procs["L0"] = spawn("L0", "--id", "L0", "--fail-at-step", "30")
        procs["L1"] = spawn("L1", "--id", "L1", "--stall-in-checkpoint", "3")
        # L1: a real kill while its checkpoint is half on the disk
        def stalled() -> list[Path]:  # a temporary untouched for 2 s (a write takes ms)
            old = []
            for t in state.glob(".L1.ckpt.npz.*.tmp"):
                try:
                    if time.time() - t.stat().st_mtime > 2.0:
                        old.append(t)
                except FileNotFoundError:  # a write that finished meanwhile
                    pass
            return old

        temps = wait_for(stalled, timeout_s=180, interval_s=0.2, what="the stalled write")
        ckpt1 = state / "L1.ckpt.npz"
        with np.load(ckpt1) as z:  # the previous checkpoint is whole
            whole_step = int(z["step"])
        assert whole_step > 0
        procs["L1"].kill()
        assert procs["L1"].wait(30) == -9 and temps[0].exists()
        procs["L1b"] = spawn("L1b", "--id", "L1")
        # L0: dies abruptly, then its checkpoint is torn
        assert procs["L0"].wait(180) == 19
        ckpt0 = state / "L0.ckpt.npz"
        data = ckpt0.read_bytes()
        ckpt0.write_bytes(data[: len(data) // 2])  # a torn write, as a full disk leaves it
        procs["L0b"] = spawn("L0b", "--id", "L0")
        for name in ("L0b", "L1b", "syncer"):
            assert procs[name].wait(240) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        end_processes(procs, logs)
    ctx = open_run(redis_url, "ckpt", wait_s=0)
    reports = registry.learner_final_reports(ctx.r, ctx.keys)
    assert reports["L0"].hashes == reports["L1"].hashes
    assert reports["L0"].steps == reports["L1"].steps == 60
    events = [(i, e) for i, e in r.xrange(keys.events)]
    corrupt = [i for i, e in events if e[b"kind"] == b"checkpoint-corrupt"]
    assert len(corrupt) == 1 and (state / "L0.ckpt.npz.corrupt").exists()
    resumed = [(i, {k.decode(): v.decode() for k, v in e.items()}) for i, e in events
               if e[b"kind"] == b"resume" and e.get(b"learner") == b"L1"]
    assert resumed and resumed[0][1]["source"] == "checkpoint", resumed
    assert int(resumed[0][1]["step"]) == whole_step, resumed
    assert not list(state.glob(".L1.ckpt.npz.*.tmp")), "the torn temporary was not removed"
    # each restarted learner contributed after its restart (stream ids are Redis times)
    restarts = {"L0": corrupt[0], "L1": resumed[0][0]}
    for learner, since in restarts.items():
        after = [i for p in range(len(ctx.fragments))
                 for i, f in r.xrange(ctx.keys.fragment(p).frags, min=since)
                 if f[b"learner"] == learner.encode()]
        assert after, f"{learner} pushed nothing after coming back"


def test_a_poisoned_learner_is_refused_throughout_and_the_run_still_finishes(tmp_path,
                                                                              redis_url):
    """Real processes: L1 sends every push with 10⁴× its norm and is slower than L0, so its
    last push is refused after L0 has finished and no round will merge anything for it. The
    syncer records each refusal for the learner; L1 stops waiting for that push's merged value,
    flushes and adopts the final values. The ledger accounts for every poisoned push as
    refused by the guard, and for no honest one."""
    from ops.chaos.ledger import account

    r = connect(redis_url)
    cfg = tiny_config(learners=2, steps=60, sync={"quorum": 1})
    keys = store_run(r, "poison", cfg)
    state = tmp_path / "state"
    base = [sys.executable, "-m", "workers.learner", "--redis-url", redis_url, "--run",
            "poison", "--state-dir", str(state)]
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("syncer", "L0", "L1")}
    cmds = {"syncer": syncer_cmd(redis_url, "poison"), "L0": [*base, "--id", "L0"],
            "L1": [*base, "--id", "L1", "--poison", "norm", "--delay-s", "0.1"]}
    t0 = time.time()
    procs = {n: subprocess.Popen(c, cwd=REPO, stdout=logs[n], stderr=subprocess.STDOUT)
             for n, c in cmds.items()}
    try:
        run_to_the_end(procs, ("L0", "L1", "syncer"), tmp_path, timeout_s=200)
    finally:
        for fh in logs.values():
            fh.close()
    ctx = open_run(redis_url, "poison", wait_s=0)
    reports = registry.learner_final_reports(ctx.r, ctx.keys)
    assert reports["L0"].hashes == reports["L1"].hashes
    rep = account(r, "poison", len(ctx.fragments), state, learners=2,
                  frag_weights=[0.5, 0.5], t_start=t0, t_end=time.time(), restarts=[],
                  window_s=5.0)
    by = rep["by_learner"]
    assert rep["lost"] == 0
    assert by["L1"]["acked"] > 0 and by["L1"]["dropped_by_guard"] == by["L1"]["acked"], by
    assert by["L1"]["merged"] == 0 and by["L0"]["dropped_by_guard"] == 0, by
    assert by["L0"]["merged"] == by["L0"]["acked"], by
    refused = registry.refusal(r, keys, "L1", 0)
    assert refused is not None and "norm" in refused.reason


def test_a_learner_rejects_bad_merged_values_and_keeps_real_ones(redis_url):
    import zmq

    from broker import codec
    from workers.learner_net import LearnerNet

    r = connect(redis_url)
    cfg = tiny_config()
    keys = store_run(r, "bad-global", cfg)
    ctx = open_run(redis_url, "bad-global", wait_s=0)
    zctx = zmq.Context()
    net = LearnerNet(ctx, "L0", zctx)
    try:
        p = 1
        good = {n: quant.quantize(np.zeros(ctx.shapes[n], np.float32), "bf16", 64)
                for n in ctx.fragments[p]}
        nan = {n: quant.QTensor("fp32", tuple(ctx.shapes[n]),
                                np.full(int(np.prod(ctx.shapes[n])), np.nan, np.float32),
                                None, 0) for n in ctx.fragments[p]}

        def header(run: str, version: int, tensors: dict) -> codec.GlobalHeader:
            blob = codec.pack_snapshot(run, p, version, tensors)
            return codec.unpack_snapshot(blob)

        for run, version, tensors in (("other-run", 5, good), ("bad-global", 2**62, nan),
                                      ("bad-global", 3, {**good, "extra": good[next(
                                          iter(good))]})):
            h, t = header(run, version, tensors)
            net._deliver(h, t)
        assert net.inbox.empty() and net.stats.rejected == 3
        h, t = header("bad-global", 2, good)  # a real version after the bad ones is taken
        net._deliver(h, t)
        assert net.inbox.get_nowait()[:2] == (p, 2)
        events = [e for _, e in r.xrange(keys.events) if e[b"kind"] == b"bad-global"]
        assert len(events) == 3 and b"another" not in events[0][b"reason"]
        assert b"other-run" in events[0][b"reason"] and b"non-finite" in events[1][b"reason"]
    finally:
        net.sub.close()
        zctx.term()


def test_a_refused_learner_does_not_count_for_the_quorum_or_the_round_share():
    s = _syncer()
    live = frozenset({"L0", "L1", "L2", "L3"})
    ok, why = s.offer(_c("L3", 0, tokens=10**18, steps=1), 0.0, 256)
    assert not ok and s.counted(live) == {"L0", "L1", "L2"}
    assert s.offer(_c("L0", 1), 0.0, 256)[0]
    assert s.round_share(len(s.counted(live))) == 1 / 3
    assert s.offer(_c("L3", 2), 0.0, 256)[0]  # an honest push clears the suspicion
    assert s.counted(live) == live


def test_a_learner_refuses_to_join_from_a_snapshot_that_is_not_its_fragments(redis_url):
    """A snapshot in Redis whose tensors are not the fragment's (a stolen credential, or
    another run's data): the learner refuses it in one line and exits; no traceback."""
    from broker import codec

    r = connect(redis_url)
    keys = store_run(r, "forged", tiny_config())
    forged = {"not-a-parameter": quant.quantize(np.zeros(4, np.float32), "fp32", 64)}
    r.set(keys.fragment(0).global_, codec.pack_snapshot("forged", 0, 1, forged))
    out = subprocess.run([sys.executable, "-m", "workers.learner", "--redis-url", redis_url,
                          "--run", "forged", "--id", "L0"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    r.close()
    assert out.returncode == 1, out.stderr[-2000:]
    assert "does not hold the fragment's tensors" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
