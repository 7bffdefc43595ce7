"""Recount the chaos accounting of finished benchmark runs from their Redis AOF and state logs.

Usage: python -m ops.chaos.recount RUN_DIR... (each a chaos run folder with redis/ and state/);
the window is [last learner join, first learner done], extended to the final rounds.
"""
import json
import sys
import tomllib
from pathlib import Path

import redis

from ops.chaos.ledger import account
from ops.cluster.redis_server import RedisServer
from pipeline import config as cfgmod
from pipeline.fragments import fragment_sizes, partition
from pipeline.model import param_shapes

out = {}
for d in sys.argv[1:]:
    d = Path(d)
    srv = RedisServer(workdir=d / "redis").start()
    try:
        r = redis.Redis(port=srv.port)
        run = [k.decode() for k in r.keys("ddl:*:config")][0].split(":")[1]
        cfg = cfgmod.from_dict(tomllib.loads(r.hget(f"ddl:{run}:config", "toml").decode()))
        frags = partition(param_shapes(cfg.model), cfg.effective_sync().fragments)
        sizes = fragment_sizes(param_shapes(cfg.model), frags)
        ev = r.xrange(f"ddl:{run}:events")
        done = [float(f[b"t"]) for _, f in ev if f[b"kind"] == b"done"]
        joins = [float(f[b"t"]) for _, f in ev if f[b"kind"] == b"join"]
        rep = account(r, run, len(frags), d / "state", learners=cfg.learners,
                      frag_weights=[s / sum(sizes) for s in sizes], t_start=min(joins),
                      t_end=min(done), restarts=[], window_s=10.0)
        out[d.name] = {k: rep[k] for k in ("goodput", "availability", "wall_s", "merged", "lost")}
    finally:
        srv.stop()
print(json.dumps(out, indent=1))
