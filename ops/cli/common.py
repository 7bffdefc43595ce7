"""What every `diloco` subcommand shares: configuration from file + flags, output, errors."""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path
from typing import Any

import redis

from pipeline import capacity
from pipeline import config as cfgmod
from pipeline.config import ConfigError, RunConfig
from pipeline.task import task_of


def add_config_args(p: argparse.ArgumentParser, *, mode: bool = True) -> None:
    """Flags every run-like command shares; they override the TOML file."""
    p.add_argument("--config", metavar="FILE", help="TOML configuration file")
    p.add_argument("--learners", type=int, help="number of learners M")
    p.add_argument("--steps", type=int, help="inner steps per learner")
    p.add_argument("--seed", type=int, help="seed of the run")
    if mode:
        p.add_argument("--mode", choices=cfgmod.MODES, help="ddp, sync-diloco or decoupled")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any field, e.g. --set sync.fragments=2 (TOML value syntax)")


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set a.b=1` pairs → overrides (values parsed as TOML, bare words as strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw
    return out


def config_from_args(args: argparse.Namespace, base: RunConfig | None = None) -> RunConfig:
    """The configuration: defaults or --config FILE, then flags, validated."""
    cfg = cfgmod.load(args.config) if getattr(args, "config", None) else (base or RunConfig())
    updates: dict[str, Any] = {}
    for name in ("learners", "steps", "seed", "mode"):
        value = getattr(args, name, None)
        if value is not None:
            updates[name] = value
    updates.update(parse_set(getattr(args, "set", []) or []))
    if "learners" in updates and "sync.quorum" not in updates and cfg.sync.quorum > updates[
            "learners"]:
        updates["sync.quorum"] = updates["learners"]
    cfg = cfgmod.override(cfg, **updates) if updates else cfgmod.validate(cfg)
    if "sync.fragments" in updates or _file_sets(args, "sync", "fragments"):
        return cfg
    return fragments_for_the_model(cfg)


def _file_sets(args: argparse.Namespace, table: str, key: str) -> bool:
    path = getattr(args, "config", None)
    if not path:
        return False
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False  # (cfgmod.load read it already: not reached)
    return isinstance(data.get(table), dict) and key in data[table]


def fragments_for_the_model(cfg: RunConfig) -> RunConfig:
    """`cfg` with `sync.fragments` raised, when it was not set, to the least whose every
    value fits its paths (`pipeline.capacity.fragments_needed`), said in one line."""
    task = task_of(cfg, local=cfg.task)
    shapes = task.param_shapes()
    need = capacity.fragments_needed(cfg, shapes, task.is_embedding, capacity.Limits(
        cfg.broker.max_payload_bytes, piece_bytes=cfg.broker.piece_bytes))
    if need is None or need == cfg.sync.fragments:
        return cfg
    print(f"sync.fragments = {need}: not set, and {cfg.sync.fragments} fragments would put "
          f"more than broker.max_payload_bytes in one value at this model's "
          f"{sum(math.prod(s) for s in shapes.values()):,} parameters (set it to choose)",
          file=sys.stderr)
    return cfgmod.override(cfg, **{"sync.fragments": need})


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    sys.stdout.flush()


def fail(msg: str, code: int = 2) -> int:
    print(f"diloco: error: {msg}", file=sys.stderr)
    return code


# Redis being unreachable (or not Redis at all) is a user-facing condition for every command
# that reads a run: one line, never a traceback.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.InvalidResponse,
              redis.ResponseError)


def fail_on(e: BaseException) -> int:
    """One-line error for an expected exception (Redis unreachable, bad input, missing run)."""
    if isinstance(e, redis.exceptions.AuthenticationError):  # a ConnectionError: first
        return fail(f"Redis refused the credentials (the user and password of the URL, or "
                    f"the ACL user is off): {e}")
    if isinstance(e, redis.ResponseError):
        return fail(f"Redis refused: {e}")
    if isinstance(e, redis.exceptions.InvalidResponse):
        return fail(f"the Redis URL does not reach a Redis server: {e}")
    if isinstance(e, REDIS_DOWN):
        return fail(f"Redis did not answer: {e}")
    if isinstance(e, KeyError) and e.args:
        return fail(str(e.args[0]))
    return fail(str(e))
