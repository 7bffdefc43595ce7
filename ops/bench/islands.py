"""`diloco bench islands`: one learner island over 4 devices vs 4 one-device learners.

Both sides train the demo model (`pipeline.config.demo_config`) with the same per-device batch
on the same cores, side by side in one run:

* island — one process with 4 devices (on a CPU host: ``XLA_FLAGS=
  --xla_force_host_platform_device_count=4``), data parallel over a mesh
  (`pipeline.mesh.Placement`), global batch 4 × b;
* separate — 4 processes of one device each, batch b, stepping at the same time.

Each process times its steady inner steps (after warm-up and compilation) the way the learner
steps: place the batch, step, wait for the result. The figure is tokens per second of the
island ÷ the summed tokens per second of the 4 separate learners. On GPU or TPU hosts the
devices are real chips; on this CPU host they are XLA's host devices sharing the same cores,
so the ratio measures the island's overhead (collectives, sharded dispatch), not a speed-up.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

N_DEVICES = 4


def _worker(devices: int, batch: int, steps: int, warmup: int) -> dict:
    """Time `steps` inner steps of the demo model on `devices` local devices (run in a child
    process whose XLA flags give it the devices)."""
    import jax
    import jax.numpy as jnp

    from pipeline import config as cfgmod
    from pipeline.mesh import Placement
    from pipeline.task import task_of
    from pipeline.train import make_step

    cfg = cfgmod.override(cfgmod.demo_config(), **{"inner.batch_size": batch})
    task = task_of(cfg)
    opt = task.optimizer()
    data = task.data()
    pl = Placement(devices) if devices > 1 else None
    step = pl.step(task, opt) if pl else make_step(task, opt)
    params = task.init_params(cfg.seed)
    params = pl.params(params) if pl else params
    state = pl.opt_state(opt.init(params)) if pl else opt.init(params)
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        b = data.batch(0, i, batch)
        b = pl.batch(b) if pl else jnp.asarray(b)
        params, state, _ = step(params, state, b)
        jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    tokens = steps * batch * cfg.model.seq_len
    return {"devices": devices, "batch": batch, "steps": steps, "seconds": dt,
            "steps_per_s": steps / dt, "tokens_per_s": tokens / dt,
            "jax_devices": len(jax.local_devices())}


def _spawn(devices: int, batch: int, steps: int, warmup: int, host_devices: int
           ) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={host_devices}"}
    return subprocess.Popen([sys.executable, "-m", "ops.bench.islands", str(devices), str(batch),
                             str(steps), str(warmup)], stdout=subprocess.PIPE, text=True,
                            env=env)


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"island benchmark worker exited {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def bench_islands(quick: bool = False) -> dict:
    """Run both sides twice, alternating; report the mean ratio (see the module docstring)."""
    batch = 16
    steps, warmup = (60, 5) if quick else (400, 10)
    reps = 1 if quick else 2
    island, separate = [], []
    for _ in range(reps):
        island.append(_result(_spawn(N_DEVICES, N_DEVICES * batch, steps, warmup, N_DEVICES)))
        procs = [_spawn(1, batch, steps, warmup, 1) for _ in range(N_DEVICES)]
        separate.append([_result(p) for p in procs])
    isl = sum(r["tokens_per_s"] for r in island) / reps
    sep = sum(sum(r["tokens_per_s"] for r in rep) for rep in separate) / reps
    return {"bench": "islands", "devices": N_DEVICES, "batch_per_device": batch,
            "steps": steps, "island_tokens_per_s": isl, "separate_tokens_per_s": sep,
            "ratio": isl / sep, "island_runs": island, "separate_runs": separate,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
            "note": "CPU host: the 4 devices are XLA host devices on the same cores as the 4 "
                    "separate learners; demo model, per-device batch 16"}


if __name__ == "__main__":
    d, b, s, w = (int(x) for x in sys.argv[1:5])
    print(json.dumps(_worker(d, b, s, w)))
