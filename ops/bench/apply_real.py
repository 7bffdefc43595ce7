"""Short real multi-process runs under both apply rules (BENCHMARKS.md §1.3).

A learner that steps faster than its syncer merges (tiny models: a few ms per step) has its
pushes superseded and receives values of rounds that closed before its latest push arrived.
This benchmark runs the same short `diloco run` (a Redis it starts, a syncer and learners as
processes) under ``sync.apply = "overwrite"`` and ``"rebase"``, for the built-in tasks, and
records the final against the initial eval loss of each: the runs where `rebase` once trained
far less (a learner rebased onto the first value to arrive as if it held its latest push).

    python -m ops.bench.apply_real --out runs/bench-apply-real [--seeds 0,1,2] [--steps 60]
        [--tasks bytegpt,llama] [--outer-momentum 0]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ops.cluster import RedisServer
from pipeline import config as cfgmod

# the configuration of the real-process tests (tests/test_e2e.py TINY), two learners
TINY = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 600_000, "eval_batches": 4},
        "inner": {"lr": 3e-3, "warmup_steps": 5, "batch_size": 8},
        "sync": {"fragments": 2, "sync_every": 10}, "learners": 2}
APPLIES = ("overwrite", "rebase")
KEEP = ("initial_eval_loss", "final_eval_loss", "final_eval_accuracy", "rounds", "goodput",
        "merged_steps", "wall_s", "tokens")


def one(url: str, task: str, apply: str, seed: int, steps: int, work: Path,
        momentum: float | None = None) -> dict:
    raw = {**TINY, "task": task, "steps": steps, "seed": seed,
           "sync": {**TINY["sync"], "apply": apply}}
    if momentum is not None:
        raw["outer"] = {"momentum": momentum}
    cfg = cfgmod.from_dict(raw)
    path = work / f"{task}-{apply}-{seed}.toml"
    path.write_text(cfgmod.dumps_toml(cfg))
    run = f"apply-{task}-{apply}-{seed}-{int(time.time() * 1000)}"
    out = subprocess.run([sys.executable, "-m", "ops.cli", "run", "--config", str(path),
                          "--redis-url", url, "--run", run, "--out", str(work / "runs"),
                          "--json"], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    s = json.loads(out.stdout.strip().splitlines()[-1])
    rec = {k: s[k] for k in KEEP if k in s}
    rec["drop"] = s["initial_eval_loss"] - s["final_eval_loss"]
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tasks", default="bytegpt,llama")
    ap.add_argument("--outer-momentum", type=float, default=None,
                    help="outer Nesterov momentum (default: the shipped one)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    results: dict = {"config": TINY, "steps": a.steps, "outer_momentum": a.outer_momentum,
                     "runs": {}}
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis:
        for task in a.tasks.split(","):
            for seed in seeds:
                for apply in APPLIES:
                    key = f"task={task} apply={apply} seed={seed}"
                    results["runs"][key] = rec = one(redis.url, task, apply, seed, a.steps,
                                                     Path(tmp), a.outer_momentum)
                    print(key, json.dumps(rec), flush=True)
    summary = {}
    for task in a.tasks.split(","):
        for apply in APPLIES:
            finals = [results["runs"][f"task={task} apply={apply} seed={s}"].get(
                "final_eval_loss") for s in seeds]
            if all(f is not None for f in finals):
                summary[f"task={task} apply={apply}"] = sum(finals) / len(finals)
    results["mean_final_eval_loss"] = summary
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
