"""What the final flush does to the final value: a diagnostic on the in-process engine.

    python -m ops.bench.final_flush --model bench --seeds 0,1,2 --out runs/bench-final-flush

The quality benchmark's candidate (H = 50, int4 up, int4 delta down, inner lr 4e-3, outer
momentum 0.7) runs twice per seed: with ``sync.final_step = "nesterov"`` (every round takes
the Nesterov step) and ``"plain"`` (the final flush's rounds take Θ ← Θ − lr·share·Δ, no
momentum look-ahead). Both record the evaluation loss of the global value right before the
final flush (identical in the two: the runs are the same until then) and after it. Each run
writes ``OUT/results.json`` as it finishes (``--jobs 2``: both arms of a seed side by side,
each on a core of its own with one XLA thread)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ARMS = ("nesterov", "plain")  # sync.final_step


def run_arm(arm: str, seed: int, model: str) -> dict:
    from ops.bench import quality
    from ops.cluster import codec_sizes
    from pipeline import config as cfgmod
    from pipeline.data import run_corpus
    from pipeline.engine import Engine

    base = quality.bench_model_config() if model == "bench" else quality.default_model_config()
    cfg = cfgmod.override(quality.frontier_config(base, 50, "int4", "int4Δ"), seed=seed,
                          **{"outer.momentum": 0.7, "inner.lr": 4e-3, "sync.final_step": arm})
    eng = Engine(cfg, run_corpus(cfg), wire=codec_sizes())
    flush = eng._final_flush
    out: dict = {"arm": arm, "seed": seed, "model": model}

    def measured_flush() -> None:
        out["before_flush"] = eng._eval(eng._global(), 0, eng.now)["eval_loss"]
        eng.history.pop()  # not a point of the run's curve
        flush()

    eng._final_flush = measured_flush
    s = eng.run()
    out["after_flush"] = s["final_eval_loss"]
    out["last_points"] = [h["eval_loss"] for h in s["history"][-3:]]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("bench", "default"), default="bench")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-final-flush"))
    ap.add_argument("--jobs", type=int, choices=(1, 2), default=2)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one run (a job)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm is not None:
        print(json.dumps(run_arm(a.arm, a.seed, a.model)))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + (
        " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"))}
    for seed in (int(x) for x in a.seeds.split(",") if x.strip()):
        todo = [arm for arm in ARMS if f"{a.model} {arm} seed={seed}" not in results]
        procs = []
        for i, arm in enumerate(todo):
            cmd = [sys.executable, "-m", "ops.bench.final_flush", "--model", a.model,
                   "--arm", arm, "--seed", str(seed)]
            if a.jobs == 2:
                cmd = ["taskset", "-c", str(i % 2), *cmd]
            procs.append((arm, subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)))
            if a.jobs == 1:
                procs[-1][1].wait()
        for arm, p in procs:
            stdout, _ = p.communicate()
            if p.returncode != 0:
                print(f"{arm} seed {seed}: rc {p.returncode}", file=sys.stderr)
                return 1
            results[f"{a.model} {arm} seed={seed}"] = json.loads(stdout.decode().splitlines()[-1])
            path.write_text(json.dumps(results, indent=1))
    for k, r in results.items():
        print(f"{k}: before the flush {r['before_flush']:.4f}, after {r['after_flush']:.4f} "
              f"({100 * (r['after_flush'] / r['before_flush'] - 1):+.2f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
