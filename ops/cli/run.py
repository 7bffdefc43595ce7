"""`diloco run` (the main job) and `diloco init` (store a run configuration for separate hosts)."""

from __future__ import annotations

import argparse
import sys
import time

from ops.cli.common import (
    add_config_args,
    config_from_args,
    fail,
    make_corpus,
    print_json,
    write_json,
)
from ops.cluster import artifacts
from pipeline.config import ConfigError, RunConfig
from pipeline.engine import Engine


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train: a syncer and M learners (or the in-process engine)",
                       description="Run the main job. By default: an embedded redis-server, a "
                       "syncer and M learner processes on this machine.")
    add_config_args(p)
    p.add_argument("--engine", choices=("distributed", "inprocess"), default="distributed",
                   help="distributed: real processes over Redis and ZeroMQ (default); "
                        "inprocess: one process on a virtual clock")
    p.add_argument("--redis-url", help="use this Redis instead of starting an embedded one")
    p.add_argument("--run", default=None, help="run name (default: a timestamp)")
    p.add_argument("--out", default="runs", help="folder for run output (default: runs/)")
    p.add_argument("--init-only", action="store_true",
                   help="store the configuration in Redis for `diloco syncer`/`learner` and exit")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--quiet", action="store_true", help="no live progress")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args, base=default_demo_config())
    except (ConfigError, FileNotFoundError) as e:
        return fail(str(e))
    run_name = args.run or time.strftime("run-%Y%m%d-%H%M%S")
    if args.engine == "inprocess":
        return run_inprocess(cfg, run_name, args)
    from ops.cluster.launcher import run_distributed

    return run_distributed(cfg, run_name, args)


def default_demo_config() -> RunConfig:
    """The no-argument demo: a few minutes on a 2-core machine (see README)."""
    from pipeline import config as cfgmod

    return cfgmod.from_dict({
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "data": {"max_bytes": 4_000_000},
        "inner": {"lr": 1e-3, "warmup_steps": 30, "batch_size": 16},
        "sync": {"fragments": 2, "sync_every": 40},
        "learners": 3, "steps": 1500,
    })


def run_inprocess(cfg: RunConfig, run_name: str, args: argparse.Namespace) -> int:
    from ops.cluster.wire import codec_sizes

    run_dir = artifacts.new_run_dir(args.out, run_name)
    artifacts.write_config(run_dir, cfg)
    log = artifacts.MetricsLog(run_dir / "metrics.jsonl")
    quiet = args.quiet or args.json

    def on_event(kind: str, data: dict) -> None:
        log.write(kind, data)
        if not quiet and kind == "eval":
            print(f"[{data['wall_s']:8.1f} s virtual] tokens {data['tokens']:>10,}  "
                  f"eval loss {data['eval_loss']:.4f}  acc {data['eval_accuracy']:.3f}",
                  file=sys.stderr)

    engine = Engine(cfg, make_corpus(cfg), wire=codec_sizes(), on_event=on_event)
    summary = engine.run()
    log.write("summary", {k: v for k, v in summary.items() if k != "history"})
    log.close()
    artifacts.save_checkpoint(run_dir / "checkpoint.npz", engine.final_params, cfg)
    artifacts.plot_loss(run_dir / "loss.png", {cfg.mode: summary["history"]},
                        title=f"{cfg.mode}, M={cfg.learners} (in-process)")
    summary["run_dir"] = str(run_dir)
    write_json(run_dir / "summary.json", summary)
    if args.json:
        print_json({k: v for k, v in summary.items() if k != "history"})
    else:
        print_summary(summary)
    return 0


def print_summary(s: dict) -> None:
    print(f"mode {s['mode']}, {s['learners']} learners, {s['tokens']:,} tokens, "
          f"{s['rounds']} rounds")
    print(f"eval loss {s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f} "
          f"(accuracy {s['final_eval_accuracy']:.3f})")
    print(f"per learner: sent {s['bytes_sent']:,} B, received {s['bytes_received']:,} B; "
          f"{s['bandwidth_ratio_vs_ddp']:.0f}x fewer bytes/token than an fp32 ring all-reduce")
    print(f"goodput {s['goodput']:.3f}; output in {s['run_dir']}")
