"""A user-space Ethernet bridge that delays every frame: the lab's round-trip time.

The kernel of the development machine (and CI's) has no ``netem``, so ``tc`` can limit a link's
rate but not delay it. This process runs in the lab's router namespace, holds an ``AF_PACKET``
socket on each of the router's ports (one veth per site and one to the hub) and forwards every
frame between them — a learning bridge — after a delay: a frame from port a to port b leaves
``delay[a] + delay[b]`` seconds after it arrived, where a site's delay is half its round-trip
time to the hub (the hub's is 0). Every protocol is delayed alike: Redis, ZeroMQ, the data
parallel peers' gloo connections, ARP.

Frames are read and written with ``PACKET_VNET_HDR``, so a segmentation-offloaded frame would
cross whole with its offload header; the lab turns offloads off on its interfaces (so that
counters and shaping see wire-size frames), and the forwarder then moves MTU-size frames —
tens of thousands a second in Python, ample for shaped links of a few to a few hundred
Mbit/s, but a CPU cost (and a cap) for a site with a round-trip time and no rate limit. Rate
shaping stays in the kernel (``tbf`` on each veth's egress), after the delay on the way down
and before it on the way up.

Run as ``python ops/lab/forwarder.py PORT:DELAY_MS ...`` inside the router namespace; it prints
``ready`` once every port is bound and runs until SIGTERM.
"""

from __future__ import annotations

import heapq
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
VNET_HDR = 10  # struct virtio_net_hdr
FRAME_MAX = 65536 + VNET_HDR + 64
BROADCAST = 0x01  # the group bit of the first byte of a destination MAC


class Bridge:
    """Learning bridge with per-port delay; `ports` maps an interface to its delay in seconds."""

    def __init__(self, ports: dict[str, float]):
        self.delay = dict(ports)
        self.socks: dict[str, socket.socket] = {}
        for name in ports:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            s.bind((name, 0))
            s.setblocking(False)
            self.socks[name] = s
        self.by_fd = {s.fileno(): n for n, s in self.socks.items()}
        self.macs: dict[bytes, str] = {}  # learnt: source MAC -> port
        self.queue: list[tuple[float, int, str, bytes]] = []
        self.seq = 0
        self.forwarded = 0
        self.dropped = 0
        self.buf = bytearray(FRAME_MAX)

    def _receive(self, port: str) -> None:
        s = self.socks[port]
        now = time.monotonic()
        for _ in range(256):  # drain, but let the other ports and the queue have a turn
            try:
                n, addr = s.recvfrom_into(self.buf)
            except BlockingIOError:
                return
            except OSError:  # the port is down (a partition): nothing to read
                return
            if addr[2] == PACKET_OUTGOING or n < VNET_HDR + 14:
                continue
            frame = bytes(self.buf[:n])
            dst, src = frame[VNET_HDR:VNET_HDR + 6], frame[VNET_HDR + 6:VNET_HDR + 12]
            self.macs[src] = port
            out = self.macs.get(dst) if not dst[0] & BROADCAST else None
            targets = [out] if out is not None else [p for p in self.socks if p != port]
            for t in targets:
                if t == port:
                    continue
                due = now + self.delay[port] + self.delay[t]
                if due <= now:
                    self._send(t, frame)
                else:
                    self.seq += 1
                    heapq.heappush(self.queue, (due, self.seq, t, frame))

    def _send(self, port: str, frame: bytes) -> None:
        try:
            self.socks[port].send(frame)
            self.forwarded += 1
        except OSError:  # a full egress queue (tbf) or a port that is down: the frame is lost,
            self.dropped += 1  # as on a router; TCP resends it

    def run(self, stop: list[bool]) -> None:
        poll = select.poll()
        for s in self.socks.values():
            poll.register(s.fileno(), select.POLLIN)
        while not stop[0]:
            now = time.monotonic()
            while self.queue and self.queue[0][0] <= now:
                _, _, port, frame = heapq.heappop(self.queue)
                self._send(port, frame)
            wait_ms = 200 if not self.queue else max(0, (self.queue[0][0] - now) * 1000)
            for fd, _ in poll.poll(wait_ms):
                self._receive(self.by_fd[fd])


def main(argv: list[str] | None = None) -> int:
    ports = {}
    for arg in argv if argv is not None else sys.argv[1:]:
        name, _, ms = arg.partition(":")
        ports[name] = float(ms or 0) / 1000.0
    stop = [False]

    def _stop(*_):
        stop[0] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    bridge = Bridge(ports)
    print("ready", flush=True)
    bridge.run(stop)
    print(f"forwarded {bridge.forwarded} dropped {bridge.dropped}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
