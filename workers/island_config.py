"""An island's configuration (`IslandConfig`, imported by users' loops from `workers.island`)
and what follows from it alone: its data shard, and the loss a heartbeat may carry."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker.pubsub import CurveClient


@dataclass(frozen=True)
class IslandConfig:
    """One learner ("island": one or more local devices). Everything about the run comes from
    Redis; `task` names the user task this process may import (`pipeline.task.task_of`)."""

    redis_url: str
    run: str
    learner_id: str = "L0"
    shard: int | None = None       # data shard (default: the number in the id)
    task: str | None = None        # the user task this process's command line names
    sync: bool = True              # False: train alone (the "syncing off" baseline)
    wait_config_s: float = 60.0
    final_timeout_s: float = 300.0
    state_dir: str | None = None   # checkpoint and acknowledged-push log
    checkpoint_every: int = 0      # inner steps between checkpoints (0: every Δh steps)
    sub_endpoints: tuple[str, ...] = ()  # connect here instead of the advertised endpoints
    devices: int = 1               # devices of this island (reported in heartbeats)
    # the most tokens one inner step trains on, declared in heartbeats (default: the task's
    # tokens per step); `after_step` refuses more
    max_tokens_per_step: int | None = None
    # ZeroMQ CURVE: this learner's key pair and the run's pinned syncer key (None: plaintext)
    curve: CurveClient | None = None
    # signed contributions: this learner's signing key (broker/signing.py; None: unsigned)
    sign_key: bytes | None = None
    # this island's curves (`workers.scalars`): TensorBoard event files in this folder, and a
    # W&B run named by the learner id in the run's group
    tensorboard: str | None = None
    wandb: bool = False


def finite_or_none(x: Any) -> float | None:
    """A loss for a heartbeat: None when absent or not finite (heartbeats carry finite
    numbers only)."""
    if x is None:
        return None
    x = float(x)
    return x if np.isfinite(x) else None


def shard_of(learner_id: str, shard: int | None, learners: int) -> int:
    """The data shard of a learner: `shard`, else the trailing number of its id, else 0.

    Raises:
        ValueError: The shard is not one of the run's ``learners`` shards.
    """
    if shard is None:
        m = re.search(r"(\d+)$", learner_id)
        shard = int(m.group(1)) if m else 0
    if not 0 <= shard < learners:
        raise ValueError(f"learner {learner_id}: shard {shard} is out of range "
                         f"[0, {learners - 1}]")
    return shard
