"""Parameters as any pytree of arrays (nested dicts and lists, as Flax or Equinox produce) and
as the flat ``name → array`` dict that fragments, the wire and replay work on.

A leaf's name is its path in the tree, keys and list indices joined by ``/``
(``layers/0/attn/wq``). Names are stable: they depend on the tree's structure only, and a dict's
keys are visited in sorted order (as JAX flattens dicts), so every process that builds the same
tree gets the same names in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

SEPARATOR = "/"


def _part(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        part = key.key
        if not isinstance(part, str):
            raise ValueError(f"parameter dict keys must be str, got {part!r}")
    elif isinstance(key, jax.tree_util.SequenceKey):
        part = str(key.idx)
    elif isinstance(key, jax.tree_util.GetAttrKey):
        part = key.name
    else:
        raise ValueError(f"unsupported pytree node key {key!r}")
    if not part or SEPARATOR in part:
        raise ValueError(f"parameter key {part!r}: must be non-empty and without {SEPARATOR!r}")
    return part


def flatten(tree: Any) -> dict[str, Any]:
    """The leaves of `tree` by name (see the module docstring), in the tree's order.

    Raises:
        ValueError: A key is not a non-empty str without ``/`` (names would be ambiguous), or
            the tree is a single leaf.
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    out: dict[str, Any] = {}
    for path, leaf in leaves:
        if not path:
            raise ValueError("parameters must be a dict (or list) of arrays, not one array")
        out[SEPARATOR.join(_part(k) for k in path)] = leaf
    return out


def unflatten(flat: Mapping[str, Any], like: Any) -> Any:
    """The tree shaped like `like` whose leaves are ``flat``'s, matched by name.

    Raises:
        KeyError: `flat` lacks a name of `like`'s leaves.
        ValueError: `flat` holds names `like` does not have.
    """
    names = list(flatten(like))
    extra = set(flat) - set(names)
    if extra:
        raise ValueError(f"names not in the parameter tree: {sorted(extra)[:5]}")
    treedef = jax.tree_util.tree_structure(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[n] for n in names])
