"""Redis clients with the timeouts and retries the pipeline relies on.

redis-py's defaults bite here: a client without a socket timeout hangs forever on a dead
server, and one whose timeout is below the XREADGROUP BLOCK time fails every idle read. Every
client is built by `connect`, which checks the relation and adds jittered exponential retries
(redis-py `Retry`); a retried XADD may duplicate an entry, which the syncer dedupes.

Commands are serialised by redis-py's pure-Python packer, which sends a large argument as its
own buffer, rather than hiredis' packer, which copies it into one command string: SET of the
8 MB syncer state takes 8 ms instead of 23 ms (measured here; the replies are still parsed by
hiredis).
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthorizationError,
    ClusterError,
    RedisClusterException,
    TryAgainError,
)
from redis.retry import Retry

from pipeline.capacity import REDIS_BULK_DEFAULT, Limits

try:  # redis-py internals (stable across 5.x–8.x); without them, its default packer
    from redis._parsers import Encoder
    from redis.connection import PythonRespSerializer

    _PACKER = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)
except ImportError:  # pragma: no cover
    _PACKER = None


URL_ENV = "DILOCO_REDIS_URL"  # where every command looks for the Redis URL last

# What an unreachable Redis (or a cluster whose slots are moving: a failover) raises once the
# client's own retries are spent. Learners and syncers ride these out (back off, then resync).
# A slot redirect (MOVED/ASK, `AskError` and its subclass `MovedError`) is among them: a WATCH
# of a commit's transaction raises it when the failover outlasts the client's retries.
OUTAGE: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError,
                                       ClusterError, TryAgainError, RedisClusterException,
                                       AskError)


# A refusal is a ConnectionError to redis-py, but asking again cannot change the answer.
REFUSED: tuple[type[Exception], ...] = (AuthenticationError, AuthorizationError)


class _Refused(Exception):
    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class _Retry(Retry):
    """redis-py's `Retry`, except that a refused login (`REFUSED`) is raised at once: a wrong or
    missing password otherwise spends every retry of the connection and of the command (24 s
    here before the first error message)."""

    def call_with_retry(self, do, fail, *args, **kwargs):
        def once():
            try:
                return do()
            except REFUSED as e:
                raise _Refused(e) from e

        try:
            return super().call_with_retry(once, fail, *args, **kwargs)
        except _Refused as refused:
            raise refused.error from None


def _retry(retries: int) -> Retry:
    return _Retry(ExponentialWithJitterBackoff(cap=2.0, base=0.05), retries)


def redact(url: str) -> str:
    """`url` without its secrets, for logs, output files and messages: the password of
    ``user:password@`` becomes ``***`` (a lone ``secret@``, which may be a password, too) and so
    does a ``password=`` query parameter. A string that cannot be parsed as a URL becomes
    ``***`` if it holds an ``@`` (it may hold a secret), else it is returned unchanged."""
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user, colon, _ = userinfo.partition(":")
            netloc = f"{user}:***@{hostport}" if colon and user else f"***@{hostport}"
        query = parts.query
        if query:
            query = urllib.parse.urlencode(
                [(k, "***" if "pass" in k.lower() else v)
                 for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True)],
                safe="*/:")
        rest = url.split("://", 1)[-1]
        if "@" in rest and "@" not in parts.netloc:
            return "***"  # a userinfo the parser did not see (a '#', '/' or '?' in it)
        if netloc == parts.netloc and query == parts.query:
            return url
        return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else ""))
    except ValueError:
        return "***" if "@" in url else url


def has_secret(url: str) -> bool:
    """True when `url` carries a password (it must not go on a command line)."""
    return redact(url) != url


def url_from_env() -> str | None:
    """The Redis URL from the environment (``DILOCO_REDIS_URL``), if set."""
    return os.environ.get(URL_ENV) or None


def quick(r: redis.Redis | RedisCluster, timeout_s: float = 1.0) -> redis.Redis | RedisCluster:
    """A client of the same server (or cluster), user and TLS settings as `r` that gives up
    after `timeout_s` without retrying: for reads a training loop makes, which must not stall
    it while the network is down."""
    if isinstance(r, RedisCluster):
        kw = {**r.nodes_manager.connection_kwargs, "socket_timeout": timeout_s,
              "socket_connect_timeout": timeout_s}
        for k in ("retry", "retry_on_error", "host", "port", "db"):
            kw.pop(k, None)
        return RedisCluster(startup_nodes=[ClusterNode(n.host, n.port) for n in r.get_nodes()],
                            retry=Retry(NoBackoff(), 0), cluster_error_retry_attempts=0, **kw)
    pool = r.connection_pool
    kw = {**pool.connection_kwargs, "socket_timeout": timeout_s,
          "socket_connect_timeout": timeout_s, "retry": Retry(NoBackoff(), 0)}
    kw.pop("retry_on_error", None)
    return redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=pool.connection_class, **kw))


# a URL's TLS files (redis-py's `rediss://` query parameters)
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")


def resolve_tls_files(url: str, base: Path | None = None) -> str:
    """`url` with its relative TLS file paths made absolute: against `base` (the folder of the
    URL file it came from) where the file is there, else against the working folder — so a
    host's URL file and its TLS files travel together, and a role started in another folder
    finds them.

    Raises:
        FileNotFoundError: a named file is in neither place (the message names the parameter
            and the paths tried, never the URL's password).
    """
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if not any(k in TLS_FILES for k, _ in query):
        return url
    out = []
    for key, value in query:
        if key in TLS_FILES and value:
            tried = [Path(value)] if os.path.isabs(value) else \
                [*([base / value] if base is not None else []), Path.cwd() / value]
            found = next((p for p in tried if p.exists()), None)
            if found is None:
                raise FileNotFoundError(f"the Redis URL's {key} names {value}, which is not at "
                                        f"{' nor '.join(str(p) for p in tried)}")
            value = str(found.resolve())
        out.append((key, value))
    return urllib.parse.urlunsplit(parts._replace(
        query=urllib.parse.urlencode(out, quote_via=urllib.parse.quote, safe="/")))


def connect(url: str, *, socket_timeout_s: float = 10.0, block_ms: int = 0,
            retries: int = 6) -> redis.Redis:
    """A binary-safe client for `url` with timeouts above `block_ms` and retries.

    Raises:
        ValueError: if the socket timeout does not exceed the blocking read time.
        FileNotFoundError: a TLS file the URL names does not exist (`resolve_tls_files`).
    """
    url = resolve_tls_files(url)
    if socket_timeout_s * 1000 <= block_ms + 500:
        raise ValueError(f"broker.socket_timeout_s ({socket_timeout_s} s) must exceed "
                         f"broker.block_ms ({block_ms} ms) by at least 0.5 s")
    common = {"socket_timeout": socket_timeout_s,
              "socket_connect_timeout": min(5.0, socket_timeout_s), "decode_responses": False,
              **({"command_packer": _PACKER} if _PACKER is not None else {})}
    client = redis.Redis.from_url(
        url, retry=_retry(retries), retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30, **common)
    if not is_cluster(client):
        return client
    client.close()
    # any node's URL: the client reads the slot map from it and follows MOVED/ASK, and after
    # a failover re-reads it (retrying with backoff while the slots move)
    return RedisCluster.from_url(url, retry=_retry(retries), **common)


def value_limits(r: redis.Redis | RedisCluster, max_payload_bytes: int,
                 piece_bytes: int = 64 * 2**20) -> Limits:
    """The limits a single value meets on its way through this Redis: the server's
    ``proto-max-bulk-len`` where this user may read it (``CONFIG GET``), else Redis's default,
    said so in the refusal (`pipeline.capacity.check`).

    Raises:
        redis.ConnectionError, redis.TimeoutError: the server is not reachable.
    """
    try:
        got = r.config_get("proto-max-bulk-len")
        # a cluster's fragments spread over its masters: one node's maxmemory says too little
        mem = {} if isinstance(r, RedisCluster) else r.config_get("maxmemory")
        if isinstance(r, RedisCluster):  # {node: {name: value}} or merged, by version
            got = next(iter(got.values())) if got and isinstance(
                next(iter(got.values())), dict) else got
        value = int(got["proto-max-bulk-len"])
        return Limits(max_payload_bytes, value, "Redis's proto-max-bulk-len", piece_bytes,
                      int(mem.get("maxmemory", 0)))
    except (redis.exceptions.NoPermissionError, redis.ResponseError, ClusterError,
            RedisClusterException, KeyError, TypeError, ValueError, StopIteration):
        return Limits(max_payload_bytes, REDIS_BULK_DEFAULT,
                      "Redis's default proto-max-bulk-len (CONFIG GET not allowed here)",
                      piece_bytes)


def is_cluster(r: redis.Redis) -> bool:
    """Whether `r`'s server is a Redis Cluster node (``CLUSTER INFO`` answers; a standalone
    server says cluster support is disabled; a user without the right to ask is taken for a
    standalone server's).

    Raises:
        redis.ConnectionError, redis.TimeoutError: the server is not reachable.
    """
    try:
        r.execute_command("CLUSTER", "INFO")
        return True
    except redis.exceptions.NoPermissionError:
        return False
    except redis.ResponseError as e:
        if "cluster support disabled" in str(e).lower():
            return False
        raise
