"""The outer optimiser: SGD with Nesterov momentum on the merged outer gradient, per fragment.

The outer gradient of a round is the merged Δ = Θ − θ (global minus learner value); a full
round's update Θ ← Θ + sgd_update(Δ) is optax's jitted sgd step. A partial round (n of L live
learners) takes a fraction of that step, `partial_outer_step`: the same sgd-with-momentum rule
written out in numpy with the momentum decayed by μ^u, on optax's own state, so full and
partial steps interleave freely (a different optax transformation would need its own
fractional form).
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
    """A jitted ``step(theta, outer_grad, state) -> (new_theta, new_state)`` for `opt`.

    `theta` and `outer_grad` are donated: XLA writes the new value and momentum into their
    buffers (no two more fragment-sized arrays per round); pass arrays nothing else holds.
    Without momentum only `theta` is (nothing would take the gradient's buffer). The state
    is not donated: a round refused after the step keeps the momentum it had."""

    def step(theta, outer_grad, state):
        updates, state = opt.update(outer_grad, state, theta)
        return optax.apply_updates(theta, updates), state

    with_momentum, without = (jax.jit(step, donate_argnums=(0, 1)),
                              jax.jit(step, donate_argnums=(0,)))
    return lambda theta, outer_grad, state: (
        with_momentum if jax.tree_util.tree_leaves(state) else without)(theta, outer_grad, state)


def outer_step(opt: optax.GradientTransformation, theta: Mapping[str, np.ndarray],
               outer_grad: Mapping[str, np.ndarray], state, step_fn=None):
    """One outer step. Returns ``(new_theta as fp32 numpy, new_state)``.

    Pass `step_fn` (from `make_outer_step`) to reuse one compiled step across rounds.
    """
    step_fn = step_fn or make_outer_step(opt)
    # copies of their own: the step donates them (the caller's arrays stay as they were)
    g = {k: jnp.array(v, jnp.float32, copy=True) for k, v in outer_grad.items()}
    t = {k: jnp.array(v, jnp.float32, copy=True) for k, v in theta.items()}
    new, state = step_fn(t, g, state)
    return {k: np.asarray(v, np.float32) for k, v in new.items()}, state  # views, no copies


def init_state(opt: optax.GradientTransformation, theta: Mapping[str, np.ndarray]):
    return opt.init({k: jnp.asarray(v, jnp.float32) for k, v in theta.items()})


def plain_outer_step(cfg: OuterConfig, theta: Mapping[str, np.ndarray],
                     outer_grad: Mapping[str, np.ndarray], state, u: float = 1.0):
    """A fraction u ∈ (0, 1] of a plain SGD step, Θ ← Θ − lr·u·g: no momentum look-ahead, and
    the momentum (`state`) returned as it was. The final flush's rounds take it under
    ``sync.final_step = "plain"``."""
    if not 0.0 < u <= 1.0:
        raise ValueError(f"plain step u={u} outside (0, 1]")
    step = np.float32(cfg.lr * u)
    return {k: (np.asarray(theta[k], np.float32) - step * np.asarray(outer_grad[k], np.float32)
                ).astype(np.float32) for k in theta}, state


def partial_outer_step(cfg: OuterConfig, theta: Mapping[str, np.ndarray],
                       outer_grad: Mapping[str, np.ndarray], state, u: float):
    """A fraction u ∈ (0, 1] of one outer step of ``optax.sgd(lr, μ, nesterov)``.

    The gradient enters the momentum as u·g and the momentum decays by μ^u, so k steps of
    1/k on the same gradient move the value about as far as one step does, and momentum
    fades at the same rate per unit of merged work however it is split into rounds:

        m ← μ^u·m + u·g,  update = u·g + μ·(1 − μ^u)/(1 − μ)·m   (Nesterov)
                          update = (1 − μ^u)/(1 − μ)·m            (heavy ball)
        Θ ← Θ − lr·update

    u = 1 is exactly optax's step. `state` is optax's (TraceState, EmptyState) for sgd with
    momentum (or an EmptyState tuple without), returned in the same structure.
    """
    if not 0.0 < u <= 1.0:
        raise ValueError(f"partial step u={u} outside (0, 1]")
    mu = float(cfg.momentum)
    f32 = np.float32
    if not mu:
        return plain_outer_step(cfg, theta, outer_grad, state, u)
    trace_state, *rest = state
    decay = mu ** u
    keep = (1.0 - decay) / (1.0 - mu)
    trace, new = {}, {}
    for k in theta:
        ug = f32(u) * np.asarray(outer_grad[k], f32)
        m = f32(decay) * np.asarray(trace_state.trace[k], f32) + ug
        update = ug + f32(mu * keep) * m if cfg.nesterov else f32(keep) * m
        trace[k] = m
        new[k] = (theta[k] - f32(cfg.lr) * update).astype(f32)
    ts = trace_state._replace(trace={k: jnp.asarray(v) for k, v in trace.items()})
    return new, (ts, *rest)
