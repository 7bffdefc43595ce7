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


@jax.jit
def _apply(theta, updates):
    return optax.apply_updates(theta, updates)


def outer_step(opt: optax.GradientTransformation, theta: Mapping[str, np.ndarray],
               outer_grad: Mapping[str, np.ndarray], state):
    """One outer step. Returns ``(new_theta as fp32 numpy, new_state)``."""
    g = {k: jnp.asarray(v, jnp.float32) for k, v in outer_grad.items()}
    t = {k: jnp.asarray(v, jnp.float32) for k, v in theta.items()}
    updates, state = opt.update(g, state, t)
    new = _apply(t, updates)
    return {k: np.asarray(v, np.float32) for k, v in new.items()}, state


def init_state(opt: optax.GradientTransformation, theta: Mapping[str, np.ndarray]):
    return opt.init({k: jnp.asarray(v, jnp.float32) for k, v in theta.items()})
