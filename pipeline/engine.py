"""The in-process engine: M learners and the syncer in one process on a virtual clock.

Every inner step is a real jitted JAX step; only time is simulated. Each learner's step takes
``engine.step_s / speed`` virtual seconds; pushes reach the syncer after a latency plus their
size over the link bandwidth; merged values reach the learners the same way. Learners fail and
come back on a schedule (a restarted learner rejoins from the latest global values). Modes:

* ``ddp`` — one step on the M learners' batches together per step: mathematically synchronous
  data-parallel training with an all-reduce of gradients every step.
* ``sync-diloco`` — one fragment, quorum K = M, no grace, learners block until the merge arrives.
* ``decoupled`` — fragments on a staggered schedule, quorum K, adaptive grace, no blocking.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np

from pipeline import quant
from pipeline.config import RunConfig
from pipeline.contribution import MergeRecord, poisoned
from pipeline.fragments import fragment_sizes, partition
from pipeline.guard import fragment_prior
from pipeline.learner import LearnerCore, Push
from pipeline.syncer import (
    FINAL_FLUSH,
    Contribution,
    Drop,
    FragmentSyncer,
    RoundRefused,
    RoundResult,
)
from pipeline.task import Data, n_params, task_of
from pipeline.train import evaluate, make_step

# Per-message framing overhead used when no wire codec is injected (header + field names).
DEFAULT_OVERHEAD_BYTES = 256


@dataclass
class WireSizes:
    """How many bytes a push / a published value takes on the wire (injectable)."""

    push: Callable[[Push], int] = lambda push: push.nbytes + DEFAULT_OVERHEAD_BYTES
    publish: Callable[[RoundResult], int] = lambda r: sum(
        quant.payload_nbytes(q) for q in r.sent.values()) + DEFAULT_OVERHEAD_BYTES


@dataclass
class _Learner:
    idx: int
    name: str
    speed: float
    params: dict
    opt_state: object
    core: LearnerCore
    clock_s: float = 0.0
    step: int = 0
    alive: bool = True
    blocked: bool = False
    bytes_sent: int = 0
    bytes_received: int = 0
    busy_s: float = 0.0
    epoch: int = 1  # as a distributed learner's process: a restart is a new one


@dataclass(order=True)
class _Event:
    time_s: float
    seq: int
    kind: str = field(compare=False)
    data: tuple = field(compare=False)


def ring_allreduce_bytes_per_step(learners: int, params: int) -> float:
    """fp32 ring all-reduce bytes per worker per step: 2·(M−1)/M·4·params."""
    return 2 * (learners - 1) / learners * 4 * params


def bandwidth_ratios(learners: int, params: int, tokens_per_step: int, sent: float,
                     received: float, learner_tokens: float) -> dict[str, float]:
    """Bytes per token of an fp32 ring all-reduce ÷ ours, per learner, by direction.

    A ring all-reduce worker sends and receives 2·(M−1)/M·4·params bytes per step each.
    ``bandwidth_ratio_sent`` and ``_received`` compare like with like; ``_binding`` uses our
    larger direction (what a link's capacity is sized by). ``bandwidth_ratio_vs_ddp`` is the
    older figure: the ring's bytes *sent* ÷ our bytes sent *and* received.
    """
    ring = ring_allreduce_bytes_per_step(learners, params) / tokens_per_step
    if learner_tokens <= 0:
        return {"bandwidth_ratio_vs_ddp": 0.0, "bandwidth_ratio_sent": 0.0,
                "bandwidth_ratio_received": 0.0, "bandwidth_ratio_binding": 0.0}
    s, r = sent / learner_tokens, received / learner_tokens

    def ratio(x: float) -> float:
        return ring / x if x > 0 else float("inf")

    return {"bandwidth_ratio_vs_ddp": ratio(s + r), "bandwidth_ratio_sent": ratio(s),
            "bandwidth_ratio_received": ratio(r), "bandwidth_ratio_binding": ratio(max(s, r))}


class Engine:
    """Run one configuration to completion; `run()` returns the summary dict.

    Args:
        cfg: the run configuration.
        corpus: the data (shards for ``cfg.learners``); default the task's (`Task.data`).
        wire: byte counts of messages (defaults approximate the wire codec).
        on_event: optional callback ``(kind, dict)`` for progress and metrics.
    """

    def __init__(self, cfg: RunConfig, corpus: Data | None = None, wire: WireSizes | None = None,
                 on_event: Callable[[str, dict], None] | None = None):
        self.cfg = cfg
        self.sync = cfg.effective_sync()
        self.wire = wire or WireSizes()
        self.on_event = on_event or (lambda kind, data: None)
        self.task = task_of(cfg, local=cfg.task)  # the caller's own configuration
        self.corpus = corpus = corpus if corpus is not None else self.task.data()
        self.shapes = self.task.param_shapes()
        self.n_params = n_params(self.task)
        self.eval_batches = corpus.eval_batches(cfg.data.eval_batches, cfg.inner.batch_size)
        self.history: list[dict] = []
        self.diverged = ""  # why training stopped early: a learner's values stopped being finite
        self.dropped: dict[str, int] = {}  # refusals by kind (the guard's: tokens, norm)
        self.clipped = 0
        self.outvoted = 0  # contributions merge = "robust" left out
        self.round_sizes: dict[int, int] = {}  # contributions merged → rounds
        self.poisoned = 0  # pushes the poisoned learner sent (engine.poison_learner)
        self._seq = itertools.count()
        self._events: list[_Event] = []

    # -- shared helpers ------------------------------------------------------------------------

    def _eval(self, params: dict, tokens: int, wall_s: float) -> dict:
        m = evaluate({k: jnp.asarray(v) for k, v in params.items()}, self.eval_batches,
                     self.task)
        rec = {"tokens": tokens, "wall_s": wall_s, "eval_loss": m["loss"],
               "eval_accuracy": m["accuracy"]}
        self.history.append(rec)
        self.on_event("eval", rec)
        return rec

    def _tokens_per_step(self) -> int:
        return self.cfg.inner.batch_size * self.cfg.model.seq_len

    def run(self) -> dict:
        if self.cfg.mode == "ddp":
            return self._run_ddp()
        return self._run_diloco()

    # -- ddp -----------------------------------------------------------------------------------

    def _run_ddp(self) -> dict:
        cfg, M = self.cfg, self.cfg.learners
        params = self.task.init_params(cfg.seed)
        opt = self.task.optimizer()
        opt_state = opt.init(params)
        step_fn = make_step(self.task, opt)
        first = self._eval(params, 0, 0.0)
        tps = self._tokens_per_step() * M
        ring = ring_allreduce_bytes_per_step(M, self.n_params)
        step_s = cfg.engine.step_s + ring / cfg.engine.bandwidth_bps + cfg.engine.latency_s
        for t in range(cfg.steps):
            batch = np.concatenate([self.corpus.batch(m, t, cfg.inner.batch_size)
                                    for m in range(M)])
            params, opt_state, metrics = step_fn(params, opt_state, jnp.asarray(batch))
            if cfg.engine.eval_every and (t + 1) % cfg.engine.eval_every == 0 and t + 1 < cfg.steps:
                self._eval(params, (t + 1) * tps, (t + 1) * step_s)
        last = self._eval(params, cfg.steps * tps, cfg.steps * step_s)
        sent = int(ring * cfg.steps)
        return self._summary(first, last, tokens=cfg.steps * tps, sent=sent, received=sent,
                             goodput=1.0, rounds=cfg.steps, wall_s=cfg.steps * step_s,
                             params=params)

    # -- diloco modes --------------------------------------------------------------------------

    def _push_event(self, time_s: float, kind: str, *data) -> None:
        heapq.heappush(self._events, _Event(time_s, next(self._seq), kind, data))

    def _run_diloco(self) -> dict:
        cfg, sync, eng = self.cfg, self.sync, self.cfg.engine
        M = cfg.learners
        init = {k: np.asarray(v) for k, v in self.task.init_params(cfg.seed).items()}
        self.frags = partition(self.shapes, sync.fragments, self.task.is_embedding)
        self.frag_sizes = fragment_sizes(self.shapes, self.frags)
        self.syncers = [FragmentSyncer(p, {n: init[n] for n in f}, cfg.outer, sync,
                                       is_embedding=self.task.is_embedding,
                                       prior_step_norm=fragment_prior(
                                           cfg, {n: self.shapes[n] for n in f}))
                        for p, f in enumerate(self.frags)]
        start = {}
        for s in self.syncers:
            start.update(s.sent_values)
        opt = self.task.optimizer()
        self.opt = opt
        self.step_fn = make_step(self.task, opt)
        speeds = eng.speeds or (1.0,) * M
        self.learners = []
        for m in range(M):
            params = {k: jnp.asarray(start[k]) for k in self.shapes}
            core = self._core(f"L{m}", start, [0] * len(self.frags))
            self.learners.append(_Learner(m, f"L{m}", speeds[m], params, opt.init(params), core))
        for m, at_s, down_s in eng.failures:
            self._push_event(at_s, "fail", m, down_s)
        self.deferred: list[list[Contribution]] = [[] for _ in self.frags]
        self.rounds = 0
        self.useful_s = 0.0
        self._pushed: dict[str, tuple[str, int, int]] = {}  # entry id → (learner, base, step)
        # (learner, fragment) → (base version, step, version) of its last merged push: what the
        # syncer's merge records tell a distributed learner (`LearnerCore.questions`)
        self._merged: dict[tuple[str, int], MergeRecord] = {}
        self.now = 0.0
        first = self._eval(self._global(), 0, 0.0)
        tps = self._tokens_per_step()
        next_eval = eng.eval_every or 0
        while True:
            runnable = [lr for lr in self.learners
                        if lr.alive and not lr.blocked and lr.step < cfg.steps]
            t_next = min((lr.clock_s + eng.step_s / lr.speed for lr in runnable),
                         default=float("inf"))
            if self._events and self._events[0].time_s <= t_next:
                ev = heapq.heappop(self._events)
                self.now = max(self.now, ev.time_s)
                getattr(self, "_on_" + ev.kind)(*ev.data)
                continue
            if not runnable:
                if any(lr.step < cfg.steps for lr in self.learners) and self._events:
                    continue
                break
            lr = min(runnable, key=lambda x: (x.clock_s + eng.step_s / x.speed, x.idx))
            self.now = t_next
            try:
                self._learner_step(lr, t_next)
            except ValueError as e:  # a learner's parameters are no longer finite
                if "non-finite" not in str(e):
                    raise
                self.diverged = f"{lr.name} at step {lr.step}: {e}"
                break
            done = min(x.step for x in self.learners)
            if next_eval and done >= next_eval and done < cfg.steps:
                self._eval(self._global(), done * tps * M, self.now)
                next_eval += eng.eval_every
        if not self.diverged:
            self._final_flush()
        last = self._eval(self._global(), cfg.steps * tps * M, self.now)
        sent = int(np.mean([lr.bytes_sent for lr in self.learners]))
        received = int(np.mean([lr.bytes_received for lr in self.learners]))
        allocated = M * self.now
        goodput = self.useful_s / allocated if allocated > 0 else 0.0
        return self._summary(first, last, tokens=cfg.steps * tps * M, sent=sent,
                             received=received, goodput=goodput, rounds=self.rounds,
                             wall_s=self.now, params=self._global())

    def _global(self) -> dict[str, np.ndarray]:
        out = {}
        for s in self.syncers:
            out.update(s.theta)
        return out

    def _live(self) -> frozenset[str]:
        return frozenset(lr.name for lr in self.learners if lr.alive)

    def _step_time(self) -> float:
        live = [lr.speed for lr in self.learners if lr.alive] or [1.0]
        return self.cfg.engine.step_s / max(live)

    def _learner_step(self, lr: _Learner, t_end: float) -> None:
        cfg, eng = self.cfg, self.cfg.engine
        batch = jax.tree_util.tree_map(
            jnp.asarray, self.corpus.batch(lr.idx, lr.step, cfg.inner.batch_size))
        lr.params, lr.opt_state, _ = self.step_fn(lr.params, lr.opt_state, batch)
        lr.step += 1
        lr.busy_s += eng.step_s / lr.speed
        lr.clock_s = t_end
        lr.params, pushes = lr.core.after_step(lr.step, self._tokens_per_step(), lr.params)
        questions = lr.core.questions.take()
        if questions:  # answered at once, as a distributed learner's network thread would soon
            for p, key in questions.items():
                lr.core.questions.answer(p, key, self._merged_lookup(lr.name, p, key))
            lr.params, more = lr.core.resume(lr.step, lr.params)
            lr.core.questions.take_used()  # nothing here keeps its own record of the value
            pushes += more
        for push in pushes:
            self._send(lr, push, t_end)
        lr.blocked = lr.core.blocked(lr.step)

    def _send(self, lr: _Learner, push: Push, t_s: float, final: bool = False) -> None:
        nbytes = self.wire.push(push)
        lr.bytes_sent += nbytes
        eng = self.cfg.engine
        arrive = t_s + eng.latency_s + nbytes * 8 / eng.bandwidth_bps
        if lr.idx == eng.poison_learner:
            push = poisoned(push, eng.poison, eng.poison_scale, self.sync.codec_up,
                            self.sync.quant_block)
            self.poisoned += 1
        c = Contribution.of(
            replace(push.header(), seconds=push.steps * eng.step_s / lr.speed, epoch=lr.epoch,
                    final=final), dict(push.payload),
            entry_id=f"{lr.name}:{push.fragment}:{push.step}", nbytes=nbytes)
        self._pushed[c.entry_id] = (lr.name, push.base_version, push.step)
        self._push_event(arrive, "arrive", c)

    def _on_arrive(self, c: Contribution) -> None:
        s = self.syncers[c.fragment]
        ok, reason = s.offer(c, self.now, self.task.tokens_per_step())
        if ok:
            c.delta.clear()  # merged into the running sums: nothing kept per contribution
        elif reason.kind is Drop.DEFER:
            self.deferred[c.fragment].append(c)
            return
        self._decide(c.fragment)

    def _on_decide(self, p: int) -> None:
        self._decide(p)

    def _decide(self, p: int, force_reason: str | None = None) -> None:
        s = self.syncers[p]
        if force_reason is None:
            d = s.decide(self.now, s.counted(self._live()), self._step_time())
            if not d.close:
                if d.wait_until_s is not None:
                    self._push_event(d.wait_until_s, "decide", p)
                return
            reason = d.reason
        else:
            reason = force_reason
        if not s.contributors:
            return
        try:
            result = s.close(self.now, reason, s.round_share(len(s.counted(self._live()))))
        except RoundRefused:
            for _, why in s.take_drops():
                self.dropped[why.kind.value] = self.dropped.get(why.kind.value, 0) + 1
            return
        for entry_id, why in result.dropped:
            self.dropped[why.kind.value] = self.dropped.get(why.kind.value, 0) + 1
            self._pushed.pop(entry_id, None)
        self.clipped += len(result.clipped)
        self.outvoted += len(result.outvoted)
        n = len(result.included)
        self.round_sizes[n] = self.round_sizes.get(n, 0) + 1
        s.record_sync_time(self.cfg.engine.sync_s)
        self.rounds += 1
        frac = self.frag_sizes[p] / self.n_params
        for (entry_id, *_), seconds in zip(result.included, result.seconds, strict=True):
            self.useful_s += frac * seconds
            if entry_id in self._pushed:
                name, base, step = self._pushed.pop(entry_id)
                self._merged[(name, p)] = MergeRecord(base, step, result.version)
        self.on_event("round", {"fragment": p, "version": result.version,
                                "included": len(result.included), "dropped": len(result.dropped),
                                "reason": reason, "time_s": self.now})
        nbytes = self.wire.publish(result)
        values = s.sent_values
        eng = self.cfg.engine
        arrive = self.now + eng.sync_s + eng.latency_s + nbytes * 8 / eng.bandwidth_bps
        for lr in self.learners:
            if lr.alive:
                lr.bytes_received += nbytes
                self._push_event(arrive, "deliver", lr.idx, p, result.version, values)
        deferred, self.deferred[p] = self.deferred[p], []
        for c in deferred:
            self._on_arrive(c)

    def _core(self, name: str, start: dict, versions: list[int]) -> LearnerCore:
        core = LearnerCore(name, self.frags, self.sync, start, versions)
        core.questions.on = True
        return core

    def _merged_lookup(self, name: str, p: int, key: tuple[int, int]) -> tuple[int, dict] | None:
        """As a distributed learner reads the merge records and a snapshot: the value of the
        version that merged learner `name`'s push `key` (the latest if no longer held)."""
        m = self._merged.get((name, p))
        if m is None or (m.base_version, m.step) != key:
            return None
        version = m.version
        s = self.syncers[p]
        if version not in s.history:
            version = s.version
        lr = next(x for x in self.learners if x.name == name)
        lr.bytes_received += sum(quant.payload_nbytes(q) for q in s.snapshot_tensors.values())
        return version, s.history[version]

    def _on_deliver(self, m: int, p: int, version: int, values: dict) -> None:
        lr = self.learners[m]
        if not lr.alive:
            return
        # what a distributed learner reads from the merge records when a value arrives
        lr.core.on_global(p, version, values, self._merged.get((lr.name, p)))
        if lr.blocked and not lr.core.blocked(lr.step):
            lr.params = lr.core.apply_due(lr.step, lr.params)
            lr.blocked = False
            lr.clock_s = max(lr.clock_s, self.now)

    def _on_fail(self, m: int, down_s: float) -> None:
        lr = self.learners[m]
        lr.alive = False
        self.on_event("fail", {"learner": lr.name, "time_s": self.now, "down_s": down_s})
        self._push_event(self.now + down_s, "restart", m)
        for p in range(len(self.frags)):  # rounds may now close without the dead learner
            self._decide(p)

    def _on_restart(self, m: int) -> None:
        """Rejoin from the latest global values, with a fresh inner optimiser."""
        lr = self.learners[m]
        start = {}
        for s in self.syncers:
            start.update(s.sent_values)
        lr.params = {k: jnp.asarray(start[k]) for k in self.shapes}
        lr.opt_state = self.opt.init(lr.params)
        lr.core = self._core(lr.name, start, [s.version for s in self.syncers])
        lr.alive, lr.blocked = True, False
        lr.epoch += 1
        lr.clock_s = self.now
        self.on_event("restart", {"learner": lr.name, "time_s": self.now})

    def _final_flush(self) -> None:
        """Apply what arrived, push every fragment's remaining progress, close final rounds."""
        while self._events:
            ev = heapq.heappop(self._events)
            if ev.kind in ("fail", "restart"):
                continue
            self.now = max(self.now, ev.time_s)
            getattr(self, "_on_" + ev.kind)(*ev.data)
        for lr in self.learners:
            if not lr.alive:
                continue
            lr.params = lr.core.apply_due(10**12, lr.params)
            for push in lr.core.push_all(lr.step, lr.params):
                self._send(lr, push, self.now, final=True)
        while self._events:
            ev = heapq.heappop(self._events)
            self.now = max(self.now, ev.time_s)
            if ev.kind == "arrive":
                self._on_arrive(*ev.data)
        for p in range(len(self.frags)):
            self._decide(p, force_reason=FINAL_FLUSH)
        for s in self.syncers:  # refusals no round closed after (the last pushes): counted too
            for _, why in s.take_drops():
                self.dropped[why.kind.value] = self.dropped.get(why.kind.value, 0) + 1
        self._events.clear()

    def _summary(self, first: dict, last: dict, *, tokens: int, sent: int, received: int,
                 goodput: float, rounds: int, wall_s: float, params: dict) -> dict:
        M = self.cfg.learners
        per_learner_tokens = tokens / M
        if self.cfg.mode == "ddp":  # the baseline: its ratios (and goodput) are definitions
            ratios = {k: 1.0 for k in ("bandwidth_ratio_vs_ddp", "bandwidth_ratio_sent",
                                       "bandwidth_ratio_received", "bandwidth_ratio_binding")}
        else:
            ratios = bandwidth_ratios(M, self.n_params, self._tokens_per_step(), sent, received,
                                      per_learner_tokens)
        self.final_params = params
        return {
            "mode": self.cfg.mode,
            "learners": M,
            "steps": self.cfg.steps,
            "params": self.n_params,
            "tokens": int(tokens),
            "initial_eval_loss": first["eval_loss"],
            "final_eval_loss": last["eval_loss"],
            "final_eval_accuracy": last["eval_accuracy"],
            "bytes_sent": int(sent),
            "bytes_received": int(received),
            **{k: float(v) for k, v in ratios.items()},
            "definitions": ("goodput 1 and bandwidth ratios 1: the baseline"
                            if self.cfg.mode == "ddp" else None),
            "goodput": float(goodput),
            "rounds": int(rounds),
            "round_sizes": {str(n): c for n, c in sorted(self.round_sizes.items())},
            "dropped_by_kind": dict(sorted(self.dropped.items())),
            "guard_dropped": sum(self.dropped.get(k, 0) for k in ("tokens", "norm")),
            "guard_clipped": self.clipped,
            "outvoted": self.outvoted,
            "poisoned_pushes": self.poisoned,
            "diverged": self.diverged or None,
            "wall_s": float(wall_s),
            "history": self.history,
        }
