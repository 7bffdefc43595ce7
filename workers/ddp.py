"""Data parallel over real links: one process per site, gradients all-reduced every step.

The baseline the lab (`diloco lab --mode ddp`) measures decoupled DiLoCo against, on the same
shaped links. It uses JAX's own multi-process runtime: ``jax.distributed.initialize`` against a
coordination service (``--serve`` runs one, in the lab's hub), CPU collectives over gloo, and a
mesh over every process's device. Each step, a process takes the gradient of its own shard's
batch, flattens every gradient into one fp32 vector, and sums the vectors of all processes in
**one** jitted all-reduce across the mesh (one bucket: the whole model); then every process
applies the same AdamW update to the mean. The step is the in-process ``ddp`` engine's
(`pipeline/engine.py`: one step on the M batches together, the learners' optimiser), split
across processes.

Process 0 evaluates the model every ``--eval-every`` steps (evaluation time is excluded from
the wall time it reports) and writes ``--out`` (JSON: per-step compute and all-reduce seconds,
the evaluation history, the final loss). Exit 0 when every step ran.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

log = logging.getLogger("diloco.ddp")


def serve(address: str, processes: int) -> int:
    """Run the coordination service at `address` until SIGTERM."""
    from jax._src.lib import _jax

    service = _jax.get_distributed_runtime_service(address, processes)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print("serving", flush=True)
    while not stop:
        time.sleep(0.2)
    service.shutdown()
    return 0


def train(a: argparse.Namespace) -> int:
    from workers.heap import keep_freed_memory

    keep_freed_memory()  # before JAX runs anything: each step reuses its scratch memory
    import jax

    from workers import native

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if a.gloo_interface:  # gloo's peers connect to this interface's address (by default,
        # to what the host name resolves to: in a network namespace, nothing reachable)
        from functools import partial

        from jax._src.lib import _jax

        _jax.make_gloo_tcp_collectives = partial(_jax.make_gloo_tcp_collectives,
                                                 interface=a.gloo_interface)
    jax.distributed.initialize(coordinator_address=a.coordinator, num_processes=a.processes,
                               process_id=a.process_id,
                               initialization_timeout=int(a.init_timeout_s))
    # after the distributed runtime is up (it asks which backend the step runs on, which
    # starts JAX's backends: too early for jax.distributed), before the step is traced
    native.install_fused()
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.flatten_util import ravel_pytree
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pipeline import config as cfgmod
    from pipeline.task import n_params, task_of
    from pipeline.train import evaluate

    cfg = cfgmod.load(a.config)
    task = task_of(cfg, local=a.task or cfg.task)
    corpus = task.data()
    n, pid = a.processes, a.process_id
    params = {k: jnp.asarray(v) for k, v in task.init_params(cfg.seed).items()}
    opt = task.optimizer()
    opt_state = opt.init(params)
    flat0, unravel = ravel_pytree(params)
    mesh = Mesh(np.array(jax.devices()), ("site",))
    summed = NamedSharding(mesh, P())

    @jax.jit
    def grad(params, batch):
        (loss, _), g = jax.value_and_grad(task.loss_and_accuracy, has_aux=True)(params, batch)
        return loss, ravel_pytree(g)[0]

    allreduce = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=summed)

    @jax.jit
    def apply(params, opt_state, flat_sum):
        g = unravel(flat_sum / n)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    eval_batches = corpus.eval_batches(cfg.data.eval_batches, cfg.inner.batch_size) \
        if pid == 0 else None
    tokens_per_step = cfg.inner.batch_size * cfg.model.seq_len * n
    steps = a.steps or cfg.steps
    history, compute_s, reduce_s = [], [], []
    eval_s = 0.0

    def _eval(t: int, wall: float) -> None:
        nonlocal eval_s
        t_e = time.monotonic()
        m = evaluate(params, eval_batches, task)
        eval_s += time.monotonic() - t_e
        history.append({"step": t, "tokens": t * tokens_per_step, "wall_s": wall,
                        "eval_loss": m["loss"], "eval_accuracy": m["accuracy"]})

    # the first step compiles every function: not part of the measurement
    t0 = None
    for t in range(steps):
        if t == 1:
            t0 = time.monotonic()
            if pid == 0:
                _eval(1, 0.0)
        batch = jnp.asarray(corpus.batch(pid, t, cfg.inner.batch_size))
        tc = time.monotonic()
        loss, flat = grad(params, batch)
        flat.block_until_ready()
        tr = time.monotonic()
        total = allreduce(multihost_utils.host_local_array_to_global_array(
            flat[None, :], mesh, P("site")))
        local = total.addressable_data(0)
        local.block_until_ready()
        te = time.monotonic()
        params, opt_state = apply(params, opt_state, local)
        compute_s.append(tr - tc)
        reduce_s.append(te - tr)
        if pid == 0 and a.eval_every and t >= 1 and (t + 1) % a.eval_every == 0 \
                and t + 1 < steps:
            _eval(t + 1, time.monotonic() - t0 - eval_s)
        if a.log_every and (t + 1) % a.log_every == 0:
            log.info("step %d loss %.4f compute %.3fs allreduce %.3fs", t + 1, float(loss),
                     compute_s[-1], reduce_s[-1])
    jax.block_until_ready(params)
    wall = time.monotonic() - (t0 or time.monotonic()) - eval_s
    if pid == 0:
        _eval(steps, wall)
        out = {"mode": "ddp", "processes": n, "steps": steps, "params": n_params(task),
               "allreduce_bytes": int(flat0.size * 4), "tokens": steps * tokens_per_step,
               "wall_s": wall, "step_s": wall / max(1, steps - 1),
               "compute_s_mean": float(np.mean(compute_s[1:] or compute_s)),
               "allreduce_s_mean": float(np.mean(reduce_s[1:] or reduce_s)),
               "final_eval_loss": history[-1]["eval_loss"], "history": history,
               "compute_s": compute_s, "allreduce_s": reduce_s}
        Path(a.out).write_text(json.dumps(out))
    jax.distributed.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.ddp", description=__doc__.split("\n")[0])
    ap.add_argument("--serve", metavar="HOST:PORT",
                    help="run the coordination service here (and nothing else)")
    ap.add_argument("--coordinator", metavar="HOST:PORT")
    ap.add_argument("--processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--config", help="the run configuration (TOML)")
    ap.add_argument("--task", default=None, metavar="MODULE:FACTORY")
    ap.add_argument("--gloo-interface", default=None, metavar="IFACE",
                    help="network interface gloo's peers reach this process on")
    ap.add_argument("--steps", type=int, default=0, help="default: the configuration's")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--init-timeout-s", type=float, default=120.0)
    ap.add_argument("--out", default="ddp.json")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    if a.serve:
        return serve(a.serve, a.processes)
    if not a.coordinator or not a.config:
        ap.error("--coordinator and --config are needed to train")
    return train(a)


if __name__ == "__main__":
    raise SystemExit(main())
