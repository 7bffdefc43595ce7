"""`diloco bench roles`: the peak memory of each role of a real `diloco run` at two model sizes,
beside what `diloco plan` counts (the arrays alone).

Each size is one run of the byte GPT on a private redis-server: two learners, one syncer, the
launcher (which evaluates the global model every 15 s and at the end), batch 2, H = 4, the
demo's fragments (`diloco run`'s base: its embeddings and the rest) and the default codecs, 24
steps. Every process's peak resident set (``VmHWM``) is
sampled from ``/proc`` while it runs, and Redis's ``used_memory_peak`` read at the end. The
slope between the two sizes is each role's bytes per parameter, the intercept its runtime. A
third run, the smaller size for 200 steps, gives Redis at its steady state.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

from ops.bench.pipeline import rss_peak
from ops.cluster import RedisServer
from pipeline import config as cfgmod
from pipeline.fragments import fragment_sizes, partition
from pipeline.plan import Workload, memory
from pipeline.task import task_of

SIZES = ((512, 2), (1024, 4))  # 6.5M and 50.7M parameters: 7.8× apart
QUICK_SIZES = ((128, 2), (384, 2))
STEPS = 24
STEADY_STEPS = 200  # ~58 rounds: past S + C + 1 versions and `keep_rounds` per fragment


def _role(cmd: str) -> str | None:
    if "workers.learner" in cmd:
        return "learner"
    if "workers.syncer" in cmd:
        return "syncer"
    if " ops.cli run " in f" {cmd} ":
        return "launcher"
    return None


def _children(root: int) -> list[int]:
    """Every process below `root`."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def run_size(d_model: int, n_layers: int, steps: int = STEPS) -> dict:
    """One run at this size: each role's peak RSS (bytes) and Redis's peak."""
    over = {"model.d_model": d_model, "model.n_layers": n_layers, "model.n_heads": 8,
            "learners": 2, "steps": steps, "inner.batch_size": 2, "sync.sync_every": 4,
            "data.eval_batches": 1}
    cfg = cfgmod.override(cfgmod.demo_config(), **over)  # what `diloco run --set` starts from
    task = task_of(cfg, local=cfg.task)
    shapes = task.param_shapes()
    params = sum(math.prod(s) for s in shapes.values())
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(workdir=Path(tmp) / "redis", appendonly=False).start()
        try:
            args = [sys.executable, "-m", "ops.cli", "run", "--redis-url", server.url,
                    "--run", "roles", "--out", str(Path(tmp) / "runs"), "--json", "--quiet",
                    *[a for k, v in over.items() for a in ("--set", f"{k}={v}")]]
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            peaks: dict[tuple[str, int], int] = {}

            def sample() -> None:
                while proc.poll() is None:
                    for pid in [proc.pid, *_children(proc.pid)]:
                        try:
                            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(
                                b"\0", b" ").decode(errors="replace")
                        except OSError:
                            continue
                        role = _role(cmd)
                        try:
                            hwm = rss_peak(pid)
                        except (OSError, RuntimeError):  # it ended meanwhile
                            continue
                        if role and hwm:
                            peaks[(role, pid)] = max(peaks.get((role, pid), 0), hwm)
                    time.sleep(0.2)

            t0 = time.monotonic()
            watcher = threading.Thread(target=sample, daemon=True)
            watcher.start()
            out, err = proc.communicate(timeout=1800)
            watcher.join()
            if proc.returncode:
                raise RuntimeError(f"diloco run at d_model {d_model}: {err[-2000:]}")
            r = redis.Redis.from_url(server.url)
            redis_peak = int(r.info("memory")["used_memory_peak"])
            held = redis_by_kind(r)
            r.close()
        finally:
            server.stop()
    summary = json.loads(out.strip().splitlines()[-1])
    by_role: dict[str, int] = {}
    for (role, _), v in peaks.items():
        by_role[role] = max(by_role.get(role, 0), v)
    frag = tuple(fragment_sizes(shapes, partition(shapes, cfg.effective_sync().fragments,
                                                   task.is_embedding)))
    plan_mem = memory(cfg, Workload(frag, cfg.learners, 1.0, 10.0, 10.0))
    return {"d_model": d_model, "n_layers": n_layers, "params": params,
            "wall_s": round(time.monotonic() - t0, 1), "rounds": summary.get("rounds"),
            "peak_bytes": {**by_role, "redis": redis_peak}, "redis_at_end": held,
            "plan_bytes": {k: plan_mem[k] for k in ("learner_bytes", "syncer_bytes",
                                                     "redis_bytes")},
            "fragments": list(frag)}


def redis_by_kind(r: redis.Redis) -> dict[str, int]:
    """Redis's ``MEMORY USAGE`` summed by kind of key: the streams of pushes, the snapshots
    (``sent:<v>``, ``global``), the checkpoints, the rest."""
    out: dict[str, int] = {}
    for k in r.scan_iter("*"):
        key = k.decode(errors="replace")
        kind = ("sent" if ":sent:" in key else "global" if key.endswith(":global") else
                "state" if key.endswith(":state") else "frags" if key.endswith(":frags") else
                "other")
        out[kind] = out.get(kind, 0) + (r.memory_usage(k) or 0)
    return out


def bench_roles(quick: bool = False) -> dict:
    runs = [run_size(d, n) for d, n in (QUICK_SIZES if quick else SIZES)]
    small, large = runs
    dn = large["params"] - small["params"]
    fit = {}
    for role in large["peak_bytes"]:
        slope = (large["peak_bytes"][role] - small["peak_bytes"][role]) / dn
        fit[role] = {"bytes_per_param": round(slope, 1),
                     "intercept_mb": round((small["peak_bytes"][role]
                                            - slope * small["params"]) / 2**20)}
    # the smaller size for longer: Redis holds as many snapshots as it ever will (S + C + 1
    # versions a fragment) and the entries of `broker.keep_rounds` rounds
    steady = run_size(*(QUICK_SIZES if quick else SIZES)[0], steps=STEADY_STEPS)
    steady["redis_peak_per_param"] = round(steady["peak_bytes"]["redis"] / steady["params"], 1)
    return {"bench": "roles", "runs": runs, "fit": fit, "steady": steady, "env": {
        k: os.environ[k] for k in ("DILOCO_FUSED", "DILOCO_KEEP_FREED_MEMORY") if k in os.environ}}
