"""README's hardened separate-hosts recipe, run exactly as written: its bash block is extracted,
the placeholders substituted (host names, ports, the run's config file), and each host's
commands run in a copy of that host's bundle folder — from `diloco secure init` to a finished
run with two learners, then status, redis-cli and replay as the reader. The docs cannot drift
from what works."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_broker import end_processes, tiny_config

from ops.cluster import free_port
from pipeline import config as cfgmod

REPO = Path(__file__).resolve().parent.parent
DILOCO = str(Path(sys.executable).with_name("diloco"))


def recipe() -> list[tuple[str, str]]:
    """(where, command) of README's hardened recipe: where is "operator", "redis" (the
    Redis host's command, given in a comment), "syncer", "learner" or "anywhere"."""
    text = (REPO / "README.md").read_text()
    sec = text[text.index("## Learners and syncers on separate hosts"):]
    start = sec.index("```bash\n") + len("```bash\n")
    block = sec[start:sec.index("```", start)].replace("\\\n", " ")
    where, out = "operator", []
    for line in block.splitlines():
        line = line.strip()
        if line.startswith("# on the Redis host"):
            out.append(("redis", line.split(": ", 1)[1]))
        elif line.startswith("# the syncer's host"):
            where = "syncer"
        elif line.startswith("# each learner's host"):
            where = "learner"
        elif line.startswith("# anywhere"):
            where = "anywhere"
        elif line and not line.startswith("#"):
            out.append((where, re.sub(r"\s+", " ", line)))
    return out


def test_the_recipe_is_what_the_readme_shows():
    steps = recipe()
    assert [w for w, _ in steps] == ["operator", "redis", *["operator"] * 5, "syncer",
                                     "learner", "anywhere"], steps
    assert steps[0][1].startswith("diloco secure init") and "bundle" in steps[5][1]


@pytest.mark.slow  # ~26 s: the full tier (CI); the parse of the recipe stays in the default
def test_the_readme_hardened_recipe_runs_as_written(tmp_path):
    redis_port, pub_port = free_port(), free_port()
    cfg = tiny_config(learners=2, steps=40, sync={"codec_up": "int4", "codec_down": "int4",
                                                  "down_delta": True})
    (tmp_path / "my.toml").write_text(cfgmod.dumps_toml(cfg))
    subs = {r"(?<![-\w])redis-host(?![-\w])": "127.0.0.1",
            r"(?<![-\w])syncer-host(?![-\w])": "127.0.0.1",
            ":6380/": f":{redis_port}/", "0.0.0.0:5555": f"127.0.0.1:{pub_port}"}
    env = {**os.environ, "PATH": f"{Path(DILOCO).parent}:{os.environ['PATH']}"}
    env.pop("DILOCO_REDIS_URL", None)
    procs: dict[str, subprocess.Popen] = {}
    handles = {}  # the processes' log files, closed at the end
    logs = tmp_path / "logs"
    logs.mkdir()

    def shell(cmd: str, cwd: Path, name: str, wait: bool = True) -> subprocess.Popen | str:
        for k, v in subs.items():
            cmd = re.sub(k, v, cmd)
        if cmd.startswith("diloco secure init"):
            cmd += f" --port {redis_port}"  # the README takes the default port
        log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 (closed below)
        handles[name] = log
        p = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
        procs[name] = p
        if not wait:
            return p
        code = p.wait(300)
        out = (logs / f"{name}.log").read_text()
        assert code == 0, f"{cmd}\n{out[-3000:]}"
        return out

    machines = tmp_path / "machines"  # each host's own folder: a copy of its bundle
    try:
        for i, (where, cmd) in enumerate(recipe()):
            if where == "operator":
                shell(cmd, tmp_path, f"{i}-operator")
            elif where == "redis":
                host = machines / "redis"
                shutil.copytree(tmp_path / "redis-files", host)
                shell(cmd.replace("cd redis-files && ", ""), host, "redis", wait=False)
                deadline = time.monotonic() + 15
                while subprocess.run(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{redis_port}"],
                                     capture_output=True).returncode != 0:
                    assert time.monotonic() < deadline, "redis-server did not start"
                    time.sleep(0.1)
            elif where == "syncer":
                host = machines / "syncer"
                shutil.copytree(tmp_path / "hosts" / "syncer", host)
                syncer = shell(cmd, host, "syncer", wait=False)
            elif where == "learner":
                learners = []
                for lid in ("L0", "L1"):  # the README shows L0; every learner alike
                    host = machines / lid
                    shutil.copytree(tmp_path / "hosts" / lid, host)
                    learners.append(shell(cmd.replace("L0", lid), host, lid, wait=False))
                for lid, p in zip(("L0", "L1"), learners, strict=True):
                    assert p.wait(240) == 0, (logs / f"{lid}.log").read_text()[-3000:]
            else:  # anywhere: status once (not --watch), then what an operator looks at
                status = json.loads(shell(cmd.replace("--watch", "--json"), tmp_path,
                                          "status").strip().splitlines()[-1])
                assert sorted(status["learners"]) == ["L0", "L1"] and status["rounds"] >= 2
                reader = "--redis-url-file hosts/reader/reader.url --run exp1"
                rep = json.loads(shell(f"diloco replay {reader} --json", tmp_path,
                                       "replay").strip().splitlines()[-1])
                assert rep["ok"] and rep["rounds_checked"] >= 2, rep
                n = shell("diloco redis-cli --redis-url-file hosts/reader/reader.url -- "
                          "XLEN 'ddl:{exp1/f0001}:frags'", tmp_path, "redis-cli")
                assert int(n.strip()) >= 1, n
        assert syncer.wait(60) == 0, (logs / "syncer.log").read_text()[-3000:]
        learner_log = (logs / "L0.log").read_text()
        assert "CURVE handshake" not in learner_log and "Traceback" not in learner_log
    finally:
        end_processes(procs, handles)


@pytest.fixture(autouse=True)
def _needs_redis_server():
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
