"""`diloco bench large`: the largest model this host holds, through every path, end to end.

One run of the byte GPT at `SIZE` (``--quick``: `QUICK_SIZE`) under the chaos harness
(`ops.chaos.ChaosRun`: real processes, a private redis-server with AOF, a TCP proxy per
learner): two learners, two syncers sharing the fragments, batch 1, H = 4, 4 fragments (the
demo's 2 would put 75M values in one: over `broker.max_payload_bytes`, which the syncer
refuses), the default codecs. Once every learner trains, `TAKEOVER_AT_S` later, the first
syncer is killed for good: the other takes its fragments over (recovery from the checkpoint
and the rounds since). At the end, with the run's Redis still up: `diloco replay` verifies
every round bit for bit, `diloco export` writes the global parameters, `diloco eval`
evaluates them. Every process's peak resident set (``VmHWM``) is sampled from ``/proc`` while
it runs, Redis's ``used_memory_peak`` read at the end (the syncers archive the entries they
trim, `broker.archive_dir`, so that replay has every round), and `diloco plan`'s memory per role
printed beside them. The ledger says nothing was lost.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from broker.records import read_rounds
from ops.bench.pipeline import rss_peak
from ops.bench.roles import redis_by_kind
from ops.chaos import ChaosRun, Fault
from pipeline import config as cfgmod
from pipeline.fragments import fragment_sizes, partition
from pipeline.plan import Workload, memory
from pipeline.task import task_of
from workers.common import host_memory

SIZE = (1024, 8)        # d_model, layers: 100.9M parameters
QUICK_SIZE = (128, 2)   # 0.4M: the same path in a minute
TAKEOVER_AT_S = 45.0    # after every learner trains
DURATION_S = 150.0      # of training, from then


def _cli(*args: str, timeout_s: float = 1800) -> tuple[dict, float]:
    """A `diloco` command's JSON summary (its last line) and its wall time."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True,
                         text=True, timeout=timeout_s)
    wall = time.monotonic() - t0
    if out.returncode:
        raise RuntimeError(f"diloco {args[0]}: exit {out.returncode}: {out.stdout[-2000:]}"
                           f"{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), wall


class _Peaks:
    """Every role process's VmHWM, sampled until stopped (a killed process keeps its last)."""

    def __init__(self, chaos: ChaosRun):
        self.chaos, self.peaks = chaos, {}
        self.min_available = host_memory()[1]  # the host's MemAvailable at its lowest
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for name, p in list(self.chaos.procs.items() if self.chaos.sup else ()):
                try:
                    self.peaks[(name, p.pid)] = max(self.peaks.get((name, p.pid), 0),
                                                    rss_peak(p.pid))
                except (OSError, RuntimeError):  # it ended meanwhile
                    continue
            self.min_available = min(self.min_available, host_memory()[1])
            time.sleep(0.25)

    def stop(self) -> dict[str, int]:
        """The peak of each role (the largest of its processes)."""
        self._stop.set()
        self._thread.join()
        out: dict[str, int] = {}
        for (name, _), v in self.peaks.items():
            role = "learner" if name.startswith("L") else name.split("-")[0]
            out[role] = max(out.get(role, 0), v)
        return out


def _taken_over(chaos: ChaosRun, killed_t: float) -> dict[str, float]:
    """Per fragment the killed syncer served: seconds from its kill to the first round the
    other syncer closed of it (its recovery, from the checkpoint and the rounds since)."""
    out = {}
    for p in range(len(chaos.frags)):
        recs = list(read_rounds(chaos.r, chaos.keys.fragment(p)))
        if any(r.syncer == "syncer-0" for r in recs):
            after = [r.t for r in recs if r.syncer != "syncer-0" and r.t and r.t > killed_t]
            out[str(p)] = round(min(after) - killed_t, 1) if after else None
    return out


def bench_large(quick: bool = False, piece_bytes: int | None = None) -> dict:
    """The run (module docstring); `piece_bytes`: `broker.piece_bytes` (the tests' small
    pieces), else the default."""
    d_model, n_layers = QUICK_SIZE if quick else SIZE
    over = {"model.d_model": d_model, "model.n_layers": n_layers, "model.n_heads": 8,
            "learners": 2, "inner.batch_size": 1, "sync.sync_every": 4, "sync.fragments": 4,
            "data.eval_batches": 4, **({} if piece_bytes is None else {
                "broker.piece_bytes": piece_bytes})}
    cfg = cfgmod.override(cfgmod.demo_config(), **over)
    task = task_of(cfg, local=cfg.task)
    shapes = task.param_shapes()
    params = sum(math.prod(s) for s in shapes.values())
    frag = tuple(fragment_sizes(shapes, partition(shapes, cfg.effective_sync().fragments,
                                                   task.is_embedding)))
    plan = memory(cfg, Workload(frag, cfg.learners, 1.0, 10.0, 10.0))
    takeover_at, duration = (10.0, 40.0) if quick else (TAKEOVER_AT_S, DURATION_S)
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "archive"  # the entries trimmed from the streams, for replay
        chaos = ChaosRun(cfgmod.override(cfg, **{"broker.archive_dir": str(archive)}),
                         Path(tmp) / "run", "large", standby=True)
        peaks = None
        try:
            t0, available_before = time.monotonic(), host_memory()[1]
            chaos.start()
            peaks = _Peaks(chaos)
            chaos.supervise([Fault(takeover_at, "takeover", "syncer-0")], duration)
            rep = chaos.finish()
            wall = time.monotonic() - t0
            by_role = peaks.stop()
            redis_peak = int(chaos.r.info("memory")["used_memory_peak"])
            held = redis_by_kind(chaos.r)
            url = ["--redis-url", chaos.redis.url, "--run", "large"]
            replay, replay_s = _cli("replay", *url, "--archive", str(archive), "--json")
            npz = Path(tmp) / "model.npz"
            export, export_s = _cli("export", *url, "--out", str(npz), "--json")
            evaluated, eval_s = _cli("eval", str(npz), "--json")
            rounds = {s: sum(n) for s, n in rep["rounds_by_syncer"].items()}
            taken = _taken_over(chaos, rep["faults"][0]["t"]) if rep["faults"] else {}
        except Exception as e:  # the logs go with the temporary folder: their ends, kept
            tails = "".join(f"\n--- {f.name}: {f.read_text(errors='replace')[-1500:]}"
                            for f in sorted((Path(tmp) / "run" / "logs").glob("*.log")))
            raise RuntimeError(f"bench large at {params:,} parameters: {e}{tails}") from e
        finally:
            if peaks is not None and not peaks._stop.is_set():
                peaks.stop()
            chaos.close()
    n_rounds = sum(rounds.values())
    return {
        "bench": "large", "d_model": d_model, "n_layers": n_layers, "params": params,
        "fragments": list(frag), "config": over, "wall_s": round(wall, 1),
        "peak_bytes": {**by_role, "redis": redis_peak}, "redis_at_end": held,
        "host_available_bytes": {"before": available_before, "lowest": peaks.min_available},
        "plan_bytes": {k: plan[k] for k in ("learner_bytes", "syncer_bytes", "redis_bytes")},
        "takeover": {"at_s": takeover_at, "rounds_by_syncer": rounds,
                     "first_round_after_s": taken, "faults": rep["faults"]},
        "ledger": {k: rep.get(k) for k in ("lost", "merged_twice", "goodput",
                                           "identical_final_values", "versions_increase",
                                           "exit_codes", "crashes")},
        "replay": {"summary": replay, "s": round(replay_s, 1),
                   "s_per_round": round(replay_s / max(1, n_rounds), 3)},
        "export": {"summary": export, "s": round(export_s, 1)},
        "eval": {"summary": evaluated, "s": round(eval_s, 1)},
    }
