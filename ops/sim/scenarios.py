"""Scenarios of the goodput simulator (``ops/sim/simulator.py``): the published table beside
the simulated one (rows, text, PNG) and the setups of a projection of this implementation to
scale from figures measured on real runs (inner step time, learner rejoin time, syncer round
time). `diloco goodput` (``ops/cli/goodput.py``) is their command line.
"""

from __future__ import annotations

from collections.abc import Sequence

from ops.sim.simulator import (
    PUBLISHED,
    TABLE_CHIPS,
    Assumptions,
    Cell,
    Setup,
    make_setup,
)


def pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def cell_dict(c: Cell) -> dict:
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
        row = cell_dict(c)
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


def project_setups(a: Assumptions, learners: int, rejoin_s: float, round_s: float,
                   fragments: int) -> list[Setup]:
    """Setups of ``--project``: baselines, the table's learner model, this implementation.

    This implementation's learner is a process: on a failure it is restarted whole (a spare
    takes the failed chips, no elastic re-form), it is out for ``rejoin_s`` and loses, per
    fragment, the inner work since that fragment's last push (each fragment is pushed once per
    syncer round, the fragments staggered, so ``sync_s = round_s``).

    Args:
        a: Assumptions (``step_s`` already set from ``--step-s``).
        learners: M.
        rejoin_s: Seconds from a learner crash until it trains again.
        round_s: Seconds between two pushes of the same fragment by one learner.
        fragments: Fragments a learner pushes in turn per round.

    Returns:
        The setups to simulate.
    """
    impl = Setup(f"impl M={learners}", learners, False, rejoin_s, 0.0, 0.0, round_s,
                 min(a.quorum, learners), fragments)
    return [make_setup("dp", a), make_setup("elastic-dp", a),
            make_setup(f"M={learners}", a), impl]
