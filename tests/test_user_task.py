"""A user's own task (``task = "module:factory"``): imported only where a process names it, a
nested parameter tree through fragments, the wire and replay, a real multi-process run, and a
hand-written loop (examples/own_loop.py) next to CLI learners."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers_broker import run_to_the_end

from broker import codec, registry
from broker.keys import RunKeys
from ops.cluster import store_run_config
from ops.tools import replay, status
from pipeline import config as cfgmod
from pipeline import quant, tree
from pipeline.config import ConfigError
from pipeline.task import SpecTask, TaskNotNamed, TreeTask, param_spec, spec_task, task_of
from workers.common import open_run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# A model that exists only in this test: a bag-of-context MLP with a nested parameter tree
# (dicts, a list, a tuple-free layout as Flax produces) and its own optimizer and batches.
USER_MODULE = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np, optax
    from pipeline.task import TreeTask
    from pipeline.data import run_corpus

    def init(seed, width):
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
        return {"tok": {"emb": 0.02 * jax.random.normal(k1, (256, width))},
                "layers": [{"w": jax.random.normal(k2, (2 * width, width)) / width,
                            "b": jnp.zeros((width,))},
                           {"w": jax.random.normal(k3, (width, 256)) / width,
                            "b": jnp.zeros((256,))}]}

    def loss(p, batch):
        x, y = batch[:, :-1], batch[:, 1:]
        e = p["tok"]["emb"][x]
        prev = jnp.pad(e, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        h = jax.nn.relu(jnp.concatenate([e, prev], -1) @ p["layers"][0]["w"]
                        + p["layers"][0]["b"])
        logits = h @ p["layers"][1]["w"] + p["layers"][1]["b"]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1).mean()
        return nll, (logits.argmax(-1) == y).mean()

    class Batches:  # the user's own data: the run's corpus, every other row reversed
        def __init__(self, cfg):
            self.corpus = run_corpus(cfg)
        def batch(self, shard, step, batch_size):
            b = self.corpus.batch(shard, step, batch_size)
            return np.ascontiguousarray(np.where(np.arange(batch_size)[:, None] % 2,
                                                 b, b[:, ::-1]))
        def eval_batches(self, n, batch_size):
            return self.corpus.eval_batches(n, batch_size)

    def make(cfg, width=32, lr=0.01):
        return TreeTask(run=cfg, name="bagmlp", init=lambda s: init(s, width), loss=loss,
                        embeddings=("tok/emb",),
                        make_optimizer=lambda c: optax.adam(lr),
                        make_data=Batches)
''')

TINY = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
    "data": {"max_bytes": 600_000, "eval_batches": 4},
    "inner": {"lr": 3e-3, "warmup_steps": 5, "batch_size": 8},
    "sync": {"fragments": 2, "sync_every": 10},
}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The test's task module on sys.path and PYTHONPATH (for the processes it starts)."""
    (tmp_path / "bagmlp_task.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(EXAMPLES), str(ROOT)]))
    yield "bagmlp_task:make"
    sys.modules.pop("bagmlp_task", None)


def _cfg(task: str, **top) -> cfgmod.RunConfig:
    return cfgmod.from_dict({**TINY, "task": task, "task_options": {"width": 24}, **top})


def test_a_user_task_is_imported_only_where_the_process_names_it(user_module):
    cfg = _cfg(user_module)
    sys.modules.pop("bagmlp_task", None)
    with pytest.raises(TaskNotNamed, match="--task bagmlp_task:make"):
        task_of(cfg)
    with pytest.raises(TaskNotNamed):
        task_of(cfg, local="other_module:make")
    assert "bagmlp_task" not in sys.modules  # naming it in the configuration imported nothing
    task = task_of(cfg, local=user_module)
    assert isinstance(task, TreeTask) and "bagmlp_task" in sys.modules
    shapes = task.param_shapes()
    assert shapes["tok/emb"] == (256, 24) and shapes["layers/1/w"] == (24, 256)
    assert [n for n in shapes if task.is_embedding(n)] == ["tok/emb"]
    # options reach the factory and are part of the run hash; a wrong one is refused clearly
    assert _cfg(user_module).run_hash() != cfgmod.from_dict(
        {**TINY, "task": user_module, "task_options": {"width": 16}}).run_hash()
    with pytest.raises(ConfigError, match="factory refused"):
        task_of(cfgmod.from_dict({**TINY, "task": user_module, "task_options": {"depth": 2}}),
                local=user_module)
    with pytest.raises(ConfigError, match="cannot import"):
        task_of(cfgmod.from_dict({**TINY, "task": "no_such_module:make"}),
                local="no_such_module:make")
    # the spec lets code-less processes see the shapes; a malformed one is refused
    spec = param_spec(task)
    st = spec_task(cfg, json.loads(json.dumps(spec)))
    assert isinstance(st, SpecTask) and st.param_shapes() == shapes
    with pytest.raises(TaskNotNamed):
        st.init_params(0)
    assert st.tokens_per_step() == task.tokens_per_step()
    n = len(spec["names"])
    for bad in ({**spec, "shapes": [[-1]] + spec["shapes"][1:]}, {**spec, "dtypes": ["int8"]},
                {**spec, "names": ["../x"] + spec["names"][1:]}, {"names": 1}, [1], None,
                {**spec, "embeddings": [[1]]}, {**spec, "tokens_per_step": -5},
                {**spec, "shapes": [[2**31] * 8] * n}):
        with pytest.raises(ConfigError):
            spec_task(cfg, bad)


def test_task_options_that_toml_cannot_hold_are_refused_and_text_round_trips():
    with pytest.raises(ConfigError, match="finite"):
        cfgmod.from_dict({**TINY, "task": "m:f", "task_options": {"x": float("inf")}})
    cfg = cfgmod.from_dict({**TINY, "task": "m:f", "task_options": {"s": "a\u00e9\U0001f600"},
                            "data": {**TINY["data"], "text_field": "t\u00e9xt"}})
    again = cfgmod.from_dict(__import__("tomllib").loads(cfgmod.dumps_toml(cfg)))
    assert again == cfg and again.run_hash() == cfg.run_hash()
    with pytest.raises(ConfigError, match="twice"):
        cfgmod.validate(__import__("dataclasses").replace(
            cfg, task_options=(("a", 1), ("a", "x"))))


def test_a_nested_tree_round_trips_through_fragments_and_the_wire_bit_for_bit(user_module):
    task = task_of(_cfg(user_module), local=user_module)
    nested = task.init(3)
    flat = tree.flatten(nested)
    assert list(flat) == list(task.param_shapes())
    blob = codec.pack_snapshot("r", 0, 7, {n: quant.quantize(np.asarray(v), "fp32", 64)
                                           for n, v in flat.items()})
    header, tensors = codec.unpack_snapshot(blob, max_bytes=2**26)
    back = tree.unflatten({n: quant.dequantize(q) for n, q in tensors.items()}, nested)
    for a, b in zip(tree.flatten(back).values(), flat.values(), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_processes_without_the_task_open_the_run_from_its_spec(user_module, redis_url):
    cfg = _cfg(user_module)
    assert store_run_config(redis_url, "ut", cfg)
    stored = registry.load_param_spec(open_run(redis_url, "ut", wait_s=0).r, RunKeys("ut"))
    assert stored["names"][0] == "layers/0/b"
    ctx = open_run(redis_url, "ut", wait_s=0)  # a read-only tool: no --task, no import
    assert isinstance(ctx.task, SpecTask) and len(ctx.fragments) == 2
    with pytest.raises(TaskNotNamed):
        open_run(redis_url, "ut", wait_s=0, need_code=True)  # a learner must name it
    assert status.collect(redis_url, "ut")["run"] == "ut"
    out = subprocess.run([sys.executable, "-m", "ops.cli", "learner", "--redis-url", redis_url,
                          "--run", "ut", "--id", "L0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--task bagmlp_task:make" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    # a library island whose tree is not the run's says so (and closes cleanly unstarted)
    from workers.island import Island, IslandConfig

    with pytest.raises(ValueError, match="not the run's"):
        with Island(IslandConfig(redis_url, "ut", "L1", task=user_module)) as island:
            island.start(like={"nope": np.zeros(3, np.float32)})


def test_a_user_task_trains_in_a_real_multi_process_run_and_replays(user_module, redis_url,
                                                                    tmp_path):
    cfg = _cfg(user_module, learners=2, steps=80)
    path = tmp_path / "run.toml"
    path.write_text(cfgmod.dumps_toml(cfg))
    out = subprocess.run([sys.executable, "-m", "ops.cli", "run", "--config", str(path),
                          "--redis-url", redis_url, "--run", "user", "--out",
                          str(tmp_path / "runs"), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads(out.stdout.strip().splitlines()[-1])
    assert s["final_eval_loss"] < 0.8 * s["initial_eval_loss"], s
    hashes = list(s["learner_hashes"].values())
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    # replay needs the task's initial values: refused without naming it, verified with it
    assert replay.replay(redis_url, "user")["status"] == "incomplete"
    report = replay.replay(redis_url, "user", task=user_module)
    assert report["status"] == "verified", report


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as fh:  # the child keeps its own descriptor
        return subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)


def test_the_hand_written_loop_example_joins_cli_learners_with_identical_results(
        redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), str(ROOT)]))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    task = "user_model:make"
    cfg = cfgmod.from_dict({**TINY, "task": task, "task_options": {"hidden": 48},
                            "learners": 3, "steps": 60, "sync": {**TINY["sync"],
                                                                 "strict": True}})
    assert store_run_config(redis_url, "mixed", cfg)
    base = [sys.executable, "-m"]
    procs = {
        "syncer": _spawn(base + ["workers.syncer", "--redis-url", redis_url, "--run", "mixed",
                                 "--task", task], tmp_path / "syncer.log"),
        "L0": _spawn(base + ["workers.learner", "--redis-url", redis_url, "--run", "mixed",
                             "--id", "L0", "--task", task], tmp_path / "L0.log"),
        "L1": _spawn(base + ["workers.learner", "--redis-url", redis_url, "--run", "mixed",
                             "--id", "L1", "--task", task], tmp_path / "L1.log"),
        "L2": _spawn([sys.executable, str(EXAMPLES / "own_loop.py"), "--redis-url", redis_url,
                      "--run", "mixed", "--id", "L2", "--state-dir", str(tmp_path / "L2")],
                     tmp_path / "L2.log"),
    }
    run_to_the_end(procs, ("L0", "L1", "L2", "syncer"), tmp_path)
    ctx = open_run(redis_url, "mixed", wait_s=0)
    reports = registry.learner_final_reports(ctx.r, ctx.keys)
    assert sorted(reports) == ["L0", "L1", "L2"]
    hashes = {name: json.dumps(rep.hashes, sort_keys=True) for name, rep in reports.items()}
    assert len(set(hashes.values())) == 1 and reports["L2"].steps == 60, hashes
    printed = json.loads((tmp_path / "L2.log").read_text().strip().splitlines()[-1])
    assert printed["hashes"] == reports["L2"].hashes
    # the example's checkpoint holds its own optimizer state and the sync bookkeeping
    assert (tmp_path / "L2" / "L2.ckpt.npz").exists()
