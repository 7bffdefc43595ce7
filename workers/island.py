"""The learner as a library: join a run from your own JAX training loop.

`Island` does everything a learner does around the inner step, and nothing of the step
itself: it joins the run (subscribing first, then reading every fragment's latest merged value),
resumes from its checkpoint, pushes each fragment's outer gradient when it is due, applies
merged values τ steps after the push, sends heartbeats, checkpoints the sync bookkeeping, and
takes part in the final flush. The loop — the model, the optimizer, the data, the devices —
stays the caller's::

    with Island(IslandConfig(redis_url, run="demo", learner_id="L3",
                             task="mypkg.task:make")) as island:
        params, opt_state = island.start(like=params, opt_state=optimizer.init)
        while not island.done:
            batch = my_batches(island.shard, island.step)
            params, opt_state, loss = my_step(params, opt_state, batch)
            params = island.after_step(params, opt_state=opt_state, loss=loss)
        params = island.finish(params)

Parameters are the caller's own pytree (nested dicts and lists) with the run's parameter names
(`pipeline.tree`: paths joined by ``/``) and shapes; `after_step` returns the same structure.
Merged values arrive on the network thread (`workers.learner_net`) and are applied only inside
`after_step`, so the step is never interrupted. An island over several devices passes `place`
(`pipeline.mesh.Placement.params`) and gets merged values back on its mesh.

The CLI learner (`workers/learner.py`) is this class with the run's own task and loop.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import socket
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import redis
import zmq

from broker import codec, pieces, registry, signing
from broker.connection import OUTAGE, quick
from broker.entries import EntryMeta, entry_fields
from broker.errors import BrokerError, DecodeError, Superseded
from broker.pubsub import CurveClient
from broker.records import FinalPushes, Heartbeat, LearnerFinal
from pipeline import quant, tree
from pipeline.contribution import poisoned
from pipeline.learner import DEFER, LearnerCore, Push
from workers.common import (
    NpzWriter,
    RunContext,
    decode_values,
    open_run,
    process_age_s,
    read_snapshot,
    stale_temps,
)
from workers.island_checkpoint import acked_pushes, checkpoint_arrays, pushed_after, restore_opt
from workers.learner_net import LearnerNet

log = logging.getLogger("diloco.learner")

Placer = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class IslandConfig:
    """One learner ("island": one or more local devices). Everything about the run comes from
    Redis; `task` names the user task this process may import (`pipeline.task.task_of`)."""

    redis_url: str
    run: str
    learner_id: str = "L0"
    shard: int | None = None       # data shard (default: the number in the id)
    task: str | None = None        # the user task this process's command line names
    sync: bool = True              # False: train alone (the "syncing off" baseline)
    wait_config_s: float = 60.0
    final_timeout_s: float = 300.0
    state_dir: str | None = None   # checkpoint and acknowledged-push log
    checkpoint_every: int = 0      # inner steps between checkpoints (0: every Δh steps)
    sub_endpoints: tuple[str, ...] = ()  # connect here instead of the advertised endpoints
    devices: int = 1               # devices of this island (reported in heartbeats)
    # the most tokens one inner step trains on, declared in heartbeats (default: the task's
    # tokens per step); `after_step` refuses more
    max_tokens_per_step: int | None = None
    # ZeroMQ CURVE: this learner's key pair and the run's pinned syncer key (None: plaintext)
    curve: CurveClient | None = None
    # signed contributions: this learner's signing key (broker/signing.py; None: unsigned)
    sign_key: bytes | None = None


def _finite_or_none(x: Any) -> float | None:
    """A loss for a heartbeat: None when absent or not finite (heartbeats carry finite
    numbers only)."""
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else None


def shard_of(learner_id: str, shard: int | None, learners: int) -> int:
    """The data shard of a learner: `shard`, else the trailing number of its id, else 0.

    Raises:
        ValueError: The shard is not one of the run's ``learners`` shards.
    """
    if shard is None:
        m = re.search(r"(\d+)$", learner_id)
        shard = int(m.group(1)) if m else 0
    if not 0 <= shard < learners:
        raise ValueError(f"learner {learner_id}: shard {shard} is out of range "
                         f"[0, {learners - 1}]")
    return shard


class Island:
    """A learner around a caller's training loop (see the module docstring).

    Args:
        cfg: Where and who.
        ctx: An opened run (default: open ``cfg.run`` on ``cfg.redis_url``).
        zctx: The ZeroMQ context (default: a new one, terminated by `close`).
        place: Puts a flat ``name → array`` dict where the step wants it (several devices);
            default `jax.numpy.asarray` (the default device).
    """

    def __init__(self, cfg: IslandConfig, *, ctx: RunContext | None = None,
                 zctx: zmq.Context | None = None, place: Placer | None = None):
        self.cfg = cfg
        self.ctx = ctx or open_run(cfg.redis_url, cfg.run, wait_s=cfg.wait_config_s, task=cfg.task)
        self._own_zctx = zctx is None
        self.zctx = zctx or zmq.Context()
        self.run_cfg = self.ctx.cfg
        self.sync = self.run_cfg.effective_sync()
        self.id = cfg.learner_id
        self.shard = shard_of(cfg.learner_id, cfg.shard, self.run_cfg.learners)
        self.total_steps = self.run_cfg.steps
        self.state_dir = Path(cfg.state_dir) if cfg.state_dir else None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        self._push_log = self.state_dir / f"{self.id}.acked.jsonl" if self.state_dir else None
        self.net = LearnerNet(self.ctx, self.id, self.zctx, acked_log=self._push_log,
                              sub_endpoints=cfg.sub_endpoints, curve=cfg.curve)
        # Committed to the device like the jitted step's outputs: a mix of committed and
        # uncommitted inputs is a new signature for jit, and every fragment's merged value
        # arriving as a fresh array made the step compile again (2.5 s each, a dozen times
        # after every restart, before the compilations of every mix were in memory).
        device = jax.devices()[0]
        self._place = place or (lambda flat: {k: jax.device_put(v, device)
                                              for k, v in flat.items()})
        self.tokens_per_step = self.ctx.task.tokens_per_step()
        self.max_tokens_per_step = cfg.max_tokens_per_step or self.tokens_per_step
        if self.max_tokens_per_step < self.tokens_per_step:
            raise ValueError(f"max_tokens_per_step {self.max_tokens_per_step} is below the "
                             f"task's {self.tokens_per_step} tokens per step")
        # the configured Δh, not the effective one: sync-diloco (one fragment, Δh = H) then
        # checkpoints as often as decoupled, so a kill costs every mode the same redone work
        self.every = cfg.checkpoint_every or self.run_cfg.sync.delta_h
        self.step_s = 0.0
        self.step = 0
        self.tokens_done = 0
        self.train_s = 0.0
        self.sync_s = 0.0  # seconds in after_step's own work (see LearnerFinal.sync_s)
        self.steady_steps_per_s = 0.0
        self.report: LearnerFinal | None = None
        self.core: LearnerCore | None = None  # built on joining, from the fragments' snapshots
        self.epoch = 0  # this process's epoch of its learner id, claimed on joining
        self._quick: redis.Redis | None = None  # fail-fast reads of the training loop
        self._params: dict[str, Any] | None = None  # flat, as of the last after_step
        self._treedef: Any = None
        self._names: list[str] = []
        self._prior: Heartbeat | None = None
        self._joined: tuple[list[int], dict[str, np.ndarray]] | None = None
        self._push_time: dict[int, float] = {}
        # the training thread's last sign of life: a step, or a wait on merged values (the
        # liveness probe, workers/metrics.py)
        self.last_tick = time.monotonic()
        self._t_last = self._t_start = self._t_first = 0.0
        # seconds after the process started: joining began, joined, first step done (and
        # took_over_at_s: when a warm spare was told to take over, `diloco learner --standby`)
        self.startup: dict[str, float | None] = {}
        self._t_rate, self._tok_rate = 0.0, 0
        self._steps_here = 0
        self._closed = False
        self._checkpoints = 0
        self._ckpt_writer = NpzWriter(f"{self.id} checkpoint")
        self.stall_in_checkpoint = 0  # fault injection (CLI learner only): see _checkpoint
        self.poison: tuple[str, float] | None = None  # fault injection: (kind, scale), _send

    # -- the caller's loop -----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the run's step count is reached or the run was told to stop or finish."""
        return (self.step >= self.total_steps or self.net.stop_seen or self.net.finish_seen)

    def start(self, like: Any = None, opt_state: Any = None) -> tuple[Any, Any]:
        """Join the run: (parameters, optimizer state) to train from.

        Args:
            like: The caller's parameter tree (its structure; values are ignored), whose names
                and shapes must be the run's. None: parameters as a flat ``name → array`` dict.
            opt_state: The caller's optimizer state for these parameters, or a function that
                makes it from the parameters (``optimizer.init``): returned restored from this
                island's checkpoint when it has one, else as given (made).

        Returns:
            The run's latest merged parameters (or the checkpointed ones, with their unpushed
            progress) in the structure of `like`, and the optimizer state.

        Raises:
            ValueError: `like` has other names or shapes than the run's parameters.
            BrokerError: A fragment has no merged value within ``wait_config_s``.
        """
        if like is not None:
            self._check_like(like)
            self._treedef = jax.tree_util.tree_structure(like)
            self._names = list(tree.flatten(like))
        self.startup["join_at_s"] = process_age_s()
        self._join()
        if callable(opt_state):
            opt_state = opt_state(self._out(self._params))
        self.step, self.tokens_done, opt_state = self._resume(opt_state)
        self.startup["joined_at_s"] = process_age_s()
        self._t_last = self._t_start = self._t_rate = time.monotonic()
        self._tok_rate = self.tokens_done
        return self._out(self._params), opt_state

    def after_step(self, params: Any, *, opt_state: Any = None, loss: Any = None,
                   tokens: int | None = None) -> Any:
        """Count one inner step; push, apply, report and checkpoint what is due.

        Args:
            params: The parameters after the step (the structure `start` returned).
            opt_state: The optimizer state after the step, saved with checkpoints (None: a
                restarted island starts a fresh optimizer state).
            loss: The step's loss, reported in heartbeats (reading it waits for the step).
            tokens: Tokens of this step (default: the task's tokens per step).

        Returns:
            The parameters to continue from: the same values unless a merged value was due.
        """
        self._check_net()
        now = t_in = time.monotonic()
        dt = now - self._t_last  # the caller's step: from the end of the last after_step
        n_tok = self.tokens_per_step if tokens is None else int(tokens)
        if not 0 < n_tok <= self.max_tokens_per_step:
            raise ValueError(f"{self.id}: a step of {n_tok} tokens (declared at most "
                             f"{self.max_tokens_per_step} per step)")
        self.step += 1
        self._steps_here += 1
        if self._steps_here == 1:
            self._t_first = now  # the first step of a process includes compilation
            self.startup["first_step_at_s"] = age = process_age_s()
            took = self.startup.get("took_over_at_s")
            if age is not None:
                marks = ", ".join(f"{k.removesuffix('_at_s').replace('_', ' ')} {v:.1f} s"
                                  for k, v in self.startup.items()
                                  if k not in ("first_step_at_s", "took_over_at_s")
                                  and v is not None)
                log.info("%s: first step %.1f s after the process started (%s%s)", self.id, age,
                         "" if took is None else f"a warm spare, took over at {took:.1f} s; ",
                         marks)
        self.tokens_done += n_tok
        self.step_s = dt if self.step_s == 0 else 0.8 * self.step_s + 0.2 * dt
        flat = self._flat(params)
        self._drain_inbox()  # also without syncing: merged values must not pile up
        if self.cfg.sync:
            applied = self.core.applied
            flat, pushes = self.core.after_step(self.step, n_tok, flat, seconds=dt)
            for push in pushes:
                self._send(push)
                self._push_time[push.fragment] = time.monotonic()
            if self.core.blocked(self.step):
                flat = self._wait_until_unblocked(flat)
            self._check_timeouts(time.monotonic())
            if self.core.applied != applied:
                flat = self._place(flat)
        self._params = flat
        now = self.last_tick = time.monotonic()
        if now - self._t_rate >= 1.0:
            tps = (self.tokens_done - self._tok_rate) / (now - self._t_rate)
            self._t_rate, self._tok_rate = now, self.tokens_done
            self.net.report(step=self.step, tokens=self.tokens_done, tokens_per_s=tps,
                            step_s=self.step_s, versions=list(self.core.base_version),
                            loss=_finite_or_none(loss), **self._identity())
        if self.state_dir is not None and self.step % self.every == 0:
            self._check_net()  # a superseded process writes no checkpoint
            self._checkpoint(opt_state)
        self._t_last = time.monotonic()
        self.sync_s += self._t_last - t_in
        return self._out(flat)

    def _identity(self) -> dict:
        """What every heartbeat says about this island."""
        return {"pid": os.getpid(), "host": socket.gethostname(), "shard": self.shard,
                "devices": self.cfg.devices, "max_tokens_per_step": self.max_tokens_per_step}

    def finish(self, params: Any = None) -> Any:
        """Final flush: push the remaining progress, wait for the final rounds, adopt their
        values. Returns the final parameters (what every learner of the run ends with).

        Raises:
            BrokerError: The syncers did not close the final rounds in ``final_timeout_s``.
        """
        if params is not None:
            self._params = self._flat(params)
        self.report = self._finish()
        return self._out(self._params)

    def close(self) -> None:
        """Leave the run: stop the network thread, deregister (if it ever joined), end the
        ZeroMQ context."""
        if self._closed:
            return
        self._closed = True
        started = self.net.is_alive() or self.net.ident is not None
        self._ckpt_writer.close()
        try:
            if started:
                self.net.close()
            else:  # never started (start() failed early, or a spare that never took over)
                self.net.close_unstarted()
        finally:
            try:
                # the heartbeat is the network thread's: an island that never started it (a
                # warm spare that did not take over) must not delete its learner's
                # nor may one superseded by a newer process of its learner id (also one that
                # stops for another reason before it noticed)
                if started and self.net.superseded is None and not self._superseded_now():
                    registry.leave(self.ctx.r, self.ctx.keys, self.id)
            finally:
                if self._quick is not None:
                    self._quick.close()
                if self._own_zctx:
                    self.zctx.term()

    def __enter__(self) -> Island:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- structure -------------------------------------------------------------------------------

    def _check_like(self, like: Any) -> None:
        flat = tree.flatten(like)
        want = self.ctx.shapes
        if set(flat) != set(want):
            extra, missing = sorted(set(flat) - set(want)), sorted(set(want) - set(flat))
            raise ValueError(f"the parameters are not the run's: extra {extra[:3]}, "
                             f"missing {missing[:3]}")
        for n, v in flat.items():
            if tuple(np.shape(v)) != tuple(want[n]):
                raise ValueError(f"parameter {n}: shape {tuple(np.shape(v))}, the run's is "
                                 f"{tuple(want[n])}")
            if np.dtype(getattr(v, "dtype", np.float32)) != np.float32:
                raise ValueError(f"parameter {n}: dtype {v.dtype}; the run's parameters are "
                                 f"float32 (cast inside the loss for lower precision)")

    def _flat(self, params: Any) -> dict[str, Any]:
        return tree.flatten(params) if self._treedef is not None else dict(params)

    def _out(self, flat: dict[str, Any]) -> Any:
        if self._treedef is None:
            return flat
        return jax.tree_util.tree_unflatten(self._treedef, [flat[n] for n in self._names])

    # -- joining and the network -----------------------------------------------------------------

    def _join(self) -> None:
        """Subscribe first, then read every fragment's snapshot (the Clone pattern)."""
        # the last heartbeat of a previous incarnation, read before ours overwrites it
        self._prior = registry.learner_records(self.ctx.r, self.ctx.keys).get(self.id)
        prior = {"step": self._prior.step, "tokens": self._prior.tokens} if self._prior else {}
        # from now on an older process running as this learner pushes nothing more
        self.net.sign_key = self.cfg.sign_key
        self.epoch = self.net.epoch = registry.claim_epoch(self.ctx.r, self.ctx.keys, self.id,
                                                           self.cfg.sign_key)
        self.net.report(**prior, **self._identity())
        self.net.start()
        values: dict[str, np.ndarray] = {}
        versions = []
        deadline = time.monotonic() + self.cfg.wait_config_s
        for p in range(len(self.ctx.fragments)):
            snap = read_snapshot(self.ctx, p)
            while snap is None:
                if time.monotonic() > deadline:
                    raise BrokerError(f"fragment {p} has no global value in Redis; is a syncer "
                                      f"running for run {self.ctx.keys.run!r}?")
                time.sleep(0.1)
                snap = read_snapshot(self.ctx, p)
            versions.append(snap[0])
            values.update(snap[1])
            self.net.joined_at(p, snap[0], snap[1])
        self.core = self._new_core(values, versions)
        self._params = self._place({k: values[k] for k in self.ctx.shapes})
        self._joined = (versions, values)
        rejoin = any(versions)
        registry.event(self.ctx.r, self.ctx.keys, "rejoin" if rejoin else "join", learner=self.id,
                       versions=versions, pid=os.getpid(), devices=self.cfg.devices)

    def _new_core(self, values: dict[str, np.ndarray], versions: list[int]) -> LearnerCore:
        core = LearnerCore(self.id, self.ctx.fragments, self.sync, values, versions)
        core.merged_lookup = self._merged_lookup
        return core

    def _merged_lookup(self, p: int, f: Any) -> tuple[int, dict[str, np.ndarray]] | str | None:
        """Was fragment p's push in flight merged, though its value never came? Then that
        version's value (or the latest, if Redis no longer keeps it) from its snapshot, for
        `LearnerCore.rebase_merged`; None when it was not; `DEFER` when Redis cannot say now
        (unreachable: the training loop must not wait on it, and pushing everything again
        could repeat merged progress)."""
        if self.net.redis_down:
            return DEFER
        fk = self.ctx.keys.fragment(p)
        try:
            if self._quick is None:  # a cluster client reads the slot map when it is built
                self._quick = quick(self.ctx.r)
            r = self._quick
            rec = registry.merged(r, self.ctx.keys, self.id, p)
            if rec is None or (rec.base_version, rec.step) != f.key:
                return None
            limit = self.run_cfg.broker.max_payload_bytes
            blob = (pieces.read(r, fk.sent(rec.version), max_bytes=limit, what="snapshot")
                    or pieces.read(r, fk.global_, max_bytes=limit, what="snapshot"))
            if blob is None:
                return None
            header, tensors = codec.unpack_snapshot(blob, max_bytes=limit)
        except (redis.RedisError, *OUTAGE) as e:
            log.warning("%s: could not check whether push %d of fragment %d was merged (%s); "
                        "pushing at the fragment's next turn", self.id, f.key[1], p, e)
            return DEFER
        except DecodeError as e:
            log.warning("%s: could not check whether push %d of fragment %d was merged (%s); "
                        "pushing all its progress again", self.id, f.key[1], p, e)
            return None
        problem = self.net.check_value(header, tensors)
        if problem or header.fragment != p or header.version < rec.version:
            log.warning("%s: the snapshot of fragment %d is not usable (%s); pushing all "
                        "the progress again", self.id, p, problem or "an older version")
            return None
        values = decode_values(tensors)
        if not all(np.isfinite(v).all() for v in values.values()):
            log.warning("%s: non-finite values in the snapshot of fragment %d", self.id, p)
            return None
        self.net.joined_at(p, header.version, values)
        log.info("%s: push %d of fragment %d was merged into v%d, whose value never came: "
                 "rebased onto v%d, pushing only the progress since", self.id, f.key[1], p,
                 rec.version, header.version)
        return header.version, values

    def _newer_epoch(self) -> int | None:
        """A newer process's epoch of this learner id, read now (None: none)."""
        return registry.newer_epoch(self.ctx.r, self.ctx.keys, self.id, self.epoch,
                                    self.cfg.sign_key) if self.epoch else None

    def _superseded_now(self) -> bool:
        try:
            return self._newer_epoch() is not None
        except (*OUTAGE, redis.ResponseError):
            return False  # (leave() will not reach Redis either)

    def _check_current(self) -> None:
        """Raise `Superseded` if a newer process has joined as this learner (read now, not
        at the network thread's next look)."""
        self._check_net()
        newer = self._newer_epoch()
        if newer is not None:
            self.net.superseded = newer
            self.net.stop_event.set()
            self._check_net()

    def _check_net(self) -> None:
        """Fail loudly if the network thread died (a learner must not train on unsynced)."""
        if self.net.superseded is not None and not self._closed:
            raise Superseded(f"{self.id}: another process joined the run as this learner "
                             f"(epoch {self.net.superseded}; this one {self.epoch}): stopping")
        if self.net.ident is not None and not self.net.is_alive() and not self._closed:
            raise BrokerError(f"{self.id}: the network thread stopped unexpectedly (see the "
                              f"log above)")

    def _drain_inbox(self, timeout_s: float = 0.0) -> int:
        self._check_net()
        self.last_tick = time.monotonic()
        n = 0
        try:
            item = self.net.inbox.get(timeout=timeout_s) if timeout_s else \
                self.net.inbox.get_nowait()
            while True:
                p, version, values, merged = item
                self.core.on_global(p, version, values, merged)
                n += 1
                item = self.net.inbox.get_nowait()
        except queue.Empty:
            return n

    def _send(self, push: Push, final: bool = False) -> None:
        if self.poison is not None:  # the poison guard's tests and benchmarks
            push = poisoned(push, *self.poison, self.sync.codec_up, self.sync.quant_block)
        meta = EntryMeta.of_push(self.id, push, self.sync.codec_up,
                                       seconds=push.seconds, final=final, epoch=self.epoch)
        fields = entry_fields(meta, push.payload, piece_bytes=self.run_cfg.broker.piece_bytes)
        if self.cfg.sign_key is not None:
            fields = signing.signed(self.cfg.sign_key, self.ctx.keys.run, fields)
        self.net.push(push.fragment, fields)

    def _wait_until_unblocked(self, flat: dict[str, Any]) -> dict[str, Any]:
        """Blocking modes: wait for the merged value (repairing from the snapshot on timeout;
        a push the syncer refused is waited for no longer: its progress goes out again)."""
        while self.core.blocked(self.step):
            if not self._drain_inbox(timeout_s=self.run_cfg.broker.snapshot_timeout_s):
                for p, f in enumerate(self.core.inflight):
                    if f is not None and self.core.pending[p] is None:
                        try:
                            self._forget_if_refused(p, f)
                        except (redis.RedisError, *OUTAGE) as e:
                            log.warning("%s: could not read the refusals (%s)", self.id, e)
                        if self.core.inflight[p] is not None:
                            self.net.request_snapshot(p)
        return self.core.apply_due(self.step, flat)

    def _check_timeouts(self, now: float) -> None:
        for p, f in enumerate(self.core.inflight):
            if f is None or self.core.pending[p] is not None:
                continue
            sent_at = self._push_time.get(p)
            if sent_at is not None and now - sent_at > self.run_cfg.broker.snapshot_timeout_s:
                self.net.request_snapshot(p)
                self._push_time[p] = now

    # -- checkpoints -----------------------------------------------------------------------------

    def _ckpt_path(self) -> Path | None:
        return self.state_dir / f"{self.id}.ckpt.npz" if self.state_dir else None

    def _checkpoint(self, opt_state: Any) -> None:
        """Everything a restart needs to lose only the steps since this checkpoint, written
        atomically (temp file + rename): position, optimizer state, the parameters with
        their unpushed progress, and the sync bookkeeping (bases, counters, push in flight)."""
        path = self._ckpt_path()
        # the write in progress ends first: never two copies of the state in host memory
        self._ckpt_writer.wait()
        meta, core_arrays = self.core.state_dict()
        arrays = checkpoint_arrays(step=self.step, tokens=self.tokens_done,
                                   run_hash=self.ctx.run_hash, core_meta=meta,
                                   core_arrays=core_arrays, params=self._params,
                                   opt_state=opt_state)
        self._checkpoints += 1
        # written and fsynced off the training thread; the next checkpoint waits for this one
        self._ckpt_writer.submit(path, arrays,
                                 stall_after_half=self._checkpoints == self.stall_in_checkpoint)

    def _resume(self, opt_state: Any) -> tuple[int, int, Any]:
        """(step, tokens, optimizer state) to continue from after a restart.

        From the island's own checkpoint when it has one; else the step from its last
        heartbeat in Redis with the given optimizer state; else from scratch.
        """
        path = self._ckpt_path()
        for tmp in stale_temps(path) if path is not None else ():
            log.warning("%s: removing %s, left by a checkpoint write that did not finish",
                        self.id, tmp)
            tmp.unlink(missing_ok=True)
        if path is not None and path.exists():
            given = opt_state
            try:
                with np.load(path) as z:
                    if str(z["run_hash"]) == self.ctx.run_hash:
                        step, tokens = int(z["step"]), int(z["tokens"])
                        opt_state = restore_opt(z, opt_state, self.id)
                        progress = "core" in z.files and self._restore_progress(z, step)
                        registry.event(self.ctx.r, self.ctx.keys, "resume", learner=self.id,
                                       step=step, source="checkpoint", progress=int(progress))
                        return step, tokens, opt_state
            except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile,
                    zlib.error) as e:
                # truncated or corrupt: set it aside and resume from the snapshots read at join
                aside = path.with_name(path.name + ".corrupt")
                os.replace(path, aside)
                log.error("%s: checkpoint %s is unreadable (%s: %s); moved to %s, resuming "
                          "from the latest global values", self.id, path, type(e).__name__, e,
                          aside)
                registry.event(self.ctx.r, self.ctx.keys, "checkpoint-corrupt",
                               learner=self.id, error=f"{type(e).__name__}: {e}")
                versions, values = self._joined
                self.core = LearnerCore(self.id, self.ctx.fragments, self.sync, values,
                                        versions)
                self._params = self._place({k: values[k] for k in self.ctx.shapes})
                opt_state = given
        rec = self._prior
        if rec and rec.step:
            registry.event(self.ctx.r, self.ctx.keys, "resume", learner=self.id,
                           step=rec.step, source="heartbeat")
            return int(rec.step), int(rec.tokens), opt_state
        return 0, 0, opt_state

    def _restore_progress(self, z, step: int) -> bool:
        """Resume the checkpointed parameters and sync bookkeeping instead of the snapshots read
        at join: the unpushed progress of every fragment survives the restart. A push in flight
        that Redis never acknowledged is forgotten (its progress goes out with the next push);
        a fragment pushed after the checkpoint (the push log says Redis acknowledged it) has
        that push taken as in flight, since it holds all the checkpoint's progress of that
        fragment and may have been merged (`LearnerCore.resume_pushed`); the snapshots newer
        than the checkpoint's bases are applied the usual way."""
        try:
            meta = json.loads(str(z["core"]))
            params = {n: np.asarray(z[f"theta/{n}"], np.float32) for n in self.ctx.shapes}
            for n, v in params.items():
                if v.shape != tuple(self.ctx.shapes[n]):
                    raise ValueError(f"theta/{n} has shape {v.shape}, not {self.ctx.shapes[n]}")
            core_arrays = {k[len("core/"):]: z[k] for k in z.files if k.startswith("core/")}
            self.core.load_state(meta, core_arrays)
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as e:
            log.warning("%s: checkpoint progress not restored (%s); starting from the snapshots",
                        self.id, e)
            versions, values = self._joined
            self.core = self._new_core(values, versions)
            return False
        acked = acked_pushes(self._push_log, self.id, len(self.ctx.fragments),
                             self.ctx.run_hash)
        known = {key for key, _ in acked}
        for p, f in enumerate(self.core.inflight):
            if f is not None and (p, *f.key) not in known:
                self.core.forget_push(p)
        for p, (version, sent) in pushed_after(acked, step, self.core.base_version).items():
            if self._resumable(p, version, sent):
                log.info("%s: fragment %d was pushed at step %d, after the checkpoint (step "
                         "%d): that push is taken as in flight", self.id, p, sent, step)
                self.core.resume_pushed(p, version, sent, step, params)
        for p, f in enumerate(self.core.inflight):
            if f is not None:  # its merged value may still come: repair on the usual timeout
                self._push_time[p] = time.monotonic()
        self._params = self._place(params)
        versions, values = self._joined
        for p, v in enumerate(versions):
            self.core.on_global(p, v, values)  # ignored unless newer than the restored base
        return True

    def _resumable(self, p: int, version: int, sent: int) -> bool:
        """May the push of fragment p (on `version`, at step `sent`) be taken as in flight?
        Not if the syncer refused it; in strict modes, which wait for its merged value, only
        if the syncer's merge record names it (a push Redis lost would keep it waiting); not
        if Redis cannot say now (its progress then goes out again, as before)."""
        try:
            rec = registry.merged(self.ctx.r, self.ctx.keys, self.id, p)
            if rec is not None and (rec.base_version, rec.step) == (version, sent):
                return True
            if self.sync.strict:
                return False
            ref = registry.refusal(self.ctx.r, self.ctx.keys, self.id, p)
        except (redis.RedisError, *OUTAGE) as e:
            log.warning("%s: could not check push %d of fragment %d (%s); its progress goes "
                        "out again", self.id, sent, p, e)
            return False
        return ref is None or (ref.base_version, ref.step) != (version, sent)

    # -- the end ---------------------------------------------------------------------------------

    def _finish(self) -> LearnerFinal:
        if self._steps_here:
            self.train_s = self._t_last - self._t_start
            if self._steps_here > 1 and self._t_last > self._t_first:
                self.steady_steps_per_s = (self._steps_here - 1) / (self._t_last - self._t_first)
        self._check_net()
        deadline = time.monotonic() + self.cfg.final_timeout_s
        final: list[Push] = []
        flat = self._params
        if self.cfg.sync:
            # every push's own merged value first ("rebase" applies a value that does not
            # hold the push in flight and goes on waiting for the one that does)
            while True:
                flat = self.core.apply_due(10**12, flat)
                if all(f is None for f in self.core.inflight):
                    break
                if time.monotonic() > deadline:
                    raise BrokerError(f"{self.id}: no merged value arrived for the final flush")
                if not self._drain_inbox(timeout_s=1.0):
                    for p, f in enumerate(self.core.inflight):
                        if f is not None and self.core.pending[p] is None:
                            self._forget_if_refused(p, f)
                        if self.core.inflight[p] is not None:
                            self.net.request_snapshot(p)
            final = self.core.push_all(self.step, flat)
            for push in final:
                self._send(push, final=True)
            if not self.net.wait_flushed(self.cfg.final_timeout_s):
                self._check_net()
                raise BrokerError(f"{self.id}: final pushes not accepted by Redis in time")
        self._check_current()  # the end-of-run records are the newest process's to write
        registry.mark_final_pushes(self.ctx.r, self.ctx.keys, self.id, self._signed(
            "final-pushes", FinalPushes(final=[p.fragment for p in final], steps=self.step,
                                        tokens=self.tokens_done)))
        hashes = {}
        if self.cfg.sync:
            versions = self._wait_final_versions(deadline)
            for p, v in versions.items():
                while self.core.base_version[p] < v and (self.core.pending[p] is None
                                                         or self.core.pending[p][0] < v):
                    if time.monotonic() > deadline:
                        raise BrokerError(f"{self.id}: final value of fragment {p} not received")
                    if not self._drain_inbox(timeout_s=0.5):
                        self.net.request_snapshot(p)
            flat = self.core.apply_due(10**12, flat)
            for p, v in versions.items():
                if self.core.inflight[p] is not None and self.core.base_version[p] >= v:
                    # the final push was refused: every learner ends on the final value
                    flat = self.core.adopt_base(p, flat)
            flat = self._place(flat)
            values = {k: np.asarray(v) for k, v in flat.items()}
            hashes = {str(p): quant.tensors_hash({n: values[n] for n in names})
                      for p, names in enumerate(self.ctx.fragments)}
        self._params = flat
        s = self.net.stats
        report = LearnerFinal(
            hashes=hashes, versions=list(self.core.base_version), steps=self.step,
            tokens=self.tokens_done, bytes_sent=s.bytes_sent,
            bytes_received=self.net.bytes_received, pushes_attempted=s.pushes_attempted,
            pushes_acked=s.pushes_acked, zmq_gaps=s.zmq_gaps, snapshots_read=s.snapshots_read,
            step_s=self.step_s, train_s=self.train_s, steps_per_s=self.steady_steps_per_s,
            rejected=s.rejected, rebased_merged=self.core.rebased_merged,
            sync_s=round(self.sync_s, 3))
        log.info("%s: %d steps in %.1f s of training; %.1f s (%.1f%%) in pushes, merged values, "
                 "heartbeats and checkpoints", self.id, self._steps_here, self.train_s,
                 self.sync_s, 100 * self.sync_s / max(self.train_s, 1e-9))
        report = self._signed("final", report)
        self._check_current()
        registry.mark_learner_final(self.ctx.r, self.ctx.keys, self.id, report)
        registry.event(self.ctx.r, self.ctx.keys, "done", learner=self.id, steps=self.step)
        return report

    def _signed(self, kind: str, rec: Any) -> Any:
        """An end-of-run report signed with this learner's key (syncers that verify count
        only signed reports of learners they hold keys for)."""
        if self.cfg.sign_key is None:
            return rec
        return signing.sign_record(self.cfg.sign_key, self.ctx.keys.run, kind, self.id, rec)

    def _forget_if_refused(self, p: int, f: Any) -> None:
        """The syncer refused the push in flight for fragment p (no merged value will come
        for it): its progress stays and goes out with the final push."""
        rec = registry.refusal(self.ctx.r, self.ctx.keys, self.id, p)
        if rec is not None and (rec.base_version, rec.step) == f.key:
            log.warning("%s: the syncer refused the push of fragment %d at step %d (%s)",
                        self.id, p, f.key[1], rec.reason)
            self.core.forget_push(p)

    def _wait_final_versions(self, deadline: float) -> dict[int, int]:
        """Fragment → final version, once the syncers have closed every final round."""
        n = len(self.ctx.fragments)
        while True:
            versions: dict[int, int] = {}
            for rep in registry.syncer_final_reports(self.ctx.r, self.ctx.keys).values():
                versions.update({int(p): int(v) for p, v in rep.versions.items()})
            if len(versions) >= n:
                return versions
            if time.monotonic() > deadline:
                raise BrokerError(f"{self.id}: syncers did not finish the final rounds in time")
            self._drain_inbox(timeout_s=0.2)
