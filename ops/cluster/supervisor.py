"""One supervisor for a run's processes on this machine: `diloco run` and `diloco chaos` use it.

It starts the same processes an operator starts by hand on separate hosts (`diloco syncer`,
`diloco learner`, as ``python -m workers.<role>``), each with its log file under
``<run_dir>/logs``; it restarts, signals, kills and stops them, reports their exit codes, and
reads the global model (the syncers' checkpointed fp32 state and the rounds since) or the
published value (its snapshots) to evaluate it. It never prints.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import redis

from broker import registry
from broker.connection import URL_ENV, connect, has_secret, value_limits
from broker.errors import BrokerError, DecodeError
from broker.keys import RunKeys
from pipeline import capacity
from pipeline import config as cfgmod
from pipeline.config import RunConfig
from pipeline.fragments import partition
from pipeline.task import Data, stored_spec, task_of, with_init_hash
from pipeline.train import evaluate
from workers.common import read_snapshot
from workers.recovery import committed_theta

log = logging.getLogger("diloco.supervisor")


def global_params(r: redis.Redis, keys: RunKeys, cfg: RunConfig, fragments: list[list[str]],
                  shapes: dict[str, tuple[int, ...]], is_embedding: Callable[[str], bool]
                  ) -> tuple[dict[str, np.ndarray], list[int]]:
    """The global Θ (fp32) of every fragment at its latest committed version: the syncers'
    last checkpoint plus the rounds committed since, replayed (`workers.recovery.committed_theta`).

    Raises:
        BrokerError: A fragment has no committed state yet, or its rounds since the
            checkpoint cannot be replayed (`workers.recovery.RecoveryError`).
    """
    params: dict[str, np.ndarray] = {}
    versions = []
    for p, names in enumerate(fragments):
        fk = keys.fragment(p)
        if not r.exists(fk.state):
            raise BrokerError(f"fragment {p} has no committed state")
        theta, version = committed_theta(r, fk, cfg, {n: shapes[n] for n in names},
                                         is_embedding, archive_dir=cfg.broker.archive_dir or None)
        params.update({k: np.asarray(v, np.float32) for k, v in theta.items()})
        versions.append(version)
    return params, versions


def published_params(r: redis.Redis, keys: RunKeys, cfg: RunConfig,
                     fragments: list[list[str]], shapes: dict[str, tuple[int, ...]]
                     ) -> tuple[dict[str, np.ndarray], list[int]]:
    """The latest published value of every fragment in fp32 (what learners train from) and
    its version, read from its snapshot one fragment at a time: no checkpoint, no replay, no
    optimizer state, so it holds about the model's fp32 size. It differs from the global Θ
    (`global_params`) by what the down link has not sent yet (the int4 delta link's
    error-feedback residual; bf16 rounding).

    Raises:
        BrokerError: A fragment has no published value yet, or a snapshot that does not
            decode, does not hold the fragment's parameters or holds non-finite values.
    """
    params: dict[str, np.ndarray] = {}
    versions = []
    for p, names in enumerate(fragments):
        try:
            snap = read_snapshot(r, keys.fragment(p), cfg.broker.max_payload_bytes,
                                 {n: shapes[n] for n in names})
        except DecodeError as e:
            raise BrokerError(f"fragment {p}'s snapshot: {e}") from e
        if snap is None:
            raise BrokerError(f"fragment {p} has no published value")
        versions.append(snap[0])
        params.update(snap[1])
    return params, versions


def store_run_config(redis_url: str, run: str, cfg: RunConfig) -> bool:
    """Store the run configuration; False if the same one was stored already.

    Raises:
        ConfigError: a fragment's values would not fit their paths (`pipeline.capacity`):
            the message names the setting that fixes it; nothing is stored.
    """
    cfg = with_init_hash(cfg, local=cfg.task)  # a warm start's values, hashed: one model
    task = task_of(cfg, local=cfg.task)
    r = connect(redis_url)
    try:
        refused = capacity.check(cfg, task.param_shapes(), task.is_embedding,
                                 value_limits(r, cfg.broker.max_payload_bytes,
                                              cfg.broker.piece_bytes))
        if refused:
            raise cfgmod.ConfigError(refused)
        return registry.store_config(r, RunKeys(run), cfgmod.dumps_toml(cfg), cfg.run_hash(),
                                     spec=stored_spec(cfg))
    finally:
        r.close()


def role_cmd(role: str, redis_url: str, run: str, *args: str, cfg: RunConfig | None = None
             ) -> list[str]:
    """The command line of one role process (``syncer`` or ``learner``); with the run's
    configuration `cfg`, it names the run's user task (``--task``) so the process imports it.
    A URL with a password is not put on the command line (every user of the host can read
    it): the process finds it in ``$DILOCO_REDIS_URL``, which `Supervisor.spawn` sets."""
    task = ["--task", cfg.task] if cfg is not None and cfg.task not in cfgmod.TASKS else []
    url = [] if has_secret(redis_url) else ["--redis-url", redis_url]
    return [sys.executable, "-m", f"workers.{role}", *url, "--run", run, *task, *args]


class Supervisor:
    """The processes of one run on this machine, and its global model.

    Args:
        cfg: The run configuration.
        run: Run name.
        redis_url: The Redis every process uses (the supervisor's own client too).
        run_dir: The run's output folder; logs go to ``run_dir/logs/<name>.log``.
    """

    def __init__(self, cfg: RunConfig, run: str, redis_url: str, run_dir: Path):
        self.cfg = cfg
        self.run = run
        self.url = redis_url
        self.keys = RunKeys(run)
        self.logs = run_dir / "logs"
        self.procs: dict[str, subprocess.Popen] = {}
        self.cmds: dict[str, list[str]] = {}
        self.urls: dict[str, str] = {}  # a process's own $DILOCO_REDIS_URL (default: url)
        self.task = task_of(cfg, local=cfg.task)  # this process's own configuration
        self.frags = partition(self.task.param_shapes(), cfg.effective_sync().fragments,
                               self.task.is_embedding)
        self.r = connect(redis_url)
        self._eval_batches = None

    # -- processes ------------------------------------------------------------------------------

    def spawn(self, name: str, cmd: list[str] | None = None, url: str | None = None) -> None:
        """Start process `name` (with `cmd`, or the command it was last started with); `url`:
        the Redis URL it gets in ``$DILOCO_REDIS_URL`` when the supervisor's own is not the
        one it reaches (the lab's sites), kept for its restarts."""
        if cmd is not None:
            self.cmds[name] = cmd
        if url is not None:
            self.urls[name] = url
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as out:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(
                self.cmds[name], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, URL_ENV: self.urls.get(name, self.url)})

    def exit_codes(self) -> dict[str, int | None]:
        """Each process's exit code (None while it runs)."""
        return {name: p.poll() for name, p in self.procs.items()}

    def kill(self, name: str) -> None:
        """SIGKILL process `name` and reap it."""
        p = self.procs[name]
        if p.poll() is None:
            p.kill()
        p.wait()

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to process `name` (SIGSTOP/SIGCONT for pauses)."""
        self.procs[name].send_signal(sig)

    def wait(self, name: str, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for process `name` to exit; True if it did."""
        try:
            self.procs[name].wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """Ask every process to stop (Redis stop key, then SIGTERM); kill what outlives
        `timeout_s`."""
        try:
            registry.request_stop(self.r, self.keys)
        except redis.RedisError as e:  # Redis may be the thing that is gone
            log.warning("could not set the stop key (%s); signalling the processes", e)
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in self.procs:
            if not self.wait(name, max(0.1, deadline - time.monotonic())):
                self.kill(name)

    def kill_all(self) -> None:
        """Kill every process still running (a paused one is continued first, so it dies)."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
                p.wait()

    # -- the global model -----------------------------------------------------------------------

    def global_model(self) -> tuple[dict[str, np.ndarray], list[int]]:
        """The global parameters and each fragment's version (see :func:`global_params`)."""
        return global_params(self.r, self.keys, self.cfg, self.frags, self.task.param_shapes(),
                             self.task.is_embedding)

    def evaluate(self, data: Data, published: bool = False) -> dict:
        """Evaluation loss and accuracy of the global model on the held-out split: Θ
        (`global_params`), or with `published` the value learners train from
        (`published_params`: about the model's fp32 size, where Θ replays the rounds since
        the last checkpoint).

        Returns:
            ``{"eval_loss", "eval_accuracy", "versions"}``.

        Raises:
            BrokerError: A fragment has no committed state yet.
            redis.ConnectionError, redis.TimeoutError: Redis did not answer.
        """
        params, versions = published_params(
            self.r, self.keys, self.cfg, self.frags, self.task.param_shapes()) if published \
            else self.global_model()
        return {**self.evaluate_params(params, data), "versions": versions}

    def evaluate_params(self, params: dict[str, np.ndarray], data: Data) -> dict:
        """Evaluation loss and accuracy of `params` on the held-out split."""
        if self._eval_batches is None:
            self._eval_batches = data.eval_batches(self.cfg.data.eval_batches,
                                                   self.cfg.inner.batch_size)
        m = evaluate({k: jnp.asarray(v) for k, v in params.items()}, self._eval_batches,
                     self.task)
        return {"eval_loss": m["loss"], "eval_accuracy": m["accuracy"]}

    def close(self) -> None:
        """Kill what still runs and close the Redis client."""
        self.kill_all()
        self.r.close()
