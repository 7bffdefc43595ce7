"""Overlap efficiency: one learner's steady step rate with syncing on against off (or over
TLS, ACL users, CURVE and signatures), with real learner and syncer processes — the CLI learner
(`bench_overlap`) and a hand-written loop around `workers.island.Island`
(`bench_overlap_library`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from broker import registry
from broker.connection import connect
from broker.keys import RunKeys
from ops.bench.pipeline import servers
from ops.cluster import RedisServer, store_run_config
from pipeline import config as cfgmod
from pipeline.config import RunConfig


def _examples() -> Path:
    """The examples folder: a source checkout's, else the one installed with the package
    (<prefix>/share/decoupled-diloco/examples)."""
    checkout = Path(__file__).resolve().parents[2] / "examples"
    if (checkout / "own_loop.py").exists():
        return checkout
    return Path(sys.prefix) / "share" / "decoupled-diloco" / "examples"


EXAMPLES = _examples()


def bench_overlap(quick: bool = False) -> dict:
    """One learner pinned to CPU 0, the syncer and redis-server pinned to CPU 1 (a learner
    with its own core, as on separate hosts), run twice: syncing on, then off (`--no-sync`,
    same process otherwise). The steady inner-step rate of the two is compared."""
    steps = 300 if quick else 1500
    base = cfgmod.override(cfgmod.demo_config(), learners=1, steps=steps,
                           **{"sync.quorum": 1})
    return run_overlap(base, [sys.executable, "-m", "workers.learner"], quick)


def bench_overlap_library(quick: bool = False) -> dict:
    """The overlap benchmark of the learner as a library: examples/own_loop.py (a user's model
    and a hand-written loop around `workers.island.Island`) instead of `diloco learner`, with
    the same run settings (demo H and P, one learner, 1500 steps)."""
    if not (EXAMPLES / "own_loop.py").exists():
        raise FileNotFoundError(f"{EXAMPLES}/own_loop.py not found: bench overlap-library "
                                "runs the examples of a source checkout or of the installed "
                                "package")
    if str(EXAMPLES) not in sys.path:  # this process stores the spec: it imports the task
        sys.path.insert(0, str(EXAMPLES))
    steps = 300 if quick else 1500
    base = cfgmod.override(cfgmod.demo_config(), learners=1, steps=steps, task="user_model:make",
                           **{"sync.quorum": 1})
    res = run_overlap(base, [sys.executable, str(EXAMPLES / "own_loop.py")], quick,
                   env={"PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(EXAMPLES.parent)])},
                   syncer_args=["--task", "user_model:make"])
    res["bench"] = "overlap-library"
    res["learner"] = "examples/own_loop.py (user_model:make, default options)"
    return res


def run_overlap(base: RunConfig, learner_cmd: list[str], quick: bool, env: dict | None = None,
             syncer_args: list[str] | None = None, modes: tuple[str, ...] = ("on", "off")
             ) -> dict:
    """Steady steps/s of one learner per mode: "on" (syncing), "off" (``--no-sync``),
    "secure" (syncing over TLS with ACL users, CURVE and signed contributions)."""
    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    steps = base.steps
    env = {**os.environ, **(env or {})}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(1 if quick else 2):
        for mode in modes:
            run = f"overlap-{mode}-{rep}"
            with contextlib.ExitStack() as stack:
                if mode == "secure":
                    admin, _, redis_args, sec = servers(stack, True, run, ["L0"])
                    srv = sec.server
                else:
                    sec, srv = None, stack.enter_context(RedisServer(appendonly=True))
                    admin, redis_args = srv.url, ["--redis-url", srv.url]
                if pin:
                    subprocess.run(["taskset", "-pc", "1", str(srv.proc.pid)],
                                   capture_output=True, check=False)
                store_run_config(admin, run, base)
                cpu1 = ["taskset", "-c", "1"] if pin else []
                cpu0 = ["taskset", "-c", "0"] if pin else []
                syncer = subprocess.Popen([*cpu1, sys.executable, "-m", "workers.syncer",
                                           *redis_args, "--run", run, *(syncer_args or [])],
                                          stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, env=env)
                learner_args = sec.learner_args("L0") if sec else ["--redis-url", srv.url]
                learner = subprocess.Popen(
                    [*cpu0, *learner_cmd, *learner_args, "--run", run, "--id", "L0",
                     *(["--no-sync"] if mode == "off" else [])],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
                try:
                    learner.wait(1800)
                    syncer.wait(120)
                finally:
                    for proc in (learner, syncer):
                        if proc.poll() is None:
                            proc.kill()
                r = connect(admin)
                reports = registry.learner_final_reports(r, RunKeys(run))
                rates[mode].append(reports["L0"].steps_per_s)
    if "off" not in rates:
        return {"steps": steps, "pinned": pin, **{f"steps_per_s_{m}": statistics.mean(v)
                                                  for m, v in rates.items()},
                "runs": rates}
    on, off = statistics.mean(rates["on"]), statistics.mean(rates["off"])
    return {"bench": "overlap", "learners": 1, "steps": steps, "pinned": pin,
            "model": dataclasses.asdict(base.model), "sync": dataclasses.asdict(
                base.effective_sync()),
            "steps_per_s_sync_on": on, "steps_per_s_sync_off": off, "ratio": on / off,
            "runs_on": rates["on"], "runs_off": rates["off"],
            "note": "learner on CPU 0, syncer + redis-server on CPU 1; steady-state rate "
                    "(the first, compiling step excluded)"}
