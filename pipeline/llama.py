"""A Llama-style decoder in JAX: RMSNorm, rotary positions, SwiGLU, an untied output head, and a
configurable vocabulary — the second model of the project, of another shape than the byte GPT
(`pipeline/model.py`): its parameters are a nested tree (``layers/0/attn/wq`` once flattened by
`pipeline.tree`), not a flat dict, and only the token embedding is an embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the decoder (``ffn_dim``: the SwiGLU hidden width)."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: int = 176
    seq_len: int = 64
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.n_heads} heads of "
                             f"an even width (rotary positions rotate pairs)")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_dim", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


EMBEDDINGS = frozenset({"embed"})  # flattened names merged by weighted mean


def init_params(cfg: LlamaConfig, seed: int) -> dict:
    """Normal(0, 0.02) weights, output projections scaled by 1/sqrt(2·layers), norms at 1."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 2 + 7 * cfg.n_layers))
    d, f = cfg.d_model, cfg.ffn_dim
    resid = 0.02 / np.sqrt(2 * cfg.n_layers)

    def w(shape, std=0.02):
        return std * jax.random.normal(next(keys), shape, jnp.float32)

    layers = [{
        "attn_norm": jnp.ones((d,), jnp.float32),
        "attn": {"wq": w((d, d)), "wk": w((d, d)), "wv": w((d, d)), "wo": w((d, d), resid)},
        "mlp_norm": jnp.ones((d,), jnp.float32),
        "mlp": {"w_gate": w((d, f)), "w_up": w((d, f)), "w_down": w((f, d), resid)},
    } for _ in range(cfg.n_layers)]
    return {"embed": w((cfg.vocab_size, d)), "layers": layers,
            "final_norm": jnp.ones((d,), jnp.float32), "head": w((d, cfg.vocab_size))}


def rms_norm(x: jax.Array, g: jax.Array, eps: float) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps) * g


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotate each head's channel pairs (first half with second half) by position-dependent
    angles; `x` is ``[batch, time, heads, head_dim]``."""
    t, hd = x.shape[1], x.shape[-1]
    freqs = theta ** (-np.arange(0, hd // 2, dtype=np.float32) / (hd // 2))
    angles = np.arange(t, dtype=np.float32)[:, None] * freqs[None, :]   # [time, hd/2]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def forward(params: dict, tokens: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Logits ``[batch, time, vocab]`` for int32 tokens ``[batch, time]``."""
    b, t = tokens.shape
    h = cfg.n_heads
    x = params["embed"][tokens]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for layer in params["layers"]:
        a = layer["attn"]
        y = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
        q, k, v = ((y @ a[n]).reshape(b, t, h, -1) for n in ("wq", "wk", "wv"))
        q, k = rotary(q, cfg.rope_theta), rotary(k, cfg.rope_theta)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
        att = jax.nn.softmax(jnp.where(mask, att, jnp.float32(-1e30)), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1) @ a["wo"]
        m = layer["mlp"]
        y = rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
        x = x + (jax.nn.silu(y @ m["w_gate"]) * (y @ m["w_up"])) @ m["w_down"]
    return rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["head"]


def loss_and_accuracy(params: dict, batch: jax.Array, cfg: LlamaConfig):
    """Mean next-token cross-entropy (nats) and accuracy of a ``[batch, seq_len+1]`` window."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logp = jax.nn.log_softmax(forward(params, inputs, cfg), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    acc = jnp.mean((jnp.argmax(logp, axis=-1) == targets).astype(jnp.float32))
    return jnp.mean(nll), acc
