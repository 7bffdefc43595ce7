"""`diloco eval`, `diloco sample` and `diloco export`: use a run's global model.

* ``eval CHECKPOINT``: evaluation loss (nats/byte) and next-byte accuracy of a checkpoint's
  global parameters on the held-out split of its own configuration's corpus — the same batches
  the launcher evaluates on.
* ``sample CHECKPOINT --prompt TEXT``: autoregressive byte sampling from the checkpoint's
  model (a sliding window of the last ``model.seq_len`` bytes; greedy at temperature 0).
* ``export --redis-url URL --run NAME --out FILE.npz``: the global parameters committed by the
  syncers in Redis, plus the configuration, in the layout of ``checkpoint.npz``
  (:func:`ops.artifacts.save_checkpoint`), so ``eval`` and ``sample`` accept exported files.

Checkpoints are read with :func:`ops.artifacts.load_checkpoint`. The ``--json`` outputs (keys
documented on :func:`eval_checkpoint`, :func:`sample` and :func:`export`) are stable.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ops.cluster import artifacts, global_params
from pipeline.config import RunConfig
from pipeline.task import n_params, task_of
from pipeline.train import evaluate
from workers.common import open_run

BYTE_VOCAB = 256  # sampling draws bytes: token ids >= 256 (token-file vocabularies) never


# ----------------------------------------------------------------------------- checkpoints


def read_checkpoint(path: str | Path, task: str | None = None):
    """A checkpoint's parameters, configuration and versions, checked against the model shapes.

    Args:
        path: A ``checkpoint.npz`` written by ``diloco run`` or ``diloco export``.
        task: The user task of its configuration (``--task``; `pipeline.task.task_of`).

    Returns:
        ``(params, RunConfig, versions or None)``.

    Raises:
        ValueError: The file is not a checkpoint, or its tensors do not fit its configuration
            (ConfigError: its user task is not named by `task`).
        FileNotFoundError: No such file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    try:
        params, cfg, versions = artifacts.read_checkpoint_file(path)
    except (KeyError, OSError, ValueError, zipfile.BadZipFile) as e:
        if str(e) in (artifacts.SAFETENSORS_EXTRA, artifacts.ORBAX_EXTRA):
            raise
        raise ValueError(f"{path}: not a diloco checkpoint ({type(e).__name__}: {e})") from e
    want = task_of(cfg, task).param_shapes()
    if set(params) != set(want):
        missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
        raise ValueError(f"{path}: tensors do not match the model of its configuration "
                         f"(missing {missing[:5]}, unexpected {extra[:5]})")
    for name, shape in want.items():
        if tuple(params[name].shape) != tuple(shape):
            raise ValueError(f"{path}: {name} has shape {params[name].shape}, the configuration "
                             f"says {shape}")
    return params, cfg, versions


def eval_checkpoint(path: str | Path, task: str | None = None) -> dict[str, Any]:
    """Evaluate a checkpoint on its configuration's held-out split (stable ``eval --json``).

    Returns:
        ``{"checkpoint", "eval_loss" (nats/byte), "eval_accuracy" (next-byte, 0..1),
        "eval_batches", "eval_tokens" (predicted positions), "params" (count), "versions"
        (per fragment, or None), "config_hash"}``.
    """
    params, cfg, versions = read_checkpoint(path, task)
    the_task = task_of(cfg, task)
    batches = the_task.data().eval_batches(cfg.data.eval_batches, cfg.inner.batch_size)
    m = evaluate({k: jnp.asarray(v) for k, v in params.items()}, batches, the_task)
    return {
        "checkpoint": str(path), "eval_loss": m["loss"], "eval_accuracy": m["accuracy"],
        "eval_batches": len(batches),
        "eval_tokens": len(batches) * the_task.tokens_per_step(),
        "params": n_params(the_task), "versions": versions, "config_hash": cfg.run_hash(),
    }


# ----------------------------------------------------------------------------- sampling


def _next_logits_fn(task):
    """A jitted ``f(params, window[1, seq_len] int32, last int32) -> logits[vocab]``.

    The window is left-aligned and right-padded: with the causal mask the padding after
    position ``last`` cannot change the logits at ``last``, so one compiled shape serves every
    step.
    """
    @jax.jit
    def next_logits(params, window, last):
        return task.logits(params, window)[0, last]

    return next_logits


def _draw(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """One byte from ``logits`` (float64 softmax on the host; argmax at temperature 0)."""
    z = np.asarray(logits, np.float64)[:BYTE_VOCAB]
    if temperature <= 0:
        return int(np.argmax(z))
    z = z / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


def generate(params: Mapping[str, np.ndarray], cfg: RunConfig, prompt: bytes, n_bytes: int,
             temperature: float, seed: int, task: str | None = None) -> list[int]:
    """Sample ``n_bytes`` bytes after ``prompt`` (an empty prompt starts from a newline).

    Args:
        params: Model parameters (numpy or jax arrays).
        cfg: The run configuration (its task; ``model.seq_len`` is the context window).
        prompt: The prompt bytes.
        n_bytes: How many bytes to generate.
        temperature: Softmax temperature; 0 picks the most likely byte (greedy).
        seed: Seed of the sampler (same seed, same checkpoint, same backend: same bytes).
        task: The user task of `cfg` (``--task``), whose ``forward`` gives the logits.

    Returns:
        The generated byte values.
    """
    L = cfg.model.seq_len
    fn = _next_logits_fn(task_of(cfg, task))
    jparams = {k: jnp.asarray(v) for k, v in params.items()}
    rng = np.random.default_rng(seed)
    context = list(prompt or b"\n")
    out: list[int] = []
    window = np.zeros((1, L), np.int32)
    for _ in range(n_bytes):
        ctx = context[-L:]
        window[0, :] = 0
        window[0, : len(ctx)] = ctx
        logits = np.asarray(fn(jparams, jnp.asarray(window), jnp.int32(len(ctx) - 1)))
        b = _draw(logits, temperature, rng)
        out.append(b)
        context.append(b)
    return out


def sample(path: str | Path, prompt: str, n_bytes: int, temperature: float,
           seed: int, task: str | None = None) -> dict[str, Any]:
    """Sample from a checkpoint (stable ``sample --json``).

    Returns:
        ``{"checkpoint", "prompt", "completion" (the generated bytes decoded as UTF-8 with
        errors="replace"), "bytes" (number generated), "tokens" (the generated byte values),
        "temperature", "seed", "context_bytes" (the model's window)}``.
    """
    params, cfg, _ = read_checkpoint(path, task)
    tokens = generate(params, cfg, prompt.encode(), n_bytes, temperature, seed, task)
    return {
        "checkpoint": str(path), "prompt": prompt,
        "completion": bytes(tokens).decode("utf-8", errors="replace"), "bytes": len(tokens),
        "tokens": tokens, "temperature": temperature, "seed": seed,
        "context_bytes": cfg.model.seq_len,
    }


# ----------------------------------------------------------------------------- export


def export(redis_url: str, run: str, out: str | Path, fmt: str = "npz") -> dict[str, Any]:
    """Write the run's committed global parameters and configuration to an .npz, or (`fmt`
    "safetensors") a .safetensors file, or ("orbax") an Orbax checkpoint folder: the last two
    are what the rest of the ecosystem reads.

    Returns:
        ``{"run", "out" (the file written; the format's suffix is appended when missing),
        "format", "versions" (per fragment), "params" (count), "tensors", "bytes" (file
        size), "config_hash"}``.

    Raises:
        BrokerError: No configuration, a fragment without committed state, or rounds since
            its checkpoint that cannot be replayed.
        ValueError: an unknown format, or the safetensors extra is not installed.
    """
    if fmt not in artifacts.FORMATS:
        raise ValueError(f"--format: {fmt!r} is not one of {', '.join(artifacts.FORMATS)}")
    if fmt == "safetensors":
        artifacts._safetensors()  # refused before reading Redis, not after
    if fmt == "orbax":
        artifacts._orbax()
    out = Path(out)
    if out.suffix != f".{fmt}":
        out = out.with_name(f"{out.name}.{fmt}")
    ctx = open_run(redis_url, run, wait_s=0, verify=False)
    r, keys, cfg, run_hash = ctx.r, ctx.keys, ctx.cfg, ctx.run_hash
    try:
        params, versions = global_params(r, keys, cfg, ctx.fragments, ctx.shapes,
                                         ctx.task.is_embedding)
    finally:
        r.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    artifacts.save_checkpoint(out, params, cfg, versions)
    size = (sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) if out.is_dir()
            else out.stat().st_size)
    return {"run": run, "out": str(out), "format": fmt, "versions": versions,
            "params": int(sum(v.size for v in params.values())), "tensors": len(params),
            "bytes": size, "config_hash": run_hash}
