"""Learner islands over several JAX devices (pipeline/mesh.py): data-parallel and FSDP
placements compute the single-device step, keep their arrays where they belong, and round-trip
to the host.

XLA reads the number of CPU devices once, when JAX initialises, so the checks that need
several devices run in one subprocess started with ``XLA_FLAGS`` asking for four (this file,
run as a script, is that subprocess); this process has its one CPU device.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from pipeline import config as cfgmod
from pipeline.data import run_corpus
from pipeline.mesh import Placement, force_host_devices
from pipeline.task import task_of
from pipeline.train import inner_optimizer, make_step

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 4
STEPS = 20
SMALL = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
         "data": {"max_bytes": 200_000},
         "inner": {"lr": 3e-3, "warmup_steps": 5, "batch_size": 8},
         "learners": 2, "steps": STEPS}


@functools.cache
def _setup(task_name: str = "bytegpt"):
    cfg = cfgmod.from_dict({**SMALL, "task": task_name})
    task = task_of(cfg)
    opt = inner_optimizer(cfg.inner, cfg.steps)
    corpus = run_corpus(cfg)
    batches = [corpus.batch(0, i, cfg.inner.batch_size) for i in range(STEPS)]
    return task, opt, batches


def _train(step, params, opt_state, batches, place=None):
    """`len(batches)` steps; with a placement, everything goes through it first."""
    if place is not None:
        params, opt_state = place.params(params), place.opt_state(opt_state)
    losses = []
    for b in batches:
        params, opt_state, metrics = step(params, opt_state,
                                          b if place is None else place.batch(b))
        losses.append(float(metrics["loss"]))
    return params, opt_state, losses


def _rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# --- the checks that need several devices (run in the subprocess) ------------------------------

# compiling dominates the time here: each step is compiled once and shared by the checks

@functools.cache
def _reference(task_name: str):
    """The plain single-device step's result after `STEPS` steps."""
    task, opt, batches = _setup(task_name)
    params = task.init_params(0)
    return _train(make_step(task, opt), params, opt.init(params), batches)


@functools.cache
def _island(task_name: str, fsdp: bool):
    task, opt, _ = _setup(task_name)
    place = Placement(DEVICES, fsdp=fsdp)
    return place, place.step(task, opt)


def _same_as_one_device(task_name: str, fsdp: bool) -> None:
    """20 AdamW steps of a 4-device island equal 20 plain single-device steps on the same
    global batches, to 1e-5 relative per tensor (1e-4 for the AdamW moments)."""
    task, opt, batches = _setup(task_name)
    ref, ref_state, ref_losses = _reference(task_name)
    place, step = _island(task_name, fsdp)
    assert place.n_devices == DEVICES
    params = task.init_params(0)
    got, got_state, got_losses = _train(step, params, opt.init(params), batches, place)
    np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-5)
    assert ref_losses[-1] < ref_losses[0] - 0.5, ref_losses  # it trained
    host = place.host(got)
    errs = {k: _rel_err(host[k], ref[k]) for k in ref}
    assert max(errs.values()) < 1e-5, errs
    # the AdamW moments too, to 1e-4: a moment is a running average of gradients, and the
    # gradient of a small tensor (a norm's weights) is a sum with cancellation whose order
    # differs between four devices and one; on an AMD EPYC VM the first moment of one
    # norm weight of the llama task came out 1.3e-5 apart relative to its largest value
    for a, b in zip(jax.tree.leaves(place.host(got_state)), jax.tree.leaves(ref_state),
                    strict=True):
        assert _rel_err(a, b) < 1e-4 or np.max(np.abs(np.asarray(a) - np.asarray(b))) < 1e-9


def check_dp_bytegpt():
    _same_as_one_device("bytegpt", fsdp=False)


def check_dp_llama():
    _same_as_one_device("llama", fsdp=False)


def check_fsdp_bytegpt():
    _same_as_one_device("bytegpt", fsdp=True)


def check_one_device_is_the_plain_step_bit_for_bit():
    task, opt, batches = _setup()
    ref, ref_state, ref_losses = _reference("bytegpt")
    place = Placement(1)
    assert place.devices == (jax.local_devices()[0],)  # where the plain step runs
    params = task.init_params(0)
    got, got_state, losses = _train(place.step(task, opt), params, opt.init(params), batches,
                                    place)
    assert losses == ref_losses
    host = place.host(got)
    assert all(host[k].tobytes() == np.asarray(ref[k]).tobytes() for k in ref)
    assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in
               zip(jax.tree.leaves(got_state), jax.tree.leaves(ref_state), strict=True))
    # FSDP over one device is the same layout: everything whole on that device
    one = Placement(1, fsdp=True)
    assert all(one.array_sharding(s) == place.array_sharding(s)
               for s in task.param_shapes().values())


def check_outputs_stay_sharded():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    task, opt, batches = _setup()
    for fsdp in (False, True):
        place, step = _island("bytegpt", fsdp)
        rep, mesh = NamedSharding(place.mesh, P()), place.mesh
        params = place.params(task.init_params(0))
        state = place.opt_state(opt.init(params))
        batch = place.batch(batches[0])
        assert batch.sharding == NamedSharding(mesh, P("data"))
        assert {s.data.shape for s in batch.addressable_shards} == {(2, 33)}
        assert {s.device for s in batch.addressable_shards} == set(jax.local_devices())
        for _ in range(2):  # the step's outputs go straight back in
            params, state, metrics = step(params, state, batch)
        assert all(m.sharding == rep for m in metrics.values())
        mu = optax.tree.get(state, "mu")  # AdamW's first moment
        scalars = [x for x in jax.tree.leaves(state) if x.ndim == 0]  # the step counts
        assert scalars and all(x.sharding == rep for x in scalars)
        if not fsdp:
            assert params["wte"].sharding == rep and params["h0.mlp.fc"].sharding == rep
            assert mu["wte"].sharding == rep
        else:
            # the largest axis that divides by 4: rows of the embedding, columns of the MLP
            assert params["wte"].sharding == NamedSharding(mesh, P("data"))
            assert params["h0.mlp.fc"].sharding == NamedSharding(mesh, P(None, "data"))
            assert {s.data.shape for s in params["wte"].addressable_shards} == {(64, 32)}
            assert mu["wte"].sharding == params["wte"].sharding
            assert mu["h0.mlp.fc"].sharding == params["h0.mlp.fc"].sharding
            # no axis divides by 4: replicated
            assert place.array_sharding((5, 7)) == rep and place.array_sharding(()) == rep
        # a placed tree placed again is the same objects (nothing is copied)
        again = place.params(params)
        assert all(again[k] is params[k] for k in params)
        assert place.batch(batch) is batch
        # a batch that is a tree (a user task's) is split leaf by leaf
        tree = place.batch({"tokens": batches[0], "mask": np.ones((8, 4), np.float32)})
        assert tree["tokens"].sharding == batch.sharding == tree["mask"].sharding


def check_indivisible_batch_raises():
    task, opt, batches = _setup()
    place = Placement(DEVICES)
    try:
        place.batch(batches[0][:6])
    except ValueError as e:
        assert "inner.batch_size 6" in str(e) and "4 devices" in str(e), e
    else:
        raise AssertionError("a batch of 6 over 4 devices was accepted")
    try:
        Placement(DEVICES + 1)
    except ValueError as e:
        assert "5 devices" in str(e), e
    else:
        raise AssertionError("more devices than the process has were accepted")


def check_mixed_placement_and_host_round_trip():
    task, opt, batches = _setup()
    for fsdp in (False, True):
        place, step = _island("bytegpt", fsdp)
        placed = place.params(task.init_params(0))
        placed, state, _ = step(placed, place.opt_state(opt.init(placed)),
                                place.batch(batches[0]))
        # merged values from the network replace some entries, as numpy
        rng = np.random.default_rng(1)
        merged = {k: rng.standard_normal(placed[k].shape).astype(np.float32)
                  for k in ("wte", "h1.mlp.fc", "lnf.g")}
        mixed = {**placed, **merged}
        again = place.params(mixed)
        for k in placed:
            if k in merged:
                assert again[k].sharding == place.array_sharding(merged[k].shape)
                np.testing.assert_array_equal(np.asarray(again[k]), merged[k])
            else:
                assert again[k] is placed[k]
        host = place.host(again)
        assert all(type(v) is np.ndarray and v.flags.writeable for v in host.values())
        back = place.host(place.params(host))
        for k in host:
            assert back[k].dtype == host[k].dtype and back[k].shape == host[k].shape
            assert back[k].tobytes() == host[k].tobytes(), k
        # the host copies are not views of device memory
        host["lnf.g"][:] = 0.0
        assert np.all(np.asarray(again["lnf.g"]) == merged["lnf.g"])
        # and the step runs on the replaced values
        step(again, state, place.batch(batches[1]))
        # the optimiser state round-trips too
        s_host = place.host(state)
        for a, b in zip(jax.tree.leaves(place.host(place.opt_state(s_host))),
                        jax.tree.leaves(s_host), strict=True):
            assert a.tobytes() == b.tobytes()


CHECKS = [name.removeprefix("check_") for name in list(globals()) if name.startswith("check_")]


def _run_checks() -> dict[str, str | None]:
    assert len(jax.local_devices()) == DEVICES, jax.local_devices()
    out = {}
    for name in CHECKS:
        try:
            globals()[f"check_{name}"]()
            out[name] = None
        except Exception:
            out[name] = traceback.format_exc()[-6000:]
    return out


# --- the tests ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_devices() -> dict[str, str | None]:
    """The checks above, run once in a subprocess with four CPU devices (a one-device island
    uses the first of them, where the plain step runs)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", CHECKS)
def test_on_four_devices(four_devices, name):
    assert four_devices[name] is None, four_devices[name]


def test_force_host_devices_before_and_after_jax_starts():
    # here JAX is up with one CPU device: asking for it again is fine, another count is not
    n = len(jax.devices("cpu"))
    env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false "
                        "--xla_force_host_platform_device_count=7"}
    force_host_devices(n, env)
    assert env["XLA_FLAGS"].split() == ["--xla_cpu_enable_fast_math=false",
                                        f"--xla_force_host_platform_device_count={n}"]
    with pytest.raises(RuntimeError, match="already initialised"):
        force_host_devices(n + 2)
    # in a fresh process it works after importing jax and the pipeline, before any operation
    code = ("import os, jax\nfrom pipeline.mesh import Placement, force_host_devices\n"
            "force_host_devices(3, os.environ)\n"
            "print(Placement().n_devices, os.environ['XLA_FLAGS'])\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**env, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["3", "--xla_force_host_platform_device_count=3"]


if __name__ == "__main__":
    print(json.dumps(_run_checks()))
