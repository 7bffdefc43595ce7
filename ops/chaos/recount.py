"""Recount the chaos accounting of finished benchmark runs from their Redis AOF and state logs.

Usage: python -m ops.chaos.recount RUN_DIR... (each a chaos run folder with redis/ and state/);
the window is [last learner join, first learner done], extended to the final rounds.
"""
import json
import sys
from pathlib import Path

import redis

from broker.keys import RunKeys
from ops.chaos.ledger import account
from ops.cluster import RedisServer
from pipeline.fragments import fragment_sizes
from workers.common import open_run

out = {}
for d in sys.argv[1:]:
    d = Path(d)
    srv = RedisServer(workdir=d / "redis").start()
    try:
        r = redis.Redis(port=srv.port)
        found = list(r.scan_iter(match=RunKeys.config_pattern()))
        if not found:
            sys.exit(f"{d}: no run stored under this version's key names (runs recorded before "
                     f"the run-wide keys got their hash tag are recounted with that version)")
        run = RunKeys.run_of_config(found[0])
        ctx = open_run(srv.url, run, wait_s=0, verify=False)
        cfg, frags = ctx.cfg, ctx.fragments
        sizes = fragment_sizes(ctx.shapes, frags)
        ev = r.xrange(ctx.keys.events)
        done = [float(f[b"t"]) for _, f in ev if f[b"kind"] == b"done"]
        joins = [float(f[b"t"]) for _, f in ev if f[b"kind"] == b"join"]
        rep = account(r, run, len(frags), d / "state", learners=cfg.learners,
                      frag_weights=[s / sum(sizes) for s in sizes], t_start=min(joins),
                      t_end=min(done), restarts=[], window_s=10.0)
        out[d.name] = {k: rep[k] for k in ("goodput", "availability", "wall_s", "merged", "lost")}
    finally:
        srv.stop()
print(json.dumps(out, indent=1))
