"""The answers to a learner core's questions (`pipeline.learner_questions`) from Redis: was a
push in flight merged though its value never came (a missed message)? Asked by the training
thread when a fragment's next push is due and its last one is still in flight; read on the
network thread (`serve`, with a fail-fast client) and handed back through the inbox (`Answer`),
so the training thread never waits on Redis."""

from __future__ import annotations

import logging
import queue
from typing import NamedTuple

import numpy as np
import redis

from broker import attest, codec, pieces, registry
from broker.connection import OUTAGE, quick
from broker.errors import DecodeError
from pipeline.learner_questions import DEFER, Found
from workers.common import RunContext, decode_values
from workers.learner_net import LearnerNet

log = logging.getLogger("diloco.learner")


class Answer(NamedTuple):
    """`MergeQuestions.answer`'s arguments, as the network thread puts them in the inbox."""

    fragment: int
    key: tuple[int, int]
    found: Found


class MergedLookup:
    """The answers for one learner (see module docstring): `ask` on the training thread,
    `serve` on the network thread."""

    def __init__(self, ctx: RunContext, learner_id: str, net: LearnerNet):
        self.ctx, self.id, self.net = ctx, learner_id, net
        self._quick: redis.Redis | None = None  # fail-fast reads
        self.questions: queue.Queue[tuple[int, tuple[int, int]]] = queue.Queue()
        net.serve_lookups = self.serve

    def ask(self, p: int, key: tuple[int, int]) -> None:
        """Was fragment p's push `key` (base version, step) merged? Answered by `serve`."""
        self.questions.put((p, key))

    def serve(self) -> None:
        """Answer the oldest question asked (the network thread's loop runs this, one answer
        per pass: a snapshot read each must not hold up heartbeats, pushes and messages)."""
        try:
            p, key = self.questions.get_nowait()
        except queue.Empty:
            return
        self.net.inbox.put(Answer(p, key, self.lookup(p, key)))

    def close(self) -> None:
        if self._quick is not None:
            self._quick.close()

    def lookup(self, p: int, key: tuple[int, int]) -> Found:
        """Was fragment p's push `key` merged, though its value never came? Then that
        version's value (or the latest, if Redis no longer keeps it) from its snapshot, for
        `LearnerCore.rebase_merged`; None when it was not; `DEFER` when Redis cannot say now
        (unreachable: the training loop must not wait on it, and pushing everything again
        could repeat merged progress)."""
        if self.net.redis_down:
            return DEFER
        fk = self.ctx.keys.fragment(p)
        try:
            if self._quick is None:  # a cluster client reads the slot map when it is built
                self._quick = quick(self.ctx.r)
            r = self._quick
            rec = registry.merged(r, self.ctx.keys, self.id, p)
            if rec is None or (rec.base_version, rec.step) != key:
                return None
            limit = self.ctx.cfg.broker.max_payload_bytes
            # with CURVE the latest value (the syncers attest the latest ones)
            blob = None if self.net.attested.required else pieces.read(
                r, fk.sent(rec.version), max_bytes=limit, what="snapshot")
            header, tensors = (None, {}) if blob is None else codec.unpack_snapshot(
                blob, max_bytes=limit, delta_ok=True)
            if header is None or header.base >= 0:
                # gone, kept as the delta sent, or not read: the latest value (whole) holds
                # the push too
                blob = pieces.read(r, fk.global_, max_bytes=limit, what="snapshot")
                if blob is None:
                    return None
                header, tensors = codec.unpack_snapshot(blob, max_bytes=limit)
        except (redis.RedisError, *OUTAGE) as e:
            log.warning("%s: could not check whether push %d of fragment %d was merged (%s); "
                        "pushing at the fragment's next turn", self.id, key[1], p, e)
            return DEFER
        except DecodeError as e:
            log.warning("%s: could not check whether push %d of fragment %d was merged (%s); "
                        "pushing all its progress again", self.id, key[1], p, e)
            return None
        verdict = self.net.attested.snapshot(p, header)
        if verdict != attest.OK:  # with CURVE: not attested (yet), or forged: asked again
            log.warning("%s: could not check whether push %d of fragment %d was merged (%s); "
                        "pushing at the fragment's next turn", self.id, key[1], p,
                        attest.refusal(header.version) if verdict == attest.FORGED
                        else "its snapshot not attested yet")
            return DEFER
        problem = self.net.check_value(header, tensors)
        if problem or header.fragment != p or header.version < rec.version:
            log.warning("%s: the snapshot of fragment %d is not usable (%s); pushing all "
                        "the progress again", self.id, p, problem or "an older version")
            return None
        values = decode_values(tensors)
        if not all(np.isfinite(v).all() for v in values.values()):
            log.warning("%s: non-finite values in the snapshot of fragment %d", self.id, p)
            return None
        log.info("%s: push %d of fragment %d was merged into v%d, whose value never came: "
                 "the learner rebases onto v%d and pushes only the progress since", self.id,
                 key[1], p, rec.version, header.version)
        return header.version, values
