"""The lab: real network namespaces, veth links shaped with tc, the delaying forwarder, CPU
cgroup quotas, and real runs in it (decoupled under a partition, data parallel over gloo).

Needs root (CI runs as root); on a machine that cannot build a lab the tests say why and skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from test_chaos import TINY as CHAOS_TINY

from ops.chaos import Fault
from ops.lab import Lab, LabPlan, SiteSpec, check_capability, leftovers, run_lab
from pipeline import config as cfgmod
from pipeline.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
REASON = check_capability()
needs_lab = pytest.mark.skipif(REASON is not None, reason=str(REASON))

TINY = {**CHAOS_TINY, "learners": 2}

# A TCP client and server: 5 one-byte round trips, then N bytes one way; prints JSON.
PROBE = textwrap.dedent("""
    import json, socket, sys, time
    role, host, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "srv":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 5001)); s.listen(1); c, _ = s.accept()
        for _ in range(5):
            c.send(c.recv(1))
        got = 0
        while True:
            d = c.recv(1 << 20)
            if not d:
                break
            got += len(d)
        c.send(b"k"); print(json.dumps({"got": got}))
    else:
        for _ in range(100):
            try:
                c = socket.create_connection((host, 5001), timeout=1); break
            except OSError:
                time.sleep(0.05)
        c.settimeout(60)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(5):
            t = time.perf_counter(); c.send(b"x"); c.recv(1)
            rtts.append(time.perf_counter() - t)
        t = time.perf_counter(); c.sendall(b"\\0" * n); c.shutdown(socket.SHUT_WR); c.recv(1)
        print(json.dumps({"rtt_ms": 1000 * min(rtts),
                          "mbps": n * 8 / (time.perf_counter() - t) / 1e6}))
""")


def _probe(lab: Lab, site: int, n: int) -> dict:
    srv = subprocess.Popen(lab.wrap(lab.hub, [sys.executable, "-c", PROBE, "srv",
                                              "10.201.0.1", "0"]), stdout=subprocess.PIPE,
                           text=True)
    cli = subprocess.run(lab.wrap(lab.site(site), [sys.executable, "-c", PROBE, "cli",
                                                   "10.201.0.1", str(n)]),
                         capture_output=True, text=True, timeout=120)
    srv.communicate(timeout=30)
    assert cli.returncode == 0, cli.stderr
    return json.loads(cli.stdout)


@needs_lab
@pytest.mark.alone
def test_links_are_shaped_delayed_and_quotas_split_the_cpu():
    lab = Lab([SiteSpec(link_mbps=16, rtt_ms=40, cpu=2), SiteSpec(link_mbps=0, rtt_ms=0,
                                                                  cpu=1)], cpu_total=1.5)
    with lab:
        assert lab.quotas == pytest.approx([1.0, 0.5])
        slow = _probe(lab, 0, 4_000_000)
        fast = _probe(lab, 1, 40_000_000)
        counters = lab.counters()
        # the round trip of site 0 is its 40 ms (the forwarder delays each way by 20 ms),
        # site 1's is not delayed; site 0's rate is its 16 Mbit/s, site 1 is far faster
        assert 40 <= slow["rtt_ms"] < 60, slow
        assert fast["rtt_ms"] < 10, fast
        assert 10 < slow["mbps"] <= 16 * 1.05, slow
        assert fast["mbps"] > 3 * 16, fast
        # every frame is counted at wire size (offloads off): ≥ the payload, headers included
        assert counters["s0"]["rx_bytes"] >= 4_000_000
        assert counters["s0"]["rx_bytes"] / counters["s0"]["rx_packets"] < 1600
        # a busy loop in each site's cgroup gets that site's quota of CPU, not a sleep's
        spin = "import time\nt=time.time()\nwhile time.time()-t<3: pass\n" \
               "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_utime)"
        for _ in range(2):  # a second try: the VM's host can take a core for a second or two
            procs = [subprocess.Popen(lab.wrap(lab.site(i), [sys.executable, "-c", spin]),
                                      stdout=subprocess.PIPE, text=True) for i in range(2)]
            cpu = [float(p.communicate(timeout=30)[0]) for p in procs]
            if cpu[0] > 1.4 * cpu[1]:
                break
        if (os.cpu_count() or 1) >= 2:
            assert cpu[0] / 3 == pytest.approx(1.0, abs=0.2) or cpu[0] / 3 <= 1.05, cpu
        assert cpu[1] / 3 <= 0.5 * 1.15, cpu
        assert cpu[0] > 1.4 * cpu[1], cpu
    assert leftovers(os.getpid()) == []


def _check_shaping(rep: dict, mbps: float) -> None:
    """The measured rate on each site's link, each way, over every 1 s window, never exceeds
    the shaped rate by more than 5%."""
    cap = mbps * 1e6 / 8 * 1.05
    for port, tr in rep["traffic"].items():
        if port == "hub":
            continue
        assert tr["peak_up_bytes_per_s"] <= cap, (port, tr["peak_up_bytes_per_s"], cap)
        assert tr["peak_down_bytes_per_s"] <= cap, (port, tr["peak_down_bytes_per_s"], cap)
        assert tr["bytes_up"] > 0 and tr["bytes_down"] > 0


@needs_lab
@pytest.mark.slow
def test_decoupled_in_the_lab_survives_a_partition(tmp_path):
    """Two sites behind 2 Mbit/s links with 20 ms round trips; site 1 is cut off for 8 s:
    its learner keeps training, rejoins and contributes again, site 0 never stalls, the
    ledger loses nothing, and the shaping binds."""
    cfg = cfgmod.from_dict(TINY)
    plan = LabPlan(mode="decoupled", sites=[SiteSpec(2, 20, 1), SiteSpec(2, 20, 1)],
                   duration_s=30, schedule=[Fault(8, "partition-learner", "L1", 8)],
                   eval_every_s=10)
    rep = run_lab(cfg, plan, out=tmp_path, run="lab-test")
    assert rep["lost"] == 0, rep["lost_keys"]
    assert rep["crashes"] == {} and rep["learners_finished"] == ["L0", "L1"]
    assert rep["identical_final_values"] and rep["versions_increase"]
    assert rep["faults"][0]["kind"] == "partition-learner"
    assert rep["rejoins"] >= 1 and rep["rejoins_never"] == 0, rep
    assert rep["by_learner"]["L1"]["merged"] > 0
    _check_shaping(rep, 2)
    # while site 1's link was down nothing crossed it; its learner went on stepping
    tr = rep["traffic"]["s1"]
    t, up = np.array(tr["series_t"]), np.array(tr["series_up"])
    at = rep["faults"][0]["t_rel_s"]
    assert up[(t > at + 1.5) & (t < at + 7)].max() < 1000
    # unpaced learners sharing 2 cores: their rates differ by CPU share alone (CI once read
    # 69 against 169 steps/s); a learner blocked for the 8 s would still keep ~0.7 of the
    # other's rate, so this only checks that it kept stepping at a comparable rate
    assert rep["step_rates"]["L1"] > 0.25 * rep["step_rates"]["L0"]
    assert Path(rep["run_dir"], "bytes.png").stat().st_size > 0
    assert leftovers(os.getpid()) == []


@needs_lab
@pytest.mark.slow
def test_data_parallel_over_gloo_in_the_lab_equals_the_in_process_ddp(tmp_path):
    """One JAX process per site, gradients all-reduced over gloo across shaped links: the
    same training as the in-process ddp engine (one step on both batches together)."""
    cfg = cfgmod.from_dict({**TINY, "steps": 12, "mode": "ddp",
                            "engine": {"eval_every": 0}})
    plan = LabPlan(mode="ddp", sites=[SiteSpec(8, 10, 1), SiteSpec(8, 10, 1)],
                   eval_every_steps=6)
    rep = run_lab(cfg, plan, out=tmp_path, run="lab-ddp")
    engine = Engine(cfgmod.override(cfg, learners=2)).run()
    assert rep["steps"] == 12 and rep["history"][-1]["step"] == 12
    assert rep["final_eval_loss"] == pytest.approx(engine["final_eval_loss"], rel=2e-3)
    assert rep["final_eval_loss"] < rep["history"][0]["eval_loss"]
    _check_shaping(rep, 8)
    # a ring all-reduce of 2 processes moves each one's gradient across each link once a
    # step, each way (plus TCP/IP and gloo framing)
    for port in ("s0", "s1"):
        per_step = rep["traffic"][port]["bytes_up"] / 12
        assert 0.9 * rep["allreduce_bytes"] / 2 <= per_step <= 1.6 * rep["allreduce_bytes"]
    assert leftovers(os.getpid()) == []


def _lab_cli(tmp_path: Path, *extra: str) -> subprocess.Popen:
    sets = ["--set", "model.d_model=32", "--set", "model.n_layers=1", "--set",
            "model.n_heads=2", "--set", "model.seq_len=32", "--set", "data.max_bytes=600000",
            "--set", "inner.batch_size=8"]
    with open(tmp_path / "lab.out", "ab") as out:  # the child keeps its own copy
        return subprocess.Popen([sys.executable, "-m", "ops.cli", "lab", "--sites", "2",
                                 "--link-mbps", "4", "--rtt-ms", "10", "--duration", "600",
                                 "--steps", "1000000", "--out", str(tmp_path), *sets, *extra],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_for_learners(p: subprocess.Popen, timeout_s: float = 120) -> None:
    """Until the lab's learners run (a process in each site namespace)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = leftovers(p.pid)
        if sum(1 for x in left if x.startswith("pid ") and "-s" in x.rsplit(" ", 1)[1]) >= 2:
            return
        assert p.poll() is None, (p.returncode, p.args)
        time.sleep(0.5)
    raise AssertionError("the lab's learners did not start")


def _wait_clean(pid: int, timeout_s: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and leftovers(pid):
        time.sleep(0.5)
    return leftovers(pid)


@needs_lab
@pytest.mark.parametrize("how", ["ctrl-c", "crash"])
def test_nothing_is_left_behind(tmp_path, how):
    """Ctrl-C (SIGINT to the foreground group) or a SIGKILL of the controller mid-run: the
    namespaces, links, cgroups and every process in them are gone."""
    p = _lab_cli(tmp_path)
    try:
        _wait_for_learners(p)
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
            p.wait(60)
        else:
            p.kill()
            p.wait(10)
        assert _wait_clean(p.pid) == []
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        subprocess.run([sys.executable, "-c", f"from ops.lab import sweep; sweep(only={p.pid})"],
                       cwd=ROOT, check=False)


def test_without_root_it_says_so_and_exits_2(monkeypatch, capsys):
    from ops.cli import main

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["lab", "--sites", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs root" in lines[0], lines


def test_faults_the_lab_cannot_apply_are_refused_before_training():
    from ops.lab import check_schedule

    check_schedule([Fault(5, "partition-learner", "L1", 3), Fault(9, "kill-syncer", "", 2)],
                   2, "decoupled")
    for faults, mode, match in (
            ([Fault(5, "partition-learner", "L5", 3)], "decoupled", "not a learner"),
            ([Fault(5, "cut-zmq-learner", "L0", 3)], "decoupled", "does not apply"),
            ([Fault(5, "takeover", "", 3)], "sync-diloco", "does not apply"),
            ([Fault(5, "partition-learner", "L0", 3)], "ddp", "not to ddp")):
        with pytest.raises(ValueError, match=match):
            check_schedule(faults, 2, mode)


def test_traffic_peaks_are_over_whole_windows_only():
    from ops.lab import traffic

    def c(b):
        return {"s0": {"rx_bytes": b, "rx_packets": 0, "tx_bytes": 0, "tx_packets": 0}}

    # 1 s windows at 100 kB/s, then a 50 ms window (the stop's sample) with a 20 kB burst
    samples = [(10.0, c(0)), (11.0, c(100_000)), (12.0, c(200_000)), (12.05, c(220_000))]
    tr = traffic(samples, {"s0": 1000}, t0=10.0)["s0"]
    assert tr["bytes_up"] == 220_000 and tr["bytes_per_token"] == 220.0
    assert tr["peak_up_bytes_per_s"] == pytest.approx(100_000)
    assert tr["series_t"] == [1.0, 2.0, 2.05]
