"""Shared helpers of the broker-level and syncer-recovery tests (no fixtures, no sleeps-to-wait).

A tiny run configuration, contribution entries built without LearnerCore (quantise a delta,
`broker.entries.entry_fields` plus the `seconds`/`final` fields the learner adds), polling with a
deadline, Redis stream inspection, and syncers run as subprocesses or in a thread.
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np
import redis

from broker import codec, pieces, registry
from broker.entries import entry_fields
from broker.keys import GROUP, FragmentKeys, RunKeys
from broker.state import unpack_state
from broker.streams import FragmentStreams
from pipeline import config as cfgmod
from pipeline import quant
from pipeline.config import RunConfig
from pipeline.contribution import PushHeader
from pipeline.fragments import partition
from pipeline.model import is_embedding, param_shapes

REPO = Path(__file__).resolve().parent.parent

TINY: dict[str, Any] = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
    "data": {"max_bytes": 600_000},
    "sync": {"fragments": 2, "sync_every": 10, "codec_up": "fp32", "codec_down": "fp32"},
    "learners": 2,
    "steps": 10,
}

T = TypeVar("T")


# ------------------------------------------------------------------------------ configuration


def _merge(base: dict, extra: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def tiny_config(**sections: Any) -> RunConfig:
    """TINY merged with `sections` (e.g. ``sync={"quorum": 2}``, ``broker={...}``)."""
    return cfgmod.from_dict(_merge(TINY, sections))


def store_run(r: redis.Redis, run: str, cfg: RunConfig) -> RunKeys:
    """Store `cfg` as the configuration of `run` (as `diloco init` does); returns its keys."""
    keys = RunKeys(run)
    registry.store_config(r, keys, cfgmod.dumps_toml(cfg), cfg.run_hash())
    return keys


def fragment_names(cfg: RunConfig) -> list[list[str]]:
    return partition(param_shapes(cfg.model), cfg.effective_sync().fragments, is_embedding)


def make_delta(cfg: RunConfig, p: int, seed: int, scale: float = 1e-2) -> dict[str, np.ndarray]:
    """A random fp32 outer gradient δ for fragment `p` (deterministic in `seed`)."""
    shapes = param_shapes(cfg.model)
    rng = np.random.default_rng(seed)
    return {n: (scale * rng.standard_normal(shapes[n])).astype(np.float32)
            for n in fragment_names(cfg)[p]}


def contribution_fields(learner: str, p: int, delta: Mapping[str, np.ndarray], *,
                        base_version: int = 0, step: int = 10, steps: int = 10,
                        tokens: int = 2560, codec_name: str = "fp32", seconds: float = 1.5,
                        final: bool = False) -> dict[str, Any]:
    """The fields a learner XADDs for one push (as `workers.learner` builds them)."""
    tensors = {n: quant.quantize(v, codec_name, 64) for n, v in delta.items()}
    fields = entry_fields(PushHeader(learner, p, base_version, step, steps, tokens), tensors,
                          codec_name)
    fields["seconds"] = f"{seconds:.6f}"
    fields["final"] = "1" if final else "0"
    return fields


def push(r: redis.Redis, keys: RunKeys, p: int, fields: Mapping[str, Any]) -> str:
    return FragmentStreams(r, keys).push(p, fields)


# ------------------------------------------------------------------------------------ polling


def wait_for(pred: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.01,
             what: str = "condition") -> T:
    """Poll `pred` until it returns a truthy value (returned) or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def poll_until(pred: Callable[[], object], timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll `pred` for at most `timeout_s`; True as soon as it holds, False at the deadline
    (for conditions that are allowed not to happen)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


# --------------------------------------------------------------------------- Redis inspection


def xpending_count(r: redis.Redis, fk: FragmentKeys) -> int:
    return int(r.xpending(fk.frags, GROUP)["pending"])


def pending_by_consumer(r: redis.Redis, fk: FragmentKeys) -> dict[str, int]:
    rows = r.xinfo_consumers(fk.frags, GROUP)
    return {_s(row["name"]): int(row["pending"]) for row in rows}


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def rounds_records(r: redis.Redis, fk: FragmentKeys) -> list[dict[str, Any]]:
    """Decoded round records of a fragment (JSON fields parsed), oldest first."""
    out = []
    for rid, fields in r.xrange(fk.rounds):
        rec: dict[str, Any] = {"id": _s(rid)}
        for k, v in fields.items():
            text = _s(v)
            if _s(k) in ("included", "dropped", "seconds"):
                rec[_s(k)] = json.loads(text)
            else:
                rec[_s(k)] = text
        out.append(rec)
    return out


def dlq_entries(r: redis.Redis, fk: FragmentKeys) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in r.xrange(fk.dlq)]


def state_version(r: redis.Redis, fk: FragmentKeys) -> int | None:
    """The version of the fragment's checkpoint (its full state)."""
    blob = pieces.read(r, fk.state, max_bytes=2**34)
    return None if blob is None else int(unpack_state(blob)["version"])


def committed_version(r: redis.Redis, fk: FragmentKeys) -> int | None:
    """The fragment's latest committed version: its last round's, else its checkpoint's."""
    last = r.xrevrange(fk.rounds, "+", "-", count=1)
    return int(last[0][0].decode().split("-")[0]) if last else state_version(r, fk)


def global_value(r: redis.Redis, fk: FragmentKeys) -> tuple[int, dict[str, np.ndarray]]:
    """(version, decoded values) of the fragment's `global` snapshot."""
    blob = pieces.read(r, fk.global_, max_bytes=2**34)
    assert blob is not None, f"no global snapshot at {fk.global_}"
    header, tensors = codec.unpack_snapshot(blob)
    return header.version, {k: quant.dequantize(q) for k, q in tensors.items()}


# -------------------------------------------------------------------------------------- syncers


def syncer_cmd(url: str, run: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "workers.syncer", "--redis-url", url, "--run", run, *args]


def run_syncer_process(url: str, run: str, *args: str, log_path: Path,
                       timeout_s: float = 60.0) -> int:
    """Run a syncer subprocess to its exit; returns the exit code (output kept in `log_path`)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(syncer_cmd(url, run, *args), cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"syncer {args} did not exit within {timeout_s} s:\n"
                                 + log_path.read_text(errors="replace")[-4000:]) from None


class SyncerThread:
    """`workers.syncer.main(cfg)` in a daemon thread; `join` stops it via the run's stop key
    if it has not finished by the deadline (and fails the test)."""

    def __init__(self, cfg: Any):
        from workers import syncer as syncer_mod

        self.cfg = cfg
        self.result: int | None = None
        self.error: BaseException | None = None
        self._main = syncer_mod.main
        self.thread = threading.Thread(target=self._run, name=f"syncer-{cfg.syncer_id}",
                                       daemon=True)

    def _run(self) -> None:
        try:
            self.result = self._main(self.cfg)
        except BaseException as e:  # reported by join()
            self.error = e

    def start(self) -> SyncerThread:
        self.thread.start()
        return self

    def join(self, r: redis.Redis, keys: RunKeys, timeout_s: float = 30.0) -> int | None:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            registry.request_stop(r, keys)
            self.thread.join(15.0)
            raise AssertionError(f"in-process syncer {self.cfg.syncer_id} did not finish "
                                 f"within {timeout_s} s (stop requested)")
        if self.error is not None:
            raise self.error
        return self.result


# ------------------------------------------------------------------------------- reference


def reference_round(cfg: RunConfig, p: int, contributions: list[Any]
                    ) -> tuple[int, dict[str, np.ndarray]]:
    """Feed `contributions` (pipeline.contribution.Contribution) to a fresh pure FragmentSyncer at
    version 0 and close one round: (version, the down-link values learners decode)."""
    from pipeline.model import init_params
    from pipeline.syncer import FragmentSyncer

    init = init_params(cfg.model, cfg.seed)
    core = FragmentSyncer(p, {n: np.asarray(init[n]) for n in fragment_names(cfg)[p]},
                          cfg.outer, cfg.effective_sync(), is_embedding=is_embedding)
    for i, c in enumerate(contributions):
        ok, why = core.offer(c, float(i))
        assert ok, why
    result = core.close(float(len(contributions)), "reference")
    # the value learners hold (with the delta down link, not the delta that went out)
    return result.version, {k: quant.dequantize(q) for k, q in core.snapshot_tensors.items()}


def end_processes(procs: Mapping[str, subprocess.Popen], logs: Mapping[str, IO], *,
                  grace_s: float = 0.0) -> None:
    """End what still runs of `procs` and close their log files (a test's `finally`): with
    `grace_s`, SIGTERM first and that long for all of them to exit; then SIGKILL."""
    running = [p for p in procs.values() if p.poll() is None]
    if grace_s:
        for p in running:
            p.terminate()
        deadline = time.monotonic() + grace_s
        for p in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.01, deadline - time.monotonic()))
    for p in running:
        if p.poll() is None:
            p.kill()
            p.wait()
    for fh in logs.values():
        fh.close()


def run_to_the_end(procs: dict[str, subprocess.Popen], order: tuple[str, ...], logs: Path,
                   timeout_s: float = 300) -> None:
    """Wait for every process (in `order`) to exit 0 within one deadline; kill the rest."""
    try:
        deadline = time.monotonic() + timeout_s
        for name in order:
            left = max(1.0, deadline - time.monotonic())
            assert procs[name].wait(left) == 0, (logs / f"{name}.log").read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
