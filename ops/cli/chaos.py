"""`diloco chaos`: a full run under injected faults, with Jepsen-style accounting."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from broker.keys import check_run_name
from ops.chaos import (
    SPARE_AFTER_S,
    load_schedule,
    random_schedule,
    run_chaos,
    spare_options_problem,
)
from ops.cli.common import add_config_args, config_from_args, fail, fail_on, print_json
from ops.cli.live import LiveView, chaos_view
from ops.cluster import artifacts
from pipeline import config as cfgmod


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="a full run under injected faults, with accounting")
    add_config_args(p)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of training")
    p.add_argument("--schedule", help="TOML file of [[fault]] at_s/kind/target/down_s")
    p.add_argument("--kill-every-s", type=float, default=30.0,
                   help="random schedule: mean seconds between learner kills (0: none)")
    p.add_argument("--pause-every-s", type=float, default=0.0)
    p.add_argument("--down-s", type=float, default=5.0, help="random schedule: downtime")
    p.add_argument("--pace-s", type=float, default=0.1, help="inner step wall time per learner")
    p.add_argument("--standby", action="store_true",
                   help="start a second syncer (the two share the fragments; as --syncers 2)")
    p.add_argument("--spares", action="store_true",
                   help="a warm spare per learner (diloco learner --standby): a killed learner "
                        "is brought back by its spare, which has its data loaded and its step "
                        "compiled, instead of by a new process")
    p.add_argument("--spare-after-s", type=float, default=SPARE_AFTER_S, metavar="S",
                   help="with --spares: start a learner's next spare S seconds after its last "
                        "took over (default %(default)s)")
    p.add_argument("--syncers", type=int, default=1, metavar="N",
                   help="syncer processes sharing the fragments (default 1)")
    p.add_argument("--redis-cluster", action="store_true",
                   help="run on a local Redis Cluster (3 masters, 1 replica each) instead of "
                        "one redis-server; fault kill-redis-master (target: the fragment whose "
                        "slot's master dies)")
    p.add_argument("--out", default="runs")
    p.add_argument("--run", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no live progress")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args, base=replace(cfgmod.demo_config(), steps=10**6))
        if args.schedule:
            schedule = load_schedule(args.schedule)
        else:
            rates = {k: v for k, v in (("kill-learner", args.kill_every_s),
                                       ("pause-learner", args.pause_every_s)) if v > 0}
            schedule = random_schedule(cfg.seed, args.duration, rates, args.down_s,
                                       quiet_tail_s=min(20.0, args.duration / 5))
    except (cfgmod.ConfigError, OSError) as e:
        return fail(str(e))
    if problem := spare_options_problem(args.spares, args.spare_after_s):
        return fail(problem)
    try:
        run = check_run_name(args.run or time.strftime("chaos-%Y%m%d-%H%M%S"))
    except ValueError as e:
        return fail(str(e))
    try:
        run_dir = artifacts.new_run_dir(args.out, run)
        with LiveView(mode="quiet" if args.json or args.quiet else "auto",
                      title=f"chaos {run}: M={cfg.learners}") as view:
            rep = run_chaos(cfg, run_dir, run, schedule, args.duration, seed=cfg.seed,
                            pace_s=args.pace_s, standby=args.standby, syncers=args.syncers,
                            redis_cluster=args.redis_cluster, spares=args.spares,
                            spare_after_s=args.spare_after_s,
                            progress=chaos_view(view))
    except (ValueError, OSError) as e:  # no redis-server, an unwritable --out, too few tensors
        return fail_on(e)
    (run_dir / "chaos.json").write_text(json.dumps(rep, indent=1))
    if args.json:
        print_json({k: v for k, v in rep.items() if k != "history"})
    else:
        for k in ("pushes_attempted", "pushes_acked", "merged", "dropped_stale",
                  "dead_lettered", "duplicated", "lost", "merged_twice", "rounds",
                  "availability", "goodput",
                  "rejoin_s_p50", "rejoin_s_max"):
            print(f"{k:18s} {rep[k]}")
        print(f"faults injected: {len(rep['faults'])}; report in {run_dir / 'chaos.json'}")
    return 0 if rep["lost"] == 0 and rep["merged_twice"] == 0 else 1
