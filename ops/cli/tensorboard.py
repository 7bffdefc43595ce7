"""`diloco tensorboard RUN_DIR --out DIR`: a run folder's metrics as TensorBoard event files
(`ops.cluster.tensorboard`; `diloco run --tensorboard DIR` writes the same while it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ops.cli.common import fail, print_json
from ops.cluster import tensorboard


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tensorboard", help="a run folder's metrics as TensorBoard event files",
                       description="Write RUN_DIR/metrics.jsonl (any run: distributed, "
                       "in-process, chaos) as TensorBoard event files in DIR: evaluation loss "
                       "by tokens, each learner's loss and rates by step, each fragment's "
                       "rounds by version. Needs the [tensorboard] extra.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (holds metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="event files' folder (default: RUN_DIR/tb)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_convert)


def _convert(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(args.run_dir) / "tb"
    try:
        n = tensorboard.convert(args.run_dir, out)
    except (ValueError, OSError) as e:
        return fail(str(e))
    if args.json:
        print_json({"records": n, "out": str(out)})
    else:
        print(f"{n} records of {args.run_dir} written to {out} (tensorboard --logdir {out})")
    return 0
