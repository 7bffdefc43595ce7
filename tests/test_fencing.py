"""Two processes under one learner id — a learner partitioned away and back while its
replacement (a restart, a warm spare's takeover) runs — never both contribute: each process
claims a new epoch of its id when it joins, the older one stops before its next push or
heartbeat, and a syncer dead-letters any entry of an older epoch than one it has seen."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest
from helpers_broker import (
    REPO,
    dlq_entries,
    end_processes,
    poll_until,
    store_run,
    syncer_cmd,
    tiny_config,
)

from broker import registry
from broker.connection import connect
from broker.errors import Superseded
from broker.records import read_rounds
from workers.island import Island, IslandConfig


def _entries(r, ctx, epoch: int) -> list[tuple[int, bytes]]:
    """(fragment, entry id) of every entry of L0 with this epoch (0: no epoch field)."""
    out = []
    for p in range(len(ctx.fragments)):
        for eid, f in r.xrange(ctx.keys.fragment(p).frags):
            if f[b"learner"] == b"L0" and int(f.get(b"epoch", b"0")) == epoch:
                out.append((p, eid))
    return out


@contextlib.contextmanager
def _syncer(tmp_path, redis_url, run):
    """A real syncer process for `run`, and a list of in-process islands closed at the end."""
    log = open(tmp_path / "syncer.log", "wb")
    proc = subprocess.Popen(syncer_cmd(redis_url, run), cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT)
    islands: list[Island] = []
    try:
        yield proc, islands
    finally:
        for island in islands:
            island.close()
        end_processes({"syncer": proc}, {"syncer": log})


def _step(island, params):  # a fake inner step: every value moves by −1e-3
    return island.after_step({k: v - 1e-3 for k, v in params.items()})


def _join(icfg, islands):
    """A new process joining as `icfg`'s learner (closed with `islands`): (island, params)."""
    island = Island(icfg)
    islands.append(island)
    params, _ = island.start()
    return island, params


def _train(island, params):
    """Step `island` to the run's end (fake steps); its last parameters."""
    while not island.done:
        params = _step(island, params)
    return params


def _finish(island, params, syncer) -> None:
    """Train `island` to the end, flush, and see the syncer end the run."""
    params = _train(island, params)
    island.finish(params)
    island.close()
    assert syncer.wait(timeout=60) == 0


def test_a_superseded_learner_process_stops_and_its_late_entries_are_fenced(tmp_path,
                                                                            redis_url):
    r = connect(redis_url)
    # heartbeats far apart: the older process must find out at its next push, not later
    cfg = tiny_config(learners=1, steps=60, sync={"quorum": 1},
                      broker={"heartbeat_s": 30.0, "heartbeat_ttl_s": 90.0})
    keys = store_run(r, "fence", cfg)
    icfg = IslandConfig(redis_url, "fence", "L0")

    def step(island, params):
        time.sleep(0.01)
        return _step(island, params)

    with _syncer(tmp_path, redis_url, "fence") as (syncer, islands):
        a = Island(icfg)
        islands.append(a)
        pa, _ = a.start()
        assert a.epoch == registry.learner_epoch(r, keys, "L0") >= 1
        while a.net.stats.pushes_acked < 2:
            pa = step(a, pa)
        assert a.net.wait_flushed(10)
        old = _entries(r, a.ctx, a.epoch)
        assert len(old) >= 2

        b = Island(icfg)  # a second process joins as L0 while the first still runs
        islands.append(b)
        pb, _ = b.start()
        assert b.epoch == a.epoch + 1 == registry.learner_epoch(r, keys, "L0")
        with pytest.raises(Superseded, match="another process joined the run as this learner"):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                pa = step(a, pa)  # pushes keep being made until the island hears of it
        assert a.net.superseded == b.epoch
        a.net.join(10)
        assert not a.net.is_alive()  # the network thread of the older process has stopped
        assert _entries(r, a.ctx, a.epoch) == old  # nothing pushed once superseded
        # closing the superseded island leaves the learner's heartbeat to the newer process
        r.set(keys.heartbeat("L0"), b"1", px=60_000)
        a.close()
        assert r.exists(keys.heartbeat("L0"))

        # the newer process trains on; once the syncer has merged an entry of its epoch, a
        # late entry of the older one (pushed just before it heard) is dead-lettered
        while not b.net.stats.pushes_acked:
            pb = step(b, pb)
        def merged_b() -> bool:  # an entry of b's epoch is merged: the syncer has seen it
            for q, eid in _entries(r, b.ctx, b.epoch):
                [(_, f)] = r.xrange(b.ctx.keys.fragment(q).frags, eid, eid)
                m = registry.merged(r, keys, "L0", q)
                if m is not None and m.step >= int(f[b"step"]):
                    return True
            return False

        assert poll_until(merged_b, 30), (tmp_path / "syncer.log").read_text()[-3000:]
        p, old_id = old[-1]
        [(_, fields)] = r.xrange(b.ctx.keys.fragment(p).frags, old_id, old_id)
        late = {**fields, b"step": b"100000"}  # a new push, not a re-delivered one
        late_id = r.xadd(b.ctx.keys.fragment(p).frags, late)
        assert poll_until(lambda: any(d.get(b"dlq_source_id") == late_id
                                      for d in dlq_entries(r, b.ctx.keys.fragment(p))), 30)
        [dead] = [d for d in dlq_entries(r, b.ctx.keys.fragment(p))
                  if d.get(b"dlq_source_id") == late_id]
        assert b"fenced" in dead[b"dlq_reason"], dead[b"dlq_reason"]
        from ops.tools.inspect import entry_stats
        assert entry_stats(redis_url, "fence", p, late_id.decode(), dead_letter=True
                           )["epoch"] == a.epoch
        assert registry.refusal(r, keys, "L0", p) is None  # the id's refusals are b's
        _finish(b, pb, syncer)


def test_a_learner_superseded_in_its_final_flush_writes_no_end_of_run_record(tmp_path,
                                                                          redis_url):
    """A process that finished training and is in its final flush when a newer process joins
    as its learner stops at once (not after the flush's timeout) and writes none of the
    learner's end-of-run records; the newer process writes them."""
    r = connect(redis_url)
    keys = store_run(r, "fence3", tiny_config(learners=1, steps=12, sync={"quorum": 1}))
    icfg = IslandConfig(redis_url, "fence3", "L0", final_timeout_s=60.0)
    with _syncer(tmp_path, redis_url, "fence3") as (syncer, islands):
        a, pa = _join(icfg, islands)
        pa = _train(a, pa)
        b, pb = _join(icfg, islands)  # a newer process joins while the older one is about to flush
        t0 = time.monotonic()
        with pytest.raises(Superseded):
            a.finish(pa)
        assert time.monotonic() - t0 < 30
        assert "L0" not in registry.learner_final_reports(r, keys)
        assert "L0" not in registry.final_pushes(r, keys)
        a.close()
        _finish(b, pb, syncer)
        assert "L0" in registry.learner_final_reports(r, keys)


def test_a_learner_process_exits_3_when_another_joins_as_it(tmp_path, redis_url):
    """Real learner processes: a second `diloco learner --id L0` makes the first exit with
    code 3 (``EXIT_SUPERSEDED``) and carries the learner to the end of the run."""
    r = connect(redis_url)
    keys = store_run(r, "fence2", tiny_config(learners=1, steps=300, sync={"quorum": 1}))
    base = [sys.executable, "-m", "workers.learner", "--redis-url", redis_url, "--run",
            "fence2", "--id", "L0"]
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("syncer", "first", "second")}
    procs = {"syncer": subprocess.Popen(syncer_cmd(redis_url, "fence2"), cwd=REPO,
                                        stdout=logs["syncer"], stderr=subprocess.STDOUT),
             "first": subprocess.Popen([*base, "--delay-s", "0.05"], cwd=REPO,
                                       stdout=logs["first"], stderr=subprocess.STDOUT)}
    try:
        assert poll_until(lambda: r.hexists(keys.learners, "L0"), 120)  # the first trains
        procs["second"] = subprocess.Popen(base, cwd=REPO, stdout=logs["second"],
                                           stderr=subprocess.STDOUT)
        assert procs["first"].wait(timeout=120) == 3, (tmp_path / "first.log").read_text()[-3000:]
        assert procs["second"].wait(timeout=240) == 0, (tmp_path / "second.log"
                                                        ).read_text()[-3000:]
        assert procs["syncer"].wait(timeout=60) == 0
        assert "another process joined the run as this learner" in (
            tmp_path / "first.log").read_text()
    finally:
        end_processes(procs, logs)


def test_in_a_signed_run_only_a_claim_signed_by_the_learner_makes_it_stand_down(redis_url):
    """A learner user can raise any learner's epoch counter; with signing keys, a process
    stands down only for a newer claim signed with its learner's key (the syncers' fence needs
    no such claim: it reads the epochs of signed entries). Claims are kept per epoch, so two
    processes claiming at once both stay verifiable, and a claim starts above every signed
    one even when the counter went back."""
    from broker import signing
    from broker.keys import RunKeys

    r = connect(redis_url)
    keys = RunKeys("epochs")
    mine, other = signing.new_key(), signing.new_key()
    assert registry.newer_epoch(r, keys, "L0", 0, mine) is None  # nothing claimed yet
    assert registry.claim_epoch(r, keys, "L0", mine) == 1
    assert registry.newer_epoch(r, keys, "L0", 0, mine) == 1
    assert registry.newer_epoch(r, keys, "L0", 1, mine) is None  # its own claim
    # a learner user raising L0's counter, or writing claims it cannot sign: ignored
    r.incr(keys.epoch("L0"), 5)
    assert registry.newer_epoch(r, keys, "L0", 1) == 6  # an unsigned run believes the counter
    forged = {"6": signing.sign_epoch(other, "epochs", "L0", 6),  # another learner's key
              "5": signing.sign_epoch(mine, "other-run", "L0", 5),  # another run
              "4": signing.sign_epoch(mine, "epochs", "L1", 4),  # another learner
              "3": "0" * 64, "2": ":" * 1000}
    r.hset(keys.epoch_sig("L0"), mapping=forged)
    assert registry.newer_epoch(r, keys, "L0", 1, mine) is None
    # an entry's signature is not a claim's (another domain)
    assert signing.sign_epoch(mine, "epochs", "L0", 6) != signing.sign(
        mine, "epochs", {"learner": "L0", "epoch": "6"})
    # two processes claiming at once: both claims stay, the newest signed one counts
    assert registry.claim_epoch(r, keys, "L0", mine) == 7
    assert registry.claim_epoch(r, keys, "L0", mine) == 8
    r.hset(keys.epoch_sig("L0"), "8", signing.sign_epoch(mine, "epochs", "L0", 8))
    assert registry.newer_epoch(r, keys, "L0", 7, mine) == 8
    assert registry.newer_epoch(r, keys, "L0", 1, mine) == 8
    # the counter went back (an AOF restart lost it): the next claim is above every signed one
    r.set(keys.epoch("L0"), 2)
    assert registry.claim_epoch(r, keys, "L0", mine) == 9
    assert registry.newer_epoch(r, keys, "L0", 8, mine) == 9


def test_a_counter_that_is_not_a_number_leaves_the_learner_unfenced(redis_url, caplog):
    from broker.keys import RunKeys

    r = connect(redis_url)
    keys = RunKeys("epochs-bad")
    r.set(keys.epoch("L0"), b"not a number")
    r.hset(keys.epoch("L1"), "x", "1")  # the wrong type
    for name in ("L0", "L1"):
        assert registry.claim_epoch(r, keys, name) == 0
    assert "cannot claim an epoch" in caplog.text
    assert registry.newer_epoch(r, keys, "L0", 3) is None


def test_a_restart_whose_final_pushes_were_merged_is_refused_as_finished(tmp_path, redis_url,
                                                                          monkeypatch):
    """A process whose final pushes were merged dies before recording them; its restart
    resumes from an older checkpoint, trains the last steps again and flushes. Under the plain
    final step (the default) the syncer refuses those pushes as `finished` — their progress was
    merged once — and the restarted process still ends the run on the final value."""
    r = connect(redis_url)
    keys = store_run(r, "fence4", tiny_config(learners=1, steps=20, sync={"quorum": 1}))
    icfg = IslandConfig(redis_url, "fence4", "L0", final_timeout_s=60.0,
                        state_dir=str(tmp_path / "state"), checkpoint_every=15)
    with _syncer(tmp_path, redis_url, "fence4") as (syncer, islands):
        a, pa = _join(icfg, islands)
        pa = _train(a, pa)

        def killed(*args, **kwargs):
            raise RuntimeError("killed before recording its final pushes")

        monkeypatch.setattr(registry, "mark_final_pushes", killed)
        with pytest.raises(RuntimeError, match="killed"):
            a.finish(pa)
        monkeypatch.undo()
        n = len(a.ctx.fragments)
        assert poll_until(lambda: all(
            (m := registry.merged(r, keys, "L0", p)) is not None and m.step == 20
            for p in range(n)), 30)
        a.close()
        b, pb = _join(icfg, islands)
        assert b.step == 15  # from the checkpoint: steps 16–20 are trained again
        _finish(b, pb, syncer)
        reasons = [registry.refusal(r, keys, "L0", p) for p in range(n)]
        assert any(x is not None and x.reason.startswith("finished") for x in reasons), reasons
        final = registry.learner_final_reports(r, keys)["L0"]
        assert final.steps == 20 and len(final.hashes) == n
        for p in range(n):  # every step merged once per fragment (without the refusal: 25)
            assert sum(rec.steps for rec in read_rounds(r, keys.fragment(p))) == 20


def test_a_slot_redirect_that_outlasts_the_clients_retries_is_an_outage_not_a_crash():
    """A commit's WATCH on a cluster raises MOVED (or ASK) when a failover outlasts redis-py's
    retries (seen: the syncer of `test_redis_cluster`'s failover run crashed on it under load);
    learners and syncers ride it out as an outage, resyncing once the slot answers again."""
    from redis.exceptions import AskError, MovedError

    from broker.connection import OUTAGE

    assert isinstance(MovedError("6687 127.0.0.1:49619"), OUTAGE)
    assert isinstance(AskError("6687 127.0.0.1:49619"), OUTAGE)
