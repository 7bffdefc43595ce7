"""`diloco status`: a run's live learners, syncers, versions, rounds and stream lag; and the
progress snapshot that the live view of `run`, `chaos` and `status --watch` draws."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis

from broker import registry
from broker.errors import DecodeError
from broker.ids import as_text
from broker.keys import GROUP, RunKeys
from broker.records import RoundRecord, SyncerInfo
from workers.common import RunContext, open_run

STATES = ("training", "finished", "restarting", "gone")  # of a learner, in a progress snapshot
ETA_MIN_PROGRESS = 0.02


def natural_key(name: str) -> list:
    """Sort key that puts L2 before L10."""
    # re.split alternates str/int so the lists always compare
    return [int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name))]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def verified_live(live: Iterable[str], syncers: Mapping[str, SyncerInfo]
                  ) -> tuple[frozenset[str], frozenset[str]]:
    """(live learners that count, live learners that do not): in a signed run (a syncer
    verifies heartbeats, `SyncerInfo.signed`) only those whose heartbeat a syncer verified
    count; the rest are processes with a learner credential but not that learner's key."""
    live = frozenset(live)
    signed = [rec for rec in syncers.values() if rec.signed]
    if not signed:
        return live, frozenset()
    verified = frozenset(n for rec in signed for n in rec.verified)
    return live & verified, live - verified


def collect(redis_url: str, run: str, ctx: RunContext | None = None) -> dict:
    """Everything `status` shows, as plain data (the stable `--json` output); `ctx`: the run
    already opened (the dashboard reads it every second)."""
    ctx = ctx or open_run(redis_url, run, wait_s=0, verify=False)
    r, keys, cfg, run_hash, n_frags = ctx.r, ctx.keys, ctx.cfg, ctx.run_hash, len(ctx.fragments)
    syncers = registry.syncer_records(r, keys)
    live, unverified = verified_live(registry.live_learners(r, keys), syncers)
    signed = any(rec.signed for rec in syncers.values())
    members = registry.syncer_members(r, keys)
    learners = {}
    finals = registry.learner_final_reports(r, keys)
    for name, hb in sorted(registry.learner_records(r, keys).items()):
        learners[name] = {"live": name in live, "finished": name in finals,
                          "verified": (name not in unverified) if signed else None,
                          "last_heartbeat_age_s": time.time() - hb.t,
                          **{k: getattr(hb, k) for k in (
                              "step", "tokens", "tokens_per_s", "step_s", "versions", "loss",
                              "host", "pushes_attempted", "pushes_acked", "bytes_sent",
                              "bytes_received", "handshake_failures")}}
        fin = finals.get(name)
        if fin is not None:  # the end-of-run report is newer than the last heartbeat
            learners[name].update(step=fin.steps, tokens=fin.tokens,
                                  versions=list(fin.versions))
    fragments = []
    for p in range(n_frags):
        fk = keys.fragment(p)
        info = {"fragment": p, "stream_length": r.xlen(fk.frags), "dlq_length": r.xlen(fk.dlq),
                "rounds": r.xlen(fk.rounds), "pending": 0, "lag": 0, "version": None,
                "lease": as_text(r.get(fk.lease)) if r.get(fk.lease) else None}
        try:
            for g in r.xinfo_groups(fk.frags):
                if as_text(g["name"]) == GROUP:
                    info["pending"] = int(g["pending"])
                    info["lag"] = int(g.get("lag") or 0)
        except redis.ResponseError:  # no stream or group yet
            pass
        last = r.xrevrange(fk.rounds, count=1)
        if last:
            try:
                rec = RoundRecord.from_fields(last[0][1], lenient=True)
                info.update(version=rec.version, last_reason=rec.reason,
                            last_included=len(rec.included))
            except DecodeError as e:
                info["last_reason"] = f"unreadable round record: {e}"
        elif r.exists(fk.global_):
            info["version"] = 0
        fragments.append(info)
    for rec in learners.values():
        versions = rec.get("versions") or []
        rec["version_lag"] = [max(0, (f["version"] or 0) - v)
                              for f, v in zip(fragments, versions, strict=False)]
    return {
        "run": run, "config_hash": run_hash, "mode": cfg.mode, "learners_expected": cfg.learners,
        "live_learners": sorted(live), "unverified_learners": sorted(unverified),
        "learners": learners,
        "syncers": {k: {**v.to_dict(), "member": k in members} for k, v in syncers.items()},
        # the syncers sharing the fragments now (started without --fragments, alive)
        "syncer_members": members,
        "fragments": fragments,
        "rounds": sum(f["rounds"] for f in fragments),
        "done": registry.done_names(r, keys),
    }


def render(rep: dict) -> str:
    lines = [f"run {rep['run']} ({rep['mode']}, config {rep['config_hash']}): "
             f"{len(rep['live_learners'])}/{rep['learners_expected']} learners live, "
             f"{rep['rounds']} rounds"]
    if rep.get("unverified_learners"):
        lines[0] += (f"; {len(rep['unverified_learners'])} more with a heartbeat their "
                     f"learner's key does not sign (not counted): "
                     f"{', '.join(rep['unverified_learners'])}")
    for name, rec in rep["learners"].items():
        state = ("done" if rec.get("finished") else "live" if rec["live"] else
                 "UNVERIFIED" if name in rep.get("unverified_learners", ()) else "DOWN")
        lines.append(f"  {name:10s} {state:4s} step {rec.get('step')} "
                     f"{(rec.get('tokens_per_s') or 0):,.0f} tok/s versions {rec.get('versions')} "
                     f"lag {rec.get('version_lag')} "
                     f"heartbeat {rec['last_heartbeat_age_s']:.1f} s ago")
        for endpoint, why in (rec.get("handshake_failures") or {}).items():
            lines.append(f"  {'':10s} CURVE handshake with {endpoint} failing: {why}")
    for name, rec in rep["syncers"].items():
        share = " (sharing)" if rec.get("member") else ""
        lines.append(f"  {name:10s} fragments {rec.get('fragments')}{share} rounds "
                     f"{rec.get('rounds')} endpoint {rec.get('endpoint')} "
                     f"last: {rec.get('last_reason')}")
    for f in rep["fragments"]:
        lines.append(f"  fragment {f['fragment']}: v{f['version']} stream {f['stream_length']} "
                     f"pending {f['pending']} lag {f['lag']} dlq {f['dlq_length']} "
                     f"rounds {f['rounds']} lease {f['lease']}")
    return "\n".join(lines)


def learner_state(learner: str, *, live: Iterable[str], finished: Iterable[str],
                  restarting: Iterable[str] = ()) -> str:
    """State of one learner: finished, else training, else restarting, else gone.

    Args:
        learner: learner id.
        live: ids whose heartbeat TTL key is alive.
        finished: ids with a ``final:<id>`` done report.
        restarting: ids the supervisor is restarting right now.
    """
    if learner in finished:
        return "finished"
    if learner in live:
        return "training"
    if learner in restarting:
        return "restarting"
    return "gone"


def build_snapshot(records: Mapping[str, dict], live: Iterable[str], finals: Mapping[str, dict],
                   syncers: Mapping[str, dict], *, syncers_done: Iterable[str] = (),
                   expected_learners: int, total_steps: int,
                   restarting: Iterable[str] = frozenset(), t_s: float) -> dict:
    """The snapshot of already-read registry contents (see `snapshot` for the Redis side).

    Args:
        records: learner id → last heartbeat record.
        live: learner ids whose heartbeat is alive.
        finals: learner id → its end-of-run report (the learner finished).
        syncers: syncer id → syncer record.
        syncers_done: syncers that closed their final rounds.
        expected_learners: learners in the configuration.
        total_steps: steps each learner trains for.
        restarting: learner ids being restarted by a supervisor.
        t_s: seconds since the run started.

    Returns:
        The snapshot dict described in the module docstring. Progress is the mean over
        max(expected, seen) learners of min(step, total) / total, a finished learner counting 1.
    """
    live, restarting = frozenset(live), frozenset(restarting)
    syncer_done = frozenset(syncers_done)
    learners = []
    for lid in sorted(set(records) | set(finals), key=natural_key):
        rec, final = records.get(lid, {}), finals.get(lid)
        state = learner_state(lid, live=live, finished=finals, restarting=restarting)
        step, versions = rec.get("step"), rec.get("versions")
        if final is not None:  # the final report is newer than the last heartbeat
            step = final.get("steps", step)
            versions = final.get("versions", versions)
        learners.append({"id": lid, "state": state, "step": step,
                         "tokens_per_s": rec.get("tokens_per_s"), "loss": rec.get("loss"),
                         "versions": versions})
    fractions = []
    for ln in learners:
        step = _number(ln["step"]) or 0.0
        if ln["state"] == "finished":
            fractions.append(1.0)
        elif total_steps > 0:
            fractions.append(min(max(step, 0.0), total_steps) / total_steps)
        else:
            fractions.append(0.0)
    progress = sum(fractions) / max(expected_learners, len(learners), 1)
    eta = t_s * (1.0 - progress) / progress if progress > ETA_MIN_PROGRESS else None
    syncer_rows = []
    for sid in sorted(set(syncers) | syncer_done, key=natural_key):
        rec = syncers.get(sid, {})
        syncer_rows.append({"id": sid, "rounds": rec.get("rounds"),
                            "quorum_wait_s": rec.get("quorum_wait_s"),
                            "grace_wait_s": rec.get("grace_wait_s"),
                            "last_reason": rec.get("last_reason"), "done": sid in syncer_done})
    return {"t_s": t_s, "total_steps": total_steps, "expected_learners": expected_learners,
            "learners": learners, "syncers": syncer_rows, "progress": progress, "eta_s": eta}


def snapshot(r: redis.Redis, keys: RunKeys, *, expected_learners: int, total_steps: int,
             restarting: frozenset[str] = frozenset(), t_s: float) -> dict:
    """Read the run registry and return a progress snapshot (for `ops.cli.live.LiveView`).

    Args:
        r: Redis client.
        keys: key names of the run.
        expected_learners: learners in the configuration.
        total_steps: steps each learner trains for.
        restarting: learner ids the supervisor is restarting (none for `status --watch`).
        t_s: seconds since the run started.

    Returns:
        The snapshot dict; the caller may add ``eval_loss``.
    """
    syncers = registry.syncer_records(r, keys)
    live, unverified = verified_live(registry.live_learners(r, keys), syncers)
    return build_snapshot(
        {k: h.to_dict() for k, h in registry.learner_records(r, keys).items()
         if k not in unverified},
        live,
        {k: f.to_dict() for k, f in registry.learner_final_reports(r, keys).items()},
        {k: v.to_dict() for k, v in syncers.items()},
        syncers_done=registry.syncer_final_reports(r, keys),
        expected_learners=expected_learners, total_steps=total_steps, restarting=restarting,
        t_s=t_s)
