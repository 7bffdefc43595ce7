"""The `diloco` command line: one subcommand per role and tool.

Each tool module exposes ``register(subparsers)`` which adds its subparser and sets
``func`` (called with the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands, in the order they appear in --help.
_TOOL_MODULES = ("ops.cli.run", "ops.cli.roles", "ops.tools.inspect", "ops.tools.replay", "ops.chaos.harness",
                 "ops.tools.checkpoint", "ops.tools.plots", "ops.bench.quality", "ops.sim.scenarios")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diloco",
        description="Decoupled DiLoCo: asynchronous, fault-tolerant, low-communication training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _TOOL_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:  # a tool still being written: leave it out
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from workers import native

    native.install()  # the merge kernels, for every command that merges (run, bench, replay…)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
