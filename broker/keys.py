"""Every Redis key of a run. Nothing else in the code base spells a key name.

A run name is 1–64 characters of letters, digits, ``.``, ``_`` and ``-``, starting with a letter
or digit (no glob characters, braces, colons or spaces: names are safe in key patterns, hash
tags, file names and shell commands). Every key starts with ``ddl:{<run>`` — a Redis Cluster
hash tag. The run-wide keys share the tag ``{<run>}``, so they live in one cluster slot; each
fragment's keys share ``{<run>/fNNNN}``, so one round commits in a single MULTI/EXEC and
fragments spread over the cluster's nodes.

Run-wide keys:

====================================  ========  ==============================================
key                                   type      contents
====================================  ========  ==============================================
``ddl:{<run>}:config``                hash      ``toml`` (the run configuration), ``hash``
                                                (its run hash), ``created`` (unix time),
                                                ``params`` (user tasks: JSON parameter spec,
                                                names/shapes/dtypes/embeddings)
``ddl:{<run>}:learners``              hash      learner id → JSON of its last heartbeat (step,
                                                tokens, tokens/s, step time, versions, loss,
                                                bytes): ``broker.records.Heartbeat``
``ddl:{<run>}:hb:<learner>``          string    ``1`` with a TTL: the learner is live while set
``ddl:{<run>}:epoch:<learner>``       string    the learner id's epoch: incremented by every
                                                process that joins as that learner; pushes
                                                carry it, and a push of an older epoch is
                                                fenced (``broker.registry.claim_epoch``)
``ddl:{<run>}:epochsig:<learner>``    hash      epoch → the claim of that epoch signed
                                                with the learner's key (signed runs), and
                                                ``latest`` → ``<epoch>:<signature>``
``ddl:{<run>}:syncers``               hash      syncer id → JSON (PUB endpoint, fragments,
                                                rounds, last reason, heartbeat time)
``ddl:{<run>}:members``               set       ids of the syncers that share the fragments
``ddl:{<run>}:member:<syncer>``       string    ``1`` with a TTL (``broker.lease_ms``): the
                                                syncer is a member while set
``ddl:{<run>}:events``                stream    join, leave, rejoin, timeout, fault, done …
``ddl:{<run>}:done``                  hash      end-of-run reports (``broker.registry``):
                                                ``<learner>``, ``final:<learner>``,
                                                ``syncer:<syncer>``
``ddl:{<run>}:refused``               hash      ``<learner>:<fragment>`` → JSON of the last
                                                push of that learner and fragment the syncer
                                                refused (``broker.records.Refusal``)
``ddl:{<run>}:stop``                  string    set to stop every process at once
``ddl:{<run>}:finish``                string    set to end training early: learners stop
                                                stepping and take part in the final flush
====================================  ========  ==============================================

Per-fragment keys:

====================================  ========  ==============================================
``ddl:{<run>/fNNNN}:frags``           stream    one entry per push (fields ``learner``,
                                                ``fragment``, ``base_version``, ``step``,
                                                ``steps``, ``tokens``, ``codec``, ``nbytes``,
                                                ``sha256``, binary ``payload``, ``seconds``,
                                                ``final``); consumer group ``syncers``
``ddl:{<run>/fNNNN}:state``           string    the checkpoint: msgpack syncer state (Θ fp32,
                                                momentum, version, recent dedupe keys, grace
                                                estimator), written every
                                                ``broker.checkpoint_rounds`` rounds; the rounds
                                                since are replayed from ``:rounds``
``ddl:{<run>/fNNNN}:global``          string    snapshot of the latest published value
``<key>:staging:<token>``             hash      the pieces of a new value of ``:state``,
                                                ``:global`` or ``:sent:<v>``, before its
                                                commit renames it over that key (expires)
``ddl:{<run>/fNNNN}:sent:<version>``  string    snapshot of a recent version (anchors stale
                                                contributions; kept from max_staleness versions
                                                before the older of the version and the
                                                checkpoint); under the delta down link the
                                                delta as sent, but the oldest kept: whole
                                                (made so before the checkpoint that makes it
                                                the oldest, and by a re-commit)
``ddl:{<run>/fNNNN}:rounds``          stream    one record per closed round
                                                (``broker.records.RoundRecord``)
``ddl:{<run>/fNNNN}:merged``          hash      ``<learner>`` → JSON of that learner's last
                                                push to the fragment a round merged
                                                (``broker.records.Merged``), written in the
                                                round's commit
``ddl:{<run>/fNNNN}:dlq``             stream    entries that failed validation, with reason
``ddl:{<run>/fNNNN}:lease``           string    id of the syncer that owns the fragment (PX)
====================================  ========  ==============================================

``:state``, ``:global`` and ``:sent:<v>`` are strings, or hashes of pieces when larger than
``broker.piece_bytes`` (field ``m``: the manifest; ``0`` … ``n-1``: the pieces;
`broker.pieces`).

Runs stored by versions before these names (run-wide keys ``ddl:<run>:…`` without a hash tag)
are recognised by :attr:`RunKeys.legacy_config` and refused with a message that says so.
"""

from __future__ import annotations

import re

GROUP = "syncers"
PREFIX = "ddl"
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def staging(key: str, token: str) -> str:
    """Where the pieces of a new value of `key` wait for their commit (`broker.pieces`): in
    `key`'s hash slot."""
    return f"{key}:staging:{token}"


def check_run_name(run: str) -> str:
    """`run` if it is a valid run name.

    Raises:
        ValueError: With a message naming the allowed alphabet.
    """
    if not isinstance(run, str) or not RUN_NAME.fullmatch(run):
        raise ValueError(f"run name {run!r}: use 1 to 64 letters, digits, '.', '_' or '-', "
                         f"starting with a letter or digit")
    return run


class RunKeys:
    """Key names of one run."""

    def __init__(self, run: str):
        self.run = check_run_name(run)
        base = f"{PREFIX}:{{{run}}}"
        self.config = f"{base}:config"
        self.learners = f"{base}:learners"
        self.syncers = f"{base}:syncers"
        self.members = f"{base}:members"
        self.events = f"{base}:events"
        self.done = f"{base}:done"
        self.refused = f"{base}:refused"
        self.stop = f"{base}:stop"
        self.finish = f"{base}:finish"
        self._hb = f"{base}:hb:"
        self._epoch = f"{base}:epoch:"
        self._epochsig = f"{base}:epochsig:"
        self._member = f"{base}:member:"
        # where versions before the final key names kept the configuration
        self.legacy_config = f"{PREFIX}:{run}:config"

    def heartbeat(self, learner: str) -> str:
        return self._hb + learner

    def epoch(self, learner: str) -> str:
        return f"{self._epoch}{learner}"

    def epoch_sig(self, learner: str) -> str:
        return f"{self._epochsig}{learner}"

    def member(self, syncer: str) -> str:
        return self._member + syncer

    def fragment(self, p: int) -> FragmentKeys:
        return FragmentKeys(self.run, p)

    @staticmethod
    def config_pattern() -> str:
        """A SCAN/KEYS pattern matching the configuration key of every run."""
        return f"{PREFIX}:{{*}}:config"

    @staticmethod
    def run_of_config(key: bytes | str) -> str:
        """The run name of a key matched by :meth:`config_pattern`."""
        key = key.decode() if isinstance(key, bytes) else key
        return key[len(PREFIX) + 2:-len("}:config")]


class FragmentKeys:
    """Key names of one fragment (all in one cluster hash slot)."""

    def __init__(self, run: str, p: int):
        tag = f"{PREFIX}:{{{run}/f{p:04d}}}"
        self.run = run
        self.fragment = p
        self.frags = f"{tag}:frags"
        self.state = f"{tag}:state"
        self.global_ = f"{tag}:global"
        self.rounds = f"{tag}:rounds"
        self.dlq = f"{tag}:dlq"
        self.merged = f"{tag}:merged"
        self.lease = f"{tag}:lease"
        self._sent = f"{tag}:sent:"

    def sent(self, version: int) -> str:
        return f"{self._sent}{version}"
