"""The syncer's writes to Redis: a round's commit (state when a checkpoint is due, snapshot,
round record, acknowledgements, merge records: one MULTI/EXEC fenced by the fragment lease),
checkpoints, the stream's trim (archived first when asked), and the re-commit of rounds Redis
lost (a failover to a replica behind, an AOF restart, an outage)."""

from __future__ import annotations

import logging
import time

import redis

from broker import archive, codec
from broker.commit import LeaseLost, RoundsLost
from broker.ids import id_key
from broker.state import pack_state, unpack_state
from pipeline import capacity
from pipeline.syncer import FragmentSyncer
from workers import recovery
from workers.syncer_state import FragState, SyncerShared, delta_snapshot, whole_snapshot

log = logging.getLogger("diloco.syncer")


class Commits:
    """Rounds and checkpoints into Redis (see module docstring)."""

    def __init__(self, sh: SyncerShared):
        self.sh = sh

    def state_blob(self, core: FragmentSyncer) -> memoryview:
        d = core.state_dict()
        d.pop("history")  # kept as per-version snapshots (the `sent:<v>` keys)
        return pack_state(d)

    def snapshot(self, core: FragmentSyncer) -> memoryview:
        return codec.pack_snapshot(self.sh.ctx.keys.run, core.fragment, core.version,
                                   core.snapshot_tensors, sha256=core.sent_hash)

    def sent_snapshot(self, core: FragmentSyncer) -> memoryview | None:
        """What ``sent:<version>`` keeps when it is not the whole value: under the delta down
        link a delta as it was sent (an int4 delta: 1/7 of the fp32 value), rebuilt from the
        version before (`workers.recovery.history_from_snapshots`); None otherwise."""
        if core.sent_base < 0:
            return None
        return delta_snapshot(self.sh.ctx.keys.run, core.fragment, core.version, core.sent,
                              core.sent_hash)

    def whole_floor(self, f: FragState, floor: int, *, moved: bool = True
                    ) -> dict[int, memoryview]:
        """The oldest snapshot kept from now on (`floor`), whole, when it moves (a
        checkpoint; `moved` False: whether or not, as after Redis lost commits): the start of
        the chain of deltas recovery rebuilds (version → blob; empty when not needed, or when
        the core no longer holds that version — then the checkpoint that moved the floor
        there made it whole)."""
        core = f.core
        if (not core.sync_cfg.down_delta or floor <= 0 or (moved and floor <= f.sent_floor)
                or floor not in core.history):
            return {}
        return {floor: whole_snapshot(self.sh.ctx.keys.run, core.fragment, floor,
                                      core.history[floor])}

    def _floor_made_whole(self, p: int, f: FragState, floor: int, *, retake: bool) -> None:
        """Before a checkpoint moves the oldest snapshot kept to `floor`: that snapshot
        written whole, on its own (the same value: a crash before the checkpoint leaves it
        whole, which any reader takes), its blob gone before the state's is made."""
        for v, blob in self.whole_floor(f, floor).items():
            self.sh.store.put_sent(p, self.sh.cfg.syncer_id, v, blob, retake=retake)

    def checkpoint_due(self, f: FragState) -> bool:
        """Whether the round being committed writes the fragment's full state."""
        b = self.sh.bcfg
        return (f.core.version - f.ckpt_version >= b.checkpoint_rounds
                or (b.checkpoint_s > 0 and time.monotonic() - f.ckpt_t >= b.checkpoint_s))

    def _sent_floor(self, f: FragState, ckpt_version: int) -> int:
        """The oldest snapshot to keep: the anchors of stale contributions to the current
        version and to the checkpoint's (recovery replays from there)."""
        return max(0, min(f.core.version, ckpt_version) - self.sh.sync.max_staleness)

    def commit(self, p: int, f: FragState, *, snapshot: memoryview, record: dict, acks: list[str],
               merged: dict[str, str], checkpoint: bool) -> bool:
        """Commit the round that made f's current version (it is in `f.recent` already).
        False when the fragment is not this syncer's any more."""
        version = f.core.version
        floor = self._sent_floor(f, version if checkpoint else f.ckpt_version)
        as_delta = floor < version  # (max_staleness 0: the floor is this version, sent whole)
        try:
            if as_delta:
                self._floor_made_whole(p, f, floor, retake=False)
            self.sh.store.commit_round(
                p, self.sh.cfg.syncer_id, state=self.state_blob(f.core) if checkpoint else None,
                snapshot=snapshot, version=version,
                sent=self.sent_snapshot(f.core) if as_delta else None,
                record=record, ack_ids=acks, drop_sent_versions=range(f.sent_floor, floor),
                after=version - 1, merged=merged)
            if checkpoint:
                f.ckpt_version, f.ckpt_t = version, time.monotonic()
            f.sent_floor = max(f.sent_floor, floor)
        except RoundsLost as e:  # this round is in f.recent: re-committed with the lost ones
            log.error("%s; re-committing", e)
            self.resync()
        except LeaseLost:
            if self.sh.store.lease_holder(p) is not None:
                if not self.sh.auto:
                    raise  # another syncer owns the fragment now: this one stops
                # sharing: that syncer serves it now (its entries of this round are pending
                # here, and it claims them); this round was not committed
                log.warning("fragment %d: another syncer holds the lease; v%d not committed, "
                            "fragment handed over", p, version)
                self.sh.forget(p, "lease lost")
                return False
            # The lease expired under us: Redis was down (redis-py's retries hid it) or came
            # back from its AOF without it. Retake every lease and re-commit what Redis lacks,
            # this round included (it is in f.recent), as after an outage.
            log.warning("fragment %d: lease expired before the commit of v%d; retaking it and "
                        "re-committing", p, version)
            self.resync()
        return p in self.sh.frags  # a resync may have found another syncer serving it

    def checkpoint_all(self) -> None:
        """Write the full state of every fragment whose checkpoint is behind its version (the
        end of the run: export and evaluation then read it without replaying)."""
        for p, f in list(self.sh.frags.items()):
            if f.ckpt_version < f.core.version:
                self.checkpoint(p, f)

    def checkpoint_at_exit(self) -> None:
        """A last checkpoint of every fragment (a restart then replays nothing)."""
        try:
            self.checkpoint_all()
        except (LeaseLost, redis.RedisError) as e:
            log.warning("no checkpoint at exit (%s): a successor replays the rounds since the "
                        "last one", e)

    def checkpoint(self, p: int, f: FragState) -> None:
        floor = self._sent_floor(f, f.core.version)
        try:
            self._floor_made_whole(p, f, floor, retake=True)
            self.sh.store.checkpoint(p, self.sh.cfg.syncer_id, state=self.state_blob(f.core),
                                       version=f.core.version,
                                       drop_sent_versions=range(f.sent_floor, floor))
        except RoundsLost as e:  # a failover lost rounds: re-commit them (a checkpoint too)
            log.error("%s; re-committing", e)
            self.resync()
            return
        f.ckpt_version, f.ckpt_t = f.core.version, time.monotonic()
        f.sent_floor = max(f.sent_floor, floor)

    def trim(self, p: int, f: FragState) -> None:
        """After a commit: cut the stream below the entries recovery may still replay
        (`broker.keep_rounds`), archiving them first when `broker.archive_dir` is set."""
        ids = list(f.entries)
        if not ids:
            return
        f.recent_min_ids.append((f.core.version, min(ids, key=id_key)))
        keep = self.sh.bcfg.keep_rounds
        # the entries of rounds after the checkpoint stay: recovery replays them
        if keep and len(f.recent_min_ids) > keep and f.recent_min_ids[0][0] <= f.ckpt_version + 1:
            _, cut = f.recent_min_ids.pop(0)
            pending = [e.entry_id for e in f.deferred]
            after = [m for v, m in f.recent_min_ids if v > f.ckpt_version]
            floor = min([cut, *after, *pending], key=id_key)
            if self.sh.bcfg.archive_dir:
                try:
                    archive.archive_below(self.sh.ctx.r, self.sh.ctx.keys, p, floor,
                                          self.sh.bcfg.archive_dir)
                except (OSError, ValueError) as e:
                    log.error("fragment %d: archiving before the trim failed (%s); entries kept",
                              p, e)
                    return
            self.sh.streams.trim(p, floor)

    def behind(self) -> bool:
        """Whether Redis lost rounds this syncer committed without it noticing an outage (a
        failover to a replica that had not received them yet; an AOF restart the client's
        retries hid): its last round record is older than this syncer's version."""
        for p, f in self.sh.frags.items():
            if f.core.version == 0:
                continue
            v = recovery.committed_version(self.sh.ctx.r, self.sh.ctx.keys.fragment(p))
            if v is None or v < f.core.version:
                log.error("fragment %d: Redis holds rounds up to v%s, this syncer committed "
                          "v%d", p, v, f.core.version)
                return True
        return False

    def _committed_version(self, p: int) -> int:
        """The version Redis holds for fragment p: its last round record's, else its
        checkpoint's (-1: nothing)."""
        v = recovery.committed_version(self.sh.ctx.r, self.sh.ctx.keys.fragment(p))
        if v is not None:
            return v
        shapes = self.sh.shapes(p)
        blob = self.sh.store.load_state(p, limit := capacity.state_limit(shapes))
        return -1 if blob is None else int(unpack_state(
            blob, max_bytes=limit, shapes=shapes)["version"])

    def resync(self) -> None:
        """After an outage: re-create groups, retake leases, re-commit rounds Redis lost."""
        sh, me = self.sh, self.sh.cfg.syncer_id
        for p, f in list(sh.frags.items()):
            sh.streams.ensure_group(p)
            # packed before the lease is taken: a large fragment's state can take longer to
            # pack than the lease lasts on a busy host
            packed_from = self._committed_version(p)
            state = sent = None
            if packed_from < f.core.version:
                state = self.state_blob(f.core)
                sent = f.snapshots_since(packed_from, sh.ctx.keys.run)
            if not sh.store.acquire_lease(p, me, sh.bcfg.lease_ms):
                if not sh.auto:
                    raise LeaseLost(f"fragment {p}: another syncer took over during the outage")
                sh.forget(p, "lease lost")
                continue
            stored = self._committed_version(p)  # again, under the lease: it may have moved
            if stored >= f.core.version:
                continue
            lost = [(rec, acks, m) for rec, acks, m in f.recent if rec.version > stored]
            log.error("fragment %d: Redis is at version %d, this syncer at %d; re-committing "
                      "%d round(s)", p, stored, f.core.version, len(lost))
            if not lost or lost[-1][0].version != f.core.version:
                raise LeaseLost(f"fragment {p}: cannot rebuild rounds Redis lost")
            if state is None or stored < packed_from:  # Redis lost more meanwhile
                state = state or self.state_blob(f.core)
                sent = f.snapshots_since(stored, sh.ctx.keys.run)
            sent = {v: blob for v, blob in sent.items() if v > stored}
            # the state written here moves the oldest snapshot recovery reads: made whole
            # (whatever this syncer wrote before: Redis may have lost it)
            sent.update(self.whole_floor(f, f.core.version - sh.sync.max_staleness,
                                         moved=False))
            # retaken if it expired during the write (a large fragment on a starved host)
            # and nobody took it since: this writes the state with the rounds
            sh.store.commit_round(
                p, me, state=state, snapshot=self.snapshot(f.core),
                sent=sent[f.core.version] if f.core.sync_cfg.down_delta else None,
                version=f.core.version,
                record=lost[-1][0].to_fields(),
                earlier_records=[rec.to_fields() for rec, *_ in lost[:-1]],
                ack_ids=[i for _, acks, _ in lost for i in acks], extra_sent=sent,
                merged={n: m for *_, ms in lost for n, m in ms.items()},  # the latest wins
                retake=True)
            f.ckpt_version, f.ckpt_t = f.core.version, time.monotonic()
            sh.event("recommit", fragment=p, redis_version=stored, version=f.core.version)

