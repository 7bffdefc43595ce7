"""`diloco dashboard`: a live web page of a run (`ops.tools.dashboard`), read with reader
credentials; loopback by default, elsewhere only over HTTPS with a bearer token."""

from __future__ import annotations

import argparse
import sys

from broker.errors import BrokerError
from ops.cli.common import REDIS_DOWN, fail, fail_on
from ops.tools import dashboard, dashboard_web
from workers.common import add_redis_args

DEFAULT_PORT = 8265


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboard", help="a live web page of a run: learners, syncers, fragments, losses, "
        "bytes, goodput, events",
        description="Serve one self-updating page of the run: every learner (state, step, "
        "tokens/s, last push, staleness, host), every syncer (fragments, rounds/s, lag, "
        "leases), every fragment (version, last round), training and evaluation loss, bytes "
        "per direction, goodput and a timeline of events (joins, deaths, rejoins, dead "
        "letters, guard refusals, hand-overs, chaos faults). A reader's Redis URL is enough. "
        "Binds 127.0.0.1; another address needs --tls-cert/--tls-key and --token-file. Needs "
        "the [dashboard] extra.")
    add_redis_args(p, help="Redis of the run (a reader's URL: the page only reads)")
    p.add_argument("--run", required=True, help="run name")
    p.add_argument("--run-dir", metavar="DIR", help="the run's folder (`diloco run --out`): "
                   "its evaluation loss and the learners' curves from the start")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "127.0.0.1: reach it from elsewhere through an SSH tunnel)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default "
                   f"{DEFAULT_PORT})")
    p.add_argument("--tls-cert", metavar="FILE", help="HTTPS certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="its private key (PEM)")
    p.add_argument("--token-file", metavar="FILE", help="a file whose first line is the bearer "
                   "token the page's data needs (open the page as https://HOST:PORT/#token=…)")
    p.add_argument("--interval-s", type=float, default=1.0, help="seconds between reads of "
                   "Redis (default 1)")
    p.set_defaults(func=_dashboard)


def _token(path: str | None) -> str | None:
    if not path:
        return None
    with open(path, encoding="utf-8") as fh:
        token = fh.readline().strip()
    if len(token) < 16:
        raise ValueError(f"{path}: the token is shorter than 16 characters")
    if not (token.isascii() and token.isprintable()) or " " in token:
        raise ValueError(f"{path}: the token must be printable ASCII without spaces (a "
                         f"browser sends it in a header)")
    return token


def _dashboard(args: argparse.Namespace) -> int:
    if not 0.1 <= args.interval_s <= 3600:
        return fail("--interval-s must be between 0.1 and 3600")
    try:
        token = _token(args.token_file)
        problem = dashboard_web.check_bind(args.host, certfile=args.tls_cert,
                                           keyfile=args.tls_key, token=token)
        if problem:
            return fail(problem)
        board = dashboard.Board(args.redis_url, args.run, args.run_dir)
        scheme = "https" if args.tls_cert else "http"
        print(f"dashboard of run {args.run}: {scheme}://{args.host}:{args.port}/"
              + ("  (append #token=<the token file's token>)" if token else ""),
              file=sys.stderr, flush=True)
        dashboard_web.serve(board, host=args.host, port=args.port, interval_s=args.interval_s,
                            certfile=args.tls_cert, keyfile=args.tls_key, token=token)
    except (BrokerError, ValueError, OSError, *REDIS_DOWN) as e:
        return fail_on(e)
    except KeyboardInterrupt:
        pass
    return 0
