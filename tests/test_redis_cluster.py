"""A run on a real local Redis Cluster (3 masters, 1 replica each, started by the fixture with
``redis-server --cluster-enabled yes`` and ``redis-cli --cluster create``), reached through a
plain ``redis://`` URL of one node: every process detects the cluster and uses a cluster
client; every multi-key command stays in one fragment's (or the run's) hash slot."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from redis.cluster import RedisCluster

from broker.connection import connect
from broker.keys import RunKeys
from ops.cluster import ClusterServers, free_port
from ops.cluster.artifacts import load_checkpoint
from ops.tools.replay import replay
from pipeline import config as cfgmod
from pipeline.data import run_corpus
from pipeline.engine import Engine
from workers import native

TINY = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
    "data": {"max_bytes": 600_000, "eval_batches": 2},
    "inner": {"lr": 3e-3, "warmup_steps": 5, "batch_size": 8},
    "sync": {"fragments": 4, "sync_every": 8},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ClusterServers(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def test_free_ports_are_never_handed_out_twice_and_a_cluster_uses_distinct_ones(tmp_path):
    """The kernel may give a just-closed port again: a node whose bus port equalled its client
    port (or another node's) failed to start with "Address already in use"."""
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    c = ClusterServers(tmp_path)  # not started: only its ports are drawn
    taken = [n.port for n in c.nodes] + [int(n.extra[n.extra.index("--cluster-port") + 1])
                                         for n in c.nodes]
    assert len(set(taken)) == len(taken) == 12
    assert not set(taken) & set(ports)


def test_a_plain_url_of_any_node_gives_a_cluster_client(cluster, redis_url):
    r = connect(cluster.nodes[-1].url)  # a replica's URL works too
    try:
        assert isinstance(r, RedisCluster)
        # the run's keys spread over the masters: fragments in their own slots
        keys = RunKeys("spread")
        slots = {r.keyslot(keys.fragment(p).frags) for p in range(8)}
        assert len(slots) == 8
        assert len({r.keyslot(k) for k in (keys.config, keys.events, keys.members,
                                           keys.heartbeat("L0"))}) == 1
    finally:
        r.close()
    plain = connect(redis_url)
    try:
        assert not isinstance(plain, RedisCluster)
    finally:
        plain.close()


def test_a_run_on_the_cluster_equals_the_inprocess_engine_and_replays(cluster, tmp_path):
    """Three learners, four fragments (spread over the three masters), K = M, strict, the
    int4 delta down link (every learner must rebuild the syncer's value bit for bit): the
    learners end on identical values, which equal the in-process engine's bit for bit, and
    replay verifies every round. Values over 4 KiB go in pieces: a piece's staging key shares
    its value's slot, so the commit renames it there."""
    cfg = cfgmod.from_dict({**TINY, "learners": 3, "steps": 24,
                            "sync": {**TINY["sync"], "quorum": 3, "strict": True,
                                     "down_delta": True, "codec_down": "int4"},
                            "broker": {"piece_bytes": 4096}})
    path = tmp_path / "run.toml"
    path.write_text(cfgmod.dumps_toml(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "ops.cli", "run", "--config", str(path), "--redis-url",
         cluster.url, "--run", "onc", "--out", str(tmp_path / "runs"), "--json", "--quiet"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(s["learner_hashes"]) == ["L0", "L1", "L2"]
    assert len({json.dumps(h, sort_keys=True) for h in s["learner_hashes"].values()}) == 1
    dist, _ = load_checkpoint(tmp_path / "runs" / "onc" / "checkpoint.npz")
    native.install_fused()  # the learner processes' kernels (or, without a compiler, neither)
    engine = Engine(cfg, run_corpus(cfg))
    summary = engine.run()
    assert summary["rounds"] == s["rounds"]
    for k, v in engine.final_params.items():
        np.testing.assert_array_equal(np.asarray(v), dist[k], err_msg=k)
    assert s["rejected_globals"] == 0
    rep = replay(cluster.url, "onc")
    assert rep["ok"], rep
    assert rep["rounds_checked"] == s["rounds"]


@pytest.mark.slow
def test_a_master_killed_mid_run_fails_over_and_nothing_acknowledged_is_lost(tmp_path):
    """The master of fragment 1's slot is SIGKILLed mid-run; its replica is promoted (node
    timeout 1 s) and the old master comes back as a replica. Learners and syncers ride it out
    and the run finishes with identical values. With ``broker.wait_replicas = 1`` a push counts
    as acknowledged only once the replica holds it: the ledger loses nothing."""
    from ops.chaos.harness import Fault, run_chaos

    cfg = cfgmod.from_dict({
        **TINY, "learners": 3, "steps": 10**6,
        "broker": {"heartbeat_s": 0.25, "heartbeat_ttl_s": 1.5, "lease_ms": 2000,
                   "claim_idle_ms": 2000, "snapshot_timeout_s": 2.0, "wait_replicas": 1}})
    rep = run_chaos(cfg, tmp_path / "run", "failover", [Fault(6, "kill-redis-master", "1", 4)],
                    17, pace_s=0.05, redis_cluster=True)
    assert rep["lost"] == 0, rep["lost_keys"]
    assert rep["merged_twice"] == 0, rep["merged_twice_keys"]
    assert rep["learners_finished"] == ["L0", "L1", "L2"], rep["exit_codes"]
    assert rep["identical_final_values"], rep["learner_hashes"]
    assert rep["versions_increase"] and rep["crashes"] == {}, rep["crashes"]
    (fault,) = rep["faults"]
    assert fault["kind"] == "kill-redis-master" and "node" in fault
    # rounds of fragment 1 went on after the failover
    assert rep["rounds"] > 0 and rep["merged"] > 0


def test_the_run_roles_work_on_every_node_and_the_tools_read_the_cluster(cluster, tmp_path):
    """`diloco acl --apply` through a cluster client sets the users on every node; a role's
    URL of any node reaches the whole cluster with the role's rights (and no more); status and
    inspect read a run there."""
    from broker import acl
    from broker.streams import FragmentStreams
    from ops.tools import inspect as inspect_tool
    from ops.tools import status

    run = "onc"  # the run of the test above (module-scoped cluster)
    admin = connect(cluster.url)
    users = {u.role: u for u in acl.new_users(run)}
    try:
        acl.apply(admin, run, list(users.values()))  # on every node
        for node in cluster.nodes:  # each node knows the users
            c = connect(node.url)
            try:
                names = set()
                for n in (c.get_nodes() if isinstance(c, RedisCluster) else [c]):
                    names |= {x if isinstance(x, str) else x.decode()
                              for x in c.get_redis_connection(n).acl_users()}
                assert {u.name for u in users.values()} <= names
            finally:
                c.close()
    finally:
        admin.close()
    keys = RunKeys(run)
    learner = connect(users["learner"].url(cluster.nodes[4].url))
    reader = connect(users["reader"].url(cluster.nodes[2].url))
    try:
        assert isinstance(learner, RedisCluster) and isinstance(reader, RedisCluster)
        FragmentStreams(learner, keys).push(3, {"probe": b"1"})  # a learner may XADD
        with pytest.raises(Exception, match="NOPERM|permission"):
            reader.set(keys.stop, b"1")
        with pytest.raises(Exception, match="NOPERM|permission"):
            learner.get(keys.fragment(3).state)  # not a learner's key
    finally:
        learner.close()
        reader.close()
    st = status.collect(users["reader"].url(cluster.url), run)
    assert [f["fragment"] for f in st["fragments"]] == [0, 1, 2, 3]
    assert all(f["version"] and f["rounds"] for f in st["fragments"])
    got = inspect_tool.collect(users["reader"].url(cluster.url), run, fragment=1, limit=2)
    assert got is not None
