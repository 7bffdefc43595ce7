"""`diloco dashboard` beyond the live run of tests/test_live_ops.py: where it may listen, its
token over HTTPS, a finished run's curves from its folder, and hostile records in Redis."""

from __future__ import annotations

import json
import time

import pytest
from test_e2e import TINY
from test_live_ops import cli

from broker import registry
from broker.connection import connect
from broker.keys import RunKeys
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
    # what a learner credential may write: the events stream, heartbeat records (any id)
    registry.event(r, keys, "<img src=x onerror=alert(1)>" + "k" * 5000, learner="L0",
                   blob="\x1b[31m" + "x" * 100_000)
    r.xadd(keys.events, {"kind": "join", "t": "nan", "learner": "L1"})
    r.xadd(keys.events, {b"\xff\xfe": b"\x00" * 10})
    r.hset(keys.learners, mapping={f"ghost{i:04d}" + "g" * 300: json.dumps(
        {"t": time.time(), "step": 1, "loss": 1.0}) for i in range(dashboard.LEARNERS_MAX + 50)})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t0 = time.time() - 100
    lines = [{"kind": "eval", "t": t0 + 1, "tokens": 100, "eval_loss": 5.0},
             {"kind": "eval", "t": t0 + 2, "tokens": 200, "eval_loss": float("nan")},
             {"kind": "eval", "t": 1e300, "tokens": 250, "eval_loss": 4.5},
             {"kind": "progress", "t": t0 + 2, "learners": {"L0": {"step": 3, "loss": 4.5}}},
             {"kind": "eval", "t": t0 + 3, "tokens": 300, "eval_loss": 4.0}]
    text = ("\n".join(json.dumps(x) for x in lines) + "\nnot json\n" + "[" * 100_000 + "\n"
            + '{"kind": "eval"')
    (run_dir / "metrics.jsonl").write_text(text)  # the last line is still being written
    board = dashboard.Board(redis_url, "dash", run_dir)
    board.poll()
    st = json.loads(json.dumps(board.state(), allow_nan=False))
    assert st["error"] is None
    assert [p[1:] for p in st["eval"]] == [[100, 5.0], [300, 4.0]]
    assert st["loss"] == {"L0": [[t0 + 2, 3, 4.5]]}
    assert len(st["events"]) == 3
    for e in st["events"]:
        assert len(e["kind"]) <= dashboard.TEXT_MAX + 1 and abs(e["t"] - time.time()) < 60
        assert all(len(v) <= dashboard.TEXT_MAX + 1 and v.isprintable()
                   for v in e["detail"].values())
    assert len(st["learners"]) == dashboard.LEARNERS_MAX
    assert all(len(ln["id"]) <= 65 for ln in st["learners"])
    # the rest of the half-written line arrives: read once, whole
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(f', "t": {t0 + 4}, "tokens": 400, "eval_loss": 3.5}}\n')
    # an event of the largest id ends what the events stream can give; the rest reads on
    r.xadd(keys.events, {"kind": "x"}, id="18446744073709551615-18446744073709551615")
    board.poll()
    board.poll()
    st = board.state()
    assert [list(p[1:]) for p in st["eval"]] == [[100, 5.0], [300, 4.0], [400, 3.5]]
    assert st["error"] is None and len(st["events"]) == 4
    # a metrics file replaced by a shorter one is read again from its start
    (run_dir / "metrics.jsonl").write_text(json.dumps(
        {"kind": "eval", "t": t0 + 5, "tokens": 500, "eval_loss": 3.0}) + "\n")
    board.poll()
    assert [list(p[1:]) for p in board.state()["eval"]][-1] == [500, 3.0]


def test_curves_are_thinned_in_the_page_and_history_goes_in_time_order():
    points = [(float(i), i, 1.0) for i in range(dashboard.HISTORY)]
    thin = dashboard._thin(points)
    assert len(thin) == dashboard.SHOWN and thin[0] == points[0] and thin[-1] == points[-1]
    board = object.__new__(dashboard.Board)  # the curve logic alone (no Redis)
    board.loss = {}
    board._point("L0", (10.0, 5, 2.0))
    board._point("L0", (5.0, 2, 3.0))  # a run folder's older point
    board._point("L0", (5.0, 5, 3.0))  # a step already there: once
    board._point("L0", (11.0, 5, 2.0))  # no new step: no new point
    assert list(board.loss["L0"]) == [(5.0, 2, 3.0), (10.0, 5, 2.0)]


def test_a_dashboard_beyond_loopback_without_https_and_a_token_never_starts(tmp_path, capsys):
    """Refused before anything is read or bound (the HTTPS and token run is tests/test_live_ops)."""
    from ops.cli import main

    base = ["--redis-url", "redis://127.0.0.1:1/0", "--run", "dash"]  # never reached
    assert main(["dashboard", *base, "--host", "0.0.0.0"]) == 2
    assert "HTTPS" in capsys.readouterr().err
    (tmp_path / "short").write_text("abc\n")
    assert main(["dashboard", *base, "--token-file", str(tmp_path / "short")]) == 2
    assert "shorter than 16" in capsys.readouterr().err
    (tmp_path / "odd").write_text("a token with spaces and é in it\n")
    assert main(["dashboard", *base, "--token-file", str(tmp_path / "odd")]) == 2
    assert "printable ASCII" in capsys.readouterr().err
    assert main(["dashboard", *base, "--tls-cert", "c.pem"]) == 2
    assert "go together" in capsys.readouterr().err
