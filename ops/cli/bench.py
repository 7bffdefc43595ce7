"""`diloco bench quality|overlap|overlap-library|islands|pipeline|memory|roles|large|latency|
recovery|cluster|security|step|step-loop|step-flags|step-matrix|accelerator|s1|s2|poison|lab`:
the benchmarks' command line.

The benchmarks (`ops.bench`) write their results into ``--out`` and return them; this module
prints progress lines, the results and picks the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ops.bench import (
    accelerator,
    islands,
    lab,
    large,
    overlap,
    pipeline,
    quality,
    resilience,
    roles,
    step,
    step_matrix,
)
from ops.chaos import SPARE_AFTER_S, spare_options_problem
from ops.cli.common import add_config_args, config_from_args, fail
from ops.cli.live import LiveView, chaos_view
from pipeline.config import ConfigError

_PIPELINE = (("overlap", overlap.bench_overlap, "learner step rate, syncing on ÷ off"),
             ("overlap-library", overlap.bench_overlap_library,
              "the same for a hand-written loop around workers.island.Island"),
             ("islands", islands.bench_islands, "a 4-device island vs 4 one-device learners"),
             ("pipeline", pipeline.bench_pipeline, "syncer MB/s ÷ raw XREADGROUP MB/s"),
             ("memory", pipeline.bench_memory, "syncer peak RSS, 4 vs 64 pushers"),
             ("roles", roles.bench_roles,
              "peak memory of each role of a real run, at 6.5M and 50.7M parameters"),
             ("large", large.bench_large,
              "the largest model this host holds end to end: 2 learners, a syncer taken "
              "over by a standby, replay, export, eval"),
             ("latency", pipeline.bench_latency, "round latency p50/p99, 4 MB fragments"),
             ("cluster", pipeline.bench_cluster,
              "one redis-server vs a local Redis Cluster, the same syncer work"),
             ("recovery", pipeline.bench_recovery,
              "a successor syncer's start vs rounds since the last checkpoint"),
             ("security", pipeline.bench_security,
              "TLS + ACL + CURVE + signatures vs open: latency, throughput, overlap"),
             ("step", step.bench_step,
              "the inner step vs this machine's matmul rate; the learner loop vs the bare step"),
             ("step-loop", step.bench_learner_loop,
              "the learner loop vs the bare step alone, interleaved on one core"),
             ("step-flags", step.bench_xla_flags,
              "XLA CPU options on the shipped step, each beside the step without them"))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (results for BENCHMARKS.md)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    q = bsub.add_parser("quality", help="ddp vs sync-diloco vs decoupled at equal tokens")
    add_config_args(q, mode=False)
    q.add_argument("--out", default="runs/bench-quality", help="output folder")
    q.add_argument("--only", default="", help="comma-separated subset of variant names")
    q.add_argument("--frontier", default="", metavar="H,H,...",
                   help="also run decoupled at these sync intervals H with each up/down codec pair "
                        "(int4/bf16, bf16/bf16, int4/int8Δ, int4/int4Δ, int4+EF/int4Δ, "
                        "int4+EF/bf16; Δ: delta down link, +EF: up-link error feedback)")
    q.add_argument("--model", choices=tuple(quality.MODELS), default="bench",
                   help="bench: the small bench model (d_model 64, 2 layers, 1,500 steps); "
                        "default: the model ModelConfig defaults to, 2,000 steps; shipped: "
                        "that model and length with every sync and outer setting as shipped")
    q.add_argument("--seeds", default="", metavar="S,S,...",
                   help="run every variant at each seed (table: mean ± spread over seeds)")
    q.add_argument("--lrs", default="", metavar="LR,LR,...",
                   help="run every variant at each inner learning rate (the same sweep for "
                        "ddp and ours; the gap is to ddp at its best lr)")
    q.add_argument("--outer-lrs", default="", metavar="LR,LR,...",
                   help="run every variant but ddp at each outer learning rate (named "
                        "'<variant> olr=<lr>'; ddp has no outer step)")
    q.add_argument("--outer-momenta", default="", metavar="M,M,...",
                   help="run every variant but ddp at each outer Nesterov momentum (named "
                        "'<variant> om=<m>')")
    q.add_argument("--report", action="store_true",
                   help="print the tables over every run already in --out's results.json "
                        "(all sittings), running nothing")
    q.add_argument("--poison", action="store_true",
                   help="the poison guard's variants instead: one learner of M poisoned "
                        "(10⁴× norm, 10⁴× tokens, sign-flipped δ), guard on vs off")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_quality)
    for name, fn, text in _PIPELINE:
        b = bsub.add_parser(name, help=text)
        b.add_argument("--out", default=f"runs/bench-{name}")
        b.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
        b.set_defaults(func=lambda args, fn=fn: _pipeline(fn, args))
    for name, text in (("s1", "goodput under learner failures"),
                       ("s2", "stragglers: speeds 1, 1, 1, 1/3")):
        b = bsub.add_parser(name, help=text)
        b.add_argument("--duration", type=float, default=300.0 if name == "s1" else 180.0)
        b.add_argument("--pace-s", type=float, default=0.2)
        b.add_argument("--kill-every-s", type=float, default=30.0)
        b.add_argument("--down-s", type=float, default=5.0)
        b.add_argument("--seeds", default="1",
                       help="comma-separated seeds, one side-by-side run each (s1: the kill "
                            "schedule; s2: model initialisation and data order)")
        b.add_argument("--out", default=f"runs/bench-{name}")
        b.add_argument("--quiet", action="store_true", help="no live progress")
        b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field of the benchmark's configuration, e.g. "
                            "--set model.d_model=128 (TOML value syntax; s2: every variant)")
        if name == "s1":
            b.add_argument("--learners", type=int, help="learners M (default 4)")
            b.add_argument("--spares", action="store_true",
                           help="every learner (both modes) has a warm spare that takes over "
                                "when it is killed (diloco chaos --spares)")
            b.add_argument("--spare-after-s", type=float, default=SPARE_AFTER_S, metavar="S",
                           help="with --spares: start a learner's next spare S seconds after "
                                "its last took over (default %(default)s)")
            b.add_argument("--modes", default=",".join(resilience.S1_MODES),
                           help="comma-separated subset of: " + ", ".join(resilience.S1_MODES)
                                + " (default: both, side by side)")
            b.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                           help="every learner (both modes) checkpoints every N inner steps "
                                "(default: every Δh steps, diloco learner's default)")
        if name == "s2":
            b.add_argument("--variants", default=",".join(resilience.S2_VARIANTS[:3]),
                           help="comma-separated subset of: " + "; ".join(
                               resilience.S2_VARIANTS))
        b.set_defaults(func=_resilience)
    b = bsub.add_parser("step-matrix", help="the shipped step vs XLA's operations in every "
                        "setting (alone, one thread, four learners paced/unpaced/pinned)")
    b.add_argument("--reps", type=int, default=3, help="alternating repetitions")
    b.add_argument("--bare-steps", type=int, default=30, help="timed steps of a bare step")
    b.add_argument("--run-steps", type=int, default=80, help="steps per learner of a run")
    b.add_argument("--settings", default=",".join(step_matrix.SETTINGS),
                   help="comma-separated subset of: " + ", ".join(step_matrix.SETTINGS))
    b.add_argument("--variants", default="",
                   help="comma-separated subset of: " + ", ".join(step_matrix.VARIANTS)
                        + " (default: all; fused-avx2 on x86-64 only)")
    b.add_argument("--out", default="runs/bench-step-matrix")
    b.set_defaults(func=_step_matrix)
    b = bsub.add_parser("accelerator", help="the prepared check for a GPU/TPU host: matmul "
                        "and 100M-parameter step FLOP/s in bf16 and fp32, a 2-learner run's "
                        "overlap and blocked time")
    b.add_argument("--tiny", action="store_true",
                   help="a tiny model (the CPU smoke run the test suite makes)")
    b.add_argument("--steps", type=int, default=0, help="timed steps per dtype (0: default)")
    b.add_argument("--out", default="runs/bench-accelerator")
    b.set_defaults(func=_accelerator)
    b = bsub.add_parser("poison", help="the poison guard on real processes: one learner of "
                        "four poisoned, guard on vs off, beside the clean run")
    b.add_argument("--steps", type=int, default=1000, help="inner steps per learner")
    b.add_argument("--pace-s", type=float, default=0.05)
    b.add_argument("--variants", default=",".join(resilience.POISON_VARIANTS),
                   help="comma-separated subset of: " + ", ".join(resilience.POISON_VARIANTS))
    b.add_argument("--out", default="runs/bench-poison")
    b.add_argument("--quiet", action="store_true", help="no live progress")
    b.set_defaults(func=_poison)
    b = bsub.add_parser("lab", help="4 sites behind shaped links (needs root): data parallel "
                        "vs decoupled, bytes on the wire, CPU-share stragglers, a partition")
    b.add_argument("--link-mbps", type=float, default=1.6, help="each site's link, each way")
    b.add_argument("--rtt-ms", type=float, default=50.0)
    b.add_argument("--ddp-steps", type=int, default=200, help="the token budget, in ddp steps")
    b.add_argument("--ddp-shaped-steps", type=int, default=8,
                   help="data parallel steps on the shaped links (its step time there)")
    b.add_argument("--decoupled-steps", type=int, default=600, help="per learner")
    b.add_argument("--hetero-steps", type=int, default=300, help="per learner")
    b.add_argument("--only", default="", help="comma-separated subset of the runs")
    b.add_argument("--out", default="runs/bench-lab")
    b.set_defaults(func=_lab)


def _progress(line: str) -> None:
    print(line, flush=True)


def _quality(args: argparse.Namespace) -> int:
    try:
        base = config_from_args(args, base=quality.MODELS[args.model]())
        frontier = [int(x) for x in args.frontier.split(",") if x.strip()]
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or None
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()] or None
        outer_lrs = [float(x) for x in args.outer_lrs.split(",") if x.strip()] or None
        outer_momenta = [float(x) for x in args.outer_momenta.split(",") if x.strip()] or None
    except ValueError as e:
        return fail(str(e))
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    if args.report:
        try:
            print(quality.report(Path(args.out), base))
        except (ValueError, OSError, KeyError) as e:
            return fail(str(e))
        return 0
    try:
        print(quality.run_quality(base, Path(args.out), only=only, frontier=frontier,
                                  poison=args.poison, seeds=seeds, lrs=lrs,
                                  outer_lrs=outer_lrs, outer_momenta=outer_momenta,
                                  progress=_progress))
    except (ValueError, OSError) as e:
        return fail(str(e))
    return 0


def _pipeline(fn, args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = fn(quick=args.quick)
    except FileNotFoundError as e:  # what the benchmark needs is not on this host
        return fail(str(e))
    result["machine"] = pipeline.machine()
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


def _step_matrix(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    variants = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = ([n for n in names if n not in step_matrix.SETTINGS]
               + [n for n in variants if n not in step_matrix.VARIANTS])
    if unknown or args.reps < 1:
        return fail(f"bench step-matrix: unknown setting or variant {', '.join(unknown)}"
                    if unknown else "bench step-matrix: --reps must be at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = step_matrix.bench_step_matrix(args.reps, args.bare_steps, args.run_steps, names,
                                           variants or None, progress=_progress)
    result["machine"] = pipeline.machine()
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(step_matrix.format_table(result))
    return 0


def _accelerator(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = accelerator.bench_accelerator(args.tiny, args.steps or None, progress=_progress)
    result["machine"] = pipeline.machine()
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


def _poison(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    view = LiveView(mode="quiet" if args.quiet else "auto", title="bench poison")
    try:
        with view:
            doc = resilience.poison(Path(args.out), names, steps=args.steps, pace_s=args.pace_s,
                                    progress=_progress, live=chaos_view(view))
    except (ValueError, OSError) as e:
        return fail(str(e))
    print(json.dumps(doc["summary"], indent=1))
    return 0


def _lab(args: argparse.Namespace) -> int:
    from ops.lab import check_capability

    reason = check_capability()
    if reason:
        return fail(reason)
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    try:
        doc = lab.bench_lab(Path(args.out), link_mbps=args.link_mbps, rtt_ms=args.rtt_ms,
                            ddp_steps=args.ddp_steps, ddp_shaped_steps=args.ddp_shaped_steps,
                            decoupled_steps=args.decoupled_steps,
                            hetero_steps=args.hetero_steps, only=only, progress=_progress)
    except (ValueError, OSError, RuntimeError) as e:
        return fail(str(e))
    print(json.dumps(doc["summary"], indent=1))
    return 0


def _resilience(args: argparse.Namespace) -> int:
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        if not seeds:
            raise ValueError
    except ValueError:
        return fail(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    base = None
    if getattr(args, "learners", None) or args.set:
        try:
            base = config_from_args(args, base=resilience.base_config())
        except ConfigError as e:
            return fail(str(e))
    if args.bench == "s1":
        if problem := spare_options_problem(args.spares, args.spare_after_s):
            return fail(problem)
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        if not modes or not set(modes) <= set(resilience.S1_MODES) or len(set(modes)) < len(
                modes):
            return fail(f"--modes: a comma-separated subset of {', '.join(resilience.S1_MODES)},"
                        f" not {args.modes!r}")
        if args.checkpoint_every < 0:
            return fail(f"--checkpoint-every must be >= 1 (or 0: every Δh), not "
                        f"{args.checkpoint_every}")
    view = LiveView(mode="quiet" if args.quiet else "auto", title=f"bench {args.bench}")
    common = {"duration_s": args.duration, "pace_s": args.pace_s, "progress": _progress,
              "live": chaos_view(view)}
    try:
        names = resilience.variant_names(args.variants) if args.bench == "s2" else []
    except ValueError as e:
        return fail(str(e))
    with view:
        if args.bench == "s1":
            doc = resilience.s1(Path(args.out), seeds, kill_every_s=args.kill_every_s,
                                down_s=args.down_s, base=base, spares=args.spares,
                                spare_after_s=args.spare_after_s,
                                checkpoint_every=args.checkpoint_every, modes=modes,
                                **common)
        else:
            doc = resilience.s2(Path(args.out), seeds, names, base=base, **common)
    d = resilience.digest(doc)
    print(json.dumps(d["runs"], indent=1))
    print(json.dumps({"summary": d["summary"]}, indent=1))
    sys.stdout.flush()
    return 0
