"""`diloco bench step`: the learner's inner step against what this machine can do.

Side by side in one run, at each thread count (all cores, and one core):

* the machine's fp32 matrix-multiply rate: the best of numpy (its BLAS) and JAX (XLA) on
  1024 × 1024 matrices;
* the jitted training step (`pipeline.train.make_step`: forward, backward, AdamW) of the model
  `ModelConfig` defaults to, as shipped (with the fused kernels — attention, layer norm, the
  projections' weight gradients, GELU — where `workers.native.install_fused` can build them,
  as every training process does), the same step with all four as XLA's operations
  (`pipeline.fused.unfused`: the JAX definitions), with only attention and layer norm fused
  (``attention_norm_kernels``: the weight gradients and GELU as XLA's),
  and the previous implementation of its forward pass (3-D activations, attention by per-head
  einsums, the causal mask by `where`) kept here as the baseline; its FLOPs are counted as
  6 × parameters × tokens + 12 × layers × d_model × seq_len × tokens (the attention scores
  and their use, forward and backward, over the full square: the fused kernel computes only
  the causal half, and gets no discount for it), so efficiency = achieved FLOP/s ÷ the best
  matmul FLOP/s at the same thread count;
* the learner loop: one real learner process (syncing to a real syncer and Redis, learner on
  core 0, syncer and Redis on core 1), its steady steps/s ÷ the bare step's on one core,
  measured alternately (bare, loop, bare, …) so that each loop run has the bare step measured
  just before and after it (`diloco bench step-loop` runs this part alone);
* the same model's step in PyTorch, eager and compiled (`ops.bench.step_torch`), at the same
  thread count and against the same matmul rate, when torch is installed;
* the shipped step again with freed memory handed back to the system (`workers.heap` turned
  off, as every process did before it): each step then faults its scratch memory in anew
  (minor page faults per step are recorded for every step measured).

Every measurement of a thread count runs in its own process (XLA and OpenBLAS fix their
thread pools when they start), pinned with ``taskset`` where the machine has it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

N_MATMUL = 1024
WARMUP = 10  # untimed steps before the timed ones (the heap grows to its size in them)


def step_flops(d_model: int, n_layers: int, seq_len: int, params: int, tokens: int) -> float:
    """FLOPs of one training step (forward + backward) over `tokens` tokens."""
    return 6.0 * params * tokens + 12.0 * n_layers * d_model * seq_len * tokens


def _best(fn, reps: int) -> float:
    """Best wall time of `fn()` over `reps` calls (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def timed_steps(step, params, state, batch, warmup: int, steps: int):
    """Run `step(params, state, batch)` `warmup` times untimed, then `steps` times timed (each
    to completion); returns (the seconds of each timed step, params, state, the last step's
    third result)."""
    import jax

    out = None
    for _ in range(warmup):
        params, state, out = step(params, state, batch)
        jax.block_until_ready(params)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        params, state, out = step(params, state, batch)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t)
    return times, params, state, out


def _reference_forward(params, tokens, cfg):
    """The forward pass as shipped before this benchmark existed: the baseline."""
    import jax
    import jax.numpy as jnp

    from pipeline.fused import layer_norm_reference as _layer_norm

    _, t = tokens.shape
    h = cfg.n_heads
    x = params["wte"][tokens] + params["wpe"][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(cfg.n_layers):
        p = f"h{i}."
        y = _layer_norm(x, params[p + "ln1.g"], params[p + "ln1.b"])
        q, k, v = jnp.split(y @ params[p + "attn.qkv"], 3, axis=-1)
        q, k, v = (z.reshape(z.shape[0], t, h, -1) for z in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
        att = jax.nn.softmax(jnp.where(mask, att, jnp.float32(-1e30)), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape)
        x = x + y @ params[p + "attn.proj"]
        y = _layer_norm(x, params[p + "ln2.g"], params[p + "ln2.b"])
        x = x + jax.nn.gelu(y @ params[p + "mlp.fc"]) @ params[p + "mlp.proj"]
    x = _layer_norm(x, params["lnf.g"], params["lnf.b"])
    return x @ params["wte"].T


def measure(steps: int, full: bool = True) -> dict[str, Any]:
    """This process's measurements (see the module docstring); run in a fresh process.
    Without `full`, only the shipped step (the matmul rate and its efficiency included)."""
    import resource

    from workers.heap import keep_freed_memory

    heap = keep_freed_memory()  # as every process that trains does, unless turned off
    import contextlib

    import jax
    import jax.numpy as jnp

    from pipeline import fused, model
    from pipeline.config import RunConfig
    from pipeline.task import n_params, task_of
    from pipeline.train import make_step
    from workers import native

    cfg = RunConfig()
    mc = cfg.model
    task = task_of(cfg)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((N_MATMUL, N_MATMUL)).astype(np.float32)
    b = rng.standard_normal((N_MATMUL, N_MATMUL)).astype(np.float32)
    mm_flops = 2.0 * N_MATMUL**3
    out: dict[str, Any] = {"threads": len(os.sched_getaffinity(0)),
                           "matmul_n": N_MATMUL, "freed_memory": heap,
                           "fused_kernels": native.install_fused()}
    out["matmul_numpy_gflops"] = mm_flops / _best(lambda: a @ b, 20) / 1e9
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    mm = jax.jit(lambda x, y: x @ y)
    out["matmul_jax_gflops"] = mm_flops / _best(
        lambda: mm(ja, jb).block_until_ready(), 20) / 1e9
    peak = max(out["matmul_numpy_gflops"], out["matmul_jax_gflops"])
    tokens = cfg.inner.batch_size * mc.seq_len
    flops = step_flops(mc.d_model, mc.n_layers, mc.seq_len, n_params(task), tokens)
    out.update(model=dict(d_model=mc.d_model, n_layers=mc.n_layers, n_heads=mc.n_heads,
                          seq_len=mc.seq_len, batch=cfg.inner.batch_size),
               params=n_params(task), tokens_per_step=tokens, step_gflop=flops / 1e9)
    batch = jnp.asarray(rng.integers(0, mc.vocab_size, (cfg.inner.batch_size, mc.seq_len + 1)),
                        jnp.int32)
    shipped = model.forward
    forwards = (("shipped", shipped, contextlib.nullcontext),
                ("unfused", shipped, fused.unfused),
                ("attention_norm_kernels", shipped, lambda: fused.unfused("dense", "gelu")),
                ("previous", _reference_forward, contextlib.nullcontext))
    for name, fwd, tracing in forwards if full else forwards[:1]:
        model.forward = fwd  # loss_and_accuracy looks it up at trace time
        try:
            opt = task.optimizer()
            params = task.init_params(cfg.seed)
            state = opt.init(params)
            step = make_step(task, opt)
            with tracing():  # the first call traces the step
                params, state, _ = step(params, state, batch)
            for _ in range(WARMUP - 1):  # the compilation, and the heap growing to its size
                params, state, _ = step(params, state, batch)
                jax.block_until_ready(params)
            times = []
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(steps):
                t = time.perf_counter()
                params, state, m = step(params, state, batch)
                jax.block_until_ready(params)
                times.append(time.perf_counter() - t)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        finally:
            model.forward = shipped
        med = statistics.median(times)
        out[name] = {"step_s_median": med, "step_s_min": min(times),
                     "step_s_mean": statistics.fmean(times),
                     "gflops": flops / med / 1e9, "efficiency": flops / med / 1e9 / peak,
                     "loss_after": float(m["loss"]), "minor_faults_per_step": faults / steps}
    if not full:
        return out
    out["pytorch"] = _pytorch(cfg, task, np.asarray(batch), steps, flops, peak,
                              out["threads"])
    return out


def _pytorch(cfg, task, batch: np.ndarray, steps: int, flops: float, peak: float,
             threads: int) -> dict[str, Any]:
    """The same model's step in PyTorch (`ops.bench.step_torch`), from the same initial
    parameters, checked to give the JAX loss first; the reason when torch is missing."""
    from ops.bench import step_torch

    why = step_torch.available()
    if why is not None:
        return {"skipped": why}
    p0 = {k: np.asarray(v) for k, v in task.init_params(cfg.seed).items()}
    jax_loss = float(task.loss_and_accuracy(p0, batch)[0])
    torch_loss = step_torch.check_same_model(p0, batch, cfg.model, jax_loss)
    res = step_torch.measure(p0, batch, cfg.model, cfg.inner, steps, flops, peak, threads)
    return {"initial_loss_jax": jax_loss, "initial_loss_torch": torch_loss, **res}


def _child(threads: int | None, steps: int, keep: bool = True,
           full: bool | None = None, xla_flags: str | None = None) -> dict[str, Any]:
    """`measure` in a fresh process, on core 0 alone when `threads` is 1; without `keep`,
    with freed memory returned to the system (`workers.heap` off); the shipped step alone
    without `full` (default: as `keep`); `xla_flags` replace ``XLA_FLAGS``."""
    env = dict(os.environ)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    if not keep:
        from workers.heap import ENV

        env[ENV] = "0"
    cmd = [sys.executable, "-c", "import json; from ops.bench.step import measure; "
           f"print(json.dumps(measure({steps}, full={keep if full is None else full})))"]
    if threads == 1:
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", "0", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"step measurement failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _learner_loop(steps: int, quick: bool) -> dict[str, Any]:
    """The learner loop in a real run (one learner syncing to a real syncer and Redis, the
    default model, every push and checkpoint of a real run) against the bare step, both on
    core 0, interleaved — bare, loop, bare, loop, …, bare — so that each loop run is compared
    with the bare step measured just before and just after it (this VM's speed drifts by more
    than the effect within an hour). Throughput against throughput: the learner's steps over
    its wall time (the first, compiling step excluded) ÷ 1 / the bare step's mean."""
    from ops.bench.overlap import run_overlap
    from pipeline import config as cfgmod
    from pipeline.config import RunConfig

    base = cfgmod.override(RunConfig(), learners=1, steps=60 if quick else 300,
                           **{"sync.quorum": 1})
    cmd = [sys.executable, "-m", "workers.learner"]

    def bare() -> float:
        return 1.0 / _child(1, steps, full=False)["shipped"]["step_s_mean"]

    bares, loops = [bare()], []
    for _ in range(1 if quick else 3):
        loops.append(run_overlap(base, cmd, True, modes=("on",))["steps_per_s_on"])
        bares.append(bare())
    ratios = [lp / statistics.fmean(bares[i:i + 2]) for i, lp in enumerate(loops)]
    return {"steps": base.steps, "pinned": bool(shutil.which("taskset")),
            "order": "bare, loop, bare, ...: each loop against the mean of its neighbours",
            "bare_steps_per_s": bares, "loop_steps_per_s": loops, "ratios": ratios,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios)}


# XLA CPU options tried on the shipped step (`diloco bench step-flags`): each beside a run
# without it; the values of the experimental ones are those of jaxlib 0.10's flag parser
XLA_FLAG_CANDIDATES = {
    "xnn_graph_greedy": "--xla_cpu_experimental_xnn_graph_fusion_mode="
                        "XNN_GRAPH_FUSION_MODE_GREEDY",
    "xnn_fusion_dot_eltwise_reduce": "--xla_cpu_experimental_xnn_fusion_type=dot,eltwise,reduce",
    "ynn_off": "--xla_cpu_experimental_ynn_fusion_type=",
    "no_xnnpack": "--xla_cpu_use_xnnpack=false",
    "scheduler_concurrency": "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED",
    "no_concurrency_optimized_scheduler":
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    "vector_width_512": "--xla_cpu_prefer_vector_width=512",
}


def bench_xla_flags(quick: bool = False) -> dict[str, Any]:
    """The shipped step on all cores with each of `XLA_FLAG_CANDIDATES`, alternating with the
    step without flags (base, flag, base, flag, …, base) so that each is compared with the
    base runs just before and after it; the loss after the timed steps is recorded so that a
    flag that changes the numbers shows."""
    steps = 10 if quick else 30
    names = list(XLA_FLAG_CANDIDATES)[:2] if quick else list(XLA_FLAG_CANDIDATES)

    def run(flags: str) -> dict[str, Any]:
        d = _child(None, steps, full=False, xla_flags=flags)
        return {"step_s_median": d["shipped"]["step_s_median"],
                "efficiency": d["shipped"]["efficiency"],
                "loss_after": d["shipped"]["loss_after"],
                "matmul_gflops": max(d["matmul_numpy_gflops"], d["matmul_jax_gflops"])}

    base = [run("")]
    rows = {}
    for name in names:
        row = run(XLA_FLAG_CANDIDATES[name])
        base.append(run(""))
        around = statistics.fmean(b["step_s_median"] for b in base[-2:])
        rows[name] = {"flags": XLA_FLAG_CANDIDATES[name], **row,
                      "speedup_vs_neighbouring_base": around / row["step_s_median"]}
    times = [b["step_s_median"] for b in base]
    return {"bench": "step-flags", "cores": os.cpu_count(), "steps": steps, "base": base,
            "base_step_s_range": [min(times), max(times)], "flags": rows}


def bench_learner_loop(quick: bool = False) -> dict[str, Any]:
    """The learner-loop part of `bench_step` alone (`diloco bench step-loop`)."""
    return {"bench": "step-loop", "cores": os.cpu_count(),
            **_learner_loop(10 if quick else 40, quick)}


def bench_step(quick: bool = False) -> dict[str, Any]:
    """The step benchmark's JSON (see the module docstring)."""
    steps = 10 if quick else 40
    out: dict[str, Any] = {"bench": "step", "cores": os.cpu_count()}
    out["all_cores"] = _child(None, steps)
    out["one_core"] = _child(1, steps)
    # the same step with every freed buffer handed back to the system, as before
    # `workers.heap` (each step faults its scratch memory in again)
    out["all_cores_freed_returned"] = _child(None, steps, keep=False)
    out["one_core_freed_returned"] = _child(1, steps, keep=False)
    out["learner_loop"] = _learner_loop(steps, quick)
    for key in ("all_cores", "one_core"):
        m = out[key]
        m["speedup"] = m["previous"]["step_s_median"] / m["shipped"]["step_s_median"]
        m["speedup_fused_kernels"] = (m["unfused"]["step_s_median"]
                                      / m["shipped"]["step_s_median"])
        m["speedup_dense_gelu_kernels"] = (m["attention_norm_kernels"]["step_s_median"]
                                           / m["shipped"]["step_s_median"])
        m["speedup_kept_memory"] = (out[key + "_freed_returned"]["shipped"]["step_s_median"]
                                    / m["shipped"]["step_s_median"])
    return out
