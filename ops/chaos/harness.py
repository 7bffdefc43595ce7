"""The chaos harness: a full run under injected faults, and its Jepsen-style accounting.

The harness starts its own redis-server (AOF, appendfsync everysec, restartable on the same
port), N syncers (one by default; started without a fragment list, they share the fragments
through leases) and M learners, all through the run's
:class:`~ops.cluster.Supervisor`. Each learner reaches Redis and the
syncers' PUB sockets through its own TCP proxies, so one learner can be cut off the network.
Faults come from a schedule — scripted (at t, do X to Y for D seconds) or random (Poisson per
fault kind, seeded) — and every injected fault is written to the run's events stream. What the
harness kills it restarts (learners with the same id and state folder, so they resume).
At the end it stops the run (learners flush, syncers close final rounds) and returns the report
of `ops.chaos.ledger.account`.

With ``spares``, every learner has a warm spare (``diloco learner --standby``): a process that
has loaded the data and compiled the step and waits; bringing a killed learner back then
activates its spare instead of starting a process (a new spare starts `spare_after_s` later,
default `SPARE_AFTER_S`).
"""

from __future__ import annotations

import json
import logging
import math
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import redis

from broker import registry
from broker.connection import connect
from broker.errors import BrokerError
from broker.keys import RunKeys
from broker.records import read_rounds
from ops.chaos.ledger import account
from ops.chaos.schedule import NOT_ON_CLUSTER, Fault
from ops.cluster import ClusterServers, RedisServer, Supervisor, TcpProxy, free_port, role_cmd
from pipeline import config as cfgmod
from pipeline.config import RunConfig
from pipeline.fragments import fragment_sizes, partition
from pipeline.task import stored_spec, task_of
from workers.learner import standby_ready_file

log = logging.getLogger("diloco.chaos")

SPARE_AFTER_S = 10.0  # a learner's next warm spare starts this long after the last took over


def spare_options_problem(spares: bool, spare_after_s: float) -> str | None:
    """What is wrong with a harness's spare options (None: nothing)."""
    if not math.isfinite(spare_after_s) or spare_after_s < 0:
        return f"--spare-after-s must be a finite number of seconds >= 0, not {spare_after_s}"
    if spare_after_s != SPARE_AFTER_S and not spares:
        return "--spare-after-s needs --spares"
    return None


class ChaosRun:
    """One supervised run (see module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, run: str, *, seed: int = 0,
                 pace_s: float = 0.0, delays_s: dict[str, float] | None = None,
                 standby: bool = False, syncers: int = 1, eval_every_s: float = 0.0,
                 redis_cluster: bool = False,
                 learner_args: dict[str, list[str]] | None = None, spares: bool = False,
                 spare_after_s: float = SPARE_AFTER_S):
        self.cfg, self.run_dir, self.run = cfg, run_dir, run
        self.rng = np.random.default_rng(seed)
        self.pace_s = pace_s
        self.delays_s = delays_s or {}
        self.learner_args = learner_args or {}  # extra command-line arguments per learner
        self.standby = standby
        # syncer processes, started without a fragment list: they share the fragments
        self.n_syncers = max(syncers, 2 if standby else 1)
        self.eval_every_s = eval_every_s
        self.keys = RunKeys(run)
        self.state_dir = run_dir / "state"
        self.logs = run_dir / "logs"
        self.sup: Supervisor | None = None  # started with the run's Redis
        self.down: dict[str, float] = {}          # name → when to bring it back
        self.paused: dict[str, float] = {}
        self.cut: dict[str, float] = {}
        self.restarts: list[tuple[str, float]] = []
        self.faults: list[dict] = []
        self._pending_events: list[dict] = []
        self.task = task_of(cfg, local=cfg.task)  # this process's own configuration
        self.frags = partition(self.task.param_shapes(), cfg.effective_sync().fragments,
                               self.task.is_embedding)
        self.history: list[dict] = []
        self.crashes: dict[str, int] = {}
        self.eval_failures: list[dict] = []
        self.restore_cmds: dict[str, list[str]] = {}  # a syncer's command once its fault ends
        self.cut_proxies: dict[str, list[TcpProxy]] = {}  # a cut learner's proxies, to heal
        self.proxies: dict[str, list[TcpProxy]] = {}
        self.redis: RedisServer | ClusterServers | None = None
        self.redis_cluster = redis_cluster  # a local 3-master/3-replica Redis Cluster
        self.duration_s = 0.0  # of the supervised part (set by supervise)
        self.gave_up: set[str] = set()
        self.max_crashes = 3
        # warm spares: learner → (the process standing by for it, the file that activates it)
        self.spares_on = spares
        self.spare_after_s = spare_after_s
        self.spares: dict[str, tuple[str, Path]] = {}
        self._spares_started = 0
        self._spare_due: dict[str, float] = {}  # learner → when its next spare starts
        self.took_over: list[dict] = []  # which spare took over which learner, when
        self.cold_restarts: list[dict] = []  # a learner's spare was not warm: a new process
        self.fault_exits: list[dict] = []  # syncers' fault-injected exits (17, 18)

    # -- processes ------------------------------------------------------------------------------

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return self.sup.procs

    @property
    def r(self) -> redis.Redis:
        return self.sup.r

    def start(self) -> None:
        for d in (self.state_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.redis = (ClusterServers(workdir=self.run_dir / "redis") if self.redis_cluster
                      else RedisServer(workdir=self.run_dir / "redis")).start()
        self.sup = Supervisor(self.cfg, self.run, self.redis.url, self.run_dir)
        registry.store_config(self.r, self.keys, cfgmod.dumps_toml(self.cfg), self.cfg.run_hash(),
                              spec=stored_spec(self.cfg))
        self.sync_ports = {f"syncer-{i}": free_port() for i in range(self.n_syncers)}
        for sid, port in self.sync_ports.items():
            self.sup.spawn(sid, role_cmd("syncer", self.redis.url, self.run, "--id", sid,
                                         "--bind", f"tcp://127.0.0.1:{port}", cfg=self.cfg))
        for m in range(self.cfg.learners):
            name = f"L{m}"
            zps = [TcpProxy("127.0.0.1", port) for port in self.sync_ports.values()]
            if self.redis_cluster:  # the cluster client reaches every node directly
                url, rps = self.redis.url, []
            else:
                rp = TcpProxy("127.0.0.1", self.redis.port)
                url, rps = f"redis://{rp.address}/0", [rp]
            self.proxies[name] = [*rps, *zps]
            cmd = role_cmd("learner", url, self.run, "--id", name,
                           "--state-dir", str(self.state_dir), "--pace-s", str(self.pace_s),
                           "--delay-s", str(self.delays_s.get(name, 0.0)), cfg=self.cfg)
            for zp in zps:
                cmd += ["--sub-endpoint", f"tcp://{zp.address}"]
            self.sup.spawn(name, cmd + list(self.learner_args.get(name, ())))
            if self.spares_on:
                self._spawn_spare(name)
        self.t_start = time.time()
        self.t0 = time.monotonic()

    def _spawn_spare(self, name: str) -> None:
        """Start a warm spare for learner `name`: its own command with ``--standby FILE``."""
        self._spares_started += 1
        spare = f"{name}.spare{self._spares_started}"
        go = self.run_dir / "spares" / f"{spare}.go"
        go.parent.mkdir(parents=True, exist_ok=True)
        self.sup.spawn(spare, [*self.sup.cmds[name], "--standby", str(go)])
        self.spares[name] = (spare, go)

    def _bring_back(self, name: str) -> None:
        """Restart learner or syncer `name`: a learner's spare takes over when it is warm (its
        ready file is there); otherwise a new process (and the spare, if warming, is killed).
        A new spare starts `spare_after_s` later."""
        spare, go = self.spares.pop(name, ("", Path()))
        if spare and self.procs[spare].poll() is None and standby_ready_file(go).exists():
            self.sup.kill(name)
            go.touch()
            self.sup.procs[name] = self.sup.procs.pop(spare)
            self.sup.cmds.pop(spare, None)
            self.took_over.append({"learner": name, "spare": spare, "t": time.time()})
        else:
            if spare:  # not warm yet, or it died waiting: a plain restart, and a new spare
                self.sup.kill(spare)
                self.sup.procs.pop(spare, None)
                self.sup.cmds.pop(spare, None)
            if spare or name in self._spare_due:  # (or its next spare has not started yet)
                self.cold_restarts.append({"learner": name, "spare": spare or None,
                                           "t": time.time()})
            self.sup.kill(name)
            self.sup.spawn(name, self.restore_cmds.pop(name, None))
        if spare:  # its next spare (by default a little later: not beside the restart's work)
            self._spare_due[name] = time.monotonic() + self.spare_after_s

    def _stop_spares(self) -> None:
        """The spares are not part of the run: they are killed when training ends."""
        self._spare_due.clear()
        for spare, _ in self.spares.values():
            self.sup.kill(spare)
            self.sup.procs.pop(spare, None)
            self.sup.cmds.pop(spare, None)
        self.spares.clear()

    def _event(self, kind: str, **fields) -> None:
        self._pending_events.append({"kind": kind, **fields})
        try:
            while self._pending_events:
                ev = self._pending_events[0]
                registry.event(self.r, self.keys, ev["kind"], **{k: v for k, v in ev.items()
                                                                 if k != "kind"})
                self._pending_events.pop(0)
        except (redis.ConnectionError, redis.TimeoutError):
            pass  # Redis is down (a fault): written once it is back

    def _learner(self, target: str) -> str:
        if target:
            return target
        up = [f"L{m}" for m in range(self.cfg.learners)
              if f"L{m}" not in self.down and f"L{m}" not in self.paused
              and f"L{m}" not in self.cut]
        return str(self.rng.choice(up)) if up else ""

    def inject(self, f: Fault) -> None:
        now = time.monotonic()
        target = self._learner(f.target) if f.kind.endswith("learner") else (f.target or "")
        if f.kind.endswith("learner") and not target:
            return  # every learner is already down
        rec = {**asdict(f), "target": target, "t": time.time(), "t_rel_s": now - self.t0}
        self.faults.append(rec)
        self._event("fault", fault=f.kind, target=target, down_s=f.down_s)
        if f.kind == "kill-learner":
            self.sup.kill(target)
            self.down[target] = now + f.down_s
        elif f.kind == "pause-learner":
            self.sup.signal(target, signal.SIGSTOP)
            self.paused[target] = now + f.down_s
        elif f.kind in ("partition-learner", "cut-zmq-learner"):
            proxies = self.proxies[target] if f.kind == "partition-learner" else \
                self.proxies[target][-len(self.sync_ports):]
            for px in proxies:
                px.cut()
            self.cut[target] = now + f.down_s
            self.cut_proxies[target] = proxies
        elif f.kind in ("kill-syncer", "kill-syncer-after-commit"):
            sid = target or "syncer-0"
            self.sup.kill(sid)
            if f.kind == "kill-syncer-after-commit":
                # the restart dies after its next commit (exit 18: `_check_children` starts
                # the plain command then), however long that takes: `down_s` does not apply
                base = [a for a in self.sup.cmds[sid] if not a.startswith("--fail")]
                self.sup.spawn(sid, base + ["--fail-after-commit", "1"])
                self.restore_cmds[sid] = base
            else:
                self.down[sid] = now + f.down_s
        elif f.kind == "takeover":  # for good: the other syncers must take its fragments
            self.sup.kill(target or "syncer-0")
        elif f.kind == "kill-redis":
            self.redis.kill()
            self.down["redis"] = now + f.down_s
        elif f.kind == "kill-redis-master":  # its replica is promoted; it comes back as one
            key = self.keys.fragment(int(target or 1)).frags
            node = self.r.get_node_from_key(key)
            i = next(i for i, n in enumerate(self.redis.nodes) if n.port == node.port)
            rec["node"] = i
            self.redis.kill(i)
            self.down[f"redis-node:{i}"] = now + f.down_s

    def _recover(self, now: float) -> None:
        for name, t in list(self.down.items()):
            if now < t:
                continue
            if name.startswith("redis-node:"):
                self.redis.restart(int(name.split(":")[1]))
                self._event("recover", target=name)
            elif name == "redis":
                self.redis.start()
                self.sup.r.close()
                self.sup.r = connect(self.redis.url)
                self._event("recover", target="redis")
            else:
                self._bring_back(name)
                self.restarts.append((name, time.time()))
                self._event("recover", target=name)
            del self.down[name]
        for name, t in list(self.paused.items()):
            if now >= t:
                self.sup.signal(name, signal.SIGCONT)
                self.restarts.append((name, time.time()))
                self._event("recover", target=name)
                del self.paused[name]
        for name, t in list(self.cut.items()):
            if now >= t:
                for px in self.cut_proxies.pop(name):
                    px.heal()
                self.restarts.append((name, time.time()))
                self._event("recover", target=name)
                del self.cut[name]

    def _start_due_spares(self, now: float) -> None:
        for name, t in list(self._spare_due.items()):
            if now >= t:
                del self._spare_due[name]
                if name not in self.spares:
                    self._spawn_spare(name)

    def _check_children(self) -> None:
        """Restart anything that died without being killed by a fault (and say so)."""
        for name, p in self.procs.items():
            code = p.poll()
            if code is None or code == 0 or name in self.down or name in self.gave_up:
                continue
            if any(f["kind"] == "takeover" and (f["target"] or "syncer-0") == name
                   for f in self.faults):
                continue
            if code in (17, 18):  # a fault-injected syncer exit: bring it back, plain
                self.fault_exits.append({"syncer": name, "code": code, "t": time.time()})
                self.sup.spawn(name, self.restore_cmds.pop(name, None))
                self.restarts.append((name, time.time()))
                continue
            if code == 3 and name.startswith("L"):
                # it stood down for a newer process of its id: restarting it would take the
                # learner back from that one (reported, never expected of this harness)
                self._event("superseded", target=name, code=code)
                self.gave_up.add(name)
                continue
            self.crashes[name] = self.crashes.get(name, 0) + 1
            self._event("crash", target=name, code=code)
            if self.crashes[name] <= self.max_crashes:
                self.sup.spawn(name)
            else:  # a crash loop is a bug to report, not something to retry forever
                self.down.pop(name, None)
                self.gave_up.add(name)

    def _evaluate(self, corpus) -> None:
        try:
            m = self.sup.evaluate(corpus)
        except (BrokerError, redis.RedisError) as e:
            # Redis is down mid-fault (or nothing is committed yet): recorded, tried again later
            self.eval_failures.append({"wall_s": time.monotonic() - self.t0,
                                       "error": f"{type(e).__name__}: {e}"})
            return
        self.history.append({"wall_s": time.monotonic() - self.t0, **m})

    def wait_until_training(self, timeout_s: float = 120.0) -> None:
        """The fault clock starts once every learner has taken an inner step and every spare is
        warm (process start and compilation are not part of the experiment)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            recs = registry.learner_records(self.r, self.keys)
            if len(recs) >= self.cfg.learners and all(r.step >= 1
                                                      for r in recs.values()) and \
                    all(standby_ready_file(go).exists() for _, go in self.spares.values()):
                break
            if any(p.poll() not in (None, 0) for p in self.procs.values()):
                raise RuntimeError(f"a process died during startup; see {self.logs}")
            time.sleep(0.1)
        self.t_start = time.time()
        self.t0 = time.monotonic()

    def restarting(self) -> frozenset[str]:
        """Learners the harness took down (killed, paused or cut off) and will bring back."""
        return frozenset(n for n in (*self.down, *self.paused, *self.cut) if n.startswith("L"))

    def supervise(self, schedule: list[Fault], duration_s: float, corpus=None,
                  progress: Callable[[ChaosRun, float], None] | None = None) -> None:
        """Inject the schedule's faults and bring back what they took down, for `duration_s`
        after every learner has taken a step; `progress` is called about once a second with
        the harness and the seconds since then."""
        self.duration_s = duration_s
        cannot = NOT_ON_CLUSTER if self.redis_cluster else ("kill-redis-master",)
        refused = sorted({f.kind for f in schedule if f.kind in cannot})
        if refused:
            need = "a standalone Redis" if self.redis_cluster else "a Redis Cluster"
            raise ValueError(f"faults {', '.join(refused)} need {need}")
        self.wait_until_training()
        todo = list(schedule)
        next_eval = next_progress = self.t0
        while True:
            now = time.monotonic()
            rel = now - self.t0
            while todo and todo[0].at_s <= rel:
                self.inject(todo.pop(0))
            self._recover(now)
            self._start_due_spares(now)
            if "redis" not in self.down:
                self._check_children()
            if corpus is not None and self.eval_every_s and now >= next_eval and \
                    "redis" not in self.down:
                self._evaluate(corpus)
                next_eval = now + self.eval_every_s
            if progress is not None and now >= next_progress and "redis" not in self.down:
                next_progress = now + 1.0
                try:
                    progress(self, rel)
                except (BrokerError, redis.RedisError) as e:  # the view only: the run goes on
                    log.warning("progress view skipped: %s", e)
            learners_done = all(self.procs[f"L{m}"].poll() == 0 or f"L{m}" in self.gave_up
                                for m in range(self.cfg.learners))
            if learners_done or (rel >= duration_s and not self.down and not self.paused
                                 and not self.cut):
                break
            time.sleep(0.05)
        self.t_stop = time.time()
        self._stop_spares()
        registry.request_finish(self.r, self.keys)

    def finish(self, timeout_s: float = 300.0, corpus=None) -> dict:
        deadline = time.monotonic() + timeout_s
        for name in self.procs:
            if not self.sup.wait(name, max(1.0, deadline - time.monotonic())):
                self.sup.kill(name)
                self._event("timeout", target=name)
        t_end = time.time()
        if corpus is not None:
            self._evaluate(corpus)
        sizes = fragment_sizes(self.task.param_shapes(), self.frags)
        total = sum(sizes)
        rep = account(self.r, self.run, len(self.frags), self.state_dir,
                      learners=self.cfg.learners, frag_weights=[s / total for s in sizes],
                      t_start=self.t_start, t_end=self.t_stop, restarts=self.restarts,
                      window_s=max(5.0, 2 * self.cfg.effective_sync().sync_every *
                                   max(self.pace_s, 0.02) / len(self.frags)))
        finals = registry.learner_final_reports(self.r, self.keys)
        hashes = {k: v.hashes for k, v in finals.items()}
        versions_ok = True
        by_syncer: dict[str, list[int]] = {}  # syncer → how many rounds of each fragment
        for p in range(len(self.frags)):
            recs = list(read_rounds(self.r, self.keys.fragment(p)))
            vs = [rec.version for rec in recs]
            versions_ok &= all(b > a for a, b in zip(vs, vs[1:], strict=False))
            for rec in recs:
                by_syncer.setdefault(rec.syncer, [0] * len(self.frags))[p] += 1
        rep.update({
            "mode": self.cfg.mode, "learners": self.cfg.learners,
            "faults": self.faults, "exit_codes": {n: p.returncode for n, p in self.procs.items()},
            "crashes": self.crashes, "gave_up": sorted(self.gave_up),
            "learners_finished": sorted(finals), "learner_hashes": hashes,
            "identical_final_values": len({json.dumps(h, sort_keys=True)
                                           for h in hashes.values()}) == 1 and bool(hashes),
            "versions_increase": versions_ok, "finish_s": t_end - self.t_stop,
            "rounds_by_syncer": by_syncer, "spares_took_over": self.took_over,
            "spares_not_ready": self.cold_restarts,
            "syncer_fault_exits": self.fault_exits,
            "resumes": [{"learner": f[b"learner"].decode(), "step": int(f[b"step"]),
                         "source": f[b"source"].decode(),
                         "progress": f.get(b"progress", b"0") == b"1"}
                        for _, f in self.r.xrange(self.keys.events)
                        if f.get(b"kind") == b"resume"],
            "history": self.history, "eval_failures": self.eval_failures,
        })
        return rep

    def close(self) -> None:
        if self.sup is not None:
            self.sup.close()
        for proxies in self.proxies.values():
            for px in proxies:
                px.close()
        if self.redis is not None:
            self.redis.stop()


def run_chaos(cfg: RunConfig, run_dir: Path, run: str, schedule: list[Fault], duration_s: float,
              **kwargs) -> dict:
    """Start, supervise for `duration_s` (then stop and flush), account; always clean up."""
    corpus = kwargs.pop("corpus", None)
    progress = kwargs.pop("progress", None)
    chaos = ChaosRun(cfg, run_dir, run, **kwargs)
    try:
        chaos.start()
        chaos.supervise(schedule, duration_s, corpus, progress)
        return chaos.finish(corpus=corpus)
    finally:
        chaos.close()
