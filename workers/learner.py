"""The learner role: inner steps of the run's task on its data shard, fragment pushes, merged
values in.

The training loop of `diloco learner`: the task's batches, optimizer and jitted step, on one
device or an island of several (`pipeline.mesh.Placement`), around `workers.island.Island`,
which does the syncing (the same class a user's own loop calls). The loop never blocks on the
network, except in blocking modes (sync-diloco, or `sync.strict`), where waiting for the merged
value is the point.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import redis
import zmq

from broker import registry, signing
from broker.connection import quick
from broker.errors import BrokerError, Superseded
from broker.pubsub import CurveClient
from pipeline.config import POISONS
from pipeline.fragments import fragment_sizes
from pipeline.mesh import Placement
from pipeline.plan import role_bytes
from pipeline.train import make_step
from workers import native, scalars
from workers.common import (
    RunContext,
    add_redis_args,
    add_role_args,
    apply_environment,
    enable_compile_cache,
    memory_refusal,
    open_run,
    process_age_s,
    require_security,
    usage_error,
)
from workers.heap import keep_freed_memory
from workers.island import Island, IslandConfig

log = logging.getLogger("diloco.learner")


@dataclass(frozen=True)
class LearnerConfig:
    """One learner process. Everything about the run comes from Redis."""

    redis_url: str
    run: str
    learner_id: str = "L0"
    shard: int | None = None       # data shard (default: the number in the id)
    pace_s: float = 0.0            # pad every inner step to this wall time (emulated chips)
    delay_s: float = 0.0           # extra time per step (an emulated slow learner)
    sync: bool = True              # False: train alone (the "syncing off" baseline)
    wait_config_s: float = 60.0
    final_timeout_s: float = 300.0
    state_dir: str | None = None   # inner-optimiser checkpoint and acknowledged-push log
    checkpoint_every: int = 0      # inner steps between checkpoints (0: every Δh steps)
    sub_endpoints: tuple[str, ...] = ()  # connect here instead of the advertised endpoints
    metrics_port: int = 0          # Prometheus text endpoint (0: off)
    metrics_host: str = "127.0.0.1"  # the address it binds
    fail_at_step: int = 0          # fault injection: exit abruptly after this step (0: never)
    stall_in_checkpoint: int = 0   # fault injection: hang halfway through this checkpoint write
    curve: CurveClient | None = None  # ZeroMQ CURVE (--curve-secret, --curve-server-key)
    sign_key: bytes | None = None  # signs every contribution (--sign-key)
    poison: str = ""               # fault injection: send poisoned pushes (POISONS)
    poison_scale: float = 1e4
    task: str | None = None        # the user task this process may import (--task)
    devices: int = 1               # local devices of this learner's island (0: all)
    fsdp: bool = False             # shard parameters and optimizer state over the island
    standby: str = ""              # a warm spare: get ready, join once this file exists
    tensorboard: str | None = None  # this learner's curves as event files here (--tensorboard)
    wandb: bool = False            # and as a W&B run (--wandb)


class Learner:
    """The CLI learner: the run's task trained in a loop around an `Island`."""

    def __init__(self, cfg: LearnerConfig, ctx: RunContext, zctx: zmq.Context):
        self.cfg = cfg
        self.ctx = ctx
        self.run_cfg = ctx.cfg
        self.placement = (Placement(cfg.devices or None, fsdp=cfg.fsdp)
                          if cfg.devices != 1 or cfg.fsdp else None)
        n_dev = self.placement.n_devices if self.placement else 1
        if ctx.cfg.inner.batch_size % n_dev:
            raise ValueError(f"inner.batch_size {ctx.cfg.inner.batch_size} does not divide over "
                             f"the island's {n_dev} devices")
        self.island = Island(
            IslandConfig(cfg.redis_url, cfg.run, cfg.learner_id, cfg.shard, cfg.task, cfg.sync,
                         cfg.wait_config_s, cfg.final_timeout_s, cfg.state_dir,
                         cfg.checkpoint_every, cfg.sub_endpoints, devices=n_dev,
                         curve=cfg.curve, sign_key=cfg.sign_key, tensorboard=cfg.tensorboard,
                         wandb=cfg.wandb),
            ctx=ctx, zctx=zctx, place=self.placement.params if self.placement else None)
        self.id = cfg.learner_id
        self.island.checkpoints.stall_in = cfg.stall_in_checkpoint
        if cfg.poison:
            self.island.poison = (cfg.poison, cfg.poison_scale)
        self.data: Any = None  # `prepare`: after the metrics endpoint is up (it can take time)
        self.opt: Any = None
        self.step_fn: Any = None

    def prepare(self) -> None:
        """The task's data, optimizer and jitted step (once)."""
        if self.step_fn is None:
            task = self.ctx.task
            self.data = task.data()
            self.opt = task.optimizer()
            pl = self.placement
            # donated: the island keeps copies, never the step's inputs (`LearnerCore._push`)
            self.step_fn = pl.step(task, self.opt) if pl else make_step(task, self.opt,
                                                                        donate=True)

    def _init_opt(self, params):
        state = self.opt.init(params)
        if self.placement:
            return self.placement.opt_state(state)
        # committed, like the step's outputs and a restored state: optax makes its step count
        # an uncommitted array, and the first two steps had two signatures (two compilations
        # at every start)
        return jax.device_put(state, jax.devices()[0])

    def _batch(self, step: int):
        batch = self.data.batch(self.island.shard, step, self.run_cfg.inner.batch_size)
        pl = self.placement
        return pl.batch(batch) if pl else jax.tree_util.tree_map(jax.numpy.asarray, batch)

    def warm_up(self) -> float:
        """Run the jitted step on stand-in values placed exactly as joining places the run's
        (fresh optimizer state, one restored from a checkpoint, and the step's own outputs), so
        that every signature the first steps after joining use is compiled and loaded: a warm
        spare (`--standby`) then steps at once when it takes over. Touches nothing in Redis.
        Returns the seconds it took."""
        t0 = time.monotonic()
        self.prepare()
        flat = self.island._place({k: np.zeros(shape, np.float32)
                                   for k, shape in self.ctx.shapes.items()})
        fresh = self._init_opt(flat)
        # the checkpoint's leaves are put where the fresh state's are
        # (`workers.island_checkpoint.restore_opt`)
        restored = jax.tree_util.tree_map(
            lambda x: jax.device_put(np.asarray(x), getattr(x, "sharding", None)), fresh)
        batch = self._batch(0)
        params, _, _ = self.step_fn(flat, fresh, batch)
        # the step's outputs as parameters, a restored state: the same signature (one
        # compilation), so this second call only runs
        jax.block_until_ready(self.step_fn(params, restored, batch))
        return time.monotonic() - t0

    def train(self) -> None:
        cfg, island = self.cfg, self.island
        self.prepare()
        island.startup.setdefault("data_at_s", process_age_s())  # the step compiles later
        step_fn = self.step_fn
        params, opt_state = island.start(opt_state=self._init_opt)
        while not island.done:
            t0 = time.monotonic()
            batch = self._batch(island.step)
            params, opt_state, metrics = step_fn(params, opt_state, batch)
            jax.block_until_ready(params)
            self._pace(t0)
            params = island.after_step(params, opt_state=opt_state, loss=metrics["loss"])
            if cfg.fail_at_step and island.step == cfg.fail_at_step:
                os._exit(19)  # fault injection: die abruptly mid-run

    def _pace(self, t0: float) -> None:
        """Pad the step to `pace_s` of wall time, then add `delay_s` (a slow learner's step
        takes pace + delay: pace 0.2 s and delay 0.4 s make a learner three times slower)."""
        left = max(self.cfg.pace_s, 0.0) - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)
        if self.cfg.delay_s > 0:
            time.sleep(self.cfg.delay_s)


# /healthz fails when the training loop has not stepped (or waited on a merged value) for
# max(this, 20 steps)
LIVENESS_MIN_S = 120.0
EXIT_SUPERSEDED = 3  # another process joined the run as this learner id: this one stopped


def main(cfg: LearnerConfig) -> int:
    """Train one learner to the run's step count, then take part in the final flush."""
    # how far a cold start got when (logged with its first step: where a rejoin's time goes)
    marks = {"imported_at_s": process_age_s()}
    keep_freed_memory()  # before JAX runs anything: each step reuses its scratch memory
    apply_environment()
    native.install_fused()  # before the step is traced
    marks["kernels_at_s"] = process_age_s()
    if cfg.state_dir:  # a restarted learner loads its compiled steps instead of recompiling
        # spares keep their own folder: JAX writes entries without a lock, and a spare warms
        # up while the learner it stands in for runs
        kind = "standby.jax-cache" if cfg.standby else "jax-cache"
        enable_compile_cache(Path(cfg.state_dir) / f"{cfg.learner_id}.{kind}")
    ctx = open_run(cfg.redis_url, cfg.run, wait_s=cfg.wait_config_s, task=cfg.task,
                   need_code=True)
    marks["run_opened_at_s"] = process_age_s()
    refused = memory_refusal(
        "learner", role_bytes(ctx.cfg, fragment_sizes(ctx.shapes, ctx.fragments), "learner"),
        "a host with more memory, or a smaller model")
    if refused:
        log.error("%s: %s", cfg.learner_id, refused)
        return 2
    zctx = zmq.Context()
    try:
        learner = Learner(cfg, ctx, zctx)
    except ValueError as e:  # a setting this process cannot have: one line, no traceback
        log.error("%s: %s", cfg.learner_id, e)
        zctx.term()
        return 2
    learner.island.startup.update(marks)
    if cfg.standby:
        took = False
        try:
            took = wait_to_take_over(learner, Path(cfg.standby))
        finally:
            if not took:  # it never joined: closing deregisters nothing
                learner.island.close()
                zctx.term()
        if not took:
            return 0
    if cfg.metrics_port:
        from workers.metrics import learner_spec, serve, stalled

        island = learner.island
        serve(cfg.metrics_port, "diloco_learner", learner_spec(island), addr=cfg.metrics_host,
              live=stalled(lambda: island.last_tick if island.core is not None
                           else time.monotonic(),  # joining: bounded by wait_config_s
                           lambda: max(LIVENESS_MIN_S, 20 * island.step_s), "the training loop"),
              ready=lambda: None if island.core is not None else "joining the run")
    try:
        learner.train()
        if not learner.island.net.stop_seen:
            learner.island.finish()
        return 0
    except Superseded as e:  # another process runs as this learner now: it carries on
        log.error("%s", e)
        return EXIT_SUPERSEDED
    except BrokerError as e:  # e.g. no value to join from, or a snapshot refused: one line
        log.error("%s: %s", cfg.learner_id, e)
        return 1
    finally:
        learner.island.close()
        zctx.term()


STANDBY_POLL_S = 0.02  # how often a warm spare looks for its file
STANDBY_RUN_CHECK_S = 1.0  # how often it reads whether the run was stopped or finished


def standby_ready_file(go: Path) -> Path:
    """The file a warm spare writes (its pid) once it is warm and waiting for `go`."""
    return go.with_name(go.name + ".ready")


def wait_to_take_over(learner: Learner, go: Path) -> bool:
    """A warm spare: compile and run the step once (`Learner.warm_up`), then wait until `go`
    exists, remove it and return True; False when the run is stopped or finished, or the
    learner it stands in for has written its end-of-run report, first. While it waits,
    `standby_ready_file` holds its pid. The
    spare writes nothing to the run while it waits, so any number may stand by; the one whose
    file appears joins as ``--id`` (resuming from ``--state-dir`` like any restart)."""
    if go.exists():  # left from an earlier takeover attempt: it must not start this one
        log.warning("%s: standby: removing %s, which existed before this spare started",
                    learner.id, go)
        go.unlink(missing_ok=True)
    warm_s = learner.warm_up()
    log.info("%s: standby: warm (imports, data, compiled step) %.1f s after the process "
             "started, step warm-up %.1f s; waiting for %s", learner.id, process_age_s() or 0.0,
             warm_s, go)
    ready = standby_ready_file(go)
    tmp = ready.with_name(ready.name + ".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, ready)
    ctx = learner.ctx
    q = quick(ctx.r)  # a check must not hold up the takeover while Redis is unreachable

    def ended() -> bool:
        try:
            return (registry.stop_requested(q, ctx.keys) or registry.finish_requested(q, ctx.keys)
                    or registry.learner_finished(q, ctx.keys, learner.id))
        except redis.RedisError as e:  # Redis down: keep waiting, the run may come back
            log.warning("%s: standby: cannot read the run's state (%s)", learner.id, e)
            return False

    try:
        next_check = 0.0
        while not go.exists():
            now = time.monotonic()
            if now >= next_check:
                next_check = now + STANDBY_RUN_CHECK_S
                if ended():
                    break
            time.sleep(STANDBY_POLL_S)
        took = go.exists() and not ended()  # told to, and the run still needs it
    finally:
        q.close()
    for f in (go, ready):
        f.unlink(missing_ok=True)
    if not took:
        log.info("%s: standby: the run (or %s) ended before it was needed", learner.id,
                 learner.id)
        return False
    learner.island.startup["took_over_at_s"] = age = process_age_s()
    log.info("%s: standby: taking over %.1f s after the process started", learner.id,
             age or 0.0)
    return True


def add_args(ap: argparse.ArgumentParser) -> None:
    add_redis_args(ap)
    ap.add_argument("--run", required=True)
    ap.add_argument("--id", default="L0", help="learner id; its trailing number is the shard")
    ap.add_argument("--shard", type=int, default=None, help="data shard (default: from --id)")
    ap.add_argument("--pace-s", type=float, default=0.0,
                    help="pad each inner step to this wall time (emulate dedicated chips)")
    ap.add_argument("--delay-s", type=float, default=0.0, help="extra seconds per step")
    ap.add_argument("--no-sync", action="store_true", help="train without syncing")
    ap.add_argument("--state-dir", default=None,
                    help="folder for this learner's inner-optimiser checkpoint (resumed on "
                         "restart) and its log of acknowledged pushes")
    ap.add_argument("--checkpoint-every", type=int, default=0,
                    help="inner steps between checkpoints (default: every Δh steps)")
    add_role_args(ap)
    ap.add_argument("--sub-endpoint", action="append", default=[],
                    help="connect to this PUB endpoint instead of the advertised ones")
    ap.add_argument("--curve-secret", metavar="FILE",
                    help="ZeroMQ CURVE: this learner's key pair (NAME.key_secret from diloco "
                         "keys); with --curve-server-key")
    ap.add_argument("--curve-server-key", metavar="FILE",
                    help="ZeroMQ CURVE: the run's syncer public key (syncer.key), pinned: only "
                         "a syncer holding its secret can send this learner values")
    ap.add_argument("--sign-key", metavar="FILE",
                    help="sign every contribution with this learner's key (learners/ID.sign "
                         "from diloco keys); syncers started with --sign-keys require it")
    ap.add_argument("--fail-at-step", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stall-in-checkpoint", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--poison", default="", choices=("", *POISONS), help=argparse.SUPPRESS)
    ap.add_argument("--poison-scale", type=float, default=1e4, help=argparse.SUPPRESS)
    ap.add_argument("--task", default=None, metavar="MODULE:FACTORY",
                    help="the user task of the run (imported only when the run names the same)")
    ap.add_argument("--devices", type=int, default=1,
                    help="local devices of this learner's island, data parallel (0: all)")
    ap.add_argument("--fsdp", action="store_true",
                    help="shard parameters and optimizer state over the island's devices")
    scalars.add_args(ap)
    ap.add_argument("--standby", metavar="FILE", default="",
                    help="a warm spare for --id: start, load the data and compile the step, "
                         "write FILE.ready, then wait (touching nothing in the run) until FILE "
                         "exists; remove both and join as --id. A FILE there at start is "
                         "removed. Exits 0 if the run (or --id) ends first")


def curve_client(secret: str | None, server_key: str | None) -> CurveClient | None:
    """The learner's CURVE settings from its two flags (both or neither)."""
    if bool(secret) != bool(server_key):
        usage_error("--curve-secret and --curve-server-key go together")
    return CurveClient(secret, server_key) if secret else None


def _sign_key(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        return signing.read_key(path)
    except (OSError, ValueError) as e:
        usage_error(f"--sign-key: {e}")


def config_from_args(a: argparse.Namespace) -> LearnerConfig:
    if missing := scalars.missing_extra(a.tensorboard, a.wandb):
        usage_error(missing)
    require_security(a.redis_url, curve=bool(a.curve_secret), signed=bool(a.sign_key),
                     insecure=a.insecure or a.no_sync)
    return LearnerConfig(a.redis_url, a.run, a.id, a.shard, a.pace_s, a.delay_s,
                         not a.no_sync, state_dir=a.state_dir,
                         checkpoint_every=a.checkpoint_every,
                         sub_endpoints=tuple(a.sub_endpoint), metrics_port=a.metrics_port,
                         metrics_host=a.metrics_host,
                         fail_at_step=a.fail_at_step, task=a.task, devices=a.devices,
                         fsdp=a.fsdp, stall_in_checkpoint=a.stall_in_checkpoint,
                         poison=a.poison, poison_scale=a.poison_scale,
                         curve=curve_client(a.curve_secret, a.curve_server_key),
                         sign_key=_sign_key(a.sign_key), standby=a.standby,
                         tensorboard=a.tensorboard, wandb=a.wandb)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(prog="diloco learner")
    add_args(ap)
    sys.exit(main(config_from_args(ap.parse_args())))
