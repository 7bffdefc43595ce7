"""One run in the lab: decoupled, sync-diloco or data parallel, with every byte counted.

* ``decoupled`` / ``sync-diloco``: Redis and the syncer in the hub namespace, learner ``L<i>``
  in site i's namespace (and CPU cgroup), all reaching each other over the lab's links. The
  run is a chaos run (`ops.chaos.ChaosRun`): a fault schedule applies, ``partition-learner``
  takes the site's link down (``ip link set … down``) for the fault's duration, and the ledger
  accounts for every push.
* ``ddp``: JAX's coordination service in the hub, one `workers.ddp` process per site, gradients
  all-reduced over gloo across the same links every step.

The interface counters of every router port are sampled once a second; the result has, per
site and for the hub: bytes up and down, bytes per token, peak bytes/s over 1 s windows, and
the series for the bytes/s plot.
"""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from broker import registry
from broker.keys import RunKeys
from ops.chaos import ChaosRun, Fault
from ops.cluster import RedisServer, Supervisor, artifacts, role_cmd
from ops.lab.netns import HUB_IP, Lab, SiteSpec
from pipeline import config as cfgmod
from pipeline.config import RunConfig
from pipeline.task import stored_spec

log = logging.getLogger("diloco.lab")

REDIS_PORT = 6379
SYNCER_PORT = 5555
COORDINATOR_PORT = 7777
MODES = ("decoupled", "sync-diloco", "ddp")
# fault kinds a lab run applies (a partition is the site's link; there is no standby syncer and
# no separate ZeroMQ path to cut)
LAB_FAULTS = ("kill-learner", "pause-learner", "partition-learner", "kill-syncer",
              "kill-syncer-after-commit", "kill-redis")


@dataclass
class LabPlan:
    """What to run in the lab (see `run_lab`)."""

    mode: str
    sites: list[SiteSpec]
    duration_s: float = 0.0  # 0: until every learner has done cfg.steps
    schedule: list[Fault] = field(default_factory=list)
    eval_every_s: float = 0.0  # decoupled/sync-diloco: evaluate the global model this often
    eval_every_steps: int = 0  # ddp: evaluate every this many steps
    cpu_total: float | None = None
    pace_s: float = 0.0


class _SiteLink:
    """A site's link, as the chaos harness cuts a learner off: its router port down/up."""

    def __init__(self, lab: Lab, i: int):
        self.lab, self.i = lab, i

    def cut(self) -> None:
        self.lab.set_link(self.i, False)

    def heal(self) -> None:
        self.lab.set_link(self.i, True)

    def close(self) -> None:
        pass


class LabRun(ChaosRun):
    """A chaos run whose processes live in the lab's namespaces."""

    def __init__(self, cfg: RunConfig, run_dir: Path, run: str, lab: Lab, **kw):
        super().__init__(cfg, run_dir, run, **kw)
        self.lab = lab
        self.steps: list[tuple[float, dict[str, int]]] = []

    def start(self) -> None:
        lab = self.lab
        for d in (self.state_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        # a password, though only this machine reaches the lab: the controller's management
        # link is in the root namespace, where every local user is; processes get the URL in
        # their environment, never on their command line
        password = secrets.token_urlsafe(24)
        self.redis = RedisServer(workdir=self.run_dir / "redis", port=REDIS_PORT,
                                 host=lab.mgmt_ip, also_bind=(HUB_IP,), password=password,
                                 prefix=lab.wrap(lab.hub, [])).start()
        site_url = self.redis.address_url(auth=f"default:{password}@", host=HUB_IP)
        self.sup = Supervisor(self.cfg, self.run, self.redis.url, self.run_dir)
        registry.store_config(self.r, self.keys, cfgmod.dumps_toml(self.cfg),
                              self.cfg.run_hash(), spec=stored_spec(self.cfg))
        self.sync_ports = {"syncer-0": SYNCER_PORT}
        self.sup.spawn("syncer-0", lab.wrap(lab.hub, role_cmd(
            "syncer", site_url, self.run, "--id", "syncer-0", "--insecure",
            "--bind", f"tcp://{HUB_IP}:{SYNCER_PORT}", cfg=self.cfg)), url=site_url)
        for m in range(self.cfg.learners):
            name = f"L{m}"
            self.proxies[name] = [_SiteLink(lab, m)]
            cmd = role_cmd("learner", site_url, self.run, "--id", name, "--insecure",
                           "--state-dir", str(self.state_dir), "--pace-s", str(self.pace_s),
                           "--sub-endpoint", f"tcp://{HUB_IP}:{SYNCER_PORT}", cfg=self.cfg)
            self.sup.spawn(name, lab.wrap(lab.site(m), cmd + list(self.learner_args.get(name,
                                                                                         ()))),
                           url=site_url)
        self.t_start = time.time()
        self.t0 = time.monotonic()

    def note_steps(self, rel_s: float) -> None:
        recs = registry.learner_records(self.r, self.keys)
        self.steps.append((rel_s, {k: int(v.step) for k, v in recs.items()}))



class CounterSampler:
    """Reads the lab's interface counters every `every_s` seconds on a thread; each sample is
    (``time.monotonic()``, counters)."""

    def __init__(self, lab: Lab, every_s: float = 1.0):
        self.lab, self.every_s = lab, every_s
        self.samples: list[tuple[float, dict[str, dict[str, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lab-counters", daemon=True)

    def start(self) -> CounterSampler:
        self.sample()
        self._thread.start()
        return self

    def sample(self) -> None:
        try:
            counters = self.lab.counters()
            self.samples.append((time.monotonic(), counters))  # when the read came back
        except (RuntimeError, ValueError, KeyError) as e:  # the lab is going down
            log.debug("counter sample skipped: %s", e)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.sample()

def traffic(samples: list[tuple[float, dict[str, dict[str, int]]]],
            tokens: dict[str, int], t0: float = 0.0) -> dict:
    """Per port (``s<i>`` sites, ``hub``): bytes and packets up (from it) and down (to it),
    bytes per token (the site's own tokens; the hub: all), peak bytes/s over 1 s windows, and
    the bytes/s series (times in seconds from `t0`, a ``time.monotonic()``: the run's start;
    process start-up before it is in the totals too). `tokens` maps a port to the tokens its
    learner processed."""
    if len(samples) < 2:
        return {}
    t = np.array([s[0] for s in samples]) - t0
    out = {}
    all_tokens = sum(tokens.values())
    for port in samples[-1][1]:
        def series(key, port=port):
            return np.array([s[1].get(port, {}).get(key, 0) for s in samples], np.float64)
        up, down = series("rx_bytes") - series("rx_bytes")[0], \
            series("tx_bytes") - series("tx_bytes")[0]
        both = up + down
        dt = np.maximum(np.diff(t), 1e-3)
        rate, rate_up, rate_down = np.diff(both) / dt, np.diff(up) / dt, np.diff(down) / dt
        full = dt >= 0.9  # peaks over ~1 s windows only (the stop's last sample is not one)

        def peak(x: np.ndarray, full: np.ndarray = full) -> float:
            return float(x[full].max()) if full.any() else 0.0
        tok = all_tokens if port == "hub" else tokens.get(port, 0)
        out[port] = {
            "bytes_up": int(up[-1]), "bytes_down": int(down[-1]), "bytes": int(both[-1]),
            "packets": int(series("rx_packets")[-1] - series("rx_packets")[0]
                           + series("tx_packets")[-1] - series("tx_packets")[0]),
            "tokens": int(tok), "bytes_per_token": float(both[-1] / tok) if tok else None,
            "peak_bytes_per_s": peak(rate),
            "peak_up_bytes_per_s": peak(rate_up),
            "peak_down_bytes_per_s": peak(rate_down),
            "series_t": [round(float(x), 2) for x in t[1:]],
            "series_up": [round(float(x), 1) for x in rate_up],
            "series_down": [round(float(x), 1) for x in rate_down],
        }
    return out


def check_schedule(schedule: list[Fault], sites: int, mode: str) -> None:
    """Refuse faults a lab run cannot apply (before any training time is spent).

    Raises:
        ValueError: A fault of a kind the lab does not apply, a target that is no site's
            learner, or any fault in data parallel mode.
    """
    if schedule and mode == "ddp":
        raise ValueError("faults apply to decoupled and sync-diloco runs, not to ddp")
    for f in schedule:
        if f.kind not in LAB_FAULTS:
            raise ValueError(f"fault kind {f.kind!r} does not apply in the lab (one of "
                             f"{', '.join(LAB_FAULTS)})")
        learner = f.kind.endswith("learner")
        if learner and f.target and f.target not in {f"L{i}" for i in range(sites)}:
            raise ValueError(f"fault {f.kind} at {f.at_s} s: {f.target!r} is not a learner of "
                             f"the {sites} sites (L0…L{sites - 1})")
        if not learner and f.target not in ("", "syncer-0"):
            raise ValueError(f"fault {f.kind} at {f.at_s} s: target {f.target!r} (the lab has "
                             f"one syncer, syncer-0)")


def _diloco(cfg: RunConfig, run_dir: Path, run: str, lab: Lab, plan: LabPlan,
            sampler: CounterSampler, progress) -> dict:
    chaos = LabRun(cfg, run_dir, run, lab, pace_s=plan.pace_s, eval_every_s=plan.eval_every_s)
    corpus = chaos.task.data()
    try:
        chaos.start()
        chaos.wait_until_training(timeout_s=300.0)
        recs = registry.learner_records(chaos.r, chaos.keys)
        if len(recs) < cfg.learners or any(r.step < 1 for r in recs.values()):
            raise RuntimeError(f"the learners did not start training in 300 s; see "
                               f"{chaos.logs}")

        def tick(h: LabRun, rel: float) -> None:
            lab.check()
            h.note_steps(rel)
            if progress is not None:
                progress(h, rel)

        duration = plan.duration_s or 10 ** 9
        chaos.supervise(plan.schedule, duration, corpus, tick)
        rep = chaos.finish(corpus=corpus)
        rep_t0 = chaos.t0  # supervise's start (every learner stepping)
        finals = registry.learner_final_reports(chaos.r, RunKeys(run))
        rep["tokens_by_site"] = {f"s{int(k[1:])}": int(v.tokens) for k, v in finals.items()}
        rep["steps_by_site"] = {f"s{int(k[1:])}": int(v.steps) for k, v in finals.items()}
        # each learner's own steady rate (its steps after the first, compiled one, over the
        # time between them): heartbeats cannot show a partitioned learner's steps
        rep["step_rates"] = {k: float(v.steps_per_s) for k, v in finals.items()}
        rep["steps_series"] = [{"t": round(t, 2), **st} for t, st in chaos.steps]
        rep["supervised_s"] = chaos.duration_s
        rep["t0_monotonic"] = rep_t0
        rep["wall_s"] = chaos.t_stop - chaos.t_start
        if chaos.history:
            rep["final_eval_loss"] = chaos.history[-1]["eval_loss"]
        return rep
    finally:
        chaos.close()


def _ddp(cfg: RunConfig, run_dir: Path, lab: Lab, plan: LabPlan, sampler: CounterSampler,
         progress) -> dict:
    n = len(lab.sites)
    cfg_path = run_dir / "config.toml"
    out = run_dir / "ddp.json"
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    coord = f"{HUB_IP}:{COORDINATOR_PORT}"

    def spawn(name: str, ns: str, args: list[str]) -> None:
        with open(logs / f"{name}.log", "ab") as fh:
            procs[name] = subprocess.Popen(lab.wrap(ns, [sys.executable, "-m", "workers.ddp",
                                                         "--processes", str(n), *args]),
                                           stdout=fh, stderr=subprocess.STDOUT)

    try:
        spawn("coordinator", lab.hub, ["--serve", coord])
        time.sleep(1.0)
        for i in range(n):
            spawn(f"D{i}", lab.site(i), ["--coordinator", coord, "--process-id", str(i),
                                         "--config", str(cfg_path), "--out", str(out),
                                         "--gloo-interface", "eth0",
                                         "--eval-every", str(plan.eval_every_steps)])
        t0 = time.monotonic()
        steps = cfg.steps
        deadline = t0 + (plan.duration_s or 0) + 600 + 120 * steps  # a hung collective
        while True:
            lab.check()
            if procs["coordinator"].poll() is not None:
                raise RuntimeError(f"the coordination service exited; see {logs}")
            codes = {k: p.poll() for k, p in procs.items() if k != "coordinator"}
            failed = {k: c for k, c in codes.items() if c not in (None, 0)}
            if failed:
                raise RuntimeError(f"data parallel process(es) failed: {failed}; see {logs}")
            if all(c == 0 for c in codes.values()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"data parallel did not finish; see {logs}")
            if progress is not None:
                progress(None, time.monotonic() - t0)
            time.sleep(0.5)
        rep = json.loads(out.read_text())
        per_site = cfg.inner.batch_size * cfg.model.seq_len * rep["steps"]
        rep["tokens_by_site"] = {f"s{i}": per_site for i in range(n)}
        rep["step_rates"] = {f"D{i}": 1.0 / rep["step_s"] for i in range(n)}
        rep["t0_monotonic"] = t0
        return rep
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_lab(cfg: RunConfig, plan: LabPlan, *, out: str | Path, run: str,
            progress=None) -> dict:
    """Build the lab, run `plan` in it, remove the lab (also on error or Ctrl-C), and return
    the result (also written to ``<run folder>/lab.json``, with plots)."""
    if plan.mode not in MODES:
        raise ValueError(f"mode {plan.mode!r} is not one of {', '.join(MODES)}")
    n = len(plan.sites)
    check_schedule(plan.schedule, n, plan.mode)
    updates = {"learners": n, **({"mode": plan.mode} if plan.mode != "ddp" else {}),
               **({"sync.quorum": n} if cfg.sync.quorum > n else {})}
    cfg = cfgmod.override(cfg, **updates)
    run_dir = artifacts.new_run_dir(out, run)
    artifacts.write_config(run_dir, cfg)
    lab = Lab(plan.sites, cpu_total=plan.cpu_total)
    sampler = None
    t_build = time.monotonic()
    try:
        lab.up()
        build_s = time.monotonic() - t_build
        sampler = CounterSampler(lab).start()
        if plan.mode == "ddp":
            rep = _ddp(cfg, run_dir, lab, plan, sampler, progress)
        else:
            rep = _diloco(cfg, run_dir, run, lab, plan, sampler, progress)
        sampler.stop()
        rep["traffic"] = traffic(sampler.samples, rep.get("tokens_by_site", {}),
                                 rep.get("t0_monotonic", 0.0))
    finally:
        if sampler is not None:
            sampler.stop()
        lab.down()
    rep.update({"mode": plan.mode, "sites": [vars(s) for s in plan.sites],
                "cpu_quotas_cores": lab.quotas, "cgroup": lab.cgroup_kind or None,
                "forwarder": any(s.rtt_ms > 0 for s in plan.sites), "build_s": build_s,
                "run_dir": str(run_dir)})
    artifacts.write_json(run_dir / "lab.json", rep)
    plot_traffic(run_dir / "bytes.png", {plan.mode: rep})
    hist = rep.get("history") or []
    if hist:
        artifacts.plot_loss(run_dir / "loss.png", {plan.mode: hist}, x="wall_s",
                            title=f"lab: {plan.mode}, {n} sites")
    return rep


def plot_traffic(path: Path, results: dict[str, dict]) -> None:
    """Bytes/s per site over time (up and down), one panel per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 3.2 * len(results)), dpi=110,
                             squeeze=False)
    for ax, (name, rep) in zip(axes[:, 0], results.items(), strict=True):
        for port, tr in sorted(rep.get("traffic", {}).items()):
            if port == "hub":
                continue
            ax.plot(tr["series_t"], np.array(tr["series_up"]) / 1e3, label=f"{port} up",
                    linewidth=1)
            ax.plot(tr["series_t"], np.array(tr["series_down"]) / 1e3, label=f"{port} down",
                    linewidth=1, linestyle="--")
        ax.set_title(name)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("kB/s on the site's link")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
