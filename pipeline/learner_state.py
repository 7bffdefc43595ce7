"""A learner core's checkpoint: its bases, counters, the contribution in flight and a merged
value waiting to be applied, per fragment, as plain data and named arrays (what
`workers.island_checkpoint` writes to the learner's file), and back, every field checked
before anything is replaced."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pipeline.learner import UNKNOWN, LearnerCore, MergedValue, _chain, _InFlight, _seconds


def core_state(core: LearnerCore) -> tuple[dict, dict[str, np.ndarray]]:
    """(plain JSON-able data, name → array) for a learner checkpoint: the bases, counters,
    the contribution in flight and a merged value waiting to be applied, per fragment."""
    meta: dict = {"base_version": list(core.base_version), "steps": list(core.steps),
                  "tokens": list(core.tokens), "secs": list(core.seconds),
                  "applied": core.applied,
                  "inflight": [], "pending": []}
    arrays: dict[str, np.ndarray] = {}
    for p in range(len(core.fragments)):
        arrays.update({f"base{p}/{n}": v for n, v in core.base[p].items()})
        f = core.inflight[p]
        meta["inflight"].append(None if f is None else {
            "step": f.step, "base_version": f.base_version, "steps_at_push": f.steps_at_push,
            "tokens_at_push": f.tokens_at_push, "secs_at_push": f.seconds_at_push,
            "theta": f.theta_at_push is not None, "sent_step": f.sent_step,
            "chain": f.chain})
        if f is not None and f.theta_at_push is not None:
            arrays.update({f"theta_at_push{p}/{n}": v for n, v in f.theta_at_push.items()})
        if f is not None and f.pushed is not None:
            arrays.update({f"pushed{p}/{n}": v for n, v in f.pushed_values().items()})
        if f is not None and f.carried is not None:
            arrays.update({f"carried{p}/{n}": v for n, v in f.carried.items()})
        if core.residual[p] is not None:
            arrays.update({f"residual{p}/{n}": v for n, v in core.residual[p].items()})
        pend = core.pending[p]
        meta["pending"].append(None if pend is None else pend.version)
        if pend is not None:
            arrays.update({f"pending{p}/{n}": v for n, v in pend.value.items()})
    return meta, arrays

def restore_core(core: LearnerCore, meta: Mapping, arrays: Mapping[str, np.ndarray]) -> None:
    """Restore into `core` what `core_state` saved (the same fragments and tensors).

    Raises:
        ValueError: the checkpoint does not match this learner's fragments.
    """
    P = len(core.fragments)

    def group(prefix: str, p: int) -> dict[str, np.ndarray]:
        try:
            out = {n: np.asarray(arrays[f"{prefix}{p}/{n}"], np.float32)
                   for n in core.fragments[p]}
        except KeyError as e:
            raise ValueError(f"checkpoint lacks {e.args[0]}") from None
        except (TypeError, ValueError) as e:  # not numeric
            raise ValueError(f"checkpoint's {prefix}{p} is not a float array: {e}") from None
        for n, v in out.items():
            if v.shape != core.base[p][n].shape:
                raise ValueError(f"checkpoint's {prefix}{p}/{n} has shape {v.shape}, not "
                                 f"{core.base[p][n].shape}")
        return out

    def optional(prefix: str, p: int) -> dict[str, np.ndarray] | None:
        return group(prefix, p) if all(f"{prefix}{p}/{n}" in arrays
                                       for n in core.fragments[p]) else None

    try:  # everything is read before anything is replaced
        if len(meta["base_version"]) != P:
            raise ValueError(f"checkpoint has {len(meta['base_version'])} fragments, not {P}")
        if not (len(meta["steps"]) == len(meta["tokens"]) == len(meta["inflight"])
                == len(meta["pending"]) == P):
            raise ValueError(f"checkpoint's bookkeeping does not have {P} fragments")
        bases = [group("base", p) for p in range(P)]
        versions = [int(v) for v in meta["base_version"]]
        steps = [int(v) for v in meta["steps"]]
        tokens = [int(v) for v in meta["tokens"]]
        # checkpoints before the core kept seconds: the island's own keys, same names
        seconds = [_seconds(v) for v in meta.get("secs", [0.0] * P)]
        if len(seconds) != P:
            raise ValueError(f"checkpoint has {len(seconds)} fragments' seconds, not {P}")
        old_at_push = meta.get("secs_at_push", {})
        applied = int(meta.get("applied", 0))
        inflight = [None if f is None else _InFlight(
            int(f["step"]), int(f["base_version"]),
            group("theta_at_push", p) if f.get("theta") else None,
            int(f["steps_at_push"]), int(f["tokens_at_push"]),
            # older checkpoints lack it: that push, if superseded, goes out whole
            optional("pushed", p), optional("carried", p),
            seconds_at_push=_seconds(f.get("secs_at_push", old_at_push.get(str(p), 0.0))),
            sent_step=None if f.get("sent_step") is None else int(f["sent_step"]),
            chain=_chain(f.get("chain"), int(f["step"])))
            for p, f in enumerate(meta["inflight"])]
        # a checkpoint without residuals (older, or error feedback off): they start at zero
        residual = [optional("residual", p) for p in range(P)]
        # what the driver knew of a pending value is not saved: a restored one counts as
        # unknown
        pending = [None if v is None else MergedValue(p, int(v), group("pending", p), UNKNOWN)
                   for p, v in enumerate(meta["pending"])]
    except (KeyError, TypeError, AttributeError, IndexError, OverflowError) as e:
        raise ValueError(f"checkpoint's bookkeeping is malformed: {e!r}") from None
    core.base, core.base_version, core.steps, core.tokens = bases, versions, steps, tokens
    core.seconds = seconds
    core.applied, core.inflight, core.residual, core.pending = (applied, inflight, residual,
                                                                pending)
    core.chain_next = [None] * P  # a restored process's pushes repeat no older one's
