"""A live run started the separate-hosts way (`diloco init`, `diloco syncer`, `diloco learner`),
observed while it trains: `status --json`, `inspect --json`, the Prometheus endpoints, and
`diloco dashboard` in a real headless Chromium through a learner's kill and restart."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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


@contextlib.contextmanager
def browser(tmp_path):
    """Debian's headless Chromium driven by Selenium through Debian's chromedriver; None where
    they are missing (a failure when the quick start runs the tests: it installs them)."""
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_bin):
        assert not os.environ.get("DILOCO_REQUIRE_BROWSER"), \
            "chromium and chromedriver are missing (apt-get install chromium chromium-driver)"
        yield None
        return
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
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


def dashboard_view(page, url: str) -> tuple[dict, int, set]:
    """(learner → state, points of L0's loss curve, event kinds) as the page shows them, or
    as its JSON says where no browser runs."""
    if page is not None:
        states, points, kinds = page.execute_script(_VIEW)
        return states, points, set(kinds)
    st = json.loads(urllib.request.urlopen(url + "api/state", timeout=5).read())
    return ({ln["id"]: ln["state"] for ln in st["learners"]}, len(st["loss"].get("L0", [])),
            {e["kind"] for e in st["events"]})


def check_dashboard(tmp_path, base: list[str], procs: list, learner_cmd) -> None:
    """The page shows both learners and a growing loss curve; L1 killed goes down, restarted
    comes back, and the timeline says so; a screenshot is written."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    dash = subprocess.Popen([sys.executable, "-m", "ops.cli", "dashboard", *base, "--port",
                             str(port), "--interval-s", "0.25"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _up(url, dash), 60, "the dashboard to answer")
        with browser(tmp_path) as page:
            if page is not None:
                page.get(url)
            states, points, _ = wait_for(
                lambda: (v := dashboard_view(page, url))[0] == {"L0": "live", "L1": "live"}
                and v[1] >= 2 and v, 30, "both learners live on the page")
            wait_for(lambda: dashboard_view(page, url)[1] >= points + 3, 30,
                     "the loss curve to grow")
            procs[2].kill()
            procs[2].wait()
            wait_for(lambda: dashboard_view(page, url)[0].get("L1") == "down", 30,
                     "the killed learner shown down")
            procs[2] = learner_cmd("L1")
            _, _, kinds = wait_for(lambda: (v := dashboard_view(page, url))[0].get("L1")
                                   == "live" and v, 60, "the restarted learner shown live")
            assert {"join", "down"} <= kinds, kinds
            assert kinds & {"back", "rejoin"}, kinds
            if page is not None:
                shot = tmp_path / "dashboard.png"
                assert page.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
                assert page.find_element("id", "error").is_displayed() is False
    finally:
        dash.terminate()
        try:
            dash.wait(10)
        except subprocess.TimeoutExpired:
            dash.kill()
            dash.wait()
        dash.stderr.close()


def _up(url: str, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"diloco dashboard exited: {proc.stderr.read()[-2000:]}")
    try:
        return urllib.request.urlopen(url + "api/state", timeout=2).status == 200
    except OSError:
        return False


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

        check_dashboard(tmp_path, base, procs, start_learner)

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
