"""The sections of a run's configuration (`[model]`, `[data]`, `[inner]`, `[outer]`, `[sync]`,
`[broker]`, `[engine]`): frozen dataclasses whose fields carry their bounds in metadata
(`lo`, `hi`, `choices`; `added` for a field added after runs were recorded, `before` for the
value those ran with). `pipeline.config` builds and checks them; import them from there."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MODES = ("ddp", "sync-diloco", "decoupled")
TASKS = ("bytegpt", "llama")  # the built-in tasks (pipeline/task.py)
# a user task: "package.module:factory" (imported only by a process whose own command line
# names the same task; see pipeline/task.py)
USER_TASK = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
DATA_FORMATS = ("auto", "text", "jsonl", "u16", "u32")  # pipeline/data.py
OPTION_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MAX_OPTIONS = 256
CODECS = ("fp32", "bf16", "int8", "int4")
MERGES = ("rda", "mean", "trimmed", "robust")
APPLIES = ("overwrite", "rebase")
INNER_OPTIMIZERS = ("adamw", "muon")  # pipeline/task.py inner_optimizer
# How much of an outer step a round takes (see FragmentSyncer.round_share).
ROUND_STEPS = ("share", "full")
FINAL_STEPS = ("nesterov", "plain")
GUARD_ACTIONS = ("drop", "clip")
POISONS = ("norm", "tokens", "signflip")  # the in-process engine's poisoned learner


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range; names the field."""


def bounds(lo: float | None = None, hi: float | None = None, choices: tuple | None = None) -> dict:
    """A field's metadata: the range or the choices `pipeline.config` checks it against."""
    return {"lo": lo, "hi": hi, "choices": choices}


@dataclass(frozen=True)
class ModelConfig:
    """Byte-level decoder-only transformer."""

    d_model: int = field(default=128, metadata=bounds(8, 4096))
    n_layers: int = field(default=4, metadata=bounds(1, 64))
    n_heads: int = field(default=4, metadata=bounds(1, 64))
    seq_len: int = field(default=128, metadata=bounds(8, 8192))
    mlp_ratio: int = field(default=4, metadata=bounds(1, 16))
    vocab_size: int = field(default=256, metadata=bounds(256, 65536))


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is split."""

    # "stdlib" (the running interpreter's standard library sources), a text file or folder,
    # a JSONL file (one JSON object per line, its text in `text_field`), or a file of
    # little-endian uint16 (.bin/.u16) or uint32 (.u32) tokens of any tokenizer.
    source: str = "stdlib"
    max_bytes: int = field(default=8_000_000, metadata=bounds(10_000, 10**13))
    eval_fraction: float = field(default=0.02, metadata=bounds(0.001, 0.5))
    eval_batches: int = field(default=8, metadata=bounds(1, 10_000))
    # how to read `source`: "auto" picks by suffix (.jsonl, .bin/.u16, .u32, else text)
    format: str = field(default="auto", metadata={**bounds(choices=DATA_FORMATS), "added": True})
    text_field: str = field(default="text", metadata={"added": True})  # JSONL: the text's key


@dataclass(frozen=True)
class InnerConfig:
    """The learners' inner optimiser (AdamW, or Muon for the matrices): warmup then cosine
    decay, global-norm clipping."""

    lr: float = field(default=4e-4, metadata=bounds(1e-7, 1.0))
    warmup_steps: int = field(default=50, metadata=bounds(0, 10**9))
    min_lr_ratio: float = field(default=0.1, metadata=bounds(0.0, 1.0))
    b1: float = field(default=0.9, metadata=bounds(0.0, 0.9999))
    b2: float = field(default=0.95, metadata=bounds(0.0, 0.99999))
    weight_decay: float = field(default=0.1, metadata=bounds(0.0, 10.0))
    clip: float = field(default=1.0, metadata=bounds(1e-6, 1e6))
    batch_size: int = field(default=16, metadata=bounds(1, 65536))
    # "muon": the hidden matrices (2-D; not the embeddings or the output head) follow Muon
    # (`optax.contrib.muon`) at `muon_lr` on the same schedule, the rest its AdamW at `lr`
    # (`pipeline.task.inner_optimizer`)
    optimizer: str = field(default="adamw", metadata={**bounds(choices=INNER_OPTIMIZERS),
                                                      "added": True})
    muon_lr: float = field(default=0.02, metadata={**bounds(1e-7, 10.0), "added": True})


@dataclass(frozen=True)
class OuterConfig:
    """The syncer's outer optimiser: SGD with Nesterov momentum on the merged outer gradient."""

    lr: float = field(default=0.7, metadata=bounds(1e-6, 10.0))
    # 0.7, not DiLoCo's 0.9: lower loss at equal tokens and bytes on the default model and in
    # S1 and S2 (BENCHMARKS.md §1.3, §1.4, §3)
    momentum: float = field(default=0.7, metadata=bounds(0.0, 0.9999))
    nesterov: bool = True


@dataclass(frozen=True)
class SyncConfig:
    """Fragments, schedule, quorum and grace, staleness and wire codecs."""

    fragments: int = field(default=4, metadata=bounds(1, 1024))  # P
    sync_every: int = field(default=100, metadata=bounds(1, 10**7))  # H, inner steps per fragment
    overlap_steps: int = field(default=2, metadata=bounds(0, 10**6))  # tau
    mix_alpha: float = field(default=0.0, metadata=bounds(0.0, 1.0))  # alpha
    # What a merged value does to the steps taken since its push: "rebase" keeps them (the
    # default since 2026-12-04: BENCHMARKS.md §3 measures more goodput at the same quality,
    # §1.3), "overwrite" drops them (Streaming DiLoCo's rule).
    apply: str = field(default="rebase", metadata=bounds(choices=APPLIES))
    quorum: int = field(default=1, metadata=bounds(1, 100_000))  # K
    grace_gamma: float = field(default=0.5, metadata=bounds(0.0, 100.0))
    grace_max_s: float = field(default=30.0, metadata=bounds(0.0, 86_400.0))
    max_staleness: int = field(default=4, metadata=bounds(0, 1_000_000))
    codec_up: str = field(default="int4", metadata=bounds(choices=CODECS))
    # int4 with down_delta (below) since 2026-12-06: BENCHMARKS.md §1.1 and §9 measure the
    # quality the same as bf16 at 3.5× fewer bytes down. Stored runs always carry this field.
    codec_down: str = field(default="int4", metadata=bounds(choices=CODECS))
    quant_block: int = field(default=64, metadata=bounds(2, 1 << 20))
    merge: str = field(default="rda", metadata=bounds(choices=MERGES))
    # Block at push + tau until the merged value arrives (sync-diloco always blocks; this flag
    # makes decoupled runs deterministic for tests and equivalence checks).
    strict: bool = False
    # A dead learner leaves the quorum arithmetic (K is capped by the live learners). The
    # synchronous baseline turns this off: every round waits for all K, dead or not.
    elastic_quorum: bool = True
    # How much of an outer step a round takes (FragmentSyncer.round_share): "share" (n/L of a
    # step when n of L live learners contributed, momentum decayed by μ^(n/L): the outer update
    # per unit of work does not depend on how pushes group into rounds) or "full" (one step per
    # round, as synchronous DiLoCo; sync-diloco always uses it).
    round_step: str = field(default="share", metadata=bounds(choices=ROUND_STEPS))
    # The poison guard (pipeline/guard.py): refuse a contribution that claims more tokens than
    # steps × its learner's maximum tokens per step, and one whose norm per inner step exceeds
    # guard_norm_k × the median of the fragment's recently accepted ones (dropped, or clipped
    # to that bound). Added after runs were recorded: at their defaults, out of the run hash.
    guard: bool = field(default=True, metadata={"added": True})
    guard_norm_k: float = field(default=10.0, metadata={**bounds(1.0, 1e9), "added": True})
    guard_action: str = field(default="drop",
                              metadata={**bounds(choices=GUARD_ACTIONS), "added": True})
    # Until a fragment has a history, its norm bound per step is guard_prior × inner.lr ×
    # √(fragment size): an AdamW step moves each coordinate by a few lr at most. 0: no bound
    # before the history (set it for tasks whose inner optimizer is not AdamW-like).
    guard_prior: float = field(default=10.0, metadata={**bounds(0.0, 1e9), "added": True})
    # merge = "trimmed" | "robust" (pipeline/merge.py TrimmedMerge): the weight fraction of a
    # round's contributions left out at each end of every coordinate. Both need contributions
    # to compare: with untrusted learners, set quorum ≥ 3.
    trim: float = field(default=0.25, metadata={**bounds(0.01, 0.49), "added": True})
    # The down link as deltas (pipeline/syncer.py `encode_down`): each merged value goes out as
    # codec_down(Θ(v) − R(v−1)) against the exact reference R(v−1) every learner holds, and
    # R(v) = R(v−1) + that delta decoded — so the quantisation error of one publish is carried
    # into the next (error feedback) and every learner holds R(v) bit for bit (the header
    # carries its SHA-256). Snapshots hold R(v) in fp32 for rejoining learners. On by default
    # since 2026-12-06; runs recorded before the field existed ran without it ("before").
    down_delta: bool = field(default=True, metadata={"added": True, "before": False})
    # Up-link error feedback (pipeline/learner.py `LearnerCore._push`): each push sends
    # codec_up(δ + e) and keeps e ← (δ + e) − decoded, the part of its contributions the
    # rounds have not seen yet, so the quantisation error of one push goes out with the next
    # instead of being lost (a push that was not merged gives its e back).
    up_feedback: bool = field(default=False, metadata={"added": True})
    # The outer step of the rounds that merge a learner's last push (the final flush;
    # pipeline/syncer.py `FragmentSyncer.close`): "plain" (the default since 2026-12-04)
    # takes Θ ← Θ − lr·share·Δ without the momentum's look-ahead, which no later round would
    # correct; "nesterov" steps them like every other round (BENCHMARKS.md §1.3; runs
    # recorded before the field existed open with it: "before").
    final_step: str = field(default="plain", metadata={**bounds(choices=FINAL_STEPS),
                                                       "added": True, "before": "nesterov"})

    @property
    def delta_h(self) -> int:
        """Inner steps between two consecutive fragment pushes of one learner."""
        return max(1, round(self.sync_every / self.fragments))


@dataclass(frozen=True)
class BrokerConfig:
    """Timings and limits of the distributed pipeline (Redis streams, leases, heartbeats)."""

    heartbeat_s: float = field(default=1.0, metadata=bounds(0.01, 3600.0))
    heartbeat_ttl_s: float = field(default=5.0, metadata=bounds(0.05, 86_400.0))
    block_ms: int = field(default=100, metadata=bounds(1, 60_000))
    socket_timeout_s: float = field(default=10.0, metadata=bounds(0.1, 3600.0))
    lease_ms: int = field(default=10_000, metadata=bounds(100, 3_600_000))
    claim_idle_ms: int = field(default=60_000, metadata=bounds(100, 86_400_000))
    max_deliveries: int = field(default=10, metadata=bounds(1, 1_000_000))
    keep_rounds: int = field(default=50, metadata=bounds(0, 10**9))
    # The syncer writes a fragment's full fp32 state (Θ, outer momentum) every
    # `checkpoint_rounds` rounds or `checkpoint_s` seconds (0: rounds only), whichever comes
    # first, and at the end of the run; every round commits its record, acknowledgements and
    # published value, and recovery replays the rounds since the checkpoint
    # (`workers.recovery`). The stream keeps those rounds' entries whatever `keep_rounds` says.
    checkpoint_rounds: int = field(default=20, metadata=bounds(1, 10**6))
    checkpoint_s: float = field(default=120.0, metadata=bounds(0.0, 86_400.0))
    # A learner's push counts as acknowledged once this many replicas of its Redis (cluster)
    # master hold it (WAIT after the XADD, on the same connection; 0: the master's answer):
    # with replicas, a failover then loses no acknowledged push
    wait_replicas: int = field(default=0, metadata=bounds(0, 16))
    wait_timeout_ms: int = field(default=1000, metadata=bounds(1, 600_000))
    archive_dir: str = ""  # archive fragment entries here (msgpack files) before trimming
    stream_max_entries: int = field(default=100_000, metadata=bounds(10, 10**9))
    snapshot_timeout_s: float = field(default=10.0, metadata=bounds(0.01, 86_400.0))
    max_payload_bytes: int = field(default=256 * 2**20, metadata=bounds(1024, 2**34))
    # a Redis value larger than this is stored in pieces of this size (`broker.pieces`)
    piece_bytes: int = field(default=64 * 2**20, metadata=bounds(1024, 2**31))
    zmq_hwm: int = field(default=16, metadata=bounds(1, 1_000_000))


@dataclass(frozen=True)
class EngineConfig:
    """Virtual clock of the in-process engine (not part of the run hash)."""

    step_s: float = field(default=0.333, metadata=bounds(1e-6, 1e6))
    # Per-learner speed factors (1.0 = step_s per step; 1/3 = three times slower); empty = all 1.
    speeds: tuple[float, ...] = ()
    # Failures as (learner, at_s, down_s) triples.
    failures: tuple[tuple[int, float, float], ...] = ()
    latency_s: float = field(default=0.01, metadata=bounds(0.0, 1e6))
    bandwidth_bps: float = field(default=1e9, metadata=bounds(1.0, 1e15))
    sync_s: float = field(default=0.02, metadata=bounds(0.0, 1e6))
    eval_every: int = field(default=0, metadata=bounds(0, 10**9))  # 0: only first and last
    # A poisoned learner (benchmarks of the poison guard): learner `poison_learner` sends
    # δ × poison_scale ("norm"), claims tokens × poison_scale ("tokens"), or sends −δ
    # ("signflip", at an honest norm). -1: every learner is honest.
    poison_learner: int = field(default=-1, metadata={**bounds(-1, 100_000), "added": True})
    poison: str = field(default="norm", metadata={**bounds(choices=POISONS), "added": True})
    poison_scale: float = field(default=1e4, metadata={**bounds(1e-6, 1e18), "added": True})
