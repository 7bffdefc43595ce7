"""`diloco data prepare`: text, JSONL or a folder tokenised with a tokenizers JSON file into the
token files learners read (`ops.tools.prepare`)."""

from __future__ import annotations

import argparse
import sys

from ops.cli.common import fail, print_json
from ops.tools import prepare


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare training data")
    dsub = p.add_subparsers(dest="data", metavar="ACTION", required=True)
    q = dsub.add_parser(
        "prepare", help="tokenise text, JSONL or a folder into a token file",
        description="Tokenise --input (a text file, a .jsonl file's --text-field, or a folder "
        "of text files) with --tokenizer (a tokenizers JSON file, e.g. a Hugging Face "
        "model's tokenizer.json) into --out, the uint16 (.bin, .u16) or uint32 (.u32) token "
        "file learners read (data.source; set model.vocab_size to the tokenizer's). Streams; "
        "needs the [data] extra.")
    q.add_argument("--tokenizer", required=True, metavar="FILE", help="tokenizers JSON file")
    q.add_argument("--input", required=True, metavar="PATH", help="text, .jsonl or folder")
    q.add_argument("--out", required=True, metavar="FILE", help="token file (.bin/.u16/.u32)")
    q.add_argument("--text-field", default="text", help="JSONL: the document's key")
    q.add_argument("--eos", type=int, default=None, metavar="ID",
                   help="token id put between documents (default: none)")
    q.add_argument("--quiet", action="store_true", help="no progress lines")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.set_defaults(func=_prepare)


def _progress(s: dict) -> None:
    of = f" of {s['total_bytes'] / 2**20:,.0f} MiB" if s["total_bytes"] else ""
    print(f"  {s['bytes_read'] / 2**20:,.1f} MiB{of} read, {s['documents']:,} documents, "
          f"{s['tokens']:,} tokens", file=sys.stderr, flush=True)


def _prepare(args: argparse.Namespace) -> int:
    try:
        rep = prepare.prepare(args.tokenizer, args.input, args.out, text_field=args.text_field,
                              eos=args.eos, progress=None if args.quiet else _progress)
    except (ValueError, OSError) as e:
        return fail(str(e))
    if args.json:
        print_json(rep)
    else:
        print(f"{rep['tokens']:,} tokens of {rep['documents']:,} documents written to "
              f"{rep['out']} ({rep['dtype']}, vocabulary {rep['vocab_size']:,}, largest id "
              f"{rep['largest_id']:,}; set data.source={rep['out']} "
              f"model.vocab_size={rep['vocab_size']})")
    return 0
