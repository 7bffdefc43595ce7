"""Opening a run: connect, fetch and check the stored run configuration, lay out shapes and
fragments. Both roles do this on start, and so does every tool that reads a run."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis

from broker import codec, registry
from broker.connection import connect
from broker.keys import RunKeys
from pipeline import config as cfgmod
from pipeline import quant
from pipeline.config import RunConfig
from pipeline.fragments import partition
from pipeline.task import Task, task_of


@dataclass
class RunContext:
    r: redis.Redis
    keys: RunKeys
    cfg: RunConfig
    run_hash: str
    shapes: dict[str, tuple[int, ...]]
    fragments: list[list[str]]
    task: Task


def open_run(redis_url: str, run: str, *, expect_hash: str | None = None,
             wait_s: float = 30.0, verify: bool = True) -> RunContext:
    """Connect and load the run configuration stored in Redis (waiting up to `wait_s`).

    Args:
        verify: check that the stored configuration hashes to the stored run hash (every
            process that takes part in the run, and replay); the read-only tools (status,
            inspect, plot, export) show a run whatever wrote it and pass False.

    Raises:
        BrokerError: The run has no configuration (or is stored under old key names).
        ConfigError: The stored configuration does not match its hash (with `verify`).
        ConfigMismatch: `expect_hash` is given and differs from the stored hash.
        ValueError: The run name is not a valid name.
    """
    keys = RunKeys(run)
    probe = connect(redis_url)
    toml_text, run_hash = registry.load_config(probe, keys, wait_s=wait_s)
    cfg = cfgmod.from_dict(tomllib.loads(toml_text))
    if verify and cfg.run_hash() != run_hash:
        raise cfgmod.ConfigError(f"stored configuration of run {run!r} does not match its hash")
    if expect_hash is not None:
        registry.check_config(probe, keys, expect_hash)
    r = connect(redis_url, socket_timeout_s=cfg.broker.socket_timeout_s,
                block_ms=cfg.broker.block_ms)
    probe.close()
    task = task_of(cfg)
    shapes = task.param_shapes()
    frags = partition(shapes, cfg.effective_sync().fragments, task.is_embedding)
    return RunContext(r, keys, cfg, run_hash, shapes, frags, task)


def decode_values(tensors: dict[str, quant.QTensor]) -> dict[str, np.ndarray]:
    """Dequantise every tensor."""
    return {k: quant.dequantize(q) for k, q in tensors.items()}


def read_snapshot(ctx: RunContext, p: int) -> tuple[int, dict[str, np.ndarray]] | None:
    """(version, decoded values) of fragment p's latest published value, or None."""
    blob = ctx.r.get(ctx.keys.fragment(p).global_)
    if blob is None:
        return None
    header, tensors = codec.unpack_snapshot(blob, max_bytes=ctx.cfg.broker.max_payload_bytes)
    return header.version, decode_values(tensors)


def enable_compile_cache(path: Path) -> None:
    """Keep this process's JAX compilations in `path`, so that a restarted process loads them
    instead of compiling again (a learner's init and first step: 3.4 s → 0.9 s on the 2-core
    benchmark machine). One process per folder: JAX writes entries without a lock."""
    import jax

    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
