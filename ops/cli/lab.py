"""`diloco lab`: sites on this machine behind shaped links; one run with every byte counted."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from broker.keys import check_run_name
from ops.chaos import Fault, load_schedule
from ops.cli.common import add_config_args, config_from_args, fail, fail_on, print_json
from ops.lab import (
    MODES,
    LabPlan,
    LabUnavailable,
    SiteSpec,
    check_capability,
    check_schedule,
    run_lab,
)
from pipeline import config as cfgmod


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lab", help="sites in network namespaces behind shaped links (needs root)",
        description="Redis and the syncer in a hub namespace, each learner (or data parallel "
                    "process) in a site namespace of its own, joined through a router "
                    "namespace: per-site link rate (tc tbf), round-trip time (a user-space "
                    "forwarder delays every frame) and CPU share (a cgroup quota). Counts the "
                    "bytes on every link. Everything it creates is removed on exit.")
    add_config_args(p, mode=False)
    p.add_argument("--mode", choices=MODES, default="decoupled")
    p.add_argument("--sites", type=int, default=2, help="number of sites (learners)")
    p.add_argument("--link-mbps", default="0", metavar="R[,R…]",
                   help="each site's link rate in Mbit/s, each way (one value for all, or one "
                        "per site; 0: unshaped)")
    p.add_argument("--rtt-ms", default="0", metavar="T[,T…]",
                   help="each site's round-trip time to the hub in ms (one, or one per site)")
    p.add_argument("--site-cpu", default="1", metavar="C[,C…]",
                   help="each site's relative CPU share (one, or one per site); the shares "
                        "together get the machine's cores (or --cpu-total)")
    p.add_argument("--cpu-total", type=float, default=None,
                   help="cores the sites' quotas add up to (default: all)")
    p.add_argument("--duration", type=float, default=0.0,
                   help="seconds of training (decoupled, sync-diloco; default: until every "
                        "learner has done --steps)")
    p.add_argument("--schedule", help="chaos fault schedule (TOML [[fault]]); "
                                      "partition-learner takes the site's link down")
    p.add_argument("--partition", action="append", default=[], metavar="SITE:AT_S:DOWN_S",
                   help="take site SITE's link down at AT_S for DOWN_S seconds (repeatable)")
    p.add_argument("--eval-every-s", type=float, default=15.0,
                   help="evaluate the global model this often (decoupled, sync-diloco)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="ddp: evaluate every this many steps (default: 10 evaluations)")
    p.add_argument("--pace-s", type=float, default=0.0, help="pace each inner step (s)")
    p.add_argument("--out", default="runs")
    p.add_argument("--run", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cli)


def per_site(text: str, n: int, name: str) -> list[float]:
    """One value for every site, or exactly one per site."""
    try:
        vals = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise cfgmod.ConfigError(f"{name}: expected numbers, got {text!r}") from None
    if len(vals) == 1:
        vals = vals * n
    if len(vals) != n or any(v < 0 for v in vals):
        raise cfgmod.ConfigError(f"{name}: expected 1 or {n} values ≥ 0, got {text!r}")
    return vals


def _partitions(items: list[str]) -> list[Fault]:
    out = []
    for item in items:
        try:
            site, at, down = item.split(":")
            out.append(Fault(float(at), "partition-learner", f"L{int(site)}", float(down)))
        except ValueError:
            raise cfgmod.ConfigError(f"--partition {item!r}: expected SITE:AT_S:DOWN_S") \
                from None
    return out


def _cli(args: argparse.Namespace) -> int:
    reason = check_capability()
    if reason:
        return fail(reason)
    try:
        if args.sites < 1:
            raise cfgmod.ConfigError("--sites: at least 1")
        n = args.sites
        sites = [SiteSpec(r, t, c) for r, t, c in zip(
            per_site(args.link_mbps, n, "--link-mbps"), per_site(args.rtt_ms, n, "--rtt-ms"),
            per_site(args.site_cpu, n, "--site-cpu"), strict=True)]
        cfg = config_from_args(args, base=replace(cfgmod.demo_config(), learners=n))
        schedule = (load_schedule(args.schedule) if args.schedule else []) + \
            _partitions(args.partition)
        check_schedule(schedule, n, args.mode)
        run = check_run_name(args.run or time.strftime(f"lab-{args.mode}-%Y%m%d-%H%M%S"))
    except (cfgmod.ConfigError, OSError, ValueError) as e:
        return fail(str(e))
    plan = LabPlan(mode=args.mode, sites=sites, duration_s=args.duration,
                   schedule=sorted(schedule, key=lambda f: f.at_s),
                   eval_every_s=args.eval_every_s,
                   eval_every_steps=args.eval_every or max(1, cfg.steps // 10),
                   cpu_total=args.cpu_total, pace_s=args.pace_s)
    try:
        rep = run_lab(cfg, plan, out=args.out, run=run)
    except LabUnavailable as e:
        return fail(str(e))
    except (ValueError, OSError, RuntimeError) as e:
        return fail_on(e)
    if args.json:
        print_json({k: v for k, v in rep.items() if k not in ("history", "compute_s",
                                                               "allreduce_s")})
        return 0 if rep.get("lost", 0) == 0 else 1
    print(f"lab {run}: {args.mode}, {n} sites; folder {rep['run_dir']}")
    if "final_eval_loss" in rep:
        print(f"final eval loss   {rep['final_eval_loss']:.4f}")
    rates = rep.get("step_rates", {})
    if rates:
        print("steps/s           " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(rates.items())))
    for port, tr in sorted(rep.get("traffic", {}).items()):
        bpt = tr["bytes_per_token"]
        print(f"{port:4s} up {tr['bytes_up'] / 1e6:9.2f} MB  down {tr['bytes_down'] / 1e6:9.2f} MB"
              f"  peak {tr['peak_bytes_per_s'] / 1e6:7.3f} MB/s"
              f"  {'' if bpt is None else f'{bpt:.2f} B/token'}")
    if "lost" in rep:
        print(f"ledger: {rep['merged']} merged, {rep['lost']} lost, "
              f"{len(rep['faults'])} faults")
    print(json.dumps({"run_dir": rep["run_dir"]}))
    return 0 if rep.get("lost", 0) == 0 else 1
