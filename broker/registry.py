"""The run registry in Redis: configuration and its hash, heartbeats, syncers, events, done.

Heartbeats and end-of-run reports are typed records (`broker.records`); the layout of the
``:done`` hash (which field holds which report) is known here only. Functions that write
several keys accept a `pipe` so callers can make them atomic.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from broker import signing
from broker.errors import BrokerError, ConfigMismatch, DecodeError
from broker.ids import as_text
from broker.keys import RunKeys
from broker.records import (
    FinalPushes,
    Heartbeat,
    LearnerFinal,
    Merged,
    Refusal,
    SyncerFinal,
    SyncerInfo,
)
from pipeline.contribution import MergeRecord

EVENTS_MAX = 100_000
log = logging.getLogger("diloco.registry")


MAX_SPEC_BYTES = 64 * 2**20


def store_config(r: redis.Redis, keys: RunKeys, toml_text: str, run_hash: str,
                 spec: dict | None = None) -> bool:
    """Store the run configuration once. True if stored now, False if the same was there.

    Args:
        spec: The parameter spec of a user task (`pipeline.task.param_spec`), stored with the
            configuration so that processes without the task's code can open the run.

    Raises:
        ConfigMismatch: a different configuration is already stored under this run name.
    """
    _refuse_legacy(r, keys)
    stored = r.hsetnx(keys.config, "hash", run_hash)
    if stored:
        fields = {"toml": toml_text, "created": repr(time.time())}
        if spec is not None:
            fields["params"] = json.dumps(spec, separators=(",", ":"))
        r.hset(keys.config, mapping=fields)
        return True
    check_config(r, keys, run_hash)
    return False


def load_param_spec(r: redis.Redis, keys: RunKeys) -> Any:
    """The stored parameter spec of a user-task run (parsed JSON, unvalidated), or None.

    Raises:
        DecodeError: The field is over 64 MiB or not JSON.
    """
    if r.hstrlen(keys.config, "params") > MAX_SPEC_BYTES:
        raise DecodeError(f"run {keys.run!r}: the stored parameter spec is over "
                          f"{MAX_SPEC_BYTES} bytes")
    raw = r.hget(keys.config, "params")
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise DecodeError(f"run {keys.run!r}: the stored parameter spec is not JSON") from e


def load_config(r: redis.Redis, keys: RunKeys, wait_s: float = 0.0) -> tuple[str, str]:
    """(toml text, run hash) of the run; waits up to `wait_s` for `diloco init` to store it."""
    deadline = time.monotonic() + wait_s
    while True:
        toml_text, run_hash = r.hmget(keys.config, ["toml", "hash"])
        if toml_text and run_hash:
            return toml_text.decode(), run_hash.decode()
        if time.monotonic() >= deadline:
            _refuse_legacy(r, keys)
            raise BrokerError(f"run {keys.run!r} has no configuration in Redis; store one with "
                              f"`diloco init --run {keys.run}` (or `diloco run --init-only`)")
        time.sleep(0.1)


def _refuse_legacy(r: redis.Redis, keys: RunKeys) -> None:
    """A run stored by a version before the final key names is not read (nor written over)."""
    if r.exists(keys.legacy_config):
        raise BrokerError(
            f"run {keys.run!r} was stored by an earlier version of diloco under key names this "
            f"version does not read ({keys.legacy_config}; now {keys.config}). Use a new run "
            f"name, or finish and replay it with the version that recorded it")


def check_config(r: redis.Redis, keys: RunKeys, run_hash: str) -> None:
    stored = as_text(r.hget(keys.config, "hash"))
    if stored is not None and stored != run_hash:
        raise ConfigMismatch(
            f"run {keys.run!r} was started with configuration hash {stored}, this process has "
            f"{run_hash}; use the stored configuration (omit --config) or another --run name")


def heartbeat(r: redis.Redis, keys: RunKeys, learner: str, info: Heartbeat, ttl_s: float,
              pipe: redis.client.Pipeline | None = None,
              sign: Callable[[Heartbeat], Heartbeat] | None = None) -> None:
    """Refresh the learner's TTL key and its heartbeat record (stamped with the time now,
    then signed by `sign` in signed runs: syncers count only heartbeats they can verify)."""
    p = pipe or r.pipeline(transaction=False)
    p.set(keys.heartbeat(learner), b"1", px=int(ttl_s * 1000))
    rec = dataclasses.replace(info, t=time.time())
    p.hset(keys.learners, learner, (sign(rec) if sign is not None else rec).to_json())
    if pipe is None:
        p.execute()


EPOCH_LOOKBACK = 16  # newer claims a signed learner checks (a flood of INCRs is not read)


def claim_epoch(r: redis.Redis, keys: RunKeys, learner: str, sign_key: bytes | None = None
                ) -> int:
    """A new epoch of `learner` for the process joining as it (0: epochs are unavailable —
    the run's ACL users predate them, or the counter is not a number: logged, and the
    process is not fenced). Every push carries its process's epoch; a process looks for a
    newer one before it pushes (`newer_epoch`) and stops when there is one
    (:class:`broker.errors.Superseded`), and a syncer that has seen a learner's entry of some
    epoch dead-letters its entries of older ones: two processes running under one learner id
    (a partitioned learner coming back while its replacement runs) never both contribute.
    With `sign_key` (signed runs) the claim is also stored signed, only a signed claim makes
    another process of the learner stand down, and the new epoch is above every signed one
    (a counter that went back, e.g. an AOF restart missing its last second, is moved up)."""
    try:
        floor = _signed_newest(r, keys, learner, sign_key) if sign_key is not None else 0
        epoch = int(r.incr(keys.epoch(learner)))
        if epoch <= floor:
            epoch = int(r.incrby(keys.epoch(learner), floor + 1 - epoch))
        if sign_key is not None:
            sig = signing.sign_epoch(sign_key, keys.run, learner, epoch)
            # per epoch (what a process standing down reads) and the latest (a hint: two
            # claims at once may leave it on the older one)
            r.hset(keys.epoch_sig(learner), mapping={str(epoch): sig,
                                                     "latest": f"{epoch}:{sig}"})
    except redis.ResponseError as e:  # NOPERM (ACL users from before epochs), not a number
        log.warning("learner %r: cannot claim an epoch (%s): this process is not fenced "
                    "against another one with its id; re-apply the run's ACL users "
                    "(diloco acl --apply) if they predate epochs", learner, e)
        return 0
    return epoch


def _epoch_value(raw: Any) -> int | None:
    """A stored epoch; None if it is not a decimal integer of at most 18 digits."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    if isinstance(text, str) and 0 < len(text) <= 18 and text.isascii() and text.isdigit():
        return int(text)
    return None


def learner_epoch(r: redis.Redis, keys: RunKeys, learner: str) -> int | None:
    """The latest epoch claimed for `learner` (None: none, or not a number)."""
    return _epoch_value(r.get(keys.epoch(learner)))


_warned: dict[str, Any] = {}  # learner → the last ignored claim logged (one line per change)


def _signed_newest(r: redis.Redis, keys: RunKeys, learner: str, sign_key: bytes,
                   above: int = 0) -> int:
    """The newest epoch above `above` whose claim is signed with `sign_key`, of the
    `EPOCH_LOOKBACK` up to the counter (or above `above` when the counter is unreadable) and
    the ``latest`` claim recorded (which finds claims above a counter Redis lost); `above` if
    none. A claim that does not verify is ignored (logged once per claim)."""
    latest = learner_epoch(r, keys, learner)
    top = latest if latest is not None else above + EPOCH_LOOKBACK
    wanted = [str(n) for n in range(top, max(above, top - EPOCH_LOOKBACK), -1)]
    sigs = r.hmget(keys.epoch_sig(learner), [*wanted, "latest"])
    hint = sigs.pop()
    claims = list(zip(wanted, sigs, strict=True))
    if isinstance(hint, bytes):
        n, _, sig = hint[:160].decode("ascii", "replace").partition(":")
        if _epoch_value(n) is not None:
            claims.append((str(int(n)), sig.encode()))
    best = above
    for n, sig in claims:
        if sig is None or int(n) <= best:
            continue
        want = signing.sign_epoch(sign_key, keys.run, learner, int(n)).encode()
        if isinstance(sig, bytes) and hmac.compare_digest(sig[:128], want):
            best = int(n)
        elif _warned.get(learner) != (n, sig[:64]):
            _warned[learner] = (n, sig[:64])
            log.warning("learner %r: the claim of epoch %s is not signed with its key "
                        "(ignored)", learner, n)
    return best


def newer_epoch(r: redis.Redis, keys: RunKeys, learner: str, own: int,
                sign_key: bytes | None = None) -> int | None:
    """An epoch of `learner` newer than `own` that a process has claimed, or None. With
    `sign_key`, only a claim signed with it counts: a learner user may raise any learner's
    counter, but not sign for another learner (the syncers' fence does not depend on it)."""
    if sign_key is None:
        latest = learner_epoch(r, keys, learner)
        return latest if latest is not None and latest > own else None
    newest = _signed_newest(r, keys, learner, sign_key, above=own)
    return newest if newest > own else None


def leave(r: redis.Redis, keys: RunKeys, learner: str) -> None:
    r.delete(keys.heartbeat(learner))


def live_learners(r: redis.Redis, keys: RunKeys) -> frozenset[str]:
    """Learners whose heartbeat key has not expired."""
    names = sorted(as_text(n) for n in r.hkeys(keys.learners))
    if not names:
        return frozenset()
    alive = r.mget([keys.heartbeat(n) for n in names])
    return frozenset(n for n, a in zip(names, alive, strict=True) if a is not None)


def learner_records(r: redis.Redis, keys: RunKeys) -> dict[str, Heartbeat]:
    """Each learner's last heartbeat (a malformed record is left out, and logged)."""
    return _decoded(r.hgetall(keys.learners), Heartbeat, "heartbeat")


def _decoded(raw: dict, cls, what: str) -> dict:
    out = {}
    for k, v in raw.items():
        try:
            out[as_text(k)] = cls.from_json(v, f"{what} of {as_text(k)!r}")
        except DecodeError as e:
            log.warning("ignored: %s", e)
    return out


def register_syncer(r: redis.Redis, keys: RunKeys, syncer: str, info: SyncerInfo) -> None:
    """Write the syncer's record (stamped with the time now)."""
    r.hset(keys.syncers, syncer, dataclasses.replace(info, t=time.time()).to_json())


def syncer_records(r: redis.Redis, keys: RunKeys) -> dict[str, SyncerInfo]:
    """Each syncer's record (a malformed record is left out, and logged)."""
    return _decoded(r.hgetall(keys.syncers), SyncerInfo, "syncer record")


def endpoints(r: redis.Redis, keys: RunKeys) -> list[str]:
    """PUB endpoints advertised by the run's syncers."""
    return sorted({rec.endpoint for rec in syncer_records(r, keys).values() if rec.endpoint})


def syncer_alive(r: redis.Redis, keys: RunKeys, syncer: str, ttl_ms: int) -> list[str]:
    """Mark `syncer` a member for `ttl_ms` more (its key's TTL: Redis's clock, no host's),
    forget members whose key expired, and return the members now (sorted)."""
    pipe = r.pipeline(transaction=True)
    pipe.set(keys.member(syncer), b"1", px=ttl_ms)
    pipe.sadd(keys.members, syncer)
    pipe.smembers(keys.members)
    names = sorted(as_text(m) for m in pipe.execute()[-1])
    alive = r.mget([keys.member(n) for n in names])
    dead = [n for n, a in zip(names, alive, strict=True) if a is None]
    if dead:
        r.srem(keys.members, *dead)
    return [n for n in names if n not in dead]


def syncer_members(r: redis.Redis, keys: RunKeys) -> list[str]:
    """The syncers sharing the run's fragments (their keys alive; read-only)."""
    names = sorted(as_text(m) for m in r.smembers(keys.members))
    if not names:
        return []
    alive = r.mget([keys.member(n) for n in names])
    return [n for n, a in zip(names, alive, strict=True) if a is not None]


def syncer_leave(r: redis.Redis, keys: RunKeys, syncer: str) -> None:
    """`syncer` stops: the others share its fragments at once."""
    pipe = r.pipeline(transaction=True)
    pipe.delete(keys.member(syncer))
    pipe.srem(keys.members, syncer)
    pipe.execute()


def event(r: redis.Redis, keys: RunKeys, kind: str, pipe: redis.client.Pipeline | None = None,
          **fields: Any) -> None:
    """Append to the run's events stream (join, leave, rejoin, timeout, fault, done …)."""
    data = {"kind": kind, "t": repr(time.time())}
    data.update({k: (v if isinstance(v, bytes | str | int | float) else json.dumps(v))
                 for k, v in fields.items()})
    (pipe or r).xadd(keys.events, data, maxlen=EVENTS_MAX, approximate=True)


# The ``:done`` hash: field ``<learner>`` → FinalPushes, ``final:<learner>`` → LearnerFinal,
# ``syncer:<syncer>`` → SyncerFinal.
_FINAL, _SYNCER = "final:", "syncer:"


def mark_final_pushes(r: redis.Redis, keys: RunKeys, learner: str, rep: FinalPushes) -> None:
    """A learner finished training and pushed its final contributions."""
    r.hset(keys.done, learner, rep.to_json())


def mark_learner_final(r: redis.Redis, keys: RunKeys, learner: str, rep: LearnerFinal) -> None:
    """A learner's end-of-run report (it adopted the final values)."""
    r.hset(keys.done, _FINAL + learner, rep.to_json())


def mark_syncer_final(r: redis.Redis, keys: RunKeys, syncer: str, rep: SyncerFinal) -> None:
    """A syncer closed the final rounds of its fragments."""
    r.hset(keys.done, _SYNCER + syncer, rep.to_json())


def note_refused(r: redis.Redis, keys: RunKeys, learner: str, fragment: int,
                 rec: Refusal) -> None:
    """The syncer refused this push of `learner` to `fragment` (the last such per fragment)."""
    r.hset(keys.refused, f"{learner}:{fragment}", rec.to_json())


def refusal(r: redis.Redis, keys: RunKeys, learner: str, fragment: int) -> Refusal | None:
    """The last refused push of `learner` to `fragment` (None: none, or a malformed record)."""
    raw = r.hget(keys.refused, f"{learner}:{fragment}")
    if raw is None:
        return None
    try:
        return Refusal.from_json(raw, f"refusal of {learner!r}")
    except DecodeError as e:
        log.warning("ignored: %s", e)
        return None


def merged(r: redis.Redis, keys: RunKeys, learner: str, fragment: int) -> MergeRecord | None:
    """The last merged push of `learner` to `fragment` (None: none, or a malformed record).
    The syncer writes these records in each round's commit (`broker.streams.FragmentStreams.
    commit_round`), so a learner that reads a round's value or snapshot finds its record."""
    raw = r.hget(keys.fragment(fragment).merged, learner)
    if raw is None:
        return None
    try:
        m = Merged.from_json(raw, f"merge record of {learner!r}")
        return MergeRecord(m.base_version, m.step, m.version)
    except DecodeError as e:
        log.warning("ignored: %s", e)
        return None


def _done(r: redis.Redis, keys: RunKeys) -> tuple[dict, dict, dict]:
    pushes, finals, syncers = {}, {}, {}
    for k, v in r.hgetall(keys.done).items():
        k = as_text(k)
        if k.startswith(_FINAL):
            finals[k[len(_FINAL):]] = v
        elif k.startswith(_SYNCER):
            syncers[k[len(_SYNCER):]] = v
        else:
            pushes[k] = v
    return pushes, finals, syncers


def done_names(r: redis.Redis, keys: RunKeys) -> list[str]:
    """The reports in the ``:done`` hash by their field names, sorted (as `status` lists them:
    ``L0`` pushed its final contributions, ``final:L0`` finished, ``syncer:S`` closed)."""
    return sorted(as_text(k) for k in r.hkeys(keys.done))


def learner_finished(r: redis.Redis, keys: RunKeys, learner: str) -> bool:
    """True once `learner` has written its end-of-run report."""
    return bool(r.hexists(keys.done, _FINAL + learner))


def final_pushes(r: redis.Redis, keys: RunKeys) -> dict[str, FinalPushes]:
    """Learners that finished training → the fragments they pushed final contributions for."""
    return _decoded(_done(r, keys)[0], FinalPushes, "final pushes")


def learner_final_reports(r: redis.Redis, keys: RunKeys) -> dict[str, LearnerFinal]:
    """Learners' end-of-run reports, by learner."""
    return _decoded(_done(r, keys)[1], LearnerFinal, "final report")


def syncer_final_reports(r: redis.Redis, keys: RunKeys) -> dict[str, SyncerFinal]:
    """Syncers' final versions, by syncer."""
    return _decoded(_done(r, keys)[2], SyncerFinal, "syncer report")


def request_stop(r: redis.Redis, keys: RunKeys) -> None:
    r.set(keys.stop, b"1")


def stop_requested(r: redis.Redis, keys: RunKeys) -> bool:
    return bool(r.exists(keys.stop))


def request_finish(r: redis.Redis, keys: RunKeys) -> None:
    """End training early but cleanly: learners stop stepping and flush, syncers finish."""
    r.set(keys.finish, b"1")


def finish_requested(r: redis.Redis, keys: RunKeys) -> bool:
    return bool(r.exists(keys.finish))
