"""Your own training loop, joining a Decoupled DiLoCo run as one of its learners.

The loop below is plain JAX + optax: the model (`user_model.py`), the optimizer and the step
are the user's. `workers.island.Island` does the rest — it joins the run, pushes fragments when
they are due, applies merged parameters, heartbeats, checkpoints and takes part in the final
flush — so this process trains next to ``diloco learner`` processes of the same run::

    export PYTHONPATH=examples
    diloco init --redis-url redis://HOST:6379/0 --run mine --config mine.toml
    diloco syncer --redis-url redis://HOST:6379/0 --run mine --task user_model:make &
    diloco learner --redis-url redis://HOST:6379/0 --run mine --id L0 --task user_model:make &
    python examples/own_loop.py --redis-url redis://HOST:6379/0 --run mine --id L1
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import jax
import optax
import user_model

from workers.heap import keep_freed_memory
from workers.island import Island, IslandConfig

TASK = "user_model:make"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--id", default="L0", help="learner id; its trailing number is the shard")
    ap.add_argument("--state-dir", default=None, help="checkpoints (resumed on restart)")
    ap.add_argument("--no-sync", action="store_true", help="train alone (a baseline)")
    args = ap.parse_args()
    keep_freed_memory()  # before JAX runs anything: each step reuses its scratch memory

    cfg = IslandConfig(args.redis_url, args.run, args.id, task=TASK, state_dir=args.state_dir,
                       sync=not args.no_sync)
    with Island(cfg) as island:
        run = island.run_cfg
        opts = run.options()
        context = opts.get("context", 8)
        # the user's own model, optimizer and step
        params = user_model.init(run.seed, **opts)
        opt = optax.chain(optax.clip_by_global_norm(run.inner.clip),
                          optax.adamw(run.inner.lr, b1=run.inner.b1, b2=run.inner.b2,
                                      weight_decay=run.inner.weight_decay))

        @jax.jit
        def step(params, opt_state, batch):
            (loss, _), grads = jax.value_and_grad(
                partial(user_model.loss, context=context), has_aux=True)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        data = island.ctx.task.data()  # the run's corpus; any source of batches would do
        params, opt_state = island.start(like=params, opt_state=opt.init)
        while not island.done:
            batch = jax.numpy.asarray(data.batch(island.shard, island.step,
                                                 run.inner.batch_size))
            params, opt_state, loss = step(params, opt_state, batch)
            params = island.after_step(params, opt_state=opt_state, loss=loss)
        if not island.net.stop_seen:
            params = island.finish(params)
            print(json.dumps({"learner": args.id, "steps": island.report.steps,
                              "hashes": island.report.hashes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
