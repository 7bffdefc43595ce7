"""`diloco bench quality`: the in-process engine at equal tokens: ddp vs sync-diloco vs decoupled
(int4 up / bf16 down, and bf16 both ways), plus two ablations (radial-directional averaging
vs plain mean; K=1 with vs without the grace window with learner speeds 1, 1, 1, 1/3), and
reports final loss and accuracy, the gap to ddp and the measured bandwidth ratio.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

from ops.cluster import artifacts, codec_sizes
from pipeline import config as cfgmod
from pipeline.config import RunConfig
from pipeline.data import run_corpus
from pipeline.engine import Engine

# The quality tables (BENCHMARKS.md §1) were measured with `sync.apply = "overwrite"`, the
# default until 2026-12-04: their base keeps it, so that a kept run stays valid and the
# documented commands reproduce the documented numbers; the shipped "rebase" is measured in
# rows of its own (`--set 'sync.apply="rebase"'`, BENCHMARKS.md §1.3).
QUALITY_APPLY = "overwrite"
# Likewise the outer momentum: 0.9, the default until 2026-12-04 (second sitting); the
# default model's table screens 0.7 and others in rows of their own (" om=…")
QUALITY_MOMENTUM = 0.9
# Likewise the final flush's step: "nesterov", the only one until 2026-12-04 (fourth sitting);
# "plain" (shipped since) is measured in rows of its own (`--set 'sync.final_step="plain"'`)
QUALITY_FINAL_STEP = "nesterov"


def bench_model_config() -> RunConfig:
    """The quality benchmark's base: a small byte-level model, M=4, shipped sync defaults
    but `QUALITY_APPLY`, outer momentum `QUALITY_MOMENTUM`, `QUALITY_FINAL_STEP`."""
    return cfgmod.from_dict({
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "data": {"max_bytes": 8_000_000, "eval_batches": 16},
        "inner": {"lr": 1e-3, "warmup_steps": 50, "batch_size": 16},
        "outer": {"momentum": QUALITY_MOMENTUM},
        "sync": {"apply": QUALITY_APPLY, "final_step": QUALITY_FINAL_STEP},
        "engine": {"eval_every": 100},
        "learners": 4, "steps": 1500,
    })


def default_model_config() -> RunConfig:
    """The quality table's base at the model `ModelConfig` defaults to (d_model 128, 4 layers,
    seq 128, batch 16): M=4, 2,000 inner steps per learner, shipped sync defaults but
    `QUALITY_APPLY`, outer momentum `QUALITY_MOMENTUM`, `QUALITY_FINAL_STEP`."""
    return cfgmod.from_dict({
        "data": {"max_bytes": 8_000_000, "eval_batches": 16},
        "outer": {"momentum": QUALITY_MOMENTUM},
        "sync": {"apply": QUALITY_APPLY, "final_step": QUALITY_FINAL_STEP},
        "engine": {"eval_every": 250},
        "learners": 4, "steps": 2000,
    })


def shipped_model_config() -> RunConfig:
    """The quality-versus-size study's base: the default model and run length of
    `default_model_config`, with every sync and outer setting as `RunConfig()` ships it (no
    `QUALITY_*` override); another size by ``--set model.d_model=… --set model.n_layers=…``."""
    return cfgmod.from_dict({
        "data": {"max_bytes": 8_000_000, "eval_batches": 16},
        "engine": {"eval_every": 250},
        "learners": 4, "steps": 2000,
    })


MODELS = {"bench": bench_model_config, "default": default_model_config,
          "shipped": shipped_model_config}


# down-link codecs of the frontier: name → overrides ("Δ": deltas with error feedback)
DOWN_LINKS = {
    "bf16": {"sync.codec_down": "bf16", "sync.down_delta": False},
    "int8Δ": {"sync.codec_down": "int8", "sync.down_delta": True},
    "int4Δ": {"sync.codec_down": "int4", "sync.down_delta": True},
}


# up-link codecs of the frontier ("+EF": error feedback, `sync.up_feedback`)
UP_LINKS = {
    "int4": {"sync.codec_up": "int4"},
    "bf16": {"sync.codec_up": "bf16"},
    "int4+EF": {"sync.codec_up": "int4", "sync.up_feedback": True},
}
FRONTIER = (("int4", "bf16"), ("bf16", "bf16"), ("int4", "int8Δ"), ("int4", "int4Δ"),
            ("int4+EF", "int4Δ"), ("int4+EF", "bf16"))


def frontier_config(base: RunConfig, h: int, up: str, down: str) -> RunConfig:
    """Decoupled at sync interval `h` with up-link codec `up` (`UP_LINKS`) and down link
    `down` (`DOWN_LINKS`): the run ``"frontier H=<h> <up>/<down>"``."""
    return cfgmod.override(base, mode="decoupled", **{"sync.sync_every": h, **UP_LINKS[up],
                                                      **DOWN_LINKS[down]})


def variants(base: RunConfig) -> dict[str, RunConfig]:
    """Name → configuration of every run in the quality benchmark."""
    M = base.learners
    slow = (1.0,) * (M - 1) + (1.0 / 3.0,)
    o = cfgmod.override
    return {
        "ddp": o(base, mode="ddp"),
        "sync-diloco": o(base, mode="sync-diloco", **{"sync.codec_up": "fp32",
                                                      "sync.codec_down": "fp32"}),
        "decoupled int4/bf16": o(base, mode="decoupled", **DOWN_LINKS["bf16"]),
        "decoupled bf16/bf16": o(base, mode="decoupled", **{"sync.codec_up": "bf16",
                                                            **DOWN_LINKS["bf16"]}),
        # the delta down link: int4 deltas against the exact reference (error feedback)
        "decoupled int4/int4Δ": o(base, mode="decoupled", **DOWN_LINKS["int4Δ"]),
        "decoupled plain mean": o(base, mode="decoupled", **{"sync.merge": "mean"}),
        "slow learner K=1 + grace": o(base, mode="decoupled", **{"engine.speeds": list(slow)}),
        "slow learner K=1 no grace": o(base, mode="decoupled", **{
            "engine.speeds": list(slow), "sync.grace_max_s": 0.0}),
    }


def poison_variants(base: RunConfig) -> dict[str, RunConfig]:
    """The poison guard: the last learner of M poisoned, guard on vs off, side by side with
    the clean run (all decoupled, shipped settings otherwise)."""
    o = cfgmod.override
    bad = base.learners - 1
    runs = {"clean: guard on": o(base, mode="decoupled"),
            "clean: guard off": o(base, mode="decoupled", **{"sync.guard": False})}
    for kind, scale, label in (("norm", 1e4, "10⁴× norm"), ("tokens", 1e4, "10⁴× tokens"),
                               ("signflip", 1.0, "sign-flipped δ")):
        for guard in (True, False):
            runs[f"{label}: guard {'on' if guard else 'off'}"] = o(
                base, mode="decoupled", **{"sync.guard": guard, "engine.poison_learner": bad,
                                           "engine.poison": kind, "engine.poison_scale": scale})
    # the robust merge (sync.merge = "trimmed"): its cost on honest learners and its benefit
    # against the sign flip the guard lets through, at the shipped quorum and at K = 3 (every
    # round then has contributions to trim), side by side with RDA at the same quorum
    flip = {"engine.poison_learner": bad, "engine.poison": "signflip",
            "engine.poison_scale": 1.0}
    for k in sorted({base.sync.quorum, 3}):
        q = "" if k == base.sync.quorum else f" K={k}"
        for merge in ("rda", "trimmed", "robust"):
            if merge == "rda" and not q:
                continue  # the rows above
            runs[f"clean: {merge}{q}"] = o(base, mode="decoupled",
                                           **{"sync.merge": merge, "sync.quorum": k})
            runs[f"sign-flipped δ: {merge}{q}"] = o(
                base, mode="decoupled", **{"sync.merge": merge, "sync.quorum": k, **flip})
    for merge in ("trimmed", "robust"):
        runs[f"10⁴× norm: {merge} (guard off)"] = o(
            base, mode="decoupled", **{"sync.merge": merge, "sync.guard": False,
                                       "engine.poison_learner": bad, "engine.poison": "norm",
                                       "engine.poison_scale": 1e4})
    return runs


def sweep(runs: dict[str, RunConfig], seeds: list[int] | None,
          lrs: list[float] | None,
          outer_lrs: list[float] | None = None,
          outer_momenta: list[float] | None = None) -> dict[str, RunConfig]:
    """Every run at each outer momentum, outer learning rate, inner learning rate and seed:
    ``"<name> om=<momentum> olr=<outer lr> lr=<lr> seed=<s>"`` (each part only when swept).
    Every variant gets the same sweep: the baseline's tuning budget is ours. The outer
    settings are part of the variant's name (``_parse_label``); data parallel has no outer
    step and is not swept over them."""
    if not seeds and not lrs and not outer_lrs and not outer_momenta:
        return runs
    for what, rates in (("learning rates", lrs), ("outer learning rates", outer_lrs),
                        ("outer momenta", outer_momenta)):
        if rates and len({f"{lr:g}" for lr in rates}) != len(rates):
            raise ValueError(f"{what} {rates} repeat (or differ beyond 6 digits)")
    if seeds and len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds {seeds} repeat")
    out: dict[str, RunConfig] = {}
    for name, cfg in runs.items():
        outer = cfg.mode != "ddp"
        for om in (outer_momenta if outer_momenta and outer else [None]):
            for olr in (outer_lrs if outer_lrs and outer else [None]):
                for lr in lrs or [None]:
                    for seed in seeds or [None]:
                        label, upd = name, {}
                        for part, key, value in (("om", "outer.momentum", om),
                                                 ("olr", "outer.lr", olr),
                                                 ("lr", "inner.lr", lr)):
                            if value is not None:
                                label, upd[key] = f"{label} {part}={value:g}", value
                        if seed is not None:
                            label, upd["seed"] = f"{label} seed={seed}", seed
                        out[label] = cfgmod.override(cfg, **upd)
    return out


def run_quality(base: RunConfig, out: Path, *, only: list[str] | None = None,
                frontier: list[int] | None = None, poison: bool = False,
                seeds: list[int] | None = None, lrs: list[float] | None = None,
                outer_lrs: list[float] | None = None,
                outer_momenta: list[float] | None = None,
                progress: Callable[[str], None] | None = None) -> str:
    """Run the variants (and the frontier over H) at equal tokens; write ``results.json``,
    ``loss_vs_tokens.png`` and ``results.md`` to `out`; return the markdown table. With
    `poison`, the poison-guard variants (`poison_variants`) instead, plus ddp. `only` names
    variants before the sweep; `seeds`, `lrs`, `outer_lrs` and `outer_momenta` run each at
    every seed, inner lr, outer lr and outer momentum (the table then adds the mean ± spread
    over seeds, `seeds_markdown`). The runs are done in the order of `only` (the most wanted
    first when a sitting ends)."""
    runs = variants(base)
    if poison:
        runs = {"ddp": runs["ddp"], **poison_variants(base)}
    for h in frontier or []:
        for up, down in FRONTIER:
            runs[f"frontier H={h} {up}/{down}"] = frontier_config(base, h, up, down)
    if only:
        unknown = [k for k in only if k not in runs]
        if unknown:
            raise ValueError(f"unknown variants {unknown}; known: {sorted(runs)}")
        runs = {k: runs[k] for k in only}
    runs = sweep(runs, seeds, lrs, outer_lrs, outer_momenta)
    out.mkdir(parents=True, exist_ok=True)
    corpus = run_corpus(base)
    # a run already in results.json with the same configuration is not run again, so a long
    # benchmark can span several sittings
    done = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() \
        else {}
    results = {k: v for k, v in done.items() if k not in runs}  # other sittings' runs stay
    for name, cfg in runs.items():
        key = config_key(cfg)
        if done.get(name, {}).get("config_key") == key:
            results[name] = done[name]
            if progress is not None:
                progress(f"{name:28s} finished before: skipped")
            continue
        t0 = time.perf_counter()
        s = Engine(cfg, corpus, wire=codec_sizes()).run()
        s["compute_s"] = time.perf_counter() - t0
        s["config_key"] = key
        results[name] = s
        if progress is not None:
            progress(f"{name:28s} loss {s['final_eval_loss']:.4f} acc "
                     f"{s['final_eval_accuracy']:.4f} binding ratio "
                     f"{s.get('bandwidth_ratio_binding', 0):7.1f}x "
                     f"goodput {s['goodput']:.3f} guard drops {s.get('guard_dropped', 0)} "
                     f"({s['compute_s']:.0f} s)")
        (out / "results.json").write_text(json.dumps(results, indent=1))
    artifacts.plot_loss(out / "loss_vs_tokens.png", {k: v["history"] for k, v in results.items()},
                        title=f"eval loss vs tokens, M={base.learners}, in-process engine")
    if seeds or lrs or outer_lrs or outer_momenta:
        # the tables cover this invocation's runs (and the ddp runs it can compare with), not
        # other sittings' kept runs of other configurations
        mine = {k: v for k, v in results.items()
                if k in runs or _parse_label(k)[0] == "ddp"}
        summary = seed_summary(mine)
        md = quality_markdown(mine, base, ddp_of=lambda label: _ddp_same_seed(mine, summary,
                                                                               label))
        md += "\n" + seeds_markdown(mine)
    else:
        md = quality_markdown(results, base)
    (out / "results.md").write_text(md)
    return md


def report(out: Path, base: RunConfig) -> str:
    """The tables over every run in ``out/results.json`` (all sittings), running nothing:
    per run (swept runs against ddp at its best lr and the same seed) and over seeds."""
    path = out / "results.json"
    if not path.exists():
        raise ValueError(f"{path} does not exist: nothing has been run there")
    results = json.loads(path.read_text())
    swept = any(_parse_label(k)[1:] != (None, None) for k in results)
    if not swept:
        return quality_markdown(results, base)
    summary = seed_summary(results)
    md = quality_markdown(results, base,
                          ddp_of=lambda label: _ddp_same_seed(results, summary, label))
    return md + "\n" + seeds_markdown(results)


def _guard_cell(s: dict) -> str:
    d = s.get("dropped_by_kind", {})
    cell = f"{d.get('tokens', 0)}, {d.get('norm', 0)}"
    return cell + (f" (+{s['guard_clipped']} clipped)" if s.get("guard_clipped") else "")


# Settings added after runs were kept, at the value that does what the code did before they
# existed: a run's key leaves them out at that value, so a kept run stays valid when a setting
# is added, and a run that turns one on gets a new key.
KEY_NEUTRAL = {("sync", "up_feedback"): False, ("sync", "final_step"): "nesterov"}


def keyed_dict(cfg: RunConfig) -> dict:
    """`cfg` as a dict for a kept run's key: without the `KEY_NEUTRAL` settings at their
    neutral values."""
    d = cfgmod.to_dict(cfg)
    for (section, name), neutral in KEY_NEUTRAL.items():
        if section in d and name in d[section] and d[section][name] == neutral:
            d[section] = {k: v for k, v in d[section].items() if k != name}
    return d


def config_key(cfg: RunConfig) -> str:
    """A run's whole configuration (engine included) as a short hash: a finished run is
    skipped only when its configuration is the same."""
    return hashlib.sha256(json.dumps(keyed_dict(cfg), sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]


def _ddp_same_seed(results: dict[str, dict], summary: dict[str, dict],
                   label: str) -> float | None:
    """Final loss of ddp at its best lr with the seed of run `label` (None: not run)."""
    best = next((r["ddp_lr"] for r in summary.values() if "ddp_lr" in r), None)
    _, _, seed = _parse_label(label)
    for k, v in results.items():
        name, lr, s = _parse_label(k)
        if name == "ddp" and lr == best and s == seed:
            return v["final_eval_loss"]
    return None


def quality_markdown(results: dict[str, dict], base: RunConfig,
                     ddp_of: Callable[[str], float | None] | None = None) -> str:
    """One row per run; the gap is to ``results["ddp"]``, or to `ddp_of(label)` (swept runs:
    ddp at its best lr with the same seed)."""
    ddp_run = results.get("ddp", {}).get("final_eval_loss")
    lines = [
        f"Machine: {platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}; model d_model {base.model.d_model}, {base.model.n_layers} "
        f"layers, seq {base.model.seq_len}, batch {base.inner.batch_size}; M={base.learners}, "
        f"{base.steps} inner steps per learner; base sync settings (a frontier run's name sets its "
        f"own H and codecs): H={base.sync.sync_every}, P={base.sync.fragments}, "
        f"τ={base.sync.overlap_steps}, K={base.sync.quorum}.",
        "",
        "| run | final eval loss | gap to ddp | next-byte accuracy | bytes/token vs fp32 ring "
        "all-reduce, binding direction | sent, received | older figure (ring sent ÷ our sent + "
        "received) | goodput | rounds | refused by the guard (tokens, norm) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        ddp = ddp_of(name) if ddp_of is not None else ddp_run
        gap = f"{100 * (s['final_eval_loss'] / ddp - 1):+.2f}%" if ddp else "n/a"
        base = s["mode"] == "ddp"

        def r(key: str, s=s, base=base) -> str:
            return "1 (definition)" if base else (f"{s[key]:.0f}×" if key in s else "n/a")

        goodput = "1 (definition)" if base else f"{s['goodput']:.3f}"
        lines.append(f"| {name} | {s['final_eval_loss']:.4f} | {gap} | "
                     f"{s['final_eval_accuracy']:.4f} | {r('bandwidth_ratio_binding')} | "
                     f"{r('bandwidth_ratio_sent')}, {r('bandwidth_ratio_received')} | "
                     f"{r('bandwidth_ratio_vs_ddp')} | {goodput} | "
                     f"{s['rounds']} | {_guard_cell(s)} |")
    return "\n".join(lines) + "\n"


def _parse_label(label: str) -> tuple[str, str | None, int | None]:
    """``"<name> lr=<lr> seed=<s>"`` → (name, lr text or None, seed or None)."""
    words = label.split(" ")
    seed = lr = None
    while words and (words[-1].startswith("seed=") or words[-1].startswith("lr=")):
        key, _, value = words.pop().partition("=")
        if key == "seed":
            seed = int(value)
        else:
            lr = value
    return " ".join(words), lr, seed


def seed_summary(results: dict[str, dict]) -> dict[str, dict]:
    """Group swept runs by (variant, lr) over seeds: mean, min, max final eval loss, and the
    gap to data parallel at its best learning rate (the lowest mean loss over the seeds every
    ddp lr was run with), over the seeds the variant and that ddp share: on the mean and the
    worst seed (each seed against ddp's run of the same seed)."""
    groups: dict[tuple[str, str | None], dict[int, float]] = {}
    for label, s in results.items():
        name, lr, seed = _parse_label(label)
        groups.setdefault((name, lr), {})[-1 if seed is None else seed] = s["final_eval_loss"]
    ddp = {k: v for k, v in groups.items() if k[0] == "ddp"}
    # ddp's best lr: by the mean over the seeds every ddp lr was run with (all of its seeds
    # where they share none)
    shared = set.intersection(*(set(v) for v in ddp.values())) if ddp else set()

    def ddp_mean(k: tuple[str, str | None]) -> float:
        seeds = [s for s in ddp[k] if s in shared] or list(ddp[k])
        return sum(ddp[k][s] for s in seeds) / len(seeds)

    best = min(ddp, key=ddp_mean) if ddp else None
    out: dict[str, dict] = {}
    for (name, lr), by_seed in groups.items():
        losses = list(by_seed.values())
        row = {"variant": name, "lr": lr, "seeds": sorted(by_seed), "losses": by_seed,
               "mean": sum(losses) / len(losses), "min": min(losses), "max": max(losses)}
        if best is not None:
            ref = ddp[best]
            common = [s for s in by_seed if s in ref]
            if common:
                m = sum(by_seed[s] for s in common) / len(common)
                r = sum(ref[s] for s in common) / len(common)
                row["ddp_lr"] = best[1]
                row["gap_mean"] = m / r - 1
                row["gap_worst_seed"] = max(by_seed[s] / ref[s] - 1 for s in common)
                row["seeds_compared"] = common
        out[f"{name}" + (f" lr={lr}" if lr else "")] = row
    return out


def seeds_markdown(results: dict[str, dict]) -> str:
    """The over-seeds table of `seed_summary`."""
    rows = seed_summary(results)
    lines = ["| variant | inner lr | seeds | final eval loss, mean (min–max) | gap to ddp "
             "(best lr) on the mean | worst seed's gap | binding ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows.values():
        ratio = next((s.get("bandwidth_ratio_binding") for label, s in results.items()
                      if _parse_label(label)[:2] == (r["variant"], r["lr"])), None)
        gap = (f"{100 * r['gap_mean']:+.2f}% (ddp lr {r['ddp_lr']}, seeds "
               f"{','.join(map(str, r['seeds_compared']))})") if "gap_mean" in r else "n/a"
        worst = f"{100 * r['gap_worst_seed']:+.2f}%" if "gap_worst_seed" in r else "n/a"
        binding = ("1 (definition)" if r["variant"] == "ddp"
                   else f"{ratio:.0f}×" if ratio else "n/a")
        lines.append(f"| {r['variant']} | {r['lr'] or 'default'} | "
                     f"{','.join(map(str, r['seeds']))} | {r['mean']:.4f} ({r['min']:.4f}–"
                     f"{r['max']:.4f}) | {gap} | {worst} | {binding} |")
    return "\n".join(lines) + "\n"
