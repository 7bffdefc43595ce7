"""The `diloco` command line: one subcommand per role and tool.

Only this room parses arguments, prints and picks exit codes; the rooms it calls return data.
Each module below exposes ``register(subparsers)``, which adds its subcommands and sets
``func`` (called with the parsed namespace, returning an exit code). A module that fails to
import fails the command: nothing is left out silently.
"""

from __future__ import annotations

import argparse

from ops.cli import (
    bench,
    chaos,
    dashboard,
    data,
    goodput,
    lab,
    plan,
    roles,
    run,
    security,
    tensorboard,
    tools,
)
from workers import native
from workers.common import apply_environment
from workers.heap import keep_freed_memory

# In the order they appear in --help.
_COMMANDS = (run, roles, tools, dashboard, data, tensorboard, security, chaos, lab, bench, goodput,
             plan)
# The compiled kernels are installed only where they run: the merge kernels in the commands
# that merge in this process (building them on first use; `replay` only loads a library already
# built, else merges with numpy: the same bits), the fused step kernels in those that train
# or evaluate a model here (`plan` measures the syncer's merge with the library the syncer
# would load). The syncer and learner roles install what they use themselves; status,
# inspect, export, plot and the rest never run a compiler.
_MERGE = {"run", "chaos", "lab", "bench"}
_MERGE_IF_BUILT = {"replay", "plan"}
_MODEL = {"run", "eval", "sample", "chaos", "lab", "bench"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco",
        description="Decoupled DiLoCo: asynchronous, fault-tolerant, low-communication training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if args.command != "syncer":  # a syncer trains nothing; its merge threads keep their arenas
        keep_freed_memory()  # before JAX runs anything: a jitted step reuses its scratch memory
    if args.command in _MERGE or args.command in _MERGE_IF_BUILT:
        native.install(build=args.command in _MERGE)
    apply_environment()
    if args.command in _MODEL:
        native.install_fused()
    return int(args.func(args) or 0)
