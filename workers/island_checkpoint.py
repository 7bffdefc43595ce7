"""A learner's crash-safe checkpoint file and push log: `Checkpoints` writes the file off the
training thread and makes a restart of it (position, optimizer state, the parameters with
their unpushed progress, the pushes Redis acknowledged after it); the helpers say what the
file holds (`checkpoint_arrays`), restore the optimizer state into the structure a training
loop gives (`restore_opt`), and read the push log (`acked_pushes`, `pushed_after`)."""

from __future__ import annotations

import json
import logging
import os
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import redis

from broker import registry
from broker.connection import OUTAGE
from broker.records import Heartbeat
from pipeline.config import SyncConfig
from pipeline.learner import LearnerCore
from workers.common import NpzWriter, RunContext, stale_temps
from workers.learner_net import read_push_log

log = logging.getLogger("diloco.learner")

# ((fragment, base_version, step), of this run) of one acknowledged push
Acked = tuple[tuple[int, int, int], bool]


def checkpoint_arrays(*, step: int, tokens: int, run_hash: str, core_meta: Any,
                      core_arrays: Mapping[str, Any], params: Mapping[str, Any],
                      opt_state: Any) -> dict[str, np.ndarray]:
    """Everything a restart needs to lose only the steps since: position, optimizer state,
    the parameters with their unpushed progress, and the sync bookkeeping. The parameters and
    the optimizer state are copied (`np.array`): a writer thread reads them while the next
    steps run, and those reuse (donate) the buffers of the step's outputs. The core's arrays
    are not: `LearnerCore` replaces its arrays and never writes into one."""
    leaves = jax.tree_util.tree_leaves(opt_state) if opt_state is not None else []
    return {"step": np.asarray(step), "tokens": np.asarray(tokens),
            "run_hash": np.asarray(run_hash), "core": np.asarray(json.dumps(core_meta)),
            "opt_leaves": np.asarray(len(leaves)),
            **{f"leaf{i}": np.array(x) for i, x in enumerate(leaves)},
            **{f"theta/{n}": np.array(v) for n, v in params.items()},
            **{f"core/{k}": np.asarray(v) for k, v in core_arrays.items()}}


def restore_opt(z: Any, opt_state: Any, who: str) -> Any:
    """The checkpointed optimizer state in the structure of `opt_state` (kept as given when
    the checkpoint has none or another structure, shapes or dtypes: logged)."""
    if opt_state is None:
        return None
    treedef = jax.tree_util.tree_structure(opt_state)
    n = treedef.num_leaves
    saved = int(z["opt_leaves"]) if "opt_leaves" in z.files else n
    if saved != n or any(f"leaf{i}" not in z.files for i in range(n)):
        log.warning("%s: checkpointed optimizer state does not fit; starting it afresh", who)
        return opt_state
    like = jax.tree_util.tree_leaves(opt_state)
    saved_leaves = [z[f"leaf{i}"] for i in range(n)]
    if any(np.shape(s) != np.shape(x) or np.asarray(s).dtype != np.dtype(
            getattr(x, "dtype", np.asarray(x).dtype)) for s, x in zip(saved_leaves, like,
                                                                     strict=True)):
        log.warning("%s: checkpointed optimizer state has other shapes or dtypes; starting "
                    "it afresh", who)
        return opt_state
    leaves = [jax.device_put(s, getattr(x, "sharding", None))
              for s, x in zip(saved_leaves, like, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def acked_pushes(path: Path | None, who: str, fragments: int, run_hash: str) -> list[Acked]:
    """((fragment, base_version, step), of this run) of every push Redis acknowledged, in
    the order of the log. The log is the learner's own file, read as untrusted: a line that
    does not fit is skipped, an unreadable log counts as empty (with a warning), and records
    of another run in the same folder are left out (older records, which do not name their
    run, count only as acknowledgements)."""
    if path is None or not path.exists():
        return []
    try:
        records = list(read_push_log(path))
    except OSError as e:
        log.warning("%s: push log %s is unreadable (%s); no push counts as acknowledged",
                    who, path, e)
        return []
    out = []
    for rec in records:
        if not isinstance(rec, dict) or "id" not in rec:
            continue  # an attempt (or not a record)
        key = tuple(rec.get(k) for k in ("fragment", "base_version", "step"))
        if not all(type(x) is int and x >= 0 for x in key) or (
                key[0] >= fragments or rec.get("learner", who) != who):
            log.warning("%s: skipping a malformed record of %s", who, path)
            continue
        run = rec.get("run")
        if run is None or run == run_hash:
            out.append((key, run is not None))
    return out


def pushed_after(acked: list[Acked], step: int, base_version: list[int]
                 ) -> dict[int, tuple[int, int]]:
    """Fragment → (base_version, step) of its last acknowledged push of this run sent after
    checkpoint `step` on a base not older than the checkpoint's (`base_version`, per
    fragment; the log's order: a restarted learner's steps repeat an earlier incarnation's,
    and an earlier incarnation's push on an older base does not hold what a later one
    checkpointed)."""
    return {p: (v, s) for (p, v, s), this_run in acked
            if this_run and s > step and v >= base_version[p]}


# (versions, values) of every fragment as read when the island joined
Joined = tuple[list[int], dict[str, np.ndarray]]


@dataclass
class Resumed:
    """Where a restarted island goes on from (`Checkpoints.resume`)."""

    step: int
    tokens: int
    opt_state: Any
    core: LearnerCore | None = None       # replaced: restored, or rebuilt from the snapshots
    params: dict[str, Any] | None = None  # flat and placed, with the core
    # fragments with a push in flight: their merged value may still come (repair on timeout)
    inflight: list[int] = field(default_factory=list)


class Checkpoints:
    """An island's checkpoint file, ``<state_dir>/<learner id>.ckpt.npz`` (see module
    docstring); `path` is None without a state folder (nothing is written or read)."""

    def __init__(self, ctx: RunContext, learner_id: str, sync: SyncConfig,
                 state_dir: Path | None, push_log: Path | None):
        self.ctx, self.id, self.sync = ctx, learner_id, sync
        self.path = state_dir / f"{learner_id}.ckpt.npz" if state_dir else None
        self.push_log = push_log
        self.writer = NpzWriter(f"{learner_id} checkpoint")
        self.written = 0
        self.stall_in = 0  # fault injection (CLI learner only): hang halfway through this write

    def write(self, *, step: int, tokens: int, core: LearnerCore, params: Mapping[str, Any],
              opt_state: Any) -> None:
        """Everything a restart needs to lose only the steps since this checkpoint, written
        atomically (temp file + rename) and fsynced off the training thread; the next
        checkpoint waits for this one (never two copies of the state in host memory)."""
        self.writer.wait()
        meta, core_arrays = core.state_dict()
        arrays = checkpoint_arrays(step=step, tokens=tokens, run_hash=self.ctx.run_hash,
                                   core_meta=meta, core_arrays=core_arrays, params=params,
                                   opt_state=opt_state)
        self.written += 1
        self.writer.submit(self.path, arrays, stall_after_half=self.written == self.stall_in)

    def close(self) -> None:
        self.writer.close()

    def resume(self, opt_state: Any, *, core: LearnerCore, joined: Joined,
               prior: Heartbeat | None, new_core: Callable[[Joined], LearnerCore],
               place: Callable[[dict], dict]) -> Resumed:
        """Where to continue after a restart: this island's checkpoint when it has one (a
        corrupt one is set aside); else the step of its last heartbeat in Redis (`prior`) with
        the given optimizer state; else from scratch. `core` was built from `joined`."""
        path = self.path
        for tmp in stale_temps(path) if path is not None else ():
            log.warning("%s: removing %s, left by a checkpoint write that did not finish",
                        self.id, tmp)
            tmp.unlink(missing_ok=True)
        out = Resumed(0, 0, opt_state)
        if path is not None and path.exists():
            try:
                with np.load(path) as z:
                    if str(z["run_hash"]) == self.ctx.run_hash:
                        step = int(z["step"])
                        out = Resumed(step, int(z["tokens"]), restore_opt(z, opt_state, self.id))
                        if "core" in z.files:
                            self._restore_progress(z, out, core, joined, new_core, place)
                        registry.event(self.ctx.r, self.ctx.keys, "resume", learner=self.id,
                                       step=step, source="checkpoint",
                                       progress=int(out.params is not None))
                        return out
            except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile,
                    zlib.error) as e:
                # truncated or corrupt: set it aside and resume from the snapshots read at join
                aside = path.with_name(path.name + ".corrupt")
                os.replace(path, aside)
                log.error("%s: checkpoint %s is unreadable (%s: %s); moved to %s, resuming "
                          "from the latest global values", self.id, path, type(e).__name__, e,
                          aside)
                registry.event(self.ctx.r, self.ctx.keys, "checkpoint-corrupt",
                               learner=self.id, error=f"{type(e).__name__}: {e}")
                out = Resumed(0, 0, opt_state, core=new_core(joined),
                              params=place({k: joined[1][k] for k in self.ctx.shapes}))
        if prior and prior.step:
            registry.event(self.ctx.r, self.ctx.keys, "resume", learner=self.id,
                           step=prior.step, source="heartbeat")
            out.step, out.tokens = int(prior.step), int(prior.tokens)
        return out

    def _restore_progress(self, z: Any, out: Resumed, core: LearnerCore, joined: Joined,
                          new_core: Callable[[Joined], LearnerCore],
                          place: Callable[[dict], dict]) -> None:
        """Resume the checkpointed parameters and sync bookkeeping instead of the snapshots read
        at join: the unpushed progress of every fragment survives the restart. A push in flight
        that Redis never acknowledged is forgotten (its progress goes out with the next push);
        a fragment pushed after the checkpoint (the push log says Redis acknowledged it) has
        that push taken as in flight, since it holds all the checkpoint's progress of that
        fragment and may have been merged (`LearnerCore.resume_pushed`); the snapshots newer
        than the checkpoint's bases are applied the usual way. Sets `out.core` (rebuilt from
        the snapshots when the progress cannot be restored) and, when it is, `out.params`."""
        shapes, step = self.ctx.shapes, out.step
        try:
            meta = json.loads(str(z["core"]))
            params = {n: np.asarray(z[f"theta/{n}"], np.float32) for n in shapes}
            for n, v in params.items():
                if v.shape != tuple(shapes[n]):
                    raise ValueError(f"theta/{n} has shape {v.shape}, not {shapes[n]}")
            core.load_state(meta, {k[len("core/"):]: z[k] for k in z.files
                                   if k.startswith("core/")})
        except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as e:
            log.warning("%s: checkpoint progress not restored (%s); starting from the snapshots",
                        self.id, e)
            out.core = new_core(joined)
            return
        acked = acked_pushes(self.push_log, self.id, len(self.ctx.fragments), self.ctx.run_hash)
        known = {key for key, _ in acked}
        for p, f in enumerate(core.inflight):
            if f is not None and (p, *f.key) not in known:
                core.forget_push(p)
        for p, (version, sent) in pushed_after(acked, step, core.base_version).items():
            if self.resumable(p, version, sent):
                log.info("%s: fragment %d was pushed at step %d, after the checkpoint (step "
                         "%d): that push is taken as in flight", self.id, p, sent, step)
                core.resume_pushed(p, version, sent, step, params)
        out.inflight = [p for p, f in enumerate(core.inflight) if f is not None]
        out.core, out.params = core, place(params)
        for p, v in enumerate(joined[0]):
            core.on_global(p, v, joined[1])  # ignored unless newer than the restored base

    def resumable(self, p: int, version: int, sent: int) -> bool:
        """May the push of fragment p (on `version`, at step `sent`) be taken as in flight?
        Not if the syncer refused it; in strict modes, which wait for its merged value, only
        if the syncer's merge record names it (a push Redis lost would keep it waiting); not
        if Redis cannot say now (its progress then goes out again, as before)."""
        try:
            rec = registry.merged(self.ctx.r, self.ctx.keys, self.id, p)
            if rec is not None and (rec.base_version, rec.step) == (version, sent):
                return True
            if self.sync.strict:
                return False
            ref = registry.refusal(self.ctx.r, self.ctx.keys, self.id, p)
        except (redis.RedisError, *OUTAGE) as e:
            log.warning("%s: could not check push %d of fragment %d (%s); its progress goes "
                        "out again", self.id, sent, p, e)
            return False
        return ref is None or (ref.base_version, ref.step) != (version, sent)
