"""`diloco run` on one machine: an embedded redis-server, a syncer and M learner processes.

The launcher is only a supervisor and an observer: the processes it starts are the same ones an
operator starts by hand on separate hosts (`diloco syncer`, `diloco learner`). It stores the
run configuration in Redis, starts the children, shows live progress from their heartbeats,
evaluates the global parameters now and then, and writes the run's output folder.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from broker import registry
from broker.connection import connect
from broker.errors import BrokerError
from broker.keys import RunKeys
from broker.state import unpack_state
from ops.cli.common import fail, make_corpus, print_json, write_json
from ops.cluster import artifacts
from ops.cluster.redis_server import RedisServer
from pipeline import config as cfgmod
from pipeline.config import RunConfig
from pipeline.engine import ring_allreduce_bytes_per_step
from pipeline.fragments import fragment_sizes, partition
from pipeline.model import n_params, param_shapes
from pipeline.train import evaluate


def store_run_config(redis_url: str, run: str, cfg: RunConfig) -> bool:
    """Store the run configuration; False if the same one was stored already."""
    r = connect(redis_url)
    try:
        return registry.store_config(r, RunKeys(run), cfgmod.dumps_toml(cfg), cfg.run_hash())
    finally:
        r.close()


def global_params(r, keys: RunKeys, n_frags: int) -> tuple[dict[str, np.ndarray], list[int]]:
    """The global Θ (fp32) of every fragment, from the syncers' committed state."""
    params: dict[str, np.ndarray] = {}
    versions = []
    for p in range(n_frags):
        blob = r.get(keys.fragment(p).state)
        if blob is None:
            raise BrokerError(f"fragment {p} has no committed state")
        st = unpack_state(blob)
        params.update({k: np.asarray(v, np.float32) for k, v in st["theta"].items()})
        versions.append(int(st["version"]))
    return params, versions


def child_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class Launcher:
    def __init__(self, cfg: RunConfig, run: str, redis_url: str, run_dir: Path, *,
                 quiet: bool, learner_args: list[str] | None = None, eval_every_s: float = 15.0):
        self.cfg = cfg
        self.run = run
        self.url = redis_url
        self.keys = RunKeys(run)
        self.run_dir = run_dir
        self.quiet = quiet
        self.learner_args = learner_args or []
        self.eval_every_s = eval_every_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.r = connect(redis_url)
        self.frags = partition(param_shapes(cfg.model), cfg.effective_sync().fragments)
        self.history: list[dict] = []

    def spawn(self, name: str, cmd: list[str]) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        with open(logs / f"{name}.log", "ab") as out:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def start(self) -> None:
        base = ["--redis-url", self.url, "--run", self.run]
        self.spawn("syncer", child_cmd("workers.syncer", *base))
        for m in range(self.cfg.learners):
            self.spawn(f"L{m}", child_cmd("workers.learner", *base, "--id", f"L{m}",
                                          *self.learner_args))

    def stop_children(self, timeout_s: float = 10.0) -> None:
        try:
            registry.request_stop(self.r, self.keys)
        except Exception:  # Redis may be the thing that is gone
            pass
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def evaluate(self, corpus, log: artifacts.MetricsLog, t0: float) -> dict | None:
        try:
            params, versions = global_params(self.r, self.keys, len(self.frags))
        except BrokerError:
            return None
        m = evaluate({k: jnp.asarray(v) for k, v in params.items()},
                     self._eval_batches(corpus), self.cfg.model)
        recs = registry.learner_records(self.r, self.keys)
        tokens = sum(rec.get("tokens", 0) for rec in recs.values())
        rec = {"tokens": tokens, "wall_s": time.monotonic() - t0, "eval_loss": m["loss"],
               "eval_accuracy": m["accuracy"], "versions": versions}
        self.history.append(rec)
        log.write("eval", rec)
        return rec

    def _eval_batches(self, corpus):
        if not hasattr(self, "_eb"):
            self._eb = corpus.eval_batches(self.cfg.data.eval_batches, self.cfg.inner.batch_size)
        return self._eb

    def progress(self, log: artifacts.MetricsLog, t0: float) -> None:
        recs = registry.learner_records(self.r, self.keys)
        live = registry.live_learners(self.r, self.keys)
        syncers = registry.syncer_records(self.r, self.keys)
        log.write("progress", {"learners": recs, "syncers": syncers, "live": sorted(live)})
        if self.quiet:
            return
        parts = []
        for name in sorted(recs):
            rec = recs[name]
            mark = "" if name in live else " (down)"
            parts.append(f"{name} step {rec.get('step', 0)} {rec.get('tokens_per_s', 0):,.0f} "
                         f"tok/s v{rec.get('versions', [])}{mark}")
        for name, s in sorted(syncers.items()):
            parts.append(f"{name} rounds {s.get('rounds', 0)} quorum wait "
                         f"{1000 * s.get('quorum_wait_s', 0):.0f} ms grace wait "
                         f"{1000 * s.get('grace_wait_s', 0):.0f} ms")
        print(f"[{time.monotonic() - t0:6.1f} s] " + " | ".join(parts), file=sys.stderr,
              flush=True)

    def wait(self, corpus, log: artifacts.MetricsLog) -> float:
        t0 = time.monotonic()
        next_eval = t0 + 2.0
        while True:
            codes = {n: p.poll() for n, p in self.procs.items()}
            failed = {n: c for n, c in codes.items() if c not in (None, 0)}
            if failed:
                raise RuntimeError(f"process(es) failed: {failed}; see {self.run_dir}/logs")
            if all(c == 0 for c in codes.values()):
                return time.monotonic() - t0
            self.progress(log, t0)
            if time.monotonic() >= next_eval:
                self.evaluate(corpus, log, t0)
                next_eval = time.monotonic() + self.eval_every_s
            time.sleep(1.0)

    def summary(self, wall_s: float, corpus, log: artifacts.MetricsLog) -> dict:
        cfg = self.cfg
        params, versions = global_params(self.r, self.keys, len(self.frags))
        final = evaluate({k: jnp.asarray(v) for k, v in params.items()},
                         self._eval_batches(corpus), cfg.model)
        rec = {"tokens": 0, "wall_s": wall_s, "eval_loss": final["loss"],
               "eval_accuracy": final["accuracy"], "versions": versions}
        reports = {k[len("final:"):]: v for k, v in
                   registry.done_reports(self.r, self.keys).items() if k.startswith("final:")}
        tokens = sum(v["tokens"] for v in reports.values())
        rec["tokens"] = tokens
        self.history.append(rec)
        log.write("eval", rec)
        M = cfg.learners
        sent = int(np.mean([v["bytes_sent"] for v in reports.values()])) if reports else 0
        received = int(np.mean([v["bytes_received"] for v in reports.values()])) if reports else 0
        nparams = n_params(cfg.model)
        tps = cfg.inner.batch_size * cfg.model.seq_len
        ring_per_token = ring_allreduce_bytes_per_step(M, nparams) / tps
        ours = (sent + received) / (tokens / M) if tokens else 0.0
        sizes = fragment_sizes(param_shapes(cfg.model), self.frags)
        rounds, useful = 0, 0.0
        for p in range(len(self.frags)):
            for _, fields in self.r.xrange(self.keys.fragment(p).rounds):
                rounds += 1
                useful += sizes[p] / nparams * sum(json.loads(fields[b"seconds"]))
        first = self.history[0] if self.history else rec
        return {
            "mode": cfg.mode, "learners": M, "steps": cfg.steps, "params": nparams,
            "tokens": int(tokens),
            "initial_eval_loss": self.initial["eval_loss"],
            "final_eval_loss": final["loss"], "final_eval_accuracy": final["accuracy"],
            "bytes_sent": sent, "bytes_received": received,
            "bandwidth_ratio_vs_ddp": ring_per_token / ours if ours else 0.0,
            "goodput": useful / (M * wall_s) if wall_s else 0.0,
            "rounds": rounds, "wall_s": wall_s, "versions": versions,
            "learner_hashes": {k: v["hashes"] for k, v in reports.items()},
            "history": self.history, "first_eval_tokens": first["tokens"],
        }

    def log_rounds_and_reports(self, log: artifacts.MetricsLog) -> None:
        """Copy every round record and each learner's final report into metrics.jsonl."""
        for p in range(len(self.frags)):
            for _, f in self.r.xrange(self.keys.fragment(p).rounds):
                rec = {k.decode(): v.decode() for k, v in f.items()}
                for k in ("included", "dropped", "seconds"):
                    if k in rec:
                        rec[k] = json.loads(rec[k])
                for k in ("version", "fragment", "tokens", "steps"):
                    if k in rec:
                        rec[k] = int(rec[k])
                for k in ("quorum_wait_s", "grace_wait_s", "merge_s", "t"):
                    if k in rec:
                        rec[k] = float(rec[k])
                log.write("round", rec)
        for name, rep in registry.done_reports(self.r, self.keys).items():
            if name.startswith("final:"):
                log.write("learner_final", {"learner": name[len("final:"):], **rep})


def run_distributed(cfg: RunConfig, run_name: str, args: argparse.Namespace) -> int:
    if cfg.mode == "ddp":
        return fail("mode ddp runs only in the in-process engine (--engine inprocess)")
    server = None
    url = args.redis_url
    try:
        if url is None:
            try:
                server = RedisServer().start()
            except FileNotFoundError as e:
                return fail(str(e))
            url = server.url
        try:
            store_run_config(url, run_name, cfg)
        except BrokerError as e:
            return fail(str(e))
        if args.init_only:
            print(f"stored run {run_name!r} (config hash {cfg.run_hash()}) in {url}")
            return 0
        run_dir = artifacts.new_run_dir(args.out, run_name)
        artifacts.write_config(run_dir, cfg)
        log = artifacts.MetricsLog(run_dir / "metrics.jsonl")
        corpus = make_corpus(cfg)
        learner_args = []
        if getattr(args, "pace_s", None):
            learner_args += ["--pace-s", str(args.pace_s)]
        la = Launcher(cfg, run_name, url, run_dir, quiet=args.quiet or args.json,
                      learner_args=learner_args)
        from pipeline.model import init_params

        init = init_params(cfg.model, cfg.seed)
        la.initial = evaluate(init, la._eval_batches(corpus), cfg.model)
        la.initial = {"eval_loss": la.initial["loss"]}
        la.history.append({"tokens": 0, "wall_s": 0.0, "eval_loss": la.initial["eval_loss"]})
        la.start()
        try:
            wall_s = la.wait(corpus, log)
        except KeyboardInterrupt:
            print("interrupted: stopping every process", file=sys.stderr)
            la.stop_children()
            return 130
        except RuntimeError as e:
            la.stop_children()
            return fail(str(e), 1)
        summary = la.summary(wall_s, corpus, log)
        la.log_rounds_and_reports(log)
        params, versions = global_params(la.r, la.keys, len(la.frags))
        artifacts.save_checkpoint(run_dir / "checkpoint.npz", params, cfg, versions)
        artifacts.plot_loss(run_dir / "loss.png", {cfg.mode: summary["history"]}, x="wall_s",
                            title=f"{cfg.mode}, M={cfg.learners}: global model")
        summary["run_dir"] = str(run_dir)
        summary["redis_url"] = url if args.redis_url else None
        write_json(run_dir / "summary.json", summary)
        log.write("summary", {k: v for k, v in summary.items() if k != "history"})
        log.close()
        if args.json:
            print_json({k: v for k, v in summary.items() if k != "history"})
        else:
            from ops.cli.run import print_summary

            print_summary(summary)
        return 0
    finally:
        if server is not None:
            server.stop()
