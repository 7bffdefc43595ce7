"""What a run will cost before it starts: bytes per direction, link use, syncer cores and each
role's memory, from the run's settings, its fragments' sizes and per-value costs measured on
this code (`ops/tools/plan.py` measures them; `diloco plan` prints this).

Per fragment of n values, with H = `sync.sync_every`, M learners, K = `sync.quorum`, S seconds
a step (`value_bytes` gives each value's bytes on the wire):

* up: each learner pushes every fragment once per H steps, `push(n)` bytes;
* down: each round publishes `publish(n)` bytes to every learner; a round closes once K
  contributions are in (and the grace window, which only merges more into one round), so a
  fragment has at most M/K rounds per H steps — the figure here is that bound;
* data parallel's reference: a ring all-reduce of fp32 gradients every step,
  2·(M−1)/M·4·N bytes each way per worker;
* the syncer: per round K offers (decode, anchor, accumulate) and one close (outer step,
  encode, hash); cores = rounds per second × those costs;
* memory: the arrays each role keeps per value (see `memory`), not allocator overheads;
  Redis holds a fragment's entries until they are trimmed, one snapshot per version a stale
  push may still name, the latest value and the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pipeline.capacity import value_bytes
from pipeline.config import RunConfig


@dataclass(frozen=True)
class Costs:
    """Seconds per value of the per-value work on the data path (measured on this code)."""

    offer_s: float  # syncer: decode one contribution, anchor it, accumulate it
    close_s: float  # syncer: finish the merge, outer step, encode the published value, hash
    push_s: float  # learner: the delta since its base, quantised for the up link
    apply_s: float  # learner: a published value decoded and applied to its copy


@dataclass(frozen=True)
class Workload:
    """The run being planned: `fragment_values` (values of each fragment), M learners, a step
    of `step_s` seconds over `tokens_per_step` tokens (per learner), links of `link_gbps`
    (each learner's) and `syncer_link_gbps` (the syncers' together), `syncers` processes."""

    fragment_values: tuple[int, ...]
    learners: int
    step_s: float
    link_gbps: float
    syncer_link_gbps: float
    tokens_per_step: int = 0
    syncers: int = 1

    @property
    def params(self) -> int:
        return sum(self.fragment_values)


def even_fragments(params: int, fragments: int) -> tuple[int, ...]:
    """`params` values split over `fragments` as evenly as whole values allow (a model's real
    split, `pipeline.fragments.partition`, follows its tensors and is less even)."""
    base, extra = divmod(params, fragments)
    return tuple(base + (i < extra) for i in range(fragments))


def _gbps(bytes_per_s: float) -> float:
    return bytes_per_s * 8 / 1e9


def wire(cfg: RunConfig, w: Workload) -> dict[str, float]:
    """Bytes per second each way per learner, through the syncers, and data parallel's."""
    s = cfg.effective_sync()
    window = s.sync_every * w.step_s  # each fragment is pushed once per H steps
    rounds_per_window = w.learners / s.quorum
    up = sum(value_bytes(cfg, n)["push"] for n in w.fragment_values) / window
    down = rounds_per_window * sum(value_bytes(cfg, n)["publish_steady"]
                                   for n in w.fragment_values) / window
    m = w.learners
    ring = 2 * (m - 1) / m * 4 * w.params / w.step_s if m > 1 else 0.0
    out = {"up_bytes_per_s": up, "down_bytes_per_s": down,
           "syncer_in_bytes_per_s": m * up, "syncer_out_bytes_per_s": m * down,
           "ring_allreduce_bytes_per_s": ring,
           "vs_ring_allreduce": ring / max(up, down) if max(up, down) > 0 else math.inf,
           "rounds_per_fragment_per_window": rounds_per_window}
    if w.tokens_per_step:
        out["bytes_per_token"] = max(up, down) * w.step_s / w.tokens_per_step
    return out


def link(cfg: RunConfig, w: Workload, flows: dict[str, float]) -> dict[str, float | bool]:
    """Each link's use at the planned step time, and how long one push of the largest
    fragment takes on a learner's link against the steps a learner overlaps it with."""
    s = cfg.effective_sync()
    learner_rate = w.link_gbps * 1e9 / 8
    syncer_rate = w.syncer_link_gbps * 1e9 / 8
    use = max(flows["up_bytes_per_s"], flows["down_bytes_per_s"]) / learner_rate
    syncer_use = max(flows["syncer_in_bytes_per_s"], flows["syncer_out_bytes_per_s"]) / \
        syncer_rate
    push_s = value_bytes(cfg, max(w.fragment_values))["push"] / learner_rate
    overlap_s = max(1, s.overlap_steps) * w.step_s
    return {"learner_link_use": use, "syncer_link_use": syncer_use,
            "largest_push_s": push_s, "overlap_s": overlap_s,
            "link_holds_training_back": use > 1 or syncer_use > 1 or push_s > overlap_s}


def syncer(cfg: RunConfig, w: Workload, costs: Costs) -> dict[str, float]:
    """Cores the syncers need to keep up (all of them together), and per syncer."""
    s = cfg.effective_sync()
    window = s.sync_every * w.step_s
    rounds_per_s = (w.learners / s.quorum) / window  # per fragment
    per_round_s = sum((s.quorum * costs.offer_s + costs.close_s) * n for n in w.fragment_values)
    cores = rounds_per_s * per_round_s
    return {"rounds_per_s": rounds_per_s * len(w.fragment_values), "cores": cores,
            "cores_per_syncer": cores / w.syncers,
            "round_s_largest": (s.quorum * costs.offer_s + costs.close_s) *
            max(w.fragment_values)}


def learner_blocked(cfg: RunConfig, w: Workload, costs: Costs) -> dict[str, float]:
    """A learner's own per-value work on the data path, as a share of its step time: the push
    of a fragment and the apply of each published value (rounds per step, every fragment)."""
    s = cfg.effective_sync()
    n_max = max(w.fragment_values)
    rounds_per_step = (w.learners / s.quorum) * len(w.fragment_values) / s.sync_every
    pushes_per_step = len(w.fragment_values) / s.sync_every
    per_step = (pushes_per_step * costs.push_s + rounds_per_step * costs.apply_s) * n_max
    return {"push_s_largest": costs.push_s * n_max, "apply_s_largest": costs.apply_s * n_max,
            "share_of_step": per_step / w.step_s}


def _history_bytes(cfg: RunConfig, n: int) -> int:
    """What a syncer keeps of the recent published values of a fragment of `n` values."""
    s = cfg.effective_sync()
    kept, steady = s.max_staleness + 1, value_bytes(cfg, n)["publish_steady"]
    if s.down_delta:
        return 8 * n + (kept - 1) * steady
    return 4 * n * kept if s.codec_down == "fp32" else 4 * n + kept * steady


def memory(cfg: RunConfig, w: Workload) -> dict[str, float]:
    """Bytes each role keeps (the arrays; the allocator, the runtime and activations aside).

    * learner: parameters and AdamW's two moments (12 B a value), the step's scratch with its
      inputs donated (the gradient and the update: 8 B, XLA's `memory_analysis`), the base each
      fragment was last rebased on (4 B), a checkpoint being written (the parameters and
      moments copied, 12 B), and per push in flight — every fragment, at most — the values at
      the push (under ``apply = "rebase"``) and its δ decoded for the checkpoint (4 B each),
      its payload as sent (twice: the core's and the network thread's), the residuals of
      up-link error feedback (4 B, twice, when on and the up codec is not fp32), and a
      published value being applied (4 B of the largest fragment) — its step's activations
      come on top and depend on the model; an island of several devices (`pipeline.mesh`)
      does not donate its step's inputs: 12 B more;
    * syncer, per fragment it owns, at a round's close: Θ and the outer momentum, and the
      new ones beside them until the round's value is accepted (16 B), the delta being
      encoded and the value it makes (8 B) — the merge's fp64 sums (8 B) are gone by then —
      and the values of the last `max_staleness` + 1
      versions stale pushes are anchored on (`pipeline.history`): under the delta down link
      the oldest and the newest in fp32 and the deltas between as sent; a value sent whole in
      a codec as sent, and the newest in fp32; fp32 values whole;
    * Redis, per fragment: the stream's entries until trimmed (`keep_rounds` rounds, at least
      the rounds since a checkpoint, and the open one, of at most one push per learner each,
      and up to two pushes per learner not yet read), one
      snapshot per version a stale push may still name (`max_staleness` + the rounds since a
      checkpoint; under the delta down link all but the oldest kept as the deltas sent:
      `snapshots_bytes`), the latest value, and the checkpoint (Θ and momentum: 8 B a value).
    """
    s, b = cfg.effective_sync(), cfg.broker
    n_max = max(w.fragment_values)
    feedback = s.up_feedback and s.codec_up != "fp32"  # fp32 pushes have no error to keep
    per_value = 12 + 8 + 4 + 12 + 4 * (s.apply == "rebase") + 4 + 8 * feedback
    payloads = sum(value_bytes(cfg, n)["push"] for n in w.fragment_values)
    learner = per_value * w.params + 2 * payloads + 4 * n_max
    own = [w.fragment_values[i::w.syncers] for i in range(w.syncers)]  # fragments dealt round-robin
    syncer_each = max(sum(24 * n + _history_bytes(cfg, n) for n in part) for part in own)
    # the rounds kept and the open one (at most one push per learner each), and up to two
    # pushes per learner not yet read (its last one and, at the end, its final flush)
    entries = (max(b.keep_rounds, b.checkpoint_rounds) + 3) * w.learners
    parts = {"redis_entries_bytes": sum(entries * value_bytes(cfg, n)["push"]
                                        for n in w.fragment_values),
             "redis_snapshots_bytes": sum(snapshots_bytes(cfg, n) for n in w.fragment_values),
             "redis_checkpoints_bytes": sum(8 * n for n in w.fragment_values)}
    redis = sum(parts.values())
    return {"learner_bytes": float(learner), "syncer_bytes": float(syncer_each),
            "redis_bytes": float(redis), **{k: float(v) for k, v in parts.items()},
            "redis_bytes_during_aof_rewrite": 2.0 * redis}


def role_bytes(cfg: RunConfig, fragment_values: Sequence[int], role: str) -> int:
    """`memory`'s arrays of one process of `role` ("learner", or "syncer" serving the
    fragments of `fragment_values`): what it checks against its host when it starts."""
    w = Workload(tuple(fragment_values), cfg.learners, 1.0, 1.0, 1.0)
    return int(memory(cfg, w)[f"{role}_bytes"])


def snapshots_bytes(cfg: RunConfig, n: int) -> int:
    """The most a fragment of `n` values keeps in ``sent:<v>`` and ``global`` at once: the
    versions from `max_staleness` before the checkpoint to the newest, and the latest value
    whole. Under the delta down link each version but the oldest is kept as the delta sent
    (`broker.commit`) — and while a checkpoint commits, the new oldest is whole beside the old
    one — else each is its whole value as sent."""
    s, b, v = cfg.effective_sync(), cfg.broker, value_bytes(cfg, n)
    versions = s.max_staleness + b.checkpoint_rounds + 1
    if s.down_delta:
        return 3 * v["snapshot"] + (versions - 2) * v["publish_steady"]
    return (versions + 1) * v["snapshot"]


def plan(cfg: RunConfig, w: Workload, costs: Costs) -> dict[str, dict]:
    """Every figure of the plan, JSON-able, and what holds training back (if anything)."""
    flows = wire(cfg, w)
    links = link(cfg, w, flows)
    sync = syncer(cfg, w, costs)
    blocked = learner_blocked(cfg, w, costs)
    limits = []
    if links["link_holds_training_back"]:
        limits.append("the link")
    if sync["cores_per_syncer"] > 1:
        limits.append("the syncer (add syncers: each takes a share of the fragments)")
    if blocked["share_of_step"] > 0.05:
        limits.append("the learner's own push and apply (over 5 % of a step)")
    s = cfg.effective_sync()
    return {"inputs": {**asdict(w), "params": w.params, "sync_every": s.sync_every,
                       "fragments": len(w.fragment_values), "quorum": s.quorum,
                       "codec_up": s.codec_up, "codec_down": s.codec_down,
                       "down_delta": s.down_delta},
            "costs": asdict(costs), "wire": flows, "link": links, "syncer": sync,
            "learner": blocked, "memory": memory(cfg, w),
            "holds_training_back": limits}


def _human(n: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {prefix}{unit}"
    return f"{n:,.2f} {unit}"


def format_plan(p: dict[str, dict]) -> list[str]:
    """The plan as lines of text."""
    i, wr, ln, sy, le, me = (p[k] for k in ("inputs", "wire", "link", "syncer", "learner",
                                            "memory"))
    frag = max(i["fragment_values"])
    rows = [
        f"run: {_human(i['params'], '')}values, {i['learners']} learners, H = "
        f"{i['sync_every']}, {i['fragments']} fragments (largest {_human(frag, '')}values), "
        f"K = {i['quorum']}, {i['codec_up']} up / {i['codec_down']}"
        f"{'Δ' if i['down_delta'] else ''} down, a step {i['step_s']:g} s",
        f"up per learner        {_human(_gbps(wr['up_bytes_per_s']) * 1e9, 'bit/s')}",
        f"down per learner      {_human(_gbps(wr['down_bytes_per_s']) * 1e9, 'bit/s')} "
        f"(at most {wr['rounds_per_fragment_per_window']:g} rounds per fragment per H steps)",
        f"data parallel         {_human(_gbps(wr['ring_allreduce_bytes_per_s']) * 1e9, 'bit/s')}"
        f" each way per worker (fp32 ring all-reduce every step): "
        f"{wr['vs_ring_allreduce']:,.0f}× more",
        f"learner link          {ln['learner_link_use']:.1%} used; the largest push takes "
        f"{ln['largest_push_s']:.2f} s against {ln['overlap_s']:.2f} s of overlap",
        f"syncer link           {ln['syncer_link_use']:.1%} used "
        f"({_human(_gbps(wr['syncer_out_bytes_per_s']) * 1e9, 'bit/s')} out)",
        f"syncer CPU            {sy['cores']:.2f} cores in all, {sy['cores_per_syncer']:.2f} "
        f"per syncer; the largest fragment's round {sy['round_s_largest']:.3f} s",
        f"learner data path     {le['share_of_step']:.2%} of a step (push "
        f"{le['push_s_largest']:.3f} s, apply {le['apply_s_largest']:.3f} s)",
        f"memory                learner {_human(me['learner_bytes'], 'B')} + activations, "
        f"syncer {_human(me['syncer_bytes'], 'B')} each",
        f"Redis                 {_human(me['redis_bytes'], 'B')} "
        f"({_human(me['redis_bytes_during_aof_rewrite'], 'B')} during an AOF rewrite): "
        f"entries {_human(me['redis_entries_bytes'], 'B')} (broker.keep_rounds), snapshots "
        f"{_human(me['redis_snapshots_bytes'], 'B')} (sync.max_staleness, "
        f"broker.checkpoint_rounds), checkpoints {_human(me['redis_checkpoints_bytes'], 'B')}",
    ]
    if "bytes_per_token" in wr:
        rows.insert(4, f"bytes per token       {wr['bytes_per_token']:.4f}")
    limits = p["holds_training_back"]
    rows.append("holds training back:  " + ("; ".join(limits) if limits else "nothing"))
    return rows


def fragments_of(sizes: Sequence[int]) -> tuple[int, ...]:
    """The fragment sizes as the plan takes them (validated)."""
    out = tuple(int(n) for n in sizes)
    if not out or min(out) <= 0:
        raise ValueError("every fragment must hold at least one value")
    return out
