"""`diloco replay`: rebuild every fragment's global values offline and verify them bit for bit.

For each fragment, replay starts from version 0 (the model initialisation of the stored run
configuration, restricted to the fragment's tensors; cross-checked against the ``sent:0``
snapshot while Redis still holds it) and walks the fragment's ``:rounds`` stream in order. For
each round record it fetches the entries the record says were merged (from the fragment stream,
or from the archive folder given with ``--archive``), decodes them, offers them to a fresh
:class:`pipeline.syncer.FragmentSyncer` in the recorded order, closes the round and compares:
the sha256 of the new down-link value with the recorded ``hash``, each entry's weight and
staleness, the round's version and token/step totals. Snapshots still in Redis (``sent:<v>``,
``global``) and the checkpointed ``state`` (fp32 Θ and outer momentum, written every
``broker.checkpoint_rounds`` rounds) are cross-checked too, the state when replay reaches its
version.

A fragment stops at its first divergence, which is reported with the round's inputs (entry ids,
learners, base versions, steps, tokens, weights, staleness, where each entry was read from).

Exit codes: 0 every requested round verified; 1 a divergence; 2 unusable input (no stored
configuration, merged entries neither in Redis nor in the archive — listed —, a malformed
record). The ``--json`` output is one object; its keys are documented in :func:`replay`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import redis

from broker import archive as archmod
from broker import codec, pieces
from broker.errors import BrokerError, DecodeError
from broker.ids import id_key
from broker.keys import FragmentKeys, RunKeys
from broker.records import RoundRecord
from broker.state import unpack_state
from pipeline import capacity
from pipeline import config as cfgmod
from pipeline.guard import fragment_prior
from pipeline.quant import QTensor, tensors_hash
from pipeline.syncer import FragmentSyncer
from workers.common import open_run
from workers.recovery import fetch_entries, iter_records, replay_round

EXIT_OK, EXIT_DIVERGED, EXIT_UNUSABLE = 0, 1, 2


class _Unusable(Exception):
    """Replay cannot continue for a reason that is not a divergence (malformed input)."""


def exit_code(report: dict) -> int:
    """1 if any fragment diverged, else 2 if any input was unusable, else 0."""
    frags = report["fragments"]
    if any(f["divergence"] is not None for f in frags):
        return EXIT_DIVERGED
    if report["error"] is not None or any(not f["verified"] for f in frags):
        return EXIT_UNUSABLE
    return EXIT_OK


def replay(redis_url: str, run_name: str, *, fragment: int | None = None,
           until: int | None = None, archive_dir: str | Path | None = None,
           task: str | None = None) -> dict:
    """Replay a run and return the report (the stable ``--json`` document).

    A run of a user task replays from the task's initial parameters: `task` must name it
    (`pipeline.task.task_of`).

    Keys: ``run``, ``config_hash``, ``until``, ``archive``, ``error`` (null or why nothing could
    be replayed), ``status`` ("verified", "diverged" or "incomplete"), ``ok`` (true iff
    verified), ``rounds_checked`` (total) and ``fragments``: one object per replayed fragment
    with ``fragment``, ``rounds`` (length of its rounds stream), ``rounds_checked``,
    ``last_version`` (last verified version, 0 if none), ``verified``, ``divergence`` (null or
    see :func:`_divergence`), ``missing_entries`` (merged entry ids found nowhere, sorted),
    ``entries_from`` (``{"redis": n, "archive": n}``), ``snapshots_checked`` (versions whose
    snapshot in Redis matched), ``state_checked`` (the checkpointed fp32 state matched at its
    version) and ``error`` (null or why the fragment could not be replayed).
    """
    report: dict[str, Any] = {"run": run_name, "config_hash": None, "until": until,
                              "archive": None if archive_dir is None else str(archive_dir),
                              "error": None, "fragments": []}
    try:
        # verifies the configuration's hash
        ctx = open_run(redis_url, run_name, wait_s=0, task=task, need_code=True)
        r, keys, cfg, frags = ctx.r, ctx.keys, ctx.cfg, ctx.fragments
        report["config_hash"] = ctx.run_hash
        todo = list(range(len(frags))) if fragment is None else [fragment]
        if fragment is not None and not 0 <= fragment < len(frags):
            raise _Unusable(f"--fragment {fragment}: the run has fragments 0..{len(frags) - 1}")
        init = {k: np.asarray(v) for k, v in ctx.task.init_params(cfg.seed).items()}
        for p in todo:
            theta0 = {n: init[n] for n in frags[p]}
            rep = _Replay(r, keys, cfg, p, theta0, until, archive_dir, ctx.task.is_embedding)
            report["fragments"].append(rep.run())
    except (_Unusable, BrokerError, cfgmod.ConfigError, ValueError, OSError,
            redis.RedisError) as e:
        report["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, _Unusable) else str(e)
    frags_rep = report["fragments"]
    report["rounds_checked"] = sum(f["rounds_checked"] for f in frags_rep)
    code = exit_code(report)
    report["status"] = {EXIT_OK: "verified", EXIT_DIVERGED: "diverged"}.get(code, "incomplete")
    report["ok"] = code == EXIT_OK
    return report


@dataclass
class _Replay:
    """Replay of one fragment (see the module docstring)."""

    r: redis.Redis
    keys: RunKeys
    cfg: cfgmod.RunConfig
    p: int
    theta0: dict[str, np.ndarray]
    until: int | None
    archive_dir: str | Path | None
    is_embedding: Callable[[str], bool]
    out: dict[str, Any] = field(default_factory=dict)

    def run(self) -> dict[str, Any]:
        fk: FragmentKeys = self.keys.fragment(self.p)
        self.fk = fk
        self.max_bytes = self.cfg.broker.max_payload_bytes
        self.out = {"fragment": self.p, "rounds": int(self.r.xlen(fk.rounds)),
                    "rounds_checked": 0, "last_version": 0, "verified": False,
                    "divergence": None, "missing_entries": [],
                    "entries_from": {"redis": 0, "archive": 0}, "snapshots_checked": [],
                    "state_checked": False, "error": None}
        try:
            self.archived = ({} if self.archive_dir is None else
                             archmod.load_archive(self.archive_dir, self.keys.run, self.p))
            self._replay()
        except (_Unusable, DecodeError, ValueError) as e:
            self.out["error"] = str(e)
        o = self.out
        o["missing_entries"] = sorted(set(o["missing_entries"]), key=id_key)
        o["verified"] = o["divergence"] is None and not o["missing_entries"] and not o["error"]
        return o

    def _replay(self) -> None:
        core = FragmentSyncer(self.p, self.theta0, self.cfg.outer, self.cfg.effective_sync(),
                              is_embedding=self.is_embedding, prior_step_norm=fragment_prior(
                                  self.cfg, {n: v.shape for n, v in self.theta0.items()}))
        problem = self._check_snapshot(0, core.sent_hash)
        if problem:
            self.out["divergence"] = _divergence(0, None, "", "initial", [problem], None,
                                                 core.sent_hash, [], [])
            return
        state = self._stored_state()
        if state is not None and int(state["version"]) == 0:
            self._check_state(core, state)
        records = self._records()
        for rid, rec in records:
            if self.until is not None and rec.version > self.until:
                break
            inputs = self._fetch(rec.included)
            if self.out["missing_entries"]:
                self._list_missing(records)
                return
            if not self._round(core, rid, rec, inputs):
                return
            self.out["rounds_checked"] += 1
            self.out["last_version"] = core.version
            if state is not None and int(state["version"]) == core.version:
                self._check_state(core, state)
                if self.out["divergence"] is not None:
                    return
        if state is not None:
            stored = int(state["version"])
            if stored > core.version and (self.until is None or self.until > core.version):
                raise _Unusable(f"the checkpointed state is at version {stored}, the rounds "
                                f"stream ends at version {core.version}: round records are "
                                f"missing")

    # -- one round -----------------------------------------------------------------------------

    def _round(self, core: FragmentSyncer, rid: str, rec: RoundRecord, inputs: dict) -> bool:
        """Replay one round; False (with the divergence recorded) if anything differs."""
        check = replay_round(core, rec, inputs, self.max_bytes)
        if not check.problems and check.result is not None:
            problem = self._check_snapshot(rec.version, check.result.sent_hash,
                                           core.sent if core.sent_base >= 0 else None)
            if problem:
                check.bad("snapshot", problem)
        if check.problems:
            self.out["divergence"] = _divergence(
                rec.version, rid, rec.reason, check.kind, check.problems, rec.hash,
                None if check.result is None else check.result.sent_hash, check.rows,
                [[i, str(why)] for i, why in rec.dropped])
            return False
        return True

    # -- inputs --------------------------------------------------------------------------------

    def _records(self) -> Iterator[tuple[str, RoundRecord]]:
        """The fragment's round records, oldest first, parsed."""
        return iter_records(self.r, self.fk)

    def _fetch(self, included: list) -> dict[str, tuple[dict, str]]:
        """Entry id → (raw fields, "redis" | "archive"); ids found nowhere go to the report."""
        out, missing = fetch_entries(self.r, self.fk, [row[0] for row in included],
                                     self.archived)
        self.out["missing_entries"] += missing
        for _, source in out.values():
            self.out["entries_from"][source] += 1
        return out

    def _list_missing(self, records: Iterator[tuple[str, RoundRecord]]) -> None:
        """After a round with missing entries: list what the remaining rounds lack too."""
        for _, rec in records:
            if self.until is not None and rec.version > self.until:
                return
            ids = [row[0] for row in rec.included if row[0] not in self.archived]
            pipe = self.r.pipeline(transaction=False)
            for entry_id in ids:
                pipe.xrange(self.fk.frags, entry_id, entry_id)
            self.out["missing_entries"] += [i for i, rows in zip(ids, pipe.execute(), strict=True)
                                            if not rows]

    # -- cross-checks against what Redis still holds ---------------------------------------------

    def _check_snapshot(self, version: int, recomputed: str,
                        sent: Mapping[str, QTensor] | None = None) -> str | None:
        """Compare with the `sent:<version>` snapshot if Redis still holds it (`sent`: the
        delta replay published, under the delta down link)."""
        blob = pieces.read(self.r, self.fk.sent(version), max_bytes=self.max_bytes,
                           what="snapshot")
        if blob is None:
            return None
        header, tensors = codec.unpack_snapshot(blob, max_bytes=self.max_bytes, delta_ok=True)
        stored = tensors_hash(tensors)
        if header.base >= 0:  # a delta as sent (the delta down link): replay's own, naming
            # the value replay made
            same = (sent is not None and header.base == version - 1
                    and stored == tensors_hash(sent))
            stored = header.value if same else f"{header.value} of another delta"
        if header.version != version or stored != recomputed:
            what = "the initial value from the configuration" if version == 0 else "replay"
            return (f"snapshot sent:{version} (version {header.version}, hash {stored}) differs "
                    f"from {what} (hash {recomputed})")
        self.out["snapshots_checked"].append(version)
        return None

    def _stored_state(self) -> dict | None:
        """The fragment's checkpointed state (the syncer writes it every few rounds)."""
        shapes = {n: v.shape for n, v in self.theta0.items()}
        blob = pieces.read(self.r, self.fk.state, max_bytes=capacity.state_limit(shapes),
                           what="state")
        if blob is None:
            return None
        return unpack_state(blob, max_bytes=capacity.state_limit(shapes), shapes=shapes)

    def _check_state(self, core: FragmentSyncer, state: dict) -> None:
        """At the checkpoint's version: the fp32 Θ and the outer momentum must match exactly."""
        mine = jax.tree_util.tree_leaves(core.opt_state)
        same = (set(state["theta"]) == set(core.theta)
                and all(np.array_equal(state["theta"][k], core.theta[k]) for k in core.theta)
                and len(state["momentum"]) == len(mine)
                and all(np.array_equal(np.asarray(a), np.asarray(b))
                        for a, b in zip(state["momentum"], mine, strict=True)))
        if not same:
            self.out["divergence"] = _divergence(
                core.version, None, "", "state",
                [f"the checkpointed state at version {core.version} (fp32 value and momentum) "
                 f"differs from replay although every round hash matched"], None, None, [], [])
            return
        self.out["state_checked"] = True


def _divergence(version: int, record_id: str | None, reason: str, kind: str,
                problems: list[str], recorded: str | None, recomputed: str | None,
                inputs: list[dict], dropped: list) -> dict:
    """The first divergence of a fragment.

    Keys: ``version`` (the round's new version; 0 for the initial value), ``record_id``,
    ``reason`` (the recorded close reason), ``kind`` (the first problem: "initial", "version",
    "decode", "entry", "refused", "weight", "staleness", "hash", "totals", "snapshot",
    "record" or "state"), ``problems`` (every difference found in the round, in words),
    ``recorded_hash``, ``recomputed_hash`` (null if the round could not be closed), ``inputs``
    (per merged entry, in merge order: ``entry_id``, ``source``, ``learner``,
    ``base_version``, ``step``, ``steps``, ``tokens``, ``weight``, ``recorded_weight``,
    ``staleness``, ``recorded_staleness``, ``accepted``, ``refusal``) and ``dropped``
    (``[entry_id, reason]`` pairs the record lists).
    """
    return {"version": version, "record_id": record_id, "reason": reason, "kind": kind,
            "problems": problems, "recorded_hash": recorded, "recomputed_hash": recomputed,
            "inputs": inputs, "dropped": dropped}


def render(report: dict) -> str:
    """The human-readable report (what ``diloco replay`` prints without ``--json``)."""
    lines = [f"run {report['run']} (config {report['config_hash']}): {report['status']}, "
             f"{report['rounds_checked']} rounds checked"]
    if report["error"]:
        lines.append(f"  error: {report['error']}")
    for f in report["fragments"]:
        src = f["entries_from"]
        head = (f"  fragment {f['fragment']}: {f['rounds_checked']}/{f['rounds']} rounds, "
                f"verified up to v{f['last_version']} (entries: {src['redis']} from Redis, "
                f"{src['archive']} from the archive)")
        lines.append(head + (" OK" if f["verified"] else ""))
        if f["error"]:
            lines.append(f"    error: {f['error']}")
        if f["missing_entries"]:
            ids = f["missing_entries"]
            more = f" … and {len(ids) - 10} more" if len(ids) > 10 else ""
            lines.append(f"    {len(ids)} merged entries are neither in Redis nor in the "
                         f"archive: {', '.join(ids[:10])}{more}")
        d = f["divergence"]
        if d is not None:
            lines.append(f"    DIVERGED at v{d['version']} ({d['kind']}; round {d['record_id']}, "
                         f"{d['reason']!r}): recorded {d['recorded_hash']}, "
                         f"recomputed {d['recomputed_hash']}")
            lines += [f"    - {text}" for text in d["problems"]]
            for row in d["inputs"]:
                lines.append(
                    f"    input {row['entry_id']} [{row['source']}] {row['learner']} base "
                    f"v{row['base_version']} step {row['step']} steps {row['steps']} tokens "
                    f"{row['tokens']} weight {row['weight']} (recorded {row['recorded_weight']}) "
                    f"staleness {row['staleness']} (recorded {row['recorded_staleness']})"
                    + (f" refused: {row['refusal']}" if row["refusal"] else ""))
            for entry_id, why in d["dropped"]:
                lines.append(f"    dropped {entry_id}: {why}")
    return "\n".join(lines)
