"""`diloco plot RUN_DIR`: legible PNGs of a run from its metrics.jsonl (and its Redis).

Written into RUN_DIR (or ``--out DIR``):

* ``loss_tokens.png`` — evaluation loss of the global model vs tokens processed ("eval" records,
  plus the initial loss from the "summary" record at 0 tokens);
* ``loss_wall.png`` — the same vs wall time;
* ``rounds.png`` — a rounds timeline: per round the learners it merged (by fragment), those it
  did not, contributions it dropped, and the quorum and grace waits before it closed;
* ``bytes.png`` — bytes on the wire: per learner send and receive rates and cumulative totals,
  from the heartbeat counters ``bytes_sent``/``bytes_received`` in the "progress" records
  (with ``--redis-url``, plus each learner's final report at the end of the run).

Round records come from "round" records in metrics.jsonl when present and, with ``--redis-url``
(and ``--run``, default: RUN_DIR's name), from the fragments' ``:rounds`` streams; both have the
fields ``version, fragment, reason, included`` ([[entry_id, learner, weight, staleness], ...]),
``dropped`` ([[entry_id, reason], ...]), ``quorum_wait_s, grace_wait_s, t`` (unix s), and are
merged by (fragment, version). A plot without data is skipped with a reason, not drawn empty.
The figures are drawn with matplotlib's object API (no pyplot state).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from broker import registry
from broker.errors import DecodeError
from broker.ids import as_text
from broker.records import RoundRecord
from workers.common import open_run

PLOTS = ("loss_tokens", "loss_wall", "rounds", "bytes")
_DPI = 110


# ----------------------------------------------------------------------------- reading


def read_metrics(path: Path) -> tuple[dict[str, list[dict]], int]:
    """Records of metrics.jsonl grouped by kind, and the number of unreadable lines skipped
    (a run killed mid-write leaves a partial last line)."""
    out: dict[str, list[dict]] = {}
    bad = 0
    if not path.exists():
        return out, bad
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if isinstance(rec, dict):
                out.setdefault(str(rec.get("kind")), []).append(rec)
            else:
                bad += 1
    return out, bad


def normalize_round(fields: Mapping) -> dict[str, Any] | None:
    """A round record (Redis stream fields, bytes or str, or a metrics.jsonl record) as plain
    data; None when its version, fragment or time is missing or malformed."""
    try:
        rec = RoundRecord.from_fields(fields, lenient=True)
    except DecodeError:
        return None
    if rec.fragment < 0 or rec.t is None:
        return None
    return {"version": rec.version, "fragment": rec.fragment, "t": rec.t, "reason": rec.reason,
            "included": [list(i) for i in rec.included],
            "dropped": [[i, str(why)] for i, why in rec.dropped],
            "quorum_wait_s": rec.quorum_wait_s, "grace_wait_s": rec.grace_wait_s}


def read_redis(redis_url: str, run: str) -> tuple[list[dict[str, Any]], dict[str, dict]]:
    """Every round record in the run's ``:rounds`` streams (read in pages), and the learners'
    final reports (``final:<learner>`` in ``:done``: cumulative bytes at exit).

    Raises:
        BrokerError: The run has no configuration in Redis.
    """
    ctx = open_run(redis_url, run, wait_s=0, verify=False)
    r, keys, n_frags = ctx.r, ctx.keys, len(ctx.fragments)
    rounds = []
    try:
        for p in range(n_frags):
            start = "-"
            while True:
                batch = r.xrange(keys.fragment(p).rounds, min=start, max="+", count=1000)
                if not batch:
                    break
                rounds += [rec for _, fields in batch if (rec := normalize_round(fields))]
                start = "(" + as_text(batch[-1][0])
        finals = {k: v.to_dict() for k, v in registry.learner_final_reports(r, keys).items()}
    finally:
        r.close()
    return rounds, finals


def merge_rounds(*sources: Iterable[dict]) -> list[dict[str, Any]]:
    """Round records of several sources, one per (fragment, version), by close time."""
    seen: dict[tuple[int, int], dict] = {}
    for src in sources:
        for rec in src:
            seen.setdefault((rec["fragment"], rec["version"]), rec)
    return sorted(seen.values(), key=lambda r: (r["t"], r["fragment"]))


def byte_series(progress: Iterable[Mapping]) -> dict[str, dict[str, list[float]]]:
    """Per learner, from the heartbeat records in "progress" records: heartbeat times ``t``
    (unix s), cumulative ``sent``/``received`` bytes, and the rates ``sent_Bps`` /
    ``received_Bps`` (bytes/s) over each interval between consecutive heartbeats (one fewer
    than ``t``). A counter that goes down (a restarted learner) restarts from zero."""
    points: dict[str, dict[float, tuple[float, float]]] = {}
    for rec in progress:
        learners = rec.get("learners")
        if not isinstance(learners, Mapping):
            continue
        for name, hb in learners.items():
            if not isinstance(hb, Mapping):
                continue
            try:
                t, s, rcv = float(hb["t"]), float(hb["bytes_sent"]), float(hb["bytes_received"])
            except (KeyError, TypeError, ValueError):
                continue
            points.setdefault(str(name), {})[t] = (s, rcv)
    out = {}
    for name, pts in sorted(points.items()):
        ts = sorted(pts)
        ser: dict[str, list[float]] = {"t": ts, "sent": [pts[t][0] for t in ts],
                                       "received": [pts[t][1] for t in ts], "sent_Bps": [],
                                       "received_Bps": []}
        for i in range(1, len(ts)):
            dt = ts[i] - ts[i - 1]  # > 0: times are distinct dict keys, sorted
            for key in ("sent", "received"):
                d = ser[key][i] - ser[key][i - 1]
                ser[key + "_Bps"].append((d if d >= 0 else ser[key][i]) / dt)
        out[name] = ser
    return out


# ----------------------------------------------------------------------------- drawing


def _figure(rows: int = 1, height_in: float = 4.2, **kw):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, height_in), dpi=_DPI)
    axes = fig.subplots(rows, 1, squeeze=False, **kw)[:, 0]
    return fig, axes


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def _byte_unit(max_value: float) -> tuple[float, str]:
    for div, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if max_value >= div:
            return div, unit
    return 1.0, "B"


def plot_loss(evals: list[dict], x: str, path: Path, title: str) -> str:
    """Evaluation loss vs ``x`` ("tokens" or "wall_s")."""
    pts = sorted((float(e[x]), float(e["eval_loss"])) for e in evals
                 if x in e and "eval_loss" in e)
    fig, (ax,) = _figure()
    xs, ys = zip(*pts, strict=True)
    ax.plot(xs, ys, marker="o", markersize=3.5, label="global model (held-out split)")
    ax.annotate(f"{ys[-1]:.3f}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(-4, 8),
                ha="right", fontsize=8)
    ax.set_xlabel("tokens processed, all learners" if x == "tokens" else "wall time (s)")
    ax.set_ylabel("evaluation loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _reason_kind(reason: str) -> str:
    if reason.startswith("all "):
        return "all live learners in"
    if reason.startswith("final"):
        return "final flush"
    if reason.startswith("grace"):
        return "grace window over"
    if reason.startswith("quorum"):
        return "quorum, no grace window"
    return "other"


def plot_rounds(rounds: list[dict], t0: float, path: Path, title: str) -> str:
    """Rounds timeline: merged / absent learners and dropped entries per round, and waits."""
    from matplotlib.lines import Line2D

    learners = sorted({inc[1] for r in rounds for inc in r["included"]})
    any_drop = any(r["dropped"] for r in rounds)
    rows = {name: i for i, name in enumerate(learners)}
    drop_row = len(learners)
    frags = sorted({r["fragment"] for r in rounds})
    cmap = {p: f"C{i % 10}" for i, p in enumerate(frags)}
    fig, (ax, axw) = _figure(2, height_in=6.0, sharex=True,
                             gridspec_kw={"height_ratios": [max(2, len(learners) + any_drop), 2]})
    for r in rounds:
        x = r["t"] - t0
        inside = {inc[1] for inc in r["included"]}
        ax.scatter([x] * len(inside), [rows[n] for n in inside], s=28, color=cmap[r["fragment"]],
                   zorder=3)
        absent = [rows[n] for n in learners if n not in inside]
        ax.scatter([x] * len(absent), absent, s=28, facecolors="none", edgecolors="0.6",
                   linewidths=0.8, zorder=2)
        if r["dropped"]:
            ax.scatter([x], [drop_row], marker="x", s=40, color="red", zorder=3)
            ax.annotate(str(len(r["dropped"])), (x, drop_row), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7, color="red")
    ticks = list(range(len(learners) + any_drop))
    ax.set_yticks(ticks, learners + (["dropped"] if any_drop else []))
    ax.set_ylim(-0.6, max(ticks, default=0) + 0.6)
    ax.set_ylabel("learner")
    handles = [Line2D([], [], ls="", marker="o", color=cmap[p], label=f"merged, fragment {p}")
               for p in frags]
    handles.append(Line2D([], [], ls="", marker="o", mfc="none", mec="0.6",
                          label="not in the round"))
    if any_drop:
        handles.append(Line2D([], [], ls="", marker="x", color="red",
                              label="dropped contributions (count)"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="x")

    xs = [r["t"] - t0 for r in rounds]
    qs = [r["quorum_wait_s"] for r in rounds]
    gs = [r["grace_wait_s"] for r in rounds]
    axw.vlines(xs, 0, qs, colors="C0", lw=3, label="quorum wait (first to K-th arrival)")
    axw.vlines(xs, qs, [q + g for q, g in zip(qs, gs, strict=True)], colors="C1", lw=3,
               label="grace wait (K-th arrival to close)")
    markers = {"all live learners in": "o", "grace window over": "v",
               "quorum, no grace window": "s", "final flush": "*", "other": "D"}
    kinds = [_reason_kind(r["reason"]) for r in rounds]
    for kind, m in markers.items():
        sel = [i for i, k in enumerate(kinds) if k == kind]
        if sel:
            axw.scatter([xs[i] for i in sel], [qs[i] + gs[i] for i in sel], marker=m, s=22,
                        color="0.25", zorder=3, label=f"closed: {kind}")
    axw.set_ylim(bottom=0)
    axw.set_xlabel("time since run start (s)")
    axw.set_ylabel("wait before close (s)")
    axw.grid(alpha=0.3)
    axw.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_bytes(series: dict[str, dict[str, list[float]]], t0: float, path: Path,
               title: str) -> str:
    """Per-learner send/receive rates and cumulative bytes vs time."""
    fig, (ax, axc) = _figure(2, height_in=6.0, sharex=True)
    peak_rate = max([0.0] + [v for s in series.values()
                             for v in s["sent_Bps"] + s["received_Bps"]])
    peak_total = max([0.0] + [v for s in series.values() for v in s["sent"] + s["received"]])
    rdiv, runit = _byte_unit(peak_rate)
    cdiv, cunit = _byte_unit(peak_total)
    for i, (name, s) in enumerate(series.items()):
        color = f"C{i % 10}"
        ct = [t - t0 for t in s["t"]]
        if s["sent_Bps"]:  # a rate is constant over its interval: stairs
            ax.stairs([v / rdiv for v in s["sent_Bps"]], ct, color=color, label=f"{name} sent")
            ax.stairs([v / rdiv for v in s["received_Bps"]], ct, color=color, ls="--",
                      label=f"{name} received")
        axc.plot(ct, [v / cdiv for v in s["sent"]], color=color, marker=".", ms=3,
                 label=f"{name} sent")
        axc.plot(ct, [v / cdiv for v in s["received"]], color=color, ls="--", marker=".", ms=3,
                 label=f"{name} received")
    ax.set_ylabel(f"rate between heartbeats ({runit}/s)")
    ax.set_title(title)
    axc.set_ylabel(f"cumulative ({cunit})")
    axc.set_xlabel("time since run start (s)")
    for a in (ax, axc):
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:  # a run too short for a heartbeat has none
            a.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if not series:
        ax.text(0.5, 0.5, "no learner heartbeat with byte counters in this run",
                transform=ax.transAxes, ha="center", va="center", fontsize=9)
    return _save(fig, path)


# ----------------------------------------------------------------------------- driver


def make_plots(run_dir: str | Path, out_dir: str | Path | None = None,
               redis_url: str | None = None, run: str | None = None) -> dict[str, Any]:
    """Write every plot that has data (the stable ``plot --json`` output).

    Returns:
        ``{"run_dir", "out_dir", "plots": {name: path or None}, "skipped": {name: reason},
        "records": {"eval", "progress", "round", "summary", "unreadable_lines"},
        "rounds": {"metrics", "redis", "total"}}`` with ``name`` in :data:`PLOTS`.

    Raises:
        FileNotFoundError: RUN_DIR has no metrics.jsonl.
        BrokerError: ``redis_url`` is given and the run has no configuration there.
    """
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no such file (is {run_dir} a run folder?)")
    out = Path(out_dir) if out_dir else run_dir
    out.mkdir(parents=True, exist_ok=True)
    recs, bad = read_metrics(metrics)
    evals = list(recs.get("eval", []))
    summary = (recs.get("summary") or [{}])[-1]
    name = run or run_dir.name
    what = f"run {name}"
    if summary.get("mode"):
        what += f" ({summary['mode']}, M={summary.get('learners')})"
    if "initial_eval_loss" in summary:
        evals.insert(0, {"tokens": 0, "wall_s": 0.0, "eval_loss": summary["initial_eval_loss"]})
    from_metrics = [x for rec in recs.get("round", []) if (x := normalize_round(rec))]
    from_redis, finals = read_redis(redis_url, name) if redis_url else ([], {})
    rounds = merge_rounds(from_metrics, from_redis)
    starts = [float(r["t"]) for rs in recs.values() for r in rs
              if isinstance(r.get("t"), int | float)]
    starts += [r["t"] - r["quorum_wait_s"] - r["grace_wait_s"] for r in rounds]
    t0 = min(starts, default=0.0)

    plots: dict[str, str | None] = dict.fromkeys(PLOTS)
    skipped: dict[str, str] = {}
    if evals:
        plots["loss_tokens"] = plot_loss(evals, "tokens", out / "loss_tokens.png",
                                         f"{what}: evaluation loss vs tokens")
        plots["loss_wall"] = plot_loss(evals, "wall_s", out / "loss_wall.png",
                                       f"{what}: evaluation loss vs wall time")
    else:
        skipped["loss_tokens"] = skipped["loss_wall"] = "no eval records in metrics.jsonl"
    if rounds:
        plots["rounds"] = plot_rounds(rounds, t0, out / "rounds.png",
                                      f"{what}: rounds ({len(rounds)})")
    else:
        skipped["rounds"] = ("no round records: metrics.jsonl has none; pass --redis-url "
                             "(and --run) to read the :rounds streams" if not redis_url else
                             "no round records in metrics.jsonl or Redis")
    progress = list(recs.get("progress", []))
    if finals and isinstance(summary.get("wall_s"), int | float):
        # the learners' final counters, at the moment the launcher saw every process exit
        t_end = t0 + float(summary["wall_s"])
        progress.append({"learners": {n: {**rep, "t": t_end} for n, rep in finals.items()}})
    series = byte_series(progress)
    if any(s["t"] for s in series.values()):
        plots["bytes"] = plot_bytes(series, t0, out / "bytes.png",
                                    f"{what}: bytes on the wire per learner")
    else:
        skipped["bytes"] = "no learner heartbeats with byte counters in progress records"
    return {
        "run_dir": str(run_dir), "out_dir": str(out), "plots": plots, "skipped": skipped,
        "records": {"eval": len(recs.get("eval", [])), "progress": len(recs.get("progress", [])),
                    "round": len(recs.get("round", [])), "summary": len(recs.get("summary", [])),
                    "unreadable_lines": bad},
        "rounds": {"metrics": len(from_metrics), "redis": len(from_redis),
                   "total": len(rounds)},
    }
