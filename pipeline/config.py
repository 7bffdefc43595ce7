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

# the sections, re-exported: `pipeline.config` is where users and the project import them
from pipeline.config_sections import (  # noqa: F401
    APPLIES,
    CODECS,
    DATA_FORMATS,
    FINAL_STEPS,
    GUARD_ACTIONS,
    MAX_OPTIONS,
    MERGES,
    MODES,
    OPTION_KEY,
    POISONS,
    ROUND_STEPS,
    TASKS,
    USER_TASK,
    BrokerConfig,
    ConfigError,
    DataConfig,
    EngineConfig,
    InnerConfig,
    ModelConfig,
    OuterConfig,
    SyncConfig,
    bounds,
)


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
    mode: str = field(default="decoupled", metadata=bounds(choices=MODES))
    learners: int = field(default=4, metadata=bounds(1, 100_000))
    steps: int = field(default=1000, metadata=bounds(1, 10**9))
    seed: int = field(default=0, metadata=bounds(0, 2**31 - 1))
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
        if not (isinstance(k, str) and OPTION_KEY.fullmatch(k)):
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
    if len(out) > MAX_OPTIONS:
        raise ConfigError(f"task_options: more than {MAX_OPTIONS} options")
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
