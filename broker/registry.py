"""The run registry in Redis: configuration and its hash, heartbeats, syncers, events, done.

Functions that write several keys accept a `pipe` so callers can make them atomic.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from broker.errors import BrokerError, ConfigMismatch
from broker.keys import RunKeys

EVENTS_MAX = 100_000


def _s(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def store_config(r: redis.Redis, keys: RunKeys, toml_text: str, run_hash: str) -> bool:
    """Store the run configuration once. True if stored now, False if the same was there.

    Raises:
        ConfigMismatch: a different configuration is already stored under this run name.
    """
    stored = r.hsetnx(keys.config, "hash", run_hash)
    if stored:
        r.hset(keys.config, mapping={"toml": toml_text, "created": repr(time.time())})
        return True
    check_config(r, keys, run_hash)
    return False


def load_config(r: redis.Redis, keys: RunKeys, wait_s: float = 0.0) -> tuple[str, str]:
    """(toml text, run hash) of the run; waits up to `wait_s` for `diloco init` to store it."""
    deadline = time.monotonic() + wait_s
    while True:
        toml_text, run_hash = r.hmget(keys.config, ["toml", "hash"])
        if toml_text and run_hash:
            return toml_text.decode(), run_hash.decode()
        if time.monotonic() >= deadline:
            raise BrokerError(f"run {keys.run!r} has no configuration in Redis; store one with "
                              f"`diloco init --run {keys.run}` (or `diloco run --init-only`)")
        time.sleep(0.1)


def check_config(r: redis.Redis, keys: RunKeys, run_hash: str) -> None:
    stored = _s(r.hget(keys.config, "hash"))
    if stored is not None and stored != run_hash:
        raise ConfigMismatch(
            f"run {keys.run!r} was started with configuration hash {stored}, this process has "
            f"{run_hash}; use the stored configuration (omit --config) or another --run name")


def heartbeat(r: redis.Redis, keys: RunKeys, learner: str, info: dict[str, Any], ttl_s: float,
              pipe: redis.client.Pipeline | None = None) -> None:
    """Refresh the learner's TTL key and its heartbeat record."""
    p = pipe or r.pipeline(transaction=False)
    p.set(keys.heartbeat(learner), b"1", px=int(ttl_s * 1000))
    p.hset(keys.learners, learner, json.dumps({**info, "t": time.time()}))
    if pipe is None:
        p.execute()


def leave(r: redis.Redis, keys: RunKeys, learner: str) -> None:
    r.delete(keys.heartbeat(learner))


def live_learners(r: redis.Redis, keys: RunKeys) -> frozenset[str]:
    """Learners whose heartbeat key has not expired."""
    names = sorted(_s(n) for n in r.hkeys(keys.learners))
    if not names:
        return frozenset()
    alive = r.mget([keys.heartbeat(n) for n in names])
    return frozenset(n for n, a in zip(names, alive, strict=True) if a is not None)


def learner_records(r: redis.Redis, keys: RunKeys) -> dict[str, dict]:
    return {_s(k): json.loads(v) for k, v in r.hgetall(keys.learners).items()}


def register_syncer(r: redis.Redis, keys: RunKeys, syncer: str, info: dict[str, Any]) -> None:
    r.hset(keys.syncers, syncer, json.dumps({**info, "t": time.time()}))


def syncer_records(r: redis.Redis, keys: RunKeys) -> dict[str, dict]:
    return {_s(k): json.loads(v) for k, v in r.hgetall(keys.syncers).items()}


def endpoints(r: redis.Redis, keys: RunKeys) -> list[str]:
    """PUB endpoints advertised by the run's syncers."""
    return sorted({rec["endpoint"] for rec in syncer_records(r, keys).values()
                   if rec.get("endpoint")})


def event(r: redis.Redis, keys: RunKeys, kind: str, pipe: redis.client.Pipeline | None = None,
          **fields: Any) -> None:
    """Append to the run's events stream (join, leave, rejoin, timeout, fault, done …)."""
    data = {"kind": kind, "t": repr(time.time())}
    data.update({k: (v if isinstance(v, bytes | str | int | float) else json.dumps(v))
                 for k, v in fields.items()})
    (pipe or r).xadd(keys.events, data, maxlen=EVENTS_MAX, approximate=True)


def mark_done(r: redis.Redis, keys: RunKeys, learner: str, report: dict[str, Any]) -> None:
    r.hset(keys.done, learner, json.dumps(report))


def done_reports(r: redis.Redis, keys: RunKeys) -> dict[str, dict]:
    return {_s(k): json.loads(v) for k, v in r.hgetall(keys.done).items()}


def request_stop(r: redis.Redis, keys: RunKeys) -> None:
    r.set(keys.stop, b"1")


def stop_requested(r: redis.Redis, keys: RunKeys) -> bool:
    return bool(r.exists(keys.stop))


def request_finish(r: redis.Redis, keys: RunKeys) -> None:
    """End training early but cleanly: learners stop stepping and flush, syncers finish."""
    r.set(keys.finish, b"1")


def finish_requested(r: redis.Redis, keys: RunKeys) -> bool:
    return bool(r.exists(keys.finish))
