"""The quality table at the default model (BENCHMARKS.md §1.3), resumable over sittings.

    python -m ops.bench.quality_default [--out OUT] [--jobs 2] [--dry-run]

Every run is one ``diloco bench quality --model default`` run (~66 CPU-minutes on the 2-core
development VM) that writes its result when it ends; finished runs are read from
``OUT/results.json`` and never run again, so run this again after an interruption and it goes
on where it stopped.

What runs, the most wanted first (`plan`):

1. **The learning-rate sweep, seed 0, the same rule for data parallel and for the candidate**
   (H = 50, int4 up, int4 delta down): inner lr 1e-3, 4e-4 and 2e-3; then, while a variant's
   best lr is at an end of what it has swept, the next rate of `GRID` beyond it, so that
   every variant's best is bracketed (or at the grid's end).
2. Seeds 1 and 2 of each at its own best lr (by seed-0 loss), as soon as its sweep is done.
3. The shipped setting (H = 100 int4 / bf16) and H = 100 with an int4 delta down link, three
   seeds each, at the candidate's lr.

``--jobs 2`` keeps two runs going, each pinned to a core of its own with one XLA thread (the
jitted step uses one core better than two: BENCHMARKS.md §8), each in ``OUT/jobs/coreN``; a
run's result is merged into ``OUT/results.json`` as soon as it ends and the next wanted run
starts on the freed core. The runs are at equal tokens, so their results do not depend on
how they share the machine. At the end: the tables over every run (``--report``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

DDP = "ddp"
CAND = "frontier H=50 int4/int4Δ"
SHIPPED = "decoupled int4/bf16"
H100 = "frontier H=100 int4/int4Δ"
ARGS = {DDP: ["--only", DDP], CAND: ["--frontier", "50", "--only", CAND],
        SHIPPED: ["--only", SHIPPED], H100: ["--frontier", "100", "--only", H100]}
START = (1e-3, 4e-4, 2e-3)  # swept first, in this order
GRID = (2e-4, 4e-4, 1e-3, 2e-3, 4e-3, 8e-3)  # where a sweep may extend to, ascending
SEEDS = (0, 1, 2)

Run = tuple[str, float, int]  # variant, inner lr, seed


def name(run: Run) -> str:
    """The run's key in results.json (as `ops.bench.quality.sweep` names it)."""
    variant, lr, seed = run
    return f"{variant} lr={lr:g} seed={seed}"


def losses(results: dict) -> dict[str, float]:
    """Final eval loss of every finished run; a diverged run (non-finite loss) as +inf."""
    out = {}
    for key, row in results.items():
        loss = row.get("final_eval_loss") if isinstance(row, dict) else None
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            out[key] = float(loss) if math.isfinite(loss) else math.inf
    return out


def sweep(done: dict[str, float], variant: str) -> tuple[list[float], float | None]:
    """(seed-0 learning rates still to run, the best lr once the sweep is complete)."""
    swept = list(START)
    while True:
        todo = [lr for lr in swept if name((variant, lr, 0)) not in done]
        if todo:
            return todo, None
        best = min(swept, key=lambda lr: (done[name((variant, lr, 0))], lr))
        i = GRID.index(best)
        if best == max(swept) and i + 1 < len(GRID):
            nxt = GRID[i + 1]
        elif best == min(swept) and i > 0:
            nxt = GRID[i - 1]
        else:
            return [], best
        swept.append(nxt)


def plan(done: dict[str, float]) -> list[Run]:
    """The runs still wanted that can start now, the most wanted first."""
    ddp_todo, ddp_best = sweep(done, DDP)
    cand_todo, cand_best = sweep(done, CAND)
    wanted: list[Run] = []
    for i in range(max(len(ddp_todo), len(cand_todo))):
        wanted += [(v, todo[i], 0) for v, todo in ((DDP, ddp_todo), (CAND, cand_todo))
                   if i < len(todo)]
    for seed in SEEDS[1:]:
        wanted += [(v, best, seed) for v, best in ((DDP, ddp_best), (CAND, cand_best))
                   if best is not None]
    if cand_best is not None:
        wanted += [(v, cand_best, s) for v in (SHIPPED, H100) for s in SEEDS]
    return [r for r in wanted if name(r) not in done]


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def merge(out: Path, *dirs: Path) -> dict:
    """Every finished run in `dirs`' results.json into OUT/results.json (atomically)."""
    results = _read(out / "results.json")
    for d in dirs:
        results.update(_read(d / "results.json"))
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, out / "results.json")
    return results


def command(run: Run, out: Path) -> list[str]:
    variant, lr, seed = run
    return [sys.executable, "-m", "ops.cli", "bench", "quality", "--model", "default",
            "--out", str(out), *ARGS[variant], "--lrs", f"{lr:g}", "--seeds", str(seed)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.bench.quality_default",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-quality-default"))
    ap.add_argument("--jobs", type=int, choices=(1, 2), default=1)
    ap.add_argument("--dry-run", action="store_true", help="print the runs wanted now")
    a = ap.parse_args(argv)
    if a.jobs == 2 and (os.cpu_count() or 1) < 2:
        ap.error("--jobs 2 needs two cores")
    a.out.mkdir(parents=True, exist_ok=True)
    jobs = a.out / "jobs"
    # a sitting cut while one run of a pair had finished: keep that run
    merge(a.out, *sorted(jobs.glob("*")) if jobs.is_dir() else [])
    if a.dry_run:
        for r in plan(losses(_read(a.out / "results.json"))):
            print(name(r))
        return 0
    running: dict[int, tuple[subprocess.Popen, Run, Path]] = {}  # core → job
    failed: list[str] = []
    while True:
        results = merge(a.out, *(d for _, _, d in running.values()))
        busy = {r for _, r, _ in running.values()}
        todo = [r for r in plan(losses(results)) if r not in busy] if not failed else []
        for core in range(a.jobs):
            if core in running or not todo:
                continue
            run = todo.pop(0)
            if a.jobs == 1:
                d, cmd, env = a.out, command(run, a.out), None
            else:
                d = jobs / f"core{core}"
                d.mkdir(parents=True, exist_ok=True)
                (d / "results.json").write_text(json.dumps(results))
                cmd = ["taskset", "-c", str(core), *command(run, d)]
                env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + (
                    " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"))}
            print(f"{time.strftime('%H:%M:%S')} start {name(run)}"
                  + (f" on core {core}" if a.jobs == 2 else ""), flush=True)
            log = open(d / f"log-{core}.txt", "a")
            running[core] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              env=env), run, d)
            log.close()
        if not running:
            break
        while not any(p.poll() is not None for p, _, _ in running.values()):
            time.sleep(5)
        for core, (p, run, d) in list(running.items()):
            if p.returncode is None:
                continue
            merge(a.out, d)
            del running[core]
            print(f"{time.strftime('%H:%M:%S')} end {name(run)}: rc {p.returncode}",
                  flush=True)
            if p.returncode != 0:
                failed.append(f"{name(run)} (rc {p.returncode}, log {d}/log-{core}.txt)")
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return subprocess.call([sys.executable, "-m", "ops.cli", "bench", "quality", "--model",
                            "default", "--report", "--out", str(a.out)])


if __name__ == "__main__":
    sys.exit(main())
