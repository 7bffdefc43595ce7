"""The syncer role: merge fragment streams into rounds, commit them in Redis, publish over ZeroMQ.

`Syncer` is a short loop (`poll_once`) over the parts that do the work, each with one job:
- `workers.syncer_intake.Intake`: entries read, verified, parsed, fenced, offered or
  dead-lettered;
- `workers.syncer_rounds.Rounds`: a due round closed, committed, published;
- `workers.syncer_commits.Commits`: a round's effects (state, snapshot, round record, XACKs)
  in one MULTI/EXEC fenced by the fragment lease; checkpoints, trims, re-commits after an
  outage. Publishing follows the commit, so a crash between the two only delays it (a
  restart re-publishes);
- `workers.syncer_ownership.Ownership`: leases, fragments shared among syncers, adoption and
  recovery;
around the pure per-fragment state machine (`pipeline.syncer`), the Redis stream adapter
(`broker.streams`) and the ZeroMQ publisher (`broker.pubsub`). What they share is
`workers.syncer_state.SyncerShared`; the command line is `workers.syncer_config`.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import redis
import zmq

from broker import attest, registry
from broker.commit import LeaseLost
from broker.connection import OUTAGE, value_limits
from broker.pubsub import Publisher
from broker.records import SyncerFinal
from pipeline import capacity, kernels
from pipeline.config import to_dict
from pipeline.fragments import fragment_sizes
from pipeline.plan import role_bytes
from workers import heap, native
from workers.common import (
    RunContext,
    apply_environment,
    memory_refusal,
    open_run,
)
from workers.scalars import open_log
from workers.syncer_commits import Commits

# the command line and the configuration, re-exported: `workers.syncer.parse_args`, and
# `SyncerConfig` for the users that build one in code
from workers.syncer_config import (  # noqa: F401
    CommitFaults,
    SyncerConfig,
    add_args,
    config_from_args,
    curve_server,
    parse_args,
)
from workers.syncer_intake import Intake
from workers.syncer_ownership import Ownership
from workers.syncer_rounds import Rounds
from workers.syncer_state import SyncerShared

log = logging.getLogger("diloco.syncer")

# rounds of one fragment one poll may close back to back (deferred entries fill the next)
_CLOSES_PER_POLL = 8


class Syncer:
    """One syncer process: the loop over its parts (see module docstring)."""

    def __init__(self, cfg: SyncerConfig, ctx: RunContext, ctx_zmq: zmq.Context):
        bad = [p for p in cfg.fragments if not 0 <= p < len(ctx.fragments)]
        if bad:
            raise ValueError(f"--fragments {bad}: the run has fragments "
                             f"0..{len(ctx.fragments) - 1}")
        bcfg = ctx.cfg.broker
        # its curves (`workers.scalars`), first: what cannot be had is refused (ValueError)
        # before the socket is bound
        scalars = open_log(cfg.tensorboard, wandb=cfg.wandb, name=cfg.syncer_id,
                           group=ctx.keys.run, config=to_dict(ctx.cfg),
                           axes={"fragment": "version"})
        self.pub = Publisher(ctx_zmq, cfg.bind, cfg.advertise_host, hwm=bcfg.zmq_hwm,
                             curve=cfg.curve)
        self.sh = sh = SyncerShared(cfg, ctx, self.pub, scalars)
        self.cfg, self.ctx, self.run_cfg, self.bcfg = cfg, ctx, ctx.cfg, bcfg
        # the same objects as `sh`'s (never rebound): what tools and tests read
        self.streams, self.frags, self.owned, self.stats = sh.streams, sh.frags, sh.owned, sh.stats
        self.auto = sh.auto
        self.intake = Intake(sh)
        self.commits = Commits(sh)
        self.rounds = Rounds(sh, self.intake, self.commits)
        self.owner = Ownership(sh, self.intake, self.rounds, self.commits)
        self._next_live = 0.0
        self._next_lease = 0.0
        self._next_attest = 0.0

    @property
    def live(self) -> frozenset[str]:
        return self.sh.live

    @property
    def phase(self) -> str:
        return self.sh.phase

    @property
    def last_tick(self) -> float:
        return self.sh.last_tick

    def start(self) -> None:
        self.owner.start()
        r, keys, me = self.ctx.r, self.ctx.keys, self.cfg.syncer_id
        registry.register_syncer(r, keys, me, self.sh.info())
        self.sh.event("syncer-start", syncer=me, fragments=self.owned, endpoint=self.pub.endpoint)
        self.intake.claim(force=True)
        self.sh.phase = "active" if self.owned else "standing by"

    def run_finished(self) -> bool:
        """True when the run is over: every learner has its final report and the final rounds
        of this syncer's fragments are recorded (a syncer started afterwards has no work)."""
        reports = self.sh.verified(registry.learner_final_reports(self.ctx.r, self.ctx.keys),
                                   "final")
        if len(reports) < self.run_cfg.learners:
            return False
        return set(self.cfg.fragments or self.sh.sizes) <= self.owner.closed()

    def _refresh(self) -> None:
        """The learners (live, declared tokens per step, step time) every quarter second or
        half a heartbeat; the leases every lease period / 3 (`_renew_leases`)."""
        now, sh = time.monotonic(), self.sh
        if now >= self._next_live:
            self._next_live = now + min(0.25, self.bcfg.heartbeat_s / 2)
            live = registry.live_learners(self.ctx.r, self.ctx.keys)
            recs = registry.learner_records(self.ctx.r, self.ctx.keys)
            if sh.verifier is not None:  # only heartbeats signed by their learner count
                recs = {n: rec for n, rec in recs.items()
                        if sh.verifier.record_ok(self.ctx.keys.run, "heartbeat", n, rec)}
                self.intake.note_unverified(live - set(recs))
                live = frozenset(n for n in live if n in recs)
            sh.live, sh.known = live, frozenset(recs)
            sh.declared = {n: rec.max_tokens_per_step for n, rec in recs.items()
                           if rec.max_tokens_per_step > 0}
            times = [t for n in live if n in recs and (t := recs[n].step_s)]
            if times:
                sh.step_time_s = min(times)
        self._renew_leases()

    def _renew_leases(self) -> None:
        """The leases renewed when a lease period / 3 has passed since the last time (also
        between two fragments' closes: at 100M+ values a few closes outlast a lease); with
        CURVE, each fragment's values attested every `attest.ATTEST_S` (as often)."""
        now = time.monotonic()
        if self.cfg.curve is not None and now >= self._next_attest:
            self._next_attest = now + attest.ATTEST_S
            for p in self.owned:
                if p in self.frags:
                    self.rounds.attest(p, self.frags[p].core)
        if now >= self._next_lease:
            self._next_lease = now + self.bcfg.lease_ms / 3000
            self.owner.renew()
            registry.register_syncer(self.ctx.r, self.ctx.keys, self.cfg.syncer_id,
                                     self.sh.info())

    def poll_once(self) -> bool:
        """One iteration: read, merge, close due rounds, finish the run. True when done."""
        self.sh.last_tick = time.monotonic()
        self._refresh()
        if self.owned:
            entries = self.streams.read_new(self.cfg.syncer_id, self.owned, count=8,
                                            block_ms=self.bcfg.block_ms)
            self.intake.handle(entries)
        else:  # every fragment is served by another syncer: stand by
            time.sleep(self.bcfg.block_ms / 1000)
        pushed = self.sh.verified(registry.final_pushes(self.ctx.r, self.ctx.keys),
                                  "final-pushes")
        final = len(pushed) >= self.run_cfg.learners
        expected = {p: {n for n, rep in pushed.items() if p in rep.final}
                    for p in self.owned} if final else {}
        for p in list(self.owned):
            # a close offers the deferred entries of learners that were a round ahead: their
            # round may be due at once (never wait for the next read's block_ms)
            for _ in range(_CLOSES_PER_POLL):
                self._renew_leases()
                if (p not in self.frags or self.frags[p].finished
                        or not self.rounds.maybe_close(p, expected.get(p))):
                    break
        self.intake.claim()
        if final and self._finish(expected):
            return True
        if self.cfg.max_rounds and self.stats.rounds >= self.cfg.max_rounds:
            return True
        return registry.stop_requested(self.ctx.r, self.ctx.keys)

    def _finish(self, expected: dict[int, set[str]]) -> bool:
        """After every learner's final pushes: publish final values, record the versions.
        A fragment taken over during this poll (its lease renewal between two closes) is not
        in `expected`: it finishes at a later poll, which counts its final pushes."""
        for p in self.owned:
            f = self.frags[p]
            if (not f.finished and p in expected and expected[p] <= f.final_seen
                    and not f.core.contributors and not f.deferred):
                f.finished = True
                self.rounds.publish(p, f.core)
        if not all(self.frags[p].finished for p in self.owned):
            return False
        self.commits.checkpoint_all()
        r, keys, me = self.ctx.r, self.ctx.keys, self.cfg.syncer_id
        versions = {str(p): self.frags[p].core.version for p in self.owned}
        if versions or not self.auto:
            # a report of this syncer from before a restart or a hand-over may name other
            # fragments: kept, so they stay closed
            earlier = registry.syncer_final_reports(r, keys).get(me)
            if earlier is not None:
                versions = {**earlier.versions, **versions}
            registry.mark_syncer_final(r, keys, me,
                                       SyncerFinal(versions=versions, rounds=self.stats.rounds))
        registry.register_syncer(r, keys, me, self.sh.info())
        # sharing the fragments: stop once every fragment's final round is recorded (until
        # then, take over the fragments of a syncer that dies before closing them)
        return not self.auto or set(self.sh.sizes) <= self.owner.closed()

    def run_forever(self) -> int:
        """Poll until the run ends; ride out Redis outages (backoff, then resync)."""
        backoff_s, outage_since = 0.1, None
        while True:
            try:
                if outage_since is not None:
                    self.commits.resync()
                    self.sh.event("syncer-reconnect", syncer=self.cfg.syncer_id,
                                  down_s=round(time.monotonic() - outage_since, 3))
                    log.warning("Redis is back after %.1f s; state resynced",
                                time.monotonic() - outage_since)
                    outage_since, backoff_s = None, 0.1
                if self.poll_once():
                    self.commits.checkpoint_at_exit()
                    return 0
            except (*OUTAGE, redis.OutOfMemoryError) as e:
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.warning("Redis unreachable (%s); retrying with backoff", e)
                time.sleep(backoff_s)
                backoff_s = min(2 * backoff_s, 2.0)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                outage_since = outage_since or time.monotonic()  # the stream vanished: resync


# /healthz fails when the syncer's loop (or its standby wait) has not gone round for this long
LIVENESS_S = 60.0


def main(cfg: SyncerConfig) -> int:
    """Run one syncer until the run ends (or `max_rounds`). Returns the exit code."""
    heap.return_freed_memory()  # before the merge threads: what a round frees goes back
    native.install()
    kernels.set_threads(cfg.merge_threads or min(8, len(os.sched_getaffinity(0))))
    apply_environment()
    ctx = open_run(cfg.redis_url, cfg.run, wait_s=cfg.wait_config_s, task=cfg.task)
    # a run stored without the check (an earlier version's `init`) meets it here, before any
    # value is written: one line naming the setting, not a broken pipe at version 0
    refused = capacity.check(ctx.cfg, ctx.shapes, ctx.task.is_embedding, value_limits(
        ctx.r, ctx.cfg.broker.max_payload_bytes, ctx.cfg.broker.piece_bytes))
    if refused:
        log.error("run %r cannot start: %s", cfg.run, refused)
        return 2
    # a syncer may come to serve every fragment it may serve (taking the others' over)
    sizes = fragment_sizes(ctx.shapes, ctx.fragments)
    refused = memory_refusal(
        "syncer", role_bytes(ctx.cfg, [sizes[p] for p in cfg.fragments or range(len(sizes))],
                             "syncer"),
        "give this syncer fewer fragments (--fragments; other syncers the rest), or a host "
        "with more memory")
    if refused:
        log.error("%s: %s", cfg.syncer_id, refused)
        return 2
    zctx = zmq.Context()
    try:
        s = Syncer(cfg, ctx, zctx)
    except ValueError as e:  # a setting this process cannot have: one line, no traceback
        log.error("%s: %s", cfg.syncer_id, e)
        zctx.term()
        return 2
    if cfg.metrics_port:
        from workers.metrics import serve, stalled, syncer_spec

        serve(cfg.metrics_port, "diloco_syncer", syncer_spec(s), addr=cfg.metrics_host,
              live=stalled(lambda: s.last_tick, lambda: LIVENESS_S, "the syncer loop"),
              ready=lambda: None if s.phase in ("active", "standing by") else "starting")
    try:
        if s.run_finished():
            log.info("run %r has finished (every learner's final report is in and the final "
                     "rounds of fragments %s are closed): nothing to do", cfg.run, s.owned)
            return 0
        s.start()
        return s.run_forever()
    except LeaseLost as e:  # the fragment is another syncer's now, or this host too slow
        log.error("%s: %s; stopping", cfg.syncer_id, e)
        return 1
    finally:
        s.pub.close()
        try:
            for p in s.owned:
                s.sh.store.release_lease(p, cfg.syncer_id)
            if s.auto:
                registry.syncer_leave(s.ctx.r, s.ctx.keys, cfg.syncer_id)
        except redis.RedisError as e:
            log.warning("could not hand over the fragments at exit (%s): the others take them "
                        "when the leases run out", e)
        zctx.term()
        if s.sh.scalars is not None:  # last: the fragments are handed over already
            s.sh.scalars.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.exit(main(parse_args()))
