"""Causal multi-head self-attention of the default model: the definition in JAX, and the slot
for a fused CPU kernel.

`causal(qkv, b, t, h)` takes the packed projection ``qkv`` (``[b·t, 3·d]``, laid out as
``[b, t, 3, h, d/h]``: the model's ``y @ W_qkv``) and returns the heads' outputs as
``[b·t, d]`` (laid out ``[b, t, h, d/h]``, ready for the output projection). `reference` is
the definition, in JAX: scores ``q·k/√(d/h)`` with the causal mask added as a bias, a row
softmax, and the weighted sum of values.

XLA's CPU backend runs that as separate batched products of ``[t, d/h]`` blocks, a softmax
over the full ``t × t`` scores (half of them masked), and transposes between the layouts; in
the default model's step that is about a third of the time. `workers/native.py` compiles
`workers/attention.cc` — one pass per (batch row, head) that computes only the causal half,
keeps a row's scores in registers and recomputes them in the backward pass from each row's
log-sum-exp — registers its two XLA FFI targets and calls `install`. From then on `causal`
runs the kernel (wrapped in a `jax.custom_vjp`) wherever it can: float32 operands, the CPU
backend, outside `unfused()`. Everywhere else it is `reference`: without a C++ compiler, with
``DILOCO_ATTENTION=xla``, on GPUs and TPUs, and inside a multi-device island
(`pipeline.mesh.Placement`, whose partitioner cannot split a foreign call). The two agree to
float32 rounding (tests/test_attention.py checks values and gradients), not bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

FORWARD_TARGET = "diloco_attention_fwd"
BACKWARD_TARGET = "diloco_attention_bwd"

_installed = False
_local = threading.local()  # .off: the depth of `unfused()` on this thread


def install() -> None:
    """Use the fused kernel from now on; its FFI targets must be registered for the CPU
    platform under `FORWARD_TARGET` and `BACKWARD_TARGET` (`workers.native` does both)."""
    global _installed
    _installed = True


def uninstall() -> None:
    global _installed
    _installed = False


def installed() -> bool:
    return _installed


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """Trace `causal` as `reference` inside this block (on this thread)."""
    _local.off = getattr(_local, "off", 0) + 1
    try:
        yield
    finally:
        _local.off -= 1


def _use_kernel(qkv: jax.Array) -> bool:
    return (_installed and not getattr(_local, "off", 0) and qkv.dtype == jnp.float32
            and jax.default_backend() == "cpu")


def reference(qkv: jax.Array, b: int, t: int, h: int) -> jax.Array:
    """The definition (see the module docstring)."""
    d = qkv.shape[-1] // 3
    dh = d // h
    q, k, v = qkv.reshape(b, t, 3, h, dh).transpose(2, 0, 3, 1, 4).reshape(3, b * h, t, dh)
    causal_bias = jnp.where(jnp.tril(jnp.ones((t, t), bool)), 0.0, -1e30).astype(jnp.float32)
    scale = np.float32(1 / np.sqrt(dh))
    att = jax.nn.softmax(jnp.einsum("nqd,nkd->nqk", q, k) * scale + causal_bias, axis=-1)
    y = jnp.einsum("nqk,nkd->nqd", att, v).reshape(b, h, t, dh)
    return y.transpose(0, 2, 1, 3).reshape(b * t, d)


def _attrs(b: int, t: int, h: int) -> dict[str, np.int64]:
    return {"b": np.int64(b), "t": np.int64(t), "h": np.int64(h)}


def _forward_call(qkv: jax.Array, b: int, t: int, h: int) -> tuple[jax.Array, jax.Array]:
    d = qkv.shape[-1] // 3
    out = (jax.ShapeDtypeStruct((b * t, d), jnp.float32),
           jax.ShapeDtypeStruct((b * h * t,), jnp.float32))
    return jax.ffi.ffi_call(FORWARD_TARGET, out, vmap_method="sequential")(
        qkv, **_attrs(b, t, h))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _fused(qkv: jax.Array, b: int, t: int, h: int) -> jax.Array:
    return _forward_call(qkv, b, t, h)[0]


def _fused_fwd(qkv, b, t, h):
    y, lse = _forward_call(qkv, b, t, h)
    return y, (qkv, y, lse)


def _fused_bwd(b, t, h, res, dy):
    qkv, y, lse = res
    out = jax.ShapeDtypeStruct(qkv.shape, jnp.float32)
    dqkv = jax.ffi.ffi_call(BACKWARD_TARGET, out, vmap_method="sequential")(
        qkv, y, lse, dy.astype(jnp.float32), **_attrs(b, t, h))
    return (dqkv,)


_fused.defvjp(_fused_fwd, _fused_bwd)


def causal(qkv: jax.Array, b: int, t: int, h: int) -> jax.Array:
    """Causal self-attention of ``b`` sequences of ``t`` positions over ``h`` heads, from the
    packed ``[b·t, 3·d]`` projection to ``[b·t, d]`` (see the module docstring)."""
    if qkv.shape != (b * t, qkv.shape[-1]) or qkv.shape[-1] % (3 * h):
        raise ValueError(f"attention: qkv of shape {qkv.shape} is not [b*t, 3*h*head_dim] "
                         f"for b={b}, t={t}, h={h}")
    if _use_kernel(qkv):
        return _fused(qkv, b, t, h)
    return reference(qkv, b, t, h)
