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

Checkpoints (`workers.island_checkpoint`) and the final flush (`workers.island_final`) are
units of their own. The CLI learner (`workers/learner.py`) is this class with the run's own
task and loop.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
import redis
import zmq

from broker import registry, signing
from broker.connection import OUTAGE
from broker.entries import entry_fields
from broker.errors import BrokerError, Superseded
from broker.records import Heartbeat, LearnerFinal
from pipeline import tree
from pipeline.config import to_dict
from pipeline.contribution import poisoned
from pipeline.learner import LearnerCore, Push
from workers.common import (
    RunContext,
    join_snapshot,
    open_run,
    process_age_s,
)
from workers.island_checkpoint import Checkpoints, Joined
from workers.island_config import IslandConfig, finite_or_none, shard_of
from workers.island_final import final_flush
from workers.island_lookup import Answer, MergedLookup
from workers.learner_net import LearnerNet
from workers.scalars import open_log

log = logging.getLogger("diloco.learner")

Placer = Callable[[dict[str, Any]], dict[str, Any]]


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
        # its curves (`workers.scalars`), first: a folder or a W&B run that cannot be had is
        # refused (ValueError) before any socket or thread exists
        self.scalars = open_log(cfg.tensorboard, wandb=cfg.wandb, name=cfg.learner_id,
                                group=self.ctx.keys.run, config=to_dict(self.ctx.cfg))
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
        self._params: dict[str, Any] | None = None  # flat, as of the last after_step
        self._treedef: Any = None
        self._names: list[str] = []
        self._prior: Heartbeat | None = None
        self._joined: Joined | None = None
        self._push_time: dict[int, float] = {}
        # the training thread's last sign of life: a step, or a wait on merged values (the
        # liveness probe, workers/metrics.py)
        self.last_tick = time.monotonic()
        self._t_last = self._t_start = self._t_first = 0.0
        # seconds after the process started: joining began, joined, first step done (and
        # took_over_at_s: when a warm spare was told to take over, `diloco learner --standby`)
        self.startup: dict[str, float | None] = {}
        self._t_rate, self._tok_rate = 0.0, 0
        self.steps_here = 0  # steps this process took (a restarted island's count starts at 0)
        self._closed = False
        self._lookup = MergedLookup(self.ctx, self.id, self.net)
        self.checkpoints = Checkpoints(self.ctx, self.id, self.sync, self.state_dir,
                                       self._push_log)
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
        res = self.checkpoints.resume(opt_state, core=self.core, joined=self._joined,
                                      prior=self._prior, new_core=self._new_core,
                                      place=self._place)
        self._joined = None  # the bases hold what is still needed of it: no copy kept beside
        self.step, self.tokens_done, opt_state = res.step, res.tokens, res.opt_state
        self.core = res.core or self.core
        if res.params is not None:
            self._params = res.params
        self._push_time.update(dict.fromkeys(res.inflight, time.monotonic()))
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
        self.steps_here += 1
        if self.steps_here == 1:
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
            for p, key in self.core.questions.take().items():
                self._lookup.ask(p, key)  # answered by the network thread, through the inbox
            for p, version, values in self.core.questions.take_used():
                self.net.joined_at(p, version, values)  # rebased onto it: older ones are late
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
            loss = finite_or_none(loss)
            self.net.report(step=self.step, tokens=self.tokens_done, tokens_per_s=tps,
                            step_s=self.step_s, versions=list(self.core.base_version),
                            loss=loss, **self._identity())
            self._curves(loss=loss, tokens_per_s=tps, step_s=self.step_s)
        if self.state_dir is not None and self.step % self.every == 0:
            self._check_net()  # a superseded process writes no checkpoint
            self.checkpoints.write(step=self.step, tokens=self.tokens_done, core=self.core,
                                   params=self._params, opt_state=opt_state)
        self._t_last = time.monotonic()
        self.sync_s += self._t_last - t_in
        return self._out(flat)

    def _curves(self, **values: float | None) -> None:
        """This island's curves at its step (`workers.scalars`: written off this thread)."""
        if self.scalars is not None:
            self.scalars.add("learner", self.step, {
                **values, "tokens": self.tokens_done, "bytes_sent": self.net.stats.bytes_sent,
                "bytes_received": self.net.bytes_received}, t=time.time())

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
        if self.steps_here:
            self.train_s = self._t_last - self._t_start
            if self.steps_here > 1 and self._t_last > self._t_first:
                self.steady_steps_per_s = (self.steps_here - 1) / (self._t_last - self._t_first)
        self.report = final_flush(self)
        self._curves(sync_s=self.sync_s)
        return self._out(self._params)

    def close(self) -> None:
        """Leave the run: stop the network thread, deregister (if it ever joined), end the
        ZeroMQ context."""
        if self._closed:
            return
        self._closed = True
        started = self.net.is_alive() or self.net.ident is not None
        self.checkpoints.close()
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
                self._lookup.close()
                if self._own_zctx:
                    self.zctx.term()
                if self.scalars is not None:  # last: the run is left already
                    self.scalars.close()

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
        limit = self.run_cfg.broker.max_payload_bytes
        shapes = [{n: self.ctx.shapes[n] for n in names} for names in self.ctx.fragments]
        for p in range(len(self.ctx.fragments)):
            snap = join_snapshot(self.ctx.r, self.ctx.keys.fragment(p), limit, shapes[p],
                                 self.net.attested, deadline)
            versions.append(snap.version)
            values.update(snap.values)
            self.net.joined_at(p, snap.version, snap.values)
        self._joined = (versions, values)
        self.core = self._new_core(self._joined)
        self._params = self._place({k: values[k] for k in self.ctx.shapes})
        rejoin = any(versions)
        registry.event(self.ctx.r, self.ctx.keys, "rejoin" if rejoin else "join", learner=self.id,
                       versions=versions, pid=os.getpid(), devices=self.cfg.devices)

    def _new_core(self, joined: Joined) -> LearnerCore:
        """A core at the values read when joining."""
        versions, values = joined
        core = LearnerCore(self.id, self.ctx.fragments, self.sync, values, versions)
        core.questions.on = True
        return core

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
        deadline = self.last_tick + timeout_s
        while True:  # waits (up to `timeout_s`) for a merged value, not for an answer
            wait = deadline - time.monotonic() if n == 0 else 0.0
            try:
                item = self.net.inbox.get(timeout=wait) if wait > 0 else \
                    self.net.inbox.get_nowait()
            except queue.Empty:
                return n
            if isinstance(item, Answer):
                self.core.questions.answer(*item)
            else:
                self.core.on_global(*item)
                n += 1

    def _send(self, push: Push, final: bool = False) -> None:
        if self.poison is not None:  # the poison guard's tests and benchmarks
            push = poisoned(push, *self.poison, self.sync.codec_up, self.sync.quant_block)
        fields = entry_fields(replace(push, final=final, epoch=self.epoch), push.payload,
                              self.sync.codec_up, piece_bytes=self.run_cfg.broker.piece_bytes)
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

    # -- the end ---------------------------------------------------------------------------------

    def _forget_if_refused(self, p: int, f: Any) -> None:
        """The syncer refused the push in flight for fragment p (no merged value will come
        for it): its progress stays and goes out with the final push."""
        rec = registry.refusal(self.ctx.r, self.ctx.keys, self.id, p)
        if rec is not None and (rec.base_version, rec.step) == f.key:
            log.warning("%s: the syncer refused the push of fragment %d at step %d (%s)",
                        self.id, p, f.key[1], rec.reason)
            self.core.forget_push(p)
