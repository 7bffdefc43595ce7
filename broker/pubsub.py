"""ZeroMQ PUB/SUB of merged fragment values.

One PUB socket per syncer process, one SUB per learner; the topic is the fragment (fixed width,
so a prefix subscription never matches another fragment) and the version is the sequence
number. High-water marks are small: a slow subscriber loses messages instead of stalling the
syncer, and repairs from the Redis snapshot (the "Clone" pattern: subscribe first, then read
the snapshot, drop any update whose version is not newer). Tensor buffers travel as separate
frames without copies. Nothing is ever unpickled.

With CURVE (`CurveServer`, `CurveClient`), the PUB socket is a CURVE server with the run's
syncer key pair (shared by every syncer of the run, so syncers can be added without telling
the learners) and a ZAP handler that admits only the learner public keys in an allowlist
folder; each learner is a CURVE client with its own key pair that pins the syncers' public
key, so a PUB socket without the syncers' secret key cannot complete the handshake — rewriting
the endpoint hash in Redis cannot feed it values — and nobody else can read the values.
Keys are pyzmq's certificate files (`zmq.auth`): ``NAME.key`` (public) and
``NAME.key_secret`` (both keys; keep it mode 600). `diloco keys` makes them.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from broker import attest, codec
from broker.errors import DecodeError

log = logging.getLogger("diloco.pubsub")
REFUSED_LOG_EVERY_S = 60.0  # a refused client key is logged at most this often


def key_fingerprint(public_z85: bytes | str) -> str:
    """A short, stable name of a CURVE public key (z85 text) for logs: the first 16 hex digits
    of its SHA-256 (the key itself is public, but 40 characters of z85 are hard to compare)."""
    raw = public_z85.encode() if isinstance(public_z85, str) else bytes(public_z85)
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:16]


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, with every refused CURVE client key logged at warning (its
    fingerprint and the reason; each key at most once every `REFUSED_LOG_EVERY_S`, with the
    count of refusals since): a learner started with keys not on the allowlist is visible on
    the syncer's side, not only as silence on its own."""

    def __init__(self, ctx: zmq.Context):
        super().__init__(ctx, log=logging.getLogger("diloco.zap"))
        self._refused: dict[bytes, list[float]] = {}  # key -> [last logged at, refusals since]

    def _authenticate_curve(self, domain, client_key):
        result = super()._authenticate_curve(domain, client_key)
        if inspect.isawaitable(result):  # pyzmq 25+: a coroutine
            async def checked():
                allowed, reason = await result
                self._note(allowed, reason, client_key)
                return allowed, reason
            return checked()
        self._note(*result, client_key)
        return result

    def _note(self, allowed: bool, reason: bytes, client_key: bytes) -> None:
        if allowed:
            return
        now = time.monotonic()
        last, count = self._refused.get(client_key, [-REFUSED_LOG_EVERY_S, 0])
        count += 1
        if now - last >= REFUSED_LOG_EVERY_S:
            log.warning("refused a ZeroMQ client with CURVE key %s (%s; %d refusal(s) since "
                        "the last report): not in the allowlist of learner keys",
                        key_fingerprint(z85.encode(client_key)),
                        reason.decode(errors="replace"), count)
            self._refused[client_key] = [now, 0]
        else:
            self._refused[client_key] = [last, count]


def _secret_pair(path: str | Path) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(str(path))
    if not secret:
        raise ValueError(f"{path} holds no secret key (a .key_secret file is needed)")
    return public, secret


@dataclass(frozen=True)
class CurveServer:
    """The syncer side: its key pair file and the folder of allowed learner public keys."""

    secret_file: str
    allow_dir: str

    def allowed(self) -> int:
        """How many learner public keys the allowlist folder holds."""
        return len(zmq.auth.load_certificates(self.allow_dir))


@dataclass(frozen=True)
class CurveClient:
    """The learner side: its own key pair file and the syncers' public key file (pinned)."""

    secret_file: str
    server_key_file: str

    def server_key(self) -> bytes:
        return zmq.auth.load_certificate(self.server_key_file)[0]


CLOSE_LINGER_MS = 2000  # a closing PUB socket's time to send what it queued


class Publisher:
    """The syncer's PUB socket.

    Args:
        ctx: the process's zmq.Context.
        bind: where to bind, e.g. ``tcp://0.0.0.0:0`` (port 0: any free port).
        advertise_host: host name learners should connect to (defaults to the bound address,
            with 0.0.0.0 replaced by 127.0.0.1).
        hwm: send high-water mark (messages).
    """

    def __init__(self, ctx: zmq.Context, bind: str, advertise_host: str | None = None,
                 hwm: int = 16, curve: CurveServer | None = None):
        self.auth: _Authenticator | None = None
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            public, secret = _secret_pair(curve.secret_file)
            if not curve.allowed():
                raise ValueError(f"the CURVE allowlist {curve.allow_dir} holds no learner key")
            # the ZAP handler must run before a client can connect (one per zmq.Context: one
            # CURVE publisher per context)
            self.auth = _Authenticator(ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=curve.allow_dir)
            self.sock.curve_server = True
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
        if bind.startswith("tcp://") and bind.rsplit(":", 1)[-1] in ("0", "*"):
            host = bind[len("tcp://"):].rsplit(":", 1)[0]
            port = self.sock.bind_to_random_port(f"tcp://{host}")
            bound = f"tcp://{host}:{port}"
        else:
            self.sock.bind(bind)
            bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise_host and bound.startswith("tcp://"):
            self.endpoint = f"tcp://{advertise_host}:{bound.rsplit(':', 1)[1]}"
        else:
            self.endpoint = bound.replace("0.0.0.0", "127.0.0.1").replace("tcp://*", "tcp://127.0.0.1")
        self.sent_bytes = 0

    def publish(self, frames: Sequence[bytes | memoryview]) -> int:
        """Send one multipart message without copying; returns its size in bytes."""
        self.sock.send_multipart(frames, copy=False)
        n = sum(memoryview(f).nbytes for f in frames)
        self.sent_bytes += n
        return n

    def close(self) -> None:
        """Close the socket, sending what is still queued for up to `CLOSE_LINGER_MS`: the
        final values a syncer publishes just before it exits reach the learners. With no
        linger the socket's pipes end at once, and libzmq 4.3.5 asserts (aborting the process)
        when a peer's connection fails while a multipart message is half sent through such a
        pipe (`session_base_t::clean_pipes`; zeromq/libzmq#3442 reports it on the other end):
        seen in a syncer as ``Resource temporarily unavailable (src/session_base.cpp:233)``.
        A value still not sent after the linger is cut as before."""
        self.sock.close(linger=CLOSE_LINGER_MS)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None


# what a failed CURVE handshake means, by the event the client's socket reports (measured with
# libzmq 4.3: a pinned key that is not the syncers' fails with no detail, a learner key the
# syncer's ZAP handler refuses with an authentication failure)
_HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the syncer's key is not the one this learner pins "
                                          "(--curve-server-key {pinned})",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the syncer refused this learner's key {mine} (not on its "
                                     "allowlist, --curve-allow)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "a protocol error (code {value})",
}


class Subscriber:
    """A learner's SUB socket, subscribed to a set of fragments.

    With CURVE, a monitor on the socket reports each failed handshake: logged at warning
    (each endpoint at most once every `REFUSED_LOG_EVERY_S`, naming the keys by fingerprint)
    and kept in `handshake_failures` (endpoint → reason) until a handshake with it succeeds —
    a learner with the wrong key is visible, not silence falling back to Redis snapshots."""

    def __init__(self, ctx: zmq.Context, fragments: Sequence[int], hwm: int = 16,
                 max_bytes: int = codec.MAX_PAYLOAD_BYTES, curve: CurveClient | None = None):
        self.sock = ctx.socket(zmq.SUB)
        self.handshake_failures: dict[str, str] = {}
        self._monitor: zmq.Socket | None = None
        self._warned: dict[str, float] = {}
        if curve is not None:
            public, secret = _secret_pair(curve.secret_file)
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
            self.sock.curve_serverkey = curve.server_key()
            self._keys = {"mine": key_fingerprint(public),
                          "pinned": key_fingerprint(curve.server_key())}
            self._monitor = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | sum(_HANDSHAKE_FAILED))
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_bytes + 2**20)
        for p in fragments:
            self.sock.setsockopt(zmq.SUBSCRIBE, codec.topic(p))
        self.connected: set[str] = set()
        self.max_bytes = max_bytes
        self.received_bytes = 0
        self.decode_errors = 0
        self.last_error = ""
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)

    def connect(self, endpoints: Sequence[str]) -> None:
        for ep in endpoints:
            if ep not in self.connected:
                self.sock.connect(ep)
                self.connected.add(ep)

    def check_handshakes(self) -> None:
        """Read the socket monitor's events (never blocks): see the class docstring."""
        while self._monitor is not None:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            endpoint = ev["endpoint"].decode(errors="replace") \
                if isinstance(ev["endpoint"], bytes) else str(ev["endpoint"])
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake_failures.pop(endpoint, None)
                continue
            why = _HANDSHAKE_FAILED.get(ev["event"], "an unexpected event").format(
                value=int(ev["value"]), **self._keys)
            self.handshake_failures[endpoint] = why
            now = time.monotonic()
            if now - self._warned.get(endpoint, -REFUSED_LOG_EVERY_S) >= REFUSED_LOG_EVERY_S:
                self._warned[endpoint] = now
                log.warning("the CURVE handshake with the syncer at %s failed: %s; this learner "
                            "(key %s) receives no merged value from it over ZeroMQ and falls "
                            "back to Redis snapshots", endpoint, why, self._keys["mine"])

    def recv(self, timeout_ms: int
             ) -> tuple[codec.GlobalHeader, dict] | attest.Attestation | None:
        """One decoded message (a merged value, or a syncer's attestation: `broker.attest`), or
        None on timeout. Malformed messages are counted, skipped."""
        self.check_handshakes()
        if not self._poller.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        self.received_bytes += sum(len(f.buffer) for f in frames)
        try:
            return (attest.parse(frames)
                    or codec.parse_global_frames(frames, max_bytes=self.max_bytes))
        except DecodeError as e:
            self.decode_errors += 1
            self.last_error = str(e)[:500]
            return None

    def close(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self.sock.close(linger=0)
