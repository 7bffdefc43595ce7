"""A syncer process's configuration: its command line (`diloco syncer`, `python -m
workers.syncer`) and the fault injection the chaos harness and recovery tests use. Everything
about the run itself comes from Redis (`workers.common.open_run`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from broker.pubsub import CurveServer
from workers import scalars
from workers.common import add_redis_args, add_role_args, require_security, usage_error


@dataclass(frozen=True)
class CommitFaults:
    """Fault injection, for the chaos harness and the recovery tests only: exit abruptly at
    the N-th round commit (1-based) of this process, before the commit (the round merged but
    not committed: exit code 17) or after it (committed, not yet published: 18). 0: never."""

    before_commit: int = 0
    after_commit: int = 0

    def at(self, stage: str, commit: int) -> None:
        """Called with "before" and "after" around every commit."""
        n, code = (self.before_commit, 17) if stage == "before" else (self.after_commit, 18)
        if n and commit == n:
            os._exit(code)


@dataclass(frozen=True)
class SyncerConfig:
    """One syncer process. Everything about the run comes from Redis."""

    redis_url: str
    run: str
    syncer_id: str = "syncer-0"
    fragments: tuple[int, ...] = ()          # owned fragments; empty: shared (rebalanced)
    bind: str = "tcp://127.0.0.1:0"          # PUB bind address (port 0: any free port)
    advertise_host: str | None = None        # host learners connect to (default: bind host)
    max_rounds: int = 0                      # stop after this many rounds (0: until run ends)
    wait_config_s: float = 60.0
    metrics_port: int = 0                    # Prometheus text endpoint (0: off)
    metrics_host: str = "127.0.0.1"          # the address it binds
    curve: CurveServer | None = None         # ZeroMQ CURVE (--curve-secret, --curve-allow)
    sign_keys: str | None = None             # folder of learner signing keys (--sign-keys)
    # threads of the merge kernels (pipeline.kernels.set_threads); 0: the CPUs this process
    # may run on, at most 8. One by default: on a 2-core host shared with Redis and the
    # checksum threads, two merge threads measured 0.91× the syncer's throughput of one
    merge_threads: int = 1
    faults: CommitFaults = CommitFaults()
    # the user task this process may import: only to initialise a fragment that has no state
    # yet (shapes come from the run's stored spec otherwise); never its data
    task: str | None = None
    tensorboard: str | None = None           # this syncer's curves as event files here
    wandb: bool = False                      # and as a W&B run


def _threads_arg(text: str) -> int:
    n = int(text)
    if not 0 <= n <= 256:
        raise argparse.ArgumentTypeError(f"expected 0 (automatic) to 256, got {n}")
    return n


def parse_args(argv: list[str] | None = None) -> SyncerConfig:
    ap = argparse.ArgumentParser(prog="diloco syncer")
    add_args(ap)
    return config_from_args(ap.parse_args(argv))


def add_args(ap: argparse.ArgumentParser) -> None:
    add_redis_args(ap)
    ap.add_argument("--run", required=True)
    ap.add_argument("--id", default="syncer-0", help="syncer id (consumer name)")
    ap.add_argument("--fragments", default="",
                    help="comma-separated fragments this syncer serves, standing by while "
                         "another holds them (default: share every fragment with the run's "
                         "other syncers started without the list, balanced by size)")
    ap.add_argument("--bind", default="tcp://127.0.0.1:0",
                    help="PUB bind address, e.g. tcp://0.0.0.0:5555 (port 0: any free port)")
    ap.add_argument("--advertise-host", default=None,
                    help="host name learners use to reach this syncer (default: bind host)")
    ap.add_argument("--max-rounds", type=int, default=0)
    ap.add_argument("--merge-threads", type=_threads_arg, default=1, metavar="N",
                    help="threads that merge a fragment's tensors (default 1; 0: the CPUs "
                         "this process may run on, at most 8)")
    add_role_args(ap)
    ap.add_argument("--task", default=None, metavar="MODULE:FACTORY",
                    help="the run's user task, imported to initialise fragments (only when the "
                         "run names the same task)")
    ap.add_argument("--curve-secret", metavar="FILE",
                    help="ZeroMQ CURVE: the run's syncer key pair (syncer.key_secret from "
                         "diloco keys); with --curve-allow")
    ap.add_argument("--curve-allow", metavar="DIR",
                    help="ZeroMQ CURVE: folder of the learner public keys (NAME.key) allowed "
                         "to subscribe")
    ap.add_argument("--sign-keys", metavar="DIR",
                    help="require signed contributions: folder of the learners' signing keys "
                         "(signers/ID.sign from diloco keys); anything else is dead-lettered")
    scalars.add_args(ap)
    # fault injection (CommitFaults): the chaos harness and the recovery tests only
    ap.add_argument("--fail-before-commit", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--fail-after-commit", type=int, default=0, help=argparse.SUPPRESS)


def curve_server(secret: str | None, allow: str | None) -> CurveServer | None:
    """The syncer's CURVE settings from its two flags (both or neither)."""
    if bool(secret) != bool(allow):
        usage_error("--curve-secret and --curve-allow go together")
    return CurveServer(secret, allow) if secret else None


def config_from_args(a: argparse.Namespace) -> SyncerConfig:
    if missing := scalars.missing_extra(a.tensorboard, a.wandb):
        usage_error(missing)
    require_security(a.redis_url, curve=bool(a.curve_secret), signed=bool(a.sign_keys),
                     insecure=a.insecure, bind=a.bind)
    frags = tuple(int(x) for x in a.fragments.split(",") if x.strip())
    return SyncerConfig(a.redis_url, a.run, a.id, frags, a.bind, a.advertise_host, a.max_rounds,
                        metrics_port=a.metrics_port, metrics_host=a.metrics_host,
                        faults=CommitFaults(a.fail_before_commit, a.fail_after_commit),
                        task=a.task, curve=curve_server(a.curve_secret, a.curve_allow),
                        sign_keys=a.sign_keys, merge_threads=a.merge_threads,
                        tensorboard=a.tensorboard, wandb=a.wandb)
