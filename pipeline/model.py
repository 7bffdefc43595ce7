"""A byte-level decoder-only transformer in JAX: pure functions over a flat parameter dict.

Parameters are a ``dict[str, jax.Array]`` with dotted names (``wte``, ``h0.attn.qkv``, ...):
a flat dict makes fragments (sets of tensor names) trivial to cut and reassemble. The output
projection is tied to the token embedding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pipeline import fused
from pipeline.config import ModelConfig

Params = dict[str, jax.Array]

EMBEDDING_NAMES = ("wte", "wpe")


def is_embedding(name: str) -> bool:
    """Embedding tensors are merged by weighted mean and live in their own fragment."""
    return name in EMBEDDING_NAMES


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every parameter, in a fixed order."""
    d, f = cfg.d_model, cfg.d_model * cfg.mlp_ratio
    shapes: dict[str, tuple[int, ...]] = {"wte": (cfg.vocab_size, d), "wpe": (cfg.seq_len, d)}
    for i in range(cfg.n_layers):
        shapes[f"h{i}.ln1.g"] = (d,)
        shapes[f"h{i}.ln1.b"] = (d,)
        shapes[f"h{i}.attn.qkv"] = (d, 3 * d)
        shapes[f"h{i}.attn.proj"] = (d, d)
        shapes[f"h{i}.ln2.g"] = (d,)
        shapes[f"h{i}.ln2.b"] = (d,)
        shapes[f"h{i}.mlp.fc"] = (d, f)
        shapes[f"h{i}.mlp.proj"] = (f, d)
    shapes["lnf.g"] = (d,)
    shapes["lnf.b"] = (d,)
    return shapes


def n_params(cfg: ModelConfig) -> int:
    return int(sum(np.prod(s) for s in param_shapes(cfg).values()))


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """GPT-2 style initialisation (residual projections scaled by 1/sqrt(2·layers))."""
    key = jax.random.PRNGKey(seed)
    params: Params = {}
    resid_std = 0.02 / np.sqrt(2 * cfg.n_layers)
    for i, (name, shape) in enumerate(param_shapes(cfg).items()):
        if name.endswith(".g"):
            params[name] = jnp.ones(shape, jnp.float32)
        elif name.endswith(".b"):
            params[name] = jnp.zeros(shape, jnp.float32)
        else:
            std = resid_std if name.endswith("proj") else 0.02
            params[name] = std * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    return params


def forward(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Logits ``[batch, time, vocab]`` for int32 tokens ``[batch, time]``.

    The residual stream is kept as one ``[batch·time, d_model]`` matrix, so every projection
    and its gradients are plain 2-D matrix products (XLA's CPU backend runs the backward pass of
    a 3-D activation times a matrix — a contraction over two dimensions — about half as
    fast). Attention, the layer norms, GELU and the projections' weight gradients are
    `pipeline.fused`'s (fused kernels on CPUs where they are installed). ``diloco bench step``
    measures the step against the machine.
    """
    b, t = tokens.shape
    dense = fused.dense
    x = (params["wte"][tokens] + params["wpe"][:t]).reshape(b * t, cfg.d_model)
    for i in range(cfg.n_layers):
        p = f"h{i}."
        y = fused.layer_norm(x, params[p + "ln1.g"], params[p + "ln1.b"])
        y = fused.causal_attention(dense(y, params[p + "attn.qkv"]), b, t, cfg.n_heads)
        x = x + dense(y, params[p + "attn.proj"])
        y = fused.layer_norm(x, params[p + "ln2.g"], params[p + "ln2.b"])
        x = x + dense(fused.gelu(dense(y, params[p + "mlp.fc"])), params[p + "mlp.proj"])
    x = fused.layer_norm(x, params["lnf.g"], params["lnf.b"])
    return dense(x, params["wte"].T).reshape(b, t, -1)


def loss_and_accuracy(params: Params, batch: jax.Array, cfg: ModelConfig):
    """Mean next-byte cross-entropy (nats) and accuracy of a ``[batch, seq_len+1]`` window."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = forward(params, inputs, cfg)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    acc = jnp.mean((jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32))
    return jnp.mean(nll), acc
