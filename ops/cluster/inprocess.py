"""`diloco run --engine inprocess`: the same algorithm in one process on a virtual clock, with
the real codec's byte counts, writing the same run folder as a distributed run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ops.cluster import artifacts
from ops.cluster.wire import codec_sizes
from pipeline.config import RunConfig
from pipeline.engine import Engine


def run_inprocess(cfg: RunConfig, run_name: str, *, out: str | Path,
                  on_eval: Callable[[dict], None] | None = None,
                  tensorboard: str | Path | None = None, wandb: bool = False) -> dict:
    """Run the in-process engine; return the summary (also written to the run folder).

    Args:
        cfg: The run configuration (any mode, ddp included).
        run_name: The run name (the run folder's).
        out: The folder that gets the run folder.
        on_eval: Called with each evaluation record (virtual wall time, tokens, loss).
        tensorboard: Also write the metrics as TensorBoard event files in this folder.
        wandb: Also log them to a W&B run named `run_name` (in the run folder).
    """
    run_dir = artifacts.new_run_dir(out, run_name)
    artifacts.write_config(run_dir, cfg)
    log = artifacts.MetricsLog(run_dir / "metrics.jsonl", tensorboard,
                               (run_name, cfg) if wandb else None)

    def on_event(kind: str, data: dict) -> None:
        log.write(kind, data)
        if on_eval is not None and kind == "eval":
            on_eval(data)

    try:
        engine = Engine(cfg, wire=codec_sizes(), on_event=on_event)
        summary = engine.run()
        log.write("summary", {k: v for k, v in summary.items() if k != "history"})
    finally:
        log.close()
    artifacts.save_checkpoint(run_dir / "checkpoint.npz", engine.final_params, cfg)
    artifacts.plot_loss(run_dir / "loss.png", {cfg.mode: summary["history"]},
                        title=f"{cfg.mode}, M={cfg.learners} (in-process)")
    summary["run_dir"] = str(run_dir)
    artifacts.write_json(run_dir / "summary.json", summary)
    return summary
