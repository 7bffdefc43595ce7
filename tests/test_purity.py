"""The pure algorithm in pipeline/ does no I/O of its own: no broker clients, no environment,
no wall clock."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipeline"
SOURCES = sorted(PIPELINE.glob("*.py"))
MODULES = sorted(f"pipeline.{p.stem}" for p in SOURCES if p.stem != "__init__")
# Network/broker clients (and this project's I/O packages) that pipeline/ must never load.
FORBIDDEN = ("redis", "zmq", "hiredis", "broker", "workers", "ops")


def test_pipeline_has_modules():
    for name in ("config", "fragments", "merge", "outer", "policy", "syncer", "learner"):
        assert f"pipeline.{name}" in MODULES


def test_importing_pipeline_loads_no_io_clients():
    code = (
        "import importlib, json, sys\n"
        f"for m in {MODULES!r}:\n"
        "    importlib.import_module(m)\n"
        f"bad = sorted(k for k in sys.modules if k.split('.')[0] in {FORBIDDEN!r})\n"
        "print(json.dumps({'bad': bad, 'loaded': sorted(k for k in sys.modules"
        " if k.startswith('pipeline.'))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bad"] == []
    assert set(MODULES) <= set(out["loaded"])


PATTERNS = [
    (r"\bos\.environ\b", "os.environ"),
    (r"\bgetenv\s*\(", "getenv("),
    (r"\btime\.time\s*\(", "time.time("),
    (r"^\s*(import|from)\s+(redis|zmq|hiredis|socket)\b", "import of a network client"),
    (r"^\s*(import|from)\s+(broker|workers|ops)\b", "import of an I/O package"),
]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_sources_have_no_environment_clock_or_network(path):
    text = path.read_text()
    for pattern, what in PATTERNS:
        hits = [i + 1 for i, line in enumerate(text.splitlines())
                if re.search(pattern, line)]
        assert not hits, f"{path.name}: {what} on line(s) {hits}"
