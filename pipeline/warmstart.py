"""Warm start: version 0 of a run from an existing checkpoint (``init_from``) instead of the
task's random initial values.

The file is a ``diloco export`` (.npz with ``param/<name>`` arrays, or .safetensors), or any
.npz / .safetensors whose tensor names are the task's parameter names. Names, shapes and
dtypes are checked against the task before anything trains, the first mismatch named; values
become fp32. The loaded values' hash (`pipeline.quant.tensors_hash`) is stored with the run
(``init_sha256``), so every process that builds version 0 — a syncer on any host, replay — is
refused a different file rather than starting another model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pipeline import quant
from pipeline.config import ConfigError

SAFETENSORS_EXTRA = "reading .safetensors needs the safetensors package: pip install " \
                    "'decoupled-diloco[safetensors]'"
ORBAX_EXTRA = "reading an Orbax checkpoint needs orbax-checkpoint: pip install " \
              "'decoupled-diloco[orbax]'"
_SKIP = {"config_toml", "versions"}  # the export's own metadata arrays


def read_values(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of a checkpoint file, by name (a diloco export's ``param/`` prefix removed).

    Raises:
        ConfigError: the file is missing or unreadable, or safetensors is not installed.
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"init_from: {path} does not exist")
    try:
        if path.is_dir():
            return _orbax_values(path)
        if path.suffix == ".safetensors":
            try:
                import safetensors.numpy
            except ImportError as e:
                raise ConfigError(f"init_from: {SAFETENSORS_EXTRA}") from e
            return dict(safetensors.numpy.load_file(str(path)))
        with np.load(path, allow_pickle=False) as z:
            names = [k for k in z.files if k not in _SKIP]
            if any(k.startswith("param/") for k in names):
                return {k[len("param/"):]: z[k] for k in names if k.startswith("param/")}
            return {k: z[k] for k in names}
    except ConfigError:
        raise
    except Exception as e:  # a corrupt file: numpy, zipfile and safetensors raise their own
        raise ConfigError(f"init_from: {path} is not a readable .npz, .safetensors or Orbax "
                          f"checkpoint ({type(e).__name__}: {str(e)[:120]})") from e


def _orbax_values(path: Path) -> dict[str, np.ndarray]:
    """An Orbax checkpoint's arrays by path name (``layers/0/attn/wq``): a `diloco export`
    (its ``params`` item), or any checkpoint of one tree (`StandardCheckpointer`'s)."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ConfigError(f"init_from: {ORBAX_EXTRA}") from e
    if (path / "params").is_dir() and (path / "diloco").is_dir():
        path = path / "params"
    with ocp.StandardCheckpointer() as ck:
        tree = ck.restore(path.resolve())
    out: dict[str, np.ndarray] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, f"{prefix}{k}/")
        elif isinstance(node, list | tuple):
            for i, v in enumerate(node):
                walk(v, f"{prefix}{i}/")
        else:
            out[prefix[:-1]] = np.asarray(node)

    walk(tree, "")
    return out


def initial_values(path: str | Path, shapes: Mapping[str, tuple[int, ...]],
                   sha256: str = "") -> dict[str, np.ndarray]:
    """The task's parameters from `path`, as fp32, checked against `shapes` (and `sha256`,
    when given: the hash the run stored).

    Raises:
        ConfigError: naming the first tensor that is missing, extra, of another shape or not
            of a floating-point dtype, or the hash that differs.
    """
    got = read_values(path)
    for name in shapes:
        if name not in got:
            raise ConfigError(f"init_from: {path} has no tensor {name!r} (the task's "
                              f"parameters: {len(shapes)}, the file's: {len(got)})")
    extra = sorted(set(got) - set(shapes))
    if extra:
        raise ConfigError(f"init_from: {path} holds {extra[0]!r}, which the task has no "
                          f"parameter of" + (f" (and {len(extra) - 1} more)" if extra[1:] else ""))
    out = {}
    for name, shape in shapes.items():
        v = np.asarray(got[name])
        if v.shape != tuple(shape):
            raise ConfigError(f"init_from: {name!r} has shape {v.shape} in {path}, the task's "
                              f"is {tuple(shape)}")
        if not np.issubdtype(v.dtype, np.floating) and v.dtype.name != "bfloat16":
            raise ConfigError(f"init_from: {name!r} is {v.dtype} in {path}, not a "
                              f"floating-point tensor")
        out[name] = np.ascontiguousarray(v, np.float32)
    if sha256 and values_hash(out) != sha256:
        raise ConfigError(f"init_from: {path} is not the model this run starts from (its "
                          f"values' hash {values_hash(out)[:16]}…, the run's "
                          f"init_sha256 {sha256[:16]}…)")
    return out


def values_hash(values: Mapping[str, np.ndarray]) -> str:
    """The hash the run stores as ``init_sha256`` (fp32 values, by name)."""
    return quant.tensors_hash({k: np.asarray(v, np.float32) for k, v in values.items()})
