"""What users get: the package built (an sdist, then a wheel from that sdist), installed into a
fresh virtual environment outside the checkout, and every `diloco` command run from there in
its smallest form — from a folder that is not the checkout, with no ``PYTHONPATH``.

No network: the wheel is built without build isolation (setuptools and wheel come with the
test extras) and installed without its dependencies; the new environment reaches the
dependencies through a path entry to this environment's site-packages, which adds that folder
alone (its ``.pth`` files, the checkout's editable finder among them, are not run). Every
project module imported there must come from the new environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers_broker import end_processes

from ops.cluster.redis_server import free_port
from pipeline import config as cfgmod
from tests.test_e2e import TINY

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "workers", "broker", "ops")
_SKIP = shutil.ignore_patterns(".git", ".venv", "runs", "build", "dist", "*.egg-info",
                               "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
                               "out")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300
         ) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the new environment's bin folder, its environment variables, a work folder)."""
    base = tmp_path_factory.mktemp("installed")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=_SKIP)
    clean = {k: v for k, v in os.environ.items()
             if k != "PYTHONPATH" and not k.startswith("DILOCO_")}
    # the sdist, then the wheel built from the unpacked sdist: both must carry everything
    dist = base / "dist"
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
          "print(b.build_sdist(sys.argv[1]))", str(dist)], src, clean)
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(base / "unpacked", **extra)
    (unpacked,) = (base / "unpacked").iterdir()
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(dist), str(unpacked)], base, clean)
    (wheel,) = dist.glob("*.whl")
    env_dir = base / "env"
    _run([sys.executable, "-m", "venv", str(env_dir)], base, clean)
    py = env_dir / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], base,
         clean)
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     base, clean).stdout.strip())
    paths = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "_diloco_test_deps.pth").write_text("".join(f"{p}\n" for p in paths))
    work = base / "work"
    work.mkdir()
    env = {**clean, "PATH": f"{env_dir / 'bin'}:{clean.get('PATH', '')}"}
    return env_dir / "bin", env, work, site


@pytest.mark.timeout(900)  # the fixture builds the sdist, the wheel and the environment
def test_every_project_module_resolves_to_the_installed_package(installed):
    bin_dir, env, work, site = installed
    code = ("import importlib, json, pkgutil, sys\n"
            f"names = {list(PACKAGES)!r}\n"
            "out = {}\n"
            "for top in names:\n"
            "    pkg = importlib.import_module(top)\n"
            "    out[top] = pkg.__file__\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, top + '.'):\n"
            "        if not m.name.endswith('.__main__'):  # runs the command line\n"
            "            out[m.name] = importlib.import_module(m.name).__file__\n"
            "print(json.dumps(out))\n")
    done = _run([str(bin_dir / "python"), "-c", code], work, env)
    files = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(files) > 40, sorted(files)
    outside = {k: v for k, v in files.items() if not Path(v).is_relative_to(site)}
    assert not outside, outside
    # what the commands read at run time came with the package
    for name in ("workers/kernels.c", "workers/fused.cc", "ops/redis.conf", "ops/quickstart.sh",
                 "ops/deploy/Dockerfile", "ops/deploy/Dockerfile.gpu",
                 "ops/deploy/k8s/diloco.yaml", "ops/deploy/slurm/diloco-learners.sbatch"):
        assert (site / name).is_file(), name
    # the examples (`diloco bench overlap-library` runs them) where that command finds them
    code = "from ops.bench.overlap import EXAMPLES; print(EXAMPLES)"
    examples = Path(_run([str(bin_dir / "python"), "-c", code], work, env).stdout.strip())
    assert examples == bin_dir.parent / "share" / "decoupled-diloco" / "examples"
    assert (examples / "own_loop.py").is_file() and (examples / "user_model.py").is_file()


@pytest.mark.slow  # 70-80 s: the full tier (CI) runs every command from the installation
@pytest.mark.timeout(1200)  # the package built and installed, then every command
def test_every_command_runs_from_the_installation(installed, redis_url):
    bin_dir, env, work, _ = installed
    diloco = str(bin_dir / "diloco")
    cfg = cfgmod.from_dict({**TINY, "learners": 2, "steps": 20})
    (work / "run.toml").write_text(cfgmod.dumps_toml(cfg))

    # the read-only tools never compile: a compiler that records being run, an empty cache
    marker = work / "compiler-ran"
    wrapper = work / "no-compiler"
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" >> {marker}\nexit 1\n")
    wrapper.chmod(0o755)
    tools_env = {**env, "CC": str(wrapper), "CXX": str(wrapper),
                 "DILOCO_KERNEL_CACHE": str(work / "empty-kernel-cache")}

    def cli(*args: str, timeout: int = 300, tools: bool = False) -> dict:
        done = _run([diloco, *args], work, tools_env if tools else env, timeout)
        return json.loads(done.stdout.strip().splitlines()[-1])

    built = cli("build-kernels", "--json")
    assert set(built) == {"merge", "fused"}
    # the main job, both engines (the embedded redis-server for the distributed one)
    s = cli("run", "--config", "run.toml", "--out", "runs", "--run", "main", "--json")
    assert s["learners"] == 2 and s["final_eval_loss"] < s["initial_eval_loss"]
    done = _run([diloco, "run", "--engine", "inprocess", "--config", "run.toml", "--out", "runs",
                 "--run", "inproc", "--json", "--wandb"], work,
                {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    s = json.loads(done.stdout.strip().splitlines()[-1])
    assert s["final_eval_loss"] < s["initial_eval_loss"]
    assert list((work / "runs" / "inproc" / "wandb").glob("offline-run-*/run-*.wandb"))
    # the roles by hand, on the test's Redis, then the tools on that run
    url = ["--redis-url", redis_url]
    _run([diloco, "init", "--config", "run.toml", "--run", "hand", *url], work, env)
    logs = {}
    procs = {}
    try:
        for name, args in (("syncer", ["syncer", "--run", "hand", *url]),
                           *((f"L{i}", ["learner", "--run", "hand", "--id", f"L{i}",
                                        "--state-dir", f"state/L{i}", *url])
                             for i in range(2))):
            logs[name] = open(work / f"{name}.log", "wb")  # noqa: SIM115 (closed below)
            procs[name] = subprocess.Popen([diloco, *args], cwd=work, env=env,
                                           stdout=logs[name], stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        for name in ("L0", "L1"):
            assert procs[name].wait(max(1.0, deadline - time.monotonic())) == 0, \
                (work / f"{name}.log").read_text()[-3000:]
        status = cli("status", "--run", "hand", *url, "--json", tools=True)
        assert status["rounds"] >= 1 and sorted(status["learners"]) == ["L0", "L1"], status
    finally:
        end_processes(procs, logs, grace_s=20)
    # the tools on the finished run, two at a time (each is a process start; they only read
    # the run, or write their own files)
    empty = work / "replay-kernel-cache"  # replay merges with a library already built, else
    # numpy (the same bits): it builds none
    export = ("export", "--run", "hand", *url, "--json")
    first = {
        "inspect": lambda: cli("inspect", "--run", "hand", *url, "--json", tools=True),
        "redis-cli": lambda: _run([diloco, "redis-cli", *url, "--", "XLEN",
                                   "ddl:{hand/f0001}:frags"], work, tools_env).stdout,
        "replay": lambda: json.loads(_run(
            [diloco, "replay", "--run", "hand", *url, "--json"], work,
            {**env, "DILOCO_KERNEL_CACHE": str(empty)}).stdout.strip().splitlines()[-1]),
        "npz": lambda: cli(*export, "--out", "hand", tools=True),
        "safetensors": lambda: cli(*export, "--out", "hand", "--format", "safetensors",
                                   tools=True),
        "orbax": lambda: cli(*export, "--out", "hand", "--format", "orbax", tools=True),
        "plot": lambda: cli("plot", str(work / "runs" / "main"), "--out", "plots", "--json",
                            tools=True),
        "tensorboard": lambda: cli("tensorboard", str(work / "runs" / "main"), "--out", "tb",
                                   "--json", tools=True),
        "dashboard": lambda: _check_dashboard(diloco, work, tools_env, url),
        "chaos": lambda: cli("chaos", "--learners", "2", "--duration", "10", "--kill-every-s",
                             "0", "--pause-every-s", "0", "--config", "run.toml", "--out",
                             "chaos", "--json", "--quiet"),
        "goodput": lambda: cli("goodput", "--json"),
        # the security tools (their outputs only: applying ACLs needs a hardened Redis)
        "keys": lambda: _run([diloco, "keys", "--out", "keys", "--learners", "L0,L1"], work,
                             env),
        "acl": lambda: _run([diloco, "acl", "--run", "hand", "--url",
                             "redis://127.0.0.1:6379/0", "--out", "acl"], work, env),
        "bench": lambda: _run([diloco, "bench", "step-matrix", "--reps", "1", "--settings",
                               "alone", "--variants", "shipped", "--bare-steps", "2", "--out",
                               "bench"], work, env).stdout,
    }
    got = _two_at_a_time(first)
    assert got["inspect"]
    assert int(got["redis-cli"].strip()) >= 1, got["redis-cli"]
    assert got["replay"]["ok"] and got["replay"]["rounds_checked"] >= 1, got["replay"]
    assert not empty.exists() or not any(empty.iterdir())
    assert Path(work / "hand.npz").is_file() and got["npz"]["versions"]
    assert got["safetensors"]["out"].endswith("hand.safetensors")
    assert got["orbax"]["out"].endswith("hand.orbax") and (work / "hand.orbax/params").is_dir()
    assert got["plot"]
    assert got["tensorboard"]["records"] > 0 and any((work / "tb").iterdir())
    assert got["chaos"]["lost"] == 0, got["chaos"]
    assert got["goodput"]
    assert (work / "keys" / "syncer.key").is_file()
    assert (work / "acl" / "learner.url").is_file()
    assert "| alone |" in got["bench"]
    second = _two_at_a_time({
        "npz": lambda: cli("eval", "hand.npz", "--json"),
        "safetensors": lambda: cli("eval", "hand.safetensors", "--json"),
        "sample": lambda: cli("sample", "hand.npz", "--prompt", "def ", "--bytes", "8",
                              "--json")})
    assert second["npz"]["eval_loss"] > 0
    assert second["safetensors"]["eval_loss"] == second["npz"]["eval_loss"]
    assert second["sample"]
    assert not marker.exists(), marker.read_text()
    assert not (work / "empty-kernel-cache").exists() or not any(
        (work / "empty-kernel-cache").iterdir())


def _two_at_a_time(jobs: dict) -> dict:
    """Each job's result, two running at once (a job's failure is raised here)."""
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def _check_dashboard(diloco: str, work: Path, env: dict, url: list[str]) -> None:
    """The dashboard serves its page and script from the installed package, and the finished
    run's learners."""
    port = free_port()
    proc = subprocess.Popen([diloco, "dashboard", "--run", "hand", *url, "--port", str(port)],
                            cwd=work, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "diloco dashboard exited"
            try:
                page = urllib.request.urlopen(base, timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the dashboard did not answer"
                time.sleep(0.2)
        assert b"dashboard.js" in page
        assert b"api/state" in urllib.request.urlopen(base + "dashboard.js", timeout=5).read()
        st = json.loads(urllib.request.urlopen(base + "api/state", timeout=5).read())
        assert {ln["id"]: ln["state"] for ln in st["learners"]} == {"L0": "finished",
                                                                  "L1": "finished"}, st
    finally:
        end_processes({"dashboard": proc}, {}, grace_s=10)
