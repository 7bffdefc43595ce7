"""A user-written model, brought to a Decoupled DiLoCo run as a task.

A small windowed MLP language model over bytes: each next token is predicted from the
embeddings of the `context` tokens before it, through two hidden layers. Its parameters are a
nested tree — dicts and a list, as Flax or Equinox produce — that the run flattens to stable
names (``embed/table``, ``mlp/0/w``, ``out/b``…).

Point a run at it with ``task = "user_model:make"`` (and ``PYTHONPATH`` holding this folder);
``[task_options]`` become `make`'s keyword arguments::

    task = "user_model:make"

    [task_options]
    hidden = 128
    context = 8
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pipeline.config import RunConfig
from pipeline.task import TreeTask

VOCAB = 256  # bytes


def init(seed: int, *, dim: int = 32, hidden: int = 128, context: int = 8) -> dict:
    """The initial parameter tree (float32)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 4)

    def dense(key, n_in, n_out):
        return {"w": jax.random.normal(key, (n_in, n_out), jnp.float32) / jnp.sqrt(n_in),
                "b": jnp.zeros((n_out,), jnp.float32)}

    return {"embed": {"table": 0.02 * jax.random.normal(k[0], (VOCAB, dim), jnp.float32)},
            "mlp": [dense(k[1], context * dim, hidden), dense(k[2], hidden, hidden)],
            "out": dense(k[3], hidden, VOCAB)}


def logits(params: dict, tokens: jax.Array, *, context: int = 8) -> jax.Array:
    """Next-token logits ``[batch, time, vocab]`` of int tokens ``[batch, time]``."""
    emb = params["embed"]["table"][tokens]                       # [B, T, D]
    padded = jnp.pad(emb, ((0, 0), (context - 1, 0), (0, 0)))
    t = tokens.shape[1]
    window = jnp.concatenate([padded[:, i:i + t] for i in range(context)], axis=-1)
    h = window
    for layer in params["mlp"]:
        h = jax.nn.gelu(h @ layer["w"] + layer["b"])
    return h @ params["out"]["w"] + params["out"]["b"]


def loss(params: dict, batch: jax.Array, *, context: int = 8):
    """(mean next-token cross-entropy, accuracy) of a ``[batch, time + 1]`` token batch."""
    x, y = batch[:, :-1], batch[:, 1:]
    out = logits(params, x, context=context)
    logp = jax.nn.log_softmax(out)
    nll = -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()
    return nll, (out.argmax(-1) == y).mean()


def make(cfg: RunConfig, dim: int = 32, hidden: int = 128, context: int = 8) -> TreeTask:
    """The task factory a run names (``task = "user_model:make"``)."""
    return TreeTask(run=cfg, name="user_model",
                    init=partial(init, dim=dim, hidden=hidden, context=context),
                    loss=partial(loss, context=context),
                    forward=partial(logits, context=context),
                    embeddings=("embed/table",))
