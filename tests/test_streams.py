"""Broker level, against a real redis-server: fragment streams, the fenced round commit, dead
letters, claiming, leases, the run registry and the client's timeout check."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import redis
from helpers_broker import (
    contribution_fields,
    make_delta,
    pending_by_consumer,
    store_run,
    tiny_config,
    wait_for,
    xpending_count,
)

from broker import codec, registry
from broker.commit import LeaseLost
from broker.connection import connect
from broker.entries import parse_entry
from broker.errors import BrokerError, ConfigMismatch
from broker.keys import GROUP, RunKeys
from broker.records import Heartbeat, Merged, SyncerInfo
from broker.streams import FragmentStreams
from pipeline import config as cfgmod
from pipeline.contribution import MergeRecord, PushHeader

RUN = "streams"
P = 1


@pytest.fixture
def r(redis_url):
    client = connect(redis_url)
    yield client
    client.close()


@pytest.fixture
def cfg():
    return tiny_config()


@pytest.fixture
def keys(r, cfg):
    return store_run(r, RUN, cfg)


@pytest.fixture
def fs(r, keys):
    s = FragmentStreams(r, keys)
    for p in range(2):
        s.ensure_group(p)
    return s


def fields_of(cfg, learner="L0", p=P, seed=0, **kw):
    return contribution_fields(learner, p, make_delta(cfg, p, seed), **kw)


# ------------------------------------------------------------------------- push and read


def test_entries_are_plain_fields(r, keys, fs, cfg):
    sent = fields_of(cfg, "L0", base_version=3, step=40, steps=10, tokens=2560)
    entry_id = fs.push(P, sent)
    ((rid, got),) = r.xrange(keys.fragment(P).frags, count=1)
    assert rid.decode() == entry_id
    for name in ("learner", "fragment", "base_version", "step", "steps", "tokens", "codec",
                 "nbytes", "sha256", "payload", "seconds", "final"):
        assert name.encode() in got, name
    assert got[b"learner"] == b"L0"
    assert got[b"fragment"] == str(P).encode()
    assert (got[b"base_version"], got[b"step"], got[b"steps"], got[b"tokens"]) == (
        b"3", b"40", b"10", b"2560")
    assert got[b"codec"] == b"fp32"
    assert int(got[b"nbytes"]) == len(got[b"payload"]) == len(sent["payload"])
    assert got[b"sha256"].decode() == codec.sha256_hex(got[b"payload"])
    assert got[b"final"] == b"0" and float(got[b"seconds"]) == 1.5
    meta, tensors = parse_entry(got)
    assert meta == PushHeader("L0", P, 3, 40, 10, 2560) and meta.seconds == 1.5
    delta = make_delta(cfg, P, 0)
    assert set(tensors) == set(delta)
    for n, v in delta.items():
        np.testing.assert_array_equal(np.asarray(tensors[n].data).reshape(v.shape), v)


def test_an_entry_of_the_largest_id_is_undone_and_pushes_go_in_again(r, keys, fs, cfg):
    """A learner credential may XADD with an explicit id; the largest one leaves a stream
    that takes no `XADD *`. The fragment's syncer dead-letters it and sets the stream and its
    group back; what was pushed before is kept and nothing is delivered twice."""
    from broker.streams import StreamExhausted

    assert fs.reopen_exhausted(1) is None  # no stream yet
    a = fs.push(1, fields_of(cfg, "L0"))
    biggest = f"{2**64 - 1}-{2**64 - 1}"
    r.xadd(keys.fragment(1).frags, fields_of(cfg, "L9"), id=biggest)
    assert [e.entry_id for e in fs.read_new("s", [1], count=10, block_ms=10)] == [a, biggest]
    with pytest.raises(StreamExhausted, match="fragment 1: its stream takes no new entry"):
        fs.push(1, fields_of(cfg, "L1"))
    assert fs.reopen_exhausted(0) is None and fs.reopen_exhausted(1) == a
    assert fs.reopen_exhausted(1) is None  # once
    dead = r.xrange(keys.fragment(1).dlq)
    assert [f[b"dlq_source_id"].decode() for _, f in dead] == [biggest]
    assert b"largest stream id" in dead[0][1][b"dlq_reason"]
    b = fs.push(1, fields_of(cfg, "L1"))
    assert [e.entry_id for e in fs.read_new("s", [1], count=10, block_ms=10)] == [b]
    assert [as_id for as_id, _ in r.xrange(keys.fragment(1).frags)] == [a.encode(), b.encode()]


def test_read_new_consumer_group_basics(r, keys, fs, cfg):
    assert fs.read_new("c1", [0, 1], count=10, block_ms=10) == []
    a = fs.push(1, fields_of(cfg, "L0"))
    b = fs.push(0, fields_of(cfg, "L1", p=0))
    c = fs.push(1, fields_of(cfg, "L1"))
    got = fs.read_new("c1", [0, 1], count=10, block_ms=10)
    assert sorted((e.fragment, e.entry_id) for e in got) == sorted([(1, a), (0, b), (1, c)])
    assert all(isinstance(e.entry_id, str) and e.fields[b"payload"] for e in got)
    # new entries go to one consumer of the group only
    assert fs.read_new("c2", [0, 1], count=10, block_ms=10) == []
    assert fs.read_new("c1", [0, 1], count=10, block_ms=10) == []
    assert xpending_count(r, keys.fragment(1)) == 2
    assert xpending_count(r, keys.fragment(0)) == 1
    # count bounds a read; the rest comes with the next one
    d = fs.push(1, fields_of(cfg, "L0", step=20))
    e = fs.push(1, fields_of(cfg, "L1", step=20))
    first = fs.read_new("c2", [1], count=1, block_ms=10)
    second = fs.read_new("c2", [1], count=1, block_ms=10)
    assert [x.entry_id for x in first + second] == [d, e]
    fs.ack_only(1, [a, c, d])
    fs.ack_only(1, [])
    assert xpending_count(r, keys.fragment(1)) == 1
    # ensure_group is idempotent (BUSYGROUP swallowed)
    fs.ensure_group(1)
    assert xpending_count(r, keys.fragment(1)) == 1


def test_ensure_group_reads_entries_pushed_before_the_group(r, cfg):
    keys = store_run(r, "early", cfg)
    s = FragmentStreams(r, keys)
    a = s.push(0, fields_of(cfg, "L0", p=0))
    s.ensure_group(0)  # group created at id 0: the earlier entry is delivered
    assert [e.entry_id for e in s.read_new("c", [0], count=10, block_ms=10)] == [a]


# ------------------------------------------------------------------------------ commit


def _commit(fs, owner, ids, version=1, drop=(), checkpoint=True, merged=None):
    return fs.state.commit_round(P, owner, state=b"STATE%d" % version if checkpoint else None,
                           snapshot=b"SNAP%d" % version, version=version,
                           record={"version": version, "included": [[i, "L"] for i in ids],
                                   "reason": "test", "t": 1.5},
                           ack_ids=ids, drop_sent_versions=drop, merged=merged)


def test_commit_round_is_fenced_by_the_lease(r, keys, fs, cfg):
    fk = keys.fragment(P)
    ids = [fs.push(P, fields_of(cfg, n)) for n in ("L0", "L1")]
    fs.read_new("syncer-0", [P], count=10, block_ms=10)
    r.set(fk.state, b"OLD")
    r.set(fk.global_, b"OLDSNAP")
    before = {k: r.get(k) for k in (fk.state, fk.global_, fk.sent(1))}

    merged = {"L0": Merged(0, 5, 1).to_json()}
    # nobody holds the lease
    with pytest.raises(LeaseLost):
        _commit(fs, "syncer-0", ids, merged=merged)
    # another syncer holds it
    assert fs.state.acquire_lease(P, "syncer-1", 10_000)
    with pytest.raises(LeaseLost):
        _commit(fs, "syncer-0", ids, merged=merged)
    assert {k: r.get(k) for k in before} == before
    assert r.xlen(fk.rounds) == 0
    assert not r.exists(fk.merged)  # the merge records go with the round, or not at all
    assert xpending_count(r, fk) == 2
    assert r.get(fk.lease) == b"syncer-1"


def test_commit_round_writes_everything_and_acks(r, keys, fs, cfg):
    fk = keys.fragment(P)
    ids = [fs.push(P, fields_of(cfg, n)) for n in ("L0", "L1", "L0")]
    ids[2:] = []  # the third entry stays pending
    fs.read_new("syncer-0", [P], count=10, block_ms=10)
    assert xpending_count(r, fk) == 3
    r.set(fk.sent(0), b"SNAP0")
    assert fs.state.acquire_lease(P, "syncer-0", 10_000)

    r.hset(fk.merged, "L2", Merged(0, 3, 0).to_json())  # an earlier round's record stays
    rid = _commit(fs, "syncer-0", ids, version=1, drop=[0],
                  merged={"L0": Merged(0, 5, 1).to_json(), "L1": Merged(0, 4, 1).to_json()})
    assert r.get(fk.state) == b"STATE1"
    # the merge records, in the round's transaction, read back through the registry
    assert registry.merged(r, keys, "L0", P) == MergeRecord(0, 5, 1)
    assert registry.merged(r, keys, "L1", P) == MergeRecord(0, 4, 1)
    assert registry.merged(r, keys, "L2", P) == MergeRecord(0, 3, 0)
    assert registry.merged(r, keys, "L0", P + 1) is None  # per fragment
    assert r.get(fk.global_) == b"SNAP1"
    assert r.get(fk.sent(1)) == b"SNAP1"
    assert r.get(fk.sent(0)) is None  # drop_sent_versions
    ((got_id, rec),) = r.xrange(fk.rounds)
    assert got_id.decode() == rid
    assert json.loads(rec[b"included"]) == [[i, "L"] for i in ids]
    assert rec[b"version"] == b"1" and rec[b"reason"] == b"test" and float(rec[b"t"]) == 1.5
    assert xpending_count(r, fk) == 1
    assert fs.state.load_state(P, 100) == b"STATE1" and fs.read_global(P, 100) == b"SNAP1"
    assert fs.state.load_sent(P, [0, 1, 2], 100) == {1: b"SNAP1"}

    # a commit without acks returns the record id too (the last reply, not an XACK count)
    rid2 = fs.state.commit_round(P, "syncer-0", state=b"STATE2", snapshot=b"SNAP2", version=2,
                           record={"version": 2}, ack_ids=[], extra_sent={7: b"X"})
    assert [x.decode() for x, _ in r.xrange(fk.rounds)] == [rid, rid2]
    assert r.get(fk.sent(7)) == b"X" and r.get(fk.sent(1)) == b"SNAP1"
    assert xpending_count(r, fk) == 1


def test_a_round_between_checkpoints_leaves_the_state_and_keeps_old_snapshots(r, keys, fs, cfg):
    """Without a checkpoint a round writes its record, acks and published value only; the
    checkpoint is written alone at the end (`checkpoint`), and both drop what they are told."""
    fk = keys.fragment(P)
    ids = [fs.push(P, fields_of(cfg, "L0"))]
    fs.read_new("syncer-0", [P], count=10, block_ms=10)
    r.set(fk.state, b"STATE0")
    r.set(fk.sent(0), b"SNAP0")
    assert fs.state.acquire_lease(P, "syncer-0", 10_000)
    _commit(fs, "syncer-0", ids, version=1, checkpoint=False)
    assert r.get(fk.state) == b"STATE0"  # the checkpoint stays at version 0
    assert (r.get(fk.global_), r.get(fk.sent(1)), r.get(fk.sent(0))) == (b"SNAP1", b"SNAP1",
                                                                           b"SNAP0")
    assert r.xlen(fk.rounds) == 1 and xpending_count(r, fk) == 0
    fs.state.checkpoint(P, "syncer-0", state=b"STATE1", version=1, drop_sent_versions=[0, 1])
    assert r.get(fk.state) == b"STATE1"
    assert r.get(fk.sent(0)) is None and r.get(fk.sent(1)) == b"SNAP1"  # never its own
    assert fs.state.acquire_lease(P, "syncer-1", 10) is False
    r.set(fk.lease, b"syncer-1")
    with pytest.raises(LeaseLost):
        fs.state.checkpoint(P, "syncer-0", state=b"STATE9", version=1)
    assert r.get(fk.state) == b"STATE1"


def test_init_fragment_once_and_fenced(r, keys, fs):
    fk = keys.fragment(P)
    with pytest.raises(LeaseLost):
        fs.state.init_fragment(P, "syncer-0", state=b"S0", snapshot=b"G0")
    assert r.get(fk.state) is None
    assert fs.state.acquire_lease(P, "syncer-0", 10_000)
    assert fs.state.init_fragment(P, "syncer-0", state=b"S0", snapshot=b"G0") is True
    assert fs.state.init_fragment(P, "syncer-0", state=b"S1", snapshot=b"G1") is False
    assert (r.get(fk.state), r.get(fk.global_), r.get(fk.sent(0))) == (b"S0", b"G0", b"G0")
    assert fs.read_global(P, 100) == b"G0"


# ------------------------------------------------------------------------- dead letters


def test_dead_letter_moves_and_acks(r, keys, fs, cfg):
    fk = keys.fragment(P)
    sent = fields_of(cfg, "L0")
    entry_id = fs.push(P, sent)
    other = fs.push(P, fields_of(cfg, "L1"))
    entries = fs.read_new("syncer-0", [P], count=10, block_ms=10)
    bad = next(e for e in entries if e.entry_id == entry_id)
    fs.dead_letter(P, bad, "malformed entry: test")
    ((_, dl),) = r.xrange(fk.dlq)
    assert dl[b"dlq_reason"] == b"malformed entry: test"
    assert dl[b"dlq_source_id"] == entry_id.encode()
    for k, v in sent.items():
        assert dl[k.encode()] == (v if isinstance(v, bytes) else str(v).encode()), k
    assert xpending_count(r, fk) == 1
    assert [x["message_id"].decode() for x in r.xpending_range(fk.frags, GROUP, "-", "+", 10)
            ] == [other]
    # the original entry stays in the fragment stream (only acknowledged)
    assert r.xlen(fk.frags) == 2


# ---------------------------------------------------------------- claiming and pending


def test_read_pending_is_per_consumer(r, keys, fs, cfg):
    a, b = (fs.push(P, fields_of(cfg, n)) for n in ("L0", "L1"))
    fs.read_new("A", [P], count=2, block_ms=10)
    c = fs.push(P, fields_of(cfg, "L0", step=20))
    fs.read_new("B", [P], count=10, block_ms=10)
    fs.push(P, fields_of(cfg, "L1", step=20))  # never delivered: not pending for anyone
    assert [e.entry_id for e in fs.read_pending("A", P)] == [a, b]
    assert [e.entry_id for e in fs.read_pending("B", P)] == [c]
    assert fs.read_pending("C", P) == []
    assert all(e.fragment == P and e.fields[b"payload"] for e in fs.read_pending("A", P))
    fs.ack_only(P, [a])
    assert [e.entry_id for e in fs.read_pending("A", P)] == [b]
    # small pages walk the whole pending list
    assert [e.entry_id for e in fs.read_pending("A", P, count=1)] == [b]
    fs.read_new("A", [P], count=10, block_ms=10)
    assert len(fs.read_pending("A", P, count=1)) == 2


def test_autoclaim_takes_idle_entries_of_another_consumer(r, keys, fs, cfg):
    fk = keys.fragment(P)
    ids = [fs.push(P, fields_of(cfg, n)) for n in ("L0", "L1")]
    fs.read_new("dead", [P], count=10, block_ms=10)
    assert fs.delivery_counts(P, ids) == {i: 1 for i in ids}
    assert fs.autoclaim("alive", P, min_idle_ms=60_000) == ([], [])
    claimed = wait_for(lambda: fs.autoclaim("alive", P, min_idle_ms=50)[0], timeout_s=5,
                       what="entries idle past 50 ms")
    assert [e.entry_id for e in claimed] == ids
    assert all(e.fragment == P and e.fields[b"learner"] for e in claimed)
    assert fs.read_pending("dead", P) == []
    assert [e.entry_id for e in fs.read_pending("alive", P)] == ids
    assert pending_by_consumer(r, fk) == {"dead": 0, "alive": 2}
    counts = fs.delivery_counts(P, ids)
    assert set(counts) == set(ids) and all(n >= 2 for n in counts.values())
    assert fs.delivery_counts(P, []) == {}


def test_autoclaim_pages_through_many_entries(r, keys, fs, cfg):
    small = {"learner": "L0", "payload": b"x"}
    ids = [fs.push(P, small) for _ in range(7)]
    fs.read_new("dead", [P], count=100, block_ms=10)
    claimed = wait_for(lambda: fs.autoclaim("alive", P, min_idle_ms=20, count=3)[0],
                       timeout_s=5,
                       what="idle entries")
    assert [e.entry_id for e in claimed] == ids


# ------------------------------------------------------------------------------- leases


def test_lease_is_exclusive_renewable_and_released_by_owner_only(r, keys, fs):
    key = keys.fragment(P).lease
    assert fs.state.acquire_lease(P, "A", 5_000)
    assert not fs.state.acquire_lease(P, "B", 5_000)
    r.pexpire(key, 1_000)
    assert fs.state.acquire_lease(P, "A", 60_000)  # the owner renews
    assert r.pttl(key) > 5_000
    fs.state.release_lease(P, "B")  # not the owner: no effect
    assert r.get(key) == b"A"
    fs.state.release_lease(P, "A")
    assert r.get(key) is None
    assert fs.state.acquire_lease(P, "B", 5_000)
    assert not fs.state.acquire_lease(P, "A", 5_000)
    # other fragments have their own leases
    assert fs.state.acquire_lease(0, "A", 5_000)


def test_lease_expires(r, keys, fs):
    assert fs.state.acquire_lease(P, "A", 150)
    assert not fs.state.acquire_lease(P, "B", 5_000)
    wait_for(lambda: fs.state.acquire_lease(P, "B", 5_000), timeout_s=5, what="the lease to expire")
    assert r.get(keys.fragment(P).lease) == b"B"


# ------------------------------------------------------------------------------ registry


def test_store_config_refuses_another_hash(r, cfg):
    keys = RunKeys("reg")
    text, h = cfgmod.dumps_toml(cfg), cfg.run_hash()
    assert registry.store_config(r, keys, text, h) is True
    assert registry.store_config(r, keys, text, h) is False
    assert registry.load_config(r, keys) == (text, h)
    other = tiny_config(steps=20)
    assert other.run_hash() != h
    with pytest.raises(ConfigMismatch) as err:
        registry.store_config(r, keys, cfgmod.dumps_toml(other), other.run_hash())
    assert h in str(err.value) and other.run_hash() in str(err.value)
    assert registry.load_config(r, keys) == (text, h)  # unchanged
    with pytest.raises(ConfigMismatch):
        registry.check_config(r, keys, other.run_hash())
    registry.check_config(r, keys, h)


def test_load_config_of_an_unknown_run_names_it(r):
    with pytest.raises(BrokerError, match="nothing-here"):
        registry.load_config(r, RunKeys("nothing-here"), wait_s=0.0)


def test_live_learners_follow_heartbeat_ttl(r, keys):
    assert registry.live_learners(r, keys) == frozenset()
    registry.heartbeat(r, keys, "L0", Heartbeat(step=1), ttl_s=0.2)
    registry.heartbeat(r, keys, "L1", Heartbeat(step=1), ttl_s=60.0)
    assert registry.live_learners(r, keys) == {"L0", "L1"}
    wait_for(lambda: registry.live_learners(r, keys) == {"L1"}, timeout_s=5,
             what="L0's heartbeat to expire")
    assert set(registry.learner_records(r, keys)) == {"L0", "L1"}  # records stay
    registry.heartbeat(r, keys, "L0", Heartbeat(step=2), ttl_s=60.0)  # rejoin
    assert registry.live_learners(r, keys) == {"L0", "L1"}
    assert registry.learner_records(r, keys)["L0"].step == 2
    registry.leave(r, keys, "L1")
    assert registry.live_learners(r, keys) == {"L0"}


def test_syncer_endpoints_and_stop(r, keys):
    registry.register_syncer(r, keys, "s0", SyncerInfo(endpoint="tcp://127.0.0.1:5000"))
    registry.register_syncer(r, keys, "s1", SyncerInfo(endpoint="tcp://127.0.0.1:5001"))
    registry.register_syncer(r, keys, "s1", SyncerInfo(endpoint="tcp://127.0.0.1:5002"))
    assert registry.endpoints(r, keys) == ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5002"]
    assert not registry.stop_requested(r, keys)
    registry.request_stop(r, keys)
    assert registry.stop_requested(r, keys)


# ---------------------------------------------------------------------------- connection


@pytest.mark.parametrize("timeout_s, block_ms", [(1.0, 1000), (1.0, 5000), (1.0, 500)])
def test_connect_refuses_timeout_not_above_block(redis_url, timeout_s, block_ms):
    with pytest.raises(ValueError, match="socket_timeout_s.*block_ms"):
        connect(redis_url, socket_timeout_s=timeout_s, block_ms=block_ms)


def test_connect_accepts_a_timeout_above_block_and_blocks(redis_url, keys):
    client = connect(redis_url, socket_timeout_s=1.0, block_ms=400)
    try:
        s = FragmentStreams(client, keys)
        s.ensure_group(P)
        # an idle blocking read returns empty instead of raising a socket timeout
        assert s.read_new("c", [P], count=1, block_ms=400) == []
    finally:
        client.close()


def test_connect_is_binary_safe(r):
    r.set("k", b"\x00\xff")
    assert r.get("k") == b"\x00\xff"
    assert isinstance(r, redis.Redis)


# --------------------------------------------------- entry ids, trimmed pending entries


def test_delivery_counts_compares_entry_ids_numerically(r, keys, fs):
    """Entry ids are ``<ms>-<seq>``: "5-10" sorts before "5-9" as text, after it as an id."""
    key = keys.fragment(P).frags
    ids = [r.xadd(key, {"learner": "L0"}, id=f"5-{i}").decode() for i in range(12)]
    fs.read_new("A", [P], count=100, block_ms=10)
    assert fs.delivery_counts(P, ["5-9", "5-10"]) == {"5-9": 1, "5-10": 1}
    assert fs.delivery_counts(P, ids) == {i: 1 for i in ids}


def test_read_pending_walks_past_trimmed_entries(r, keys, fs, cfg):
    """Pending entries whose stream entries were trimmed come back without fields; they must
    not end the walk through the rest of the consumer's pending list."""
    key = keys.fragment(P).frags
    ids = [fs.push(P, fields_of(cfg, "L0", step=10 * (i + 1))) for i in range(5)]
    fs.read_new("A", [P], count=10, block_ms=10)
    r.xdel(key, ids[0], ids[1])  # trimmed (retention) while still pending
    for count in (1000, 2):
        pending = fs.read_pending("A", P, count=count)
        assert [e.entry_id for e in pending if e.fields] == ids[2:]
        # the vanished ones are returned without fields so the syncer can account for them
        assert [e.entry_id for e in pending if not e.fields] == ids[:2]


def test_autoclaim_walks_past_trimmed_entries(r, keys, fs, cfg):
    key = keys.fragment(P).frags
    ids = [fs.push(P, fields_of(cfg, "L0", step=10 * (i + 1))) for i in range(5)]
    fs.read_new("dead", [P], count=10, block_ms=10)
    r.xdel(key, ids[0], ids[1])
    wait_for(lambda: all(row["time_since_delivered"] >= 30 for row in
                         r.xpending_range(key, GROUP, "-", "+", 10)),
             timeout_s=5, what="entries idle past 30 ms")
    claimed, deleted = fs.autoclaim("alive", P, min_idle_ms=30, count=2)
    assert [e.entry_id for e in claimed] == ids[2:]
    assert deleted == ids[:2]  # reported so the syncer can account for them


def test_leases_are_kept_while_a_long_round_is_computed_for_a_bounded_time(r, keys, fs):
    """`leases_kept`: a block that outlasts the lease keeps it (a large fragment's close), and
    one that outlasts its limit loses it, as a stalled syncer does; another syncer's lease is
    never extended."""
    fk = keys.fragment(P)
    assert fs.state.acquire_lease(P, "syncer-0", 600)
    with fs.state.leases_kept(limit_s=10.0):
        time.sleep(1.5)  # two and a half lease periods
        assert r.get(fk.lease) == b"syncer-0"
    with fs.state.leases_kept(limit_s=0.3):
        time.sleep(1.5)  # the limit, then a lease period and more without renewal
        assert r.get(fk.lease) is None
    assert r.set(fk.lease, b"syncer-1", px=600)  # taken by another syncer meanwhile
    with fs.state.leases_kept(limit_s=10.0):
        time.sleep(1.0)
    assert r.get(fk.lease) is None  # its lease ran out: never extended for it

