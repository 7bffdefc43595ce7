"""An island's final flush (`workers.island.Island.finish`): every push's own merged value
first, then the remaining progress of every fragment pushed as final, the final rounds waited
for, and their values adopted — so every learner of the run ends with the same parameters —
then the end-of-run report, signed when the run signs contributions."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from broker import registry, signing
from broker.errors import BrokerError
from broker.records import FinalPushes, LearnerFinal
from pipeline import quant
from pipeline.learner import Push

if TYPE_CHECKING:
    from workers.island import Island

log = logging.getLogger("diloco.learner")


def final_flush(isl: Island) -> LearnerFinal:
    """The island's final flush (see module docstring); its report, recorded in Redis. It is
    the island's own last phase, kept apart by job: it drives the island's internals (its
    parameters, inbox, pushes and checks) as the island's methods do."""
    isl._check_net()
    deadline = time.monotonic() + isl.cfg.final_timeout_s
    final: list[Push] = []
    if isl.cfg.sync:
        final = _push_final(isl, deadline)
    isl._check_current()  # the end-of-run records are the newest process's to write
    registry.mark_final_pushes(isl.ctx.r, isl.ctx.keys, isl.id, _signed(
        isl, "final-pushes", FinalPushes(final=[p.fragment for p in final], steps=isl.step,
                                         tokens=isl.tokens_done)))
    hashes = _adopt_final_values(isl, deadline) if isl.cfg.sync else {}
    s, core = isl.net.stats, isl.core
    report = LearnerFinal(
        hashes=hashes, versions=list(core.base_version), steps=isl.step,
        tokens=isl.tokens_done, bytes_sent=s.bytes_sent,
        bytes_received=isl.net.bytes_received, pushes_attempted=s.pushes_attempted,
        pushes_acked=s.pushes_acked, zmq_gaps=s.zmq_gaps, snapshots_read=s.snapshots_read,
        step_s=isl.step_s, train_s=isl.train_s, steps_per_s=isl.steady_steps_per_s,
        rejected=s.rejected, rebased_merged=core.rebased_merged, sync_s=round(isl.sync_s, 3))
    log.info("%s: %d steps in %.1f s of training; %.1f s (%.1f%%) in pushes, merged values, "
             "heartbeats and checkpoints", isl.id, isl.steps_here, isl.train_s,
             isl.sync_s, 100 * isl.sync_s / max(isl.train_s, 1e-9))
    report = _signed(isl, "final", report)
    isl._check_current()
    registry.mark_learner_final(isl.ctx.r, isl.ctx.keys, isl.id, report)
    registry.event(isl.ctx.r, isl.ctx.keys, "done", learner=isl.id, steps=isl.step)
    return report


def _push_final(isl: Island, deadline: float) -> list[Push]:
    """Every push's own merged value first ("rebase" applies a value that does not hold the
    push in flight and goes on waiting for the one that does), then every fragment's
    remaining progress pushed as final and flushed to Redis."""
    core, flat = isl.core, isl._params
    while True:
        flat = core.apply_due(10**12, flat)
        if all(f is None for f in core.inflight):
            break
        if time.monotonic() > deadline:
            raise BrokerError(f"{isl.id}: no merged value arrived for the final flush")
        if not isl._drain_inbox(timeout_s=1.0):
            for p, f in enumerate(core.inflight):
                if f is not None and core.pending[p] is None:
                    isl._forget_if_refused(p, f)
                if core.inflight[p] is not None:
                    isl.net.request_snapshot(p)
    isl._params = flat
    final = core.push_all(isl.step, flat)
    for push in final:
        isl._send(push, final=True)
    if not isl.net.wait_flushed(isl.cfg.final_timeout_s):
        isl._check_net()
        raise BrokerError(f"{isl.id}: final pushes not accepted by Redis in time")
    return final


def _adopt_final_values(isl: Island, deadline: float) -> dict[str, str]:
    """Wait for the final rounds' values and end on them (also where the final push was
    refused); the hash of every fragment's final value."""
    core, versions = isl.core, _wait_final_versions(isl, deadline)
    for p, v in versions.items():
        while core.base_version[p] < v and (core.pending[p] is None or core.pending[p].version < v):
            if time.monotonic() > deadline:
                raise BrokerError(f"{isl.id}: final value of fragment {p} not received")
            if not isl._drain_inbox(timeout_s=0.5):
                isl.net.request_snapshot(p)
    flat = core.apply_due(10**12, isl._params)
    for p, v in versions.items():
        if core.inflight[p] is not None and core.base_version[p] >= v:
            # the final push was refused: every learner ends on the final value
            flat = core.adopt_base(p, flat)
    isl._params = flat = isl._place(flat)
    values = {k: np.asarray(v) for k, v in flat.items()}
    return {str(p): quant.tensors_hash({n: values[n] for n in names})
            for p, names in enumerate(isl.ctx.fragments)}


def _wait_final_versions(isl: Island, deadline: float) -> dict[int, int]:
    """Fragment → final version, once the syncers have closed every final round."""
    n = len(isl.ctx.fragments)
    while True:
        versions: dict[int, int] = {}
        for rep in registry.syncer_final_reports(isl.ctx.r, isl.ctx.keys).values():
            versions.update({int(p): int(v) for p, v in rep.versions.items()})
        if len(versions) >= n:
            return versions
        if time.monotonic() > deadline:
            raise BrokerError(f"{isl.id}: syncers did not finish the final rounds in time")
        isl._drain_inbox(timeout_s=0.2)


def _signed(isl: Island, kind: str, rec: Any) -> Any:
    """An end-of-run report signed with the learner's key (syncers that verify count only
    signed reports of learners they hold keys for)."""
    if isl.cfg.sign_key is None:
        return rec
    return signing.sign_record(isl.cfg.sign_key, isl.ctx.keys.run, kind, isl.id, rec)
