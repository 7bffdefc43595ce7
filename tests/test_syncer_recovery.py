"""Syncer crash recovery against a real redis-server: crashes before and after the round commit
(fault-injection flags, the syncer as a subprocess), restarts, duplicate pushes, malformed
entries and claiming the pending entries of a consumer that never came back.

Every round here uses quorum K = 2 with two contributions (from L0 and L1) pushed before the
syncer starts and no grace window, so it closes as soon as both are read. No heartbeats are
sent: the live set is empty and K applies.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import zmq
from helpers_broker import (
    SyncerThread,
    committed_version,
    contribution_fields,
    dlq_entries,
    global_value,
    make_delta,
    pending_by_consumer,
    poll_until,
    push,
    reference_round,
    rounds_records,
    run_syncer_process,
    state_version,
    store_run,
    tiny_config,
    wait_for,
    xpending_count,
)

from broker import codec, registry
from broker.connection import connect
from broker.keys import GROUP
from broker.pubsub import Subscriber
from broker.records import read_rounds
from broker.streams import FragmentStreams
from pipeline import quant
from pipeline.syncer import Contribution
from pipeline.task import ByteGPT
from workers.common import open_run
from workers.syncer import Syncer, SyncerConfig

P = 1  # the fragment under test (the non-embedding tensors: RDA merge)
OTHER = 0
# (learner, seed, steps, tokens): different weights for the two learners
L0 = ("L0", 0, 10, 2560)
L1 = ("L1", 1, 8, 2048)


def recovery_config(**broker):
    return tiny_config(sync={"quorum": 2, "grace_max_s": 0.0},
                       broker={"block_ms": 50, **broker})


@pytest.fixture
def r(redis_url):
    client = connect(redis_url)
    yield client
    client.close()


@contextlib.contextmanager
def syncer_in_process(cfg: SyncerConfig):
    """(a Syncer object in this process, not started, and its ZeroMQ context); closed, its
    leases released, after."""
    ctx = open_run(cfg.redis_url, cfg.run, wait_s=5.0)
    zctx = zmq.Context()
    s = Syncer(cfg, ctx, zctx)
    try:
        yield s, zctx
    finally:
        s.pub.close()
        for p in s.owned:
            s.streams.state.release_lease(p, cfg.syncer_id)
        ctx.r.close()
        zctx.term()


def push_contribution(r, keys, cfg, who, p=P):
    learner, seed, steps, tokens = who
    fields = contribution_fields(learner, p, make_delta(cfg, p, seed), steps=steps,
                                 tokens=tokens, step=steps)
    return push(r, keys, p, fields), fields


def contribution(cfg, who, entry_id, p=P):
    learner, seed, steps, tokens = who
    return Contribution(learner, p, 0, steps, steps, tokens, delta=make_delta(cfg, p, seed),
                        entry_id=entry_id)


def assert_values_equal(got, want):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=1e-6, err_msg=k)


def crash_syncer(tmp_path, redis_url, run, flag, code, *extra):
    log = tmp_path / f"syncer-{flag}.log"
    rc = run_syncer_process(redis_url, run, flag, "1", *extra, log_path=log)
    assert rc == code, log.read_text(errors="replace")[-4000:]


def assert_merged_once(r, keys, ids, syncer="syncer-0"):
    fk = keys.fragment(P)
    recs = rounds_records(r, fk)
    assert len(recs) == 1, recs
    rec = recs[0]
    included = [row[0] for row in rec["included"]]
    assert sorted(included) == sorted(ids) and len(set(included)) == len(included)
    assert [row[1] for row in rec["included"]] == ["L0", "L1"]
    assert rec["version"] == "1" and rec["fragment"] == str(P) and rec["syncer"] == syncer
    assert rec["seconds"] == [1.5, 1.5]
    assert int(rec["tokens"]) == L0[3] + L1[3] and int(rec["steps"]) == L0[2] + L1[2]
    assert committed_version(r, fk) == 1
    assert xpending_count(r, fk) == 0
    return rec


def test_crash_before_commit_then_restart_merges_pending_entries_once(tmp_path, r, redis_url):
    cfg = recovery_config()
    run = "crash-before"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    ids = [push_contribution(r, keys, cfg, who)[0] for who in (L0, L1)]

    crash_syncer(tmp_path, redis_url, run, "--fail-before-commit", 17)
    # the round was merged in memory but never committed: entries pending, state at v0
    assert xpending_count(r, fk) == 2
    assert pending_by_consumer(r, fk) == {"syncer-0": 2}
    assert state_version(r, fk) == 0 and state_version(r, keys.fragment(OTHER)) == 0
    assert r.xlen(fk.rounds) == 0
    assert global_value(r, fk)[0] == 0

    want_version, want = reference_round(cfg, P, [contribution(cfg, w, i)
                                                  for w, i in zip((L0, L1), ids, strict=True)])
    assert SyncerThread(SyncerConfig(redis_url, run, max_rounds=1)).start().join(r, keys) == 0

    assert_merged_once(r, keys, ids)
    version, values = global_value(r, fk)
    assert version == want_version == 1
    assert_values_equal(values, want)
    # under the delta down link (the default) `sent:1` keeps the delta as sent, which
    # makes the whole value `global` holds
    sent1, _ = codec.unpack_snapshot(r.get(fk.sent(1)), delta_ok=True)
    whole, _ = codec.unpack_snapshot(r.get(fk.global_))
    assert (sent1.version, sent1.base, sent1.value) == (1, 0, whole.sha256)
    # the other fragment saw nothing
    assert state_version(r, keys.fragment(OTHER)) == 0
    assert r.xlen(keys.fragment(OTHER).rounds) == 0
    # the restarted syncer released its leases on exit
    assert r.get(fk.lease) is None


def _probe_until_subscribed(pub, sub, run, timeout_s=10.0):
    """Publish probe messages on topic f9999 until the subscriber receives one: from then on
    the subscription is in place and nothing the publisher sends is lost to the slow joiner."""
    probe = codec.global_frames(run, 9999, 0, {"probe": quant.quantize(np.zeros(1), "fp32")})

    def once():
        pub.publish(probe)
        msg = sub.recv(20)
        return msg is not None and msg[0].fragment == 9999

    wait_for(once, timeout_s=timeout_s, interval_s=0.0, what="the SUB socket to subscribe")


def test_crash_after_commit_then_restart_republishes_without_merging_again(
        tmp_path, r, redis_url):
    cfg = recovery_config()
    run = "crash-after"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    ids = [push_contribution(r, keys, cfg, who)[0] for who in (L0, L1)]

    crash_syncer(tmp_path, redis_url, run, "--fail-after-commit", 18)
    # committed (state, snapshot, record, XACKs together), never published
    assert_merged_once(r, keys, ids)
    committed = r.get(fk.global_)
    version, values = global_value(r, fk)
    assert version == 1
    want_version, want = reference_round(cfg, P, [contribution(cfg, w, i)
                                                  for w, i in zip((L0, L1), ids, strict=True)])
    assert_values_equal(values, want)

    # restart (same id): subscribe before it starts, then watch start() re-publish
    with syncer_in_process(SyncerConfig(redis_url, run)) as (s, zctx):
        sub = Subscriber(zctx, [OTHER, P, 9999])
        try:
            sub.connect([s.pub.endpoint])
            _probe_until_subscribed(s.pub, sub, run)
            s.start()
            assert registry.endpoints(r, keys) == [s.pub.endpoint]
            got: dict[int, tuple[int, dict]] = {}

            def collect():
                msg = sub.recv(50)
                if msg is not None and msg[0].fragment in (OTHER, P):
                    got[msg[0].fragment] = (msg[0].version, msg[1])
                return len(got) == 2

            wait_for(collect, timeout_s=10, interval_s=0.0, what="the re-published values")
            assert got[P][0] == 1 and got[OTHER][0] == 0
            assert_values_equal({k: quant.dequantize(q) for k, q in got[P][1].items()}, values)
            # one full loop iteration with no new entries: nothing is merged again
            registry.request_stop(r, keys)
            assert s.run_forever() == 0
        finally:
            sub.close()

    assert_merged_once(r, keys, ids)
    assert r.get(fk.global_) == committed
    assert state_version(r, keys.fragment(OTHER)) == 0


def test_duplicate_pushes_are_merged_once(r, redis_url):
    cfg = recovery_config()
    run = "dupes"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    first, fields = push_contribution(r, keys, cfg, L0)
    dup = push(r, keys, P, fields)  # the same fields again, as a retried XADD does
    second = push_contribution(r, keys, cfg, L1)[0]
    want_version, want = reference_round(cfg, P, [contribution(cfg, L0, first),
                                                  contribution(cfg, L1, second)])

    assert SyncerThread(SyncerConfig(redis_url, run, max_rounds=1)).start().join(r, keys) == 0
    rec = assert_merged_once(r, keys, [first, second])
    assert rec["dropped"] == [[dup, "duplicate"]]
    version, values = global_value(r, fk)
    assert version == want_version == 1
    assert_values_equal(values, want)

    # a late duplicate (after its round closed, syncer restarted): acknowledged, not merged
    late = push(r, keys, P, fields)
    t = SyncerThread(SyncerConfig(redis_url, run)).start()

    def dropped_late():
        events = [f for _, f in r.xrange(keys.events)]
        return xpending_count(r, fk) == 0 and any(
            e[b"kind"] == b"dropped" and e.get(b"entry") == late.encode() for e in events)

    try:
        wait_for(dropped_late, timeout_s=15, what="the late duplicate to be dropped and acked")
    finally:
        registry.request_stop(r, keys)
    assert t.join(r, keys) == 0
    assert_merged_once(r, keys, [first, second])
    assert r.xlen(fk.dlq) == 0


def test_malformed_entries_go_to_the_dlq_and_the_round_still_closes(r, redis_url):
    cfg = recovery_config()
    run = "malformed"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    good0, fields = push_contribution(r, keys, cfg, L0)
    garbage = b"\x93not msgpack at all\xc1"
    bad = {
        # payload consistent with nbytes and sha256, but not a tensor document
        "garbage": push(r, keys, P, {**fields, "learner": "L2", "payload": garbage,
                                     "nbytes": len(garbage),
                                     "sha256": codec.sha256_hex(garbage)}),
        # a valid payload whose checksum does not match
        "sha256": push(r, keys, P, {**fields, "learner": "L3", "sha256": "0" * 64}),
        # an entry of fragment 0 pushed into fragment 1's stream
        "fragment": push(r, keys, P, contribution_fields("L4", OTHER,
                                                         make_delta(cfg, OTHER, 4))),
        # fields missing
        "missing": push(r, keys, P, {"learner": "L5"}),
    }
    good1 = push_contribution(r, keys, cfg, L1)[0]
    want_version, want = reference_round(cfg, P, [contribution(cfg, L0, good0),
                                                  contribution(cfg, L1, good1)])

    assert SyncerThread(SyncerConfig(redis_url, run, max_rounds=1)).start().join(r, keys) == 0

    dlq = {e[b"dlq_source_id"].decode(): e for e in dlq_entries(r, fk)}
    assert set(dlq) == set(bad.values())
    reasons = {name: dlq[i][b"dlq_reason"].decode() for name, i in bad.items()}
    assert all(x.startswith("malformed entry") for x in reasons.values()), reasons
    assert "sha256 mismatch" in reasons["sha256"]
    assert "fragment" in reasons["fragment"]
    assert "lacks field" in reasons["missing"]
    assert dlq[bad["garbage"]][b"payload"] == garbage  # the original fields travel along
    assert dlq[bad["sha256"]][b"learner"] == b"L3"
    assert_merged_once(r, keys, [good0, good1])  # XPENDING 0: the bad ones were acked too
    version, values = global_value(r, fk)
    assert version == want_version == 1
    assert_values_equal(values, want)
    events = [f for _, f in r.xrange(keys.events)]
    assert sum(e[b"kind"] == b"dead-letter" for e in events) == len(bad)


def test_another_consumer_claims_entries_of_a_dead_one(tmp_path, r, redis_url):
    cfg = recovery_config(claim_idle_ms=300)
    run = "claim"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    ids = [push_contribution(r, keys, cfg, who)[0] for who in (L0, L1)]

    crash_syncer(tmp_path, redis_url, run, "--fail-before-commit", 17)
    assert pending_by_consumer(r, fk) == {"syncer-0": 2}
    # the dead syncer's leases and membership run out (fast-forwarded instead of waiting
    # broker.lease_ms: a member for the rest of its TTL is given a share of the fragments)
    assert r.get(fk.lease) == b"syncer-0"
    for p in (OTHER, P):
        r.delete(keys.fragment(p).lease)
    r.delete(keys.member("syncer-0"))
    assert state_version(r, fk) == 0
    want_version, want = reference_round(cfg, P, [contribution(cfg, w, i)
                                                  for w, i in zip((L0, L1), ids, strict=True)])

    cfg1 = SyncerConfig(redis_url, run, syncer_id="syncer-1", max_rounds=1)
    assert SyncerThread(cfg1).start().join(r, keys) == 0

    assert_merged_once(r, keys, ids, syncer="syncer-1")
    assert pending_by_consumer(r, fk) == {"syncer-0": 0, "syncer-1": 0}
    version, values = global_value(r, fk)
    assert version == want_version == 1
    assert_values_equal(values, want)
    assert r.xlen(fk.dlq) == 0


def test_start_survives_an_initialisation_longer_than_the_lease(r, redis_url, monkeypatch):
    """A fresh run: start() takes the lease of fragment 0, then builds the initial parameters
    (JAX start-up and compilation: ~3 s in a fresh process, longer for big models) before the
    fenced `init_fragment`. Nobody else wants the fragment, so an expired lease must be taken
    again, not end the syncer with LeaseLost("lease held by another syncer")."""

    cfg = recovery_config(lease_ms=1000)
    run = "slow-init"
    keys = store_run(r, run, cfg)
    ids = [push_contribution(r, keys, cfg, who)[0] for who in (L0, L1)]
    want_version, want = reference_round(cfg, P, [contribution(cfg, w, i)
                                                  for w, i in zip((L0, L1), ids, strict=True)])
    real_init = ByteGPT.init_params

    def slow_init(task, seed):
        wait_for(lambda: r.get(keys.fragment(OTHER).lease) is None, timeout_s=10,
                 what="the lease of fragment 0 to run out during initialisation")
        return real_init(task, seed)

    monkeypatch.setattr(ByteGPT, "init_params", slow_init)
    assert SyncerThread(SyncerConfig(redis_url, run, max_rounds=1)).start().join(r, keys) == 0
    assert_merged_once(r, keys, ids)
    version, values = global_value(r, keys.fragment(P))
    assert version == want_version == 1
    assert_values_equal(values, want)


def test_waiting_round_does_not_inflate_delivery_counts_of_its_own_entries(r, redis_url):
    """A round waiting for its quorum longer than claim_idle_ms must not XAUTOCLAIM its own
    open-round entries again and again: every claim bumps their delivery count, and after a
    restart the healthy entries are dead-lettered as "delivered more than max_deliveries
    times" (and the round can no longer reach its quorum)."""
    cfg = recovery_config(claim_idle_ms=100, max_deliveries=3)
    run = "self-claim"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    first = push_contribution(r, keys, cfg, L0)[0]
    FragmentStreams(r, keys).ensure_group(P)  # as the syncer does (XPENDING needs the group)

    def deliveries():
        rows = r.xpending_range(fk.frags, GROUP, "-", "+", 10)
        return int(rows[0]["times_delivered"]) if rows else 0

    t = SyncerThread(SyncerConfig(redis_url, run)).start()
    try:
        wait_for(deliveries, timeout_s=15, what="the syncer to read L0's entry")
        # the round holds L0's entry and waits for L1 (quorum 2): let it wait ~20 claim
        # periods (claim_idle_ms / 2 each), or stop early once the count passed the limit
        poll_until(lambda: deliveries() > 3, timeout_s=2.0)
        held = deliveries()
    finally:
        registry.request_stop(r, keys)
    assert t.join(r, keys) == 0
    r.delete(keys.stop)

    # restart; L1 arrives: the round must close with both entries
    second = push_contribution(r, keys, cfg, L1)[0]
    t = SyncerThread(SyncerConfig(redis_url, run, max_rounds=1)).start()
    try:
        wait_for(lambda: r.xlen(fk.rounds) or r.xlen(fk.dlq), timeout_s=15,
                 what="a round record or a dead letter")
    finally:
        if not r.xlen(fk.rounds):
            registry.request_stop(r, keys)
    t.join(r, keys)
    reasons = [e[b"dlq_reason"].decode() for e in dlq_entries(r, fk)]
    assert reasons == [], f"{reasons}; L0's entry was delivered {held} times while waiting"
    assert_merged_once(r, keys, [first, second])


@pytest.mark.parametrize("slow_pack", [False, True], ids=["", "packing outlasts the lease"])
def test_a_lease_that_expired_before_the_commit_is_retaken(r, redis_url, slow_pack):
    """Redis down longer than the lease (its client's retries hide the outage) or back from
    its AOF without the lease: the commit finds no lease. Nobody else holds it, so the syncer
    retakes it and commits the round, which is merged once — also when packing the state to
    re-commit takes longer than the lease lasts (a large fragment on a busy host): it is
    packed before the lease is retaken."""
    cfg = recovery_config(**({"lease_ms": 500} if slow_pack else {}))
    run = "expired"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    ids = [push_contribution(r, keys, cfg, who)[0] for who in (L0, L1)]
    with syncer_in_process(SyncerConfig(redis_url, run, max_rounds=1)) as (s, _):
        s.start()
        r.delete(fk.lease)
        s._next_lease = float("inf")  # no renewal before the commit: it meets the gap
        if slow_pack:
            pack = s.commits.state_blob

            def slow(core):
                time.sleep(0.8)  # > lease_ms
                return pack(core)
            s.commits.state_blob = slow
        wait_for(lambda: s.poll_once(), timeout_s=10, what="the round")
        assert slow_pack or r.get(fk.lease) == b"syncer-0"  # (500 ms: expired again by now)
    assert_merged_once(r, keys, ids)
    assert state_version(r, fk) == 1


@pytest.mark.parametrize("holder", [None, "syncer-9"], ids=["expired: retaken", "taken: stops"])
def test_a_recommit_whose_lease_expires_during_the_write(r, redis_url, holder):
    """Re-committing a round Redis lost, the write outlasts the lease (a large fragment on a
    starved host): nobody took it since, so the re-commit takes it again and writes — the
    round merged once (it raised LeaseLost, which ended the syncer with a traceback). Taken by
    another syncer meanwhile, the re-commit writes nothing and says who holds it."""
    from broker.commit import LeaseLost

    cfg = recovery_config()
    run = f"recommit-expiry-{holder}"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    ids = [push_contribution(r, keys, cfg, who)[0] for who in (L0, L1)]
    with syncer_in_process(SyncerConfig(redis_url, run, max_rounds=1)) as (s, _):
        s.start()
        wait_for(lambda: s.poll_once(), timeout_s=10, what="the round")
        r.xdel(fk.rounds, "1-0")  # Redis lost the round: resync re-commits it
        r.execute_command("XSETID", fk.rounds, "0-0")
        write, calls = s.sh.store.commit_round, []

        def outlasted(*a, **kw):
            calls.append(1)
            r.delete(fk.lease)  # expired while the pieces were written
            if holder:
                r.set(fk.lease, holder)
            return write(*a, **kw)
        s.sh.store.commit_round = outlasted
        if holder is None:
            s.commits.resync()
            assert len(calls) == 1 and r.get(fk.lease) == b"syncer-0"
        else:
            with pytest.raises(LeaseLost, match="held by 'syncer-9'"):
                s.commits.resync()
            assert not r.xlen(fk.rounds)
    if holder is None:
        assert [i for i, _ in r.xrange(fk.rounds)] == [b"1-0"]
        assert_merged_once(r, keys, ids)


def test_a_drop_inside_an_open_round_has_an_event_naming_its_push(r, redis_url):
    """A push refused while a round is open is named in that round's record by entry id only;
    its "dropped" event names the push (learner, base version, step), so the chaos ledger
    accounts for it after the entry is trimmed. A duplicate gets no event (its first copy
    accounts for the push)."""
    cfg = recovery_config()
    run = "drop-in-round"
    keys = store_run(r, run, cfg)
    first, _ = push_contribution(r, keys, cfg, L0)  # opens the round (quorum 2)
    ahead = push(r, keys, P, contribution_fields("L1", P, make_delta(cfg, P, 7), base_version=5,
                                                 step=3))
    push(r, keys, P, dict(r.xrange(keys.fragment(P).frags, first, first)[0][1]))  # a copy
    second, _ = push_contribution(r, keys, cfg, L1)
    with syncer_in_process(SyncerConfig(redis_url, run, max_rounds=1)) as (s, _):
        s.start()
        wait_for(lambda: s.poll_once() or s.frags[P].core.version == 1, timeout_s=10,
                 what="the round")
    [rec] = read_rounds(r, keys.fragment(P))
    assert {e for e, _ in rec.dropped} >= {ahead} and len(rec.included) == 2
    events = [f for _, f in r.xrange(keys.events) if f[b"kind"] == b"dropped"]
    assert [(f[b"entry"].decode(), f[b"learner"], int(f[b"base_version"]), int(f[b"step"]))
            for f in events] == [(ahead, b"L1", 5, 3)]
    assert b"ahead" in events[0][b"reason"]


# ------------------------------------------------------------ checkpoints and replayed rounds


def _rounds(r, keys, cfg, s, n, base=0, stale_from=None):
    """`n` rounds of fragment P through syncer `s` (in this process): L0 and L1 push on the
    current version, L1 `stale_from` rounds behind once it is given (an anchor older than the
    version). Returns the ids pushed."""
    ids = []
    for k in range(n):
        v = s.frags[P].core.version
        for who in (L0, L1):
            learner, seed, steps, tokens = who
            b = v if stale_from is None or learner == "L0" else max(0, v - stale_from)
            ids.append(push(r, keys, P, contribution_fields(
                learner, P, make_delta(cfg, P, 10 * (base + k) + seed), base_version=b,
                steps=steps, tokens=tokens, step=100 * (base + k) + steps)))
        wait_for(lambda v=v: s.poll_once() or s.frags[P].core.version > v, timeout_s=20,
                 what=f"round {v + 1}")
    return ids


def _same_state(a, b):
    import jax

    assert a.version == b.version
    for k in a.theta:
        np.testing.assert_array_equal(a.theta[k], b.theta[k], err_msg=k)
    for x, y in zip(jax.tree_util.tree_leaves(a.opt_state),
                    jax.tree_util.tree_leaves(b.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert set(a.history) == set(b.history)
    for v in a.history:
        for k in a.history[v]:
            np.testing.assert_array_equal(a.history[v][k], b.history[v][k])
    assert a.sent_hash == b.sent_hash
    assert a.seen == b.seen


def _sent_bases(r, fk, versions) -> list[int]:
    """The base of each ``sent:<v>`` snapshot (-1: whole)."""
    from broker import pieces
    return [codec.unpack_snapshot(pieces.read(r, fk.sent(v), max_bytes=2**30),
                                  delta_ok=True)[0].base for v in versions]


def test_a_learner_asking_about_a_push_merged_into_a_version_kept_as_a_delta_gets_the_latest(
        r, redis_url):
    """A learner whose push was merged into v2 but whose value never came asks Redis
    (`workers.island_lookup`): `sent:2` is the delta as sent, no use to it, so it rebases onto
    the latest value, whole in `global`."""
    import types

    from workers.island_lookup import MergedLookup
    from workers.learner_net import LearnerNet

    run = "asks"
    with _checkpointing(r, redis_url, run, staleness=2, every=100) as (a, keys, cfg, fk):
        _rounds(r, keys, cfg, a, 2)
        asked = registry.merged(r, keys, "L0", P)
        raw = r.hget(fk.merged, "L0")
        _rounds(r, keys, cfg, a, 1, base=2)
        latest = a.frags[P].core
    r.hset(fk.merged, "L0", raw)  # L0's push of the last round never came
    assert asked.version == 2 and _sent_bases(r, fk, (2,)) == [1]
    ctx = open_run(redis_url, run, wait_s=0)
    from broker.attest import Attestations
    net = types.SimpleNamespace(ctx=ctx, redis_down=False, inbox=None,
                                attested=Attestations(run, len(ctx.fragments), required=False))
    net.check_value = lambda h, t: LearnerNet.check_value(net, h, t)
    try:
        found = MergedLookup(ctx, "L0", net).lookup(P, (asked.base_version, asked.step))
        assert found is not None and found[0] == latest.version == 3
        for k, v in latest.sent_values.items():
            np.testing.assert_array_equal(found[1][k], v)
        assert MergedLookup(ctx, "L0", net).lookup(P, (asked.base_version, 0)) is None
    finally:
        ctx.r.close()


def _recovered(r, keys, cfg, syncer):
    from workers import recovery
    return recovery.recover(r, keys.fragment(P), cfg, syncer.sh.shapes(P),
                            syncer.sh.ctx.task.is_embedding).core


@contextlib.contextmanager
def _checkpointing(r, redis_url, run, *, staleness, every):
    """A syncer (in this process) of a run that checkpoints every `every` rounds."""
    cfg = tiny_config(sync={"quorum": 2, "grace_max_s": 0.0, "max_staleness": staleness},
                      broker={"block_ms": 50, "checkpoint_rounds": every, "checkpoint_s": 0.0})
    keys = store_run(r, run, cfg)
    with syncer_in_process(SyncerConfig(redis_url, run)) as (a, _):
        a.start()
        yield a, keys, cfg, keys.fragment(P)


def test_with_max_staleness_0_the_checkpoints_snapshot_is_whole_and_recovers(r, redis_url):
    """max_staleness 0: a checkpoint's version is the oldest snapshot kept, so it is written
    whole (as a delta nothing could rebuild it); the rounds after it are deltas."""
    with _checkpointing(r, redis_url, "s0", staleness=0, every=2) as (a, keys, cfg, fk):
        _rounds(r, keys, cfg, a, 3)
        assert state_version(r, fk) == 2 and committed_version(r, fk) == 3
        assert _sent_bases(r, fk, (2, 3)) == [-1, 2] and not r.exists(fk.sent(1))
        _same_state(a.frags[P].core, _recovered(r, keys, cfg, a))


def test_a_resync_after_redis_lost_a_checkpoint_makes_the_oldest_snapshot_whole(r, redis_url):
    """Redis comes back without the round that wrote a checkpoint (and the oldest snapshot made
    whole before it): the re-commit writes the checkpoint again, and the oldest snapshot whole
    again — the syncer's own note that it had is not what Redis holds."""
    with _checkpointing(r, redis_url, "lost-ckpt", staleness=2, every=3) as (a, keys, cfg, fk):
        _rounds(r, keys, cfg, a, 2)
        before = {k: r.dump(k) for k in (fk.state, fk.sent(0), fk.sent(1), fk.global_)}
        _rounds(r, keys, cfg, a, 1, base=2)
        assert state_version(r, fk) == 3 and _sent_bases(r, fk, (1, 2, 3)) == [-1, 1, 2]
        # an AOF missing its last second: round 3, its checkpoint and sent:1 made whole gone
        r.xdel(fk.rounds, "3-0")
        r.execute_command("XSETID", fk.rounds, "2-0")
        r.delete(fk.sent(3))
        for k, dump in before.items():
            r.restore(k, 0, dump, replace=True)
        assert state_version(r, fk) == 0 and _sent_bases(r, fk, (1,)) == [0]
        a.commits.resync()
        assert state_version(r, fk) == 3 and _sent_bases(r, fk, (1, 2, 3)) == [-1, 1, 2]
        _same_state(a.frags[P].core, _recovered(r, keys, cfg, a))


@pytest.mark.parametrize("piece_bytes", [64 * 2**20, 2048], ids=["whole", "in pieces"])
def test_a_successor_replays_the_rounds_since_the_checkpoint_bit_for_bit(r, redis_url,
                                                                         piece_bytes):
    """Checkpoints every 3 rounds: after 5 rounds Redis holds the state of v3 and the records
    of v4 and v5. A successor (the first syncer gone without a word) starts from v3, replays
    the two rounds — stale contributions included, anchored at snapshots kept for the
    checkpoint — and holds exactly the first one's state; the next round continues from it.
    `diloco export`'s reader returns the values of v5, and replay verifies the whole run.
    In pieces of 2 KiB, the states (~8 KB) and snapshots take the same path piece by piece."""
    from broker import codec
    from broker.errors import BrokerError
    from ops.cluster import global_params, published_params
    from ops.tools.replay import replay

    cfg = tiny_config(sync={"quorum": 2, "grace_max_s": 0.0, "max_staleness": 2},
                      broker={"block_ms": 50, "checkpoint_rounds": 3, "checkpoint_s": 0.0,
                              "piece_bytes": piece_bytes})
    run = "ckpt-replay"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    with syncer_in_process(SyncerConfig(redis_url, run)) as (a, _):
        a.start()
        _rounds(r, keys, cfg, a, 2)
        _rounds(r, keys, cfg, a, 3, base=2, stale_from=1)
        first = a.frags[P].core
        assert first.version == 5
        assert state_version(r, fk) == 3 and committed_version(r, fk) == 5
        # the anchors of the checkpoint's stale contributions (v1..v3) and the newer ones
        assert sorted(int(k.decode().rsplit(":", 1)[1]) for k in r.keys(fk.sent("*"))) == [
            1, 2, 3, 4, 5]
        # under the delta down link each is kept as sent (the delta against the version
        # before) but the oldest, made whole by the checkpoint that made it the oldest
        assert _sent_bases(r, fk, range(1, 6)) == [-1, 1, 2, 3, 4]
        # the first syncer is gone: its leases and its membership have run out
        r.delete(fk.lease, keys.fragment(OTHER).lease)
        r.delete(keys.member("syncer-0"))
        with syncer_in_process(SyncerConfig(redis_url, run, "syncer-1")) as (b, _):
            b.start()
            second = b.frags[P].core
            _same_state(first, second)
            ev = [f for _, f in r.xrange(keys.events) if f[b"kind"] == b"recovered"]
            assert [(f[b"checkpoint"], f[b"rounds"], f[b"version"]) for f in ev] == [
                (b"3", b"2", b"5")]
            ctx = open_run(redis_url, run, wait_s=0)
            params, versions = global_params(ctx.r, ctx.keys, ctx.cfg, ctx.fragments,
                                             ctx.shapes, ctx.task.is_embedding)
            assert versions[P] == 5
            for k, v in first.theta.items():
                np.testing.assert_array_equal(params[k], v)
            # the published value (what learners hold), from the snapshots alone
            pub, pub_versions = published_params(ctx.r, ctx.keys, ctx.cfg, ctx.fragments,
                                                 ctx.shapes)
            assert pub_versions == versions and set(pub) == set(params)
            for k, v in first.sent_values.items():
                np.testing.assert_array_equal(pub[k], v)
            # a snapshot of another fragment (or other shapes) is refused, in one line
            kept = r.dump(fk.global_)
            r.restore(fk.global_, 0, r.dump(keys.fragment(OTHER).global_), replace=True)
            with pytest.raises(BrokerError, match=f"fragment {P}'s snapshot"):
                published_params(ctx.r, ctx.keys, ctx.cfg, ctx.fragments, ctx.shapes)
            nan = {k: quant.QTensor("fp32", v.shape, np.full(v.size, np.nan, np.float32), None, 0)
                   for k, v in first.sent_values.items()}
            r.delete(fk.global_)
            r.set(fk.global_, codec.pack_snapshot(run, P, 5, nan))
            with pytest.raises(BrokerError, match="non-finite"):
                published_params(ctx.r, ctx.keys, ctx.cfg, ctx.fragments, ctx.shapes)
            r.restore(fk.global_, 0, kept, replace=True)
            ctx.r.close()
            # one more round from the recovered state: the successor's own (a checkpoint: 6-3)
            _rounds(r, keys, cfg, b, 1, base=5)
            assert state_version(r, fk) == committed_version(r, fk) == 6
            assert not r.exists(fk.sent(3)) and r.exists(fk.sent(4))
            assert _sent_bases(r, fk, (4, 5, 6)) == [-1, 4, 5]
            assert r.type(fk.state) == (b"hash" if piece_bytes < 2**20 else b"string")
    rep = replay(redis_url, run)
    assert rep["ok"], rep
    frag = next(f for f in rep["fragments"] if f["fragment"] == P)
    assert frag["rounds_checked"] == 6 and frag["state_checked"]


@pytest.mark.parametrize("down_delta", [True, False], ids=["delta down link", "sent whole"])
def test_rounds_redis_lost_are_committed_again_with_their_snapshots(r, redis_url, down_delta,
                                                                   monkeypatch):
    """Redis comes back without its last two rounds (an AOF missing its last second): the
    syncer commits them again, each snapshot byte for byte — under the delta down link packed
    again from the fp32 references its history keeps (it holds only the newest packed)."""
    from broker import pieces

    _sha = codec.sha256_hex
    cfg = tiny_config(sync={"quorum": 2, "grace_max_s": 0.0, "max_staleness": 2,
                            "down_delta": down_delta},
                      broker={"block_ms": 50, "checkpoint_rounds": 100, "checkpoint_s": 0.0})
    run = "recommit"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    with syncer_in_process(SyncerConfig(redis_url, run)) as (a, zctx):
        sub = Subscriber(zctx, [P, 9999])
        try:
            sub.connect([a.pub.endpoint])
            _probe_until_subscribed(a.pub, sub, run)
            a.start()
            hashed = []
            monkeypatch.setattr(codec, "sha256_hex", lambda *b: hashed.append(1) or _sha(*b))
            _rounds(r, keys, cfg, a, 3)
            monkeypatch.undo()
            sent = [m[0] for m in iter(lambda: sub.recv(200), None)
                    if m[0].fragment == P and m[0].version > 0]  # not the start's
        finally:
            sub.close()
        held = {v: pieces.read(r, fk.sent(v), max_bytes=2**30) for v in (1, 2, 3)}
        latest = pieces.read(r, fk.global_, max_bytes=2**30)
        assert len(a.frags[P].snapshots) == (0 if down_delta else 3)
        # a round's message and its snapshot hold the same bytes under one SHA-256: sent
        # whole, hashed once (the round record's); a delta, kept as sent, hashed for each
        heads = {v: codec.unpack_snapshot(held[v], delta_ok=True)[0] for v in held}
        assert [h.version for h in sent] == [1, 2, 3]
        assert all(h.sha256 == heads[h.version].sha256 for h in sent)
        assert all((heads[v].base, heads[v].value) == ((v - 1, h.value) if down_delta
                                                       else (-1, "")) for v, h in zip(
                                                           (1, 2, 3), sent, strict=True))
        assert len(hashed) == (6 if down_delta else 0)  # the deltas' only
        assert (latest == held[3]) != down_delta  # `global` is whole
        r.xdel(fk.rounds, "2-0", "3-0")
        r.execute_command("XSETID", fk.rounds, "1-0")
        r.delete(fk.sent(2), fk.sent(3))
        if not down_delta:
            r.copy(fk.sent(1), fk.global_, replace=True)
        a.commits.resync()
        assert [i for i, _ in r.xrange(fk.rounds)] == [b"1-0", b"2-0", b"3-0"]
        for v in (2, 3):
            assert pieces.read(r, fk.sent(v), max_bytes=2**30) == held[v], v
        assert pieces.read(r, fk.global_, max_bytes=2**30) == latest
        # the checkpoint written with them makes the oldest snapshot recovery reads whole
        # (max_staleness 2 before v3): under the delta down link the value its delta made
        v1, _ = codec.unpack_snapshot(pieces.read(r, fk.sent(1), max_bytes=2**30))
        assert v1.sha256 == (heads[1].value if down_delta else heads[1].sha256)


def test_rounds_that_cannot_be_replayed_stop_the_successor_with_the_reason(r, redis_url):
    """An entry merged after the checkpoint deleted from the stream: the successor refuses to
    start (it cannot rebuild the committed value) and names the entry and the checkpoint."""
    from workers.recovery import RecoveryError

    cfg = recovery_config(checkpoint_rounds=10, checkpoint_s=0.0)
    run = "ckpt-gone"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    with syncer_in_process(SyncerConfig(redis_url, run, fragments=(P,))) as (a, _):
        a.start()
        ids = _rounds(r, keys, cfg, a, 2)
        r.delete(fk.lease)
    r.xdel(fk.frags, ids[2])
    with syncer_in_process(SyncerConfig(redis_url, run, "syncer-1", fragments=(P,))) as (b, _):
        with pytest.raises(RecoveryError, match=f"{ids[2]}.*checkpoint at v0"):
            b.start()


def test_the_end_of_a_run_writes_a_checkpoint(r, redis_url):
    """A syncer that stops (max_rounds here, the run's end alike) checkpoints every fragment
    whose state is behind, so nothing is replayed afterwards."""
    cfg = recovery_config()  # checkpoint_rounds 20: no round of this run is one
    run = "ckpt-end"
    keys = store_run(r, run, cfg)
    fk = keys.fragment(P)
    ids = [push_contribution(r, keys, cfg, who)[0] for who in (L0, L1)]
    assert SyncerThread(SyncerConfig(redis_url, run, max_rounds=1)).start().join(r, keys) == 0
    assert_merged_once(r, keys, ids)
    assert state_version(r, fk) == 1
