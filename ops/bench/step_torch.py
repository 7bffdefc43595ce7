"""The same model and training step in PyTorch: the outside reference of `diloco bench step`.

The issue that asked for a faster learner step quoted a PyTorch implementation of the default
model at ~0.15 s per step on one thread. This module is that reference, measured in the same
process, on the same thread count and against the same matmul rate as the JAX step, so the
comparison is side by side rather than from memory:

* the model is `pipeline.model.forward`'s, written the way a PyTorch user would
  (`F.layer_norm`, `F.scaled_dot_product_attention` with ``is_causal``, tanh GELU, tied
  output projection), built from the *same* initial parameters: `check_same_model` asserts
  that its loss equals the JAX loss on the same batch before anything is timed;
* the step is forward, backward, global-norm clipping and AdamW (``fused=True``, PyTorch's
  fastest CPU implementation; the learning-rate schedule, a scalar, is left out of both
  sides' cost), and it computes the next-byte accuracy as the JAX step does;
* it runs eagerly, and compiled by ``torch.compile`` (Inductor: fused C++ loops for the
  elementwise work, the kind of kernel XLA's CPU backend does not generate for this model).

torch is not a dependency of the project: without it the benchmark records why and goes on.
Install it next to the project with ``pip install torch`` (a CPU build is enough).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from ops.bench.step import N_MATMUL, _best


def available() -> str | None:
    """None when torch can be imported, else the reason it cannot."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch is not installed ({e})"
    return None


def _forward(params: dict, tokens, cfg):
    """Logits ``[batch·time, vocab]`` of `pipeline.model.forward`'s model, in PyTorch."""
    import torch.nn.functional as F

    b, t = tokens.shape
    h, d = cfg.n_heads, cfg.d_model
    dh = d // h
    x = (params["wte"][tokens] + params["wpe"][:t]).reshape(b * t, d)
    for i in range(cfg.n_layers):
        p = f"h{i}."
        y = F.layer_norm(x, (d,), params[p + "ln1.g"], params[p + "ln1.b"], 1e-5)
        qkv = (y @ params[p + "attn.qkv"]).reshape(b, t, 3, h, dh).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + y.transpose(1, 2).reshape(b * t, d) @ params[p + "attn.proj"]
        y = F.layer_norm(x, (d,), params[p + "ln2.g"], params[p + "ln2.b"], 1e-5)
        x = x + F.gelu(y @ params[p + "mlp.fc"], approximate="tanh") @ params[p + "mlp.proj"]
    x = F.layer_norm(x, (d,), params["lnf.g"], params["lnf.b"], 1e-5)
    return x @ params["wte"].T


def _loss_and_accuracy(params: dict, batch, cfg):
    import torch
    import torch.nn.functional as F

    inputs, targets = batch[:, :-1], batch[:, 1:].reshape(-1)
    logits = _forward(params, inputs, cfg)
    loss = F.cross_entropy(logits, targets)
    acc = (logits.argmax(-1) == targets).to(torch.float32).mean()
    return loss, acc


def _tokens(batch: np.ndarray):
    """`batch` as an int64 tensor of its own (PyTorch indexes with int64)."""
    import torch

    return torch.from_numpy(np.array(batch, dtype=np.int64))


def to_torch(params: dict[str, np.ndarray]) -> dict:
    """Leaf tensors (requiring gradients) holding copies of `params`."""
    import torch

    return {k: torch.tensor(np.array(v, dtype=np.float32), requires_grad=True)
            for k, v in params.items()}


def loss_of(params: dict[str, np.ndarray], batch: np.ndarray, cfg) -> float:
    """The PyTorch model's mean next-byte loss on `batch` (no gradient)."""
    import torch

    with torch.no_grad():
        loss, _ = _loss_and_accuracy(to_torch(params), _tokens(batch), cfg)
    return float(loss)


def check_same_model(params: dict[str, np.ndarray], batch: np.ndarray, cfg,
                     jax_loss: float) -> float:
    """The PyTorch loss on the JAX model's parameters and batch; raises unless it equals the
    JAX loss to float32 rounding (the two are one model, or the timing compares nothing)."""
    got = loss_of(params, batch, cfg)
    if not abs(got - jax_loss) <= 1e-4 * max(1.0, abs(jax_loss)):
        raise AssertionError(f"PyTorch loss {got} != JAX loss {jax_loss}: not the same model")
    return got


def measure(params: dict[str, np.ndarray], batch: np.ndarray, cfg, inner, steps: int,
            flops: float, peak: float, threads: int) -> dict[str, Any]:
    """Median step time of the eager and the compiled PyTorch step at `threads` threads, with
    the same FLOP count and matmul rate as the JAX step it is compared with."""
    import torch

    torch.set_num_threads(threads)
    tb = _tokens(batch)
    n = N_MATMUL
    a, b = torch.randn(n, n), torch.randn(n, n)
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                           "matmul_torch_gflops": 2.0 * n**3 / _best(lambda: a @ b, 20) / 1e9}
    for name in ("eager", "compiled"):
        p = to_torch(params)
        opt = torch.optim.AdamW(list(p.values()), lr=inner.lr, betas=(inner.b1, inner.b2),
                                weight_decay=inner.weight_decay, fused=True)
        leaves = list(p.values())
        fwd = _loss_and_accuracy
        if name == "compiled":
            try:
                fwd = torch.compile(_loss_and_accuracy)
            except Exception as e:  # recorded in the result; the eager figure stands alone
                out[name] = {"error": f"{type(e).__name__}: {e}"}
                continue

        def step(p=p, opt=opt, leaves=leaves, fwd=fwd):
            opt.zero_grad(set_to_none=True)
            loss, acc = fwd(p, tb, cfg)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(leaves, inner.clip, foreach=True)
            opt.step()
            return loss, acc

        t0 = time.perf_counter()
        try:
            for _ in range(3):  # warm-up (and, compiled, the compilation)
                step()
        except Exception as e:  # Inductor needs a C++ compiler; record why, keep eager's
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
            continue
        warm = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss, _ = step()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out[name] = {"step_s_median": med, "step_s_min": min(times), "warmup_s": warm,
                     "gflops": flops / med / 1e9, "efficiency": flops / med / 1e9 / peak,
                     "loss_after": float(loss.detach())}
    return out
