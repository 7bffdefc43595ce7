"""`diloco plan`: a run's bytes per direction, link use, syncer cores and memory per role
before it starts (`pipeline.plan`), with this code's per-value costs measured on this host
(`ops.tools.plan`)."""

from __future__ import annotations

import argparse
import re

from ops.cli.common import add_config_args, config_from_args, fail, print_json
from pipeline import config as cfgmod

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def _count(text: str) -> int:
    """A count of values: 300000000, 3e8, 300M, 12B (k, M, B/G, T)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 300M, 12B, 3e8)")
    n = round(float(m.group(1)) * _SUFFIX[m.group(2)])
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least one value")
    return n


def _positive(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = -1.0
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return x


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="bytes per direction, link use, syncer cores and memory of a run, "
        "before it starts",
        description="Plan a run: from its sync settings (--config, --set), its size (--params, "
        "or the configured model's tensors) and its step time, print each learner's bytes up "
        "and down against a data-parallel ring all-reduce, each link's use, the syncer cores "
        "it needs, each role's memory and what would hold training back. The per-value costs "
        "of the syncer and the learner are measured on this host first (a second or two).")
    add_config_args(p, mode=False)
    p.add_argument("--params", type=_count, help="model values (300M, 12B, 3e8); default: the "
                   "configured model's, split into fragments as a run splits them")
    p.add_argument("--step-s", type=_positive, required=True,
                   help="seconds of one inner step of a learner")
    p.add_argument("--link-gbps", type=_positive, default=10.0,
                   help="each learner's link to the syncers (Gbit/s; default 10)")
    p.add_argument("--syncer-link-gbps", type=_positive,
                   help="the syncers' link, all of them together (default: --link-gbps)")
    p.add_argument("--syncers", type=int, default=1, help="syncer processes (default 1)")
    p.add_argument("--tokens-per-step", type=_count,
                   help="tokens a learner trains on per step, for bytes per token (default: "
                   "the configured batch × sequence length, without --params)")
    p.add_argument("--measure-values", type=_count, default=None,
                   help="fragment size the costs are measured on (default 2M values)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_plan)


def _fragments(cfg: cfgmod.RunConfig, params: int | None) -> tuple[int, ...]:
    from pipeline.fragments import fragment_sizes, partition
    from pipeline.plan import even_fragments
    from pipeline.task import task_of

    p = cfg.effective_sync().fragments
    if params is not None:
        return even_fragments(params, p)
    task = task_of(cfg, local=cfg.task)
    shapes = task.param_shapes()
    return tuple(fragment_sizes(shapes, partition(shapes, p, task.is_embedding)))


def _plan(args: argparse.Namespace) -> int:
    from ops.tools import plan as planner
    from pipeline.plan import Workload, format_plan, fragments_of, plan

    try:
        cfg = config_from_args(args)
        if args.syncers < 1:
            raise cfgmod.ConfigError("--syncers: at least 1")
        fragments = fragments_of(_fragments(cfg, args.params))
    except (cfgmod.ConfigError, ValueError) as e:
        return fail(str(e))
    # bytes per token: of the tokens given, or of the configured model's batch when it is the
    # model planned (a --params model's batch is not the configuration's)
    tokens = args.tokens_per_step or (
        0 if args.params else cfg.inner.batch_size * cfg.model.seq_len)
    w = Workload(fragment_values=fragments, learners=cfg.learners, step_s=args.step_s,
                 link_gbps=args.link_gbps,
                 syncer_link_gbps=args.syncer_link_gbps or args.link_gbps,
                 tokens_per_step=tokens, syncers=args.syncers)
    costs = planner.measure(cfg, args.measure_values or planner.MEASURE_VALUES)
    result = plan(cfg, w, costs)
    if args.json:
        print_json(result)
    else:
        print("\n".join(format_plan(result)))
    return 0
