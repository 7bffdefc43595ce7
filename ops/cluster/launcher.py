"""`diloco run` on one machine: an embedded redis-server, a syncer and M learner processes.

The launcher stores the run configuration in Redis, starts the processes through the
:class:`~ops.cluster.supervisor.Supervisor`, logs their heartbeats, evaluates the global
parameters now and then (the published value: what learners train from; Θ itself at the end),
and writes the run's output folder. It returns the run's summary; the
command line (``ops/cli/run.py``) prints it and shows live progress through a callback.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from broker import records, registry
from broker.connection import redact
from broker.errors import BrokerError
from ops.cluster import artifacts
from ops.cluster.redis_server import RedisServer
from ops.cluster.supervisor import Supervisor, role_cmd, store_run_config
from pipeline.config import RunConfig
from pipeline.engine import bandwidth_ratios
from pipeline.fragments import fragment_sizes
from pipeline.task import Data, n_params, with_init_hash

Progress = Callable[[float], None]  # called about once a second with the seconds since start


class RunFailed(Exception):
    """A process of the run exited with an error (its log is in the run folder)."""


class Launcher:
    """One `diloco run` in a run folder: start, watch, summarise."""

    def __init__(self, cfg: RunConfig, run: str, redis_url: str, run_dir: Path, *,
                 learner_args: list[str] | None = None, eval_every_s: float = 15.0,
                 pin_learners: bool = False, tensorboard: str | Path | None = None):
        self.cfg = cfg
        self.tensorboard = tensorboard  # each process writes its curves in a folder here
        self.run_dir = run_dir
        self.learner_args = learner_args or []
        self.pin_learners = pin_learners  # learner m on the m-th core this process may use
        self.eval_every_s = eval_every_s
        self.sup = Supervisor(cfg, run, redis_url, run_dir)
        self.history: list[dict] = []

    def start(self) -> None:
        self.sup.spawn("syncer", role_cmd("syncer", self.sup.url, self.sup.run,
                                          *self._curves("syncer-0"), cfg=self.cfg))
        cores = sorted(os.sched_getaffinity(0)) if self.pin_learners else []
        for m in range(self.cfg.learners):
            self.sup.spawn(f"L{m}", role_cmd("learner", self.sup.url, self.sup.run,
                                             "--id", f"L{m}", *self.learner_args,
                                             *self._curves(f"L{m}"), cfg=self.cfg))
            if self.pin_learners:
                # set as the interpreter starts, before JAX starts its threads (they inherit
                # it); a learner restarted later by the supervisor is not pinned
                os.sched_setaffinity(self.sup.procs[f"L{m}"].pid, {cores[m % len(cores)]})

    def _curves(self, name: str) -> list[str]:
        return ["--tensorboard", str(Path(self.tensorboard) / name)] if self.tensorboard else []

    def evaluate(self, corpus: Data, log: artifacts.MetricsLog, t0: float) -> dict | None:
        """Evaluate the value learners train from (`Supervisor.evaluate`'s `published`: about
        the model's fp32 size; Θ itself, which replays the rounds since the last checkpoint,
        is evaluated at the end) and log it."""
        try:
            m = self.sup.evaluate(corpus, published=True)
        except BrokerError:
            return None  # nothing published yet (or a snapshot refused: tried again later)
        recs = registry.learner_records(self.sup.r, self.sup.keys)
        rec = {"tokens": sum(h.tokens for h in recs.values()),
               "wall_s": time.monotonic() - t0, **m}
        self.history.append(rec)
        log.write("eval", rec)
        return rec

    def log_progress(self, log: artifacts.MetricsLog) -> None:
        r, keys = self.sup.r, self.sup.keys
        recs = registry.learner_records(r, keys)
        log.write("progress", {"learners": {k: h.to_dict() for k, h in recs.items()},
                               "syncers": {k: s.to_dict() for k, s in
                                           registry.syncer_records(r, keys).items()},
                               "live": sorted(registry.live_learners(r, keys))})

    def wait(self, corpus: Data, log: artifacts.MetricsLog,
             progress: Progress | None = None) -> float:
        t0 = time.monotonic()
        next_eval = t0 + 2.0
        while True:
            codes = self.sup.exit_codes()
            failed = {n: c for n, c in codes.items() if c not in (None, 0)}
            if failed:
                raise RunFailed(f"process(es) failed: {failed}; see {self.run_dir}/logs")
            if all(c == 0 for c in codes.values()):
                return time.monotonic() - t0
            self.log_progress(log)
            if progress is not None:
                progress(time.monotonic() - t0)
            if time.monotonic() >= next_eval:
                self.evaluate(corpus, log, t0)
                next_eval = time.monotonic() + self.eval_every_s
            time.sleep(1.0)

    def summary(self, wall_s: float, corpus: Data, log: artifacts.MetricsLog,
                initial_eval_loss: float,
                global_model: tuple[dict[str, np.ndarray], list[int]]) -> dict:
        """The run's summary, with the final evaluation of the global Θ (`global_model`:
        `Supervisor.global_model`'s)."""
        cfg, r, keys = self.cfg, self.sup.r, self.sup.keys
        final = {**self.sup.evaluate_params(global_model[0], corpus),
                 "versions": global_model[1]}
        reports = registry.learner_final_reports(r, keys)
        tokens = sum(v.tokens for v in reports.values())
        rec = {"tokens": tokens, "wall_s": wall_s, **final}
        self.history.append(rec)
        log.write("eval", rec)
        M = cfg.learners
        sent = int(np.mean([v.bytes_sent for v in reports.values()])) if reports else 0
        received = int(np.mean([v.bytes_received for v in reports.values()])) if reports else 0
        nparams = n_params(self.sup.task)
        tps = cfg.inner.batch_size * cfg.model.seq_len
        ratios = bandwidth_ratios(M, nparams, tps, sent, received, tokens / M)
        sizes = fragment_sizes(self.sup.task.param_shapes(), self.sup.frags)
        rounds, useful = 0, 0.0
        merged_steps = [0] * len(self.sup.frags)  # learner steps each fragment's rounds merged
        for p in range(len(self.sup.frags)):
            for rnd in records.read_rounds(r, keys.fragment(p)):
                rounds += 1
                useful += sizes[p] / nparams * sum(rnd.seconds)
                merged_steps[p] += rnd.steps or 0
        first = self.history[0] if self.history else rec
        return {
            "mode": cfg.mode, "learners": M, "steps": cfg.steps, "params": nparams,
            "tokens": int(tokens),
            "initial_eval_loss": initial_eval_loss,
            "final_eval_loss": final["eval_loss"], "final_eval_accuracy": final["eval_accuracy"],
            "bytes_sent": sent, "bytes_received": received,
            **ratios,
            "goodput": useful / (M * wall_s) if wall_s else 0.0,
            "rounds": rounds, "merged_steps": merged_steps, "wall_s": wall_s,
            "versions": final["versions"],
            "learner_hashes": {k: v.hashes for k, v in reports.items()},
            "rejected_globals": sum(v.rejected for v in reports.values()),
            "history": self.history, "first_eval_tokens": first["tokens"],
        }

    def log_rounds_and_reports(self, log: artifacts.MetricsLog) -> None:
        """Copy every round record and each learner's final report into metrics.jsonl."""
        r, keys = self.sup.r, self.sup.keys
        for p in range(len(self.sup.frags)):
            for rnd in records.read_rounds(r, keys.fragment(p)):
                log.write("round", rnd.to_dict())
        for name, rep in registry.learner_final_reports(r, keys).items():
            log.write("learner_final", {"learner": name, **rep.to_dict()})


def run_distributed(cfg: RunConfig, run_name: str, *, out: str | Path,
                    redis_url: str | None = None, pace_s: float = 0.0,
                    progress: Callable[[Launcher, float], None] | None = None,
                    pin_learners: bool = False, tensorboard: str | Path | None = None,
                    wandb: bool = False) -> dict:
    """Run the job with real processes; return the summary (also written to the run folder).

    Args:
        cfg: The run configuration (mode decoupled or sync-diloco).
        run_name: The run name.
        out: The folder that gets the run folder.
        redis_url: Use this Redis; None: start an embedded redis-server for the run.
        pace_s: Pace every learner's inner step to this wall time (0: as fast as it goes).
        progress: Called about once a second with the launcher and the seconds since start.
        pin_learners: Pin learner m to the m-th core of this process's (round robin).
        tensorboard: Also write the metrics as TensorBoard event files in this folder, and
            each process its own curves in a folder under it named by its id.
        wandb: Also log them to a W&B run named `run_name` (in the run folder).

    Raises:
        ValueError: The mode runs only in-process.
        FileNotFoundError: No redis-server to start.
        BrokerError: The run exists with another configuration.
        RunFailed: A process of the run failed.
    """
    if cfg.mode == "ddp":
        raise ValueError("mode ddp runs only in the in-process engine (--engine inprocess)")
    server = RedisServer().start() if redis_url is None else None
    url = redis_url or server.url
    la = log = None
    try:
        cfg = with_init_hash(cfg, local=cfg.task)
        store_run_config(url, run_name, cfg)
        run_dir = artifacts.new_run_dir(out, run_name)
        artifacts.write_config(run_dir, cfg)
        log = artifacts.MetricsLog(run_dir / "metrics.jsonl", tensorboard,
                                   (run_name, cfg) if wandb else None)
        la = Launcher(cfg, run_name, url, run_dir,
                      learner_args=["--pace-s", str(pace_s)] if pace_s else [],
                      pin_learners=pin_learners, tensorboard=tensorboard)
        corpus = la.sup.task.data()
        initial = la.sup.evaluate_params(la.sup.task.init_params(cfg.seed),
                                         corpus)["eval_loss"]
        la.history.append({"tokens": 0, "wall_s": 0.0, "eval_loss": initial})
        la.start()
        try:
            wall_s = la.wait(corpus, log, None if progress is None else
                             lambda t: progress(la, t))
        except BaseException:
            la.sup.stop_all()
            raise
        params, versions = la.sup.global_model()
        summary = la.summary(wall_s, corpus, log, initial, (params, versions))
        la.log_rounds_and_reports(log)
        artifacts.save_checkpoint(run_dir / "checkpoint.npz", params, cfg, versions)
        artifacts.plot_loss(run_dir / "loss.png", {cfg.mode: summary["history"]}, x="wall_s",
                            title=f"{cfg.mode}, M={cfg.learners}: global model")
        summary["run_dir"] = str(run_dir)
        summary["redis_url"] = None if redis_url is None else redact(redis_url)
        artifacts.write_json(run_dir / "summary.json", summary)
        log.write("summary", {k: v for k, v in summary.items() if k != "history"})
        return summary
    finally:
        if log is not None:
            log.close()
        if la is not None:
            la.sup.close()
        if server is not None:
            server.stop()
