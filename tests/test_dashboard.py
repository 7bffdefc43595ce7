"""`diloco dashboard` beyond the live run of tests/test_live_ops.py: where it may listen, its
token over HTTPS, a finished run's curves from its folder, and hostile records in Redis."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from test_e2e import TINY
from test_live_ops import cli, wait_for

from broker import registry
from broker.connection import connect
from broker.keys import RunKeys
from ops.cluster import secure_init
from ops.cluster.redis_server import free_port
from ops.tools import dashboard, dashboard_web
from pipeline import config as cfgmod


@pytest.mark.parametrize("host,cert,token,ok", [
    ("127.0.0.1", None, None, True), ("localhost", None, None, True), ("::1", None, None, True),
    ("0.0.0.0", None, None, False), ("10.0.0.5", "c.pem", None, False),
    ("10.0.0.5", None, "t" * 20, False), ("10.0.0.5", "c.pem", "t" * 20, True)])
def test_beyond_loopback_only_https_with_a_token(host, cert, token, ok):
    why = dashboard_web.check_bind(host, certfile=cert, keyfile=cert and "k.pem", token=token)
    assert (why is None) == ok
    if not ok:
        assert "HTTPS" in why and "--token-file" in why or "--tls-cert" in why


def _stored_run(tmp_path, redis_url: str) -> list[str]:
    cfg = cfgmod.from_dict({**TINY, "learners": 2})
    (tmp_path / "c.toml").write_text(cfgmod.dumps_toml(cfg))
    base = ["--redis-url", redis_url, "--run", "dash"]
    assert cli("init", *base, "--config", str(tmp_path / "c.toml")).returncode == 0
    return base


def test_hostile_records_are_bounded_and_a_run_folder_gives_the_curves(tmp_path, redis_url):
    _stored_run(tmp_path, redis_url)
    r, keys = connect(redis_url), RunKeys("dash")
    # what a learner credential may write: the events stream (and its own heartbeat)
    registry.event(r, keys, "<img src=x onerror=alert(1)>" + "k" * 5000, learner="L0",
                   blob="\x1b[31m" + "x" * 100_000)
    r.xadd(keys.events, {"kind": "join", "t": "nan", "learner": "L1"})
    r.xadd(keys.events, {b"\xff\xfe": b"\x00" * 10})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"kind": "eval", "t": 1.0, "tokens": 100, "eval_loss": 5.0},
             {"kind": "eval", "t": 2.0, "tokens": 200, "eval_loss": float("nan")},
             {"kind": "progress", "t": 2.0, "learners": {"L0": {"step": 3, "loss": 4.5}}},
             {"kind": "eval", "t": 3.0, "tokens": 300, "eval_loss": 4.0}]
    text = "\n".join(json.dumps(x) for x in lines) + "\nnot json\n" + '{"kind": "eval"'
    (run_dir / "metrics.jsonl").write_text(text)  # the last line is still being written
    board = dashboard.Board(redis_url, "dash", run_dir)
    board.poll()
    st = json.loads(json.dumps(board.state(), allow_nan=False))
    assert st["error"] is None
    assert [p[1:] for p in st["eval"]] == [[100, 5.0], [300, 4.0]]
    assert st["loss"] == {"L0": [[2.0, 3, 4.5]]}
    assert len(st["events"]) == 3
    for e in st["events"]:
        assert len(e["kind"]) <= dashboard.TEXT_MAX + 1
        assert all(len(v) <= dashboard.TEXT_MAX + 1 and v.isprintable()
                   for v in e["detail"].values())
    # the rest of the half-written line arrives: read once, whole
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(', "t": 4.0, "tokens": 400, "eval_loss": 3.5}\n')
    board.poll()
    assert [list(p[1:]) for p in board.state()["eval"]] == [[100, 5.0], [300, 4.0], [400, 3.5]]


def test_over_https_the_data_needs_the_token(tmp_path, redis_url):
    base = _stored_run(tmp_path, redis_url)
    secure_init(tmp_path / "tls", hosts=["127.0.0.1"])
    (tmp_path / "token").write_text("s3cret-token-of-the-dashboard\n")
    refused = cli("dashboard", *base, "--host", "0.0.0.0")
    assert refused.returncode == 2 and "HTTPS" in refused.stderr
    short = tmp_path / "short"
    short.write_text("abc\n")
    assert "shorter than 16" in cli("dashboard", *base, "--token-file", str(short)).stderr
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", "dashboard", *base, "--port", str(port),
         "--tls-cert", str(tmp_path / "tls/server.crt"), "--tls-key",
         str(tmp_path / "tls/server.key"), "--token-file", str(tmp_path / "token")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tls = ssl.create_default_context(cafile=str(tmp_path / "tls/ca.crt"))
    url = f"https://127.0.0.1:{port}/"

    def get(path: str, token: str | None = None):
        req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"}
                                     if token else {})
        try:
            with urllib.request.urlopen(req, context=tls, timeout=5) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers, e.read()

    try:
        def page_up():
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read()[-2000:])
            try:
                return get("")[0] == 200
            except OSError:
                return False

        wait_for(page_up, 60, "the dashboard over HTTPS")
        status, headers, body = get("")
        assert b"dashboard.js" in body and "script-src 'self'" in headers["Content-Security-Policy"]
        assert get("dashboard.js")[0] == 200
        assert get("api/state")[0] == 401
        assert get("api/state", "wrong-token-wrong-token")[0] == 401
        status, _, body = get("api/state", "s3cret-token-of-the-dashboard")
        assert status == 200 and json.loads(body)["run"] == "dash"
        with pytest.raises(OSError):  # not plain HTTP: the connection is closed unanswered
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=5)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()

