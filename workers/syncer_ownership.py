"""Which fragments a syncer serves: leases taken and renewed, the run's open fragments shared
among the live syncers (`pipeline.fragments.assign`), a fragment adopted (recovered from its
checkpoint and the rounds since, re-published, its pending entries merged once) or handed
over. A syncer given `--fragments` serves exactly those, standing by while another holds them."""

from __future__ import annotations

import logging
import time

import numpy as np

from broker import registry
from broker.commit import LeaseLost
from pipeline import capacity
from pipeline.fragments import assign
from pipeline.guard import fragment_prior
from pipeline.syncer import FragmentSyncer
from workers import recovery
from workers.syncer_commits import Commits
from workers.syncer_intake import Intake
from workers.syncer_rounds import Rounds
from workers.syncer_state import FragState, SyncerShared

log = logging.getLogger("diloco.syncer")


class Ownership:
    """Leases, sharing, adoption and recovery (see module docstring)."""

    def __init__(self, sh: SyncerShared, intake: Intake, rounds: Rounds, commits: Commits):
        self.sh = sh
        self.intake = intake
        self.rounds = rounds
        self.commits = commits
        self._init: dict[str, np.ndarray] | None = None
        self._next_balance = 0.0
        self._unwanted: dict[int, float] = {}  # fragment → since when another should own it

    def start(self) -> None:
        sh = self.sh
        if sh.auto:
            self.rebalance(force=True)
            return
        for p in sh.cfg.fragments:
            if not sh.store.has_state(p):
                self._init_params()  # before any lease: JAX can outlast a short lease
        for p in sh.cfg.fragments:
            while not sh.store.acquire_lease(p, sh.cfg.syncer_id, sh.bcfg.lease_ms):
                log.info("fragment %d is leased by another syncer; standing by", p)
                sh.phase, sh.last_tick = "standing by", time.monotonic()
                time.sleep(sh.bcfg.lease_ms / 3000)
        self.adopt(list(sh.cfg.fragments))

    def _init_params(self) -> dict[str, np.ndarray]:
        """The run's initial parameters (for fragments without state yet), built once."""
        if self._init is None:
            self._init = {k: np.asarray(v) for k, v in self.sh.ctx.task.init_params(
                self.sh.run_cfg.seed).items()}
        return self._init

    def adopt(self, ps: list[int]) -> None:
        """Take fragments whose leases this syncer holds now: their state at the latest
        committed version (initialised if they have none), re-published; then the entries read
        and never acknowledged — by this consumer before a crash, or by a previous owner —
        merged once (an owner that lost its lease cannot commit them)."""
        sh, me = self.sh, self.sh.cfg.syncer_id
        for p in ps:
            sh.streams.ensure_group(p)
            blob = sh.store.load_state(p, limit := capacity.state_limit(sh.shapes(p)))
            if blob is None:
                self._init_fragment(p)
                blob = sh.store.load_state(p, limit)
            # decoded, and the blob released, before the fragment is rebuilt from it
            state = recovery.read_checkpoint(sh.ctx.r, sh.ctx.keys.fragment(p), sh.shapes(p),
                                             blob)
            del blob
            f = sh.frags[p] = self._recover(p, state)
            del state
            f.keep_snapshot(f.core.version, self.commits.snapshot(f.core))
            f.final_seen |= self._finals_done(p)
            sh.owned.append(p)
        sh.owned.sort()
        self._init = None  # the whole model's initial values: built again only if needed
        for p in ps:  # re-publish what is committed (a restart after a crash, a takeover)
            self.rounds.publish(p, sh.frags[p].core)
        for p in ps:  # recovery may have outlasted a lease: claim nothing for a lost one
            if not sh.store.acquire_lease(p, me, sh.bcfg.lease_ms):
                if not sh.auto:
                    raise LeaseLost(f"fragment {p}: lease lost while recovering it")
                log.warning("fragment %d: lease lost while recovering it; another syncer "
                            "serves it", p)
                sh.forget(p, "lease lost")
        for p in [p for p in ps if p in sh.frags]:
            pending = sh.streams.read_pending(me, p)
            self.intake.lost(p, [e.entry_id for e in pending if not e.fields])
            self.intake.handle([e for e in pending if e.fields], check_deliveries=True)
            claimed, deleted = sh.streams.claim_others(p, me)
            self.intake.lost(p, deleted)
            self.intake.handle(claimed, check_deliveries=True)

    def _init_fragment(self, p: int) -> None:
        """Version 0 of fragment p written (its state and snapshot), from the run's initial
        parameters; the core that wrote it is dropped here, before the fragment is read back
        (a fragment's values are not held twice)."""
        sh = self.sh
        init = self._init_params()
        core = FragmentSyncer(p, {n: init[n] for n in sh.ctx.fragments[p]}, sh.run_cfg.outer,
                              sh.sync, is_embedding=sh.ctx.task.is_embedding,
                              prior_step_norm=fragment_prior(sh.run_cfg, sh.shapes(p)))
        state, snapshot = self.commits.state_blob(core), self.commits.snapshot(core)
        del core
        sh.store.acquire_lease(p, sh.cfg.syncer_id, sh.bcfg.lease_ms)
        sh.store.init_fragment(p, sh.cfg.syncer_id, state=state, snapshot=snapshot)

    def _recover(self, p: int, state: dict) -> FragState:
        """The fragment at its latest committed version: its checkpoint, then the rounds
        committed since replayed (`workers.recovery`)."""
        sh = self.sh
        rec = recovery.recover(sh.ctx.r, sh.ctx.keys.fragment(p), sh.run_cfg, sh.shapes(p),
                               sh.ctx.task.is_embedding,
                               archive_dir=sh.bcfg.archive_dir or None, state=state)
        if rec.replayed:
            log.info("fragment %d: checkpoint v%d + %d round(s) replayed in %.2f s → v%d", p,
                     rec.checkpoint_version, rec.replayed, rec.seconds, rec.core.version)
            sh.event("recovered", fragment=p, syncer=sh.cfg.syncer_id,
                     checkpoint=rec.checkpoint_version, rounds=rec.replayed,
                     seconds=round(rec.seconds, 3), version=rec.core.version)
        return FragState(rec.core, ckpt_version=rec.checkpoint_version, ckpt_t=time.monotonic(),
                         sent_floor=max(0, rec.checkpoint_version - sh.sync.max_staleness))

    def _finals_done(self, p: int) -> set[str]:
        """The learners whose final push to fragment p a previous owner merged or refused (a
        syncer that takes a fragment over during the final flush never reads those): its
        dedupe keys as recovered (rounds committed), or the merge and refusal records."""
        r, keys = self.sh.ctx.r, self.sh.ctx.keys
        out = set()
        pushed = self.sh.verified(registry.final_pushes(r, keys), "final-pushes")
        seen = self.sh.frags[p].core.seen
        for name, rep in pushed.items():
            if p not in rep.final:
                continue
            if any(k[0] == name and k[2] >= rep.steps for k in seen):
                out.add(name)
                continue
            for rec in (registry.merged(r, keys, name, p), registry.refusal(r, keys, name, p)):
                if rec is not None and rec.step >= rep.steps:
                    out.add(name)
        return out

    def hand_over(self, p: int) -> None:
        """Stop serving fragment p while this syncer still holds its lease: a checkpoint
        first (the next owner replays nothing), then the lease."""
        f, release = self.sh.frags[p], True
        try:
            if f.ckpt_version < f.core.version:
                self.commits.checkpoint(p, f)
        except LeaseLost:
            release = False  # not ours any more: the next owner replays the rounds
        else:
            self.sh.store.release_lease(p, self.sh.cfg.syncer_id)
        if p in self.sh.frags:  # the checkpoint's resync may have found another serving it
            self.sh.forget(p, "released" if release else "lease lost")

    def closed(self) -> set[int]:
        """Fragments whose final round a syncer has recorded (the run is over for them)."""
        out: set[int] = set()
        for rep in registry.syncer_final_reports(self.sh.ctx.r, self.sh.ctx.keys).values():
            out |= {int(p) for p in rep.versions}
        return out

    def rebalance(self, force: bool = False) -> None:
        """Share the run's open fragments among the live syncers, balanced by size
        (`pipeline.fragments.assign`; every syncer computes the same answer): hand over the
        fragments another syncer should own (once their open round is empty, or after a lease
        period), take the free ones this one should own. A dead syncer's fragments are taken
        when its lease and membership run out; a syncer that leaves hands them over at once."""
        sh, now = self.sh, time.monotonic()
        if not force and now < self._next_balance:
            return
        self._next_balance = now + sh.bcfg.lease_ms / 3000
        me = sh.cfg.syncer_id
        members = registry.syncer_alive(sh.ctx.r, sh.ctx.keys, me, sh.bcfg.lease_ms)
        closed = self.closed()
        mine = set(assign({p: n for p, n in sh.sizes.items() if p not in closed},
                          members).get(me, ()))
        before = list(sh.owned)
        self._unwanted = {p: t for p, t in self._unwanted.items() if p in sh.frags}
        for p in list(sh.owned):
            f = sh.frags.get(p)
            if f is None:  # a hand-over's resync found another syncer serving it
                continue
            if p in mine or f.finished:
                self._unwanted.pop(p, None)
                continue
            since = self._unwanted.setdefault(p, now)
            if not f.core.contributors or now - since > sh.bcfg.lease_ms / 1000:
                self.hand_over(p)
        want = sorted(mine - set(sh.owned) - closed)
        if want and not all(sh.store.has_state(p) for p in want):
            self._init_params()  # before any lease: JAX can outlast a short lease
        got = [p for p in want if sh.store.acquire_lease(p, me, sh.bcfg.lease_ms)]
        if got:
            self.adopt(got)
            log.info("took fragments %s (syncers %s; now owns %s)", got, members, sh.owned)
            sh.event("rebalance", syncer=me, took=got, owns=sh.owned, syncers=members)
        sh.phase = "active" if sh.owned else "standing by"
        if sh.owned != before:  # `diloco status` shows who owns what
            registry.register_syncer(sh.ctx.r, sh.ctx.keys, me, sh.info())

    def renew(self) -> None:
        """Every lease period / 3: renew the leases (a lost one is handed over, or stops a
        syncer given `--fragments`), re-commit what Redis lost, share the fragments again,
        and set back any stream an entry of the largest id blocks."""
        sh = self.sh
        for p in list(sh.owned):
            if not sh.store.acquire_lease(p, sh.cfg.syncer_id, sh.bcfg.lease_ms):
                if not sh.auto:
                    raise LeaseLost(f"fragment {p}: lease lost")
                log.warning("fragment %d: lease lost (this syncer stalled longer than "
                            "broker.lease_ms?); another syncer serves it", p)
                sh.forget(p, "lease lost")
        if self.commits.behind():
            self.commits.resync()
        if sh.auto:
            self.rebalance(force=True)
        for p in list(sh.owned):
            self.intake.reopen(p)

