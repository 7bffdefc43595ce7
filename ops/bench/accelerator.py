"""`diloco bench accelerator`: the prepared check for a host with a GPU or TPU (it runs on the
CPU too, where the test suite runs it at a tiny size).

In one process, on JAX's default device:

* the device's matrix-multiply rate in bf16 and fp32 (square products of `matmul_n`);
* the learner's jitted training step of a byte-level GPT of at least 100M parameters
  (`big_model`: d_model 1024, 8 layers, seq 512, batch 8) in fp32, and in bf16 (mixed
  precision: float32 master parameters and AdamW state, the forward and backward pass on a
  bf16 copy), each step's FLOPs counted as `ops.bench.step.step_flops`, so that achieved
  FLOP/s ÷ the same run's matmul rate is the step's efficiency.

Then two real `diloco run`s of two learners sharing that device (each learner its own
process: ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so that both fit), with a real syncer and an
embedded redis-server: one syncing (H = 32, 8 fragments: a push every 4 steps), one that never
syncs during the
run (H past the run's end: the same processes, no fragment ever due). Overlap = each
learner's steady steps/s syncing ÷ not syncing; the training thread's time in the learner's
own sync work (`LearnerFinal.sync_s`: pushes, applying merged values, heartbeats) per push
and as a fraction of the training time is what a push and an apply block it.

It writes JSON. A GPU host needs, beside the package: a JAX with its accelerator plugin
(``pip install 'decoupled-diloco[cuda12]'`` or ``[cuda13]``, ``[tpu]``), redis-server on the
PATH (the runs start their own), and ~5 minutes.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.bench.step import step_flops, timed_steps

# fragments: the big model's 101.5M values in 8 fragments of ~12.7M, so that each fragment's
# syncer state (Θ, momentum and kept versions) stays well under Redis's 512 MB value limit
BIG = {"d_model": 1024, "n_layers": 8, "n_heads": 16, "seq_len": 512, "batch": 8,
       "fragments": 8, "sync_every": 32}
TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32, "batch": 4, "fragments": 2,
        "sync_every": 8}


def _device() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    return {"platform": dev.platform, "device_kind": dev.device_kind,
            "devices": jax.device_count(), "jax": jax.__version__}


def matmul_rate(dtype: str, n: int, reps: int = 10) -> float:
    """FLOP/s of an n × n by n × n product in `dtype` on the default device (best of `reps`)."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(k2, (n, n), jnp.float32).astype(dtype)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def _run_config(size: dict[str, int], **top: Any):
    from pipeline import config as cfgmod

    return cfgmod.override(cfgmod.RunConfig(), **{
        "model.d_model": size["d_model"], "model.n_layers": size["n_layers"],
        "model.n_heads": size["n_heads"], "model.seq_len": size["seq_len"],
        "inner.batch_size": size["batch"], **top})


def step_rate(size: dict[str, int], dtype: str, steps: int) -> dict[str, Any]:
    """The training step of the model of `size` on the default device, in `dtype` ("float32",
    or "bfloat16": a bf16 copy of the float32 parameters for the forward and backward pass)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from pipeline.task import n_params, task_of

    cfg = _run_config(size)
    task = task_of(cfg)
    opt = task.optimizer()
    compute = jnp.dtype(dtype)

    def loss_fn(params, batch):
        cast = jax.tree.map(lambda p: p.astype(compute), params)
        loss, acc = task.loss_and_accuracy(cast, batch)
        return loss.astype(jnp.float32), acc

    @jax.jit
    def step(params, state, batch):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    params = jax.device_put(task.init_params(cfg.seed))
    state = opt.init(params)
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, cfg.model.vocab_size,
                                     (size["batch"], size["seq_len"] + 1)), jnp.int32)
    # three untimed steps: the compilation, then the allocator settles
    times, params, state, loss = timed_steps(step, params, state, batch, 3, steps)
    n = n_params(task)
    flops = step_flops(size["d_model"], size["n_layers"], size["seq_len"], n,
                       size["batch"] * size["seq_len"])
    med = statistics.median(times)
    return {"dtype": dtype, "params": n, "step_s": med, "step_flop": flops,
            "flops": flops / med, "loss_after": float(loss)}


def decoupled(size: dict[str, int], steps: int, sync_every: int | None) -> dict[str, Any]:
    """A real `diloco run` of two learners on this host's default device (`sync_every` None:
    past the run's end, so nothing syncs while it trains): per learner, steady steps/s and the
    training thread's time in its own sync work."""
    from ops.cluster import run_distributed

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # two processes, one GPU
    cfg = _run_config(size, learners=2, steps=steps,
                      **{"sync.fragments": size["fragments"],
                         "sync.sync_every": sync_every or 10 * steps})
    with tempfile.TemporaryDirectory(prefix="diloco-accel-") as tmp:
        summary = run_distributed(cfg, "accel", out=tmp)
        lines = (Path(tmp) / "accel" / "metrics.jsonl").read_text().splitlines()
    finals = [json.loads(ln) for ln in lines]
    finals = {f["learner"]: f for f in finals if f.get("kind") == "learner_final"}
    return {"sync_every": cfg.sync.sync_every, "rounds": summary["rounds"],
            "final_eval_loss": summary["final_eval_loss"],
            "learners": {name: {k: f[k] for k in ("steps", "steps_per_s", "train_s", "sync_s",
                                                  "pushes_attempted", "bytes_sent",
                                                  "bytes_received")}
                         for name, f in sorted(finals.items())}}


def bench_accelerator(tiny: bool = False, steps: int | None = None,
                      progress=print) -> dict[str, Any]:
    """The whole check (see the module docstring); `tiny`: the CPU-sized smoke run."""
    size = TINY if tiny else BIG
    n = 256 if tiny else 8192
    steps = steps or (5 if tiny else 20)
    run_steps = 24 if tiny else 160
    out: dict[str, Any] = {"bench": "accelerator", "device": _device(), "model": size}
    progress(f"device: {out['device']}")
    out["matmul_flops"] = {d: matmul_rate(d, n) for d in ("bfloat16", "float32")}
    rates = {k: f"{v / 1e12:.2f} TFLOP/s" for k, v in out["matmul_flops"].items()}
    progress(f"matmul: {rates}")
    out["step"] = {}
    for dtype in ("float32", "bfloat16"):
        s = step_rate(size, dtype, steps)
        s["efficiency"] = s["flops"] / out["matmul_flops"][dtype]
        out["step"][dtype] = s
        progress(f"step {dtype}: {s['params'] / 1e6:.1f}M parameters, {s['step_s'] * 1e3:.1f} "
                 f"ms, {s['flops'] / 1e12:.2f} TFLOP/s, {s['efficiency']:.1%} of the matmul rate")
    on = decoupled(size, run_steps, size["sync_every"])
    off = decoupled(size, run_steps, None)
    ratios = {k: on["learners"][k]["steps_per_s"] / off["learners"][k]["steps_per_s"]
              for k in on["learners"] if off["learners"].get(k, {}).get("steps_per_s")}
    blocked = {k: {"sync_s_per_push": v["sync_s"] / max(1, v["pushes_attempted"]),
                   "sync_fraction": v["sync_s"] / v["train_s"] if v["train_s"] else None}
               for k, v in on["learners"].items()}
    out["decoupled"] = {"syncing": on, "not_syncing": off, "overlap": ratios,
                        "overlap_mean": statistics.fmean(ratios.values()) if ratios else None,
                        "blocked": blocked}
    per_push = {k: round(v["sync_s_per_push"], 4) for k, v in blocked.items()}
    progress(f"overlap (syncing ÷ not): { {k: round(v, 3) for k, v in ratios.items()} }; "
             f"blocked per push (s): {per_push}")
    return out
