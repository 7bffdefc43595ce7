"""The run's task (pipeline/task.py): the built-in byte GPT and the Llama-style decoder, chosen by
``task`` in the run configuration, through the engine and a real multi-process run."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from test_e2e import diloco, write_config

from ops.cluster.artifacts import load_checkpoint
from ops.tools import replay
from pipeline import config as cfgmod
from pipeline import model
from pipeline.config import ConfigError
from pipeline.data import run_corpus
from pipeline.engine import Engine
from pipeline.fragments import partition
from pipeline.task import ByteGPT, TreeTask, n_params, task_of

SMALL = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 32},
         "data": {"max_bytes": 600_000, "eval_batches": 4},
         "inner": {"lr": 3e-3, "warmup_steps": 5, "batch_size": 8},
         "sync": {"fragments": 3, "sync_every": 12}, "learners": 2, "steps": 120}


def test_the_default_task_keeps_the_hash_of_runs_recorded_before_it():
    without = cfgmod.from_dict({k: v for k, v in SMALL.items()})
    assert without.task == "bytegpt"
    assert cfgmod.from_dict({**SMALL, "task": "bytegpt"}).run_hash() == without.run_hash()
    assert cfgmod.from_dict({**SMALL, "task": "llama"}).run_hash() != without.run_hash()
    with pytest.raises(ConfigError, match="task"):
        cfgmod.from_dict({**SMALL, "task": "gpt5"})
    # the default is not written (versions before the field read the file), another is
    assert "task" not in cfgmod.dumps_toml(without)
    # the stored TOML names the task and loads back to the same run
    llama_cfg = cfgmod.from_dict({**SMALL, "task": "llama"})
    again = cfgmod.from_dict(__import__("tomllib").loads(cfgmod.dumps_toml(llama_cfg)))
    assert again == llama_cfg and again.run_hash() == llama_cfg.run_hash()


def test_tasks_describe_their_parameters_without_computing_them():
    byte = task_of(cfgmod.from_dict(SMALL))
    assert isinstance(byte, ByteGPT) and byte.param_shapes() == model.param_shapes(byte.cfg)
    task = task_of(cfgmod.from_dict({**SMALL, "task": "llama"}))
    assert isinstance(task, TreeTask) and task.name == "llama"
    shapes = task.param_shapes()
    params = task.init_params(0)
    assert list(shapes) == list(params)
    assert all(params[k].shape == s for k, s in shapes.items())
    assert "layers/1/mlp/w_gate" in shapes and shapes["head"] == (32, 256)
    assert [n for n in shapes if task.is_embedding(n)] == ["embed"]
    assert n_params(task) == sum(int(np.prod(s)) for s in shapes.values())
    frags = partition(shapes, 3, task.is_embedding)
    assert frags[0] == ["embed"] and sorted(sum(frags, [])) == sorted(shapes)
    # loss and logits through flat parameters
    batch = jax.numpy.zeros((2, 33), jax.numpy.int32)
    loss, _ = jax.jit(task.loss_and_accuracy)(params, batch)  # jitted: one compile each
    assert float(loss) == pytest.approx(np.log(256), rel=0.05)
    assert jax.jit(task.logits)(params, batch[:, :-1]).shape == (2, 32, 256)


def test_the_engine_trains_the_llama_task():
    cfg = cfgmod.from_dict({**SMALL, "task": "llama"})
    s = Engine(cfg, run_corpus(cfg)).run()
    assert s["final_eval_loss"] < 0.8 * s["initial_eval_loss"], s
    assert s["rounds"] >= 8 and s["params"] == n_params(task_of(cfg))


def test_a_llama_run_with_real_processes_ends_identical_and_replays(tmp_path, redis_url):
    cfg_path = write_config(tmp_path, learners=2, steps=60, task="llama")
    s = diloco("run", "--config", cfg_path, "--redis-url", redis_url, "--run", "llama",
               "--out", str(tmp_path / "runs"), "--json")
    assert s["final_eval_loss"] < s["initial_eval_loss"] - 0.5
    hashes = list(s["learner_hashes"].values())
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    params, cfg = load_checkpoint(tmp_path / "runs" / "llama" / "checkpoint.npz")
    assert cfg.task == "llama" and "layers/0/attn/wq" in params
    report = replay.replay(redis_url, "llama")
    assert report["status"] == "verified", report


@pytest.mark.parametrize("task_name", ["bytegpt", "llama"])
def test_muon_orthogonalises_the_matrices_and_adamw_moves_the_rest(task_name):
    """`inner.optimizer = "muon"`: a hidden matrix's first update is Muon's (its singular
    values near one another: the momentum orthogonalised), the embeddings', the output
    head's and the vectors' AdamW's (each entry ±lr on the first step); a run recorded before
    the setting keeps AdamW and its hash, and a few steps on one batch lower the loss."""
    from pipeline.task import inner_optimizer
    from pipeline.train import make_step

    inner = {**SMALL["inner"], "warmup_steps": 0}
    adamw = cfgmod.from_dict({**SMALL, "task": task_name, "inner": inner})
    assert adamw.inner.optimizer == "adamw" and "optimizer" not in cfgmod.dumps_toml(adamw)
    cfg = cfgmod.from_dict({**SMALL, "task": task_name,
                            "inner": {**inner, "optimizer": "muon", "muon_lr": 0.02}})
    assert cfg.run_hash() != adamw.run_hash()
    with pytest.raises(ConfigError, match="optimizer"):
        cfgmod.from_dict({**SMALL, "inner": {**inner, "optimizer": "sgd"}})
    task = task_of(cfg)
    params = task.init_params(0)
    opt = task.optimizer()
    rng = np.random.default_rng(0)
    grads = {n: jax.numpy.asarray(rng.standard_normal(v.shape).astype(np.float32))
             for n, v in params.items()}
    updates, _ = jax.jit(opt.update)(grads, opt.init(params), params)
    norm = np.sqrt(sum(float(np.sum(np.square(g))) for g in grads.values()))  # clip: 1.0
    kinds = {}
    for n, u in updates.items():
        u = np.asarray(u)
        # AdamW's first step, with Nesterov momentum as optax's muon has it (NAdam:
        # m̂ = g (1 + b1 / (1 + b1))) of the clipped gradient g: −lr m̂ / (|g| + ε) − lr wd θ
        g = np.asarray(grads[n]) / norm
        adamw = -3e-3 * (1 + 0.9 / 1.9) * g / (np.abs(g) + 1e-8) - 3e-4 * np.asarray(params[n])
        if np.allclose(u, adamw, rtol=1e-3, atol=1e-6):
            kinds[n] = "adamw"
        elif u.ndim == 2:  # Muon's: a matrix whose singular values are alike
            s = np.linalg.svd(u, compute_uv=False)
            kinds[n] = "muon" if s.min() > 0.3 * s.max() else f"spread {s.min() / s.max():.3f}"
        else:
            kinds[n] = "other"
    assert {n for n, k in kinds.items() if k not in ("muon", "adamw")} == set(), kinds
    assert "muon" in kinds.values() and "adamw" in kinds.values()
    assert all(kinds[n] == "adamw" for n in params if task.is_embedding(n) or n == "head")
    with pytest.raises(ValueError, match="is_embedding"):  # a user's make_optimizer
        inner_optimizer(cfg.inner, cfg.steps)
    if task_name == "llama":
        return  # (the step: one task is enough)
    step = make_step(task, opt)
    batch = jax.numpy.asarray(rng.integers(0, 256, (8, 33)), jax.numpy.int32)
    state = opt.init(params)
    losses = []
    for _ in range(4):
        params, state, m = step(params, state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0], losses
