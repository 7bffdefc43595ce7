"""`diloco status`: a run's live learners, syncers, versions, rounds and stream lag."""

from __future__ import annotations

import json
import sys
import time

from broker import registry
from broker.connection import connect
from broker.keys import GROUP, RunKeys
from pipeline import config as cfgmod


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def collect(redis_url: str, run: str) -> dict:
    """Everything `status` shows, as plain data (the stable `--json` output)."""
    import tomllib

    r = connect(redis_url)
    keys = RunKeys(run)
    toml_text, run_hash = registry.load_config(r, keys)
    cfg = cfgmod.from_dict(tomllib.loads(toml_text))
    from pipeline.fragments import partition
    from pipeline.model import param_shapes

    n_frags = len(partition(param_shapes(cfg.model), cfg.effective_sync().fragments))
    live = registry.live_learners(r, keys)
    learners = {}
    for name, rec in sorted(registry.learner_records(r, keys).items()):
        learners[name] = {"live": name in live, "last_heartbeat_age_s": time.time() - rec["t"],
                          **{k: rec.get(k) for k in ("step", "tokens", "tokens_per_s", "step_s",
                                                     "versions", "pushes_attempted",
                                                     "pushes_acked", "bytes_sent",
                                                     "bytes_received")}}
    fragments = []
    for p in range(n_frags):
        fk = keys.fragment(p)
        info = {"fragment": p, "stream_length": r.xlen(fk.frags), "dlq_length": r.xlen(fk.dlq),
                "rounds": r.xlen(fk.rounds), "pending": 0, "lag": 0, "version": None,
                "lease": _s(r.get(fk.lease)) if r.get(fk.lease) else None}
        try:
            for g in r.xinfo_groups(fk.frags):
                if _s(g["name"]) == GROUP:
                    info["pending"] = int(g["pending"])
                    info["lag"] = int(g.get("lag") or 0)
        except Exception:  # no stream/group yet
            pass
        last = r.xrevrange(fk.rounds, count=1)
        if last:
            fields = last[0][1]
            info["version"] = int(fields[b"version"])
            info["last_reason"] = _s(fields[b"reason"])
            info["last_included"] = len(json.loads(fields[b"included"]))
        elif r.exists(fk.global_):
            info["version"] = 0
        fragments.append(info)
    for rec in learners.values():
        versions = rec.get("versions") or []
        rec["version_lag"] = [max(0, (f["version"] or 0) - v)
                              for f, v in zip(fragments, versions, strict=False)]
    return {
        "run": run, "config_hash": run_hash, "mode": cfg.mode, "learners_expected": cfg.learners,
        "live_learners": sorted(live), "learners": learners,
        "syncers": registry.syncer_records(r, keys), "fragments": fragments,
        "rounds": sum(f["rounds"] for f in fragments),
        "done": sorted(registry.done_reports(r, keys)),
    }


def render(rep: dict) -> str:
    lines = [f"run {rep['run']} ({rep['mode']}, config {rep['config_hash']}): "
             f"{len(rep['live_learners'])}/{rep['learners_expected']} learners live, "
             f"{rep['rounds']} rounds"]
    for name, rec in rep["learners"].items():
        state = "live" if rec["live"] else "DOWN"
        lines.append(f"  {name:10s} {state:4s} step {rec.get('step')} "
                     f"{(rec.get('tokens_per_s') or 0):,.0f} tok/s versions {rec.get('versions')} "
                     f"lag {rec.get('version_lag')} "
                     f"heartbeat {rec['last_heartbeat_age_s']:.1f} s ago")
    for name, rec in rep["syncers"].items():
        lines.append(f"  {name:10s} fragments {rec.get('fragments')} rounds {rec.get('rounds')} "
                     f"endpoint {rec.get('endpoint')} last: {rec.get('last_reason')}")
    for f in rep["fragments"]:
        lines.append(f"  fragment {f['fragment']}: v{f['version']} stream {f['stream_length']} "
                     f"pending {f['pending']} lag {f['lag']} dlq {f['dlq_length']} "
                     f"rounds {f['rounds']} lease {f['lease']}")
    return "\n".join(lines)


def watch(redis_url: str, run: str) -> int:
    try:
        while True:
            text = render(collect(redis_url, run))
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
            sys.stdout.flush()
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
