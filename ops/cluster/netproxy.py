"""A TCP proxy the chaos harness puts between a learner and Redis (or a syncer's PUB socket),
so a test can cut one learner off the network and heal it again, on any machine."""

from __future__ import annotations

import selectors
import socket
import threading


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to `target` until `cut()`; `heal()` lets traffic through again.

    While cut, existing connections are closed and new ones are accepted and held silently
    (a black hole: clients see timeouts, as across a real partition).
    """

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cut = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            for s in list(self._pairs):
                self._close(s)

    def heal(self) -> None:
        with self._lock:
            self._cut = False
            for s in self._held:
                s.close()
            self._held.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with self._lock:
            for s in list(self._pairs):
                self._close(s)
            for s in self._held:
                s.close()
        self._listener.close()

    def _close(self, s: socket.socket) -> None:
        peer = self._pairs.pop(s, None)
        for x in (s, peer):
            if x is None:
                continue
            try:
                self._sel.unregister(x)
            except (KeyError, ValueError):
                pass
            x.close()
        if peer is not None:
            self._pairs.pop(peer, None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.05):
                with self._lock:
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj in self._pairs:
                        self._pump(key.fileobj)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._cut:
            self._held.append(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=2)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pairs[client], self._pairs[upstream] = upstream, client
        self._sel.register(client, selectors.EVENT_READ, None)
        self._sel.register(upstream, selectors.EVENT_READ, None)

    def _pump(self, src: socket.socket) -> None:
        dst = self._pairs[src]
        try:
            data = src.recv(1 << 16)
            if not data:
                raise ConnectionError("closed")
            dst.setblocking(True)
            dst.sendall(data)
            dst.setblocking(False)
        except OSError:
            self._close(src)
