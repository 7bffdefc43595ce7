"""Run configuration: frozen dataclasses loaded from one TOML file, validated field by field.

The run-defining part (model, data, inner and outer optimisers, sync policy, mode, learners,
steps, seed) has a stable hash: every process of a distributed run must present the same hash.
The `[engine]` section (virtual-clock speeds and failures of the in-process engine) is not
run-defining and is left out of the hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

MODES = ("ddp", "sync-diloco", "decoupled")
TASKS = ("bytegpt", "llama")  # the built-in tasks (pipeline/task.py)
# a user task: "package.module:factory" (imported only by a process whose own command line
# names the same task; see pipeline/task.py)
USER_TASK = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
DATA_FORMATS = ("auto", "text", "jsonl", "u16", "u32")  # pipeline/data.py
_OPTION_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MAX_OPTIONS = 256
CODECS = ("fp32", "bf16", "int8", "int4")
MERGES = ("rda", "mean", "trimmed", "robust")
APPLIES = ("overwrite", "rebase")
# How much of an outer step a round takes (see FragmentSyncer.round_share).
ROUND_STEPS = ("share", "full")
FINAL_STEPS = ("nesterov", "plain")
GUARD_ACTIONS = ("drop", "clip")
POISONS = ("norm", "tokens", "signflip")  # the in-process engine's poisoned learner


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range; names the field."""


def _rng(lo: float | None = None, hi: float | None = None, choices: tuple | None = None) -> dict:
    return {"lo": lo, "hi": hi, "choices": choices}


@dataclass(frozen=True)
class ModelConfig:
    """Byte-level decoder-only transformer."""

    d_model: int = field(default=128, metadata=_rng(8, 4096))
    n_layers: int = field(default=4, metadata=_rng(1, 64))
    n_heads: int = field(default=4, metadata=_rng(1, 64))
    seq_len: int = field(default=128, metadata=_rng(8, 8192))
    mlp_ratio: int = field(default=4, metadata=_rng(1, 16))
    vocab_size: int = field(default=256, metadata=_rng(256, 65536))


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is split."""

    # "stdlib" (the running interpreter's standard library sources), a text file or folder,
    # a JSONL file (one JSON object per line, its text in `text_field`), or a file of
    # little-endian uint16 (.bin/.u16) or uint32 (.u32) tokens of any tokenizer.
    source: str = "stdlib"
    max_bytes: int = field(default=8_000_000, metadata=_rng(10_000, 10**13))
    eval_fraction: float = field(default=0.02, metadata=_rng(0.001, 0.5))
    eval_batches: int = field(default=8, metadata=_rng(1, 10_000))
    # how to read `source`: "auto" picks by suffix (.jsonl, .bin/.u16, .u32, else text)
    format: str = field(default="auto", metadata={**_rng(choices=DATA_FORMATS), "added": True})
    text_field: str = field(default="text", metadata={"added": True})  # JSONL: the text's key


@dataclass(frozen=True)
class InnerConfig:
    """The learners' inner AdamW optimiser: warmup then cosine decay, global-norm clipping."""

    lr: float = field(default=4e-4, metadata=_rng(1e-7, 1.0))
    warmup_steps: int = field(default=50, metadata=_rng(0, 10**9))
    min_lr_ratio: float = field(default=0.1, metadata=_rng(0.0, 1.0))
    b1: float = field(default=0.9, metadata=_rng(0.0, 0.9999))
    b2: float = field(default=0.95, metadata=_rng(0.0, 0.99999))
    weight_decay: float = field(default=0.1, metadata=_rng(0.0, 10.0))
    clip: float = field(default=1.0, metadata=_rng(1e-6, 1e6))
    batch_size: int = field(default=16, metadata=_rng(1, 65536))


@dataclass(frozen=True)
class OuterConfig:
    """The syncer's outer optimiser: SGD with Nesterov momentum on the merged outer gradient."""

    lr: float = field(default=0.7, metadata=_rng(1e-6, 10.0))
    # 0.7, not DiLoCo's 0.9: lower loss at equal tokens and bytes on the default model and in
    # S1 and S2 (BENCHMARKS.md §1.3, §1.4, §3)
    momentum: float = field(default=0.7, metadata=_rng(0.0, 0.9999))
    nesterov: bool = True


@dataclass(frozen=True)
class SyncConfig:
    """Fragments, schedule, quorum and grace, staleness and wire codecs."""

    fragments: int = field(default=4, metadata=_rng(1, 1024))  # P
    sync_every: int = field(default=100, metadata=_rng(1, 10**7))  # H, inner steps per fragment
    overlap_steps: int = field(default=2, metadata=_rng(0, 10**6))  # tau
    mix_alpha: float = field(default=0.0, metadata=_rng(0.0, 1.0))  # alpha
    # What a merged value does to the steps taken since its push: "rebase" keeps them (the
    # default since 2026-12-04: BENCHMARKS.md §3 measures more goodput at the same quality,
    # §1.3), "overwrite" drops them (Streaming DiLoCo's rule).
    apply: str = field(default="rebase", metadata=_rng(choices=APPLIES))
    quorum: int = field(default=1, metadata=_rng(1, 100_000))  # K
    grace_gamma: float = field(default=0.5, metadata=_rng(0.0, 100.0))
    grace_max_s: float = field(default=30.0, metadata=_rng(0.0, 86_400.0))
    max_staleness: int = field(default=4, metadata=_rng(0, 1_000_000))
    codec_up: str = field(default="int4", metadata=_rng(choices=CODECS))
    # int4 with down_delta (below) since 2026-12-06: BENCHMARKS.md §1.1 and §9 measure the
    # quality the same as bf16 at 3.5× fewer bytes down. Stored runs always carry this field.
    codec_down: str = field(default="int4", metadata=_rng(choices=CODECS))
    quant_block: int = field(default=64, metadata=_rng(2, 1 << 20))
    merge: str = field(default="rda", metadata=_rng(choices=MERGES))
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
    round_step: str = field(default="share", metadata=_rng(choices=ROUND_STEPS))
    # The poison guard (pipeline/guard.py): refuse a contribution that claims more tokens than
    # steps × its learner's maximum tokens per step, and one whose norm per inner step exceeds
    # guard_norm_k × the median of the fragment's recently accepted ones (dropped, or clipped
    # to that bound). Added after runs were recorded: at their defaults, out of the run hash.
    guard: bool = field(default=True, metadata={"added": True})
    guard_norm_k: float = field(default=10.0, metadata={**_rng(1.0, 1e9), "added": True})
    guard_action: str = field(default="drop",
                              metadata={**_rng(choices=GUARD_ACTIONS), "added": True})
    # Until a fragment has a history, its norm bound per step is guard_prior × inner.lr ×
    # √(fragment size): an AdamW step moves each coordinate by a few lr at most. 0: no bound
    # before the history (set it for tasks whose inner optimizer is not AdamW-like).
    guard_prior: float = field(default=10.0, metadata={**_rng(0.0, 1e9), "added": True})
    # merge = "trimmed" | "robust" (pipeline/merge.py TrimmedMerge): the weight fraction of a
    # round's contributions left out at each end of every coordinate. Both need contributions
    # to compare: with untrusted learners, set quorum ≥ 3.
    trim: float = field(default=0.25, metadata={**_rng(0.01, 0.49), "added": True})
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
    final_step: str = field(default="plain", metadata={**_rng(choices=FINAL_STEPS),
                                                       "added": True, "before": "nesterov"})

    @property
    def delta_h(self) -> int:
        """Inner steps between two consecutive fragment pushes of one learner."""
        return max(1, round(self.sync_every / self.fragments))


@dataclass(frozen=True)
class BrokerConfig:
    """Timings and limits of the distributed pipeline (Redis streams, leases, heartbeats)."""

    heartbeat_s: float = field(default=1.0, metadata=_rng(0.01, 3600.0))
    heartbeat_ttl_s: float = field(default=5.0, metadata=_rng(0.05, 86_400.0))
    block_ms: int = field(default=100, metadata=_rng(1, 60_000))
    socket_timeout_s: float = field(default=10.0, metadata=_rng(0.1, 3600.0))
    lease_ms: int = field(default=10_000, metadata=_rng(100, 3_600_000))
    claim_idle_ms: int = field(default=60_000, metadata=_rng(100, 86_400_000))
    max_deliveries: int = field(default=10, metadata=_rng(1, 1_000_000))
    keep_rounds: int = field(default=50, metadata=_rng(0, 10**9))
    # The syncer writes a fragment's full fp32 state (Θ, outer momentum) every
    # `checkpoint_rounds` rounds or `checkpoint_s` seconds (0: rounds only), whichever comes
    # first, and at the end of the run; every round commits its record, acknowledgements and
    # published value, and recovery replays the rounds since the checkpoint
    # (`workers.recovery`). The stream keeps those rounds' entries whatever `keep_rounds` says.
    checkpoint_rounds: int = field(default=20, metadata=_rng(1, 10**6))
    checkpoint_s: float = field(default=120.0, metadata=_rng(0.0, 86_400.0))
    # A learner's push counts as acknowledged once this many replicas of its Redis (cluster)
    # master hold it (WAIT after the XADD, on the same connection; 0: the master's answer):
    # with replicas, a failover then loses no acknowledged push
    wait_replicas: int = field(default=0, metadata=_rng(0, 16))
    wait_timeout_ms: int = field(default=1000, metadata=_rng(1, 600_000))
    archive_dir: str = ""  # archive fragment entries here (msgpack files) before trimming
    stream_max_entries: int = field(default=100_000, metadata=_rng(10, 10**9))
    snapshot_timeout_s: float = field(default=10.0, metadata=_rng(0.01, 86_400.0))
    max_payload_bytes: int = field(default=256 * 2**20, metadata=_rng(1024, 2**34))
    # a Redis value larger than this is stored in pieces of this size (`broker.pieces`)
    piece_bytes: int = field(default=64 * 2**20, metadata=_rng(1024, 2**31))
    zmq_hwm: int = field(default=16, metadata=_rng(1, 1_000_000))


@dataclass(frozen=True)
class EngineConfig:
    """Virtual clock of the in-process engine (not part of the run hash)."""

    step_s: float = field(default=0.333, metadata=_rng(1e-6, 1e6))
    # Per-learner speed factors (1.0 = step_s per step; 1/3 = three times slower); empty = all 1.
    speeds: tuple[float, ...] = ()
    # Failures as (learner, at_s, down_s) triples.
    failures: tuple[tuple[int, float, float], ...] = ()
    latency_s: float = field(default=0.01, metadata=_rng(0.0, 1e6))
    bandwidth_bps: float = field(default=1e9, metadata=_rng(1.0, 1e15))
    sync_s: float = field(default=0.02, metadata=_rng(0.0, 1e6))
    eval_every: int = field(default=0, metadata=_rng(0, 10**9))  # 0: only first and last
    # A poisoned learner (benchmarks of the poison guard): learner `poison_learner` sends
    # δ × poison_scale ("norm"), claims tokens × poison_scale ("tokens"), or sends −δ
    # ("signflip", at an honest norm). -1: every learner is honest.
    poison_learner: int = field(default=-1, metadata={**_rng(-1, 100_000), "added": True})
    poison: str = field(default="norm", metadata={**_rng(choices=POISONS), "added": True})
    poison_scale: float = field(default=1e4, metadata={**_rng(1e-6, 1e18), "added": True})


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs. `mode`, `learners`, `steps` and `seed` are run-defining."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    sync: SyncConfig = SyncConfig()
    broker: BrokerConfig = BrokerConfig()
    engine: EngineConfig = EngineConfig()
    mode: str = field(default="decoupled", metadata=_rng(choices=MODES))
    learners: int = field(default=4, metadata=_rng(1, 100_000))
    steps: int = field(default=1000, metadata=_rng(1, 10**9))
    seed: int = field(default=0, metadata=_rng(0, 2**31 - 1))
    # what is trained (pipeline/task.py): a built-in task sized by [model], or a user task
    # "package.module:factory" called with the [task_options] table as keyword arguments.
    # Added after runs were recorded, so at their defaults they are left out of the run hash
    # (those runs keep theirs).
    task: str = field(default="bytegpt", metadata={"added": True})
    task_options: tuple[tuple[str, Any], ...] = field(default=(), metadata={"added": True})
    # warm start (pipeline/warmstart.py): version 0 from this checkpoint file instead of the
    # task's initial values; `init_sha256` is the loaded values' hash, filled in when the run
    # is stored, so a process given another file is refused
    init_from: str = field(default="", metadata={"added": True})
    init_sha256: str = field(default="", metadata={"added": True})

    def options(self) -> dict[str, Any]:
        """The [task_options] table as a dict (lists as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.task_options}

    def effective_sync(self) -> SyncConfig:
        """The sync policy the mode implies: sync-diloco is P=1, K=M, no grace, blocking."""
        if self.mode == "sync-diloco":
            return replace(self.sync, fragments=1, quorum=self.learners, grace_max_s=0.0,
                           overlap_steps=0, strict=True, elastic_quorum=False,
                           round_step="full")
        return self.sync

    def run_hash(self) -> str:
        """Stable sha256 over the run-defining fields (engine and broker timings excluded).

        A field added after runs were recorded (metadata ``added``) counts only when it is not
        at the value those runs ran with (its default, or its metadata ``before``), so the runs
        recorded before it keep their hash and still open.
        """
        d = _drop_added(to_dict(_normalized(self)), self)
        d.pop("engine")
        d.pop("broker")
        text = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _recorded_before(f) -> Any:
    """The value an added field's runs recorded before it existed ran with: its metadata
    ``before`` when the default has changed since, else its default."""
    return f.metadata.get("before", f.default)


def _drop_added(d: dict, cfg: RunConfig, *, keep_before: bool = False) -> dict:
    """`d` (to_dict of `cfg`) without the fields added after runs were recorded that are at
    the value those runs ran with, top level and in sections. `keep_before`: keep the fields
    whose default has changed since (metadata ``before``) whatever their value — a file read
    back with `from_dict` must not take today's default for them."""
    def drop(f, value) -> bool:
        return (bool(f.metadata.get("added")) and value == _recorded_before(f)
                and not (keep_before and "before" in f.metadata))

    for f in fields(cfg):
        if drop(f, getattr(cfg, f.name)):
            d.pop(f.name)
    for section in _SECTIONS:
        obj = getattr(cfg, section)
        for f in fields(obj):
            if drop(f, getattr(obj, f.name)):
                d[section].pop(f.name)
    return d


def from_stored(data: dict) -> RunConfig:
    """A run's stored configuration (`dumps_toml`'s layout, parsed): as `from_dict`, except
    that a field whose default changed after it was added (metadata ``before``) and that the
    text leaves out — a run recorded before the field existed — takes the value such runs ran
    with, not today's default (`dumps_toml` always writes those fields)."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for f in fields(RunConfig):
        if "before" in f.metadata:
            data.setdefault(f.name, f.metadata["before"])
    for section, cls in _SECTIONS.items():
        for f in fields(cls):
            if "before" in f.metadata and f.name not in data.get(section, {}):
                data.setdefault(section, {})[f.name] = f.metadata["before"]
    return from_dict(data)


def _task_options(value: Any) -> tuple[tuple[str, Any], ...]:
    """Validate the [task_options] table: at most 256 identifier keys, each a string, number,
    boolean or a list of those (no nested tables)."""
    if not isinstance(value, dict | list | tuple):
        raise ConfigError("task_options: expected a table")
    items = value.items() if isinstance(value, dict) else value
    out = []
    for item in items:
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise ConfigError("task_options: expected a table")
        k, v = item
        if not (isinstance(k, str) and _OPTION_KEY.fullmatch(k)):
            raise ConfigError(f"task_options: {k!r} is not a valid option name")
        scalar = (str, int, float, bool)
        if isinstance(v, list | tuple) and all(isinstance(x, scalar) for x in v):
            v = tuple(v)
        elif not isinstance(v, scalar):
            raise ConfigError(f"task_options.{k}: expected a string, number, boolean or a "
                              f"list of those, got {type(v).__name__}")
        if any(isinstance(x, float) and not math.isfinite(x)
               for x in (v if isinstance(v, tuple) else (v,))):
            raise ConfigError(f"task_options.{k}: must be finite")
        out.append((k, v))
    if len(out) > _MAX_OPTIONS:
        raise ConfigError(f"task_options: more than {_MAX_OPTIONS} options")
    if len({k for k, _ in out}) != len(out):
        raise ConfigError("task_options: an option is given twice")
    return tuple(sorted(out, key=lambda kv: kv[0]))


def _check_task(name: Any) -> str:
    if not isinstance(name, str) or not (name in TASKS or USER_TASK.fullmatch(name)):
        raise ConfigError(f"task: {name!r} is neither a built-in task ({', '.join(TASKS)}) nor "
                          f"a user task \"package.module:factory\"")
    return name


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "inner": InnerConfig,
             "outer": OuterConfig, "sync": SyncConfig, "broker": BrokerConfig,
             "engine": EngineConfig}


def _normalized(obj: Any) -> Any:
    """A copy with every float-typed field stored as a float (so 30 and 30.0 hash alike)."""
    if not dataclasses.is_dataclass(obj):
        return obj
    changes = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if f.type == "float" and isinstance(v, int | float) and not isinstance(v, bool):
            changes[f.name] = float(v)
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _normalized(v)
    return replace(obj, **changes)


def _check_value(path: str, f: dataclasses.Field, value: Any) -> Any:
    """Coerce and range-check one value; raise ConfigError naming `path`."""
    want = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    meta = f.metadata or {}
    if want == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if want == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
    elif want == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        value = float(value)
    elif want == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(choices)}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and hi is not None and not (lo <= value <= hi):
        raise ConfigError(f"{path}: {value!r} is out of range [{lo}, {hi}]")
    return value


def _engine_tuple(path: str, name: str, value: Any) -> tuple:
    if name == "speeds":
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 1000 for v in value
        ):
            raise ConfigError(f"{path}: expected a list of speed factors in (0, 1000]")
        return tuple(float(v) for v in value)
    out = []
    for item in value if isinstance(value, list | tuple) else [None]:
        if not (isinstance(item, list | tuple) and len(item) == 3):
            raise ConfigError(f"{path}: expected a list of [learner, at_s, down_s] triples")
        learner, at_s, down_s = item
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool)
                      for v in (at_s, down_s))
        if (not isinstance(learner, int) or isinstance(learner, bool) or learner < 0
                or not numbers or at_s < 0 or down_s <= 0):
            raise ConfigError(f"{path}: bad failure {item!r} (learner >= 0, at_s >= 0, down_s > 0)")
        out.append((int(learner), float(at_s), float(down_s)))
    return tuple(out)


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a table")
    known = {f.name: f for f in fields(cls)}
    if cls is SyncConfig and "partial_round_scaling" in data:  # configs of earlier releases
        raise ConfigError(f"{prefix}.partial_round_scaling: replaced by {prefix}.round_step "
                          f"(\"share\" or \"full\"); partial rounds now also decay the outer "
                          f"momentum by their share, so runs recorded with the old field cannot "
                          f"be replayed by this release")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown field (known: {', '.join(known)})")
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}"
        if cls is EngineConfig and name in ("speeds", "failures"):
            kwargs[name] = _engine_tuple(path, name, value)
        else:
            kwargs[name] = _check_value(path, known[name], value)
    return cls(**kwargs)


def from_dict(data: dict) -> RunConfig:
    """Build and validate a RunConfig from a nested dict (the TOML layout)."""
    top = {f.name: f for f in fields(RunConfig)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name in _SECTIONS:
            kwargs[name] = _build(_SECTIONS[name], value, name)
        elif name == "task_options":
            kwargs[name] = _task_options(value)
        elif name == "task":
            kwargs[name] = _check_task(value)
        elif name in top:
            kwargs[name] = _check_value(name, top[name], value)
        else:
            raise ConfigError(f"{name}: unknown field (known: {', '.join(top)})")
    cfg = RunConfig(**kwargs)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> RunConfig:
    """Cross-field checks; raise ConfigError naming the field."""
    for section in _SECTIONS:
        obj = getattr(cfg, section)
        for f in fields(obj):
            if not (section == "engine" and f.name in ("speeds", "failures")):
                _check_value(f"{section}.{f.name}", f, getattr(obj, f.name))
    for name in ("mode", "learners", "steps", "seed"):
        _check_value(name, next(f for f in fields(RunConfig) if f.name == name), getattr(cfg, name))
    _check_task(cfg.task)
    if not isinstance(cfg.init_from, str) or len(cfg.init_from) > 4096 or "\0" in cfg.init_from:
        raise ConfigError("init_from: expected a file path")
    if not isinstance(cfg.init_sha256, str) or (
            cfg.init_sha256 and not re.fullmatch(r"[0-9a-f]{64}", cfg.init_sha256)):
        raise ConfigError("init_sha256: expected 64 hex digits (filled in when the run is "
                          "stored)")
    if cfg.init_sha256 and not cfg.init_from:
        raise ConfigError("init_sha256: set without init_from")
    if _task_options(cfg.task_options) != cfg.task_options:
        raise ConfigError("task_options: not in canonical form (build it with from_dict)")
    if cfg.task_options and cfg.task in TASKS:
        raise ConfigError(f"task_options: the built-in task {cfg.task!r} takes its size from "
                          f"[model]; task options are for user tasks")
    if cfg.model.d_model % cfg.model.n_heads:
        raise ConfigError(f"model.n_heads: {cfg.model.n_heads} must divide model.d_model "
                          f"({cfg.model.d_model})")
    if cfg.task == "llama" and (cfg.model.d_model // cfg.model.n_heads) % 2:
        raise ConfigError(f"model.n_heads: the llama task needs an even head width (d_model "
                          f"{cfg.model.d_model} / n_heads {cfg.model.n_heads} is odd)")
    if cfg.sync.quorum > cfg.learners:
        raise ConfigError(f"sync.quorum: {cfg.sync.quorum} is out of range [1, learners="
                          f"{cfg.learners}]")
    if cfg.engine.speeds and len(cfg.engine.speeds) != cfg.learners:
        raise ConfigError(f"engine.speeds: has {len(cfg.engine.speeds)} entries, expected "
                          f"learners={cfg.learners}")
    if cfg.broker.socket_timeout_s * 1000 <= cfg.broker.block_ms + 500:
        raise ConfigError(f"broker.socket_timeout_s: {cfg.broker.socket_timeout_s} s must exceed "
                          f"broker.block_ms ({cfg.broker.block_ms} ms) by at least 0.5 s")
    for learner, _, _ in cfg.engine.failures:
        if learner >= cfg.learners:
            raise ConfigError(f"engine.failures: learner {learner} is out of range "
                              f"[0, {cfg.learners - 1}]")
    return cfg


def demo_config() -> RunConfig:
    """The no-argument demo of `diloco run`: a few minutes on a 2-core machine."""
    return from_dict({
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "data": {"max_bytes": 4_000_000},
        "inner": {"lr": 1e-3, "warmup_steps": 30, "batch_size": 16},
        "sync": {"fragments": 2, "sync_every": 40},
        "learners": 3, "steps": 1500,
    })


def to_dict(cfg: RunConfig) -> dict:
    """Nested plain dict (TOML layout), tuples as lists, task options as a table."""
    d = json.loads(json.dumps(dataclasses.asdict(cfg)))
    d["task_options"] = json.loads(json.dumps(cfg.options()))
    return d


def load(path: str | Path) -> RunConfig:
    """Load and validate a TOML configuration file.

    Raises:
        ConfigError: The file cannot be read, is not TOML, or holds an invalid configuration.
    """
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror or e}") from e
    return from_dict(data)


def override(cfg: RunConfig, **updates: Any) -> RunConfig:
    """Apply dotted-path overrides (e.g. ``{"sync.fragments": 2, "steps": 10}``) and validate."""
    d = to_dict(cfg)
    for key, value in updates.items():
        node = d
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                raise ConfigError(f"{key}: unknown section {p!r}")
            node = node[p]
        node[leaf] = value
    return from_dict(d)


def dumps_toml(cfg: RunConfig) -> str:
    """Serialise to TOML (the subset this configuration uses). A field added after runs were
    recorded is left out while at the value those runs ran with, so versions before it read
    the file too — except one whose default has changed since (metadata ``before``), which is
    always written."""
    d = _drop_added(to_dict(cfg), cfg, keep_before=True)
    lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for section, table in d.items():
        if isinstance(table, dict):
            lines.append(f"\n[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v, ensure_ascii=False)
