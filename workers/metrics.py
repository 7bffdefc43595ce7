"""Prometheus text endpoints of the learner and the syncer (off unless a port is given), with
health probes for schedulers.

Values are read from the process's own counters at scrape time (a custom collector), so there
is no second set of books to keep in step. The counters are the ones the chaos accounting uses.
The same port answers ``/healthz`` (liveness: the process's main loop is making progress) and
``/readyz`` (readiness: it has joined the run) with 200 ``ok`` or 503 and the reason, from the
process's own state — what a Kubernetes probe or a load balancer asks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# name → (type, help, getter returning a number or {label value: number})
Spec = dict[str, tuple[str, str, Callable[[], float | dict[str, float]]]]


class _Collector:
    def __init__(self, prefix: str, label: str, spec: Spec):
        self.prefix, self.label, self.spec = prefix, label, spec

    def collect(self) -> Iterable:
        for name, (kind, help_, get) in self.spec.items():
            value = get()
            full = f"{self.prefix}_{name}"
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            if isinstance(value, dict):
                fam = cls(full, help_, labels=[self.label])
                for k, v in value.items():
                    fam.add_metric([str(k)], float(v))
            else:
                fam = cls(full, help_, value=float(value))
            yield fam


# a probe: None when healthy, else why not
Probe = Callable[[], "str | None"]


def serve(port: int, prefix: str, spec: Spec, label: str = "fragment",
          addr: str = "127.0.0.1", live: Probe | None = None,
          ready: Probe | None = None) -> CollectorRegistry:
    """Start the HTTP endpoint on `port` (a daemon thread) and return its registry:
    ``/metrics`` (Prometheus text), ``/healthz`` (`live`) and ``/readyz`` (`ready`)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(prefix, label, spec))
    probes = {"/healthz": live, "/readyz": ready}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            path = self.path.split("?", 1)[0]
            if path in probes:
                probe = probes[path]
                try:
                    why = probe() if probe is not None else None
                except Exception as e:  # noqa: BLE001 - a failing probe is a failed probe
                    why = f"probe failed: {type(e).__name__}"
                self._reply(503 if why else 200, "text/plain; charset=utf-8",
                            (why or "ok").encode() + b"\n")
            elif path in ("/metrics", "/"):
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(reg))
            else:
                self._reply(404, "text/plain; charset=utf-8", b"not found\n")

        def _reply(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes and probes are not log lines
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=f"metrics-{port}", daemon=True).start()
    return reg


def stalled(last_tick: Callable[[], float], limit_s: Callable[[], float], what: str) -> Probe:
    """A liveness probe: unhealthy when `last_tick()` (a time.monotonic value) is older than
    `limit_s()` seconds."""
    def probe() -> str | None:
        idle = time.monotonic() - last_tick()
        limit = limit_s()
        return f"{what} made no progress for {idle:.0f} s (limit {limit:.0f} s)" \
            if idle > limit else None
    return probe


def learner_spec(learner) -> Spec:
    s = learner.net.stats
    return {
        "steps": ("counter", "inner steps done", lambda: learner.step),
        "tokens": ("counter", "tokens trained on", lambda: learner.tokens_done),
        "pushes_attempted": ("counter", "pushes handed to the network thread",
                             lambda: s.pushes_attempted),
        "pushes_acked": ("counter", "pushes Redis acknowledged (XADD returned)",
                         lambda: s.pushes_acked),
        "repushed": ("counter", "pushes re-sent after Redis lost them", lambda: s.repushed),
        "bytes_sent": ("counter", "stream entry bytes sent", lambda: s.bytes_sent),
        "bytes_received": ("counter", "ZeroMQ and snapshot bytes received",
                           lambda: learner.net.bytes_received),
        "snapshots_read": ("counter", "snapshot repairs from Redis", lambda: s.snapshots_read),
        "zmq_gaps": ("counter", "merged values missed on ZeroMQ (version gaps)",
                     lambda: s.zmq_gaps),
        "redis_down_seconds": ("counter", "time Redis was unreachable", lambda: s.redis_down_s),
        "step_seconds": ("gauge", "recent inner step time", lambda: learner.step_s),
        "fragment_version": ("gauge", "version of each fragment's base", lambda: dict(
            enumerate(learner.core.base_version if learner.core is not None else []))),
    }


def syncer_spec(syncer) -> Spec:
    return {
        "rounds": ("counter", "rounds committed", lambda: syncer.stats.rounds),
        "merged": ("counter", "contributions merged", lambda: syncer.stats.merged),
        "dropped": ("counter", "contributions refused (stale, duplicate, invalid)",
                    lambda: syncer.stats.dropped),
        "duplicated": ("counter", "duplicate pushes recognised", lambda: syncer.stats.duplicated),
        "dead_lettered": ("counter", "entries moved to a dead-letter stream",
                          lambda: syncer.stats.dead_lettered),
        "fenced": ("counter", "entries of a superseded learner process (dead-lettered)",
                   lambda: syncer.stats.fenced),
        "lost": ("counter", "pending entries deleted before merging", lambda: syncer.stats.lost),
        "quorum_wait_seconds": ("gauge", "last round: first arrival to quorum",
                                lambda: syncer.stats.quorum_wait_s),
        "grace_wait_seconds": ("gauge", "last round: quorum to close",
                               lambda: syncer.stats.grace_wait_s),
        "live_learners": ("gauge", "learners with a fresh heartbeat", lambda: len(syncer.live)),
        "fragment_version": ("gauge", "global version of each owned fragment",
                             lambda: {p: f.core.version for p, f in syncer.frags.items()}),
    }
