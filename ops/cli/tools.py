"""`diloco inspect`, `replay`, `plot`, `eval`, `sample`, `export` and `redis-cli`: the operator
tools' command lines. The tools themselves (`ops.tools`) return data; this module parses,
prints and picks the exit code."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.parse

import numpy as np

from broker.connection import resolve_tls_files
from broker.errors import BrokerError
from ops.cli.common import REDIS_DOWN, fail, fail_on, print_json
from ops.tools import checkpoint, inspect, plots, replay
from workers.common import add_redis_args


def register(sub: argparse._SubParsersAction) -> None:
    """Add the tools' subcommands to the ``diloco`` parser."""
    _add_inspect(sub)
    _add_replay(sub)
    _add_checkpoint_tools(sub)
    _add_plot(sub)
    p = sub.add_parser("build-kernels", help="compile the merge and step kernels into the "
                       "kernel cache now (an installer's or an image's step)",
                       description="Build the compiled kernels (workers/kernels.c, "
                       "workers/fused.cc) into $DILOCO_KERNEL_CACHE (default ~/.cache/diloco), "
                       "for this host's CPU or $DILOCO_KERNEL_MARCH, so that no process compiles "
                       "at its first start. Exit 0 with the kernels that could not be built "
                       "named: the processes then run numpy's merge and XLA's operations.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_build_kernels)


def _build_kernels(args: argparse.Namespace) -> int:
    """Entry point of ``diloco build-kernels``; returns the exit code."""
    from workers import native

    built = native.build()
    if args.json:
        print(json.dumps(built))
    else:
        for name, ok in built.items():
            print(f"{name}: {'built' if ok else 'not built (see the warning above)'}")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="entries in flight in the fragment streams (and one "
                       "payload's statistics with --entry)",
                       description="List the entries of each fragment stream and its dead-letter "
                       "stream, or with --entry ID --fragment P show one payload's per-tensor "
                       "statistics after dequantising.")
    add_redis_args(p)
    p.add_argument("--run", required=True, help="run name")
    p.add_argument("--fragment", type=int, metavar="P", help="only fragment P")
    p.add_argument("--entry", metavar="ID", help="show one entry's payload statistics "
                   "(needs --fragment; an id of the stream or of the dead-letter stream)")
    p.add_argument("--dlq", action="store_true", help="with --entry: look the id up in the "
                   "dead-letter stream only (ids are per stream and may repeat)")
    p.add_argument("--limit", type=int, default=100, metavar="N",
                   help="newest N entries per stream (0: all; default 100)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_inspect)


def _inspect(args: argparse.Namespace) -> int:
    """Entry point of ``diloco inspect``; returns the exit code."""
    if args.entry is not None and args.fragment is None:
        return fail("--entry needs --fragment P (the fragment whose stream holds the entry)")
    try:
        if args.entry is not None:
            rep = inspect.entry_stats(args.redis_url, args.run, args.fragment, args.entry, args.dlq)
            text = inspect.render_entry(rep)
        else:
            rep = inspect.collect(args.redis_url, args.run, args.fragment, max(0, args.limit))
            text = inspect.render(rep)
    except (KeyError, BrokerError, ValueError, *REDIS_DOWN) as e:
        return fail_on(e)
    if args.json:
        print_json(rep)
    else:
        sys.stdout.write(text + "\n")
    return 0


def _add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="rebuild the global values offline and verify every round's hash",
        description="Replay a run's rounds from its fragment streams (and archive) and verify "
        "each new value bit for bit against the recorded hash. Exit 0: verified; 1: a "
        "divergence (reported with the round's inputs); 2: unusable input.")
    add_redis_args(p, help="Redis holding the run")
    p.add_argument("--run", required=True, help="run name")
    p.add_argument("--fragment", type=int, default=None, metavar="P",
                   help="replay only fragment P (default: all)")
    p.add_argument("--until", type=int, default=None, metavar="VERSION",
                   help="stop after the round that produced VERSION")
    p.add_argument("--archive", default=None, metavar="DIR",
                   help="also read archived entries (msgpack files) from DIR")
    p.add_argument("--task", default=None, metavar="MODULE:FACTORY",
                   help="the run's user task (its initial parameters start the replay)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=_replay)


def _replay(args: argparse.Namespace) -> int:
    """Entry point of ``diloco replay``: print the report, return the exit code."""
    report = replay.replay(args.redis_url, args.run, fragment=args.fragment, until=args.until,
                           archive_dir=args.archive, task=args.task)
    if args.json:
        print_json(report)
    else:
        print(replay.render(report))
    sys.stdout.flush()
    return replay.exit_code(report)


def _add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="PNG plots of a run folder (loss, rounds, bytes)",
                       description="Plot loss vs tokens and wall time, a rounds timeline and "
                       "bytes on the wire from RUN_DIR/metrics.jsonl (round records also from "
                       "Redis with --redis-url).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (holds metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="folder for the PNGs (default: RUN_DIR)")
    add_redis_args(p, required=False, help="read round records from this Redis too")
    p.add_argument("--run", help="run name in Redis (default: RUN_DIR's folder name)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_plot)


def _plot(args: argparse.Namespace) -> int:
    """Entry point of ``diloco plot``; returns the exit code."""
    try:
        rep = plots.make_plots(args.run_dir, args.out, args.redis_url, args.run)
    except (OSError, BrokerError, ValueError, *REDIS_DOWN) as e:
        return fail_on(e)
    if args.json:
        print_json(rep)
    else:
        for name in plots.PLOTS:
            if rep["plots"][name]:
                print(f"wrote {rep['plots'][name]}")
            else:
                print(f"skipped {name}: {rep['skipped'][name]}", file=sys.stderr)
    return 0


def _add_checkpoint_tools(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="evaluation loss and accuracy of a checkpoint",
                       description="Evaluate a checkpoint's global parameters on the held-out "
                       "split of its configuration's corpus.")
    e.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint.npz (run or export), "
                   "an exported .safetensors or .orbax")
    e.add_argument("--task", default=None, metavar="MODULE:FACTORY",
                   help="the checkpoint's user task (imported only when its configuration "
                        "names the same)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=_eval)

    s = sub.add_parser("sample", help="sample bytes from a checkpoint's model",
                       description="Autoregressive byte sampling from a checkpoint's model.")
    s.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint.npz (run or export), "
                   "an exported .safetensors or .orbax")
    s.add_argument("--prompt", required=True, help="text to continue (UTF-8)")
    s.add_argument("--bytes", type=int, default=200, metavar="N",
                   help="bytes to generate (default 200)")
    s.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="softmax temperature; 0 is greedy (default 0.8)")
    s.add_argument("--seed", type=int, default=0, metavar="S", help="sampler seed (default 0)")
    s.add_argument("--task", default=None, metavar="MODULE:FACTORY",
                   help="the checkpoint's user task (its forward gives the logits)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=_sample)

    x = sub.add_parser("export", help="write a run's global parameters from Redis to .npz, "
                       ".safetensors or an Orbax checkpoint", description="Read the global "
                       "parameters the syncers committed in Redis and write them with the "
                       "configuration: checkpoint.npz's layout, safetensors (the task's "
                       "parameter names; the configuration in its metadata), or an Orbax "
                       "checkpoint folder (items 'params', the names as a tree split at '/', "
                       "and 'diloco', the configuration). eval and sample read all three.")
    add_redis_args(x)
    x.add_argument("--run", required=True, help="run name")
    x.add_argument("--out", required=True, metavar="FILE", help="file to write")
    x.add_argument("--format", default="npz", choices=("npz", "safetensors", "orbax"),
                   help="npz (default), safetensors or orbax (their extras)")
    x.add_argument("--json", action="store_true", help="print one JSON object")
    x.set_defaults(func=_export)
    c = sub.add_parser("redis-cli", help="redis-cli against the run's Redis, with the URL's TLS "
                       "files and user (the password through $REDISCLI_AUTH, never argv)",
                       description="Run redis-cli with the host, port, database, user, TLS "
                       "flags and client certificate of a Redis URL; everything after the "
                       "options goes to redis-cli: diloco redis-cli --redis-url-file "
                       "acl/reader.url -- XRANGE 'ddl:{exp1/f0001}:frags' - + COUNT 1")
    add_redis_args(c)
    c.add_argument("args", nargs=argparse.REMAINDER,
                   help="redis-cli's own options and command (after --)")
    c.set_defaults(func=_redis_cli)


def redis_cli_command(url: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The redis-cli argv for `url` and the environment it needs beside ours: the password
    goes in REDISCLI_AUTH (a command line is readable by every user of the host).

    Raises:
        ValueError: not a redis:// or rediss:// URL.
        FileNotFoundError: a TLS file it names is missing (`resolve_tls_files`).
    """
    parts = urllib.parse.urlsplit(resolve_tls_files(url))
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError("diloco redis-cli takes a redis:// or rediss:// URL")
    query = dict(urllib.parse.parse_qsl(parts.query))
    argv = ["redis-cli", "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
    if parts.path.strip("/"):
        argv += ["-n", parts.path.strip("/")]
    env = {}
    if parts.username:
        argv += ["--user", urllib.parse.unquote(parts.username)]
    if parts.password is not None:
        env["REDISCLI_AUTH"] = urllib.parse.unquote(parts.password)
    if parts.scheme == "rediss":
        argv.append("--tls")
        for key, flag in (("ssl_ca_certs", "--cacert"), ("ssl_ca_path", "--cacertdir"),
                          ("ssl_certfile", "--cert"), ("ssl_keyfile", "--key")):
            if query.get(key):
                argv += [flag, query[key]]
        if query.get("ssl_cert_reqs", "").lower() in ("none", "cert_none"):
            argv.append("--insecure")
    return argv + (args[1:] if args[:1] == ["--"] else args), env


def _redis_cli(args: argparse.Namespace) -> int:
    try:
        argv, env = redis_cli_command(args.redis_url, list(args.args))
    except (OSError, ValueError) as e:
        return fail(str(e))
    if shutil.which("redis-cli") is None:
        return fail("redis-cli is not installed (apt-get install redis-tools)")
    return subprocess.call(argv, env={**os.environ, **env})


def _eval(args: argparse.Namespace) -> int:
    try:
        rep = checkpoint.eval_checkpoint(args.checkpoint, args.task)
    except (OSError, ValueError) as e:
        return fail(str(e))
    if args.json:
        print_json(rep)
    else:
        print(f"{rep['checkpoint']}: eval loss {rep['eval_loss']:.4f} nats/byte, accuracy "
              f"{rep['eval_accuracy']:.3f} ({rep['eval_tokens']:,} positions, "
              f"{rep['params']:,} parameters, versions {rep['versions']})")
    return 0


def _sample(args: argparse.Namespace) -> int:
    if args.bytes < 0:
        return fail("--bytes must be >= 0")
    if not np.isfinite(args.temperature) or args.temperature < 0:
        return fail("--temperature must be a finite number >= 0")
    try:
        rep = checkpoint.sample(args.checkpoint, args.prompt, args.bytes, args.temperature,
                                args.seed, args.task)
    except (OSError, ValueError, NotImplementedError) as e:
        return fail(str(e))
    if args.json:
        print_json(rep)
    else:
        sys.stdout.write(rep["prompt"] + rep["completion"] + "\n")
        sys.stdout.flush()
    return 0


def _export(args: argparse.Namespace) -> int:
    try:
        rep = checkpoint.export(args.redis_url, args.run, args.out, args.format)
    except (BrokerError, ValueError, OSError, *REDIS_DOWN) as e:
        return fail_on(e)
    if args.json:
        print_json(rep)
    else:
        print(f"wrote {rep['out']}: {rep['params']:,} parameters in {rep['tensors']} tensors, "
              f"versions {rep['versions']} ({rep['bytes']:,} bytes)")
    return 0
