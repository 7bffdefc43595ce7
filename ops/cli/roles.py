"""`diloco syncer`, `diloco learner`, `diloco init` and `diloco status`: one role per host."""

from __future__ import annotations

import argparse
import logging
import sys

from broker.errors import BrokerError
from ops.cli.common import REDIS_DOWN, add_config_args, config_from_args, fail, fail_on, print_json
from pipeline.config import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    from workers import learner, syncer

    s = sub.add_parser("syncer", help="run one syncer (merges fragment streams, publishes)")
    syncer.add_args(s)
    s.set_defaults(func=_run_syncer)
    ln = sub.add_parser("learner", help="run one learner (trains, pushes fragments)")
    learner.add_args(ln)
    ln.set_defaults(func=_run_learner)
    i = sub.add_parser("init", help="store a run configuration in Redis for separate hosts")
    add_config_args(i)
    i.add_argument("--redis-url", required=True)
    i.add_argument("--run", required=True)
    i.set_defaults(func=_init)
    st = sub.add_parser("status", help="live learners, versions, rounds and stream lag")
    st.add_argument("--redis-url", required=True)
    st.add_argument("--run", required=True)
    st.add_argument("--json", action="store_true")
    st.add_argument("--watch", action="store_true", help="refresh in place every second")
    st.set_defaults(func=_status)


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)


def _run_syncer(args: argparse.Namespace) -> int:
    from workers import syncer

    _logging()
    try:
        return syncer.main(syncer.config_from_args(args))
    except (BrokerError, ConfigError, ValueError) as e:
        return fail(str(e))


def _run_learner(args: argparse.Namespace) -> int:
    from workers import learner

    _logging()
    try:
        return learner.main(learner.config_from_args(args))
    except (BrokerError, ConfigError, ValueError) as e:
        return fail(str(e))


def _init(args: argparse.Namespace) -> int:
    from ops.cli.run import default_demo_config
    from ops.cluster.launcher import store_run_config

    try:
        cfg = config_from_args(args, base=default_demo_config())
        stored = store_run_config(args.redis_url, args.run, cfg)
    except (BrokerError, ConfigError, *REDIS_DOWN) as e:
        return fail_on(e)
    if stored:
        print(f"stored run {args.run!r} (config hash {cfg.run_hash()})")
    else:
        print(f"run {args.run!r} already exists with the same run-defining configuration (hash "
              f"{cfg.run_hash()}); its stored configuration is unchanged (timings in [broker] "
              f"are not updated by init)")
    return 0


def _status(args: argparse.Namespace) -> int:
    from ops.tools import status

    try:
        if args.watch:
            return status.watch(args.redis_url, args.run)
        report = status.collect(args.redis_url, args.run)
    except (BrokerError, *REDIS_DOWN) as e:
        return fail_on(e)
    if args.json:
        print_json(report)
    else:
        print(status.render(report))
    return 0
