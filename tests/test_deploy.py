"""The deployment files (ops/deploy) run as written: every container of the Kubernetes manifest
and the Slurm batch script are started on this machine with their own commands, arguments and
environment against a real Redis, so they cannot drift from the CLI.

What a single machine cannot give is emulated, and only that: a pod's volumes become folders
(Secrets and ConfigMaps as files, volume claims empty), ``$(VAR)`` references expand from the
pod's environment (``fieldRef``: the pod's name, 127.0.0.1 as its IP), mount paths map onto
those folders, and the fixed ports (Redis 6379, the PUB 5555, metrics 9101/9102) become free
ones on the loopback — several pods share this host. The image's entrypoint ``diloco`` runs as
``python -m ops.cli``. Building the image and applying the manifests to a cluster are not
tested here (no container engine or cluster on this machine).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from helpers_broker import REPO  # noqa: E402

from broker import registry, signing  # noqa: E402
from broker.connection import connect  # noqa: E402
from broker.keys import RunKeys  # noqa: E402
from ops.cluster import TlsFiles, free_port  # noqa: E402
from pipeline import config as cfgmod  # noqa: E402

DEPLOY = REPO / "ops" / "deploy"
DILOCO = [sys.executable, "-m", "ops.cli"]
TINY = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32},
        "data": {"max_bytes": 600_000, "eval_batches": 2},
        "inner": {"batch_size": 8, "warmup_steps": 5},
        "sync": {"fragments": 2, "sync_every": 10}}


def _docs() -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "diloco.yaml").read_text()) if d]


def _find(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


class Pod:
    """One pod of a workload, emulated on this machine (see the module docstring)."""

    def __init__(self, template: dict, name: str, root: Path, objects: dict, ports: dict):
        self.name, self.spec = name, template["spec"]
        [self.container] = self.spec["containers"]
        self.root = root / name
        self.ports = ports  # the manifest's port → a free local one
        self.folders: dict[str, Path] = {}
        for vol in self.spec.get("volumes", []):
            self.folders[vol["name"]] = self._volume(vol, objects)
        self.mounts = {}
        for m in self.container.get("volumeMounts", []):
            folder = self.folders.get(m["name"])
            if folder is None:  # a volume claim template: an empty persistent folder
                folder = self.root / m["name"]
                folder.mkdir(parents=True, exist_ok=True)
            self.mounts[m["mountPath"]] = folder
        self.env = {}
        for e in self.container.get("env", []):
            if "value" in e:
                self.env[e["name"]] = e["value"]
            elif "configMapKeyRef" in e["valueFrom"]:
                ref = e["valueFrom"]["configMapKeyRef"]
                self.env[e["name"]] = objects[("ConfigMap", ref["name"])][ref["key"]]
            else:
                path = e["valueFrom"]["fieldRef"]["fieldPath"]
                self.env[e["name"]] = {"metadata.name": name, "status.podIP": "127.0.0.1"}[path]

    def _volume(self, vol: dict, objects: dict) -> Path:
        folder = self.root / vol["name"]
        folder.mkdir(parents=True, exist_ok=True)
        kind, ref = (("Secret", vol["secret"]["secretName"]) if "secret" in vol
                     else ("ConfigMap", vol["configMap"]["name"]))
        data = objects[(kind, ref)]
        src = vol.get("secret") or vol.get("configMap")
        items = src.get("items") or [{"key": k, "path": k} for k in data]
        for it in items:
            (folder / it["path"]).write_bytes(
                data[it["key"]] if isinstance(data[it["key"]], bytes)
                else data[it["key"]].encode())
            os.chmod(folder / it["path"], 0o600)
        return folder

    def _expand(self, arg: str) -> str:
        arg = re.sub(r"\$\((\w+)\)", lambda m: self.env.get(m.group(1), m.group(0)), arg)
        for path in sorted(self.mounts, key=len, reverse=True):
            if arg == path or arg.startswith(path + "/"):
                return str(self.mounts[path]) + arg[len(path):]
        return arg

    def argv(self) -> list[str]:
        cmd = self.container.get("command") or DILOCO
        args = [self._expand(a) for a in self.container.get("args", [])]
        out = []
        for i, a in enumerate(args):  # fixed ports and all-interfaces binds, made local
            prev = args[i - 1] if i else ""
            if prev in ("--metrics-port", "--tls-port") and int(a) in self.ports:
                a = str(self.ports[int(a)])
            elif prev == "--metrics-host" and a == "0.0.0.0":
                a = "127.0.0.1"
            elif prev == "--bind":
                host_port = a.rsplit(":", 1)
                a = f"tcp://127.0.0.1:{self.ports.get(int(host_port[1]), 0)}"
            out.append(a)
        return [*cmd, *out]

    def port(self, container_port: int) -> int:
        return self.ports[container_port]

    def start(self, log: Path) -> subprocess.Popen:
        fh = open(log, "wb")
        try:
            return subprocess.Popen(self.argv(), cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                    env={**os.environ, **self.env})
        finally:
            fh.close()


def _probe(port: int, path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _secrets(tmp: Path, run: str, learners: list[str], redis_port: int) -> dict:
    """The Secrets and the ConfigMap as docs/DEPLOY.md §2.11 makes them, for this host."""
    tls = TlsFiles.generate(tmp / "tls")
    # the role URLs name the client TLS files where this machine has them (on a cluster:
    # the pod's mount, /etc/diloco/redis/…)
    q = f"ssl_ca_certs={tls.ca}&ssl_certfile={tls.client_cert}&ssl_keyfile={tls.client_key}"
    base = f"rediss://127.0.0.1:{redis_port}/0?{q}"
    subprocess.run([*DILOCO, "acl", "--run", run, "--url", base, "--out", str(tmp / "acl")],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([*DILOCO, "keys", "--out", str(tmp / "keys"), "--learners",
                    ",".join(learners)], cwd=REPO, check=True, capture_output=True)
    admin_pw = signing.new_key().hex()
    acl_file = (f"user default off\nuser admin on #{hashlib.sha256(admin_pw.encode()).hexdigest()}"
                f" ~* &* +@all\n" + (tmp / "acl" / "users.acl").read_text())
    keys = tmp / "keys"

    def files(folder: Path) -> dict[str, bytes]:
        return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file()}

    client = {"ca.crt": tls.ca.read_bytes(), "client.crt": tls.client_cert.read_bytes(),
              "client.key": tls.client_key.read_bytes(),
              **{f"{r}.url": (tmp / "acl" / f"{r}.url").read_bytes()
                 for r in ("learner", "syncer", "operator", "reader")}}
    return {
        ("Secret", "diloco-redis-tls"): {"server.crt": tls.server_cert.read_bytes(),
                                         "server.key": tls.server_key.read_bytes(),
                                         "ca.crt": tls.ca.read_bytes()},
        ("Secret", "diloco-redis-acl"): {"users.acl": acl_file},
        ("Secret", "diloco-redis-client"): client,
        ("Secret", "diloco-syncer-key"): {"syncer.key_secret":
                                          (keys / "syncer.key_secret").read_bytes()},
        ("Secret", "diloco-syncer-public"): {"syncer.key": (keys / "syncer.key").read_bytes()},
        ("Secret", "diloco-curve-allow"): files(keys / "allow"),
        ("Secret", "diloco-signers"): files(keys / "signers"),
        ("Secret", "diloco-learner-keys"): files(keys / "learners"),
        "admin_url": base.replace("rediss://", f"rediss://admin:{admin_pw}@"),
    }


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_the_kubernetes_manifest_runs_as_written(tmp_path):
    docs = _docs()
    cm = _find(docs, "ConfigMap", "diloco-run")
    run = cm["data"]["RUN"]
    (tmp_path / "shipped.toml").write_text(cm["data"]["run.toml"])
    assert cfgmod.load(tmp_path / "shipped.toml").learners == \
        _find(docs, "StatefulSet", "diloco-learner")["spec"]["replicas"]
    learner_set = _find(docs, "StatefulSet", "diloco-learner")
    learners = [f"diloco-learner-{i}" for i in range(2)]  # two of its replicas suffice here
    redis_port = free_port()
    objects = _secrets(tmp_path, run, learners, redis_port)
    tiny = cfgmod.from_dict({**TINY, "learners": len(learners), "steps": 40})
    objects[("ConfigMap", "diloco-run")] = {"RUN": run, "run.toml": cfgmod.dumps_toml(tiny)}
    procs: dict[str, subprocess.Popen] = {}
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        redis_pod = Pod(_find(docs, "StatefulSet", "redis")["spec"]["template"], "redis-0",
                        tmp_path, objects, {6379: redis_port})
        procs["redis"] = redis_pod.start(logs / "redis.log")
        deadline = time.monotonic() + 20
        while True:  # TLS, client certificates and the admin user from the aclfile
            try:
                connect(objects["admin_url"], retries=0).ping()
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert time.monotonic() < deadline, (logs / "redis.log").read_text()[-2000:]
                time.sleep(0.2)
        init = Pod(_find(docs, "Job", "diloco-init")["spec"]["template"], "diloco-init-x",
                   tmp_path, objects, {})
        done = subprocess.run(init.argv(), cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, **init.env}, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        syncers = {n: Pod(_find(docs, "StatefulSet", "diloco-syncer")["spec"]["template"], n,
                          tmp_path, objects, {5555: free_port(), 9101: free_port()})
                   for n in ("diloco-syncer-0", "diloco-syncer-1")}
        procs["diloco-syncer-0"] = syncers["diloco-syncer-0"].start(logs / "syncer-0.log")
        time.sleep(3)  # the first takes the leases; the second stands by
        procs["diloco-syncer-1"] = syncers["diloco-syncer-1"].start(logs / "syncer-1.log")
        pods = {n: Pod(learner_set["spec"]["template"], n, tmp_path, objects,
                       {9102: free_port()}) for n in learners}
        for n, pod in pods.items():
            procs[n] = pod.start(logs / f"{n}.log")
        seen: dict[tuple[str, str], int | None] = {}
        deadline = time.monotonic() + 240
        while any(procs[n].poll() is None for n in learners):
            assert time.monotonic() < deadline, "the learners did not finish"
            for name, port in ((learners[0], pods[learners[0]].port(9102)),
                               ("diloco-syncer-0", syncers["diloco-syncer-0"].port(9101)),
                               ("diloco-syncer-1", syncers["diloco-syncer-1"].port(9101))):
                for path in ("/healthz", "/readyz"):
                    code = _probe(port, path)
                    if code is not None:
                        seen[(name, path)] = code if seen.get((name, path)) != 200 else 200
            time.sleep(0.5)
        for n in learners:
            assert procs[n].returncode == 0, (logs / f"{n}.log").read_text()[-3000:]
        # every process answered its probes: live, and ready once it joined the run
        for name in (learners[0], "diloco-syncer-0", "diloco-syncer-1"):
            for path in ("/healthz", "/readyz"):
                assert seen.get((name, path)) == 200, (name, path, seen)
        assert procs["diloco-syncer-0"].wait(60) == 0, (logs / "syncer-0.log").read_text()[-3000:]
        r = connect(objects["admin_url"])
        reports = registry.learner_final_reports(r, RunKeys(run))
        assert sorted(reports) == learners
        assert reports[learners[0]].hashes == reports[learners[1]].hashes
        assert all(rep.steps == 40 for rep in reports.values())
        # the learners' checkpoints went to their volume claims
        assert (tmp_path / learners[0] / "state" / f"{learners[0]}.ckpt.npz").exists()
    finally:
        _stop(procs)


@pytest.mark.slow
def test_the_slurm_script_runs_learners_and_restarts_a_failed_one(tmp_path):
    """The batch script's learners, with a stand-in `srun` that starts its tasks on this machine
    (SLURM_PROCID per task); learner L1 is killed once mid-run and the script brings it back.
    Then a second L1 is started by hand (as if its node had been thought lost): the script's L1
    stands down (exit 3, a signed claim of a newer epoch) and is not restarted, and the new one
    finishes the learner's work."""
    from ops.cluster import SecureSetup

    run, learners = "slurm", ["L0", "L1"]
    sec = SecureSetup(tmp_path / "sec", run, learners).start()
    procs: dict[str, subprocess.Popen] = {}
    try:
        secrets = tmp_path / "secrets"  # the layout the script documents
        secrets.mkdir()
        shutil.copy(sec.url_file("learner"), secrets / "learner.url")
        shutil.copy(sec.keys / "syncer.key", secrets / "syncer.key")
        shutil.copytree(sec.keys / "learners", secrets / "learners")
        cfg = cfgmod.from_dict({**TINY, "learners": 2, "steps": 450})
        (tmp_path / "run.toml").write_text(cfgmod.dumps_toml(cfg))
        subprocess.run([*DILOCO, "init", "--config", str(tmp_path / "run.toml"), "--run", run,
                        "--redis-url-file", sec.url_file("operator")], cwd=REPO, check=True,
                       capture_output=True, timeout=120)
        with open(tmp_path / "syncer.log", "wb") as log:
            procs["syncer"] = subprocess.Popen(
                [*DILOCO, "syncer", "--run", run, *sec.syncer_args()], cwd=REPO, stdout=log,
                stderr=subprocess.STDOUT)
        shim = tmp_path / "bin"
        shim.mkdir()
        (shim / "srun").write_text(
            "#!/bin/bash\n# stand-in for srun: run the command once per task, here\n"
            "n=1\nwhile [ $# -gt 0 ]; do case $1 in --ntasks=*) n=${1#--ntasks=}; shift;;\n"
            "  --*) shift;; *) break;; esac; done\n"
            "pids=()\nfor ((i = 0; i < n; i++)); do SLURM_PROCID=$i \"$@\" & pids+=($!); done\n"
            "rc=0\nfor p in \"${pids[@]}\"; do wait $p || rc=$?; done\nexit $rc\n")
        (shim / "srun").chmod(0o755)
        (shim / "diloco").write_text(f"#!/bin/bash\nexec {sys.executable} -m ops.cli \"$@\"\n")
        (shim / "diloco").chmod(0o755)
        env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "SLURM_NTASKS": "2",
               "DILOCO_RUN": run, "DILOCO_SECRETS": str(secrets),
               "DILOCO_STATE_ROOT": str(tmp_path / "state"), "PYTHONPATH": str(REPO),
               "DILOCO_LEARNER_ARGS": "--pace-s 0.05"}  # long enough to kill one mid-run
        with open(tmp_path / "job.log", "wb") as log:
            procs["job"] = subprocess.Popen(
                ["bash", str(DEPLOY / "slurm" / "diloco-learners.sbatch")], cwd=REPO, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        admin = connect(sec.admin_url)
        keys = RunKeys(run)
        deadline = time.monotonic() + 120
        killed = False
        while not killed:  # kill L1 once it has made progress
            assert time.monotonic() < deadline and procs["job"].poll() is None, \
                (tmp_path / "job.log").read_text()[-3000:]
            hb = registry.learner_records(admin, keys).get("L1")
            if hb is not None and hb.step >= 20 and hb.pid:
                os.kill(hb.pid, signal.SIGKILL)
                killed, killed_pid = True, hb.pid
            time.sleep(0.2)
        restarted = None
        while restarted is None:  # the restarted L1 trains
            assert time.monotonic() < deadline + 120 and procs["job"].poll() is None, \
                (tmp_path / "job.log").read_text()[-3000:]
            hb = registry.learner_records(admin, keys).get("L1")
            if hb is not None and hb.pid and hb.pid != killed_pid and hb.step >= 40:
                restarted = hb.pid
            time.sleep(0.2)
        with open(tmp_path / "second.log", "wb") as log:
            procs["second"] = subprocess.Popen(
                [*DILOCO, "learner", "--run", run, "--id", "L1",
                 "--redis-url-file", str(secrets / "learner.url"),
                 "--state-dir", str(tmp_path / "state" / "L1"),
                 "--curve-secret", str(secrets / "learners" / "L1.key_secret"),
                 "--curve-server-key", str(secrets / "syncer.key"),
                 "--sign-key", str(secrets / "learners" / "L1.sign"), "--pace-s", "0.05"],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        assert procs["job"].wait(240) == 3, (tmp_path / "job.log").read_text()[-3000:]
        assert procs["second"].wait(240) == 0, (tmp_path / "second.log").read_text()[-3000:]
        job_log = (tmp_path / "job.log").read_text()
        assert "learner L1: exit" in job_log
        assert "learner L1: another process joined the run as this learner (exit 3): " \
            "not restarting" in job_log, job_log[-3000:]
        reports = registry.learner_final_reports(admin, keys)
        assert sorted(reports) == learners and reports["L0"].hashes == reports["L1"].hashes
        resumes = [f for _, f in admin.xrange(keys.events) if f[b"kind"] == b"resume"
                   and f[b"learner"] == b"L1"]
        assert resumes and resumes[0][b"source"] == b"checkpoint", resumes
        assert procs["syncer"].wait(60) == 0, (tmp_path / "syncer.log").read_text()[-3000:]
    finally:
        if procs.get("job") is not None and procs["job"].poll() is None:
            os.killpg(procs["job"].pid, signal.SIGKILL)
        _stop(procs)
        sec.stop()


def test_the_dockerfile_installs_the_package_and_runs_diloco():
    """The image installs the package as tests/test_installed.py does (a plain, non-editable
    pip install of the source: everything pyproject.toml packages, nothing from a checkout at
    run time) and runs the console script that test runs."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
    data = {f.split("/")[0] for files in project["tool"]["setuptools"]["data-files"].values()
            for f in files}
    (script,) = project["project"]["scripts"]
    assert script == "diloco"  # the script tests/test_installed.py runs every command with
    for name, install in (("Dockerfile", "pip install --no-cache-dir ."),
                          ("Dockerfile.gpu", "pip install --no-cache-dir '.[cuda12]'")):
        text = (DEPLOY / name).read_text()
        copied = [src for line in re.findall(r"^COPY (.+)$", text, re.M)
                  for src in line.split()[:-1]]
        for pkg in [p.rstrip("*") for p in packages] + sorted(data) + ["pyproject.toml",
                                                                        "README.md"]:
            assert pkg in copied, (name, pkg)
        assert f'ENTRYPOINT ["{script}"]' in text and install in text, name
        assert "pip install -e" not in text and "PYTHONPATH" not in text, name
        assert re.search(r"^USER \d+", text, re.M), f"{name} must not run as root"
    assert "cuda12" in project["project"]["optional-dependencies"]
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER \d+", text, re.M), "the image must not run as root"
    # every subcommand the manifest and the batch script call exists in the CLI
    docs = _docs()
    used = {c["args"][0] for d in docs if d["kind"] in ("StatefulSet", "Job")
            for c in d["spec"]["template"]["spec"]["containers"] if c.get("args")
            and not c.get("command")}
    out = subprocess.run([*DILOCO, "--help"], cwd=REPO, capture_output=True, text=True).stdout
    for cmd in used | {"learner"}:
        assert re.search(rf"^\s+{cmd}\s", out, re.M), cmd


def test_probes_answer_from_the_process_state():
    from workers.metrics import serve, stalled

    tick = {"t": time.monotonic(), "ready": False}
    port = free_port()
    serve(port, "diloco_test", {"x": ("gauge", "a value", lambda: 1.0)},
          live=stalled(lambda: tick["t"], lambda: 5.0, "the loop"),
          ready=lambda: None if tick["ready"] else "joining the run")
    assert _probe(port, "/healthz") == 200 and _probe(port, "/readyz") == 503
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        assert b"diloco_test_x 1.0" in resp.read()
    tick.update(t=time.monotonic() - 10, ready=True)
    assert _probe(port, "/readyz") == 200
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
        raise AssertionError("a stalled loop must fail its liveness probe")
    except urllib.error.HTTPError as e:
        assert e.code == 503 and b"the loop made no progress for 10 s" in e.read()
    assert _probe(port, "/nothing") == 404
