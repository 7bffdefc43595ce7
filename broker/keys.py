"""Every Redis key of a run. Nothing else in the code base spells a key name.

Run-wide keys (prefix ``ddl:<run>``):

====================================  ========  ==============================================
key                                   type      contents
====================================  ========  ==============================================
``ddl:<run>:config``                  hash      ``toml`` (the run configuration), ``hash``
                                                (its run hash), ``created`` (unix time)
``ddl:<run>:learners``                hash      learner id → JSON of its last heartbeat (step,
                                                tokens, tokens/s, step time, versions, bytes)
``ddl:<run>:hb:<learner>``            string    ``1`` with a TTL: the learner is live while set
``ddl:<run>:syncers``                 hash      syncer id → JSON (PUB endpoint, fragments,
                                                rounds, last reason, heartbeat time)
``ddl:<run>:events``                  stream    join, leave, rejoin, timeout, fault, done …
``ddl:<run>:done``                    hash      learner id → JSON of its final report
``ddl:<run>:stop``                    string    set to stop every process at once
``ddl:<run>:finish``                  string    set to end training early: learners stop
                                                stepping and take part in the final flush
====================================  ========  ==============================================

Per-fragment keys share the Redis Cluster hash tag ``{<run>/fNNNN}`` so that one round commits
in a single MULTI/EXEC, and fragments spread over cluster nodes:

====================================  ========  ==============================================
``ddl:{<run>/fNNNN}:frags``           stream    one entry per push (fields ``learner``,
                                                ``fragment``, ``base_version``, ``step``,
                                                ``steps``, ``tokens``, ``codec``, ``nbytes``,
                                                ``sha256``, ``seconds``, ``final``, binary
                                                ``payload``); consumer group ``syncers``
``ddl:{<run>/fNNNN}:state``           string    msgpack syncer state (Θ fp32, momentum,
                                                version, recent dedupe keys, grace estimator)
``ddl:{<run>/fNNNN}:global``          string    snapshot of the latest published value
``ddl:{<run>/fNNNN}:sent:<version>``  string    snapshot of a recent version (anchors stale
                                                contributions; the last max_staleness+1 kept)
``ddl:{<run>/fNNNN}:rounds``          stream    one record per closed round
``ddl:{<run>/fNNNN}:dlq``             stream    entries that failed validation, with reason
``ddl:{<run>/fNNNN}:lease``           string    id of the syncer that owns the fragment (PX)
====================================  ========  ==============================================
"""

from __future__ import annotations

GROUP = "syncers"
PREFIX = "ddl"


class RunKeys:
    """Key names of one run."""

    def __init__(self, run: str):
        if not run or any(c in run for c in "{}: \t\n"):
            raise ValueError(f"run name {run!r}: use letters, digits, '-', '_' or '.'")
        self.run = run
        base = f"{PREFIX}:{run}"
        self.config = f"{base}:config"
        self.learners = f"{base}:learners"
        self.syncers = f"{base}:syncers"
        self.events = f"{base}:events"
        self.done = f"{base}:done"
        self.stop = f"{base}:stop"
        self.finish = f"{base}:finish"
        self._hb = f"{base}:hb:"

    def heartbeat(self, learner: str) -> str:
        return self._hb + learner

    def heartbeat_pattern(self) -> str:
        return self._hb + "*"

    def learner_of_heartbeat(self, key: str) -> str:
        return key[len(self._hb):]

    def fragment(self, p: int) -> FragmentKeys:
        return FragmentKeys(self.run, p)


class FragmentKeys:
    """Key names of one fragment (all in one cluster hash slot)."""

    def __init__(self, run: str, p: int):
        tag = f"{PREFIX}:{{{run}/f{p:04d}}}"
        self.fragment = p
        self.frags = f"{tag}:frags"
        self.state = f"{tag}:state"
        self.global_ = f"{tag}:global"
        self.rounds = f"{tag}:rounds"
        self.dlq = f"{tag}:dlq"
        self.lease = f"{tag}:lease"
        self._sent = f"{tag}:sent:"

    def sent(self, version: int) -> str:
        return f"{self._sent}{version}"
