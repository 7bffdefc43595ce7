"""End to end: a syncer and learners as separate OS processes over a real Redis and ZeroMQ."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from broker.connection import connect
from broker.keys import RunKeys
from ops.cluster.artifacts import load_checkpoint
from pipeline import config as cfgmod
from pipeline.data import run_corpus
from pipeline.engine import Engine
from workers import native

TINY = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
    "data": {"max_bytes": 600_000, "eval_batches": 4},
    "inner": {"lr": 3e-3, "warmup_steps": 5, "batch_size": 8},
    "sync": {"fragments": 2, "sync_every": 10},
}


def write_config(tmp_path, **top) -> str:
    cfg = cfgmod.from_dict({**TINY, **top})
    path = tmp_path / "run.toml"
    path.write_text(cfgmod.dumps_toml(cfg))
    return str(path)


def diloco(*args: str, timeout: int = 240) -> dict:
    out = subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_three_learners_and_a_syncer_as_processes(tmp_path, redis_url):
    """Every value larger than 4 KiB — pushes, snapshots, states — goes in pieces."""
    cfg_path = write_config(tmp_path, learners=3, steps=60, broker={"piece_bytes": 4096})
    s = diloco("run", "--config", cfg_path, "--redis-url", redis_url, "--run", "e2e",
               "--out", str(tmp_path / "runs"), "--json", "--tensorboard", str(tmp_path / "tb"))
    r = connect(redis_url)
    fk = RunKeys("e2e").fragment(0)
    assert r.type(fk.state) == r.type(fk.global_) == b"hash", r.type(fk.state)
    assert r.hget(fk.state, "0") is not None and not list(r.scan_iter("*staging*"))
    assert any(b"pieces" in fields for _, fields in r.xrange(fk.frags))
    r.close()
    assert s["mode"] == "decoupled" and s["learners"] == 3
    assert s["tokens"] == 3 * 60 * 8 * 32
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    hashes = s["learner_hashes"]
    assert sorted(hashes) == ["L0", "L1", "L2"]
    # every learner ends with identical values for every fragment
    assert len({json.dumps(h, sort_keys=True) for h in hashes.values()}) == 1
    assert len(hashes["L0"]) == 2
    assert s["rounds"] >= 4 and s["bytes_sent"] > 0 and s["bytes_received"] > 0
    # under "rebase" every step's progress is merged, and only once, though these learners
    # step faster than their syncer merges and so supersede pushes
    assert s["merged_steps"] == [3 * 60, 3 * 60], s["merged_steps"]
    for name in ("config.toml", "metrics.jsonl", "loss.png", "checkpoint.npz", "summary.json"):
        assert (tmp_path / "runs" / "e2e" / name).exists(), name
    # each process's own curves (`workers.scalars`), read back with TensorBoard's reader:
    # a learner's against its step, to its last; the syncer's every round against its version
    from test_tensorboard import _scalars

    mine = _scalars(tmp_path / "tb" / "L0")
    steps = [step for step, _ in mine["learner/tokens"]]
    assert steps == sorted(steps) and mine["learner/tokens"][-1] == (60, 60 * 8 * 32)
    assert "learner/loss" in mine and mine["learner/bytes_sent"][-1][1] > 0
    rounds = _scalars(tmp_path / "tb" / "syncer-0")
    versions = [[v for v, _ in rounds[f"fragment/{p}/merged"]] for p in (0, 1)]
    assert all(vs == list(range(1, len(vs) + 1)) for vs in versions), versions
    assert sum(map(len, versions)) == s["rounds"]


DOWN_LINKS = {
    "bf16 values": {},
    # int4 deltas (every learner must rebuild the syncer's value bit for bit for the engines
    # to agree): tests/test_redis_cluster.py runs that equality on a Redis Cluster
}


@pytest.mark.parametrize("down", list(DOWN_LINKS))
def test_distributed_equals_inprocess_engine(tmp_path, redis_url, down):
    """With K = M, strict learners and fp32-summed merges the two engines agree bit for bit."""
    cfg_path = write_config(tmp_path, learners=2, steps=30)
    cfg = cfgmod.override(cfgmod.load(cfg_path), **{"sync.quorum": 2, "sync.strict": True,
                                                    **DOWN_LINKS[down]})
    (tmp_path / "eq.toml").write_text(cfgmod.dumps_toml(cfg))
    s = diloco("run", "--config", str(tmp_path / "eq.toml"), "--redis-url", redis_url,
               "--run", "eq", "--out", str(tmp_path / "runs"), "--json")
    dist, _ = load_checkpoint(tmp_path / "runs" / "eq" / "checkpoint.npz")
    native.install_fused()  # the learner processes' kernels (or, without a compiler, neither)
    engine = Engine(cfg, run_corpus(cfg))
    summary = engine.run()
    assert summary["rounds"] == s["rounds"]
    for k, v in engine.final_params.items():
        np.testing.assert_array_equal(np.asarray(v), dist[k], err_msg=k)
    if DOWN_LINKS[down]:
        assert s["rejected_globals"] == 0
        rep = diloco("replay", "--redis-url", redis_url, "--run", "eq", "--json")
        assert rep["ok"] and rep["rounds_checked"] == s["rounds"], rep


@pytest.mark.parametrize("flag", ["--engine=inprocess"])
def test_inprocess_cli_json(tmp_path, flag):
    cfg_path = write_config(tmp_path, learners=2, steps=20)
    for mode in ("ddp", "sync-diloco", "decoupled"):
        s = diloco("run", flag, "--mode", mode, "--config", cfg_path, "--out",
                   str(tmp_path / "runs"), "--json")
        for key in ("mode", "learners", "tokens", "initial_eval_loss", "final_eval_loss",
                    "final_eval_accuracy", "bytes_sent", "bytes_received",
                    "bandwidth_ratio_vs_ddp", "goodput", "rounds"):
            assert key in s, key
        assert s["mode"] == mode and s["tokens"] == 2 * 20 * 8 * 32
