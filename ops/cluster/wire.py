"""Byte counts of the real wire codec, injected into the in-process engine."""

from __future__ import annotations

from broker import codec
from broker.entries import entry_fields
from pipeline.engine import WireSizes
from pipeline.learner import Push
from pipeline.syncer import RoundResult


def _push_bytes(push: Push) -> int:
    fields = entry_fields(push, push.payload, next(iter(push.payload.values())).codec)
    return sum(len(str(k)) + (len(v) if isinstance(v, bytes | str) else len(str(v)))
               for k, v in fields.items())


def _publish_bytes(r: RoundResult, run: str = "run") -> int:
    frames = codec.global_frames(run, r.fragment, r.version, r.sent, base=r.sent_base,
                                 value=r.sent_hash if r.sent_base >= 0 else "")
    return sum(len(memoryview(f).cast("B")) for f in frames)


def codec_sizes() -> WireSizes:
    """WireSizes that count exactly what the Redis entry and the ZeroMQ message carry."""
    return WireSizes(push=_push_bytes, publish=_publish_bytes)
