"""Fragments: which tensors are synced together, and when each fragment is due.

The model's tensors are split into P fragments by balanced bin-packing (greedy, largest tensor
first, into the currently smallest fragment). With P > 1 the embeddings form fragment 0 on their
own (they are merged by weighted mean, the rest by radial-directional averaging). Learner step
t > 0 with t mod Δh = 0 pushes fragment (t // Δh) mod P, Δh = max(1, round(H / P)): every
fragment is pushed once every P·Δh ≈ H steps, one at a time, so communication is spread out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np


def partition(shapes: Mapping[str, tuple[int, ...]], n_fragments: int,
              is_embedding: Callable[[str], bool]) -> list[list[str]]:
    """Tensor names of each of the `n_fragments` fragments (each list sorted by model order);
    the embeddings (`is_embedding`, the task's) get a fragment of their own.

    Raises:
        ValueError: if there are fewer tensors than fragments to fill.
    """
    order = {name: i for i, name in enumerate(shapes)}
    sizes = {name: int(np.prod(s)) for name, s in shapes.items()}
    if n_fragments == 1:
        return [list(shapes)]
    embed = [n for n in shapes if is_embedding(n)]
    rest = [n for n in shapes if not is_embedding(n)]
    bins_n = n_fragments - 1 if embed else n_fragments
    if len(rest) < bins_n:
        raise ValueError(f"sync.fragments: {n_fragments} fragments need at least {bins_n} "
                         f"non-embedding tensors, the model has {len(rest)}")
    bins: list[list[str]] = [[] for _ in range(bins_n)]
    load = [0] * bins_n
    for name in sorted(rest, key=lambda n: (-sizes[n], order[n])):
        i = min(range(bins_n), key=lambda j: (load[j], j))
        bins[i].append(name)
        load[i] += sizes[name]
    frags = ([embed] if embed else []) + bins
    return [sorted(f, key=order.__getitem__) for f in frags]


def due_fragment(step: int, delta_h: int, n_fragments: int) -> int | None:
    """The fragment a learner pushes after finishing inner step `step` (1-based), or None."""
    if step <= 0 or step % delta_h:
        return None
    return (step // delta_h) % n_fragments


def fragment_sizes(shapes: Mapping[str, tuple[int, ...]],
                   frags: list[list[str]]) -> list[int]:
    """Number of parameters in each fragment."""
    return [int(sum(np.prod(shapes[n]) for n in f)) for f in frags]


def assign(sizes: Mapping[int, int], owners: list[str]) -> dict[str, list[int]]:
    """Fragments shared among `owners` balanced by size (syncers sharded automatically).

    Largest fragment first, each to the owner with the least total so far (ties: the first in
    sorted order); every owner computes the same answer from the same inputs. Returns owner →
    its fragments in increasing order (every owner present, maybe with none).

    Args:
        sizes: fragment → its size (parameters or bytes).
        owners: the owners' ids (any order; duplicates ignored).
    """
    names = sorted(set(owners))
    load = {n: 0 for n in names}
    out: dict[str, list[int]] = {n: [] for n in names}
    if not names:
        return out
    for p in sorted(sizes, key=lambda p: (-sizes[p], p)):
        n = min(names, key=lambda n: (load[n], names.index(n)))
        out[n].append(p)
        load[n] += sizes[p]
    return {n: sorted(ps) for n, ps in out.items()}
