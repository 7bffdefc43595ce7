"""Quality against model size with the shipped settings (BENCHMARKS.md §1.5), resumable over
sittings.

    python -m ops.bench.quality_size [--out OUT] [--jobs 2] [--dry-run] [--report]
                                     [--resume-from docs/bench/RAW.json] [--levers]

At each size of `SIZES` (~0.05M, ~0.2M and the default model's 0.84M parameters: 17×), data
parallel against the shipped decoupled setting (``--model shipped``: every sync and outer
setting as `RunConfig()` ships it), 2,000 inner steps per learner at batch 16, M = 4, the same
data and evaluation as BENCHMARKS.md §1.3. Each side's inner learning rate is swept by the
rule of `ops.bench.quality_default` (1e-3, 4e-4, 2e-3, then along `LADDER` until its best is
bracketed: both sides get the same rule, so data parallel's tuning budget is ours); then seed
1 of each at its own best. The smallest size first, each size in ``OUT/<size>``: every run
is one ``diloco bench quality`` run that writes its result when it ends, so run this again
after an interruption and it goes on where it stopped. ``--jobs 2`` keeps two runs going,
each on a core of its own (`ops.bench.quality_default.drive`).

``--levers``: the two levers of `LEVERS` at the default model instead (the same driver and
folders' rules), and with ``--report`` their table against the shipped setting.

Data parallel has no sync or outer setting, so at the default model its rows are those of
BENCHMARKS.md §1.3 (`REUSED_DDP`, the same model, data, steps and rates), copied into the
size's folder once, and marked so.

At the end (``--report``): per size, each side at its best rate, the gap on the mean over the
seeds both ran and the worst seed's, beside the published M = 4 gaps (`PUBLISHED`), as
``OUT/summary.md``, ``OUT/summary.json`` and ``OUT/gap_vs_size.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ops.bench.quality_default import (
    DDP,
    GRID,
    START,
    Run,
    _bracket,
    _read,
    drive,
    lock_folder,
    losses,
    merge,
    merge_jobs,
    name,
)

SHIP = "decoupled int4/int4Δ"  # on the shipped base: the shipped setting itself
# size → (model overrides, parameters: pipeline.model.n_params at that size)
SIZES = {"0.05M": ({"model.d_model": 32, "model.n_layers": 3}, 49_600),
         "0.2M": ({"model.d_model": 64, "model.n_layers": 4}, 222_336),
         "0.84M": ({}, 837_888)}
SEEDS = (0, 1)
# the inner learning rates a sweep may extend to: `GRID` and, for the smaller models, whose best
# rates are higher, two more above it
LADDER = (*GRID, 3.2e-2, 6.4e-2)
# the default model's data parallel rows (BENCHMARKS.md §1.3, 2026-12-04)
REUSED_DDP = ("0.84M", Path("docs/bench/quality_default_results.json"))
# the two levers the literature reports for the gap, at the default model on the shipped setting
# (each in ``OUT/0.84M-<lever>``): a per-learner batch twice data parallel's share at equal
# tokens (1,000 steps of 32), and Muon for the hidden matrices (`inner.optimizer`, its rate
# `inner.muon_lr` at its default); seed 0 at these rates, then seed 1 of a lever at its best
# rate where that beats the shipped setting's seed 0
LEVERS = {"batch32": ["--steps", "1000", "--set", "inner.batch_size=32"],
          "muon": ["--set", 'inner.optimizer="muon"']}
LEVER_RUNS = (("muon", 4e-3, 0), ("batch32", 4e-3, 0), ("batch32", 8e-3, 0))
# Charles et al. 2025, "Scaling Laws for DiLoCo", Table 4: DiLoCo M = 4 against data
# parallel, each at its tuned rates (parameters, gap)
PUBLISHED = ((35e6, 0.039), (180e6, 0.023), (2.4e9, 0.011))


def _sweep(done: dict[str, float], variant: str) -> tuple[list[float], float | None]:
    """`variant`'s seed-0 inner lr sweep: (rates still to run, its best once bracketed)."""
    return _bracket(done, lambda lr: name((variant, lr, 0)), START, LADDER)[:2]


def plan(done: dict[str, float]) -> list[Run]:
    """One size's runs still wanted that can start now (`done`: its finished runs' losses):
    both sweeps interleaved, then seed 1 of each at its best."""
    sweeps = [(v, *_sweep(done, v)) for v in (DDP, SHIP)]
    wanted: list[Run] = []
    for i in range(max(len(todo) for _, todo, _ in sweeps)):
        wanted += [(v, todo[i], 0) for v, todo, _ in sweeps if i < len(todo)]
    wanted += [(v, best, s) for s in SEEDS[1:] for v, _, best in sweeps if best is not None]
    return [r for r in wanted if name(r) not in done]


def command(size: str, run: Run, out: Path) -> list[str]:
    """The run's `diloco bench quality` command at `size`, writing to `out`."""
    variant, lr, seed = run
    model = [x for k, v in SIZES[size][0].items() for x in ("--set", f"{k}={v}")]
    return [sys.executable, "-m", "ops.cli", "bench", "quality", "--model", "shipped",
            *model, "--out", str(out), "--only", variant, "--lrs", f"{lr:g}",
            "--seeds", str(seed)]


def _add_missing(out: Path, size: str, rows: dict) -> int:
    """Add `rows` (name → result) to the size's results.json where it has no run of that
    name; returns how many were added."""
    results = _read(out / size / "results.json")
    new = {k: v for k, v in rows.items() if k not in results and isinstance(v, dict)}
    if new:
        (out / size).mkdir(parents=True, exist_ok=True)
        (out / size / "results.json").write_text(json.dumps({**results, **new}, indent=1))
    return len(new)


def reuse_ddp(out: Path, size: str, source: Path) -> int:
    """Copy `source`'s data parallel rows into the size's results.json where missing, each
    marked with where it came from; returns how many were copied."""
    return _add_missing(out, size, {k: {**v, "reused_from": str(source)}
                                    for k, v in _read(source).items()
                                    if k.startswith(DDP + " ") and isinstance(v, dict)})


def resume_from(out: Path, raw: Path) -> int:
    """Copy the finished runs a raw results file (this study's ``docs/bench`` JSON: its
    ``runs``, size → results) holds into each size's results.json where missing: a new
    checkout goes on where a sitting committed its runs. Returns how many were copied."""
    runs = json.loads(raw.read_text()).get("runs", {})
    return sum(_add_missing(out, size, rows) for size, rows in runs.items()
               if size in SIZES and isinstance(rows, dict))


def summary(out: Path) -> dict[str, dict]:
    """Per size with both sides' seeds at their best: each side's best rate (by seed 0), its
    losses, the gap on the mean over the seeds both ran, and the worst seed's gap."""
    rows = {}
    for size, (_, params) in SIZES.items():
        results = _read(out / size / "results.json")
        done = losses(results)
        best = {v: _sweep(done, v)[1] for v in (DDP, SHIP)}
        if None in best.values():
            continue
        by_seed = {v: {s: done[name((v, best[v], s))] for s in SEEDS
                       if name((v, best[v], s)) in done} for v in best}
        seeds = sorted(set(by_seed[DDP]) & set(by_seed[SHIP]))
        if not seeds:
            continue
        mean = {v: sum(by_seed[v][s] for s in seeds) / len(seeds) for v in best}
        ship = results[name((SHIP, best[SHIP], seeds[0]))]
        rows[size] = {
            "params": params, "seeds": seeds, "ddp_lr": best[DDP], "ship_lr": best[SHIP],
            "ddp": [by_seed[DDP][s] for s in seeds], "ship": [by_seed[SHIP][s] for s in seeds],
            "gap_mean": mean[SHIP] / mean[DDP] - 1,
            "gap_worst_seed": max(by_seed[SHIP][s] / by_seed[DDP][s] - 1 for s in seeds),
            "binding_ratio": ship.get("bandwidth_ratio_binding"),
            "ddp_reused": "reused_from" in results[name((DDP, best[DDP], seeds[0]))]}
    return rows


def markdown(rows: dict[str, dict]) -> str:
    lines = ["| size (parameters) | data parallel: best inner lr, loss per seed | shipped: best "
             "inner lr, loss per seed | gap on the mean | worst seed | binding ratio | "
             "published M = 4 gap (Charles et al. 2025) |", "|---|---|---|---|---|---|---|"]
    pub = ", ".join(f"{100 * g:+.1f} % at {p / 1e6:g}M" for p, g in PUBLISHED)
    for size, r in rows.items():
        ddp = " / ".join(f"{x:.4f}" for x in r["ddp"])
        ship = " / ".join(f"{x:.4f}" for x in r["ship"])
        lines.append(f"| {size} ({r['params']:,}) | {r['ddp_lr']:g}: {ddp}"
                     f"{' (§1.3)' if r['ddp_reused'] else ''} | {r['ship_lr']:g}: {ship} | "
                     f"{100 * r['gap_mean']:+.1f} % | {100 * r['gap_worst_seed']:+.1f} % | "
                     f"{r['binding_ratio'] or 0:.0f}× | {pub if size == '0.84M' else ''} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: dict[str, dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [r["params"] for r in rows.values()]
    ax.plot(xs, [100 * r["gap_mean"] for r in rows.values()], "o-",
            label="this code, shipped settings (mean of seeds)")
    ax.vlines(xs, [100 * min(s / d - 1 for s, d in zip(r["ship"], r["ddp"], strict=True))
                   for r in rows.values()],
              [100 * r["gap_worst_seed"] for r in rows.values()], color="C0", alpha=0.5)
    ax.plot([p for p, _ in PUBLISHED], [100 * g for _, g in PUBLISHED], "s--", color="C1",
            label="DiLoCo M = 4, Charles et al. 2025 (Table 4)")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("eval loss gap to tuned data parallel (%)")
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(out: Path) -> str:
    rows = summary(out)
    md = markdown(rows)
    (out / "summary.md").write_text(md)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    if rows:
        plot(out / "gap_vs_size.png", rows)
    return md


def _lever_losses(out: Path) -> tuple[float | None, dict[str, dict[tuple[float, int], float]]]:
    """The shipped setting's seed-0 loss at its best rate at 0.84M, and each lever's losses
    by (rate, seed)."""
    ship = summary(out).get("0.84M")
    base = ship["ship"][0] if ship else None
    got = {}
    for lever in LEVERS:
        done = losses(_read(out / f"0.84M-{lever}" / "results.json"))
        got[lever] = {(lr, seed): done[name((SHIP, lr, seed))]
                      for lr in {r[1] for r in LEVER_RUNS} for seed in SEEDS
                      if name((SHIP, lr, seed)) in done}
    return base, got


def lever_wanted(out: Path) -> list:
    """The levers' runs wanted now (`LEVERS`)."""
    base, got = _lever_losses(out)
    runs = [r for r in LEVER_RUNS if (r[1], r[2]) not in got[r[0]]]
    for lever, seen in got.items():
        seed0 = {lr: v for (lr, seed), v in seen.items() if seed == 0}
        todo = [r for r in LEVER_RUNS if r[0] == lever and (r[1], r[2]) not in seen]
        if seed0 and not todo and base is not None and min(seed0.values()) < base:
            runs.append((lever, min(seed0, key=seed0.get), 1))
    return [(name((SHIP, lr, seed)), out / f"0.84M-{lever}",
             lambda d, lr=lr, seed=seed, lever=lever: command("0.84M", (SHIP, lr, seed), d)
             + LEVERS[lever])
            for lever, lr, seed in runs if (lr, seed) not in got[lever]]


def lever_report(out: Path) -> str:
    base, got = _lever_losses(out)
    lines = ["| lever at 0.84M (shipped setting) | inner lr | loss seed 0 / 1 | against the "
             "shipped setting's seed 0 |", "|---|---|---|---|"]
    for lever, seen in got.items():
        for lr in sorted({lr for lr, _ in seen}):
            by_seed = " / ".join(f"{seen[(lr, s)]:.4f}" for s in SEEDS if (lr, s) in seen)
            vs = f"{100 * (seen[(lr, 0)] / base - 1):+.1f} %" if base and (lr, 0) in seen else ""
            lines.append(f"| {lever} | {lr:g} | {by_seed} | {vs} |")
    return "\n".join(lines) + "\n"


def wanted(out: Path) -> list:
    """Every size's runs wanted now, the smallest size first."""
    return [(name(r), out / size, lambda d, size=size, r=r: command(size, r, d))
            for size in SIZES
            for r in plan(losses(_read(out / size / "results.json")))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ops.bench.quality_size",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/bench-quality-size"))
    ap.add_argument("--jobs", type=int, choices=(1, 2), default=1)
    ap.add_argument("--dry-run", action="store_true", help="print the runs wanted now")
    ap.add_argument("--report", action="store_true", help="write and print the summary only")
    ap.add_argument("--levers", action="store_true",
                    help="the two levers at the default model instead (LEVERS), in "
                         "OUT/0.84M-<lever>; with --report, their table")
    ap.add_argument("--resume-from", type=Path, metavar="RAW",
                    help="first copy the finished runs of a committed raw results file "
                         "(docs/bench/quality_size_*_results.json) into OUT")
    a = ap.parse_args(argv)
    if a.jobs == 2 and (os.cpu_count() or 1) < 2:
        ap.error("--jobs 2 needs two cores")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.resume_from:
        print(f"{resume_from(a.out, a.resume_from)} finished run(s) copied from {a.resume_from}")
    for size in SIZES:
        if (a.out / size).is_dir():
            merge_jobs(a.out / size)
    for lever in LEVERS if a.levers else ():
        (a.out / f"0.84M-{lever}").mkdir(parents=True, exist_ok=True)
        merge_jobs(a.out / f"0.84M-{lever}")
    todo = (lambda: lever_wanted(a.out)) if a.levers else (lambda: wanted(a.out))
    if a.report:
        print((lever_report if a.levers else report)(a.out), end="")
        return 0
    if a.dry_run:
        for key, d, _ in todo():
            print(f"{d.name}: {key}")
        return 0
    lock = lock_folder(ap, a.out)  # noqa: F841 (held until the process ends)
    if REUSED_DDP[1].exists():
        reuse_ddp(a.out, *REUSED_DDP)
    for size in SIZES:
        (a.out / size).mkdir(parents=True, exist_ok=True)
        merge(a.out / size)
    failed = drive(a.jobs, todo)
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    print((lever_report if a.levers else report)(a.out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
