"""ZeroMQ PUB/SUB of merged fragment values.

One PUB socket per syncer process, one SUB per learner; the topic is the fragment (fixed width,
so a prefix subscription never matches another fragment) and the version is the sequence
number. High-water marks are small: a slow subscriber loses messages instead of stalling the
syncer, and repairs from the Redis snapshot (the "Clone" pattern: subscribe first, then read
the snapshot, drop any update whose version is not newer). Tensor buffers travel as separate
frames without copies. Nothing is ever unpickled.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from broker import codec
from broker.errors import DecodeError


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
                 hwm: int = 16):
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.LINGER, 0)
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
        self.sock.close(linger=0)


class Subscriber:
    """A learner's SUB socket, subscribed to a set of fragments."""

    def __init__(self, ctx: zmq.Context, fragments: Sequence[int], hwm: int = 16,
                 max_bytes: int = codec.MAX_PAYLOAD_BYTES):
        self.sock = ctx.socket(zmq.SUB)
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

    def recv(self, timeout_ms: int) -> tuple[codec.GlobalHeader, dict] | None:
        """One decoded message, or None on timeout. Malformed messages are counted, skipped."""
        if not self._poller.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        self.received_bytes += sum(len(f.buffer) for f in frames)
        try:
            return codec.parse_global_frames(frames, max_bytes=self.max_bytes)
        except DecodeError as e:
            self.decode_errors += 1
            self.last_error = str(e)[:500]
            return None

    def close(self) -> None:
        self.sock.close(linger=0)
