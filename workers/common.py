"""Opening a run: connect, fetch and check the stored run configuration, lay out shapes and
fragments. Both roles do this on start, and so does every tool that reads a run."""

from __future__ import annotations

import argparse
import glob
import io
import ipaddress
import logging
import os
import sys
import threading
import time
import tomllib
import traceback
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import redis

from broker import attest, codec, pieces, registry
from broker.archive import fsync_dir
from broker.connection import URL_ENV, connect, redact, resolve_tls_files, url_from_env
from broker.errors import BrokerError, DecodeError
from broker.keys import FragmentKeys, RunKeys
from pipeline import config as cfgmod
from pipeline import data, quant
from pipeline.config import RunConfig
from pipeline.fragments import partition
from pipeline.task import Task, TaskNotNamed, param_spec, spec_task, task_of

log = logging.getLogger("diloco.common")

INSECURE_ENV = "DILOCO_INSECURE"  # "1": roles may run open against a Redis on another host


def is_loopback(url: str) -> bool:
    """True when `url` reaches a Redis on this host (loopback address or a Unix socket)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return False
    if parts.scheme == "unix":
        return True
    return loopback_host(parts.hostname or "")


def loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (IPv4 or IPv6)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_NO_VERIFY = {"ssl_cert_reqs": {"none", "optional"}, "ssl_check_hostname": {"false", "0", "no"}}


def security_missing(url: str, *, curve: bool, signed: bool, bind: str | None = None
                     ) -> list[str]:
    """What a role lacks to run against a Redis on another host, or (a syncer) to publish on
    a non-loopback address (docs/SECURITY.md): a TLS URL that verifies the server, with an ACL
    user; ZeroMQ CURVE; signed contributions. Empty when everything is on this host."""
    bind_host = bind[len("tcp://"):].rsplit(":", 1)[0].strip("[]") if bind and \
        bind.startswith("tcp://") else None
    remote_bind = bind_host is not None and not loopback_host(bind_host)
    missing = []
    if not is_loopback(url):
        parts = urllib.parse.urlsplit(url)
        query = {k.lower(): v.lower() for k, v in urllib.parse.parse_qsl(parts.query)}
        if parts.scheme != "rediss":
            missing.append("a rediss:// (TLS) Redis URL")
        elif any(query.get(k) in bad for k, bad in _NO_VERIFY.items()):
            missing.append("TLS certificate checks (the URL turns them off)")
        if not parts.username or parts.username == "default":
            missing.append("an ACL user in the URL (diloco acl)")
    elif not remote_bind:
        return []
    if not curve:
        missing.append("ZeroMQ CURVE keys (--curve-…)")
    if not signed:
        missing.append("signing keys (--sign-key / --sign-keys)")
    return missing


def require_security(url: str, *, curve: bool, signed: bool, insecure: bool,
                     bind: str | None = None) -> None:
    """Security is on by default against a Redis on another host (or a syncer publishing on a
    non-loopback address): refuse (exit 2, one line) unless the role has it all, or
    `insecure` (``--insecure``, ``$DILOCO_INSECURE=1``)."""
    if insecure or os.environ.get(INSECURE_ENV) == "1":
        return
    missing = security_missing(url, curve=curve, signed=signed, bind=bind)
    if missing:
        where = (f"the Redis at {redact(url)} is on another host" if not is_loopback(url)
                 else f"this syncer publishes on {bind}")
        usage_error(f"{where}, and this process is missing {'; '.join(missing)}; set them up "
                    f"(docs/SECURITY.md) or pass --insecure to run open on a network you "
                    f"control")


def usage_error(message: str) -> None:
    """An operator's mistake on a role's command line: one line, exit 2 (as argparse)."""
    sys.stderr.write(f"diloco: error: {message}\n")
    raise SystemExit(2)


class _UrlFile(argparse.Action):
    """``--redis-url-file FILE``: the URL is the file's first line (kept off the process
    list, where every user of the host can read a command line)."""

    def __call__(self, parser, namespace, value, option_string=None):
        try:
            lines = Path(value).read_text(encoding="utf-8").strip().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"{option_string}: cannot read {value}: "
                         f"{getattr(e, 'strerror', None) or e}")
        if not lines or not lines[0].strip():
            parser.error(f"{option_string}: {value} is empty")
        try:  # the TLS files it names: beside the file first
            url = resolve_tls_files(lines[0].strip(), Path(value).resolve().parent)
        except FileNotFoundError as e:
            parser.error(f"{option_string} {value}: {e}")
        setattr(namespace, self.dest, url)


def add_redis_args(ap: argparse.ArgumentParser, *, required: bool = True,
                   help: str = "Redis of the run") -> None:
    """``--redis-url URL`` or ``--redis-url-file FILE``, else ``$DILOCO_REDIS_URL``: put a URL
    with a password in the file or the variable, not on the command line."""
    env = url_from_env()
    g = ap.add_mutually_exclusive_group(required=required and env is None)
    g.add_argument("--redis-url", default=env,
                   help=f"{help} (or --redis-url-file, or ${URL_ENV}; a URL with a password "
                        f"belongs in the file or the variable: a command line is public)")
    g.add_argument("--redis-url-file", dest="redis_url", action=_UrlFile, metavar="FILE",
                   help="read the Redis URL from the first line of this file")


def add_role_args(ap: argparse.ArgumentParser) -> None:
    """The flags the learner and the syncer share: metrics endpoint, ``--insecure``."""
    ap.add_argument("--metrics-port", type=int, default=0,
                    help="serve Prometheus metrics on this port (default: off)")
    ap.add_argument("--metrics-host", default="127.0.0.1",
                    help="address the metrics endpoint binds (default: loopback only; "
                         "0.0.0.0 for every interface)")
    ap.add_argument("--insecure", action="store_true",
                    help="run without TLS, ACL user, CURVE and signatures against a Redis on "
                         "another host (refused by default)")


def apply_environment() -> None:
    """Settings a process takes from its environment: ``DILOCO_DATA_CACHE`` (where text and
    JSONL corpora are cached, `pipeline.data`)."""
    data.set_cache_dir(os.environ.get(data.CACHE_ENV) or None)


@dataclass
class RunContext:
    r: redis.Redis
    keys: RunKeys
    cfg: RunConfig
    run_hash: str
    shapes: dict[str, tuple[int, ...]]
    fragments: list[list[str]]
    task: Task


def open_run(redis_url: str, run: str, *, expect_hash: str | None = None,
             wait_s: float = 30.0, verify: bool = True, task: str | None = None,
             need_code: bool = False) -> RunContext:
    """Connect and load the run configuration stored in Redis (waiting up to `wait_s`).

    Args:
        verify: check that the stored configuration hashes to the stored run hash (every
            process that takes part in the run, and replay); the read-only tools (status,
            inspect, plot, export) show a run whatever wrote it and pass False.
        task: The user task this process's command line names (``--task``): imported only
            when the run trains that task (`pipeline.task.task_of`). Without it, a user-task
            run opens from its stored parameter spec (shapes and embeddings, no code).
        need_code: Refuse to open a user-task run without its code (learners, replay).

    Raises:
        BrokerError: The run has no configuration (or is stored under old key names).
        ConfigError: The stored configuration does not match its hash (with `verify`).
        ConfigMismatch: `expect_hash` is given and differs from the stored hash.
        ValueError: The run name is not a valid name.
    """
    keys = RunKeys(run)
    probe = connect(redis_url)
    toml_text, run_hash = registry.load_config(probe, keys, wait_s=wait_s)
    cfg = cfgmod.from_stored(tomllib.loads(toml_text))
    if verify and cfg.run_hash() != run_hash:
        raise cfgmod.ConfigError(f"stored configuration of run {run!r} does not match its hash")
    if expect_hash is not None:
        registry.check_config(probe, keys, expect_hash)
    r = connect(redis_url, socket_timeout_s=cfg.broker.socket_timeout_s,
                block_ms=cfg.broker.block_ms)
    probe.close()
    task_ = _task(r, keys, cfg, task, need_code)
    shapes = task_.param_shapes()
    frags = partition(shapes, cfg.effective_sync().fragments, task_.is_embedding)
    return RunContext(r, keys, cfg, run_hash, shapes, frags, task_)


def _task(r: redis.Redis, keys: RunKeys, cfg: RunConfig, local: str | None,
          need_code: bool) -> Task:
    """The run's task: built in, imported (named locally) or from the stored spec."""
    if cfg.task in cfgmod.TASKS or local == cfg.task or need_code:
        task = task_of(cfg, local)
        spec = None if cfg.task in cfgmod.TASKS else registry.load_param_spec(r, keys)
        if spec is not None and param_spec(task) != param_spec(spec_task(cfg, spec)):
            raise cfgmod.ConfigError(f"task {cfg.task!r}: this process's code builds other "
                                     f"parameters, embeddings or tokens per step than the "
                                     f"run's stored spec (a different version of the task?)")
        return task
    spec = registry.load_param_spec(r, keys)
    if spec is None:
        raise TaskNotNamed(f"run {keys.run!r} trains the user task {cfg.task!r} and has no "
                           f"stored parameter spec: pass --task {cfg.task}")
    return spec_task(cfg, spec)



def decode_values(tensors: dict[str, quant.QTensor]) -> dict[str, np.ndarray]:
    """Dequantise every tensor."""
    return {k: quant.dequantize(q) for k, q in tensors.items()}


class Snapshot(NamedTuple):
    version: int
    values: dict[str, np.ndarray]
    header: codec.GlobalHeader  # its layout and the SHA-256 of its tensors


def read_snapshot(r: redis.Redis, fk: FragmentKeys, max_bytes: int,
                  shapes: Mapping[str, tuple[int, ...]]) -> Snapshot | None:
    """The fragment's latest published value (decoded), or None.

    Raises:
        DecodeError: A snapshot that does not decode, one of another fragment or run, one
            whose tensors are not the fragment's (`shapes`: name → shape), or one holding
            non-finite values.
    """
    blob = pieces.read(r, fk.global_, max_bytes=max_bytes, what="snapshot")
    if blob is None:
        return None
    header, tensors = codec.unpack_snapshot(blob, max_bytes=max_bytes)
    del blob
    if (header.run, header.fragment) != (fk.run, fk.fragment):
        raise DecodeError(f"the snapshot of fragment {fk.fragment} of run {fk.run!r} says "
                          f"fragment {header.fragment} of run {header.run!r}")
    if {k: tuple(q.shape) for k, q in tensors.items()} != {k: tuple(s) for k, s in shapes.items()}:
        raise DecodeError(f"the snapshot of fragment {fk.fragment} does not hold the "
                          f"fragment's tensors and shapes")
    values = decode_values(tensors)
    if not all(np.isfinite(v).all() for v in values.values()):
        raise DecodeError(f"the snapshot of fragment {fk.fragment} holds non-finite values")
    return Snapshot(header.version, values, header)


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    """This host's (MemTotal, MemAvailable) in bytes; 0 where not known (not Linux)."""
    got = {}
    try:
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable") and rest.split():
                got[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return got.get("MemTotal", 0), got.get("MemAvailable", 0)


def memory_refusal(role: str, need: int, fix: str,
                   meminfo: Path = Path("/proc/meminfo")) -> str | None:
    """Why a `role` process whose arrays need `need` bytes (`pipeline.plan.role_bytes`)
    cannot run on this host — more than its memory, `fix` says what to change — or None
    (logged at warning when it is more than the memory available now)."""
    total, available = host_memory(meminfo)
    gib = 2**30
    if total and need > total:
        return (f"the {role}'s arrays alone need {need / gib:.1f} GiB (diloco plan), more "
                f"than this host's {total / gib:.1f} GiB: {fix}")
    if available and need > available:
        log.warning("the %s's arrays need %.1f GiB (diloco plan), more than the %.1f GiB "
                    "available on this host now", role, need / gib, available / gib)
    return None




def join_snapshot(r: redis.Redis, fk: FragmentKeys, max_bytes: int,
                  shapes: Mapping[str, tuple[int, ...]], attested: attest.Attestations,
                  deadline: float) -> Snapshot:
    """The fragment's value to join from: read until there is one (its syncer writes it when
    it starts) and, with CURVE, until it is what the syncers attested over ZeroMQ for its
    version (`broker.attest`; a forged or malformed one is logged, once, and read again a
    second later; one not attested yet is waited for — a takeover's recovery, a restart).

    Raises:
        BrokerError: None by `deadline` (monotonic), saying why.
    """
    said: set[str] = set()
    why = ""
    while True:
        now_why = ""
        try:
            snap = read_snapshot(r, fk, max_bytes, shapes)
        except DecodeError as e:
            snap, now_why = None, f"its snapshot in Redis does not decode: {e}"
        # (a snapshot not attested yet is waited on, not read again: it may be large)
        verdict = None if snap is None else attested.wait(
            fk.fragment, snap.header, min(5.0, max(0.0, deadline - time.monotonic())))
        if verdict == attest.OK:
            return snap
        if verdict == attest.FORGED:
            now_why = attest.refusal(snap.version)
        elif verdict == attest.UNKNOWN:
            now_why = (f"no syncer attested its snapshot (version {snap.version}) over ZeroMQ: "
                       f"is the syncer serving it running with --curve-secret, and reachable?")
        why = now_why or why
        if now_why and now_why not in said and verdict != attest.UNKNOWN:
            said.add(now_why)
            log.error("fragment %d: %s; reading it again", fk.fragment, now_why)
        if time.monotonic() > deadline:
            raise BrokerError(f"fragment {fk.fragment}: {why}" if why else
                              f"fragment {fk.fragment} has no global value in Redis; is a "
                              f"syncer running for run {fk.run!r}?")
        time.sleep(1.0 if verdict == attest.FORGED or now_why and snap is None else 0.1)


def write_npz_atomic(path: Path, arrays: dict[str, np.ndarray], *,
                     stall_after_half: bool = False) -> None:
    """Write an .npz durably: a temporary file in the same folder, fsynced, renamed over
    `path`, and the folder fsynced — a crash leaves the old file or the new one, never a
    truncated one (a crash mid-write leaves a temporary `stale_temps` finds).

    `stall_after_half` is fault injection (the durability test kills the process there): write
    half the bytes, flush them to the disk and sleep."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            if stall_after_half:
                buf = io.BytesIO()
                np.savez(buf, **arrays)
                data = buf.getvalue()
                fh.write(data[: len(data) // 2])
                fh.flush()
                os.fsync(fh.fileno())
                time.sleep(3600)
                fh.write(data[len(data) // 2:])
            else:
                np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


class NpzWriter:
    """`write_npz_atomic` on a thread of its own, one write at a time: `submit` waits only for
    the previous write and returns while the new one is written and fsynced. A crash during a
    write leaves the file before it whole, which is then up to two intervals behind the data
    (one with synchronous writes). A failed write is raised by the next `submit` (or logged
    by `close`)."""

    def __init__(self, name: str):
        self.name = name
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None

    def submit(self, path: Path, arrays: dict[str, np.ndarray], *,
               stall_after_half: bool = False) -> None:
        """Write `arrays` (which the caller must not change afterwards) to `path`."""
        self._idle.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        self._idle.clear()
        try:
            threading.Thread(target=self._write, args=(path, arrays, stall_after_half),
                             name=f"{self.name}-write", daemon=True).start()
        except BaseException:
            self._idle.set()
            raise

    def _write(self, path: Path, arrays: dict[str, np.ndarray], stall: bool) -> None:
        try:
            write_npz_atomic(path, arrays, stall_after_half=stall)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            traceback.clear_frames(e.__traceback__)  # they hold `arrays`: a whole checkpoint
            self._error = e
        finally:
            self._idle.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the write in progress; False if it is still going after `timeout_s`."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Let the write in progress finish (a clean stop leaves the latest file whole)."""
        if not self.wait(timeout_s):
            log.error("%s: a write is still in progress after %.0f s; leaving it", self.name,
                      timeout_s)
        elif self._error is not None:
            log.error("%s: the last write failed: %s: %s", self.name,
                      type(self._error).__name__, self._error)


def stale_temps(path: Path) -> list[Path]:
    """Temporary files `write_npz_atomic` left beside `path` when its process died mid-write."""
    path = Path(path)
    return sorted(path.parent.glob(f".{glob.escape(path.name)}.*.tmp"))


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that is not known: the
    learner's cold start counts from the exec, imports included."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        with open("/proc/uptime", "rb") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - started)
    except (OSError, ValueError, IndexError):
        return None


def enable_compile_cache(path: Path) -> None:
    """Keep this process's JAX compilations in `path`, so that a restarted process loads them
    instead of compiling again (a learner's init and first step: 3.4 s → 0.9 s on the 2-core
    benchmark machine). One process per folder: JAX writes entries without a lock.

    Where the environment names a cache (``JAX_COMPILATION_CACHE_DIR``: one folder shared by
    the learners of a host, or the test suite's) that one is kept instead, with a size limit
    (``JAX_COMPILATION_CACHE_MAX_SIZE``, 64 GiB unless set): with a limit JAX takes a file
    lock around every read and write of the folder, so processes can share it."""
    import jax

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        if jax.config.jax_compilation_cache_max_size < 0:  # -1: no limit, and no lock
            jax.config.update("jax_compilation_cache_max_size", 64 << 30)
    else:
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
