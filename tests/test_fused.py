"""The fused kernels (`workers/fused.cc`, `pipeline/fused.py`: attention, layer norm, the
projections' weight gradient, GELU): the same values and gradients as the JAX definitions, in a
whole training step too; results that do not depend on the thread count; refusals of bad
shapes; the fallbacks (no compiler, ``DILOCO_FUSED=xla``, a multi-device island)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline import fused
from workers import native

ROOT = Path(__file__).resolve().parents[1]
HAVE_CXX = native._cxx() is not None


@pytest.fixture
def kernels(monkeypatch):
    """The kernels installed for one test (built on first use; asked for with
    ``DILOCO_FUSED=fused``, so that they run on every host, whatever its vector width), and
    uninstalled after it, so that no other test of this process traces them."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler on this machine: the kernel cannot be built")
    if os.environ.get(native.FUSED_ENV, "").lower() == "xla":
        pytest.skip(f"{native.FUSED_ENV}=xla turns the kernels off")
    monkeypatch.setenv(native.FUSED_ENV, "fused")
    assert native.install_fused() == "fused"  # a compiler is here: the build must work
    try:
        yield
    finally:
        fused.uninstall()


def _qkv(b, t, h, dh, seed=0, scale=1.0):
    r = np.random.default_rng(seed)
    return (jnp.asarray((scale * r.standard_normal((b * t, 3 * h * dh))).astype(np.float32)),
            jnp.asarray(r.standard_normal((b * t, h * dh)).astype(np.float32)))


# head dims with vector code (16, 32, 64) and without (3, 24, 48, 128, 256: the widest it
# takes); t that is not a multiple of the kernel's 8-row or 16-column blocks; one position;
# one sequence; scores of spread ~64, where many of a row's weights underflow to 0 (scale 8)
SHAPES = [(1, 1, 1, 16, 1.0), (2, 5, 2, 3, 1.0), (2, 17, 2, 32, 1.0), (3, 33, 1, 64, 1.0),
          (2, 24, 3, 24, 1.0), (1, 130, 2, 32, 1.0), (4, 128, 4, 32, 1.0), (2, 19, 2, 48, 1.0),
          (1, 40, 1, 128, 1.0), (1, 9, 1, 256, 1.0), (2, 50, 2, 32, 8.0), (1, 37, 1, 24, 8.0)]


def _value_and_vjp(f, w, *args):
    """f(*args) and the gradient of sum(f * w), from one compiled function, and its lowered
    text (one trace and one compile: a test's time goes to XLA's compiler, not to the check)."""
    def both(*a):
        y, vjp = jax.vjp(f, *a)
        return y, vjp(w)
    lowered = jax.jit(both).lower(*args)
    y, g = lowered.compile()(*args)
    return y, g, lowered.as_text()


@pytest.mark.parametrize("b,t,h,dh,scale", SHAPES)
def test_kernel_matches_the_definition(kernels, b, t, h, dh, scale):
    qkv, w = _qkv(b, t, h, dh, scale=scale)

    def attend(x):
        return fused.causal_attention(x, b, t, h)

    y, (g,), text = _value_and_vjp(attend, w, qkv)
    assert fused.FORWARD_TARGET in text and fused.BACKWARD_TARGET in text
    with fused.unfused():
        y_ref, (g_ref,), text = _value_and_vjp(attend, w, qkv)
        assert fused.FORWARD_TARGET not in text
    # large scores carry float32's rounding of the scores into the weights: a looser bound
    # (and so does an output's absolute error, whatever its size: a sum of weights ~1 whose
    # own errors are the scores' rounding, ~|score| float32 ulps, times values ~1)
    tol = 1e-5 * scale**2
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=tol,
                               atol=2e-6 * scale**2)
    big = float(jnp.max(jnp.abs(g_ref)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=10 * tol, atol=2e-6 * big)
    # the gradient reaches every part of qkv: q (not the first row's), k and v
    assert float(jnp.min(jnp.max(jnp.abs(g), axis=0))) > 0 or t == 1 or scale > 1


@pytest.mark.parametrize("n,d", [(1, 1), (3, 5), (64, 128), (130, 128), (1000, 24)])
def test_layer_norm_kernel_matches_the_definition(kernels, n, d):
    r = np.random.default_rng(n + d)
    x = jnp.asarray((3 + 2 * r.standard_normal((n, d))).astype(np.float32))
    g, b = (jnp.asarray(r.standard_normal(d).astype(np.float32)) for _ in range(2))
    w = jnp.asarray(r.standard_normal((n, d)).astype(np.float32))

    y, grads, text = _value_and_vjp(fused.layer_norm, w, x, g, b)
    assert fused.NORM_FORWARD_TARGET in text and fused.NORM_BACKWARD_TARGET in text
    with fused.unfused():
        y_ref, grads_ref, _ = _value_and_vjp(fused.layer_norm, w, x, g, b)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_ref, strict=True):
        scale = float(jnp.max(jnp.abs(want))) or 1.0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                                   atol=1e-5 * scale)


def test_layer_norm_of_other_shapes_runs_the_definition(kernels):
    x = jnp.ones((2, 3, 4), jnp.float32)
    g = b = jnp.ones(4, jnp.float32)
    text = jax.jit(fused.layer_norm).lower(x, g, b).as_text()
    assert fused.NORM_FORWARD_TARGET not in text  # 3-D: the kernel takes [n, d]
    assert fused.NORM_FORWARD_TARGET in jax.jit(fused.layer_norm).lower(
        x[0], g, b).as_text()


# (k, m, n): one element; edges of the 8-row parts and 32-column panels; k in several chunks,
# with a short last one; two column groups and two k ranges (the step's qkv projection); four
# k ranges, the last one short; three column groups; two blocks of rows, the second with a
# partial part; k = 0
GRAM_SHAPES = [(1, 1, 1), (5, 3, 7), (300, 65, 33), (2048, 128, 384), (513, 130, 70),
               (1030, 8, 40), (700, 12, 200), (600, 9, 600), (300, 300, 40), (0, 3, 4)]


@pytest.mark.parametrize("k,m,n", GRAM_SHAPES)
def test_weight_gradient_kernel_matches_the_product(kernels, k, m, n):
    r = np.random.default_rng(k + m + n)
    a = r.standard_normal((k, m)).astype(np.float32)
    b = r.standard_normal((k, n)).astype(np.float32)
    got = np.asarray(jax.jit(fused._weight_grad_call)(jnp.asarray(a), jnp.asarray(b)))
    want = a.astype(np.float64).T @ b.astype(np.float64)
    assert got.shape == (m, n)
    # float32 sums of k products of unit normals: error ~ sqrt(k) ulps of the terms
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * max(k, 1))


def test_dense_gradients_match_the_definition(kernels):
    r = np.random.default_rng(7)
    x = jnp.asarray(r.standard_normal((96, 40)).astype(np.float32))
    w = jnp.asarray(r.standard_normal((40, 72)).astype(np.float32))
    t = jnp.asarray(r.standard_normal((96, 72)).astype(np.float32))

    def loss(x, w):
        return jnp.sum(jnp.tanh(fused.dense(x, w)) * t)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert fused.WEIGHT_GRAD_TARGET in jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        x, w).as_text()
    with fused.unfused():
        assert fused.WEIGHT_GRAD_TARGET not in jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
            x, w).as_text()
        want = jax.grad(loss, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(fused.dense(x, w)), np.asarray(x @ w))
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # a product of other ranks runs as it is
    x3 = x.reshape(2, 48, 40)
    assert fused.WEIGHT_GRAD_TARGET not in jax.jit(jax.grad(
        lambda x: jnp.sum(fused.dense(x, w)))).lower(x3).as_text()


def test_gelu_kernel_matches_the_definition(kernels):
    r = np.random.default_rng(11)
    # a shape that is no multiple of 16 lanes or of the kernel's blocks; tails of both signs;
    # values whose tanh saturates, whose cube overflows, and the edge values
    body = 4 * r.standard_normal(40_000 - 11)
    edges = [0.0, -0.0, 1e-8, -1e-8, 12.0, -12.0, 30.0, -30.0, 1e20, -1e20, np.inf]
    x = np.concatenate([body, edges]).astype(np.float32).reshape(200, 200)
    w = r.standard_normal(x.shape).astype(np.float32)

    def loss(x):
        return jnp.sum(fused.gelu(x) * w)

    y = np.asarray(jax.jit(fused.gelu)(jnp.asarray(x)))
    g = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(x)))
    assert fused.GELU_FORWARD_TARGET in jax.jit(fused.gelu).lower(x).as_text()
    assert fused.GELU_BACKWARD_TARGET in jax.jit(jax.grad(loss)).lower(x).as_text()
    with fused.unfused():
        assert fused.GELU_FORWARD_TARGET not in jax.jit(lambda x: fused.gelu(x)).lower(x).as_text()
        y_ref = np.asarray(fused.gelu(jnp.asarray(x)))
    # against float64 (the definition's float32 tanh loses ~3e-4 relative where x is ~ -4)
    X = x.astype(np.float64)
    c = np.sqrt(2 / np.pi)
    with np.errstate(over="ignore", invalid="ignore"):
        t = np.tanh(c * (X + 0.044715 * X**3))
        want_y = 0.5 * X * (1 + t)
        want_g = w * (0.5 * (1 + t) + 0.5 * X * (1 - t * t) * c * (1 + 3 * 0.044715 * X * X))
    fin = np.isfinite(want_y)
    np.testing.assert_allclose(y[fin], want_y[fin], rtol=5e-6, atol=1e-6)
    np.testing.assert_allclose(y, y_ref, rtol=1e-3, atol=1e-6)
    assert y.ravel()[-1] == np.inf and y.ravel()[-2] == 0.0  # gelu(inf), gelu(-1e20)
    gfin = np.isfinite(want_g)
    np.testing.assert_allclose(g[gfin], want_g[gfin], rtol=1e-5, atol=2e-6)
    # a huge input's derivative is 1 (or 0), never 0 * inf
    assert g.ravel()[-3] == w.ravel()[-3] and g.ravel()[-2] == 0.0


def test_a_training_step_matches_the_definition(kernels):
    from pipeline import config as cfgmod
    from pipeline.task import task_of
    from pipeline.train import make_step

    cfg = cfgmod.override(cfgmod.RunConfig(), **{"model.seq_len": 48, "inner.batch_size": 4,
                                                 "model.n_layers": 2})
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
    with fused.unfused():
        p_ref, l_ref = three_steps()
    np.testing.assert_allclose(l_fused, l_ref, rtol=1e-5)
    for k in p_ref:
        np.testing.assert_allclose(np.asarray(p_fused[k]), np.asarray(p_ref[k]), rtol=1e-4,
                                   atol=1e-6, err_msg=k)


def test_unfused_turns_off_the_kernels_named(kernels):
    from pipeline import config as cfgmod
    from pipeline.task import task_of

    cfg = cfgmod.override(cfgmod.RunConfig(), **{"model.seq_len": 16, "inner.batch_size": 2})
    task = task_of(cfg)
    params = task.init_params(0)
    batch = jnp.zeros((2, 17), jnp.int32)
    targets = {"attention": fused.FORWARD_TARGET, "layer_norm": fused.NORM_FORWARD_TARGET,
               "dense": fused.WEIGHT_GRAD_TARGET, "gelu": fused.GELU_FORWARD_TARGET}

    def traced() -> set[str]:
        text = jax.jit(jax.grad(lambda p: task.loss_and_accuracy(p, batch)[0])).lower(
            params).as_text()
        return {name for name, target in targets.items() if target in text}

    assert traced() == set(fused.KERNELS)
    with fused.unfused("gelu", "dense"):
        assert traced() == {"attention", "layer_norm"}
        with fused.unfused():
            assert traced() == set()
        assert traced() == {"attention", "layer_norm"}
    assert traced() == set(fused.KERNELS)
    with pytest.raises(ValueError, match="no kernel named softmax"):
        with fused.unfused("softmax"):
            pass


def test_bad_shapes_are_refused(kernels):
    qkv, _ = _qkv(2, 8, 2, 16)
    with pytest.raises(ValueError, match="not \\[b\\*t"):
        fused.causal_attention(qkv, 3, 8, 2)  # 2·8 rows are not 3·8
    with pytest.raises(ValueError, match="not \\[b\\*t"):
        fused.causal_attention(qkv, 2, 8, 5)  # 96 columns are not 3·5·head_dim
    # the kernel checks its operands itself: a call that bypasses `causal` is refused by it
    with pytest.raises(Exception, match="b \\* t rows"):
        jax.block_until_ready(fused._forward_call(qkv, 4, 8, 2))
    wide, _ = _qkv(1, 2, 1, 300)
    with pytest.raises(Exception, match="head_dim 1 .. 256"):
        jax.block_until_ready(fused._forward_call(wide, 1, 2, 1))
    # a head wider than the kernel takes runs the definition
    assert fused.FORWARD_TARGET not in jax.jit(
        lambda x: fused.causal_attention(x, 1, 2, 1)).lower(wide).as_text()
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(Exception, match="operand shapes do not match"):
        jax.block_until_ready(fused._norm_forward_call(x, jnp.ones(7), jnp.ones(8)))
    with pytest.raises(Exception, match="gelu: x, dy and the result"):
        jax.block_until_ready(fused._fused_gelu_bwd(x, jnp.ones(3, jnp.float32)))
    with pytest.raises(Exception, match="weight gradient: a must be"):
        jax.block_until_ready(fused._weight_grad_call(x, jnp.ones((5, 3), jnp.float32)))


_CHILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
import jax, jax.numpy as jnp, numpy as np
from pipeline import fused
from workers import native
backend = native.install_fused()
out = {"backend": backend, "cpus": len(__import__("os").sched_getaffinity(0)),
       "disabled": sorted(fused._disabled), "vector_bits": native._vector_bits}
if backend == "fused":
    r = np.random.default_rng(3)
    b, t, h, dh = 8, 64, 4, 32
    qkv = jnp.asarray(r.standard_normal((b * t, 3 * h * dh)).astype(np.float32))
    w = jnp.asarray(r.standard_normal((b * t, h * dh)).astype(np.float32))
    g = jax.jit(jax.grad(lambda x: jnp.sum(fused.causal_attention(x, b, t, h) * w)))(qkv)
    out["grad"] = np.asarray(g).tobytes().hex()
    x = jnp.asarray(r.standard_normal((1000, 96)).astype(np.float32))
    gb = jnp.asarray(r.standard_normal((2, 96)).astype(np.float32))
    gn = jax.jit(jax.grad(lambda x, g, b: jnp.sum(fused.layer_norm(x, g, b) ** 3),
                          argnums=(0, 1, 2)))(x, gb[0], gb[1])
    out["norm_grad"] = b"".join(np.asarray(a).tobytes() for a in gn).hex()
    a, d = (jnp.asarray(r.standard_normal((1500, c)).astype(np.float32)) for c in (72, 200))
    out["weight_grad"] = np.asarray(jax.jit(fused._weight_grad_call)(a, d)).tobytes().hex()
    gg = jax.jit(jax.grad(lambda x: jnp.sum(fused.gelu(x) * d)))(d * 3)
    out["gelu_grad"] = np.asarray(gg).tobytes().hex()
print(json.dumps(out))
"""


def _child(env_extra: dict[str, str], cpus: str | None = None) -> dict:
    """`_CHILD` in a process of its own: this environment without the ``DILOCO_*`` variables
    but the kernel cache's (the suite may run under any of them), and `env_extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DILOCO_") or k == "DILOCO_KERNEL_CACHE"}
    env = {**env, "JAX_PLATFORMS": "cpu", **env_extra}
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
    one = _child({native.FUSED_ENV: "fused"}, cpus="0")
    every = _child({native.FUSED_ENV: "fused"})
    assert one["backend"] == every["backend"] == "fused"
    assert one["cpus"] == 1 and every["cpus"] >= 2
    assert one["grad"] == every["grad"]  # bit for bit
    assert one["norm_grad"] == every["norm_grad"]
    assert one["weight_grad"] == every["weight_grad"]
    assert one["gelu_grad"] == every["gelu_grad"]


def test_without_a_compiler_or_when_turned_off_xla_runs_the_definition(tmp_path):
    off = _child({"DILOCO_FUSED": "xla"})
    assert off["backend"] == "xla"
    some = _child({"DILOCO_FUSED": "xla:gelu,Dense,softmax"})
    if some["vector_bits"] >= native.FUSED_MIN_VECTOR_BITS:  # an AVX-512 host
        assert some["backend"] == "fused" and some["disabled"] == ["dense", "gelu"]
        assert "no kernel named softmax" in some["stderr"]
    else:
        assert some["backend"] == "xla"
    no_cxx = {"CXX": str(tmp_path / "no-such-compiler"),
              "DILOCO_KERNEL_CACHE": str(tmp_path / "cache")}
    assert _child(no_cxx)["backend"] == "xla"
    # insisting on the kernels reaches the build on every host (without it a host without
    # AVX-512 builds nothing: test_the_kernels_run_only_where_they_are_built_for_512_bit_vectors)
    none = _child({**no_cxx, "DILOCO_FUSED": "fused"})
    assert none["backend"] == "xla"
    assert "the model's fused operations run as XLA's" in none["stderr"]


@pytest.mark.slow  # ~21 s of compiling for three targets: the full tier (CI)
@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler on this machine")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 targets")
def test_the_kernels_run_only_where_they_are_built_for_512_bit_vectors(tmp_path):
    """Built for AVX2 (256-bit vectors: the kernels' register blocks spill, and the step is
    several times slower than XLA's operations), the step runs XLA's operations and says
    why; ``DILOCO_FUSED=fused`` runs the kernels anyway, and they still agree with the
    definitions. Built for AVX-512 (on a host that has it), they run."""
    env = {native.MARCH_ENV: "x86-64-v3", "DILOCO_KERNEL_CACHE": str(tmp_path / "cache"),
           native.FUSED_ENV: ""}
    if not native._host_runs("-march=x86-64-v3"):
        pytest.skip("this CPU has no AVX2")
    auto = _child(env)  # known from the target: nothing is built
    assert auto["backend"] == "xla" and auto["vector_bits"] == 0
    assert "would be built for 256-bit vectors (-march=x86-64-v3)" in auto["stderr"]
    assert not list((tmp_path / "cache").glob("fused-*"))
    forced = _child({**env, native.FUSED_ENV: "fused"})
    if forced["vector_bits"] == 0:
        pytest.skip(f"the compiler cannot build for x86-64-v3: {forced['stderr'][-500:]}")
    assert forced["backend"] == "fused" and forced["vector_bits"] == 256  # the library agrees
    if native._host_runs("-march=x86-64-v4"):
        wide = _child({**env, native.MARCH_ENV: "x86-64-v4"})
        assert wide["vector_bits"] == 512 and wide["backend"] == "fused"
    else:  # code this CPU cannot run is not loaded
        wide = _child({**env, native.MARCH_ENV: "x86-64-v4"})
        assert wide["backend"] == "xla" and "this CPU cannot run code built for it" in \
            wide["stderr"]


def test_a_kernel_target_name_is_checked(monkeypatch, caplog):
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    assert native._march() == "-march=x86-64-v3"
    monkeypatch.setenv(native.MARCH_ENV, "native -o /etc/passwd")
    with caplog.at_level("WARNING", logger="diloco.native"):
        assert native._march() == "-march=native"
    assert "is not a -march target name" in caplog.text


def test_a_multi_device_island_traces_the_definition():
    """XLA's partitioner cannot split the kernels' calls: an island of several devices traces
    the JAX definitions, one device the kernels."""
    code = """
import jax, numpy as np
from pipeline import config as cfgmod, fused
from pipeline.mesh import Placement
from pipeline.task import task_of
from workers import native
print(native.install_fused())
cfg = cfgmod.override(cfgmod.RunConfig(), **{"model.seq_len": 16, "inner.batch_size": 4})
task = task_of(cfg)
opt = task.optimizer()
for n in (1, 2):
    pl = Placement(n)
    params = pl.params(task.init_params(0))
    state = pl.opt_state(opt.init(params))
    batch = pl.batch(np.zeros((4, 17), np.int32))
    text = pl.step(task, opt).lower(params, state, batch).as_text()
    print(n, fused.FORWARD_TARGET in text, fused.NORM_FORWARD_TARGET in text,
          fused.WEIGHT_GRAD_TARGET in text, fused.GELU_FORWARD_TARGET in text)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", native.FUSED_ENV: "fused",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.split()
    if lines[0] != "fused":
        pytest.skip("the kernel could not be built here")
    assert lines[1:] == ["1", *["True"] * 4, "2", *["False"] * 4]


_SANITIZED = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from pipeline import fused
from workers import native
shapes = json.loads(sys.argv[1])
backend = native.install_fused()
lib = native._fused_library()
out = {"backend": backend, "library": lib.name if lib else None, "errors": {}}
r = np.random.default_rng(5)


def normal(*shape, scale=1.0):
    return jnp.asarray((scale * r.standard_normal(shape)).astype(np.float32))


def check(name, kernel, reference, *args):
    # each target called on its own: its operands are the call's own arguments and results,
    # each an allocation of its own, whose ends the sanitizer watches (inside one jitted
    # program XLA may pack several into one buffer)
    got, want = jax.jit(kernel)(*args), jax.jit(reference)(*args)
    gaps = [float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)),
                         initial=0) / max(float(np.max(np.abs(w), initial=0)), 1.0))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]
    out["errors"][name] = max(gaps, default=0.0)


def vjp(f, *args):
    # (f(args), the gradient of <f(args), dy>): the reference of a forward and backward call
    y, back = jax.vjp(f, *args[:-1])
    return y, back(args[-1])


for b, t, h, dh, scale in shapes["attention"]:
    qkv, dy = normal(b * t, 3 * h * dh, scale=scale), normal(b * t, h * dh)
    def kernel(qkv, dy):
        y, lse = fused._forward_call(qkv, b, t, h)
        return y, fused._fused_bwd(b, t, h, (qkv, y, lse), dy)
    check(f"attention {b},{t},{h},{dh}", kernel,
          lambda qkv, dy: vjp(lambda q: fused.attention_reference(q, b, t, h), qkv, dy), qkv, dy)
for n, d in shapes["layer_norm"]:
    x, dy, g, bias = normal(n, d), normal(n, d), normal(d), normal(d)
    def kernel(x, g, bias, dy):
        y, rstd = fused._norm_forward_call(x, g, bias)
        return y, fused._fused_norm_bwd((x, g, rstd), dy)
    check(f"layer_norm {n},{d}", kernel,
          lambda *a: vjp(fused.layer_norm_reference, *a), x, g, bias, dy)
for k, m, n in shapes["gram"]:
    check(f"weight_grad {k},{m},{n}", fused._weight_grad_call,
          lambda a, c: jnp.matmul(a.T, c, precision="highest"), normal(k, m), normal(k, n))
for n in shapes["gelu"]:
    check(f"gelu {n}", lambda x, dy: (fused._fused_gelu(x), fused._fused_gelu_bwd(x, dy)),
          lambda x, dy: vjp(fused.gelu_reference, x, dy), normal(n, scale=4.0), normal(n))
print(json.dumps(out))
"""


@pytest.mark.slow  # ~21 s of compiling: the full tier (CI)
@pytest.mark.timeout(900)  # the sanitized build, on a machine whose cache is empty
def test_the_kernels_run_clean_under_the_address_and_undefined_behaviour_sanitizers(
        sanitizer):
    """Every kernel's target, forward and backward, called on its own on the edge shapes of
    the tests above, built with ``-fsanitize=address,undefined`` (``DILOCO_SANITIZE``) in a
    process with the sanitizer's runtime preloaded: no read or write past the ends of the
    operands XLA hands it, no undefined behaviour, the definitions' values. (An overread of
    16 floats at a GELU tail, planted to try this test, is reported: "READ of size 64 … 0
    bytes to the right of 12000-byte region".)"""
    # lengths of GELU: under one vector, a vector and a tail, a block of 16,384 and a tail
    shapes = {"attention": SHAPES, "layer_norm": [(1, 1), (3, 5), (130, 128), (1000, 24)],
              "gram": GRAM_SHAPES, "gelu": [1, 15, 17, 16_384 + 5, 40_000 - 11]}
    done = subprocess.run([sys.executable, "-c", _SANITIZED, json.dumps(shapes)], cwd=ROOT,
                          env={**sanitizer.env, native.FUSED_ENV: "fused"},
                          capture_output=True, text=True, timeout=600, check=False)
    report = sanitizer.reports(done.stderr)
    assert done.returncode == 0 and not report, (report or done.stderr.splitlines())[-40:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "fused" and out["library"].startswith("fused-jaxlib")
    assert "-sanitized" in out["library"]  # the sanitized build ran, not the plain one
    assert len(out["errors"]) == sum(map(len, shapes.values()))
    bad = {k: v for k, v in out["errors"].items() if not v <= 1e-3}
    assert not bad, bad


def test_sanitizer_names_are_checked(monkeypatch, caplog):
    monkeypatch.setenv(native.SANITIZE_ENV, "Address,undefined")
    assert "-fsanitize=address,undefined" in native._sanitize_flags()
    monkeypatch.setenv(native.SANITIZE_ENV, "address -o /etc/passwd")
    with caplog.at_level("WARNING", logger="diloco.native"):
        assert native._sanitize_flags() == []
    assert "is not a list of sanitizer names" in caplog.text
    monkeypatch.delenv(native.SANITIZE_ENV)
    assert native._sanitize_flags() == []


_EXPORT = """
import json
import jax, numpy as np
from jax import export
from pipeline import fused
from pipeline.config import RunConfig
from pipeline.mesh import Placement
from pipeline.task import task_of
from pipeline.train import make_step
from workers import native
out = {"backend": native.install_fused()}
cfg = RunConfig()
task = task_of(cfg)
opt = task.optimizer()
params = task.init_params(0)
state = opt.init(params)
batch = np.zeros((cfg.inner.batch_size, cfg.model.seq_len + 1), np.int32)
steps = {"learner": make_step(task, opt), "island": Placement(1).step(task, opt)}
targets = sorted(fused.SYMBOLS)
checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets]
for name, step in steps.items():
    for platform in ("cpu", "cuda", "tpu"):
        exp = export.export(step, platforms=[platform], disabled_checks=checks)(
            params, state, batch)
        text = exp.mlir_module()
        out[name + "/" + platform] = [t for t in targets if t in text]
print(json.dumps(out))
"""


@pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler on this machine")
def test_the_kernels_are_chosen_by_the_platform_a_step_is_lowered_for():
    """With the kernels installed as a learner installs them, the default model's learner step
    and a one-device island's step exported for the CPU hold the kernels' calls, and exported
    for CUDA and TPU (from this CPU-only process) hold none: the choice follows the platform
    the program is lowered for, not the process's default backend."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", native.FUSED_ENV: "fused"}
    done = subprocess.run([sys.executable, "-c", _EXPORT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "fused"
    for name in ("learner", "island"):
        assert out[f"{name}/cpu"] == sorted(fused.SYMBOLS), out
        assert out[f"{name}/cuda"] == out[f"{name}/tpu"] == [], out


_FALLBACK = """
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO)
from workers import native
if sys.argv[1] == "missing-source":
    native._SRC = native._FUSED_SRC = Path("/nonexistent/diloco-source.c")
print(json.dumps({"merge": native.install(), "fused": native.install_fused()}))
"""


@pytest.mark.skipif(not HAVE_CXX or not (os.environ.get("CC") or shutil.which("cc")
                                          or shutil.which("gcc")),
                    reason="no C or C++ compiler on this machine")
@pytest.mark.parametrize("case", ["missing-source", "corrupt-library"])
def test_a_missing_source_or_a_corrupt_cached_library_is_a_logged_fallback(tmp_path, case):
    """Neither stops a process: numpy merges and XLA's operations run, and the log says why."""
    cache = tmp_path / "cache"
    cache.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    if any(k.startswith("DILOCO_") and k != "DILOCO_KERNEL_CACHE" for k in os.environ):
        pytest.skip("the libraries' names and fallbacks here are those of the defaults")
    if case == "corrupt-library":  # the names the libraries have in the cache, garbage inside
        for lib in (native._fused_library(), native._compiled(
                "kernels", native._SRC, native.os.environ.get("CC") or shutil.which("cc")
                or shutil.which("gcc"), [*native._FLAGS, native._march()], "")):
            assert lib is not None and lib.exists()
            (cache / lib.name).write_bytes(b"\x7fELF not a library")
    env = {**base, "JAX_PLATFORMS": "cpu", "DILOCO_KERNEL_CACHE": str(cache),
           native.FUSED_ENV: "fused"}
    done = subprocess.run([sys.executable, "-c", _FALLBACK, case], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"merge": "numpy",
                                                                "fused": "xla"}
    said = "reading /nonexistent" if case == "missing-source" else f"loading {cache}/"
    assert done.stderr.count(said) == 2, done.stderr[-3000:]
    assert "the merge runs on numpy" in done.stderr
    assert "the model's fused operations run as XLA's" in done.stderr
