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

import argparse
import sys
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ops.cli.common import fail, print_json

BYTE_VOCAB = 256  # sampling draws bytes: token ids >= 256 (token-file vocabularies) never


# ----------------------------------------------------------------------------- checkpoints


def read_checkpoint(path: str | Path):
    """A checkpoint's parameters, configuration and versions, checked against the model shapes.

    Args:
        path: A ``checkpoint.npz`` written by ``diloco run`` or ``diloco export``.

    Returns:
        ``(params, RunConfig, versions or None)``.

    Raises:
        ValueError: The file is not a checkpoint, or its tensors do not fit its configuration.
        FileNotFoundError: No such file.
    """
    from ops.cluster.artifacts import load_checkpoint
    from pipeline.model import param_shapes

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint")
    try:
        params, cfg = load_checkpoint(path)
        with np.load(path) as z:
            versions = [int(v) for v in z["versions"]] if "versions" in z.files else None
    except (KeyError, OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a diloco checkpoint ({type(e).__name__}: {e})") from e
    want = param_shapes(cfg.model)
    if set(params) != set(want):
        missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
        raise ValueError(f"{path}: tensors do not match the model of its configuration "
                         f"(missing {missing[:5]}, unexpected {extra[:5]})")
    for name, shape in want.items():
        if tuple(params[name].shape) != tuple(shape):
            raise ValueError(f"{path}: {name} has shape {params[name].shape}, the configuration "
                             f"says {shape}")
    return params, cfg, versions


def eval_checkpoint(path: str | Path) -> dict[str, Any]:
    """Evaluate a checkpoint on its configuration's held-out split (stable ``eval --json``).

    Returns:
        ``{"checkpoint", "eval_loss" (nats/byte), "eval_accuracy" (next-byte, 0..1),
        "eval_batches", "eval_tokens" (predicted positions), "params" (count), "versions"
        (per fragment, or None), "config_hash"}``.
    """
    import jax.numpy as jnp

    from ops.cli.common import make_corpus
    from pipeline.model import n_params
    from pipeline.train import evaluate

    params, cfg, versions = read_checkpoint(path)
    corpus = make_corpus(cfg)
    batches = corpus.eval_batches(cfg.data.eval_batches, cfg.inner.batch_size)
    m = evaluate({k: jnp.asarray(v) for k, v in params.items()}, batches, cfg.model)
    return {
        "checkpoint": str(path), "eval_loss": m["loss"], "eval_accuracy": m["accuracy"],
        "eval_batches": int(batches.shape[0]),
        "eval_tokens": int(batches.shape[0] * batches.shape[1] * (batches.shape[2] - 1)),
        "params": n_params(cfg.model), "versions": versions, "config_hash": cfg.run_hash(),
    }


# ----------------------------------------------------------------------------- sampling


def _next_logits_fn(model_cfg):
    """A jitted ``f(params, window[1, seq_len] int32, last int32) -> logits[vocab]``.

    The window is left-aligned and right-padded: with the causal mask the padding after
    position ``last`` cannot change the logits at ``last``, so one compiled shape serves every
    step.
    """
    import jax

    from pipeline.model import forward

    @jax.jit
    def next_logits(params, window, last):
        return forward(params, window, model_cfg)[0, last]

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


def generate(params: Mapping[str, np.ndarray], model_cfg, prompt: bytes, n_bytes: int,
             temperature: float, seed: int) -> list[int]:
    """Sample ``n_bytes`` bytes after ``prompt`` (an empty prompt starts from a newline).

    Args:
        params: Model parameters (numpy or jax arrays).
        model_cfg: The model configuration (its ``seq_len`` is the context window).
        prompt: The prompt bytes.
        n_bytes: How many bytes to generate.
        temperature: Softmax temperature; 0 picks the most likely byte (greedy).
        seed: Seed of the sampler (same seed, same checkpoint, same backend: same bytes).

    Returns:
        The generated byte values.
    """
    import jax.numpy as jnp

    L = model_cfg.seq_len
    fn = _next_logits_fn(model_cfg)
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
           seed: int) -> dict[str, Any]:
    """Sample from a checkpoint (stable ``sample --json``).

    Returns:
        ``{"checkpoint", "prompt", "completion" (the generated bytes decoded as UTF-8 with
        errors="replace"), "bytes" (number generated), "tokens" (the generated byte values),
        "temperature", "seed", "context_bytes" (the model's window)}``.
    """
    params, cfg, _ = read_checkpoint(path)
    tokens = generate(params, cfg.model, prompt.encode(), n_bytes, temperature, seed)
    return {
        "checkpoint": str(path), "prompt": prompt,
        "completion": bytes(tokens).decode("utf-8", errors="replace"), "bytes": len(tokens),
        "tokens": tokens, "temperature": temperature, "seed": seed,
        "context_bytes": cfg.model.seq_len,
    }


# ----------------------------------------------------------------------------- export


def export(redis_url: str, run: str, out: str | Path) -> dict[str, Any]:
    """Write the run's committed global parameters and configuration to an .npz.

    Returns:
        ``{"run", "out" (the file written; ".npz" is appended when missing), "versions"
        (per fragment), "params" (count), "tensors", "bytes" (file size), "config_hash"}``.

    Raises:
        BrokerError: No configuration, or a fragment without committed state.
    """
    from ops.cluster.artifacts import save_checkpoint
    from ops.cluster.launcher import global_params
    from ops.tools.inspect import open_run

    out = Path(out)
    if out.suffix != ".npz":
        out = out.with_name(out.name + ".npz")
    r, keys, cfg, run_hash, n_frags = open_run(redis_url, run)
    try:
        params, versions = global_params(r, keys, n_frags)
    finally:
        r.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out, params, cfg, versions)
    return {"run": run, "out": str(out), "versions": versions,
            "params": int(sum(v.size for v in params.values())), "tensors": len(params),
            "bytes": out.stat().st_size, "config_hash": run_hash}


# ----------------------------------------------------------------------------- CLI


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``diloco eval``, ``diloco sample`` and ``diloco export`` to the CLI."""
    e = sub.add_parser("eval", help="evaluation loss and accuracy of a checkpoint",
                       description="Evaluate a checkpoint's global parameters on the held-out "
                       "split of its configuration's corpus.")
    e.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint.npz (run or export)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=_eval)

    s = sub.add_parser("sample", help="sample bytes from a checkpoint's model",
                       description="Autoregressive byte sampling from a checkpoint's model.")
    s.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint.npz (run or export)")
    s.add_argument("--prompt", required=True, help="text to continue (UTF-8)")
    s.add_argument("--bytes", type=int, default=200, metavar="N",
                   help="bytes to generate (default 200)")
    s.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="softmax temperature; 0 is greedy (default 0.8)")
    s.add_argument("--seed", type=int, default=0, metavar="S", help="sampler seed (default 0)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=_sample)

    x = sub.add_parser("export", help="write a run's global parameters from Redis to an .npz",
                       description="Read the global parameters the syncers committed in Redis "
                       "and write them with the configuration in checkpoint.npz's layout.")
    x.add_argument("--redis-url", required=True, help="Redis of the run")
    x.add_argument("--run", required=True, help="run name")
    x.add_argument("--out", required=True, metavar="FILE.npz", help="file to write")
    x.add_argument("--json", action="store_true", help="print one JSON object")
    x.set_defaults(func=_export)


def _eval(args: argparse.Namespace) -> int:
    try:
        rep = eval_checkpoint(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        return fail(str(e))
    if args.json:
        print_json(rep)
    else:
        print(f"{rep['checkpoint']}: eval loss {rep['eval_loss']:.4f} nats/byte, accuracy "
              f"{rep['eval_accuracy']:.3f} ({rep['eval_tokens']:,} positions, "
              f"{rep['params']:,} parameters, versions {rep['versions']})")
    return 0


def _sample(args: argparse.Namespace) -> int:
    if args.bytes < 0:
        return fail("--bytes must be >= 0")
    if not np.isfinite(args.temperature) or args.temperature < 0:
        return fail("--temperature must be a finite number >= 0")
    try:
        rep = sample(args.checkpoint, args.prompt, args.bytes, args.temperature, args.seed)
    except (FileNotFoundError, ValueError) as e:
        return fail(str(e))
    if args.json:
        print_json(rep)
    else:
        sys.stdout.write(rep["prompt"] + rep["completion"] + "\n")
        sys.stdout.flush()
    return 0


def _export(args: argparse.Namespace) -> int:
    from broker.errors import BrokerError
    from ops.cli.common import REDIS_DOWN, fail_on

    try:
        rep = export(args.redis_url, args.run, args.out)
    except (BrokerError, ValueError, OSError, *REDIS_DOWN) as e:
        return fail_on(e)
    if args.json:
        print_json(rep)
    else:
        print(f"wrote {rep['out']}: {rep['params']:,} parameters in {rep['tensors']} tensors, "
              f"versions {rep['versions']} ({rep['bytes']:,} bytes)")
    return 0
