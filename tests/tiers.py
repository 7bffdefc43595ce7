"""The test tiers: each test is marked `redis`, `process` or `compiler` by what it reaches, found
here from its source — never picked by hand — and checked while it runs.

A test reaches what the functions it calls reach: its own body, its fixtures (the whole
closure pytest resolves for it), and the functions and classes of the test modules and
`helpers_*` modules those name, followed until nothing new turns up. Every name is resolved
through its module's imports to a qualified name (`native.build` in a module that did
`from workers import native` is `workers.native.build`) and matched against `REACHES` below.

The check (`guard`, autouse): a test not marked `redis` that connects to a Redis server, or
one marked with none of the three that starts a process (the compilers included), fails with
the name of what it did — so a test that escapes the scan is caught the first time it runs, in
every tier, and the fix is a name added to `REACHES`.

Tiers: `pytest -m fast` (none of the three), `pytest -m "not slow"` (the default tier), `pytest`
(all: what CI runs).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

TESTS = Path(__file__).resolve().parent

# qualified name (or a prefix ending in ".") → the marks a test that names it gets
REACHES: dict[str, tuple[str, ...]] = {
    # Redis: a server started by the test (a process too) or a connection to one
    "ops.cluster.redis_server.": ("redis", "process"),
    "ops.cluster.RedisServer": ("redis", "process"),
    "ops.cluster.RedisCluster": ("redis", "process"),
    "ops.cluster.ClusterServers": ("redis", "process"),
    "ops.cluster.cluster.": ("redis", "process"),
    "redis.": ("redis",),
    "broker.connection.connect": ("redis",),
    # processes
    "subprocess.": ("process",),
    "multiprocessing.": ("process",),
    "os.fork": ("process",),
    "os.posix_spawn": ("process",),
    "os.system": ("process",),
    "sys.executable": ("process",),
    "ops.chaos.": ("process", "redis"),
    "ops.lab.": ("process", "redis"),
    "ops.cluster.Launcher": ("process", "redis"),
    "ops.cluster.launcher.": ("process", "redis"),
    "ops.bench.": ("process", "redis", "compiler"),
    "ops.cli.": ("process", "redis", "compiler"),
    "ops.sim.": ("process",),
    "workers.scalars.WandbSink": ("process",),  # W&B's service process (and git)
    "wandb.": ("process",),
    "workers.syncer.main": ("process", "redis", "compiler"),
    "workers.learner.main": ("process", "redis", "compiler"),
    # the compilers (the kernels' build, and asking a compiler its version)
    "workers.native.": ("compiler", "process"),
}
# names under a matched prefix that reach nothing: constants and pure helpers
NEUTRAL = ("workers.native.FUSED_ENV", "workers.native.SANITIZE_ENV", "workers.native.MARCH_ENV",
           "workers.native.FUSED_MIN_VECTOR_BITS")
MARKS = ("redis", "process", "compiler")
# conftest's autouse fixtures around every test (they act only on what a test is marked)
INFRASTRUCTURE = frozenset({"_tier_guard", "_kernels_built", "_unfused", "_reap_children",
                            "_alone"})


def _match(qual: str) -> set[str]:
    if any(qual == n or qual.startswith(n + ".") for n in NEUTRAL):
        return set()
    out: set[str] = set()
    for key, marks in REACHES.items():
        base = key.rstrip(".")
        if qual == base or qual.startswith(base + "."):
            out.update(marks)
    return out


class _Module:
    """One test or helper module's imports and top-level definitions."""

    def __init__(self, mod: ModuleType):
        self.name = mod.__name__
        try:
            self.tree = ast.parse(inspect.getsource(mod))
        except (OSError, TypeError, SyntaxError):
            self.tree = ast.Module(body=[], type_ignores=[])
        self.imports: dict[str, str] = {}
        self.defs: dict[str, ast.AST] = {}
        self.methods: dict[str, list[ast.AST]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.imports[a.asname or a.name.split(".")[0]] = \
                        a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.imports[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.defs[node.name] = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(t, ast.Name):
                        self.defs[t.id] = node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                        self.methods.setdefault(sub.name, []).append(sub)


@cache
def _module(name: str) -> _Module | None:
    mod = sys.modules.get(name)
    if mod is None or not str(getattr(mod, "__file__", "") or "").startswith(str(TESTS)):
        return None
    return _Module(mod)


def _dotted(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def _reach(start: list[tuple[_Module, ast.AST]]) -> set[str]:
    """The marks reached from the definitions `start` (module, node)."""
    marks: set[str] = set()
    seen: set[tuple[str, int]] = set()
    todo = list(start)
    while todo:
        mod, node = todo.pop()
        key = (mod.name, id(node))
        if key in seen:
            continue
        seen.add(key)
        for sub in ast.walk(node):
            chain = _dotted(sub) if isinstance(sub, ast.Attribute | ast.Name) else None
            if not chain:
                continue
            head, rest = chain[0], chain[1:]
            if head in ("self", "cls") and rest:
                todo += [(mod, m) for m in mod.methods.get(rest[0], [])]
                continue
            if head in mod.defs:
                todo.append((mod, mod.defs[head]))
                continue
            qual = mod.imports.get(head)
            if qual is None:
                continue
            full = ".".join([qual, *rest])
            marks |= _match(full)
            # a helper module's function: follow it there
            modname, _, attr = qual.rpartition(".")
            for cand_mod, cand_attr in ((modname, attr), (qual, rest[0] if rest else None)):
                other = _module(cand_mod) if cand_mod else None
                if other is not None and cand_attr in other.defs:
                    todo.append((other, other.defs[cand_attr]))
    return marks


def _node_of(fn) -> tuple[_Module, ast.AST] | None:
    fn = inspect.unwrap(fn)
    mod = _module(getattr(fn, "__module__", ""))
    if mod is None:
        return None
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        node = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    return mod, node


def marks_of(item: pytest.Item) -> set[str]:
    """The marks `item` reaches: its function, its class's methods it calls, its fixtures."""
    start: list[tuple[_Module, ast.AST]] = []
    fn = getattr(item, "function", None)
    if fn is not None and (n := _node_of(fn)) is not None:
        start.append(n)
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        if name in INFRASTRUCTURE:
            continue
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if defs:
            if (n := _node_of(defs[-1].func)) is not None:
                start.append(n)
    return _reach(start)


def pytest_configure(config: pytest.Config) -> None:
    for name, what in (("redis", "connects to a Redis server (or starts one)"),
                       ("process", "starts a process (a role, a server, the compilers)"),
                       ("compiler", "builds or loads the compiled kernels"),
                       ("fast", "none of redis, process, compiler: the fast tier")):
        config.addinivalue_line("markers", f"{name}: {what} — assigned by tests/tiers.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        found = marks_of(item)
        for m in sorted(found):
            item.add_marker(m)
        if not found:
            item.add_marker("fast")


class TierViolation(BaseException):
    """Raised (past `except Exception`) where a test does what its marks say it does not."""


# DILOCO_TIERS_RECORD=path: nothing fails; each test's marks and what it did are written to
# `path` (JSON) at the end — to see where the scan marks more than a test does
RECORD = os.environ.get("DILOCO_TIERS_RECORD", "")
_current: dict = {"item": None, "marks": frozenset(), "violations": [], "did": set()}
_record: dict[str, dict] = {}


def _saw(what: str, detail: str) -> None:
    item = _current["item"]
    if item is None:
        return
    _current["did"].add(what)
    allowed = {"process": {"process", "redis", "compiler"}, "redis": {"redis"}}[what]
    if _current["marks"] & allowed or RECORD:
        return
    msg = (f"{item.nodeid} {detail}, but tests/tiers.py did not mark it so (marks: "
           f"{sorted(_current['marks']) or 'none: fast'}): add the name it reaches to REACHES")
    _current["violations"].append(msg)
    raise TierViolation(msg)


def _install() -> None:
    import redis.connection

    orig_exec = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    orig_connect = redis.connection.AbstractConnection.connect

    def execute_child(self, args, *a, **kw):
        _saw("process", f"started a process ({str(args)[:160]})")
        return orig_exec(self, args, *a, **kw)

    def connect(self, *a, **kw):
        _saw("redis", "connected to Redis")
        return orig_connect(self, *a, **kw)

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]
    redis.connection.AbstractConnection.connect = connect


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest):
    """Fail a test that does what its marks say it does not (see the module's docstring)."""
    if not _current.get("installed"):
        _install()
        _current["installed"] = True
    node = request.node
    _current.update(item=node, violations=[], did=set(),
                    marks=frozenset(m.name for m in node.iter_markers() if m.name in MARKS))
    yield
    violations = list(_current["violations"])
    if RECORD:
        _record[node.nodeid] = {"marks": sorted(_current["marks"]),
                                "did": sorted(_current["did"])}
    _current.update(item=None, marks=frozenset(), violations=[], did=set())
    if violations:
        pytest.fail("\n".join(dict.fromkeys(violations)), pytrace=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if RECORD and _record:
        Path(RECORD).write_text(json.dumps(_record, indent=1, sort_keys=True))
