"""A learner's crash-safe checkpoint file and push log, read and written without the island's
state: what the file holds (`checkpoint_arrays`), the optimizer state restored into the
structure a training loop gives (`restore_opt`), and which pushes Redis acknowledged after it
(`acked_pushes`, `pushed_after`). `workers.island.Island` decides what to do with them."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from workers.learner_net import read_push_log

log = logging.getLogger("diloco.learner")

# ((fragment, base_version, step), of this run) of one acknowledged push
Acked = tuple[tuple[int, int, int], bool]


def checkpoint_arrays(*, step: int, tokens: int, run_hash: str, core_meta: Any,
                      core_arrays: Mapping[str, Any], params: Mapping[str, Any],
                      opt_state: Any) -> dict[str, np.ndarray]:
    """Everything a restart needs to lose only the steps since: position, optimizer state,
    the parameters with their unpushed progress, and the sync bookkeeping. Copies
    (`np.array`): a writer thread reads them while the next steps run, and those may reuse
    the buffers of the step's outputs."""
    leaves = jax.tree_util.tree_leaves(opt_state) if opt_state is not None else []
    return {"step": np.asarray(step), "tokens": np.asarray(tokens),
            "run_hash": np.asarray(run_hash), "core": np.asarray(json.dumps(core_meta)),
            "opt_leaves": np.asarray(len(leaves)),
            **{f"leaf{i}": np.array(x) for i, x in enumerate(leaves)},
            **{f"theta/{n}": np.array(v) for n, v in params.items()},
            **{f"core/{k}": np.array(v) for k, v in core_arrays.items()}}


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
