"""Warm start (``init_from``): version 0 of a run is a checkpoint's values, checked against
the task first; the run stores their hash, and every process that builds version 0 is held
to it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from test_e2e import write_config

from ops.cluster.artifacts import save_checkpoint
from pipeline import config as cfgmod
from pipeline.config import ConfigError
from pipeline.task import task_of, with_init_hash
from pipeline.warmstart import initial_values, values_hash

TINY_MODEL = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32}}


def _cfg(**top) -> cfgmod.RunConfig:
    return cfgmod.from_dict({**TINY_MODEL, **top})


def _values(cfg: cfgmod.RunConfig, scale: float = 0.5) -> dict[str, np.ndarray]:
    shapes = task_of(cfg).param_shapes()
    rng = np.random.default_rng(3)
    return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}


def test_an_export_or_a_plain_file_starts_the_run_with_its_values(tmp_path):
    cfg = _cfg()
    values = _values(cfg)
    import orbax.checkpoint as ocp

    save_checkpoint(tmp_path / "export.npz", values, cfg)
    save_checkpoint(tmp_path / "export.orbax", values, cfg)
    np.savez(tmp_path / "plain.npz", **{k: v.astype(np.float64) for k, v in values.items()})
    with ocp.StandardCheckpointer() as ck:  # another JAX program's checkpoint of its tree
        ck.save((tmp_path / "plain.orbax").resolve(),
                {k: v.astype(np.float64) for k, v in values.items()})
    for name in ("export.npz", "plain.npz", "export.orbax", "plain.orbax"):
        warm = with_init_hash(cfgmod.override(cfg, init_from=str(tmp_path / name)))
        assert warm.init_sha256 == values_hash(values)
        got = task_of(warm).init_params(warm.seed)
        assert sorted(got) == sorted(values)
        assert all(np.array_equal(got[k], values[k]) for k in values)
    # the hash is run-defining: a warm start is another run than a cold one
    assert warm.run_hash() != cfg.run_hash()


@pytest.mark.parametrize("change, says", [
    (lambda v: v.pop(sorted(v)[0]), "has no tensor"),
    (lambda v: v.update(extra=np.zeros(3, np.float32)), "holds 'extra'"),
    (lambda v: v.update({sorted(v)[0]: np.zeros((2, 2), np.float32)}), "has shape (2, 2)"),
    (lambda v: v.update({sorted(v)[0]: np.zeros_like(v[sorted(v)[0]], np.int32)}),
     "not a floating-point tensor"),
])
def test_a_file_that_does_not_fit_the_task_is_refused_naming_the_first_mismatch(
        tmp_path, change, says):
    cfg = _cfg()
    values = _values(cfg)
    change(values)
    np.savez(tmp_path / "bad.npz", **values)
    with pytest.raises(ConfigError, match="init_from: .*" + says.replace("(", r"\(").replace(
            ")", r"\)")):
        with_init_hash(cfgmod.override(cfg, init_from=str(tmp_path / "bad.npz")))


def test_another_file_than_the_stored_hash_is_refused(tmp_path):
    cfg = _cfg()
    np.savez(tmp_path / "a.npz", **_values(cfg))
    warm = with_init_hash(cfgmod.override(cfg, init_from=str(tmp_path / "a.npz")))
    np.savez(tmp_path / "a.npz", **_values(cfg, scale=0.25))  # replaced on this host
    with pytest.raises(ConfigError, match="not the model this run starts from"):
        initial_values(warm.init_from, task_of(warm).param_shapes(), warm.init_sha256)
    for bad in ("nothing-here.npz", __file__):
        with pytest.raises(ConfigError, match="init_from"):
            with_init_hash(cfgmod.override(cfg, init_from=bad))


def test_a_second_run_starts_where_the_first_ended_and_replays(tmp_path, redis_url):
    """A finished run's checkpoint starts another, on real processes with the int4 delta down
    link: its initial evaluation loss is the first run's final one (learners start from the
    loaded values bit for bit), and replay, which rebuilds version 0 from the file, verifies
    every round."""
    first = subprocess.run(
        [sys.executable, "-m", "ops.cli", "run", "--engine", "inprocess", "--config",
         write_config(tmp_path, learners=2, steps=20), "--run", "first", "--out",
         str(tmp_path / "runs"), "--json", "--quiet"], capture_output=True, text=True,
        timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    s1 = json.loads(first.stdout.strip().splitlines()[-1])
    ckpt = tmp_path / "runs" / "first" / "checkpoint.npz"
    (tmp_path / "second").mkdir()
    cfg2 = write_config(tmp_path / "second", learners=2, steps=6, init_from=str(ckpt),
                        sync={"fragments": 2, "sync_every": 3})
    second = subprocess.run(
        [sys.executable, "-m", "ops.cli", "run", "--config", cfg2, "--redis-url", redis_url,
         "--run", "second", "--out", str(tmp_path / "runs"), "--json", "--quiet"],
        capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    s2 = json.loads(second.stdout.strip().splitlines()[-1])
    assert s2["initial_eval_loss"] == s1["final_eval_loss"]
    replay = subprocess.run(
        [sys.executable, "-m", "ops.cli", "replay", "--redis-url", redis_url, "--run", "second",
         "--json"], capture_output=True, text=True, timeout=240)
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
    assert json.loads(replay.stdout.strip().splitlines()[-1])["ok"]
