"""The outer optimiser: SGD with Nesterov momentum on the merged outer gradient, per fragment.

The outer gradient of a round is the merged Δ = Θ − θ (global minus learner value); the
update Θ ← Θ + sgd_update(Δ) is an ordinary optax transformation, so anything optax offers
(e.g. a different momentum or schedule) drops in.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipeline.config import OuterConfig


def outer_optimizer(cfg: OuterConfig) -> optax.GradientTransformation:
    """optax.sgd(lr, momentum, nesterov) — 0.7 / 0.9 / Nesterov by default."""
    return optax.sgd(learning_rate=cfg.lr, momentum=cfg.momentum or None, nesterov=cfg.nesterov)


def make_outer_step(opt: optax.GradientTransformation):
    """A jitted ``step(theta, outer_grad, state) -> (new_theta, new_state)`` for `opt`."""

    @jax.jit
    def step(theta, outer_grad, state):
        updates, state = opt.update(outer_grad, state, theta)
        return optax.apply_updates(theta, updates), state

    return step


def outer_step(opt: optax.GradientTransformation, theta: Mapping[str, np.ndarray],
               outer_grad: Mapping[str, np.ndarray], state, step_fn=None):
    """One outer step. Returns ``(new_theta as fp32 numpy, new_state)``.

    Pass `step_fn` (from `make_outer_step`) to reuse one compiled step across rounds.
    """
    step_fn = step_fn or make_outer_step(opt)
    g = {k: jnp.asarray(v, jnp.float32) for k, v in outer_grad.items()}
    t = {k: jnp.asarray(v, jnp.float32) for k, v in theta.items()}
    new, state = step_fn(t, g, state)
    return {k: np.asarray(v, np.float32) for k, v in new.items()}, state


def init_state(opt: optax.GradientTransformation, theta: Mapping[str, np.ndarray]):
    return opt.init({k: jnp.asarray(v, jnp.float32) for k, v in theta.items()})
