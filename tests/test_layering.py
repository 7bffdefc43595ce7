"""The layering as designed: what each folder and each room of ops/ may import.

    pipeline  ←  broker  ←  workers  ←  ops
                                          cli → (every room)
                                          bench → lab, chaos, cluster
                                          lab → chaos, cluster
                                          chaos → cluster
                                          tools → cluster
                                          cluster, sim (nothing in ops)

Read from the source (every import, also inside functions), so a forbidden arrow fails here
even if no test exercises the code that has it. A room of ops/ uses a sibling room only through
the names its ``__init__`` exports (``from ops.cluster import Supervisor``, never
``from ops.cluster.supervisor import Supervisor``), and nothing imports ops.cli.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "broker", "workers", "ops")
ROOMS = ("cli", "cluster", "chaos", "tools", "bench", "sim", "lab")

# Who may import whom (beyond itself and third-party code).
ALLOWED = {
    "pipeline": set(),
    "broker": {"pipeline"},
    "workers": {"broker", "pipeline"},
    "ops.sim": set(),
    "ops.cluster": {"workers", "broker", "pipeline"},
    "ops.chaos": {"ops.cluster", "workers", "broker", "pipeline"},
    "ops.tools": {"ops.cluster", "workers", "broker", "pipeline"},
    "ops.lab": {"ops.chaos", "ops.cluster", "workers", "broker", "pipeline"},
    "ops.bench": {"ops.lab", "ops.chaos", "ops.cluster", "workers", "broker", "pipeline"},
    "ops.cli": {f"ops.{r}" for r in ROOMS if r != "cli"} | {"workers", "broker", "pipeline"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    """The unit a module belongs to: a top-level package, or a room of ops/."""
    parts = module.split(".")
    if parts[0] == "ops" and len(parts) > 1 and parts[1] in ROOMS:
        return f"ops.{parts[1]}"
    return parts[0]


def _imports(path: pathlib.Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, imported names) of every import in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, tuple(a.name for a in node.names)))
    return out


SOURCES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_room_exists_with_an_init():
    for room in ROOMS:
        assert (ROOT / "ops" / room / "__init__.py").is_file(), room
    loose = sorted(p.name for p in (ROOT / "ops").glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"modules of ops/ outside a room: {loose}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layering(path):
    me = _module_name(path)
    mine = _layer(me)
    bad = []
    for line, module, names in _imports(path):
        if module.split(".")[0] not in PACKAGES:
            continue  # standard library or third party
        if module == "ops":  # `from ops import cli` and the like name rooms
            targets = [f"ops.{n}" for n in names]
        else:
            targets = [module]
        for target in targets:
            theirs = _layer(target)
            if theirs == mine:
                continue
            if theirs not in ALLOWED[mine]:
                bad.append(f"line {line}: {mine} imports {target}")
            elif theirs.startswith("ops.") and target != theirs:
                bad.append(f"line {line}: {target} is inside room {theirs}; import from "
                           f"{theirs} what its __init__ exports")
    assert not bad, f"{me}: " + "; ".join(bad)


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_exports_what_siblings_import(room):
    """Every name a sibling imports from a room is in that room's __all__ (or a submodule the
    __init__ imports), so a room's surface is its __init__."""
    pkg = importlib.import_module(f"ops.{room}")
    exported = set(getattr(pkg, "__all__", ()))
    for path in SOURCES:
        if _layer(_module_name(path)) == f"ops.{room}":
            continue
        for line, module, names in _imports(path):
            if module == f"ops.{room}":
                missing = [n for n in names if n not in exported]
                assert not missing, (f"{path.relative_to(ROOT)}:{line} imports {missing} from "
                                     f"ops.{room}, which does not export them")


def test_the_architecture_map_lists_every_module():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = text[text.index("## 10. Map of the code"):]
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", table, re.M))
    # every module but the packages' __init__ (ops/cli's holds the parser) and __main__
    present = {str(p.relative_to(ROOT)) for p in SOURCES
               if p.name not in ("__init__.py", "__main__.py")} | {"ops/cli/__init__.py"}
    assert sorted(present - listed) == [], "modules missing from docs/ARCHITECTURE.md §10"
    assert sorted(listed - present) == [], "docs/ARCHITECTURE.md §10 lists modules that are gone"
