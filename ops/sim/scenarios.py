"""`diloco goodput`: goodput and uptime at scale from the discrete-event simulator.

This module owns the command line of the simulator in ``ops/sim/simulator.py``: a scenario
mode (setups side by side at given chip counts), ``--table`` (the published table beside the
simulated one, as text or ``--json``), ``--plot FILE`` (goodput vs chips, PNG) and
``--project`` (goodput this implementation would reach at scale, from figures measured on
real runs: inner step time, learner rejoin time, syncer round time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from ops.sim.simulator import (
    PUBLISHED,
    TABLE_CHIPS,
    TABLE_SETUPS,
    YEAR_S,
    Assumptions,
    Cell,
    Setup,
    make_setup,
    simulate_cell,
    simulate_table,
    with_overrides,
)

_KNOBS = (  # (flag, Assumptions field, type, help)
    ("--slice-chips", "slice_chips", int, "chips an elastic group drops on a failure"),
    ("--repair-s", "repair_s", float, "time for a dropped slice to return"),
    ("--downscale-s", "downscale_s", float, "pause of a group to drop a failed slice"),
    ("--upscale-s", "upscale_s", float, "pause of a group to re-admit returned slices"),
    ("--upscale-wait-s", "upscale_wait_s", float, "wait of a returned slice before an upscale"),
    ("--restart-s", "restart_s", float, "restart pause of non-elastic data-parallel"),
    ("--checkpoint-s", "checkpoint_s", float, "training time between two checkpoints (DP)"),
    ("--step-s", "step_s", float, "inner step time"),
    ("--speed-cv", "speed_cv", float, "coefficient of variation of a chip's step time"),
    ("--quorum", "quorum", int, "running learners a DiLoCo round needs (K)"),
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``goodput`` subcommand to the ``diloco`` parser.

    Args:
        sub: The subparsers object of the top-level parser.
    """
    p = sub.add_parser(
        "goodput",
        help="simulate goodput at scale (DP, elastic DP, Decoupled DiLoCo with M learners)",
        description="Discrete-event goodput simulator. Without --table or --project: the "
        "setups side by side at --chips. Knobs default to the documented fit (docs/GOODPUT.md).",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--table", action="store_true",
                      help="150k-2.4M chips x six setups, beside the published values")
    mode.add_argument("--project", action="store_true",
                      help="project this implementation to scale from measured "
                      "--step-s, --rejoin-s and --round-s")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--plot", metavar="FILE", help="write goodput vs chips as a PNG (table)")
    p.add_argument("--chips", type=int, nargs="+", metavar="N",
                   help="chip counts (default: 1.2M; with --project: the table's)")
    p.add_argument("--learners", type=int, nargs="+", metavar="M",
                   help="DiLoCo learner counts (default: 2 4 8 16; with --project: 8)")
    p.add_argument("--chips-per-learner", type=int, metavar="C",
                   help="instead of --learners: M = chips / C (rounded, at least 1)")
    p.add_argument("--mtbi-days", type=float, default=YEAR_S / 86_400.0,
                   help="mean time between interruptions of one chip, days (default 365)")
    defaults = Assumptions()
    for flag, field, typ, text in _KNOBS:
        p.add_argument(flag, type=typ, help=f"{text} (default {getattr(defaults, field):g})")
    p.add_argument("--rejoin-s", type=float,
                   help="--project: seconds from a learner crash until it trains again")
    p.add_argument("--round-s", type=float,
                   help="--project: syncer round time: seconds between two pushes of the same "
                   "fragment by one learner (H inner steps)")
    p.add_argument("--fragments", type=int, default=4,
                   help="--project: fragments a learner pushes in turn per round (default 4)")
    p.add_argument("--seeds", type=int, default=10, help="runs per cell (default 10)")
    p.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    p.add_argument("--failures", type=int, default=4000,
                   help="interruptions per run; sets the simulated horizon (default 4000)")
    p.set_defaults(func=run)


def assumptions_from(args: argparse.Namespace) -> Assumptions:
    """The documented assumptions with the knobs given on the command line applied.

    Args:
        args: Parsed ``goodput`` arguments.

    Returns:
        The assumptions to simulate with.
    """
    overrides = {field: getattr(args, field) for _, field, _, _ in _KNOBS}
    overrides["mtbi_s"] = args.mtbi_days * 86_400.0
    return with_overrides(Assumptions(), **overrides)


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _cell_dict(c: Cell) -> dict:
    return {"setup": c.setup, "chips": c.chips, "goodput": round(c.goodput, 5),
            "goodput_ci95": round(c.goodput_ci, 5), "uptime": round(c.uptime, 5),
            "uptime_ci95": round(c.uptime_ci, 5),
            "failures_per_hour": round(c.failures_per_hour, 2), "seeds": c.seeds}


def _chips_label(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def table_rows(cells: Sequence[Cell]) -> list[dict]:
    """JSON rows of the table: each simulated cell with its published value.

    Args:
        cells: Cells of ``simulate_table``.

    Returns:
        One dict per cell with setup, chips, goodput, published (None if not in the paper).
    """
    rows = []
    for c in cells:
        row = _cell_dict(c)
        pub = PUBLISHED.get(c.setup)
        row["published"] = pub[TABLE_CHIPS.index(c.chips)] if pub and c.chips in TABLE_CHIPS \
            else None
        rows.append(row)
    return rows


def format_table(cells: Sequence[Cell]) -> str:
    """Text table: one line per setup, simulated ± CI beside published, per chip count.

    Args:
        cells: Cells of ``simulate_table``.

    Returns:
        The table and the largest absolute deviation, as text.
    """
    chips = sorted({c.chips for c in cells})
    by = {(c.setup, c.chips): c for c in cells}
    setups = list(dict.fromkeys(c.setup for c in cells))
    head = f"{'setup':<11}" + "".join(f"{_chips_label(n) + ' chips':>22}" for n in chips)
    lines = ["goodput: simulated (95% CI) | published", head, "-" * len(head)]
    worst = 0.0
    for s in setups:
        parts = []
        for n in chips:
            c = by[(s, n)]
            pub = PUBLISHED[s][TABLE_CHIPS.index(n)] if s in PUBLISHED and n in TABLE_CHIPS \
                else None
            text = f"{100 * c.goodput:4.1f}±{100 * c.goodput_ci:3.1f}"
            if pub is not None:
                text += f" | {100 * pub:3.0f}%"
                worst = max(worst, abs(c.goodput - pub))
            parts.append(f"{text:>22}")
        lines.append(f"{s:<11}" + "".join(parts))
    lines.append(f"max |simulated - published| = {100 * worst:.1f} points")
    return "\n".join(lines)


def plot_table(cells: Sequence[Cell], path: str) -> None:
    """Draw goodput vs chips per setup: simulated lines with CI bands, published markers.

    Args:
        cells: Cells of ``simulate_table``.
        path: PNG file to write.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    setups = list(dict.fromkeys(c.setup for c in cells))
    published = [s for s in setups if s in PUBLISHED]
    colors = ["#444444", "#d62728", "#ff7f0e", "#2ca02c", "#1f77b4", "#9467bd", "#8c564b"]
    for k, s in enumerate(setups):
        row = sorted((c for c in cells if c.setup == s), key=lambda c: c.chips)
        xs = [c.chips for c in row]
        ys = [100 * c.goodput for c in row]
        color = colors[k % len(colors)]
        ax.plot(xs, ys, "-", color=color, lw=2, label=f"{s} (simulated)")
        ax.fill_between(xs, [100 * (c.goodput - c.goodput_ci) for c in row],
                        [100 * (c.goodput + c.goodput_ci) for c in row], color=color, alpha=0.2)
        if s in PUBLISHED:
            ax.plot(TABLE_CHIPS, [100 * v for v in PUBLISHED[s]], "o", color=color, ms=7,
                    mfc="none", mew=2, label=f"{s} (published)")
    ax.set_xscale("log")
    ticks = sorted({c.chips for c in cells} | (set(TABLE_CHIPS) if published else set()))
    ax.set_xticks(ticks, [_chips_label(n) for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("chips (log scale; 1 interruption per chip-year)")
    ax.set_ylabel("goodput (%)")
    ax.set_ylim(0, 100)
    ax.set_title("Goodput vs scale: lines simulated (95% CI band), circles published")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)


def project_setups(args: argparse.Namespace, a: Assumptions, learners: int) -> list[Setup]:
    """Setups of ``--project``: baselines, the table's learner model, this implementation.

    This implementation's learner is a process: on a failure it is restarted whole (a spare
    takes the failed chips, no elastic re-form), it is out for ``rejoin_s`` and loses, per
    fragment, the inner work since that fragment's last push (each fragment is pushed once per
    syncer round, the fragments staggered, so ``sync_s = round_s``).

    Args:
        args: Parsed arguments with ``rejoin_s`` and ``round_s``.
        a: Assumptions (``step_s`` already set from ``--step-s``).
        learners: M.

    Returns:
        The setups to simulate.
    """
    impl = Setup(f"impl M={learners}", learners, False, args.rejoin_s, 0.0, 0.0, args.round_s,
                 min(a.quorum, learners), args.fragments)
    return [make_setup("dp", a), make_setup("elastic-dp", a),
            make_setup(f"M={learners}", a), impl]


def _learner_counts(args: argparse.Namespace, chips: int, default: Sequence[int]) -> list[int]:
    if args.chips_per_learner:
        return [max(1, round(chips / args.chips_per_learner))]
    return list(args.learners or default)


def _print_cells(cells: Sequence[Cell], title: str) -> None:
    print(title)
    print(f"{'setup':<14}{'chips':>10}{'goodput (95% CI)':>20}{'uptime (95% CI)':>20}"
          f"{'interruptions/h':>17}")
    for c in cells:
        print(f"{c.setup:<14}{c.chips:>10}{_pct(c.goodput):>13} ± {100 * c.goodput_ci:3.1f}"
              f"{_pct(c.uptime):>13} ± {100 * c.uptime_ci:3.1f}{c.failures_per_hour:>17.1f}")


def run(args: argparse.Namespace) -> int:
    """Run ``diloco goodput``; returns the exit code (2 on bad arguments)."""
    bad = [text for ok, text in (
        (args.seeds >= 1, "--seeds >= 1"), (args.failures >= 10, "--failures >= 10"),
        (args.mtbi_days > 0, "--mtbi-days > 0"), (min(args.chips or [1]) >= 1, "--chips >= 1"),
        (min(args.learners or [1]) >= 1, "--learners >= 1"),
        ((args.chips_per_learner or 1) >= 1, "--chips-per-learner >= 1")) if not ok]
    if bad:
        print(f"goodput: need {', '.join(bad)}", file=sys.stderr)
        return 2
    try:
        a = assumptions_from(args)
        if args.project:
            return _run_project(args, a)
        t0 = time.perf_counter()
        if args.table or (args.plot and not args.chips):
            if args.chips_per_learner:
                raise ValueError("--chips-per-learner needs a fixed --chips (not --table)")
            chips = tuple(args.chips or TABLE_CHIPS)
            setups = ("dp", "elastic-dp", *(f"M={m}" for m in args.learners)) \
                if args.learners else TABLE_SETUPS
            cells = simulate_table(a, chips, setups, args.seeds, args.seed, args.failures)
        else:
            cells = []
            for n in args.chips or [1_200_000]:
                names = ["dp", "elastic-dp"] + [
                    f"M={m}" for m in _learner_counts(args, n, (2, 4, 8, 16))]
                cells += [simulate_cell(make_setup(s, a), n, a, args.seeds, args.seed,
                                        args.failures) for s in names]
    except ValueError as e:
        print(f"goodput: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    if args.plot:
        plot_table(cells, args.plot)
    if args.json:
        rows = table_rows(cells)
        devs = [abs(r["goodput"] - r["published"]) for r in rows if r["published"] is not None]
        out = {"assumptions": dataclasses.asdict(a), "seeds": args.seeds, "seed": args.seed,
               "failures_per_run": args.failures, "rows": rows,
               "max_abs_deviation": round(max(devs), 5) if devs else None,
               "elapsed_s": round(elapsed, 2)}
        print(json.dumps(out))
        return 0
    if args.table or (args.plot and not args.chips):
        print(format_table(cells))
    else:
        _print_cells(cells, "goodput and uptime, mean over seeds (95% CI)")
    print(f"({args.seeds} seeds x ~{args.failures} interruptions per cell, {elapsed:.1f} s"
          + (f"; plot: {args.plot}" if args.plot else "") + ")")
    return 0


def _run_project(args: argparse.Namespace, a: Assumptions) -> int:
    missing = [f for f in ("step_s", "rejoin_s", "round_s") if getattr(args, f) is None]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        print(f"goodput --project: missing {flags}", file=sys.stderr)
        return 2
    if min(args.step_s, args.rejoin_s, args.round_s) <= 0 or args.fragments < 1:
        print("goodput --project: --step-s, --rejoin-s and --round-s must be > 0, "
              "--fragments >= 1", file=sys.stderr)
        return 2
    if args.checkpoint_s is None:  # data-parallel checkpoints every step, as in the table
        a = dataclasses.replace(a, checkpoint_s=args.step_s)
    t0 = time.perf_counter()
    cells, notes = [], []
    for n in args.chips or TABLE_CHIPS:
        for m in _learner_counts(args, n, (8,)):
            for s in project_setups(args, a, m):
                if any(c.setup == s.name and c.chips == n for c in cells):
                    continue
                cells.append(simulate_cell(s, n, a, args.seeds, args.seed, args.failures))
    inner = args.round_s / args.step_s
    notes.append(f"inputs: step {args.step_s:g} s, rejoin {args.rejoin_s:g} s, round "
                 f"{args.round_s:g} s (~{inner:.0f} inner steps per round)")
    notes.append(f"impl learner on a failure: restarted whole, out {args.rejoin_s:g} s, loses "
                 f"its inner work since each fragment's last push (~{args.round_s / 2:g} s "
                 f"on average, {args.fragments} fragment(s))")
    notes.append(f"table model learner: out {a.downscale_s:g} s (elastic re-form), loses the "
                 f"step in flight ({a.step_s / 2:g} s)")
    if args.json:
        print(json.dumps({"assumptions": dataclasses.asdict(a),
                          "inputs": {"step_s": args.step_s, "rejoin_s": args.rejoin_s,
                                     "round_s": args.round_s, "fragments": args.fragments},
                          "rows": [_cell_dict(c) for c in cells],
                          "elapsed_s": round(time.perf_counter() - t0, 2)}))
        return 0
    _print_cells(cells, "projection: this implementation at scale vs the baselines")
    for line in notes:
        print("  " + line)
    return 0
