"""The inner optimiser (AdamW, warmup then cosine, clipping), the jitted step and evaluation.

The jitted step returns ``(params, opt_state, metrics)``; NaN checks, pushing and logging
happen outside it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipeline.task import Params, Task, inner_optimizer

__all__ = ["evaluate", "inner_optimizer", "make_step"]


def make_step(task: Task, opt: optax.GradientTransformation, *,
              donate: bool = False) -> Callable:
    """A jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)``.

    With `donate` the step's outputs reuse the buffers of its `params` and `opt_state`
    (deleted by the call: the caller keeps no reference to them), so a step holds one copy of
    the parameters and optimizer state instead of two.
    """

    def loss_fn(params: Params, batch: jax.Array):
        return task.loss_and_accuracy(params, batch)

    @partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def step(params: Params, opt_state, batch: jax.Array):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "accuracy": acc,
                                   "grad_norm": optax.tree.norm(grads)}

    return step


@partial(jax.jit, static_argnums=2)
def _eval_batch(params: Params, batch: jax.Array, task: Task):
    return task.loss_and_accuracy(params, batch)


def evaluate(params: Params, batches: np.ndarray, task: Task) -> dict[str, float]:
    """Mean loss (nats/token) and next-token accuracy over fixed evaluation batches."""
    losses, accs = [], []
    for b in batches:
        loss, acc = _eval_batch(params, jax.tree_util.tree_map(jnp.asarray, b), task)
        losses.append(float(loss))
        accs.append(float(acc))
    return {"loss": float(np.mean(losses)), "accuracy": float(np.mean(accs))}
