"""The learner role: inner AdamW steps on its data shard, fragment pushes, merged values in.

A loop around the pure learner state machine (`pipeline.learner.LearnerCore`) and the network
thread (`workers.learner_net`). The loop never blocks on the network, except in blocking modes
(sync-diloco, or `sync.strict`), where waiting for the merged value is the point.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import zmq

from broker import codec, registry
from broker.errors import BrokerError
from broker.records import FinalPushes, Heartbeat, LearnerFinal
from pipeline import data, quant
from pipeline.learner import LearnerCore, Push
from pipeline.train import inner_optimizer, make_step
from workers.common import RunContext, enable_compile_cache, open_run, read_snapshot
from workers.learner_net import LearnerNet, read_push_log

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
    fail_at_step: int = 0          # fault injection: exit abruptly after this step (0: never)


class Learner:
    def __init__(self, cfg: LearnerConfig, ctx: RunContext, zctx: zmq.Context):
        self.cfg = cfg
        self.ctx = ctx
        self.run_cfg = ctx.cfg
        self.sync = ctx.cfg.effective_sync()
        self.id = cfg.learner_id
        shard = cfg.shard
        if shard is None:
            m = re.search(r"(\d+)$", cfg.learner_id)
            shard = int(m.group(1)) if m else 0
        if not 0 <= shard < ctx.cfg.learners:
            raise ValueError(f"learner {cfg.learner_id}: shard {shard} is out of range "
                             f"[0, {ctx.cfg.learners - 1}]")
        self.shard = shard
        self.state_dir = Path(cfg.state_dir) if cfg.state_dir else None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        self._push_log = self.state_dir / f"{self.id}.acked.jsonl" if self.state_dir else None
        self.net = LearnerNet(ctx, self.id, zctx, acked_log=self._push_log,
                              sub_endpoints=cfg.sub_endpoints)
        self.tokens_per_step = ctx.cfg.inner.batch_size * ctx.cfg.model.seq_len
        self.secs = [0.0] * len(ctx.fragments)
        self.step_s = 0.0
        self.step = 0
        self.tokens_done = 0
        self.tokens = 0
        self.train_s = 0.0
        self.steady_steps_per_s = 0.0
        self.core: LearnerCore | None = None  # built on joining, from the fragments' snapshots
        self.params: dict | None = None
        self._prior: Heartbeat | None = None
        self._joined: tuple[list[int], dict[str, np.ndarray]] | None = None
        self._push_time: dict[int, float] = {}

    def _join(self) -> None:
        """Subscribe first, then read every fragment's snapshot (the Clone pattern)."""
        # the last heartbeat of a previous incarnation, read before ours overwrites it
        self._prior = registry.learner_records(self.ctx.r, self.ctx.keys).get(self.id)
        if self._prior:
            self.net.report(step=self._prior.step, tokens=self._prior.tokens)
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
            self.net.joined_at(p, snap[0])
        self.core = LearnerCore(self.id, self.ctx.fragments, self.sync, values, versions)
        self.params = {k: jnp.asarray(values[k]) for k in self.ctx.shapes}
        self._joined = (versions, values)
        rejoin = any(versions)
        registry.event(self.ctx.r, self.ctx.keys, "rejoin" if rejoin else "join", learner=self.id,
                       versions=versions, pid=os.getpid())

    def _drain_inbox(self, timeout_s: float = 0.0) -> int:
        n = 0
        try:
            item = self.net.inbox.get(timeout=timeout_s) if timeout_s else \
                self.net.inbox.get_nowait()
            while True:
                p, version, values = item
                self.core.on_global(p, version, values)
                n += 1
                item = self.net.inbox.get_nowait()
        except queue.Empty:
            return n

    def _send(self, push: Push, final: bool = False) -> None:
        meta = codec.EntryMeta.of_push(self.id, push, self.sync.codec_up,
                                       seconds=self.secs[push.fragment], final=final)
        self.net.push(push.fragment, codec.entry_fields(meta, push.payload))

    def _wait_until_unblocked(self) -> None:
        """Blocking modes: wait for the merged value (repairing from the snapshot on timeout)."""
        while self.core.blocked(self.step):
            if not self._drain_inbox(timeout_s=self.ctx.cfg.broker.snapshot_timeout_s):
                for p, f in enumerate(self.core.inflight):
                    if f is not None and self.core.pending[p] is None:
                        self.net.request_snapshot(p)
        self.params = self.core.apply_due(self.step, self.params)

    def _check_timeouts(self, now: float) -> None:
        for p, f in enumerate(self.core.inflight):
            if f is None or self.core.pending[p] is not None:
                continue
            sent_at = self._push_time.get(p)
            if sent_at is not None and now - sent_at > self.ctx.cfg.broker.snapshot_timeout_s:
                self.net.request_snapshot(p)
                self._push_time[p] = now

    def train(self) -> None:
        cfg, run_cfg = self.cfg, self.run_cfg
        self._join()
        corpus = data.run_corpus(run_cfg)
        opt = inner_optimizer(run_cfg.inner, run_cfg.steps)
        step_fn = make_step(self.ctx.task, opt)
        opt_state = opt.init(self.params)
        self.step, tokens, opt_state = self._resume(opt_state)
        every = cfg.checkpoint_every or self.sync.delta_h
        t_rate, tok_rate = time.monotonic(), 0
        t_train = t_first = time.monotonic()
        steps_here = 0  # steps done by this process (a restarted learner resumes mid-run)
        while self.step < run_cfg.steps:
            t0 = time.monotonic()
            self._drain_inbox()
            batch = jnp.asarray(corpus.batch(self.shard, self.step, run_cfg.inner.batch_size))
            self.params, opt_state, metrics = step_fn(self.params, opt_state, batch)
            jax.block_until_ready(self.params)
            self._pace(t0)
            dt = time.monotonic() - t0
            self.step += 1
            steps_here += 1
            if steps_here == 1:
                t_first = time.monotonic()  # the first step of a process includes compilation
            tokens += self.tokens_per_step
            self.tokens_done = tokens
            self.step_s = dt if self.step_s == 0 else 0.8 * self.step_s + 0.2 * dt
            for p in range(len(self.secs)):
                self.secs[p] += dt
            if cfg.sync:
                self.params, pushes = self.core.after_step(self.step, self.tokens_per_step,
                                                           self.params)
                self._reset_secs()
                for push in pushes:
                    self._send(push)
                    self._push_time[push.fragment] = time.monotonic()
                if self.core.blocked(self.step):
                    self._wait_until_unblocked()
                    self._reset_secs()
                self._check_timeouts(time.monotonic())
            now = time.monotonic()
            if now - t_rate >= 1.0:
                tps = (tokens - tok_rate) / (now - t_rate)
                t_rate, tok_rate = now, tokens
                self.net.report(step=self.step, tokens=tokens, tokens_per_s=tps,
                                step_s=self.step_s, versions=list(self.core.base_version),
                                loss=float(metrics["loss"]), pid=os.getpid(),
                                host=socket.gethostname(), shard=self.shard)
            if self.state_dir is not None and self.step % every == 0:
                self._checkpoint(opt_state, tokens)
            if cfg.fail_at_step and self.step == cfg.fail_at_step:
                os._exit(19)  # fault injection: die abruptly mid-run
            if self.net.stop_seen or self.net.finish_seen:
                break
        self.tokens = tokens
        self.train_s = time.monotonic() - t_train
        self.steady_steps_per_s = ((steps_here - 1) / (time.monotonic() - t_first)
                                   if steps_here > 1 else 0.0)

    def _ckpt_path(self) -> Path | None:
        return self.state_dir / f"{self.id}.ckpt.npz" if self.state_dir else None

    def _checkpoint(self, opt_state, tokens: int) -> None:
        """Everything a restart needs to lose only the steps since this checkpoint, written
        atomically (temp file + rename): position, inner-optimiser state, the parameters with
        their unpushed progress, and the sync bookkeeping (bases, counters, push in flight)."""
        path = self._ckpt_path()
        leaves = jax.tree_util.tree_leaves(opt_state)
        meta, core_arrays = self.core.state_dict()
        meta["secs"] = list(self.secs)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, step=self.step, tokens=tokens, run_hash=self.ctx.run_hash,
                 core=json.dumps(meta),
                 **{f"leaf{i}": np.asarray(x) for i, x in enumerate(leaves)},
                 **{f"theta/{n}": np.asarray(v) for n, v in self.params.items()},
                 **{f"core/{k}": v for k, v in core_arrays.items()})
        os.replace(tmp, path)

    def _resume(self, opt_state):
        """(step, tokens, inner optimiser state) to continue from after a restart.

        From the learner's own checkpoint when it has one; else the step from its last
        heartbeat in Redis with a fresh inner optimiser; else from scratch.
        """
        path = self._ckpt_path()
        if path is not None and path.exists():
            with np.load(path) as z:
                if str(z["run_hash"]) == self.ctx.run_hash:
                    treedef = jax.tree_util.tree_structure(opt_state)
                    n = treedef.num_leaves
                    leaves = [jnp.asarray(z[f"leaf{i}"]) for i in range(n)]
                    step, tokens = int(z["step"]), int(z["tokens"])
                    progress = "core" in z.files and self._restore_progress(z)
                    registry.event(self.ctx.r, self.ctx.keys, "resume", learner=self.id,
                                   step=step, source="checkpoint", progress=int(progress))
                    return step, tokens, jax.tree_util.tree_unflatten(treedef, leaves)
        rec = self._prior
        if rec and rec.step:
            registry.event(self.ctx.r, self.ctx.keys, "resume", learner=self.id,
                           step=rec.step, source="heartbeat")
            return int(rec.step), int(rec.tokens), opt_state
        return 0, 0, opt_state

    def _restore_progress(self, z) -> bool:
        """Resume the checkpointed parameters and sync bookkeeping instead of the snapshots read
        at join: the unpushed progress of every fragment survives the restart. A push in flight
        that Redis never acknowledged is forgotten (its progress goes out with the next push);
        the snapshots newer than the checkpoint's bases are applied the usual way."""
        try:
            meta = json.loads(str(z["core"]))
            params = {n: np.asarray(z[f"theta/{n}"], np.float32) for n in self.ctx.shapes}
            core_arrays = {k[len("core/"):]: z[k] for k in z.files if k.startswith("core/")}
            self.core.load_state(meta, core_arrays)
        except (KeyError, ValueError) as e:
            log.warning("%s: checkpoint progress not restored (%s); starting from the snapshots",
                        self.id, e)
            versions, values = self._joined
            self.core = LearnerCore(self.id, self.ctx.fragments, self.sync, values, versions)
            return False
        acked = self._acked_pushes()
        for p, f in enumerate(self.core.inflight):
            if f is not None and (p, f.base_version, f.step) not in acked:
                self.core.forget_push(p)
            elif f is not None:  # its merged value may still come: repair on the usual timeout
                self._push_time[p] = time.monotonic()
        self.params = {k: jnp.asarray(v) for k, v in params.items()}
        self.secs = [float(x) for x in meta.get("secs", self.secs)]
        versions, values = self._joined
        for p, v in enumerate(versions):
            self.core.on_global(p, v, values)  # ignored unless newer than the restored base
        return True

    def _acked_pushes(self) -> set[tuple[int, int, int]]:
        """(fragment, base_version, step) of every push Redis acknowledged, from the log."""
        path = self._push_log
        if path is None or not path.exists():
            return set()
        return {(int(rec["fragment"]), int(rec["base_version"]), int(rec["step"]))
                for rec in read_push_log(path) if "id" in rec}

    def _pace(self, t0: float) -> None:
        """Pad the step to `pace_s` of wall time, then add `delay_s` (a slow learner's step
        takes pace + delay: pace 0.2 s and delay 0.4 s make a learner three times slower)."""
        left = max(self.cfg.pace_s, 0.0) - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)
        if self.cfg.delay_s > 0:
            time.sleep(self.cfg.delay_s)

    def _reset_secs(self) -> None:
        for p in range(len(self.secs)):
            if self.core.steps[p] == 0:
                self.secs[p] = 0.0

    def finish(self) -> LearnerFinal:
        """Final flush: apply answers, push remaining progress, adopt the final global values."""
        deadline = time.monotonic() + self.cfg.final_timeout_s
        final: list[Push] = []
        if self.cfg.sync:
            while any(f is not None and self.core.pending[p] is None
                      for p, f in enumerate(self.core.inflight)):
                if time.monotonic() > deadline:
                    raise BrokerError(f"{self.id}: no merged value arrived for the final flush")
                if not self._drain_inbox(timeout_s=1.0):
                    for p, f in enumerate(self.core.inflight):
                        if f is not None:
                            self.net.request_snapshot(p)
            self.params = self.core.apply_due(10**12, self.params)
            final = self.core.push_all(self.step, self.params)
            for push in final:
                self._send(push, final=True)
            if not self.net.wait_flushed(self.cfg.final_timeout_s):
                raise BrokerError(f"{self.id}: final pushes not accepted by Redis in time")
        registry.mark_final_pushes(self.ctx.r, self.ctx.keys, self.id, FinalPushes(
            final=[p.fragment for p in final], steps=self.step, tokens=self.tokens))
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
            self.params = self.core.apply_due(10**12, self.params)
            values = {k: np.asarray(v) for k, v in self.params.items()}
            hashes = {str(p): quant.tensors_hash({n: values[n] for n in names})
                      for p, names in enumerate(self.ctx.fragments)}
        s = self.net.stats
        report = LearnerFinal(
            hashes=hashes, versions=list(self.core.base_version), steps=self.step,
            tokens=self.tokens, bytes_sent=s.bytes_sent, bytes_received=self.net.bytes_received,
            pushes_attempted=s.pushes_attempted, pushes_acked=s.pushes_acked,
            zmq_gaps=s.zmq_gaps, snapshots_read=s.snapshots_read, step_s=self.step_s,
            train_s=self.train_s, steps_per_s=self.steady_steps_per_s)
        registry.mark_learner_final(self.ctx.r, self.ctx.keys, self.id, report)
        registry.event(self.ctx.r, self.ctx.keys, "done", learner=self.id, steps=self.step)
        return report

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


def main(cfg: LearnerConfig) -> int:
    """Train one learner to the run's step count, then take part in the final flush."""
    if cfg.state_dir:  # a restarted learner loads its compiled steps instead of recompiling
        enable_compile_cache(Path(cfg.state_dir) / f"{cfg.learner_id}.jax-cache")
    ctx = open_run(cfg.redis_url, cfg.run, wait_s=cfg.wait_config_s)
    zctx = zmq.Context()
    learner = Learner(cfg, ctx, zctx)
    if cfg.metrics_port:
        from workers.metrics import learner_spec, serve

        serve(cfg.metrics_port, "diloco_learner", learner_spec(learner))
    try:
        learner.train()
        if not learner.net.stop_seen:
            learner.finish()
        return 0
    finally:
        learner.net.close()
        registry.leave(ctx.r, ctx.keys, cfg.learner_id)
        zctx.term()


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--redis-url", required=True)
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
    ap.add_argument("--metrics-port", type=int, default=0,
                    help="serve Prometheus metrics on this port (default: off)")
    ap.add_argument("--sub-endpoint", action="append", default=[],
                    help="connect to this PUB endpoint instead of the advertised ones")
    ap.add_argument("--fail-at-step", type=int, default=0, help=argparse.SUPPRESS)


def config_from_args(a: argparse.Namespace) -> LearnerConfig:
    return LearnerConfig(a.redis_url, a.run, a.id, a.shard, a.pace_s, a.delay_s,
                         not a.no_sync, state_dir=a.state_dir,
                         checkpoint_every=a.checkpoint_every,
                         sub_endpoints=tuple(a.sub_endpoint), metrics_port=a.metrics_port,
                         fail_at_step=a.fail_at_step)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ap = argparse.ArgumentParser(prog="diloco learner")
    add_args(ap)
    sys.exit(main(config_from_args(ap.parse_args())))
