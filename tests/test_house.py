"""The house rules that keep the checkout readable, checked on every change (fast tier): the
docs' length caps, the raw benchmark files the report cites, and no Python file over 500
lines or class over 25 methods."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 100  # columns of prose in the docs (tables and code blocks may be wider)

# Python files over 500 lines and classes over 25 methods (counting those of the project's own
# base classes), each with the size it may not exceed until it is split: none today, and none
# may join (split by job instead). A split one leaves the list.
OVER_500: dict[str, int] = {}
OVER_25: dict[str, int] = {}


def _wrapped_lines(text: str) -> int:
    """Lines as a reader sees them at `WIDTH` columns: a table row is one line however wide."""
    return sum(1 if line.startswith("|") or len(line) <= WIDTH else -(-len(line) // WIDTH)
               for line in text.split("\n"))


def _prose(text: str) -> list[str]:
    """The lines outside code blocks and tables."""
    out, code = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            code = not code
        elif not code and not line.startswith("|"):
            out.append(line)
    return out


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().split("\n")) <= 150


def test_the_benchmark_report_holds_current_tables_only():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert _wrapped_lines(text) <= 400, "BENCHMARKS.md: move history to docs/journal/"
    long = [line for line in _prose(text) if len(line) > WIDTH]
    assert not long, f"BENCHMARKS.md: prose lines over {WIDTH} columns: {long[:3]}"


def test_the_raw_benchmark_files_are_the_ones_the_docs_cite():
    docs = "\n".join(p.read_text() for p in [ROOT / "BENCHMARKS.md", ROOT / "README.md",
                                               *(ROOT / "docs").glob("*.md")])
    cited = set(re.findall(r"docs/bench/([\w.\-]+\.\w+)", docs))
    present = {p.name for p in (ROOT / "docs" / "bench").iterdir() if p.is_file()}
    assert sorted(cited - present) == [], "cited but not in docs/bench/"
    assert sorted(present - cited) == [], "in docs/bench/ but cited nowhere: move to " \
                                          "docs/journal/bench/"


def test_no_python_file_grows_past_500_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().split("\n")) - 1
             for pkg in ("pipeline", "broker", "workers", "ops")
             for p in (ROOT / pkg).rglob("*.py")}
    over = {f: n for f, n in sizes.items() if n > 500}
    grown = {f: (n, OVER_500.get(f)) for f, n in over.items() if n > OVER_500.get(f, 500)}
    assert not grown, f"over 500 lines (now, cap): {grown}; split the file by job"
    shrunk = sorted(f for f in OVER_500 if sizes.get(f, 0) <= 500)
    assert not shrunk, f"{shrunk} are 500 lines or fewer now: take them off OVER_500"


def _methods() -> dict[str, int]:
    """Each class of the packages → its methods, its own and those of the project's classes
    it derives from (by name, within the packages)."""
    classes: dict[str, tuple[str, set[str], list[str]]] = {}
    for pkg in ("pipeline", "broker", "workers", "ops"):
        for p in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ClassDef):
                    own = {n.name for n in node.body
                           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
                    bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
                    classes[node.name] = (f"{p.relative_to(ROOT)}:{node.name}", own, bases)

    def all_methods(name: str, seen: frozenset = frozenset()) -> set[str]:
        _, own, bases = classes[name]
        out = set(own)
        for b in bases:
            if b in classes and b not in seen:
                out |= all_methods(b, seen | {name})
        return out

    return {where: len(all_methods(name)) for name, (where, _, _) in classes.items()}


def test_no_class_grows_past_25_methods():
    counts = _methods()
    grown = {c: (n, OVER_25.get(c)) for c, n in counts.items() if n > OVER_25.get(c, 25)}
    assert not grown, f"over 25 methods (now, cap): {grown}; carve out objects with one job"
    shrunk = sorted(c for c in OVER_25 if counts.get(c, 0) <= 25)
    assert not shrunk, f"{shrunk} have 25 methods or fewer now: take them off OVER_25"
