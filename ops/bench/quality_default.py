"""The quality table at the default model (BENCHMARKS.md §1.3), resumable over sittings.

    python -m ops.bench.quality_default [--out OUT] [--steps N] [--jobs 2] [--dry-run]

Every run is one ``diloco bench quality --model default`` run (~46 CPU-minutes on the 2-core
development VM) that writes its result when it ends; finished runs are read from
``OUT/results.json`` and never run again, so run this again after an interruption and it goes
on where it stopped.

What runs, the most wanted first (`plan`):

1. **The learning-rate sweep, seed 0, the same rule for data parallel and for the candidate**
   (H = 50, int4 up, int4 delta down): inner lr 1e-3, 4e-4 and 2e-3; then, while a variant's
   best lr is at an end of what it has swept, the next rate of `GRID` beyond it, so that
   every variant's best is bracketed (or at the grid's end).
2. **The candidate's outer learning rate** at its best inner lr: 0.4 and 1.0 beside the
   default 0.7, extended along `OUTER_GRID` by the same rule; then **its outer momentum** at
   its best inner and outer rate: 0.5 and 0.7 beside the default 0.9, extended along
   `MOMENTUM_GRID`; then, where the outer settings moved from the defaults, **its inner
   learning rate again** at them, from the best rate and its two neighbours on `GRID`, by
   the rule of 1 (a lower momentum moves the best inner rate up: BENCHMARKS.md §1.4); and
   **as many more rates for data parallel** (`FINE`, between those of `GRID`, nearest its
   best first) as these screens ran beyond the defaults, so that its tuning budget stays at
   least ours — only those between its best's neighbours on `GRID` (at most two): a rate
   beyond them cannot move a bracketed best, so the rest of that budget is not spent.
3. Seeds 1 and 2 of each at its own best (by seed-0 loss), as soon as its sweep is done.
4. The shipped setting (H = 100 int4 / bf16, `sync.apply = "rebase"`) and H = 100 with an
   int4 delta down link, three seeds each, at the candidate's inner lr, outer lr and outer
   momentum.

**Longer runs** (``--steps N``, N ≠ 2,000; OUT defaults to ``runs/bench-quality-default-N``;
`plan_long`): the gap to data parallel falls with run length (BENCHMARKS.md §1.3), so the
criterion is measured again at N steps from the rates chosen at 2,000 (`LONG_START`): data
parallel at 8e-3 and the candidate at inner lr 4e-3, outer momentum 0.7, with the shipped
plain final step (``sync.final_step = "plain"``; data parallel has no outer step). First the
three seeds of both; then, on seed 0, each one's neighbouring rates (data parallel: 6e-3 and
1.2e-2, on the ladder of `GRID` and `FINE` together; the candidate: 2e-3 and 8e-3 on `GRID`),
extended by the rule of 1 until each best is bracketed; then seeds 1 and 2 of a best that
moved. Both get the same two neighbours, and each sweep runs until its best is bracketed, so
data parallel's budget is never below ours.

``--jobs 2`` keeps two runs going, each pinned to a core of its own with one XLA thread (the
jitted step uses one core better than two: BENCHMARKS.md §8), each in ``OUT/jobs/coreN``; a
run's result is merged into ``OUT/results.json`` as soon as it ends and the next wanted run
starts on the freed core. The runs are at equal tokens, so their results do not depend on
how they share the machine. At the end: the tables over every run (``--report``). One
planner per OUT (``OUT/planner.lock``): a second is refused; ``--dry-run`` only reads.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

DDP = "ddp"
CAND = "frontier H=50 int4/int4Δ"
# the default before 2026-12-06 (bf16 down link sent whole); today's is the int4 delta down
# link ("decoupled int4/int4Δ"), measured at the tables' `sync.apply` as H100
SHIPPED = "decoupled int4/bf16"
H100 = "frontier H=100 int4/int4Δ"
# every run at the quality tables' `sync.apply` (ops.bench.quality.QUALITY_APPLY) but the
# shipped setting's, which is measured as shipped
ARGS = {DDP: ["--only", DDP], CAND: ["--frontier", "50", "--only", CAND],
        SHIPPED: ["--only", SHIPPED, "--set", 'sync.apply="rebase"'],
        H100: ["--frontier", "100", "--only", H100]}
START = (1e-3, 4e-4, 2e-3)  # swept first, in this order
GRID = (2e-4, 4e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)  # where a sweep may extend to, ascending
# the candidate's outer learning rate, screened at its best inner rate (the default first)
OUTER_DEFAULT = 0.7
OUTER_START = (OUTER_DEFAULT, 0.4, 1.0)
OUTER_GRID = (0.2, 0.4, 0.7, 1.0, 1.4)
# then its outer Nesterov momentum, at its best inner and outer rate (the default first)
# the base's (runs named without " om="): ops.bench.quality.QUALITY_MOMENTUM, not imported
# here (it would load JAX into the planner)
MOMENTUM_DEFAULT = 0.9
MOMENTUM_START = (MOMENTUM_DEFAULT, 0.5, 0.7)
MOMENTUM_GRID = (0.0, 0.3, 0.5, 0.7, 0.9)
# data parallel's rates between those of GRID: it gets as many of them, nearest its best
# first, as the candidate's screens after its inner sweep ran (the same tuning budget)
FINE = (3e-4, 6e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2)
SEEDS = (0, 1, 2)
STEPS = 2000  # the plan's run length; other lengths run `plan_long`
# the longer plan's starting points: each one's best at 2,000 steps (BENCHMARKS.md §1.3), each
# with the ladder its neighbouring rates are taken from
LONG_START = ((DDP, 8e-3, tuple(sorted((*GRID, *FINE)))),
              (CAND + " om=0.7", 4e-3, GRID))

# variant (with " om=<outer momentum>", " olr=<outer lr>" where not the default), inner lr, seed
Run = tuple[str, float, int]


def name(run: Run) -> str:
    """The run's key in results.json (as `ops.bench.quality.sweep` names it)."""
    variant, lr, seed = run
    return f"{variant} lr={lr:g} seed={seed}"


def with_outer(variant: str, olr: float, momentum: float = MOMENTUM_DEFAULT) -> str:
    """The variant at outer learning rate `olr` and outer momentum `momentum`, named as
    `ops.bench.quality.sweep` names it (each part only where not the default)."""
    return (variant + ("" if momentum == MOMENTUM_DEFAULT else f" om={momentum:g}")
            + ("" if olr == OUTER_DEFAULT else f" olr={olr:g}"))


def losses(results: dict) -> dict[str, float]:
    """Final eval loss of every finished run; a diverged run (non-finite loss) as +inf."""
    out = {}
    for key, row in results.items():
        loss = row.get("final_eval_loss") if isinstance(row, dict) else None
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            out[key] = float(loss) if math.isfinite(loss) else math.inf
    return out


def _bracket(done: dict[str, float], key, start: tuple[float, ...],
             grid: tuple[float, ...]) -> tuple[list[float], float | None, int]:
    """Sweep one rate over `grid` from `start` (loss of rate r: ``done[key(r)]``): (rates
    still to run, the best rate once it is bracketed or at the grid's end, how many rates
    the sweep has asked for beyond the first of `start`)."""
    swept = list(start)
    while True:
        todo = [r for r in swept if key(r) not in done]
        if todo:
            return todo, None, len(swept) - 1
        best = min(swept, key=lambda r: (done[key(r)], r))
        i = grid.index(best)
        if best == max(swept) and i + 1 < len(grid):
            nxt = grid[i + 1]
        elif best == min(swept) and i > 0:
            nxt = grid[i - 1]
        else:
            return [], best, len(swept) - 1
        swept.append(nxt)


def sweep(done: dict[str, float], variant: str) -> tuple[list[float], float | None]:
    """(seed-0 inner learning rates still to run, the best once the sweep is complete)."""
    todo, best, _ = _bracket(done, lambda lr: name((variant, lr, 0)), START, GRID)
    return todo, best


def outer_sweep(done: dict[str, float], lr: float) -> tuple[list[float], float | None, int]:
    """The candidate's outer lr at inner lr `lr`, seed 0: (outer lrs still to run, the best
    once bracketed, how many runs beyond the default the screen has asked for)."""
    return _bracket(done, lambda o: name((with_outer(CAND, o), lr, 0)),
                    OUTER_START, OUTER_GRID)


def momentum_sweep(done: dict[str, float], lr: float,
                   olr: float) -> tuple[list[float], float | None, int]:
    """The candidate's outer momentum at inner lr `lr` and outer lr `olr`, seed 0: (momenta
    still to run, the best once bracketed, how many runs beyond the default it asked for)."""
    return _bracket(done, lambda m: name((with_outer(CAND, olr, m), lr, 0)),
                    MOMENTUM_START, MOMENTUM_GRID)


def inner_again(done: dict[str, float], variant: str,
                lr: float) -> tuple[list[float], float | None, int]:
    """`variant` (the candidate at its screened outer settings) over the inner rate again,
    seed 0, from `lr` and its neighbours on GRID: (rates still to run, the best once
    bracketed, how many runs beyond `lr` it asked for; none where the outer settings are the
    defaults, whose inner sweep this is)."""
    if variant == CAND:
        return [], lr, 0
    i = GRID.index(lr)
    start = (lr, *GRID[i + 1:i + 2], *GRID[max(i - 1, 0):i])
    return _bracket(done, lambda r: name((variant, r, 0)), start, GRID)


def fine(done: dict[str, float], best: float, n: int) -> tuple[list[float], float | None]:
    """Data parallel's `n` extra seed-0 rates from FINE, nearest its grid-best `best` first,
    only those between `best`'s neighbours on GRID (they bracket it: a rate beyond them
    cannot become the best): (those still to run, its best over every seed-0 rate once they
    have run)."""
    i = GRID.index(best)
    lo, hi = GRID[max(i - 1, 0)], GRID[min(i + 1, len(GRID) - 1)]
    near = [r for r in FINE if lo < r < hi]  # beyond its grid neighbours a bracketed best
    extra = sorted(near, key=lambda r: (abs(math.log(r / best)), r))[:n]  # cannot move
    todo = [r for r in extra if name((DDP, r, 0)) not in done]
    if todo:
        return todo, None
    rates = [r for r in (*GRID, *FINE) if name((DDP, r, 0)) in done]
    return [], min(rates, key=lambda r: (done[name((DDP, r, 0))], r))


def plan(done: dict[str, float]) -> list[Run]:
    """The runs still wanted that can start now, the most wanted first."""
    ddp_todo, ddp_grid_best = sweep(done, DDP)
    cand_todo, cand_lr = sweep(done, CAND)
    ddp_runs = [(DDP, lr, 0) for lr in ddp_todo]
    cand_runs = [(CAND, lr, 0) for lr in cand_todo]
    ddp_best = cand_best = None
    if cand_lr is not None:
        outer_todo, olr, extra = outer_sweep(done, cand_lr)
        cand_runs = [(with_outer(CAND, o), cand_lr, 0) for o in outer_todo]
        if olr is not None:
            mom_todo, om, more = momentum_sweep(done, cand_lr, olr)
            extra += more
            cand_runs = [(with_outer(CAND, olr, m), cand_lr, 0) for m in mom_todo]
            if om is not None:
                outer = with_outer(CAND, olr, om)
                lr_todo, lr2, more = inner_again(done, outer, cand_lr)
                extra += more
                cand_runs = [(outer, r, 0) for r in lr_todo]
                if lr2 is not None:
                    cand_best = (outer, lr2)
        if ddp_grid_best is not None:
            fine_todo, best = fine(done, ddp_grid_best, extra)
            ddp_runs = [(DDP, lr, 0) for lr in fine_todo]
            if cand_best is not None and best is not None:
                ddp_best = (DDP, best)
    wanted: list[Run] = []
    for i in range(max(len(ddp_runs), len(cand_runs))):
        wanted += [runs[i] for runs in (ddp_runs, cand_runs) if i < len(runs)]
    for seed in SEEDS[1:]:
        wanted += [(v, lr, seed) for v, lr in (b for b in (ddp_best, cand_best) if b)]
    if cand_best is not None:
        outer_part = cand_best[0][len(CAND):]
        wanted += [(v + outer_part, cand_best[1], s) for v in (SHIPPED, H100) for s in SEEDS]
    return [r for r in wanted if name(r) not in done]


def plan_long(done: dict[str, float]) -> list[Run]:
    """The longer plan's runs still wanted that can start now, the most wanted first: the
    three seeds at `LONG_START`, then seed 0 of each one's neighbouring rates until its best
    is bracketed, then seeds 1 and 2 of a best that moved."""
    wanted = [(v, lr, seed) for seed in SEEDS for v, lr, _ in LONG_START]
    sweeps = []
    for variant, lr0, ladder in LONG_START:
        i = ladder.index(lr0)
        start = (lr0, *ladder[i + 1:i + 2], *ladder[max(i - 1, 0):i])
        todo, best, _ = _bracket(done, lambda r, v=variant: name((v, r, 0)), start, ladder)
        sweeps.append(([(variant, r, 0) for r in todo], variant, best, lr0))
    for i in range(max(len(t) for t, *_ in sweeps)):
        wanted += [t[i] for t, *_ in sweeps if i < len(t)]
    for seed in SEEDS[1:]:
        wanted += [(v, best, seed) for _, v, best, lr0 in sweeps
                   if best is not None and best != lr0]
    return [r for r in dict.fromkeys(wanted) if name(r) not in done]


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


def merge_jobs(out: Path) -> dict:
    """`merge` of every job folder of `out`: a sitting cut while one run of a pair had
    finished keeps that run."""
    jobs = out / "jobs"
    return merge(out, *sorted(jobs.glob("*")) if jobs.is_dir() else [])


def command(run: Run, out: Path, steps: int = STEPS) -> list[str]:
    """The run's `diloco bench quality` command; at another length than `STEPS` with the
    shipped plain final step (the 2,000-step table's runs keep the Nesterov one they were
    measured with: ops.bench.quality.QUALITY_FINAL_STEP)."""
    variant, lr, seed = run
    base, _, olr = variant.partition(" olr=")
    base, _, om = base.partition(" om=")
    longer = [] if steps == STEPS else ["--steps", str(steps), *(
        [] if base == DDP else ["--set", 'sync.final_step="plain"'])]
    return [sys.executable, "-m", "ops.cli", "bench", "quality", "--model", "default",
            "--out", str(out), *ARGS[base], *(["--outer-momenta", om] if om else []),
            *(["--outer-lrs", olr] if olr else []), "--lrs", f"{lr:g}", "--seeds", str(seed),
            *longer]


# one run a planner wants: its key in its folder's results.json, the folder, and its
# `diloco bench quality` command writing to a given folder
Job = tuple[str, Path, Callable[[Path], list[str]]]


def drive(jobs: int, wanted: Callable[[], list[Job]]) -> list[str]:
    """Keep `jobs` runs of `wanted()` going, the most wanted first, until it wants none: with
    two, each pinned to a core of its own with one XLA thread in ``<folder>/jobs/coreN``, its
    result merged into ``<folder>/results.json`` as soon as it ends (`wanted` is asked again
    then). After a failed run nothing new starts. Returns the failed runs."""
    running: dict[int, tuple[subprocess.Popen, str, Path, Path]] = {}  # core → job
    failed: list[str] = []
    while True:
        busy = {(key, out) for _, key, out, _ in running.values()}
        todo = [j for j in wanted() if j[:2] not in busy] if not failed else []
        for core in range(jobs):
            if core in running or not todo:
                continue
            key, out, argv = todo.pop(0)
            if jobs == 1:
                d, cmd, env = out, argv(out), None
            else:
                d = out / "jobs" / f"core{core}"
                d.mkdir(parents=True, exist_ok=True)
                (d / "results.json").write_text(json.dumps(_read(out / "results.json")))
                cmd = ["taskset", "-c", str(core), *argv(d)]
                env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + (
                    " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"))}
            print(f"{time.strftime('%H:%M:%S')} start {out.name}: {key}"
                  + (f" on core {core}" if jobs == 2 else ""), flush=True)
            log = open(d / f"log-{core}.txt", "a")
            running[core] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                              env=env), key, out, d)
            log.close()
        if not running:
            return failed
        while not any(p.poll() is not None for p, *_ in running.values()):
            time.sleep(5)
        for core, (p, key, out, d) in list(running.items()):
            if p.returncode is None:
                continue
            merge(out, d)
            del running[core]
            print(f"{time.strftime('%H:%M:%S')} end {out.name}: {key}: rc {p.returncode}",
                  flush=True)
            if p.returncode != 0:
                failed.append(f"{key} (rc {p.returncode}, log {d}/log-{core}.txt)")


def lock_folder(ap: argparse.ArgumentParser, out: Path):
    """One planner per folder (a second would start the same runs again in the same job
    folders): the held lock file, or exit 2 naming the lock."""
    lock = open(out / "planner.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        ap.error(f"another planner is running on {out} (it holds {out}/planner.lock)")
    return lock


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.bench.quality_default",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="default: runs/bench-quality-default (-N with --steps N)")
    ap.add_argument("--steps", type=int, default=STEPS,
                    help=f"inner steps per learner (not {STEPS}: the longer plan)")
    ap.add_argument("--jobs", type=int, choices=(1, 2), default=1)
    ap.add_argument("--dry-run", action="store_true", help="print the runs wanted now")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    if a.out is None:
        a.out = Path("runs/bench-quality-default" + ("" if a.steps == STEPS else f"-{a.steps}"))
    planner = plan if a.steps == STEPS else plan_long
    if a.jobs == 2 and (os.cpu_count() or 1) < 2:
        ap.error("--jobs 2 needs two cores")
    a.out.mkdir(parents=True, exist_ok=True)
    merge_jobs(a.out)
    if a.dry_run:
        for r in planner(losses(_read(a.out / "results.json"))):
            print(name(r))
        return 0
    lock = lock_folder(ap, a.out)  # noqa: F841 (held until the process ends)
    failed = drive(a.jobs, lambda: [
        (name(r), a.out, lambda d, r=r: command(r, d, a.steps))
        for r in planner(losses(_read(a.out / "results.json")))])
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return subprocess.call([sys.executable, "-m", "ops.cli", "bench", "quality", "--model",
                            "default", "--report", "--out", str(a.out),
                            *([] if a.steps == STEPS else ["--steps", str(a.steps)])])


if __name__ == "__main__":
    sys.exit(main())
