"""A live run started the separate-hosts way (`diloco init`, `diloco syncer`, `diloco learner`),
observed while it trains: `status --json`, `inspect --json` and the Prometheus endpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from test_e2e import TINY

from broker import registry
from broker.connection import connect
from broker.keys import RunKeys
from ops.cluster.redis_server import free_port
from pipeline import config as cfgmod


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True,
                          text=True, timeout=120)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_status_inspect_and_metrics_during_a_run(tmp_path, redis_url):
    cfg = cfgmod.from_dict({**TINY, "learners": 2, "steps": 100_000,
                            "broker": {"heartbeat_s": 0.25}})
    (tmp_path / "c.toml").write_text(cfgmod.dumps_toml(cfg))
    init = cli("init", "--redis-url", redis_url, "--run", "live", "--config",
               str(tmp_path / "c.toml"))
    assert init.returncode == 0, init.stderr
    # a second init with a different configuration is refused, naming both hashes
    other = cli("init", "--redis-url", redis_url, "--run", "live", "--config",
                str(tmp_path / "c.toml"), "--set", "seed=7")
    assert other.returncode != 0 and "hash" in other.stderr
    ports = {"syncer": free_port(), "L0": free_port(), "L1": free_port()}
    base = ["--redis-url", redis_url, "--run", "live"]
    procs = [subprocess.Popen([sys.executable, "-m", "ops.cli", "syncer", *base,
                               "--metrics-port", str(ports["syncer"])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    for name in ("L0", "L1"):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "learner", *base, "--id", name, "--pace-s", "0.03",
             "--metrics-port", str(ports[name])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        r = connect(redis_url)
        keys = RunKeys("live")
        wait_for(lambda: r.xlen(keys.fragment(0).rounds) >= 3 and
                 r.xlen(keys.fragment(1).rounds) >= 3, 120, "three rounds per fragment")
        status = cli("status", *base, "--json")
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        assert st["live_learners"] == ["L0", "L1"]
        assert st["learners_expected"] == 2 and st["rounds"] >= 6
        assert all(f["version"] >= 3 for f in st["fragments"])
        assert all(isinstance(f["pending"], int) and isinstance(f["lag"], int)
                   for f in st["fragments"])
        assert set(st["learners"]) == {"L0", "L1"}
        assert all(rec["live"] and rec["step"] > 0 for rec in st["learners"].values())
        assert list(st["syncers"]) == ["syncer-0"]

        insp = cli("inspect", *base, "--json")
        assert insp.returncode == 0, insp.stderr
        ins = json.loads(insp.stdout)
        entries = [e for f in ins["fragments"] for e in f["entries"]]
        assert {e["learner"] for e in entries} == {"L0", "L1"}
        assert all(e["fragment"] == f["fragment"] for f in ins["fragments"] for e in f["entries"])

        learner = wait_for(lambda: (m := scrape(ports["L0"]))
                           .get("diloco_learner_pushes_acked_total", 0) > 0 and m, 30,
                           "learner metrics")
        assert learner["diloco_learner_pushes_attempted_total"] >= \
            learner["diloco_learner_pushes_acked_total"]
        syncer = scrape(ports["syncer"])
        assert syncer["diloco_syncer_merged_total"] > 0
        assert syncer["diloco_syncer_rounds_total"] >= 6
        assert syncer["diloco_syncer_lost_total"] == 0
        assert syncer['diloco_syncer_fragment_version{fragment="0"}'] >= 3

        registry.request_finish(r, keys)  # end training early: flush, final rounds, exit
        for p in procs:
            assert p.wait(120) == 0
        finals = registry.learner_final_reports(r, keys)
        assert len({json.dumps(v.hashes, sort_keys=True) for v in finals.values()}) == 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
