"""`diloco bench step-matrix`: the learner step as shipped against XLA's own operations in
every setting users run it in, side by side, the repetitions alternating.

Settings (`SETTINGS`):

* ``alone``: one process, the bare jitted step of the default model (`pipeline.train`), all
  cores, unpinned;
* ``one-thread``: the same pinned to one core (XLA's pool then has one thread);
* ``shared-paced``, ``shared-unpaced``, ``shared-pinned``: a real `diloco run` of
  `RunConfig()` with four learners (a syncer and Redis beside them on the same cores), each
  learner's step padded to 0.333 s, unpadded, or unpadded with learner m pinned to core
  m mod cores (two per core here). The figure is each learner's steady rate over its run
  (`LearnerFinal.steps_per_s`: first step to last, so compilation is left out and the pace
  is in it), as seconds per step.

Variants (`VARIANTS`): ``shipped`` is the environment with no ``DILOCO_*`` variable (what a
user gets); ``xla`` is ``DILOCO_FUSED=xla`` (XLA's operations); ``fused-avx2`` asks for the
fused kernels built for AVX2 (``DILOCO_FUSED=fused DILOCO_KERNEL_MARCH=x86-64-v3``): what a
host without AVX-512 would run if the kernels were not gated by vector width
(`workers.native.FUSED_MIN_VECTOR_BITS`).

Each repetition runs every setting and variant once, in the same order, so that the variants
of a setting alternate and a drift of the machine's speed falls on all of them. The result
keeps every figure; the table gives each cell's median and spread (min–max over repetitions)
and whether the shipped choice is the fastest or within the spread of the faster one.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SETTINGS: dict[str, dict[str, Any]] = {
    "alone": {"kind": "bare", "pin": False},
    "one-thread": {"kind": "bare", "pin": True},
    "shared-paced": {"kind": "run", "pace_s": 0.333, "pin": False, "every_variant": True},
    "shared-unpaced": {"kind": "run", "pace_s": 0.0, "pin": False},
    "shared-pinned": {"kind": "run", "pace_s": 0.0, "pin": True},
}
VARIANTS: dict[str, dict[str, str]] = {
    "shipped": {},
    "xla": {"DILOCO_FUSED": "xla"},
    "fused-avx2": {"DILOCO_FUSED": "fused", "DILOCO_KERNEL_MARCH": "x86-64-v3"},
}
WARMUP = 5


def bare(steps: int) -> dict[str, Any]:
    """The bare jitted step in this process: median and spread of `steps` timed steps after
    `WARMUP` (the learner's own start: the kept heap, the kernels as `install_fused` says)."""
    from workers.heap import keep_freed_memory

    keep_freed_memory()
    import jax.numpy as jnp
    import numpy as np

    from ops.bench.step import timed_steps
    from pipeline.config import RunConfig
    from pipeline.task import task_of
    from pipeline.train import make_step
    from workers import native

    backend = native.install_fused()
    cfg = RunConfig()
    task = task_of(cfg)
    mc = cfg.model
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, mc.vocab_size, (cfg.inner.batch_size,
                                                         mc.seq_len + 1)), jnp.int32)
    opt = task.optimizer()
    params = task.init_params(cfg.seed)
    state = opt.init(params)
    times = timed_steps(make_step(task, opt), params, state, batch, WARMUP, steps)[0]
    return {"backend": backend, "vector_bits": native._vector_bits,
            "threads": len(os.sched_getaffinity(0)), "step_s": statistics.median(times),
            "step_s_all": times}


def shared(steps: int, pace_s: float, pin: bool) -> dict[str, Any]:
    """A real `diloco run` of `RunConfig()` with four learners, in a temporary folder: each
    learner's steady seconds per step."""
    from ops.cluster import run_distributed
    from pipeline import config as cfgmod

    cfg = cfgmod.override(cfgmod.RunConfig(), learners=4, steps=steps)
    with tempfile.TemporaryDirectory(prefix="diloco-step-matrix-") as tmp:
        t0 = time.monotonic()
        summary = run_distributed(cfg, "m", out=tmp, pace_s=pace_s, pin_learners=pin)
        wall = time.monotonic() - t0
        finals = [json.loads(ln) for ln in
                  (Path(tmp) / "m" / "metrics.jsonl").read_text().splitlines()]
    rates = {f["learner"]: f["steps_per_s"] for f in finals if f.get("kind") == "learner_final"}
    per = sorted(1.0 / r for r in rates.values() if r > 0)
    if len(per) != cfg.learners:
        raise RuntimeError(f"step-matrix: {len(per)} of {cfg.learners} learners reported a rate")
    return {"step_s": statistics.median(per), "step_s_all": per, "wall_s": wall,
            "final_eval_loss": summary["final_eval_loss"]}


def _env(variant: dict[str, str]) -> dict[str, str]:
    """This environment without any ``DILOCO_*`` variable, plus the variant's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    return {**env, **variant}


def _child(code: str, env: dict[str, str], pin: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-c", f"import json; from ops.bench import step_matrix as m; "
           f"print(json.dumps(m.{code}))"]
    if pin:
        env = {**env, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        cmd = ["taskset", "-c", str(min(os.sched_getaffinity(0))), *cmd]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                          timeout=1800, cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0:
        raise RuntimeError(f"step-matrix {code}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def verdict(cells: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Whether ``shipped`` is the fastest variant of a setting, or within the spread of the
    fastest (its median no slower than the fastest's slowest repetition)."""
    best = min(cells, key=lambda v: cells[v]["median"])
    ship = cells["shipped"]
    return {"fastest": best, "ok": best == "shipped" or ship["median"] <= cells[best]["max"],
            **{f"{v}_over_shipped": c["median"] / ship["median"] for v, c in cells.items()
               if v != "shipped"}}


def bench_step_matrix(reps: int = 3, bare_steps: int = 30, run_steps: int = 80,
                      settings: list[str] | None = None, variants: list[str] | None = None,
                      run_variants: list[str] | None = None, progress=print) -> dict[str, Any]:
    """The matrix (see the module docstring; ``shipped`` is always measured, the reference of
    the others): `reps` alternating repetitions of every setting
    and variant (`run_variants`: the variants of the ``shared-*`` settings but
    ``shared-paced``, the issue's setting, which runs them all; default all but
    ``fused-avx2``, whose 4-learner runs take minutes each)."""
    settings = settings or list(SETTINGS)
    x86 = platform.machine() in ("x86_64", "AMD64")
    variants = ["shipped", *[v for v in variants or VARIANTS
                             if v != "shipped" and (x86 or v != "fused-avx2")]]
    run_variants = run_variants or [v for v in variants if v != "fused-avx2"]
    if not shutil.which("taskset"):
        settings = [s for s in settings if not (SETTINGS[s]["kind"] == "bare"
                                                and SETTINGS[s]["pin"])]
    for v in variants:  # every library built before anything is timed
        subprocess.run([sys.executable, "-c", "from workers import native; native.build()"],
                       env=_env(VARIANTS[v]), check=True, capture_output=True, timeout=900,
                       cwd=Path(__file__).resolve().parents[2])
    raw: dict[str, dict[str, list[dict]]] = {s: {} for s in settings}
    for rep in range(reps):
        for s in settings:
            spec = SETTINGS[s]
            every = spec["kind"] == "bare" or spec.get("every_variant")
            for v in (variants if every else run_variants):
                env = _env(VARIANTS[v])
                if spec["kind"] == "bare":
                    got = _child(f"bare({bare_steps})", env, pin=spec["pin"])
                else:
                    got = _child(f"shared({run_steps}, {spec['pace_s']}, {spec['pin']})", env)
                raw[s].setdefault(v, []).append(got)
                progress(f"rep {rep + 1}/{reps} {s:15s} {v:10s} {got['step_s'] * 1e3:8.1f} ms/step"
                         + (f" ({got['backend']})" if "backend" in got else ""))
    table = {}
    for s, by_variant in raw.items():
        cells = {v: _summary([g["step_s"] for g in runs]) for v, runs in by_variant.items()}
        table[s] = {"cells": cells, **verdict(cells)}
    return {"bench": "step-matrix", "reps": reps, "bare_steps": bare_steps,
            "run_steps": run_steps, "settings": {s: SETTINGS[s] for s in settings},
            "variants": {v: VARIANTS[v] for v in variants}, "table": table, "raw": raw}


def format_table(result: dict[str, Any]) -> str:
    """The markdown table of a result: per setting, each variant's median [min–max] ms/step."""
    variants = list(result["variants"])
    lines = ["| setting | " + " | ".join(variants) + " | fastest | shipped ok |",
             "|---|" + "---|" * (len(variants) + 2)]
    for s, row in result["table"].items():
        cells = []
        for v in variants:
            c = row["cells"].get(v)
            cells.append("–" if c is None else
                         f"{c['median'] * 1e3:.0f} [{c['min'] * 1e3:.0f}–{c['max'] * 1e3:.0f}]")
        lines.append(f"| {s} | " + " | ".join(cells)
                     + f" | {row['fastest']} | {'yes' if row['ok'] else 'NO'} |")
    return "\n".join(lines)
