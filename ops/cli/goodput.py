"""`diloco goodput`: goodput and uptime at scale from the discrete-event simulator.

A scenario mode (setups side by side at given chip counts), ``--table`` (the published table
beside the simulated one, as text or ``--json``), ``--plot FILE`` (goodput vs chips, PNG) and
``--project`` (goodput this implementation would reach at scale, from figures measured on real
runs: inner step time, learner rejoin time, syncer round time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from ops.sim import (
    TABLE_CHIPS,
    TABLE_SETUPS,
    YEAR_S,
    Assumptions,
    Cell,
    cell_dict,
    format_table,
    make_setup,
    pct,
    plot_table,
    project_setups,
    simulate_cell,
    simulate_table,
    table_rows,
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


def _learner_counts(args: argparse.Namespace, chips: int, default: Sequence[int]) -> list[int]:
    if args.chips_per_learner:
        return [max(1, round(chips / args.chips_per_learner))]
    return list(args.learners or default)


def _print_cells(cells: Sequence[Cell], title: str) -> None:
    print(title)
    print(f"{'setup':<14}{'chips':>10}{'goodput (95% CI)':>20}{'uptime (95% CI)':>20}"
          f"{'interruptions/h':>17}")
    for c in cells:
        print(f"{c.setup:<14}{c.chips:>10}{pct(c.goodput):>13} ± {100 * c.goodput_ci:3.1f}"
              f"{pct(c.uptime):>13} ± {100 * c.uptime_ci:3.1f}{c.failures_per_hour:>17.1f}")


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
            for s in project_setups(a, m, args.rejoin_s, args.round_s, args.fragments):
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
                          "rows": [cell_dict(c) for c in cells],
                          "elapsed_s": round(time.perf_counter() - t0, 2)}))
        return 0
    _print_cells(cells, "projection: this implementation at scale vs the baselines")
    for line in notes:
        print("  " + line)
    return 0
