"""`diloco bench lab`: the published cross-site scenario, scaled to this machine, in the lab.

Four sites, each a network namespace with an equal CPU quota (together the machine), the
model `ModelConfig` defaults to (d_model 128, 4 layers, seq 128, batch 16), the default sync
settings. The runs (each writes its JSON when it finishes; a restarted benchmark skips the
runs already in ``results.json`` with the same configuration, so it can span sittings):

* ``ddp-unshaped``: data parallel (JAX over gloo) on unshaped links for the whole token
  budget — its loss curve, its unshaped step rate and its bytes per step;
* ``ddp-shaped``: data parallel on the shaped links (``--link-mbps``, ``--rtt-ms``) for a
  few steps — its step time there. The link rate is chosen so that a step's all-reduce needs
  ≥ 25× the step's compute (checked from the measured compute time and bytes per step, and
  confirmed by this measured step time). Data parallel's loss after a step does not depend on
  the link (the same arithmetic), so its wall time to the token budget on the shaped links is
  this step time × the budget's steps — stated as such in the result;
* ``decoupled-shaped``: decoupled on the shaped links, `decoupled_steps` per learner; the
  global model evaluated every 20 s; when it reaches data parallel's final loss;
* ``decoupled-shaped-bf16``, ``decoupled-shaped-h200``: the same with a bf16 down link sent
  whole (``sync.down_delta = false``: the default before 2026-12-06), or with H = 200 — the
  frontier;
* ``decoupled-unshaped``: decoupled on unshaped links — its learners' step rate, the
  baseline of "keeps ≥ 0.95 of its step rate";
* ``hetero-<mode>``: one site with a third of the others' CPU, each mode on the shaped links
  for `hetero_s` seconds (data parallel: a few steps, its step time): wall time to the loss
  both DiLoCo modes reach;
* ``partition``: decoupled on the shaped links, site 3 cut off for 30 s, then healed.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ops.bench.quality import keyed_dict
from ops.chaos import Fault
from ops.lab import LabPlan, SiteSpec, plot_traffic, run_lab
from pipeline import config as cfgmod
from pipeline.config import RunConfig

Progress = Callable[[str], None]
# the frontier: decoupled on the same shaped links with another down link, or another H
VARIANTS = {"decoupled-shaped-bf16": {"sync.codec_down": "bf16", "sync.down_delta": False},
            "decoupled-shaped-h200": {"sync.sync_every": 200}}
KEEP = ("mode", "sites", "cpu_quotas_cores", "steps", "step_s", "compute_s_mean",
        "allreduce_s_mean", "allreduce_bytes", "params", "tokens", "wall_s", "final_eval_loss",
        "step_rates", "history", "lost", "merged", "rejoins", "rejoins_never", "rejoin_s_p50",
        "rejoin_s_max", "faults", "by_learner", "identical_final_values", "tokens_by_site",
        "steps_by_site", "supervised_s", "steps_series", "goodput", "availability")


def base_config(steps: int) -> RunConfig:
    """The default model and sync settings, 4 learners, quorum 1 (decoupled)."""
    return cfgmod.override(RunConfig(), learners=4, steps=steps,
                           **{"broker.heartbeat_s": 0.5, "broker.heartbeat_ttl_s": 3.0})


def _quiet(_: str) -> None:
    pass


def _slim(rep: dict) -> dict:
    out = {k: rep[k] for k in KEEP if k in rep}
    out["traffic"] = {p: {k: v for k, v in tr.items()} for p, tr in rep.get("traffic",
                                                                            {}).items()}
    return out


def time_to_loss(history: list[dict], target: float) -> float | None:
    """The first wall time at which the evaluation loss is ≤ `target` (linear between
    evaluations); None if it never is."""
    prev = None
    for h in history:
        if "wall_s" not in h or "eval_loss" not in h:
            continue
        if h["eval_loss"] <= target:
            if prev is None or prev["eval_loss"] == h["eval_loss"]:
                return float(h["wall_s"])
            f = (prev["eval_loss"] - target) / (prev["eval_loss"] - h["eval_loss"])
            return float(prev["wall_s"] + f * (h["wall_s"] - prev["wall_s"]))
        prev = h
    return None


def _per_step(rep: dict, steps: float) -> dict:
    """Mean bytes per step on a site's link, up and down (sites averaged)."""
    sites = [tr for p, tr in rep["traffic"].items() if p != "hub"]
    return {"up": float(np.mean([t["bytes_up"] for t in sites]) / steps),
            "down": float(np.mean([t["bytes_down"] for t in sites]) / steps)}


def bench_lab(out: Path, *, link_mbps: float = 1.6, rtt_ms: float = 50.0,
              ddp_steps: int = 200, ddp_shaped_steps: int = 8, decoupled_steps: int = 600,
              hetero_steps: int = 300, hetero_s: float = 300.0, only: tuple[str, ...] = (),
              progress: Progress = _quiet) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "results.json"
    results: dict = json.loads(res_path.read_text()) if res_path.exists() else {}
    shaped = [SiteSpec(link_mbps, rtt_ms, 1.0)] * 4
    unshaped = [SiteSpec(0.0, 0.0, 1.0)] * 4
    hetero = [SiteSpec(link_mbps, rtt_ms, c) for c in (1.0, 1.0, 1.0, 1 / 3)]

    current: dict = {}  # the runs measured with this invocation's settings

    def run(name: str, cfg: RunConfig, plan: LabPlan) -> dict | None:
        key = json.dumps({"cfg": keyed_dict(cfg), "mode": plan.mode,
                          "sites": [vars(s) for s in plan.sites],
                          "schedule": [vars(f) for f in plan.schedule],
                          "duration": plan.duration_s}, sort_keys=True, default=str)
        if name in results and results[name].get("config_key") == key:
            progress(f"{name:20s} already measured")
            current[name] = results[name]
            return results[name]
        if only and name not in only:
            return None  # not asked for, and not measured with these settings
        t0 = time.monotonic()
        progress(f"{name:20s} running …")
        rep = run_lab(cfg, plan, out=out / "runs", run=name)
        slim = {**_slim(rep), "config_key": key, "bench_wall_s": time.monotonic() - t0,
                "run_dir": rep["run_dir"]}
        results[name] = current[name] = slim
        res_path.write_text(json.dumps(results, indent=1))
        rates = ", ".join(f"{v:.3f}" for v in slim.get("step_rates", {}).values())
        progress(f"{name:20s} done in {slim['bench_wall_s']:.0f} s; loss "
                 f"{slim.get('final_eval_loss')}; steps/s {rates}")
        return slim

    ddp_cfg = cfgmod.override(base_config(ddp_steps), mode="ddp")
    ddp_u = run("ddp-unshaped", ddp_cfg, LabPlan("ddp", unshaped,
                                                 eval_every_steps=max(1, ddp_steps // 10)))
    ddp_s = run("ddp-shaped", cfgmod.override(ddp_cfg, steps=ddp_shaped_steps),
                LabPlan("ddp", shaped, eval_every_steps=10 ** 6))
    dec_s = run("decoupled-shaped", base_config(decoupled_steps),
                LabPlan("decoupled", shaped, eval_every_s=20.0))
    variants = {"decoupled-shaped": dec_s}
    for name, over in VARIANTS.items():
        variants[name] = run(name, cfgmod.override(base_config(decoupled_steps), **over),
                             LabPlan("decoupled", shaped, eval_every_s=20.0))
    dec_u = run("decoupled-unshaped", base_config(max(100, decoupled_steps // 3)),
                LabPlan("decoupled", unshaped, eval_every_s=60.0))
    part = run("partition", base_config(decoupled_steps // 2),
               LabPlan("decoupled", shaped, eval_every_s=30.0,
                       schedule=[Fault(60.0, "partition-learner", "L3", 30.0)]))
    het = {}
    for mode in ("decoupled", "sync-diloco", "ddp"):
        cfg = cfgmod.override(base_config(hetero_steps if mode != "ddp" else 6),
                              **({"mode": "ddp"} if mode == "ddp" else {}))
        het[mode] = run(f"hetero-{mode}", cfg,
                        LabPlan(mode, hetero, duration_s=hetero_s, eval_every_s=20.0,
                                eval_every_steps=10 ** 6))
    summary = summarize(current, link_mbps=link_mbps, rtt_ms=rtt_ms, ddp_steps=ddp_steps)
    doc = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "python": platform.python_version()},
           "link_mbps": link_mbps, "rtt_ms": rtt_ms, "summary": summary}
    (out / "summary.json").write_text(json.dumps(doc, indent=1))
    shown = {k: v for k, v in (("ddp (shaped)", ddp_s),
                               *((f"{n} (int4Δ down)" if n == "decoupled-shaped" else n, v)
                                 for n, v in variants.items()),
                               ("partition: site 3 cut off at 60 s for 30 s", part)) if v}
    if shown:
        plot_traffic(out / "bytes.png", shown)
    _plot_loss(out / "loss.png", summary, ddp_u, variants, het)
    del dec_u
    return doc


def summarize(results: dict, *, link_mbps: float, rtt_ms: float, ddp_steps: int) -> dict:
    """The targets, from the finished runs (missing runs leave their figures out)."""
    s: dict = {}
    ddp_u, ddp_s = results.get("ddp-unshaped"), results.get("ddp-shaped")
    dec_u = results.get("decoupled-unshaped")
    if ddp_u:
        per = _per_step(ddp_u, ddp_u["steps"])
        s["ddp_bytes_per_step_site"] = per
        s["ddp_compute_s"] = ddp_u["compute_s_mean"]
        s["ddp_unshaped_step_s"] = ddp_u["step_s"]
        s["ddp_final_eval_loss"] = ddp_u["final_eval_loss"]
        s["ddp_tokens"] = ddp_u["tokens"]
        # the all-reduce's time on the shaped link, from its measured bytes: ≥ 25× compute?
        link_bps = link_mbps * 1e6 / 8
        s["allreduce_link_s"] = max(per["up"], per["down"]) / link_bps
        s["allreduce_over_compute"] = s["allreduce_link_s"] / ddp_u["compute_s_mean"]
        s["ddp_bytes_per_token_site"] = ddp_u["traffic"]["s0"]["bytes_per_token"]
        s["ddp_needed_mbps"] = max(per.values()) / ddp_u["step_s"] * 8 / 1e6
    if ddp_s:
        s["ddp_shaped_step_s"] = ddp_s["step_s"]
        s["ddp_shaped_compute_s"] = ddp_s["compute_s_mean"]
        s["ddp_shaped_allreduce_s"] = ddp_s["allreduce_s_mean"]
        s["ddp_shaped_peak_mbps"] = max(
            max(t["peak_up_bytes_per_s"], t["peak_down_bytes_per_s"])
            for p, t in ddp_s["traffic"].items() if p != "hub") * 8 / 1e6
        if ddp_u:
            # the shaped step less its compute, over the compute
            s["measured_allreduce_over_compute"] = (ddp_s["step_s"] - ddp_u["compute_s_mean"]) \
                / ddp_u["compute_s_mean"]
            s["ddp_shaped_time_to_budget_s"] = ddp_s["step_s"] * (ddp_steps - 1)
    s["decoupled"] = {}
    for name in ("decoupled-shaped", *VARIANTS):
        if results.get(name):
            s["decoupled"][name] = _decoupled(results[name], s, dec_u)
    if dec_u:
        s["decoupled_unshaped_steps_per_s"] = float(np.mean(list(dec_u["step_rates"].values())))
    part = results.get("partition")
    if part:
        s["partition"] = {k: part.get(k) for k in ("lost", "rejoins", "rejoins_never",
                                                   "rejoin_s_p50", "step_rates", "by_learner",
                                                   "identical_final_values")}
    het = {m: results.get(f"hetero-{m}") for m in ("decoupled", "sync-diloco", "ddp")}
    if all(het.values()):
        target = max(het["sync-diloco"]["final_eval_loss"], het["decoupled"]["final_eval_loss"])
        s["hetero"] = {"target_loss": target,
                       "decoupled_s": time_to_loss(het["decoupled"]["history"], target),
                       "sync_diloco_s": time_to_loss(het["sync-diloco"]["history"], target),
                       "ddp_step_s": het["ddp"]["step_s"],
                       "step_rates": {m: het[m]["step_rates"] for m in het}}
        if ddp_u:
            t_ddp = time_to_loss([{**h, "wall_s": h["step"] * het["ddp"]["step_s"]}
                                  for h in ddp_u["history"]], target)
            s["hetero"]["ddp_s"] = t_ddp
    return s


def _decoupled(dec: dict, s: dict, dec_u: dict | None) -> dict:
    """The targets' figures of one decoupled run on the shaped links, against data parallel's
    (already in `s`) and decoupled's unshaped step rate (`dec_u`, the bf16 down-link run: the
    down link's codec does not change the inner step)."""
    d: dict = {}
    d["steps_per_s"] = float(np.mean(list(dec["step_rates"].values())))
    steps = float(np.mean(list(dec["steps_by_site"].values())))
    sites = [t for p, t in dec["traffic"].items() if p != "hub"]
    if any(t["bytes_per_token"] is None for t in sites):
        return {"error": "a site reported no tokens (a learner without a final report)"}
    d["bytes_per_token_site"] = float(np.mean([t["bytes_per_token"] for t in sites]))
    d["tokens"] = sum(dec["tokens_by_site"].values())
    d["final_eval_loss"] = dec.get("final_eval_loss")
    d["peak_mbps"] = max(max(t["peak_up_bytes_per_s"], t["peak_down_bytes_per_s"])
                         for t in sites) * 8 / 1e6
    per = d["bytes_per_step_site"] = _per_step(dec, steps)
    if "ddp_bytes_per_token_site" in s:
        d["bytes_per_token_ratio"] = s["ddp_bytes_per_token_site"] / d["bytes_per_token_site"]
        t_dec = time_to_loss(dec.get("history", []), s["ddp_final_eval_loss"])
        d["time_to_ddp_loss_s"] = t_dec
        if t_dec and "ddp_shaped_time_to_budget_s" in s:
            d["time_to_loss_speedup"] = s["ddp_shaped_time_to_budget_s"] / t_dec
    # steady state: the bytes after every learner has started stepping (a joining learner
    # first reads each fragment's fp32 snapshot once: 4 bytes a parameter, not repeated)
    first = dec.get("steps_series") or [{}]
    steps0 = float(np.mean([v for k, v in first[0].items() if k != "t"] or [0.0]))
    n_steady = max(1.0, steps - steps0)
    steady = {"up": float(np.mean([_after(t, "series_up") for t in sites])) / n_steady,
              "down": float(np.mean([_after(t, "series_down") for t in sites])) / n_steady}
    d["steady_bytes_per_step_site"] = steady
    d["steady_bytes_per_token_site"] = (steady["up"] + steady["down"]) * steps / \
        (d["tokens"] / len(sites))
    if "ddp_bytes_per_token_site" in s:
        d["steady_bytes_per_token_ratio"] = s["ddp_bytes_per_token_site"] / \
            d["steady_bytes_per_token_site"]
    if dec_u:
        rate_u = float(np.mean(list(dec_u["step_rates"].values())))
        d["shaped_over_unshaped_step_rate"] = d["steps_per_s"] / rate_u
        d["needed_mbps"] = max(steady.values()) * rate_u * 8 / 1e6
        d["needed_mbps_with_join"] = max(per.values()) * rate_u * 8 / 1e6
        if "ddp_needed_mbps" in s:
            d["needed_link_ratio"] = s["ddp_needed_mbps"] / d["needed_mbps"]
            d["needed_link_ratio_with_join"] = s["ddp_needed_mbps"] / d["needed_mbps_with_join"]
    return d


def _after(tr: dict, key: str, t0: float = 0.0) -> float:
    """Bytes of a bytes/s series after time `t0` (the run's start)."""
    t = np.array(tr["series_t"])
    rate = np.array(tr[key])
    dt = np.diff(np.concatenate([[t[0] - 1.0], t])) if t.size else t
    return float((rate * dt)[t > t0].sum())


def _plot_loss(path: Path, summary: dict, ddp_u, variants: dict, het) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    ax = axes[0]
    if ddp_u and "ddp_shaped_step_s" in summary:
        st = summary["ddp_shaped_step_s"]
        ax.plot([h["step"] * st for h in ddp_u["history"]],
                [h["eval_loss"] for h in ddp_u["history"]], marker="o", markersize=2.5,
                label=f"data parallel (step {st:.1f} s on the shaped link)")
    for name, rep in variants.items():
        if rep:
            ax.plot([h["wall_s"] for h in rep["history"]],
                    [h["eval_loss"] for h in rep["history"]], marker="o", markersize=2.5,
                    label=name.replace("-shaped", "").replace("-bf16", ", bf16 down")
                    .replace("-h200", ", H = 200"))
    ax.set_xscale("log")
    ax.set_xlabel("wall time (s, log)")
    ax.set_ylabel("evaluation loss")
    ax.set_title("4 sites, shaped links")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    for mode, rep in het.items():
        if rep and mode != "ddp":
            ax.plot([h["wall_s"] for h in rep["history"]],
                    [h["eval_loss"] for h in rep["history"]], marker="o", markersize=2.5,
                    label=mode)
    ax.set_xlabel("wall time (s)")
    ax.set_title("one site with 1/3 of the CPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
