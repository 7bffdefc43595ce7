"""The fused causal-attention kernel (`workers/attention.cc`, `pipeline/attention.py`): the
same values and gradients as the JAX definition, in a whole training step too; results that
do not depend on the thread count; refusals of bad shapes; the fallbacks (no compiler,
``DILOCO_ATTENTION=xla``, a multi-device island)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline import attention
from workers import native

ROOT = Path(__file__).resolve().parents[1]
HAVE_CXX = any(shutil.which(c) for c in ("c++", "g++", "clang++")) or bool(os.environ.get("CXX"))


@pytest.fixture
def fused():
    """The kernel installed for one test (built on first use), and uninstalled after it, so
    that no other test of this process traces it."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler on this machine: the kernel cannot be built")
    assert native.install_attention() == "fused"  # a compiler is here: the build must work
    try:
        yield
    finally:
        attention.uninstall()


def _qkv(b, t, h, dh, seed=0):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.standard_normal((b * t, 3 * h * dh)).astype(np.float32)),
            jnp.asarray(r.standard_normal((b * t, h * dh)).astype(np.float32)))


# head dims with vector code (16, 32, 64) and without (3, 24); t that is not a multiple of
# the kernel's 8-row or 16-column blocks; one position; one sequence
SHAPES = [(1, 1, 1, 16), (2, 5, 2, 3), (2, 17, 2, 32), (3, 33, 1, 64), (2, 24, 3, 24),
          (1, 130, 2, 32), (4, 128, 4, 32)]


@pytest.mark.parametrize("b,t,h,dh", SHAPES)
def test_kernel_matches_the_definition(fused, b, t, h, dh):
    qkv, w = _qkv(b, t, h, dh)

    def loss(x):
        return jnp.sum(attention.causal(x, b, t, h) * w)

    y = jax.jit(lambda x: attention.causal(x, b, t, h))(qkv)
    g = jax.jit(jax.grad(loss))(qkv)
    text = jax.jit(jax.grad(loss)).lower(qkv).as_text()
    assert attention.FORWARD_TARGET in text and attention.BACKWARD_TARGET in text
    with attention.unfused():
        y_ref = attention.causal(qkv, b, t, h)
        g_ref = jax.grad(loss)(qkv)
        assert attention.FORWARD_TARGET not in jax.jit(jax.grad(loss)).lower(qkv).as_text()
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=2e-6)
    scale = float(jnp.max(jnp.abs(g_ref)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=2e-6 * scale)
    # the gradient reaches every part of qkv: q (not the first row's), k and v
    assert float(jnp.min(jnp.max(jnp.abs(g), axis=0))) > 0 or t == 1


def test_a_training_step_matches_the_definition(fused):
    from pipeline import config as cfgmod
    from pipeline.task import task_of
    from pipeline.train import make_step

    cfg = cfgmod.override(cfgmod.RunConfig(), **{"model.seq_len": 48, "inner.batch_size": 4})
    task = task_of(cfg)
    batch = jnp.asarray(np.random.default_rng(1).integers(
        0, cfg.model.vocab_size, (4, cfg.model.seq_len + 1)), jnp.int32)

    def three_steps():
        opt = task.optimizer()
        params = task.init_params(cfg.seed)
        state = opt.init(params)
        step = make_step(task, opt)
        losses = []
        for _ in range(3):
            params, state, m = step(params, state, batch)
            losses.append(float(m["loss"]))
        return params, losses

    p_fused, l_fused = three_steps()
    with attention.unfused():
        p_ref, l_ref = three_steps()
    np.testing.assert_allclose(l_fused, l_ref, rtol=1e-5)
    for k in p_ref:
        np.testing.assert_allclose(np.asarray(p_fused[k]), np.asarray(p_ref[k]), rtol=1e-4,
                                   atol=1e-6, err_msg=k)


def test_bad_shapes_are_refused(fused):
    qkv, _ = _qkv(2, 8, 2, 16)
    with pytest.raises(ValueError, match="not \\[b\\*t"):
        attention.causal(qkv, 3, 8, 2)  # 2·8 rows are not 3·8
    with pytest.raises(ValueError, match="not \\[b\\*t"):
        attention.causal(qkv, 2, 8, 5)  # 96 columns are not 3·5·head_dim
    # the kernel checks its operands itself: a call that bypasses `causal` is refused by it
    with pytest.raises(Exception, match="b \\* t rows"):
        jax.block_until_ready(attention._forward_call(qkv, 4, 8, 2))
    wide, _ = _qkv(1, 2, 1, 300)
    with pytest.raises(Exception, match="head_dim 1 .. 256"):
        jax.block_until_ready(attention._forward_call(wide, 1, 2, 1))


_CHILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from pipeline import attention
from workers import native
backend = native.install_attention()
out = {"backend": backend, "cpus": len(__import__("os").sched_getaffinity(0))}
if backend == "fused":
    r = np.random.default_rng(3)
    b, t, h, dh = 8, 64, 4, 32
    qkv = jnp.asarray(r.standard_normal((b * t, 3 * h * dh)).astype(np.float32))
    w = jnp.asarray(r.standard_normal((b * t, h * dh)).astype(np.float32))
    g = jax.jit(jax.grad(lambda x: jnp.sum(attention.causal(x, b, t, h) * w)))(qkv)
    out["grad"] = np.asarray(g).tobytes().hex()
print(json.dumps(out))
"""


def _child(env_extra: dict[str, str], cpus: str | None = None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env_extra}
    cmd = [sys.executable, "-c", _CHILD]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler on this machine")
@pytest.mark.skipif(not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs taskset and two cores")
def test_results_do_not_depend_on_the_thread_count():
    one = _child({}, cpus="0")
    every = _child({})
    assert one["backend"] == every["backend"] == "fused"
    assert one["cpus"] == 1 and every["cpus"] >= 2
    assert one["grad"] == every["grad"]  # bit for bit


def test_without_a_compiler_or_when_turned_off_xla_runs_the_definition(tmp_path):
    off = _child({"DILOCO_ATTENTION": "xla"})
    assert off["backend"] == "xla"
    missing = tmp_path / "no-such-compiler"
    none = _child({"CXX": str(missing), "DILOCO_KERNEL_CACHE": str(tmp_path / "cache")})
    assert none["backend"] == "xla"
    assert "attention runs as XLA's operations" in none["stderr"]


def test_a_multi_device_island_traces_the_definition():
    """XLA's partitioner cannot split the kernel's call: an island of several devices traces
    the JAX definition, one device the kernel."""
    code = """
import jax, numpy as np
from pipeline import attention, config as cfgmod
from pipeline.mesh import Placement
from pipeline.task import task_of
from workers import native
print(native.install_attention())
cfg = cfgmod.override(cfgmod.RunConfig(), **{"model.seq_len": 16, "inner.batch_size": 4})
task = task_of(cfg)
opt = task.optimizer()
for n in (1, 2):
    pl = Placement(n)
    params = pl.params(task.init_params(0))
    state = pl.opt_state(opt.init(params))
    batch = pl.batch(np.zeros((4, 17), np.int32))
    text = pl.step(task, opt).lower(params, state, batch).as_text()
    print(n, attention.FORWARD_TARGET in text)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split()
    if lines[0] != "fused":
        pytest.skip("the kernel could not be built here")
    assert lines[1:] == ["1", "True", "2", "False"]
