"""What is trained: the task a run names — a built-in one (``task = "bytegpt"`` or
``"llama"``, sized by ``[model]``) or the user's own (``task = "package.module:factory"``, called
as ``factory(cfg, **task_options)``).

A task gives every process what it needs of the model and the data, and nothing of the loop:

* ``param_shapes()`` — flat name → shape of every parameter (float32), in a fixed order. The
  syncer, the fragments and the wire need only this; it is computed without training
  (``jax.eval_shape`` of the initialiser);
* ``init_params(seed)`` — the initial parameters as a flat ``name → array`` dict;
* ``is_embedding(name)`` — embeddings are merged by weighted mean (not radial-directional
  averaging) and live in their own fragment;
* ``loss_and_accuracy(params, batch)`` — jittable: mean loss and accuracy of a batch;
* ``logits(params, tokens)`` — jittable next-token logits (``diloco sample``; optional);
* ``optimizer()`` — the inner optax optimizer (default: AdamW of ``[inner]``);
* ``data()`` — where batches come from: ``batch(shard, step, batch_size)`` for learner shard
  ``shard`` at inner step ``step`` (a pure function of them and the run's seed, so restarts
  and replays are exact) and ``eval_batches(n, batch_size)`` (default: the run's ``[data]``
  token corpus, `pipeline.data`);
* ``tokens_per_step()`` — the tokens of one inner step (the merge weighs contributions by
  tokens).

A user model keeps its parameters as any pytree of float32 arrays (nested dicts and lists, as
Flax or Equinox produce): `TreeTask` flattens them with `pipeline.tree` (names are paths,
``layers/0/attn/wq``); everything outside the task sees flat dicts.

**Importing a user task.** The configuration stored in Redis names the task, but reading it
never imports code: a process imports ``package.module`` only when its own command line
(``--task``) or its local configuration file names the same task (`task_of`'s ``local``).
Read-only tools open such a run from the parameter spec stored next to the configuration
(`spec_task`), without the task's code.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pipeline import llama, model, tree
from pipeline.config import TASKS, ConfigError, InnerConfig, RunConfig
from pipeline.data import run_corpus
from pipeline.limits import MAX_NDIM, MAX_TENSORS

Params = dict[str, jax.Array]
__all__ = ["TASKS", "ByteGPT", "Data", "Params", "SpecTask", "Task", "TaskNotNamed",
           "TreeTask", "inner_optimizer", "n_params", "param_spec", "spec_task", "stored_spec",
           "task_of"]

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./:-]{0,199}")  # a flat parameter name
MAX_PARAMS = 2**40  # the wire's bound on one fragment's elements (broker.codec)


class Data(Protocol):
    """Where a task's batches come from (see the module docstring)."""

    def batch(self, shard: int, step: int, batch_size: int) -> Any: ...

    def eval_batches(self, n: int, batch_size: int) -> Sequence[Any]: ...


class Task(Protocol):
    """The model and data side of a run (see the module docstring)."""

    name: str

    def param_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def init_params(self, seed: int) -> Params: ...

    def is_embedding(self, name: str) -> bool: ...

    def loss_and_accuracy(self, params: Params, batch: Any) -> tuple[Any, Any]: ...

    def logits(self, params: Params, tokens: jax.Array) -> jax.Array: ...

    def optimizer(self) -> optax.GradientTransformation: ...

    def data(self) -> Data: ...

    def tokens_per_step(self) -> int: ...


class TaskNotNamed(ConfigError):
    """The run trains a user task that this process was not told to import."""


def inner_optimizer(cfg: InnerConfig, total_steps: int,
                    is_embedding: Callable[[str], bool] | None = None
                    ) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on a linear-warmup + cosine-decay schedule.

    Under ``optimizer = "muon"`` the hidden matrices of a flat parameter dict (2-D; not the
    embeddings, which `is_embedding` names, and not the output projection, a tensor named
    ``head``) follow Muon at `muon_lr` on the same schedule's shape, decaying by the same
    fraction a step as AdamW's (weight decay ``weight_decay · lr / muon_lr``: optax scales it
    by Muon's rate); the rest `optax.contrib.muon`'s AdamW at `lr` (Nesterov momentum, as
    Muon's own)."""
    warmup = min(cfg.warmup_steps, max(0, total_steps - 1))

    def schedule(peak: float) -> optax.Schedule:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup else peak, peak_value=peak, warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1), end_value=peak * cfg.min_lr_ratio)

    if cfg.optimizer != "muon":
        inner = optax.adamw(schedule(cfg.lr), b1=cfg.b1, b2=cfg.b2,
                            weight_decay=cfg.weight_decay)
        return optax.chain(optax.clip_by_global_norm(cfg.clip), inner)
    if is_embedding is None:
        raise ValueError("inner.optimizer = \"muon\" needs the task's is_embedding: Muon "
                         "must not take the embeddings")
    from optax.contrib import MuonDimensionNumbers, muon

    def hidden(name: str, v: Any) -> bool:
        return (len(getattr(v, "shape", ())) == 2 and not is_embedding(name)
                and name.rsplit("/", 1)[-1] != "head")

    def matrices(params: Mapping[str, Any]) -> dict[str, MuonDimensionNumbers | None]:
        # (optax asks again with the AdamW leaves masked out: shapeless, and None)
        return {n: MuonDimensionNumbers() if hidden(n, v) else None for n, v in params.items()}

    inner = muon(schedule(cfg.muon_lr), weight_decay=cfg.weight_decay * cfg.lr / cfg.muon_lr,
                 adam_b1=cfg.b1, adam_b2=cfg.b2, adam_weight_decay=cfg.weight_decay,
                 adam_learning_rate=schedule(cfg.lr), muon_weight_dimension_numbers=matrices)
    return optax.chain(optax.clip_by_global_norm(cfg.clip), inner)


def n_params(task: Task) -> int:
    """Number of parameters of the task's model."""
    return int(sum(np.prod(s) for s in task.param_shapes().values()))


class _RunDefaults:
    """The defaults a task takes from its run configuration ``self.run``: the inner AdamW of
    ``[inner]``, the token corpus of ``[data]`` and ``batch_size · seq_len`` tokens a step."""

    run: RunConfig
    is_embedding: Callable[[str], bool]

    def optimizer(self) -> optax.GradientTransformation:
        return inner_optimizer(self.run.inner, self.run.steps, self.is_embedding)

    def data(self) -> Data:
        return self._corpus

    def vocab_size(self) -> int | None:
        """The model's vocabulary, where the task knows it (token files are checked against
        it); None: not checked."""
        return None

    @cached_property
    def _corpus(self) -> Data:
        return run_corpus(self.run, vocab=self.vocab_size())

    def tokens_per_step(self) -> int:
        return self.run.inner.batch_size * self.run.model.seq_len


@dataclass(frozen=True, eq=False)
class ByteGPT(_RunDefaults):
    """The byte-level GPT of `pipeline/model.py` (flat parameters, tied output)."""

    run: RunConfig
    name: str = "bytegpt"

    @property
    def cfg(self):
        return self.run.model

    def vocab_size(self) -> int | None:
        return self.run.model.vocab_size

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return model.param_shapes(self.cfg)

    def init_params(self, seed: int) -> Params:
        return model.init_params(self.cfg, seed)

    def is_embedding(self, name: str) -> bool:
        return model.is_embedding(name)

    def loss_and_accuracy(self, params: Params, batch: jax.Array):
        return model.loss_and_accuracy(params, batch, self.cfg)

    def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
        return model.forward(params, tokens, self.cfg)


@dataclass(frozen=True, eq=False)
class TreeTask(_RunDefaults):
    """A task from plain functions over a parameter pytree — how a user brings a model.

    Args:
        run: The run configuration (the factory's first argument).
        name: A short name for logs.
        init: ``init(seed) -> pytree`` of float32 arrays (nested dicts/lists).
        loss: ``loss(tree, batch) -> loss`` or ``(loss, accuracy)``, jittable.
        embeddings: Flat names (``tok/embedding``) of the tensors merged by weighted mean.
        forward: ``forward(tree, tokens) -> logits`` (only for ``diloco sample``).
        make_optimizer: ``make_optimizer(run) -> optax.GradientTransformation``; default the
            AdamW of ``[inner]``.
        make_data: ``make_data(run) -> Data``; default the ``[data]`` token corpus, whose
            batches are int32 ``[batch_size, seq_len + 1]`` windows.
        tokens: Tokens of one inner step; default ``batch_size · seq_len``.
        vocab: The model's vocabulary size: the ``[data]`` corpus's token ids are checked
            against it when the run starts (default: not checked).
    """

    run: RunConfig
    name: str
    init: Callable[[int], Any]
    loss: Callable[[Any, Any], Any]
    embeddings: tuple[str, ...] = ()
    forward: Callable[[Any, Any], Any] | None = None
    make_optimizer: Callable[[RunConfig], optax.GradientTransformation] | None = None
    make_data: Callable[[RunConfig], Data] | None = None
    tokens: int | None = None
    vocab: int | None = None

    def vocab_size(self) -> int | None:
        return self.vocab

    @cached_property
    def _skeleton(self) -> Any:
        """The parameter tree's structure with shapes and dtypes, computed without FLOPs."""
        skel = jax.eval_shape(lambda: self.init(0))
        flat = tree.flatten(skel)
        bad = [k for k, v in flat.items() if v.dtype != jnp.float32]
        if bad:
            raise ConfigError(f"task {self.name!r}: parameters must be float32 ({bad[0]} is "
                              f"{flat[bad[0]].dtype}); keep a float32 master copy and cast "
                              f"inside the loss")
        missing = [e for e in self.embeddings if e not in flat]
        if missing:
            raise ConfigError(f"task {self.name!r}: embedding {missing[0]!r} is not a "
                              f"parameter name (names: {', '.join(list(flat)[:8])}, ...)")
        return skel

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in tree.flatten(self._skeleton).items()}

    def init_params(self, seed: int) -> Params:
        return tree.flatten(self.init(seed))

    def is_embedding(self, name: str) -> bool:
        return name in self.embeddings

    def unflatten(self, params: Params) -> Any:
        """The model's own tree of the flat parameters."""
        return tree.unflatten(params, self._skeleton)

    def loss_and_accuracy(self, params: Params, batch: Any):
        out = self.loss(self.unflatten(params), batch)
        if isinstance(out, tuple):
            return out[0], out[1]
        return out, jnp.float32(jnp.nan)

    def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
        if self.forward is None:
            raise NotImplementedError(f"task {self.name!r} has no forward (needed to sample)")
        return self.forward(self.unflatten(params), tokens)

    def optimizer(self) -> optax.GradientTransformation:
        if self.make_optimizer is not None:
            return self.make_optimizer(self.run)
        return super().optimizer()

    def data(self) -> Data:
        return super().data() if self.make_data is None else self._user_data

    @cached_property
    def _user_data(self) -> Data:
        return self.make_data(self.run)

    def tokens_per_step(self) -> int:
        return self.tokens if self.tokens is not None else super().tokens_per_step()


def _llama(cfg: RunConfig) -> TreeTask:
    """The Llama-style decoder of `pipeline/llama.py`, sized by ``[model]``: a SwiGLU width of
    ``mlp_ratio · d_model · 2/3`` rounded up to a multiple of 8 (about the parameters of the
    GPT's ``mlp_ratio · d_model`` GELU layer)."""
    m = cfg.model
    ffn = -(-(m.mlp_ratio * m.d_model * 2 // 3) // 8) * 8
    lc = llama.LlamaConfig(vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                           n_heads=m.n_heads, ffn_dim=ffn, seq_len=m.seq_len)
    return TreeTask(run=cfg, name="llama", vocab=m.vocab_size,
                    init=lambda seed: llama.init_params(lc, seed),
                    loss=lambda p, b: llama.loss_and_accuracy(p, b, lc),
                    forward=lambda p, t: llama.forward(p, t, lc),
                    embeddings=tuple(sorted(llama.EMBEDDINGS)))


def task_of(cfg: RunConfig, local: str | None = None) -> Task:
    """The task of a run configuration.

    Args:
        cfg: The run configuration (stored in Redis or read from a file).
        local: The task this process's own command line or local configuration names. A user
            task is imported only when it equals ``cfg.task``.

    Raises:
        TaskNotNamed: ``cfg.task`` is a user task and ``local`` does not name it.
        ConfigError: The user task cannot be imported, its factory fails, or what it returns
            is not a valid task.
    """
    task = _built_task(cfg, local)
    return WarmStarted(task, cfg.init_from, cfg.init_sha256) if cfg.init_from else task


def with_init_hash(cfg: RunConfig, local: str | None = None) -> RunConfig:
    """`cfg` with ``init_sha256`` filled in from its ``init_from`` file (loaded and checked
    against the task: the first mismatch is refused, naming it); unchanged without a warm
    start or with the hash already set (then the file is checked against it when loaded)."""
    if not cfg.init_from or cfg.init_sha256:
        return cfg
    from pipeline.config import override
    from pipeline.warmstart import initial_values, values_hash

    shapes = _built_task(cfg, local).param_shapes()
    return override(cfg, init_sha256=values_hash(initial_values(cfg.init_from, shapes)))


class WarmStarted:
    """A task whose initial values are a checkpoint's (``init_from``,
    `pipeline.warmstart`); everything else is the task's own."""

    def __init__(self, task: Task, path: str, sha256: str = ""):
        self._task, self.init_from, self.init_sha256 = task, path, sha256

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def init_params(self, seed: int) -> Params:
        from pipeline.warmstart import initial_values

        return initial_values(self.init_from, self._task.param_shapes(), self.init_sha256)


def _built_task(cfg: RunConfig, local: str | None) -> Task:
    if cfg.task == "bytegpt":
        return ByteGPT(cfg)
    if cfg.task == "llama":
        return _llama(cfg)
    if local != cfg.task:
        said = f" (this process names {local!r})" if local else ""
        raise TaskNotNamed(f"run trains the user task {cfg.task!r}{said}; a process imports a "
                           f"task only when its own command line names it: pass "
                           f"--task {cfg.task}")
    module_name, _, attr = cfg.task.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        raise ConfigError(f"task {cfg.task!r}: cannot import {module_name} ({e}); is it on "
                          f"PYTHONPATH?") from e
    except AttributeError as e:
        raise ConfigError(f"task {cfg.task!r}: {module_name} has no {attr!r}") from e
    try:
        task = factory(cfg, **cfg.options())
    except TypeError as e:
        raise ConfigError(f"task {cfg.task!r}: the factory refused the run or its "
                          f"[task_options] ({e})") from e
    return check(task)


def check(task: Any) -> Task:
    """`task` if it implements the protocol with valid parameter names; else ConfigError."""
    missing = [m for m in ("param_shapes", "init_params", "is_embedding", "loss_and_accuracy",
                           "optimizer", "data", "tokens_per_step") if not hasattr(task, m)]
    if missing:
        raise ConfigError(f"task: {type(task).__name__} lacks {', '.join(missing)} (build it "
                          f"with pipeline.task.TreeTask)")
    shapes = task.param_shapes()
    if not shapes or len(shapes) > MAX_TENSORS:
        raise ConfigError(f"task {task.name!r}: expected 1..{MAX_TENSORS} parameter tensors, "
                          f"got {len(shapes)}")
    for name, shape in shapes.items():
        if len(shape) > MAX_NDIM:
            raise ConfigError(f"task {task.name!r}: parameter {name!r} has {len(shape)} "
                              f"dimensions (at most {MAX_NDIM}: reshape it)")
        if not NAME.fullmatch(name):
            raise ConfigError(f"task {task.name!r}: parameter name {name!r} is not "
                              f"[A-Za-z0-9_./:-], 1..200 characters")
        if not all(isinstance(d, int) and d >= 1 for d in shape):
            raise ConfigError(f"task {task.name!r}: parameter {name} has shape {shape}")
    if task.tokens_per_step() < 1:
        raise ConfigError(f"task {task.name!r}: tokens_per_step must be at least 1")
    return task


# -- the parameter spec: a user task's shapes, for processes that do not import it ------------

def param_spec(task: Task) -> dict:
    """Names, shapes, dtypes and embedding flags: stored with the run's configuration so that
    read-only tools open a user-task run without its code."""
    shapes = task.param_shapes()
    return {"names": list(shapes), "shapes": [list(s) for s in shapes.values()],
            "dtypes": ["float32"] * len(shapes),
            "embeddings": [n for n in shapes if task.is_embedding(n)],
            "tokens_per_step": task.tokens_per_step()}


def stored_spec(cfg: RunConfig) -> dict | None:
    """The parameter spec to store with a configuration: user tasks only, computed by the
    process storing it, whose local configuration names the task."""
    return None if cfg.task in TASKS else param_spec(task_of(cfg, local=cfg.task))


@dataclass(frozen=True, eq=False)
class SpecTask:
    """A task known only by its stored parameter spec: shapes and embeddings, no code (status,
    inspect, plots, export and a syncer restarting from committed state need nothing more)."""

    name: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    embeddings: frozenset[str]
    tokens: int

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.shapes)

    def is_embedding(self, name: str) -> bool:
        return name in self.embeddings

    def tokens_per_step(self) -> int:
        return self.tokens

    def _no_code(self, *_a, **_k):
        raise TaskNotNamed(f"this needs the code of the user task {self.name!r}: pass "
                           f"--task {self.name}")

    init_params = loss_and_accuracy = logits = optimizer = data = _no_code


def spec_task(cfg: RunConfig, spec: Any) -> SpecTask:
    """The `SpecTask` of a stored spec, validated (it came from Redis).

    Raises:
        ConfigError: The spec is malformed.
    """
    try:
        names, shapes = spec["names"], spec["shapes"]
        dtypes, emb = spec["dtypes"], spec["embeddings"]
        ok = (isinstance(names, list) and isinstance(shapes, list) and isinstance(dtypes, list)
              and isinstance(emb, list) and len(names) == len(shapes) == len(dtypes)
              and 0 < len(names) <= MAX_TENSORS)
    except (KeyError, TypeError) as e:
        raise ConfigError(f"run {cfg.task!r}: malformed parameter spec") from e
    if not ok:
        raise ConfigError(f"task {cfg.task!r}: malformed parameter spec")
    out, total = [], 0
    for n, s, d in zip(names, shapes, dtypes, strict=True):
        if not (isinstance(n, str) and NAME.fullmatch(n) and d == "float32"
                and isinstance(s, list) and len(s) <= MAX_NDIM
                and all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 2**31
                        for x in s)):
            raise ConfigError(f"task {cfg.task!r}: malformed parameter spec entry {n!r}")
        total += math.prod(s)
        out.append((n, tuple(s)))
    if total > MAX_PARAMS:
        raise ConfigError(f"task {cfg.task!r}: the parameter spec claims {total} parameters "
                          f"(at most {MAX_PARAMS})")
    if (len(set(names)) != len(names) or not all(isinstance(e, str) for e in emb)
            or not set(emb) <= set(names)):
        raise ConfigError(f"task {cfg.task!r}: malformed parameter spec")
    tokens = spec.get("tokens_per_step", cfg.inner.batch_size * cfg.model.seq_len)
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and 1 <= tokens <= 2**40):
        raise ConfigError(f"task {cfg.task!r}: malformed tokens_per_step in the parameter spec")
    return SpecTask(cfg.task, tuple(out), frozenset(emb), tokens)
