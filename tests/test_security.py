"""Secrets out of sight: the Redis URL's password never reaches a command line, an output file,
a log or a message; every command reads the URL from a file or the environment; metrics bind
to loopback unless told otherwise. Against a real password-protected redis-server and real
processes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers_broker import REPO

from broker.connection import URL_ENV, connect, has_secret, redact
from ops.cluster import RedisServer
from ops.cluster.supervisor import role_cmd
from workers.common import add_redis_args

SECRET = "Hunter2-s3cret-9f1c"  # unusual enough that a match is the password


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    (f"redis://default:{SECRET}@h:1/0", "redis://default:***@h:1/0"),
    (f"redis://:{SECRET}@h:1/0", "redis://***@h:1/0"),
    (f"redis://{SECRET}@h/0", "redis://***@h/0"),  # a lone userinfo may be a password
    (f"rediss://learner:{SECRET}@[::1]:6380/2?ssl_cert_reqs=required",
     "rediss://learner:***@[::1]:6380/2?ssl_cert_reqs=required"),
    (f"unix:///tmp/r.sock?db=0&password={SECRET}", "unix:///tmp/r.sock?db=0&password=***"),
    (f"redis://:a:{SECRET}@b@h:1/0", "redis://***@h:1/0"),
    (f"{SECRET}@nothing", "***"),
    ("notaurl", "notaurl"),
])
def test_redact(url, shown):
    assert redact(url) == shown
    assert SECRET not in redact(url)
    assert has_secret(url) == (shown != url)


def test_the_url_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    url_file = tmp_path / "url"
    url_file.write_text(f"redis://default:{SECRET}@h:1/0\n")

    def parse(*argv, env=None, required=True):
        if env is None:
            monkeypatch.delenv(URL_ENV, raising=False)
        else:
            monkeypatch.setenv(URL_ENV, env)
        ap = argparse.ArgumentParser()
        add_redis_args(ap, required=required)
        return ap.parse_args(list(argv)).redis_url

    assert parse("--redis-url", "redis://a:1/0") == "redis://a:1/0"
    assert parse("--redis-url-file", str(url_file)) == f"redis://default:{SECRET}@h:1/0"
    assert parse(env="redis://e:1/0") == "redis://e:1/0"
    assert parse("--redis-url", "redis://a:1/0", env="redis://e:1/0") == "redis://a:1/0"
    assert parse(required=False) is None
    with pytest.raises(SystemExit):
        parse()  # required and nowhere to be found
    with pytest.raises(SystemExit):
        parse("--redis-url", "redis://a:1/0", "--redis-url-file", str(url_file))
    with pytest.raises(SystemExit):
        parse("--redis-url-file", str(tmp_path / "missing"))


def test_role_commands_carry_no_password():
    cmd = role_cmd("learner", f"redis://default:{SECRET}@h:1/0", "r", "--id", "L0")
    assert not any(SECRET in a for a in cmd) and "--redis-url" not in cmd
    assert "--redis-url" in role_cmd("learner", "redis://h:1/0", "r")


class _Ps:
    """Every command line on the host, sampled until stopped (what `ps` shows anyone)."""

    def __init__(self):
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self):
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
                    except OSError:
                        continue
                    self.seen.add(raw.replace(b"\0", b" ").decode(errors="replace"))
            time.sleep(0.2)

    def stop(self) -> set[str]:
        self._stop.set()
        self._t.join()
        return self.seen


def test_a_run_against_a_password_protected_redis_shows_the_password_nowhere(tmp_path):
    from test_e2e import write_config

    with RedisServer(workdir=tmp_path / "redis", password=SECRET) as server:
        assert SECRET in server.url
        with pytest.raises(Exception, match="(?i)auth"):  # the password is required
            connect(server.url.replace(f"default:{SECRET}@", "")).ping()
        url_file = tmp_path / "redis-url"
        url_file.write_text(server.url + "\n")
        url_file.chmod(0o600)
        cfg_path = write_config(tmp_path, learners=2, steps=30)
        out_dir = tmp_path / "runs"
        ps = _Ps()
        try:
            run = subprocess.run(
                [sys.executable, "-m", "ops.cli", "run", "--config", cfg_path,
                 "--redis-url-file", str(url_file), "--run", "secret", "--out", str(out_dir),
                 "--json"], capture_output=True, text=True, timeout=300, cwd=REPO)
            env = {**os.environ, URL_ENV: server.url}
            status = subprocess.run([sys.executable, "-m", "ops.cli", "status", "--run",
                                     "secret", "--json"], capture_output=True, text=True,
                                    timeout=120, cwd=REPO, env=env)
            init = subprocess.run([sys.executable, "-m", "ops.cli", "run", "--init-only",
                                   "--config", cfg_path, "--run", "secret2"],
                                  capture_output=True, text=True, timeout=120, cwd=REPO,
                                  env=env)
        finally:
            cmdlines = ps.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["redis_url"] == redact(server.url)
    assert len({json.dumps(h, sort_keys=True) for h in summary["learner_hashes"].values()}) == 1
    assert status.returncode == 0, status.stderr[-2000:]
    assert init.returncode == 0 and "***" in init.stdout, init.stderr[-2000:]
    # the processes really ran (the sampler saw them), and none had the password on its line
    assert any("workers.learner" in c for c in cmdlines)
    assert not [c for c in cmdlines if SECRET in c]
    for text in (run.stdout, run.stderr, status.stdout, status.stderr, init.stdout,
                 init.stderr):
        assert SECRET not in text
    files = [p for p in out_dir.rglob("*") if p.is_file()]
    assert any(p.name == "summary.json" for p in files) and any(
        p.name.endswith(".log") for p in files)
    assert not [p for p in files if SECRET.encode() in p.read_bytes()]


def test_metrics_bind_to_loopback_by_default():
    import socket

    from workers.metrics import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve(port, "t", {"x": ("gauge", "a test value", lambda: 1.0)})
    addrs = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.split(":")[1], 16) == port:  # LISTEN
            addrs.add(local.split(":")[0])
    assert addrs == {"0100007F"}  # 127.0.0.1, not 0.0.0.0
