"""README's hardened separate-hosts recipe, run exactly as written: its bash block is extracted,
the placeholders substituted (host names, ports, the run's config file), and each host's
commands run in a copy of that host's bundle folder — from `diloco secure init` to a finished
run with two learners, then status, redis-cli and replay as the reader. The docs cannot drift
from what works."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers_broker import end_processes, tiny_config

from broker.connection import resolve_tls_files
from ops.cli.tools import redis_cli_command
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
                                     "learner", "anywhere", "anywhere"], steps
    assert steps[-1][1].startswith("diloco dashboard")
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
            elif cmd.startswith("diloco dashboard"):  # as the reader, over TLS and the ACL
                port = free_port()
                dash = shell(f"exec {cmd} --port {port}", tmp_path, "dashboard", wait=False)
                url = f"http://127.0.0.1:{port}/api/state"
                deadline = time.monotonic() + 60
                while True:
                    assert dash.poll() is None, (logs / "dashboard.log").read_text()[-3000:]
                    try:
                        st = json.loads(urllib.request.urlopen(url, timeout=2).read())
                        break
                    except OSError:
                        assert time.monotonic() < deadline, "the dashboard did not answer"
                        time.sleep(0.2)
                assert st["error"] is None and st["rounds"] >= 2, st
                assert {ln["id"]: ln["state"] for ln in st["learners"]} == {
                    "L0": "finished", "L1": "finished"}, st
                dash.terminate()
                dash.wait(10)
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
        check_recipes_redis_cli(tmp_path, "exp1")  # after the run: one example stops it
        learner_log = (logs / "L0.log").read_text()
        assert "CURVE handshake" not in learner_log and "Traceback" not in learner_log
    finally:
        end_processes(procs, handles)


def recipes_rc_lines() -> list[list[str]]:
    """The arguments of every ``$ rc …`` example of docs/RECIPES.md (its comment and any
    ``| grep`` dropped)."""
    out = []
    for line in (REPO / "docs" / "RECIPES.md").read_text().splitlines():
        if line.startswith("$ rc "):
            out.append(shlex.split(line[len("$ rc "):].split(" | ")[0], comments=True))
    return out


# RECIPES §2: which URL each example needs (the reader's, unless it writes or is an admin's)
ADMIN, WRITES = ("INFO", "CONFIG"), ("SET", "HDEL", "DEL")


def check_recipes_redis_cli(tmp_path: Path, run: str) -> None:
    """Every redis-cli example of RECIPES.md, as written but for the run name, against the
    hardened Redis through `diloco redis-cli`'s argv: the reader's URL, the operator's for a
    write and the admin's for INFO and CONFIG, as the page says. Each exits 0 with no error."""
    urls = {role: resolve_tls_files(path.read_text().splitlines()[0], path.parent)
            for role, path in (("reader", tmp_path / "hosts/reader/reader.url"),
                               ("operator", tmp_path / "hosts/operator/operator.url"),
                               ("admin", tmp_path / "redis-files/admin.url"))}
    examples = recipes_rc_lines()
    assert len(examples) >= 25
    for args in examples:
        args = [re.sub(r"\{ops2?([/}])", lambda m: "{" + run + m.group(1), a) for a in args]
        cmd = next(a.upper() for a in args if not a.startswith("-"))
        role = "admin" if cmd in ADMIN else "operator" if cmd in WRITES else "reader"
        argv, env = redis_cli_command(urls[role], args)
        done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, timeout=30)
        out = (done.stdout + done.stderr).decode(errors="replace")  # payloads are binary
        errors = [ln for ln in out.splitlines()
                  if re.match(r"(\(error\) )?(ERR|NOPERM|WRONGTYPE|NOAUTH|WRONGPASS)\b", ln)
                  or "Could not connect" in ln]
        assert done.returncode == 0 and not errors, (role, args, out[-2000:])
        assert "REDISCLI_AUTH" not in " ".join(argv)


@pytest.fixture(autouse=True)
def _needs_redis_server():
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")


def test_the_redis_guides_own_ca_settings_start_a_tls_only_redis_with_acl_users(tmp_path):
    """docs/REDIS.md §7's hand-written redis.conf lines and users.acl, as written (paths and
    the port substituted), added to a copy of ops/redis.conf: a TLS-only server that refuses
    plaintext and clients without a certificate, whose default user is off and whose admin
    gets in with the password the hash was made from."""
    import hashlib

    import redis

    from ops.cluster import TlsFiles

    text = (REPO / "docs" / "REDIS.md").read_text()
    section = text[text.index("## 7. Security"):text.index("## 8. Redis Cluster")]
    conf_block, acl_block = re.findall(r"```\n(.*?)```", section, re.S)[:2]
    tls = TlsFiles.generate(tmp_path / "tls")
    port, password = free_port(), "a-long-admin-password-for-the-test"
    paths = {"/etc/redis/tls/server.crt": tls.server_cert, "/etc/redis/tls/server.key":
             tls.server_key, "/etc/redis/tls/ca.crt": tls.ca,
             "/etc/redis/users.acl": tmp_path / "users.acl"}
    for doc_path, real in paths.items():
        assert doc_path in conf_block, doc_path
        conf_block = conf_block.replace(doc_path, str(real))
    base = (REPO / "ops" / "redis.conf").read_text().replace("dir /var/lib/redis",
                                                            f"dir {tmp_path}")
    base = base.replace("bind 0.0.0.0", "bind 127.0.0.1").replace("maxmemory 2gb",
                                                                  "maxmemory 64mb")
    (tmp_path / "redis.conf").write_text(base + "\n" + conf_block.replace(
        "tls-port 6380", f"tls-port {port}"))
    digest = hashlib.sha256(password.encode()).hexdigest()
    (tmp_path / "users.acl").write_text("\n".join(
        line for line in acl_block.replace("<sha256 of the admin password>", digest)
        .splitlines() if line and not line.startswith("#")) + "\n")
    log = open(tmp_path / "redis.log", "wb")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(["redis-server", str(tmp_path / "redis.conf")], cwd=tmp_path,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        tls_args = {"host": "127.0.0.1", "port": port, "ssl": True, "socket_timeout": 5,
                    "ssl_ca_certs": str(tls.ca)}
        admin = redis.Redis(**tls_args, username="admin", password=password,
                            ssl_certfile=str(tls.client_cert), ssl_keyfile=str(tls.client_key))
        deadline = time.monotonic() + 20
        while True:
            try:
                assert admin.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None, (tmp_path / "redis.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.2)
        assert admin.acl_whoami() == "admin"
        with pytest.raises(redis.ConnectionError):  # no certificate
            redis.Redis(**tls_args, username="admin", password=password).ping()
        with pytest.raises(redis.AuthenticationError):  # the default user is off
            redis.Redis(**tls_args, ssl_certfile=str(tls.client_cert),
                        ssl_keyfile=str(tls.client_key)).ping()
        assert admin.config_get("port") == {"port": "0"}  # no plaintext port
    finally:
        server.terminate()
        server.wait(20)
        log.close()
