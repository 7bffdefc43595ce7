"""Prometheus text endpoints of the learner and the syncer (off unless a port is given).

Values are read from the process's own counters at scrape time (a custom collector), so there
is no second set of books to keep in step. The counters are the ones the chaos accounting uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
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


def serve(port: int, prefix: str, spec: Spec, label: str = "fragment",
          addr: str = "127.0.0.1") -> CollectorRegistry:
    """Start the HTTP endpoint on `port` (a daemon thread) and return its registry."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(prefix, label, spec))
    start_http_server(port, addr=addr, registry=reg)
    return reg


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
        "lost": ("counter", "pending entries deleted before merging", lambda: syncer.stats.lost),
        "quorum_wait_seconds": ("gauge", "last round: first arrival to quorum",
                                lambda: syncer.stats.quorum_wait_s),
        "grace_wait_seconds": ("gauge", "last round: quorum to close",
                               lambda: syncer.stats.grace_wait_s),
        "live_learners": ("gauge", "learners with a fresh heartbeat", lambda: len(syncer.live)),
        "fragment_version": ("gauge", "global version of each owned fragment",
                             lambda: {p: f.core.version for p, f in syncer.frags.items()}),
    }
