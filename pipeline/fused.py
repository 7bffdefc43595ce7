"""Fused CPU kernels of the default model's causal attention, layer norm, GELU and
projections' weight gradients: the definitions in JAX, and the slot for the compiled kernels.

`causal_attention(qkv, b, t, h)` takes the packed projection ``qkv`` (``[b·t, 3·d]``, laid
out as ``[b, t, 3, h, d/h]``: the model's ``y @ W_qkv``) and returns the heads' outputs as
``[b·t, d]`` (laid out ``[b, t, h, d/h]``, ready for the output projection);
`attention_reference` is the definition, in JAX: scores ``q·k/√(d/h)`` with the causal mask
added as a bias, a row softmax, and the weighted sum of values. `layer_norm(x, g, b)`
normalises the last axis of a ``[n, d]`` matrix (`layer_norm_reference`: mean, variance,
``(x − μ)/√(σ² + 1e-5)·g + b``). `dense(x, w)` is the projection ``x @ w``, whose weight
gradient ``xᵀ @ dy`` — a product that sums over all ``b·t`` rows — is the kernel's; `gelu(x)`
is GELU's tanh form (`gelu_reference`: ``jax.nn.gelu(x, approximate=True)``).

XLA's CPU backend runs attention as separate batched products of ``[t, d/h]`` blocks, a
softmax over the full ``t × t`` scores (half of them masked), and transposes between the
layouts — in the default model's step about a third of the time — and a layer norm as several
loops with their reductions (~10 %). `workers/native.py` compiles `workers/fused.cc` — for
attention one pass per (batch row, head) that computes only the causal half, keeps a row's
scores in registers and recomputes them in the backward pass from each row's log-sum-exp; for
the layer norm and GELU one pass each way; for a weight gradient, blocks of the result summed
in registers, the sum over rows cut into ranges (fixed by the shape) that the threads share
— registers its XLA FFI targets and calls `install`. From then on all four run the kernels
(each wrapped in a `jax.custom_vjp`) wherever they can: float32 operands, a program lowered
for the CPU (`jax.lax.platform_dependent`: a program lowered or exported for a GPU or TPU holds
the definitions), outside `unfused()`. Everywhere else they are the definitions: without a C++
compiler, with ``DILOCO_FUSED=xla``, on GPUs and TPUs, and inside a multi-device island
(`pipeline.mesh.Placement`, whose partitioner cannot split a foreign call). Kernel and
definition agree to float32 rounding (tests/test_fused.py checks values and gradients), not
bit for bit; the kernels' results do not depend on the thread count. The
kernels have reverse-mode derivatives only (`jax.grad`, `jax.vjp`): forward mode (`jax.jvp`,
`jax.jacfwd`) and second derivatives need the definitions (`unfused()`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

FORWARD_TARGET = "diloco_attention_fwd"
BACKWARD_TARGET = "diloco_attention_bwd"
NORM_FORWARD_TARGET = "diloco_layer_norm_fwd"
NORM_BACKWARD_TARGET = "diloco_layer_norm_bwd"
WEIGHT_GRAD_TARGET = "diloco_weight_grad"
GELU_FORWARD_TARGET = "diloco_gelu_fwd"
GELU_BACKWARD_TARGET = "diloco_gelu_bwd"
# the symbol each target's handler has in the compiled library
SYMBOLS = {FORWARD_TARGET: "DilocoAttentionFwd", BACKWARD_TARGET: "DilocoAttentionBwd",
           NORM_FORWARD_TARGET: "DilocoLayerNormFwd", NORM_BACKWARD_TARGET: "DilocoLayerNormBwd",
           WEIGHT_GRAD_TARGET: "DilocoWeightGrad", GELU_FORWARD_TARGET: "DilocoGeluFwd",
           GELU_BACKWARD_TARGET: "DilocoGeluBwd"}
LAYER_NORM_EPS = 1e-5
MAX_HEAD_DIM = 256  # the widest head the attention kernel takes (kMaxHeadDim in fused.cc)

KERNELS = ("attention", "layer_norm", "dense", "gelu")  # the names `unfused` takes

_installed = False
_disabled: frozenset[str] = frozenset()  # kernels installed as their definitions
_local = threading.local()  # .off: per kernel name, the depth of `unfused()` on this thread


def _kernel_names(names: Iterable[str], caller: str) -> tuple[str, ...]:
    names = tuple(names)
    unknown = sorted(set(names) - set(KERNELS))
    if unknown:
        raise ValueError(f"{caller}: no kernel named {', '.join(unknown)} (the kernels: "
                         f"{', '.join(KERNELS)})")
    return names


def install(disabled: Iterable[str] = ()) -> None:
    """Use the fused kernels from now on, but those named in `disabled` (of `KERNELS`); their
    FFI targets must be registered for the CPU platform under the names in `SYMBOLS`
    (`workers.native` does both)."""
    _switch(True, frozenset(_kernel_names(disabled, "install")))


def uninstall() -> None:
    _switch(False, frozenset())


def _switch(on: bool, disabled: frozenset[str]) -> None:
    """The choice is made when a function is traced, and JAX's caches of traced functions do
    not know of it: a change empties them, so that nothing traced before runs after."""
    global _installed, _disabled
    if (_installed, _disabled) != (on, disabled):
        _installed, _disabled = on, disabled
        jax.clear_caches()


@contextlib.contextmanager
def unfused(*kernels: str) -> Iterator[None]:
    """Trace the definitions instead of the kernels inside this block (on this thread): of
    every kernel, or of those named (any of `KERNELS`).

    It acts when a function is traced: a jitted function already traced outside the block
    runs what it traced (`pipeline.mesh.Placement` wraps its step's first call in it)."""
    names = _kernel_names(kernels or KERNELS, "unfused")
    if not hasattr(_local, "off"):
        _local.off = dict.fromkeys(KERNELS, 0)
    for name in names:
        _local.off[name] += 1
    try:
        yield
    finally:
        for name in names:
            _local.off[name] -= 1


def _use_kernel(kernel: str, *operands: jax.Array) -> bool:
    """Whether `kernel` is traced (beside its definition: `_on_cpu` picks by platform)."""
    off = getattr(_local, "off", None)
    return (_installed and kernel not in _disabled and not (off and off[kernel])
            and all(x.dtype == jnp.float32 for x in operands))


def _on_cpu(kernel, definition, *args):
    """`kernel(*args)` where the computation is lowered for the CPU, `definition(*args)` for
    any other platform: chosen by the platform the program is lowered for (a GPU or TPU
    program, an export for them, never holds the CPU kernels' calls), not by the process's
    default backend."""
    return jax.lax.platform_dependent(*args, cpu=kernel, default=definition)


def attention_reference(qkv: jax.Array, b: int, t: int, h: int) -> jax.Array:
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


def causal_attention(qkv: jax.Array, b: int, t: int, h: int) -> jax.Array:
    """Causal self-attention of ``b`` sequences of ``t`` positions over ``h`` heads, from the
    packed ``[b·t, 3·d]`` projection to ``[b·t, d]`` (see the module docstring)."""
    if h < 1 or qkv.ndim != 2 or qkv.shape[0] != b * t or qkv.shape[-1] % (3 * h):
        raise ValueError(f"attention: qkv of shape {qkv.shape} is not [b*t, 3*h*head_dim] "
                         f"for b={b}, t={t}, h={h}")
    if (_use_kernel("attention", qkv) and b * t > 0
            and qkv.shape[-1] // (3 * h) <= MAX_HEAD_DIM):
        return _on_cpu(lambda x: _fused(x, b, t, h),
                       lambda x: attention_reference(x, b, t, h), qkv)
    return attention_reference(qkv, b, t, h)


def layer_norm_reference(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    """The definition (see the module docstring)."""
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * g + b


def _norm_forward_call(x: jax.Array, g: jax.Array, b: jax.Array):
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32),
           jax.ShapeDtypeStruct(x.shape[:1], jnp.float32))
    return jax.ffi.ffi_call(NORM_FORWARD_TARGET, out, vmap_method="sequential")(
        x, g, b, eps=np.float32(LAYER_NORM_EPS))


@jax.custom_vjp
def _fused_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    return _norm_forward_call(x, g, b)[0]


def _fused_norm_fwd(x, g, b):
    y, rstd = _norm_forward_call(x, g, b)
    return y, (x, g, rstd)


def _fused_norm_bwd(res, dy):
    x, g, rstd = res
    out = (jax.ShapeDtypeStruct(x.shape, jnp.float32),
           jax.ShapeDtypeStruct(g.shape, jnp.float32),
           jax.ShapeDtypeStruct(g.shape, jnp.float32))
    return tuple(jax.ffi.ffi_call(NORM_BACKWARD_TARGET, out, vmap_method="sequential")(
        x, g, rstd, dy.astype(jnp.float32)))


_fused_norm.defvjp(_fused_norm_fwd, _fused_norm_bwd)


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array) -> jax.Array:
    """Layer norm over the last axis (see the module docstring); the kernel takes a ``[n, d]``
    matrix and ``[d]`` scale and shift, any other shape runs the definition."""
    if (x.ndim == 2 and g.shape == b.shape == x.shape[1:] and x.shape[0] > 0
            and x.shape[1] > 0 and _use_kernel("layer_norm", x, g, b)):
        return _on_cpu(_fused_norm, layer_norm_reference, x, g, b)
    return layer_norm_reference(x, g, b)


def _weight_grad_call(x: jax.Array, dy: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[1], dy.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(WEIGHT_GRAD_TARGET, out, vmap_method="sequential")(x, dy)


@jax.custom_vjp
def _fused_dense(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def _fused_dense_fwd(x, w):
    return x @ w, (x, w)


def _fused_dense_bwd(res, dy):
    x, w = res
    dy = dy.astype(jnp.float32)
    return dy @ w.T, _weight_grad_call(x, dy)


_fused_dense.defvjp(_fused_dense_fwd, _fused_dense_bwd)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """The projection ``x @ w`` of a ``[n, k]`` matrix by a ``[k, m]`` one. Its value and the
    input's gradient ``dy @ wᵀ`` are XLA's products; with the kernels installed, the weight's
    gradient ``xᵀ @ dy`` (a sum over the n rows) is the kernel's. Other shapes and dtypes run
    ``x @ w`` as it is."""
    if (x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[0] and x.size and w.size
            and _use_kernel("dense", x, w)):
        return _on_cpu(_fused_dense, jnp.matmul, x, w)
    return x @ w


def gelu_reference(x: jax.Array) -> jax.Array:
    """The definition: GELU's tanh form, ``jax.nn.gelu(x, approximate=True)``."""
    return jax.nn.gelu(x, approximate=True)


@jax.custom_vjp
def _fused_gelu(x: jax.Array) -> jax.Array:
    return jax.ffi.ffi_call(GELU_FORWARD_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            vmap_method="sequential")(x)


def _fused_gelu_fwd(x):
    return _fused_gelu(x), x


def _fused_gelu_bwd(x, dy):
    return (jax.ffi.ffi_call(GELU_BACKWARD_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32),
                             vmap_method="sequential")(x, dy.astype(jnp.float32)),)


_fused_gelu.defvjp(_fused_gelu_fwd, _fused_gelu_bwd)


def gelu(x: jax.Array) -> jax.Array:
    """GELU (tanh form) elementwise, of any shape (see the module docstring)."""
    if x.size and _use_kernel("gelu", x):
        return _on_cpu(_fused_gelu, gelu_reference, x)
    return gelu_reference(x)
