"""`diloco bench accelerator`, the prepared check for a GPU/TPU host, at its CPU smoke size: the
device's matmul rates, the step in fp32 and bf16 against them, and two real two-learner runs
(syncing, and not syncing during the run) with a syncer and an embedded redis-server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~28 s: the full tier (CI)
@pytest.mark.timeout(600)
def test_the_accelerator_check_runs_at_its_cpu_size(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    done = subprocess.run([sys.executable, "-m", "ops.cli", "bench", "accelerator", "--tiny",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["device"]["platform"] == "cpu"
    assert all(v > 0 for v in out["matmul_flops"].values())
    for dtype in ("float32", "bfloat16"):
        step = out["step"][dtype]
        assert step["params"] > 10_000 and step["step_s"] > 0 and step["flops"] > 0
        assert 0 < step["efficiency"] < 2, step
        assert step["loss_after"] == step["loss_after"]  # finite, not NaN
    on, off = out["decoupled"]["syncing"], out["decoupled"]["not_syncing"]
    assert sorted(on["learners"]) == sorted(off["learners"]) == ["L0", "L1"]
    for name in ("L0", "L1"):  # syncing pushed during the run; not syncing only at its end
        assert on["learners"][name]["pushes_attempted"] > off["learners"][name][
            "pushes_attempted"] >= 1
        assert on["learners"][name]["steps"] == off["learners"][name]["steps"]
    assert set(out["decoupled"]["overlap"]) == {"L0", "L1"}
    assert all(v > 0 for v in out["decoupled"]["overlap"].values())
    assert all(b["sync_s_per_push"] >= 0 for b in out["decoupled"]["blocked"].values())
    assert "overlap (syncing ÷ not)" in done.stdout
