"""What is trained: the task a run names (``task = "bytegpt"`` or ``"llama"``).

A task gives every process what it needs of the model, and nothing of the loop around it:

* ``param_shapes()`` — flat name → shape of every parameter, in a fixed order (the syncer,
  the fragments and the wire need only this; it is computed without training);
* ``init_params(seed)`` — the initial parameters as a flat ``name → array`` dict;
* ``is_embedding(name)`` — embeddings are merged by weighted mean (not radial-directional
  averaging) and live in their own fragment;
* ``loss_and_accuracy(params, batch)`` — jittable: mean loss and accuracy of a token batch
  ``[batch, seq_len + 1]``;
* ``logits(params, tokens)`` — jittable: next-token logits ``[batch, time, vocab]`` (sampling).

A task whose model keeps its parameters as a nested tree flattens them with `pipeline.tree`
(names are paths, ``layers/0/attn/wq``); everything outside the task sees flat dicts. Tasks
are frozen dataclasses, hashable, so a jitted step can take one as a static argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import jax
import numpy as np

from pipeline import llama, model, tree
from pipeline.config import TASKS, ModelConfig, RunConfig

Params = dict[str, jax.Array]
__all__ = ["TASKS", "ByteGPT", "Llama", "Params", "Task", "n_params", "task_of"]


class Task(Protocol):
    """The model side of a run (see the module docstring)."""

    name: str

    def param_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def init_params(self, seed: int) -> Params: ...

    def is_embedding(self, name: str) -> bool: ...

    def loss_and_accuracy(self, params: Params, batch: jax.Array) -> tuple[Any, Any]: ...

    def logits(self, params: Params, tokens: jax.Array) -> jax.Array: ...


def n_params(task: Task) -> int:
    """Number of parameters of the task's model."""
    return int(sum(np.prod(s) for s in task.param_shapes().values()))


@dataclass(frozen=True)
class ByteGPT:
    """The byte-level GPT of `pipeline/model.py` (flat parameters, tied output)."""

    cfg: ModelConfig
    name: str = "bytegpt"

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


@dataclass(frozen=True)
class Llama:
    """The Llama-style decoder of `pipeline/llama.py` (a nested parameter tree)."""

    cfg: llama.LlamaConfig
    name: str = "llama"

    @cached_property
    def _skeleton(self) -> Any:
        """The parameter tree's structure with shapes, built without computing anything."""
        return jax.eval_shape(lambda: llama.init_params(self.cfg, 0))

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in tree.flatten(self._skeleton).items()}

    def init_params(self, seed: int) -> Params:
        return tree.flatten(llama.init_params(self.cfg, seed))

    def is_embedding(self, name: str) -> bool:
        return name in llama.EMBEDDINGS

    def loss_and_accuracy(self, params: Params, batch: jax.Array):
        return llama.loss_and_accuracy(tree.unflatten(params, self._skeleton), batch, self.cfg)

    def logits(self, params: Params, tokens: jax.Array) -> jax.Array:
        return llama.forward(tree.unflatten(params, self._skeleton), tokens, self.cfg)


def task_of(cfg: RunConfig) -> Task:
    """The task of a run configuration, sized by its ``[model]`` section.

    The Llama decoder takes ``d_model``, ``n_layers``, ``n_heads``, ``seq_len`` and
    ``vocab_size`` from it, and a SwiGLU width of ``mlp_ratio · d_model · 2/3`` (rounded up to
    a multiple of 8: about the parameters of the GPT's ``mlp_ratio · d_model`` GELU layer).
    """
    m = cfg.model
    if cfg.task not in TASKS:
        raise ValueError(f"task {cfg.task!r} is not one of {', '.join(TASKS)}")
    if cfg.task == "llama":
        ffn = -(-(m.mlp_ratio * m.d_model * 2 // 3) // 8) * 8
        return Llama(llama.LlamaConfig(vocab_size=m.vocab_size, d_model=m.d_model,
                                       n_layers=m.n_layers, n_heads=m.n_heads, ffn_dim=ffn,
                                       seq_len=m.seq_len))
    return ByteGPT(m)
