"""`diloco syncer`, `diloco learner`, `diloco init` and `diloco status`: one role per host."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import zmq

from broker.errors import BrokerError
from ops.cli.common import REDIS_DOWN, add_config_args, config_from_args, fail_on, print_json
from ops.cli.live import LiveView
from ops.cluster import store_run_config
from ops.tools import snapshot, status
from pipeline import config as cfgmod
from pipeline.config import ConfigError
from pipeline.task import with_init_hash
from workers import learner, syncer
from workers.common import add_redis_args, open_run


def register(sub: argparse._SubParsersAction) -> None:
    for role, text in ((syncer, "run one syncer (merges fragment streams, publishes)"),
                       (learner, "run one learner (trains, pushes fragments)")):
        p = sub.add_parser(role.__name__.rpartition(".")[2], help=text)
        role.add_args(p)
        p.set_defaults(func=lambda args, role=role: _run_role(role, args))
    i = sub.add_parser("init", help="store a run configuration in Redis for separate hosts")
    add_config_args(i)
    add_redis_args(i)
    i.add_argument("--run", required=True)
    i.set_defaults(func=_init)
    st = sub.add_parser("status", help="live learners, versions, rounds and stream lag")
    add_redis_args(st)
    st.add_argument("--run", required=True)
    st.add_argument("--json", action="store_true")
    st.add_argument("--watch", action="store_true",
                    help="the live progress view, refreshed every second (Ctrl-C to stop)")
    st.set_defaults(func=_status)


def _run_role(role, args: argparse.Namespace) -> int:
    """`diloco syncer` / `diloco learner`: the role's ``main`` with its parsed configuration."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    try:
        return role.main(role.config_from_args(args))
    except (BrokerError, ConfigError, ValueError, OSError, zmq.ZMQError, *REDIS_DOWN) as e:
        return fail_on(e)  # OSError: a metrics port in use; ZMQError: a bad or busy endpoint


def _init(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args, base=cfgmod.demo_config())
        cfg = with_init_hash(cfg, local=cfg.task)  # printed below: the hash stored
        stored = store_run_config(args.redis_url, args.run, cfg)
    except (BrokerError, ConfigError, ValueError, *REDIS_DOWN) as e:
        return fail_on(e)
    if stored:
        print(f"stored run {args.run!r} (config hash {cfg.run_hash()})")
    else:
        print(f"run {args.run!r} already exists with the same run-defining configuration (hash "
              f"{cfg.run_hash()}); its stored configuration is unchanged (timings in [broker] "
              f"are not updated by init)")
    return 0


def _status(args: argparse.Namespace) -> int:
    try:
        if args.watch:
            return _watch(args.redis_url, args.run)
        report = status.collect(args.redis_url, args.run)
    except (BrokerError, ValueError, *REDIS_DOWN) as e:
        return fail_on(e)
    if args.json:
        print_json(report)
    else:
        print(status.render(report))
    return 0


def _watch(redis_url: str, run: str) -> int:
    """The live view of a run from its registry, until Ctrl-C."""
    ctx = open_run(redis_url, run, wait_s=0, verify=False)
    t0 = time.monotonic()
    with LiveView(mode="auto", line_interval_s=1.0, title=f"{run}: {ctx.cfg.mode}") as view:
        try:
            while True:
                view.update(snapshot(ctx.r, ctx.keys, expected_learners=ctx.cfg.learners,
                                     total_steps=ctx.cfg.steps, t_s=time.monotonic() - t0))
                time.sleep(1.0)
        except KeyboardInterrupt:
            return 0
