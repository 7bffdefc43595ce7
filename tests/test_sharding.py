"""Syncers started without a fragment list share the fragments through leases in Redis
(`workers.syncer_ownership.Ownership.rebalance`): balanced by size, handed over when one
joins, taken over when one dies (its entries read and never committed claimed by the new
owner), given back when it returns — each contribution merged exactly once. A real
redis-server; the syncers are objects in this process, driven one poll at a time so every
step is deterministic."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import zmq
from helpers_broker import (
    contribution_fields,
    make_delta,
    push,
    rounds_records,
    store_run,
    tiny_config,
    xpending_count,
)

from broker import registry
from broker.connection import connect
from ops.tools import status
from ops.tools.replay import replay
from pipeline.fragments import assign
from workers.common import open_run
from workers.syncer import Syncer, SyncerConfig

N_FRAGS = 4


@pytest.fixture
def r(redis_url):
    client = connect(redis_url)
    yield client
    client.close()


@contextlib.contextmanager
def syncers():
    """Make in-process syncers (`make(url, run, id)`); every one closed after."""
    made = []

    def make(url, run, sid):
        ctx = open_run(url, run, wait_s=5.0)
        zctx = zmq.Context()
        s = Syncer(SyncerConfig(url, run, sid), ctx, zctx)
        made.append((s, zctx))
        return s

    try:
        yield make
    finally:
        for s, zctx in made:
            s.pub.close()
            s.ctx.r.close()
            zctx.term()


def gone(r, keys, s: Syncer) -> None:
    """Syncer `s` died: its leases and its membership ran out (fast-forwarded)."""
    for p in s.owned:
        r.delete(keys.fragment(p).lease)
    r.delete(keys.member(s.cfg.syncer_id))


def push_round(r, keys, cfg, rnd: int, versions: dict[int, int]) -> list[tuple[int, str]]:
    out = []
    for p in range(N_FRAGS):
        for learner, seed in (("L0", 0), ("L1", 1)):
            out.append((p, push(r, keys, p, contribution_fields(
                learner, p, make_delta(cfg, p, 100 * rnd + seed), base_version=versions[p],
                step=10 * rnd + 10, steps=10, tokens=2560))))
    return out


def poll_until(ss: list[Syncer], done, limit: int = 400) -> None:
    for _ in range(limit):
        for s in ss:
            s.poll_once()
        if done():
            return
    raise AssertionError("syncers did not get there")


def versions(ss: list[Syncer]) -> dict[int, int]:
    return {p: f.core.version for s in ss for p, f in s.frags.items()}


def owners(r, keys) -> dict[int, str | None]:
    return {p: (r.get(keys.fragment(p).lease) or b"").decode() or None for p in range(N_FRAGS)}


def merged_once(r, keys) -> Counter:
    """Entry → how many round records merged it (every fragment)."""
    seen: Counter = Counter()
    for p in range(N_FRAGS):
        for rec in rounds_records(r, keys.fragment(p)):
            seen.update((p, row[0]) for row in rec["included"])
    return seen


def test_syncers_share_hand_over_take_over_and_give_back(r, redis_url):
    cfg = tiny_config(sync={"fragments": N_FRAGS, "quorum": 2, "grace_max_s": 0.0},
                      broker={"block_ms": 20, "checkpoint_rounds": 2, "checkpoint_s": 0.0})
    run = "shard"
    keys = store_run(r, run, cfg)
    with syncers() as make:
        a = make(redis_url, run, "syncer-a")
        a.start()
        assert a.owned == list(range(N_FRAGS))  # alone: everything
        b = make(redis_url, run, "syncer-b")
        b.start()
        assert b.owned == [] and b.phase == "standing by"  # a holds every lease yet
        a.owner.rebalance(force=True)  # a sees b: hands over b's share (its rounds are empty)
        b.owner.rebalance(force=True)
        want = assign(a.sh.sizes, ["syncer-a", "syncer-b"])
        assert (a.owned, b.owned) == (want["syncer-a"], want["syncer-b"])
        assert a.owned and b.owned
        assert owners(r, keys) == {p: s for s, ps in want.items() for p in ps}
        assert registry.syncer_members(r, keys) == ["syncer-a", "syncer-b"]
        st = status.collect(redis_url, run)  # who owns what, as `diloco status` shows it
        assert st["syncer_members"] == ["syncer-a", "syncer-b"]
        assert {n: rec["fragments"] for n, rec in st["syncers"].items()} == want
        assert {f["fragment"]: f["lease"] for f in st["fragments"]} == owners(r, keys)

        # a round of every fragment, each closed by its owner
        push_round(r, keys, cfg, 0, versions([a, b]))
        poll_until([a, b], lambda: set(versions([a, b]).values()) == {1})
        for p in range(N_FRAGS):
            (rec,) = rounds_records(r, keys.fragment(p))
            assert rec["syncer"] == owners(r, keys)[p]

        # b reads the next round's entries of its fragments and dies before committing them
        ids = push_round(r, keys, cfg, 1, versions([a, b]))
        got = b.streams.read_new("syncer-b", b.owned, count=100, block_ms=20)
        assert {e.fragment for e in got} == set(b.owned)
        gone(r, keys, b)
        a.owner.rebalance(force=True)  # a takes b's fragments and claims b's pending entries
        assert a.owned == list(range(N_FRAGS))
        poll_until([a], lambda: set(versions([a]).values()) == {2})
        assert all(xpending_count(r, keys.fragment(p)) == 0 for p in range(N_FRAGS))
        counts = merged_once(r, keys)
        assert all(counts[(p, i)] == 1 for p, i in ids)

        # b comes back under its id: a gives its share back, b continues from a's commits
        b2 = make(redis_url, run, "syncer-b")
        b2.start()
        a.owner.rebalance(force=True)
        b2.owner.rebalance(force=True)
        assert (a.owned, b2.owned) == (want["syncer-a"], want["syncer-b"])
        assert {p: b2.frags[p].core.version for p in b2.owned} == {p: 2 for p in b2.owned}
        push_round(r, keys, cfg, 2, versions([a, b2]))
        poll_until([a, b2], lambda: set(versions([a, b2]).values()) == {3})
        counts = merged_once(r, keys)
        assert counts and max(counts.values()) == 1  # nothing merged twice
        events = [f[b"kind"] for _, f in r.xrange(keys.events)]
        assert b"rebalance" in events
    rep = replay(redis_url, run)
    assert rep["ok"], rep
    assert rep["rounds_checked"] == 3 * N_FRAGS


def test_a_syncer_with_a_fragment_list_stands_by_as_before(r, redis_url):
    """`--fragments` keeps its meaning: exactly those, standing by while another holds them;
    it takes no part in the sharing."""
    cfg = tiny_config(sync={"fragments": N_FRAGS, "quorum": 2, "grace_max_s": 0.0},
                      broker={"block_ms": 20})
    run = "fixed"
    store_run(r, run, cfg)
    ctx = open_run(redis_url, run, wait_s=5.0)
    zctx = zmq.Context()
    s = Syncer(SyncerConfig(redis_url, run, "syncer-f", fragments=(1, 3)), ctx, zctx)
    try:
        s.start()
        assert s.owned == [1, 3] and not s.auto
        assert registry.syncer_members(r, ctx.keys) == []
    finally:
        s.pub.close()
        for p in s.owned:
            s.streams.state.release_lease(p, "syncer-f")
        ctx.r.close()
        zctx.term()


def test_a_hand_over_mid_round_loses_none_of_the_round_and_a_lost_lease_drops_quietly(
        r, redis_url):
    """A fragment handed over while its round is open: the checkpoint written at the hand-over
    holds the dedupe keys of the last close only, so the new owner merges the open round's
    entries it claims (they are not duplicates). And a sharing syncer whose commit meets a
    lease another syncer holds lets the fragment go instead of stopping."""
    cfg = tiny_config(sync={"fragments": N_FRAGS, "quorum": 2, "grace_max_s": 0.0},
                      broker={"block_ms": 20, "checkpoint_s": 0.0})
    run = "midround"
    keys = store_run(r, run, cfg)
    p = 1
    with syncers() as make:
        a = make(redis_url, run, "syncer-a")
        a.start()
        push_round(r, keys, cfg, 0, versions([a]))
        poll_until([a], lambda: set(versions([a]).values()) == {1})
        # L0's next push opens a round; L1's has not come yet
        first = push(r, keys, p, contribution_fields("L0", p, make_delta(cfg, p, 7),
                                                     base_version=1, step=50))
        poll_until([a], lambda: bool(a.frags[p].core.contributors))
        a.owner.hand_over(p)  # the hand-over: a checkpoint at v1, then the lease
        assert p not in a.owned and r.get(keys.fragment(p).lease) is None
        b = make(redis_url, run, "syncer-b")
        b._next_lease = float("inf")  # driven by hand here: no lease renewal, no rebalance
        b.streams.state.acquire_lease(p, "syncer-b", 10_000)
        b.owner.adopt([p])  # claims L0's entry from a and merges it
        assert b.frags[p].core.contributors == frozenset({"L0"})
        second = push(r, keys, p, contribution_fields("L1", p, make_delta(cfg, p, 8),
                                                      base_version=1, step=50))
        poll_until([b], lambda: b.frags[p].core.version == 2)
        rec = rounds_records(r, keys.fragment(p))[-1]
        assert sorted(row[0] for row in rec["included"]) == sorted([first, second])
        assert xpending_count(r, keys.fragment(p)) == 0
        # a commit that meets another syncer's lease: b lets the fragment go, and lives on
        push(r, keys, p, contribution_fields("L0", p, make_delta(cfg, p, 9), base_version=2,
                                             step=60))
        poll_until([b], lambda: bool(b.frags[p].core.contributors))
        r.set(keys.fragment(p).lease, b"syncer-z")
        push(r, keys, p, contribution_fields("L1", p, make_delta(cfg, p, 10), base_version=2,
                                             step=60))
        poll_until([b], lambda: p not in b.frags)
        assert r.xlen(keys.fragment(p).rounds) == 2  # nothing committed without the lease
    rep = replay(redis_url, run)
    assert rep["ok"], rep


def test_a_fragment_taken_over_between_two_closes_of_the_final_rounds_finishes_later(
        r, redis_url):
    """The leases are renewed between two fragments' closes (a long close outlasts a lease):
    a renewal there that takes over a dead syncer's fragments while every learner has made its
    final pushes must not end the poll in a KeyError (it did: the syncers of a loaded chaos
    run died at their end); the fragments taken over finish at a later poll, each once."""
    import time

    from broker.records import FinalPushes

    cfg = tiny_config(sync={"fragments": N_FRAGS, "quorum": 2, "grace_max_s": 0.0},
                      broker={"block_ms": 20, "checkpoint_rounds": 2, "checkpoint_s": 0.0})
    run = "shard-final"
    keys = store_run(r, run, cfg)
    with syncers() as make:
        a, b = make(redis_url, run, "syncer-a"), make(redis_url, run, "syncer-b")
        a.start()
        b.start()
        a.owner.rebalance(force=True)
        b.owner.rebalance(force=True)
        assert a.owned and b.owned
        taken = list(b.owned)
        for p in range(N_FRAGS):
            for learner, seed in (("L0", 0), ("L1", 1)):
                push(r, keys, p, contribution_fields(
                    learner, p, make_delta(cfg, p, seed), final=True))
        for learner in ("L0", "L1"):
            registry.mark_final_pushes(r, keys, learner, FinalPushes(
                final=list(range(N_FRAGS)), steps=10, tokens=2560))
        gone(r, keys, b)
        close = a.rounds.maybe_close
        calls = []

        def close_then_lease_due(p, expected):
            calls.append(p)
            if len(calls) == 1:
                a._next_lease = 0.0  # this close outlasted a third of the lease period
            return close(p, expected)

        a.rounds.maybe_close = close_then_lease_due
        a._next_lease = time.monotonic() + 3600  # not due when the poll starts
        done = False
        for _ in range(100):
            if a.poll_once():
                done = True
                break
        assert done and a.owned == list(range(N_FRAGS))
        assert set(taken) <= set(calls)  # the fragments taken over were closed too
    finals = registry.syncer_final_reports(r, keys)
    assert sorted(int(p) for p in finals["syncer-a"].versions) == list(range(N_FRAGS))
    assert all(v == 1 for v in finals["syncer-a"].versions.values())
    assert max(merged_once(r, keys).values()) == 1
