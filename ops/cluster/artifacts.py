"""A run's output folder: config.toml, metrics.jsonl, summary.json, loss.png, checkpoint.npz."""

from __future__ import annotations

import json
import os
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import config as cfgmod
from pipeline.config import RunConfig
from workers.common import write_npz_atomic


def new_run_dir(root: str | Path, run: str) -> Path:
    """`root/run` (created). An existing folder gets a numeric suffix instead of being reused."""
    base = Path(root) / run
    path, i = base, 1
    while path.exists():
        path = Path(f"{base}-{i}")
        i += 1
    path.mkdir(parents=True)
    return path


class MetricsLog:
    """Append-only JSON lines; every record gets the wall time `t` it was written. With
    `tensorboard` (a folder) each record's numbers also go to TensorBoard event files there,
    with `wandb` (the run's name and configuration) to a W&B run in this folder
    (`ops.cluster.tensorboard`: the ``[tensorboard]`` and ``[wandb]`` extras)."""

    def __init__(self, path: Path, tensorboard: str | Path | None = None,
                 wandb: tuple[str, RunConfig] | None = None):
        from ops.cluster.tensorboard import TensorBoardLog, WandbLog

        self.path = path
        self._trackers = ([TensorBoardLog(tensorboard)] if tensorboard else []) + (
            [WandbLog(wandb[0], cfgmod.to_dict(wandb[1]), path.parent)] if wandb else [])
        self._fh = open(path, "a", buffering=1)

    def write(self, kind: str, record: Mapping) -> None:
        rec = {"kind": kind, "t": time.time(), **record}
        self._fh.write(json.dumps(rec) + "\n")
        for tracker in self._trackers:
            tracker.write(kind, rec)

    def close(self) -> None:
        self._fh.close()
        for tracker in self._trackers:
            tracker.close()


def write_json(path: Path, obj: Any) -> None:
    """`obj` as indented JSON (sorted keys), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def write_config(run_dir: Path, cfg: RunConfig) -> None:
    (run_dir / "config.toml").write_text(cfgmod.dumps_toml(cfg))


FORMATS = ("npz", "safetensors", "orbax")  # by the path's suffix (an Orbax checkpoint: a folder)
SAFETENSORS_EXTRA = ("the safetensors format needs its extra: "
                     "pip install 'decoupled-diloco[safetensors]'")
ORBAX_EXTRA = "the orbax format needs its extra: pip install 'decoupled-diloco[orbax]'"


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ValueError(ORBAX_EXTRA) from e
    return ocp


def nest(flat: Mapping[str, np.ndarray]) -> dict:
    """Parameter names as a tree: ``layers/0/attn/wq`` → ``{"layers": {"0": {"attn": …}}}``
    (the pytree a JAX user's model holds; names without ``/`` stay at the top)."""
    tree: dict = {}
    for name, v in flat.items():
        *path, leaf = name.split("/")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"parameter names {part!r} and {name!r} collide in a tree")
        if leaf in node:
            raise ValueError(f"parameter names collide in a tree at {name!r}")
        node[leaf] = v
    return tree


def unnest(tree: Mapping, prefix: str = "") -> dict[str, np.ndarray]:
    """The inverse of `nest`: a tree of arrays as ``a/b/c`` names."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(unnest(v, f"{name}/"))
        else:
            out[name] = np.asarray(v)
    return out


def _safetensors():
    try:
        import safetensors.numpy
    except ImportError as e:
        raise ValueError(SAFETENSORS_EXTRA) from e
    return safetensors


def save_checkpoint(path: Path, params: Mapping[str, np.ndarray], cfg: RunConfig,
                    versions: list[int] | None = None) -> None:
    """The global parameters with the configuration (TOML text) inside, as .npz or, for a
    ``.safetensors`` path, as safetensors (the task's parameter names as tensor names; the
    configuration and versions in its metadata), written atomically either way."""
    path = Path(path)
    if path.suffix == ".orbax":  # a folder: items "params" (the tree) and "diloco" (JSON)
        ocp = _orbax()
        meta = {"config_toml": cfgmod.dumps_toml(cfg),
                "versions": None if versions is None else [int(v) for v in versions]}
        tree = nest({k: np.asarray(v, np.float32) for k, v in params.items()})
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:  # written atomically
            ck.save(path.resolve(), ocp.args.Composite(params=ocp.args.StandardSave(tree),
                                                       diloco=ocp.args.JsonSave(meta)),
                    force=True)
        return
    if path.suffix == ".safetensors":
        st = _safetensors()
        meta = {"diloco_config_toml": cfgmod.dumps_toml(cfg), "format": "np"}
        if versions is not None:
            meta["diloco_versions"] = json.dumps([int(v) for v in versions])
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            st.numpy.save_file({k: np.ascontiguousarray(v, np.float32)
                                for k, v in params.items()}, str(tmp), metadata=meta)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return
    arrays = {f"param/{k}": np.asarray(v, np.float32) for k, v in params.items()}
    arrays["config_toml"] = np.array(cfgmod.dumps_toml(cfg))
    if versions is not None:
        arrays["versions"] = np.asarray(versions, np.int64)
    write_npz_atomic(path, arrays)  # an export never leaves a half-written file


def read_checkpoint_file(path: str | Path
                         ) -> tuple[dict[str, np.ndarray], RunConfig, list[int] | None]:
    """Parameters, configuration and versions (None: not recorded) of a checkpoint in either
    format (by suffix: ``.safetensors``; a folder: Orbax; else .npz)."""
    path = Path(path)
    if path.is_dir():
        ocp = _orbax()
        items = None
        if (path / "diloco").is_dir() and (path / "params").is_dir():
            with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ck:
                items = ck.restore(path.resolve())
        if items is None or not isinstance(items.get("diloco"), dict):
            raise ValueError("an Orbax checkpoint without diloco's configuration (not written "
                             "by diloco export; init_from reads any Orbax checkpoint)")
        meta = items["diloco"]
        cfg = cfgmod.from_stored(tomllib.loads(str(meta["config_toml"])))
        versions = meta.get("versions")
        versions = [int(v) for v in versions] if isinstance(versions, list) else None
        return unnest(items["params"]), cfg, versions
    if path.suffix == ".safetensors":
        st = _safetensors()
        with st.safe_open(str(path), framework="np") as f:
            meta = f.metadata() or {}
        if "diloco_config_toml" not in meta:
            raise ValueError("a safetensors file without a diloco configuration in its "
                             "metadata (not written by diloco export)")
        params = st.numpy.load_file(str(path))
        cfg = cfgmod.from_stored(tomllib.loads(meta["diloco_config_toml"]))
        raw = meta.get("diloco_versions")
        versions = [int(v) for v in json.loads(raw)] if raw else None
        return params, cfg, versions
    with np.load(path) as z:
        params = {k[len("param/"):]: z[k] for k in z.files if k.startswith("param/")}
        cfg = cfgmod.from_stored(tomllib.loads(str(z["config_toml"])))
        versions = [int(v) for v in z["versions"]] if "versions" in z.files else None
    return params, cfg, versions


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], RunConfig]:
    params, cfg, _ = read_checkpoint_file(path)
    return params, cfg


def plot_loss(path: Path, series: Mapping[str, list[dict]], x: str = "tokens",
              title: str = "") -> None:
    """Evaluation loss vs `x` ("tokens" or "wall_s"), one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, hist in series.items():
        pts = [(h[x], h["eval_loss"]) for h in hist if x in h]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", markersize=2.5, label=name)
    ax.set_xlabel("tokens processed (all learners)" if x == "tokens" else "wall time (s)")
    ax.set_ylabel("evaluation loss (nats/byte)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
