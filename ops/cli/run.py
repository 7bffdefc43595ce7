"""`diloco run`: the main job on this machine (real processes, or the in-process engine)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

from broker.connection import redact
from broker.errors import BrokerError
from broker.keys import check_run_name
from ops.cli.common import (
    REDIS_DOWN,
    add_config_args,
    config_from_args,
    fail,
    fail_on,
    print_json,
)
from ops.cli.live import LiveView
from ops.cluster import (
    Launcher,
    RedisServer,
    RunFailed,
    run_distributed,
    run_inprocess,
    store_run_config,
    tensorboard,
)
from ops.tools import snapshot
from pipeline import config as cfgmod
from pipeline.config import ConfigError
from workers.common import INSECURE_ENV, add_redis_args, is_loopback


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train: a syncer and M learners (or the in-process engine)",
                       description="Run the main job. By default: an embedded redis-server, a "
                       "syncer and M learner processes on this machine.")
    add_config_args(p)
    p.add_argument("--engine", choices=("distributed", "inprocess"), default="distributed",
                   help="distributed: real processes over Redis and ZeroMQ (default); "
                        "inprocess: one process on a virtual clock")
    add_redis_args(p, required=False,
                   help="use this Redis instead of starting an embedded one")
    p.add_argument("--insecure", action="store_true",
                   help="let the run's processes use a Redis on another host without TLS, "
                        "ACL users, CURVE and signatures (refused by default)")
    p.add_argument("--run", default=None, help="run name (default: a timestamp)")
    p.add_argument("--out", default="runs", help="folder for run output (default: runs/)")
    p.add_argument("--init-only", action="store_true",
                   help="store the configuration in Redis for `diloco syncer`/`learner` and exit")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no live progress")
    p.add_argument("--tensorboard", metavar="DIR", help="also write the metrics as TensorBoard "
                   "event files in DIR (the [tensorboard] extra)")
    p.add_argument("--wandb", action="store_true", help="also log the metrics to a Weights & "
                   "Biases run named after the run, in its folder (the [wandb] extra; W&B's "
                   "own settings apply: WANDB_MODE=offline, WANDB_PROJECT, your key online)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args, base=cfgmod.demo_config())
    except (ConfigError, FileNotFoundError) as e:
        return fail(str(e))
    try:
        run_name = check_run_name(args.run or time.strftime("run-%Y%m%d-%H%M%S"))
    except ValueError as e:
        return fail(str(e))
    quiet = args.quiet or args.json
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return fail(tensorboard.TENSORBOARD_EXTRA)
    if args.wandb and importlib.util.find_spec("wandb") is None:
        return fail(tensorboard.WANDB_EXTRA)
    if args.engine == "inprocess":
        try:
            summary = run_inprocess(cfg, run_name, out=args.out,
                                    on_eval=None if quiet else _print_eval,
                                    tensorboard=args.tensorboard, wandb=args.wandb)
        except (ValueError, OSError) as e:  # data too small for the split, an unwritable --out
            return fail_on(e)
    elif cfg.mode == "ddp":
        return fail("mode ddp runs only in the in-process engine (--engine inprocess)")
    elif args.init_only:
        return _init_only(cfg, run_name, args.redis_url)
    else:
        if args.insecure:  # the roles' check (workers.common.require_security) reads it
            os.environ[INSECURE_ENV] = "1"
        elif args.redis_url and not is_loopback(args.redis_url):
            return fail(f"the Redis at {redact(args.redis_url)} is on another host: diloco run "
                        f"starts its processes without TLS, ACL users, CURVE or signatures; "
                        f"pass --insecure to run open on a network you control, or run the "
                        f"roles as in docs/SECURITY.md")
        if not args.redis_url:  # the embedded demo: open on loopback, and says so
            print("security: off — one machine, Redis and ZeroMQ on loopback (across hosts, "
                  "see docs/SECURITY.md)", file=sys.stderr)
        with LiveView(mode="quiet" if quiet else "auto",
                      title=f"{run_name}: {cfg.mode}, M={cfg.learners}") as view:
            def progress(la: Launcher, t_s: float) -> None:
                snap = snapshot(la.sup.r, la.sup.keys, expected_learners=cfg.learners,
                                total_steps=cfg.steps, t_s=t_s)
                if la.history:
                    snap["eval_loss"] = la.history[-1]["eval_loss"]
                view.update(snap)

            try:
                summary = run_distributed(cfg, run_name, out=args.out,
                                          redis_url=args.redis_url, progress=progress,
                                          tensorboard=args.tensorboard, wandb=args.wandb)
            except KeyboardInterrupt:
                print("interrupted: every process was stopped", file=sys.stderr)
                return 130
            except RunFailed as e:
                return fail(str(e), 1)
            except (ValueError, OSError, BrokerError, *REDIS_DOWN) as e:
                return fail_on(e)
    if args.json:
        print_json({k: v for k, v in summary.items() if k != "history"})
    else:
        print_summary(summary)
    return 0


def _init_only(cfg, run_name: str, redis_url: str | None) -> int:
    """Store the configuration (in an embedded Redis that then stops, without --redis-url)."""
    server = None
    try:
        server = RedisServer().start() if redis_url is None else None
        url = redis_url or server.url
        store_run_config(url, run_name, cfg)
    except (BrokerError, OSError, ValueError, *REDIS_DOWN) as e:
        return fail_on(e)
    finally:
        if server is not None:
            server.stop()
    print(f"stored run {run_name!r} (config hash {cfg.run_hash()}) in {redact(url)}")
    return 0


def _print_eval(data: dict) -> None:
    print(f"[{data['wall_s']:8.1f} s virtual] tokens {data['tokens']:>10,}  "
          f"eval loss {data['eval_loss']:.4f}  acc {data['eval_accuracy']:.3f}",
          file=sys.stderr)


def print_summary(s: dict) -> None:
    print(f"mode {s['mode']}, {s['learners']} learners, {s['tokens']:,} tokens, "
          f"{s['rounds']} rounds")
    print(f"eval loss {s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f} "
          f"(accuracy {s['final_eval_accuracy']:.3f})")
    print(f"per learner: sent {s['bytes_sent']:,} B, received {s['bytes_received']:,} B; "
          f"{s.get('bandwidth_ratio_binding', s['bandwidth_ratio_vs_ddp']):.0f}x fewer "
          f"bytes/token than an fp32 ring all-reduce in the busier direction")
    print(f"goodput {s['goodput']:.3f}; output in {s['run_dir']}")
