"""A live run started the separate-hosts way (`diloco init`, `diloco syncer`, `diloco learner`),
observed while it trains: `status --json`, `inspect --json`, the Prometheus endpoints, and
`diloco dashboard` in a real headless Chromium through a learner's kill and restart."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from helpers_broker import end_processes
from test_e2e import TINY

from broker import registry
from broker.connection import connect
from broker.keys import RunKeys
from ops.cluster import secure_init
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


@contextlib.contextmanager
def browser(tmp_path):
    """Debian's headless Chromium driven by Selenium through Debian's chromedriver; None where
    they are missing (a failure when the quick start runs the tests: it installs them)."""
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_bin):
        assert not os.environ.get("REQUIRE_CHROMIUM"), \
            "chromium and chromedriver are missing (apt-get install chromium chromium-driver)"
        yield None
        return
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    opts.accept_insecure_certs = True  # the dashboard's certificate is the test's own CA's
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--window-size=1400,1100",
                f"--user-data-dir={tmp_path / 'chromium'}"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


_VIEW = """
const rows = Array.from(document.querySelectorAll('#learners tbody tr'));
const line = document.querySelector('#loss polyline[data-series="L0"]');
return [Object.fromEntries(rows.map(tr => [tr.dataset.learner, tr.dataset.state])),
        line ? Number(line.dataset.points) : 0,
        Array.from(document.querySelectorAll('#events tbody tr')).map(tr => tr.dataset.kind)];
"""


class Dashboard:
    """`diloco dashboard` over HTTPS with a bearer token (the run's own CA), started beside the
    run's processes so that its start overlaps theirs."""

    TOKEN = "a-bearer-token-of-the-live-run"

    def __init__(self, tmp_path, base: list[str]):
        secure_init(tmp_path / "tls", hosts=["127.0.0.1"])
        (tmp_path / "token").write_text(self.TOKEN + "\n")
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}/"
        self.tls = ssl.create_default_context(cafile=str(tmp_path / "tls" / "ca.crt"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "dashboard", *base, "--port", str(self.port),
             "--interval-s", "0.25", "--tls-cert", str(tmp_path / "tls" / "server.crt"),
             "--tls-key", str(tmp_path / "tls" / "server.key"),
             "--token-file", str(tmp_path / "token")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def get(self, path: str, token: str | None = None,
            host: str | None = None) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if host:
            headers["Host"] = host
        req = urllib.request.Request(self.url + path, headers=headers)
        try:
            with urllib.request.urlopen(req, context=self.tls, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"diloco dashboard exited: {self.proc.stderr.read()[-2000:]}")
        try:
            return self.get("")[0] == 200
        except OSError:
            return False

    def view(self, page) -> tuple[dict, int, set]:
        """(learner → state, points of L0's loss curve, event kinds) as the page shows them,
        or as its JSON says where no browser runs."""
        if page is not None:
            states, points, kinds = page.execute_script(_VIEW)
            return states, points, set(kinds)
        st = json.loads(self.get("api/state", self.TOKEN)[1])
        return ({ln["id"]: ln["state"] for ln in st["learners"]},
                len(st["loss"].get("L0", [])), {e["kind"] for e in st["events"]})

    def stop(self) -> None:
        end_processes({"dashboard": self.proc}, {"stderr": self.proc.stderr}, grace_s=10)


def check_dashboard(tmp_path, dash: Dashboard, procs: list, learner_cmd) -> None:
    """Its data needs the token; the page (opened with the token) shows both learners and a
    growing loss curve; L1 killed goes down, restarted comes back, and the timeline says so; a
    screenshot is written."""
    wait_for(dash.up, 60, "the dashboard to answer")
    assert dash.get("api/state")[0] == 401
    assert dash.get("api/state", "not-the-token-of-this-run")[0] == 401
    # a page whose name an attacker points at 127.0.0.1 is not answered (DNS rebinding)
    assert dash.get("api/state", dash.TOKEN, host="attacker.example")[0] == 400
    with pytest.raises(OSError):  # HTTPS only: a plain request is closed unanswered
        urllib.request.urlopen(f"http://127.0.0.1:{dash.port}/api/state", timeout=5)
    with browser(tmp_path) as page:
        if page is not None:
            page.get(f"{dash.url}#token={dash.TOKEN}")
        states, points, _ = wait_for(
            lambda: (v := dash.view(page))[0] == {"L0": "live", "L1": "live"} and v[1] >= 2
            and v, 30, "both learners live on the page")
        wait_for(lambda: dash.view(page)[1] >= points + 3, 30, "the loss curve to grow")
        procs[2].kill()
        procs[2].wait()
        wait_for(lambda: dash.view(page)[0].get("L1") == "down", 30,
                 "the killed learner shown down")
        procs[2] = learner_cmd("L1")
        _, _, kinds = wait_for(lambda: (v := dash.view(page))[0].get("L1") == "live" and v,
                               60, "the restarted learner shown live")
        assert {"join", "down"} <= kinds, kinds
        assert kinds & {"back", "rejoin"}, kinds
        if page is not None:
            assert "token" not in page.current_url  # taken out of the address bar
            shot = tmp_path / "dashboard.png"
            assert page.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
            assert page.find_element("id", "error").is_displayed() is False


def test_status_inspect_metrics_and_the_dashboard_during_a_run(tmp_path, redis_url):
    cfg = cfgmod.from_dict({**TINY, "learners": 2, "steps": 100_000,
                            "broker": {"heartbeat_s": 0.25, "heartbeat_ttl_s": 1.5}})
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

    def start_learner(name: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "learner", *base, "--id", name, "--pace-s", "0.03",
             "--metrics-port", str(ports[name])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    procs += [start_learner("L0"), start_learner("L1")]
    dash = Dashboard(tmp_path, base)
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

        check_dashboard(tmp_path, dash, procs, start_learner)

        registry.request_finish(r, keys)  # end training early: flush, final rounds, exit
        for p in procs:
            assert p.wait(120) == 0
        finals = registry.learner_final_reports(r, keys)
        assert len({json.dumps(v.hashes, sort_keys=True) for v in finals.values()}) == 1
    finally:
        dash.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
