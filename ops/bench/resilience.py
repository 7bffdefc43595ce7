"""`diloco bench s1|s2|poison`: goodput under failures and stragglers, and the poison guard
on real processes, side by side in one run each.

* s1 — failures: M=4, a random learner killed every `--kill-every-s` seconds on average
  (Poisson, seeded), back after 5 s; `decoupled` vs `sync-diloco`; goodput, loss at equal wall
  time, the chaos accounting.
* s2 — heterogeneous hardware: learner speeds 1, 1, 1, 1/3 (the slow one made slow by an
  injected per-step delay); `decoupled` (K=1 + grace) vs K=1 without grace vs `sync-diloco`;
  the wall time at which each reaches sync-diloco's final loss.
* poison — one learner of four poisoned (10⁴× norm, 10⁴× tokens), guard on vs off, beside the
  clean run: final loss at equal steps and the ledger of the poisoned pushes.

Learners share 2 cores here, so each inner step is paced to a fixed wall time (`--pace-s`):
a dead or blocked learner would otherwise hand its CPU to the others and flatter every ratio.
The pacing counts as compute.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path

from ops.chaos import SPARE_AFTER_S, random_schedule, run_chaos
from pipeline import config as cfgmod
from pipeline.config import RunConfig
from pipeline.data import run_corpus


def base_config() -> RunConfig:
    return cfgmod.from_dict({
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "data": {"max_bytes": 4_000_000, "eval_batches": 8},
        "inner": {"lr": 1e-3, "warmup_steps": 50, "batch_size": 16},
        "sync": {"fragments": 4, "sync_every": 100},
        "broker": {"heartbeat_s": 0.5, "heartbeat_ttl_s": 2.0},
        "learners": 4, "steps": 10**6,
    })


Progress = Callable[[str], None]
Live = Callable[[object, float], None]  # run_chaos's progress callback (the live view)


def _quiet(_: str) -> None:
    pass


def _variant(cfg: RunConfig, out: Path, name: str, schedule, duration_s: float, pace_s: float,
             corpus, delays=None, progress: Progress = _quiet, live: Live | None = None,
             learner_args: dict[str, list[str]] | None = None, spares: bool = False,
             spare_after_s: float = SPARE_AFTER_S) -> dict:
    run = re.sub(r"[^A-Za-z0-9._-]+", "-", name.replace("+", "p")).strip("-")
    t0 = time.monotonic()
    rep = run_chaos(cfg, out / run, run, schedule, duration_s, pace_s=pace_s,
                    delays_s=delays or {}, eval_every_s=10.0, corpus=corpus, progress=live,
                    learner_args=learner_args, spares=spares, spare_after_s=spare_after_s)
    rep["bench_wall_s"] = time.monotonic() - t0
    rep["final_eval_loss"] = rep["history"][-1]["eval_loss"] if rep["history"] else None
    progress(f"{name:24s} goodput {rep['goodput']:.3f} availability "
             f"{rep['availability']:.3f} loss {rep['final_eval_loss']} rounds {rep['rounds']} "
             f"lost {rep['lost']}")
    return rep


S1_MODES = ("decoupled", "sync-diloco")


def s1(out: Path, seeds: list[int], *, duration_s: float = 300.0, pace_s: float = 0.2,
       kill_every_s: float = 30.0, down_s: float = 5.0, progress: Progress = _quiet,
       live: Live | None = None, base: RunConfig | None = None, spares: bool = False,
       spare_after_s: float = SPARE_AFTER_S, checkpoint_every: int = 0,
       modes: tuple[str, ...] = S1_MODES) -> dict:
    """S1, learner failures: decoupled and sync-diloco side by side per seed (the seed picks
    the kill schedule). `base`: the configuration both modes start from (default
    `base_config`); `spares`: every learner of both modes has a warm spare (`ChaosRun`),
    the next one started `spare_after_s` after a takeover; `checkpoint_every`: every
    learner's checkpoint interval in inner steps (0: the learner's default, every Δh; the
    same for both modes either way); `modes`: a subset of `S1_MODES` (the ratios need
    both). Writes ``s1.json`` and ``s1.png`` to `out`; returns the document."""
    out.mkdir(parents=True, exist_ok=True)
    base = base or base_config()
    corpus = run_corpus(base)
    ckpt = {f"L{m}": ["--checkpoint-every", str(checkpoint_every)]
            for m in range(base.learners)} if checkpoint_every else None
    runs = {}
    for seed in seeds:
        schedule = random_schedule(seed, duration_s, {"kill-learner": kill_every_s},
                                   down_s, quiet_tail_s=15.0)
        runs[seed] = {mode: _variant(cfgmod.override(base, mode=mode), out / f"seed{seed}",
                                     mode, schedule, duration_s, pace_s, corpus,
                                     progress=progress, live=live, learner_args=ckpt,
                                     spares=spares, spare_after_s=spare_after_s)
                      for mode in modes}
        runs[seed]["kills"] = len(runs[seed][modes[0]].get("faults", []))
    summary: dict = {"kills_per_seed": {s: r["kills"] for s, r in runs.items()}}
    for mode in modes:
        m = mode.replace("-", "_")
        summary[f"goodput_{m}_mean"] = _mean(r[mode]["goodput"] for r in runs.values())
        summary[f"final_loss_{m}_mean"] = _mean(r[mode]["final_eval_loss"]
                                               for r in runs.values())
        # a killed learner's restart until its first contribution is merged again
        for stat, agg in (("p50", _mean), ("max", _max)):
            summary[f"rejoin_s_{stat}_{m}"] = agg(r[mode].get(f"rejoin_s_{stat}")
                                                  for r in runs.values())
    if set(modes) == set(S1_MODES):
        summary["goodput_ratio_per_seed"] = {
            s: r["decoupled"]["goodput"] / r["sync-diloco"]["goodput"] for s, r in runs.items()}
        summary["goodput_ratio_of_means"] = (summary["goodput_decoupled_mean"]
                                             / summary["goodput_sync_diloco_mean"])
    doc = _save(out, "s1", runs, summary, {"duration_s": duration_s, "pace_s": pace_s,
                                           "seeds": seeds, "spares": spares,
                                           "spare_after_s": spare_after_s,
                                           "checkpoint_every": checkpoint_every,
                                           "modes": list(modes)}, base)
    _plot(out / "s1.png", runs, f"S1: learner failures (shaded), M={base.learners}")
    return doc


def s2(out: Path, seeds: list[int], variant_names: list[str], *, duration_s: float = 180.0,
       pace_s: float = 0.2, progress: Progress = _quiet, live: Live | None = None,
       base: RunConfig | None = None) -> dict:
    """S2, a straggler (speeds 1, 1, 1, 1/3): the variants side by side per seed (the seed
    picks the model initialisation and data order). `base`: the configuration every variant
    starts from (default `base_config`). Writes ``s2.json`` and ``s2.png``."""
    out.mkdir(parents=True, exist_ok=True)
    slow = {"L3": 2 * pace_s}  # 3× the paced step time: speed 1/3
    runs = {}
    for seed in seeds:
        seeded = cfgmod.override(base or base_config(), seed=seed)
        corpus = run_corpus(seeded)
        variants = {name: _s2_config(seeded, name) for name in variant_names}
        results = {name: _variant(cfg, out / f"seed{seed}", name, [], duration_s,
                                  pace_s, corpus, slow, progress, live)
                   for name, cfg in variants.items()}
        for rep in results.values():
            rep["tail_mean_eval_loss"] = _tail_mean(rep["history"], TAIL_S)
            if "sync-diloco" in results:
                target = results["sync-diloco"]["final_eval_loss"]
                hit = [h["wall_s"] for h in rep["history"] if h["eval_loss"] <= target]
                rep["time_to_sync_final_loss_s"] = hit[0] if hit else None
                rep["sync_finish_s"] = results["sync-diloco"]["history"][-1]["wall_s"]
        runs[seed] = results
    names = list(next(iter(runs.values())))
    summary = {name: {"final_eval_loss_mean": _mean(r[name]["final_eval_loss"]
                                                    for r in runs.values()),
                      f"last_{TAIL_S:.0f}s_mean_eval_loss_mean": _mean(
                          r[name]["tail_mean_eval_loss"] for r in runs.values()),
                      "goodput_mean": _mean(r[name]["goodput"] for r in runs.values())}
               for name in names}
    doc = _save(out, "s2", runs, summary, {"duration_s": duration_s, "pace_s": pace_s,
                                           "seeds": seeds}, base or base_config())
    _plot(out / "s2.png", runs, "S2: speeds 1, 1, 1, 1/3, M=4")
    return doc


POISON_VARIANTS = ("clean", "clean (again)", "clean M=3 (the honest learners alone)",
                   "clean with L3 not syncing (its shard unused)",
                   "10⁴× norm: guard on", "10⁴× norm: guard off", "10⁴× tokens: guard on",
                   "10⁴× tokens: guard off")


def poison(out: Path, names: list[str] | None = None, *, steps: int = 1000, pace_s: float = 0.05,
           progress: Progress = _quiet, live: Live | None = None) -> dict:
    """The poison guard on real processes: M=4 learners of `steps` inner steps each, no other
    fault; learner L3 sends δ × 10⁴ ("norm") or claims 10⁴ × its tokens ("tokens"), with the
    guard on and off, side by side with the clean run (twice: its run-to-run spread). The
    chaos ledger says, per learner, how many acknowledged pushes were merged and how many the
    guard refused. Writes ``poison.json``; returns the document."""
    out.mkdir(parents=True, exist_ok=True)
    base = cfgmod.override(base_config(), steps=steps)
    corpus = run_corpus(base)
    runs = {}
    for name in names or POISON_VARIANTS:
        if name not in POISON_VARIANTS:
            raise ValueError(f"unknown variant {name!r}; known: {', '.join(POISON_VARIANTS)}")
        args, cfg = None, base
        if "M=3" in name:
            cfg = cfgmod.override(base, learners=3)
        elif "not syncing" in name:
            args = {"L3": ["--no-sync"]}
        elif not name.startswith("clean"):
            kind = "norm" if "norm" in name else "tokens"
            args = {"L3": ["--poison", kind, "--poison-scale", "1e4"]}
            cfg = cfgmod.override(base, **{"sync.guard": name.endswith("on")})
        # the run ends when the learners finish their steps: the duration only bounds it
        runs[name] = _variant(cfg, out, name, [], 3600.0, pace_s, corpus, progress=progress,
                              live=live, learner_args=args)
    clean = runs.get("clean", {}).get("final_eval_loss")
    summary = {}
    for name, rep in runs.items():
        by = rep.get("by_learner", {})
        bad = by.get("L3", {}) if not name.startswith("clean") else {}
        loss = rep["final_eval_loss"]
        summary[name] = {
            "final_eval_loss": loss,
            "vs_clean": (loss / clean - 1) if clean and loss is not None else None,
            "poisoned_pushes_acked": bad.get("acked"),
            "poisoned_refused_by_guard": bad.get("dropped_by_guard"),
            "poisoned_merged": bad.get("merged"),
            "honest_refused_by_guard": sum(v["dropped_by_guard"] for k, v in by.items()
                                           if k != "L3" or name.startswith("clean")),
            "lost": rep["lost"], "rounds": rep["rounds"], "goodput": rep["goodput"],
            "wall_s": rep["bench_wall_s"]}
    return _save(out, "poison", {"runs": runs}, summary, {"steps": steps, "pace_s": pace_s},
                 base)


S2_VARIANTS = ("decoupled K=1 + grace", "K=1 no grace", "sync-diloco",
               "K=1 + grace, full steps", "K=1 no grace, full steps")


def variant_names(text: str) -> list[str]:
    """Split a comma-separated list of S2 variant names (some names contain a comma).

    Raises:
        ValueError: A name is not one of `S2_VARIANTS`.
    """
    names, rest = [], text.strip()
    while rest:
        name = next((n for n in sorted(S2_VARIANTS, key=len, reverse=True)
                     if rest.startswith(n)), None)
        if name is None:
            raise ValueError(f"--variants: cannot read {rest!r}; known: "
                             f"{'; '.join(S2_VARIANTS)}")
        names.append(name)
        rest = rest[len(name):].lstrip(",").strip()
    return names


def _s2_config(base: RunConfig, name: str) -> RunConfig:
    """The S2 variants: the shipped decoupled policy (K=1 + grace), the same without grace,
    sync-diloco, and ablations of both decoupled ones with a full outer step per round.
    `name` comes from `variant_names`, which refuses unknown names."""
    if name == "sync-diloco":
        return cfgmod.override(base, mode="sync-diloco")
    over = {} if "no grace" not in name else {"sync.grace_max_s": 0.0}
    if name.endswith("full steps"):
        over["sync.round_step"] = "full"
    return cfgmod.override(base, mode="decoupled", **over)


TAIL_S = 30.0  # S2 also reports the mean evaluation loss over the run's last 30 s


def _tail_mean(history: list[dict], tail_s: float) -> float | None:
    if not history:
        return None
    end = history[-1]["wall_s"]
    tail = [h["eval_loss"] for h in history if h["wall_s"] >= end - tail_s]
    return float(sum(tail) / len(tail))


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return float(sum(vals) / len(vals)) if vals else None


def _max(values) -> float | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _save(out: Path, name: str, runs: dict, summary: dict, params: dict,
          base: RunConfig) -> dict:
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, Python "
                       f"{platform.python_version()}", **params, "config": cfgmod.to_dict(base)}
    doc = {"meta": meta, "summary": summary, "runs": {str(k): v for k, v in runs.items()}}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    return doc


REPORT_KEYS = ("goodput", "availability", "final_eval_loss", "tail_mean_eval_loss", "rounds",
               "pushes_acked", "merged", "dropped_stale", "dropped_by_guard", "dead_lettered",
               "duplicated", "lost",
               "rejoin_s_p50", "rejoin_s_max", "time_to_sync_final_loss_s")


def digest(doc: dict) -> dict:
    """The figures of each variant per seed (`REPORT_KEYS`), and the summary."""
    return {"runs": {seed: {k: {kk: v.get(kk) for kk in REPORT_KEYS}
                            for k, v in results.items() if isinstance(v, dict)}
                     for seed, results in doc["runs"].items()}, "summary": doc["summary"]}


def _plot(path: Path, runs: dict, title: str) -> None:
    """Loss vs wall time, one panel per seed, fault windows shaded."""
    import matplotlib  # here, not at import: every `diloco` command would pay for pyplot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 3.6 * len(runs)), dpi=110,
                             squeeze=False)
    for ax, (seed, results) in zip(axes[:, 0], runs.items(), strict=True):
        variants = {k: v for k, v in results.items() if isinstance(v, dict)}
        first = next(iter(variants.values()))
        t_join = first.get("t_join_rel_s", 0.0)
        for f in first.get("faults", []):
            ax.axvspan(f["t_rel_s"], f["t_rel_s"] + f["down_s"], color="red", alpha=0.12, lw=0)
        for name, rep in variants.items():
            xs = [h["wall_s"] - t_join for h in rep["history"]]
            ax.plot(xs, [h["eval_loss"] for h in rep["history"]], marker="o", ms=3, label=name)
        ax.set_ylabel("eval loss (nats/byte)")
        ax.set_title(f"{title} — seed {seed}")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[-1, 0].set_xlabel("wall time since start (s); red: a learner down")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
