"""`diloco inspect`, `eval`, `sample`, `export` and `plot` against one real finished run.

A module-scoped fixture starts its own redis-server and runs `diloco run` (a syncer and two
learner processes, the TINY configuration of test_e2e.py); every test reads that run. The last
test adds entries to the streams (unread, pending, dead-lettered), so it runs last.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
from test_e2e import TINY

from broker.keys import GROUP, RunKeys
from ops.cli import main
from ops.cluster import artifacts
from ops.cluster.artifacts import load_checkpoint
from ops.cluster.redis_server import RedisServer
from ops.tools import checkpoint as tools
from ops.tools import inspect as inspect_cmd
from ops.tools import plots
from pipeline import config as cfgmod
from pipeline.config import RunConfig
from pipeline.fragments import partition
from pipeline.model import is_embedding, param_shapes

ENTRY_KEYS = {"id", "fragment", "learner", "base_version", "step", "steps", "tokens", "codec",
              "payload_bytes", "entry_bytes", "seconds", "final", "age_s", "pending", "consumer",
              "deliveries", "idle_s", "state", "version", "dropped_reason", "dead_letter",
              "dlq_reason", "source_id", "epoch", "chain"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class FinishedRun:
    url: str
    run: str
    run_dir: Path
    summary: dict
    cfg: RunConfig


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> FinishedRun:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install -y redis-server)")
    tmp = tmp_path_factory.mktemp("tools")
    server = RedisServer(workdir=tmp / "redis").start()
    try:
        cfg = cfgmod.from_dict({**TINY, "learners": 2, "steps": 30})
        (tmp / "run.toml").write_text(cfgmod.dumps_toml(cfg))
        out = subprocess.run(
            [sys.executable, "-m", "ops.cli", "run", "--config", str(tmp / "run.toml"),
             "--redis-url", server.url, "--run", "t", "--out", str(tmp / "runs"), "--json"],
            capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-4000:]
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        yield FinishedRun(server.url, "t", Path(summary["run_dir"]), summary, cfg)
    finally:
        server.stop()


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run one subcommand in-process; (exit code, stdout, stderr)."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_json(capsys, *argv: str) -> dict:
    code, out, _ = cli(capsys, *argv, "--json")
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


def fragment_names(cfg: RunConfig) -> list[list[str]]:
    return partition(param_shapes(cfg.model), cfg.effective_sync().fragments, is_embedding)


# ----------------------------------------------------------------------------- inspect


def test_inspect_lists_entries_of_every_fragment(finished, capsys):
    rep = cli_json(capsys, "inspect", "--redis-url", finished.url, "--run", finished.run)
    assert rep["run"] == "t" and rep["redis_time_s"] > 0
    assert [f["fragment"] for f in rep["fragments"]] == [0, 1]
    learners = set()
    for f in rep["fragments"]:
        assert f["version"] == finished.summary["versions"][f["fragment"]]
        assert f["pending"] == 0 and f["dlq_length"] == 0
        assert f["shown"] == f["length"] == len(f["entries"]) > 0
        for e in f["entries"]:
            assert set(e) == ENTRY_KEYS
            assert e["epoch"] >= 1  # each learner process claims one when it joins
            assert 0 <= e["chain"] <= e["step"]  # every push names the chain it continues
            assert e["fragment"] == f["fragment"]
            assert e["codec"] == finished.cfg.sync.codec_up
            assert e["payload_bytes"] > 0 and e["entry_bytes"] > e["payload_bytes"]
            assert e["steps"] > 0 and e["tokens"] == e["steps"] * 8 * 32
            assert 0 <= e["age_s"] < 600
            assert not e["pending"] and e["deliveries"] is None and not e["dead_letter"]
            assert e["state"] == "merged" and 1 <= e["version"] <= f["version"]
            learners.add(e["learner"])
    assert learners == {"L0", "L1"}
    one = cli_json(capsys, "inspect", "--redis-url", finished.url, "--run", finished.run,
                   "--fragment", "1")
    assert [f["fragment"] for f in one["fragments"]] == [1]


def test_inspect_entry_statistics(finished, capsys):
    listing = cli_json(capsys, "inspect", "--redis-url", finished.url, "--run", finished.run)
    shapes = param_shapes(finished.cfg.model)
    names = fragment_names(finished.cfg)
    for f in listing["fragments"]:
        entry = f["entries"][-1]
        rep = cli_json(capsys, "inspect", "--redis-url", finished.url, "--run", finished.run,
                       "--fragment", str(f["fragment"]), "--entry", entry["id"])
        assert rep["id"] == entry["id"] and rep["learner"] == entry["learner"]
        assert rep["decode_error"] is None and not rep["dead_letter"]
        assert rep["payload_bytes"] == entry["payload_bytes"]
        assert [t["name"] for t in rep["tensors"]] == names[f["fragment"]]
        for t in rep["tensors"]:
            assert tuple(t["shape"]) == shapes[t["name"]]
            assert t["numel"] == int(np.prod(t["shape"]))
            assert t["finite"] and t["nonfinite"] == 0
            assert np.isfinite([t["l2_norm"], t["min"], t["max"]]).all()
            assert t["min"] <= t["max"] and t["l2_norm"] > 0
        assert rep["total"]["finite"] and rep["total"]["l2_norm"] > 0
    code, text, _ = cli(capsys, "inspect", "--redis-url", finished.url, "--run", finished.run,
                     "--fragment", "0", "--entry", listing["fragments"][0]["entries"][0]["id"])
    assert code == 0 and "wte" in text and "all finite" in text and len(text) < 5000


def test_inspect_text_and_errors(finished, capsys):
    code, text, _ = cli(capsys, "inspect", "--redis-url", finished.url, "--run", finished.run)
    assert code == 0 and "fragment 0:" in text and "fragment 1:" in text and "merged v" in text
    base = ("inspect", "--redis-url", finished.url)
    assert cli(capsys, *base, "--run", finished.run, "--entry", "1-0")[0] == 2  # no --fragment
    assert cli(capsys, *base, "--run", finished.run, "--fragment", "0", "--entry", "1-0")[0] == 2
    assert cli(capsys, *base, "--run", finished.run, "--fragment", "7")[0] == 2
    code, _, err = cli(capsys, *base, "--run", "no-such-run")
    assert code == 2 and "no configuration" in err


# ----------------------------------------------------------------------------- eval, sample


def test_eval_beats_the_initial_loss(finished, capsys):
    ckpt = finished.run_dir / "checkpoint.npz"
    rep = cli_json(capsys, "eval", str(ckpt))
    assert rep["eval_loss"] < finished.summary["initial_eval_loss"] - 0.5
    assert rep["eval_loss"] == pytest.approx(finished.summary["final_eval_loss"], abs=1e-4)
    assert 0 < rep["eval_accuracy"] <= 1
    assert rep["versions"] == finished.summary["versions"]
    assert rep["eval_tokens"] == rep["eval_batches"] * 8 * 32
    assert cli(capsys, "eval", str(finished.run_dir / "missing.npz"))[0] == 2


def test_sample_is_deterministic_for_a_seed(finished, capsys):
    ckpt = str(finished.run_dir / "checkpoint.npz")
    args = ("sample", ckpt, "--prompt", "def main(", "--bytes", "40", "--seed", "3")
    a = cli_json(capsys, *args)
    b = cli_json(capsys, *args)
    assert a == b
    assert a["bytes"] == len(a["tokens"]) == 40 and a["completion"]
    assert all(0 <= t < 256 for t in a["tokens"])
    assert a["completion"] == bytes(a["tokens"]).decode("utf-8", errors="replace")
    assert a["context_bytes"] == 32
    greedy = cli_json(capsys, "sample", ckpt, "--prompt", "x" * 50, "--bytes", "10",
                      "--temperature", "0")
    assert greedy["bytes"] == 10  # a prompt longer than the window slides
    code, text, _ = cli(capsys, "sample", ckpt, "--prompt", "import ", "--bytes", "12")
    assert code == 0 and text.startswith("import ") and len(text) > len("import ")
    assert cli(capsys, "sample", ckpt, "--prompt", "a", "--temperature", "-1")[0] == 2


# ----------------------------------------------------------------------------- export


def test_export_equals_the_checkpoint(finished, capsys, tmp_path):
    rep = cli_json(capsys, "export", "--redis-url", finished.url, "--run", finished.run,
                   "--out", str(tmp_path / "global"))
    assert rep["out"] == str(tmp_path / "global.npz")
    assert rep["versions"] == finished.summary["versions"]
    assert rep["params"] == finished.summary["params"]
    exported, cfg_x = load_checkpoint(rep["out"])
    saved, cfg_s = load_checkpoint(finished.run_dir / "checkpoint.npz")
    assert cfg_x == cfg_s == finished.cfg
    assert sorted(exported) == sorted(saved)
    for k, v in saved.items():
        np.testing.assert_array_equal(exported[k], v, err_msg=k)
    assert tools.read_checkpoint(rep["out"])[2] == finished.summary["versions"]
    assert cli(capsys, "export", "--redis-url", finished.url, "--run", "nope",
               "--out", str(tmp_path / "x.npz"))[0] == 2


def _same_model_and_loss(theirs: dict, exported: str, finished, capsys) -> None:
    """What another library read from an export is the run's checkpoint, fp32, by name; the
    export's versions are the run's; eval of the export gives the checkpoint's loss."""
    saved, _ = load_checkpoint(finished.run_dir / "checkpoint.npz")
    assert sorted(theirs) == sorted(saved)
    for k, v in saved.items():
        assert theirs[k].dtype == np.float32
        np.testing.assert_array_equal(theirs[k], v, err_msg=k)
    assert tools.read_checkpoint(exported)[2] == finished.summary["versions"]
    assert cli_json(capsys, "eval", exported)["eval_loss"] == cli_json(
        capsys, "eval", str(finished.run_dir / "checkpoint.npz"))["eval_loss"]


def test_export_as_safetensors_is_read_by_the_ecosystem_and_by_eval(finished, capsys, tmp_path):
    """safetensors' own reader sees the task's parameter names and the same values; eval of
    the file gives the checkpoint's loss."""
    import safetensors.numpy

    rep = cli_json(capsys, "export", "--redis-url", finished.url, "--run", finished.run,
                   "--out", str(tmp_path / "global"), "--format", "safetensors")
    assert rep["out"] == str(tmp_path / "global.safetensors") and rep["format"] == "safetensors"
    _same_model_and_loss(safetensors.numpy.load_file(rep["out"]), rep["out"], finished, capsys)
    # a safetensors file that diloco did not write is refused in one line
    safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "other.safetensors"))
    code, _, err = cli(capsys, "eval", str(tmp_path / "other.safetensors"))
    assert code == 2 and "without a diloco configuration" in err, err


def test_export_as_orbax_is_read_by_orbax_and_by_eval(finished, capsys, tmp_path):
    """Orbax's own reader restores the exported tree (the task's names, split at '/'); eval of
    the folder gives the checkpoint's loss; a tree with a llama's path names comes back whole."""
    import orbax.checkpoint as ocp

    rep = cli_json(capsys, "export", "--redis-url", finished.url, "--run", finished.run,
                   "--out", str(tmp_path / "global"), "--format", "orbax")
    assert rep["out"] == str(tmp_path / "global.orbax") and rep["bytes"] > 0
    with ocp.StandardCheckpointer() as ck:
        theirs = ck.restore(Path(rep["out"]).resolve() / "params")
    _same_model_and_loss(theirs, rep["out"], finished, capsys)
    tree = artifacts.nest({"layers/0/attn/wq": np.ones(2), "layers/1/mlp/w": np.zeros(3),
                           "embed": np.ones(1)})
    assert sorted(tree) == ["embed", "layers"] and sorted(tree["layers"]) == ["0", "1"]
    assert sorted(artifacts.unnest(tree)) == ["embed", "layers/0/attn/wq", "layers/1/mlp/w"]
    with pytest.raises(ValueError, match="collide"):
        artifacts.nest({"a": np.ones(1), "a/b": np.ones(1)})
    # an Orbax checkpoint that diloco did not write is refused in one line
    with ocp.StandardCheckpointer() as ck:
        ck.save((tmp_path / "other.orbax").resolve(), {"w": np.zeros(2, np.float32)})
    code, _, err = cli(capsys, "eval", str(tmp_path / "other.orbax"))
    assert code == 2 and "without diloco's configuration" in err, err


# ----------------------------------------------------------------------------- plot


def _check_pngs(rep: dict, names) -> None:
    for name in names:
        path = Path(rep["plots"][name])
        assert path.exists() and path.stat().st_size > 5000, name
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_plot_writes_every_png(finished, capsys, tmp_path):
    rep = cli_json(capsys, "plot", str(finished.run_dir), "--out", str(tmp_path),
                   "--redis-url", finished.url, "--run", finished.run)
    assert rep["skipped"] == {}
    _check_pngs(rep, plots.PLOTS)
    assert {Path(p).name for p in rep["plots"].values()} == {
        "loss_tokens.png", "loss_wall.png", "rounds.png", "bytes.png"}
    assert rep["rounds"]["redis"] == rep["rounds"]["total"] == finished.summary["rounds"]
    assert rep["records"]["eval"] >= 1 and rep["records"]["progress"] >= 1
    # without Redis: the launcher copied every round record into metrics.jsonl
    rep = cli_json(capsys, "plot", str(finished.run_dir), "--out", str(tmp_path / "nr"))
    assert rep["rounds"]["metrics"] == finished.summary["rounds"]
    _check_pngs(rep, plots.PLOTS)
    assert cli(capsys, "plot", str(tmp_path / "not-a-run"))[0] == 2


def test_plot_reads_round_records_from_metrics(finished, capsys, tmp_path):
    """The launcher may copy the round records into metrics.jsonl: the same fields."""
    run_dir = tmp_path / "copy"
    run_dir.mkdir()
    r = redis.Redis.from_url(finished.url)
    keys = RunKeys(finished.run)
    lines = [ln for ln in (finished.run_dir / "metrics.jsonl").read_text().splitlines()
             if '"kind": "round"' not in ln]  # re-added below, half of them as JSON text
    for p in range(2):
        for _, fields in r.xrange(keys.fragment(p).rounds):
            rec = {k.decode(): v.decode() for k, v in fields.items()}
            for k in ("included", "dropped"):  # decoded lists as well as JSON text
                if p == 0:
                    rec[k] = json.loads(rec[k])
            lines.append(json.dumps({"kind": "round", **rec}))
    r.close()
    lines.append('{"kind": "progress", "t": 1')  # a torn last line is skipped
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rep = cli_json(capsys, "plot", str(run_dir))
    assert rep["rounds"] == {"metrics": finished.summary["rounds"], "redis": 0,
                             "total": finished.summary["rounds"]}
    assert rep["records"]["unreadable_lines"] == 1 and rep["out_dir"] == str(run_dir)
    _check_pngs(rep, plots.PLOTS)


def test_byte_series_and_round_normalisation():
    progress = [{"learners": {"L0": {"t": 10.0, "bytes_sent": 0, "bytes_received": 0}}},
                {"learners": {"L0": {"t": 10.0, "bytes_sent": 0, "bytes_received": 0}}},
                {"learners": {"L0": {"t": 12.0, "bytes_sent": 400, "bytes_received": 100}}},
                {"learners": {"L0": {"t": 13.0, "bytes_sent": 50, "bytes_received": 300}}},
                {"learners": {"L1": {"t": 1.0}}}]
    s = plots.byte_series(progress)
    assert list(s) == ["L0"] and s["L0"]["t"] == [10.0, 12.0, 13.0]
    assert s["L0"]["sent_Bps"] == [200.0, 50.0]  # the counter restarted at 13 s
    assert s["L0"]["received_Bps"] == [50.0, 200.0]
    rec = plots.normalize_round({b"version": b"3", b"fragment": b"1", b"t": b"5.5",
                                 b"included": b'[["1-0", "L0", 2.0, 0]]', b"dropped": b"bad",
                                 b"reason": b"final flush"})
    assert rec["included"] == [["1-0", "L0", 2.0, 0]] and rec["dropped"] == []
    assert rec["quorum_wait_s"] == rec["grace_wait_s"] == 0.0
    assert plots.normalize_round({"fragment": 0, "t": 1.0}) is None


def test_a_bytes_plot_without_heartbeats_is_written_without_warnings(tmp_path):
    """A run too short for a learner heartbeat has no byte series: the plot says so (no legend
    of nothing: matplotlib warns, and the tests turn warnings into errors)."""
    path = plots.plot_bytes({}, 0.0, tmp_path / "bytes.png", "a short run")
    assert Path(path).stat().st_size > 0


def test_round_outcomes_walk_past_the_first_page(finished):
    """Round record ids are versions; the walk back is bounded by close times, not ids."""
    r = redis.Redis.from_url(finished.url)
    fk = RunKeys("synthetic").fragment(0)
    t0 = 1_700_000_000
    for v in range(1, 451):  # entry (t0 + 10 v) s merged by round v, closed at t0 + 10 v + 1 s
        r.xadd(fk.rounds, {"version": v, "t": t0 + 10 * v + 1,
                           "included": json.dumps([[f"{(t0 + 10 * v) * 1000}-0", "L0", 1.0, 0]]),
                           "dropped": json.dumps([[f"{(t0 + 10 * v) * 1000}-1", "stale"]])},
               id=f"{v}-0")
    out = inspect_cmd._round_outcomes(r, fk, f"{(t0 + 1000) * 1000}-0")
    r.close()
    assert out[f"{(t0 + 1000) * 1000}-0"] == ("merged", 100, None)
    assert out[f"{(t0 + 4500) * 1000}-1"] == ("dropped", 450, "stale")
    # records closed more than the tolerated clock skew before the oldest entry are not read
    assert min(v for _, v, _ in out.values()) == 100 - int(inspect_cmd._CLOCK_SKEW_S // 10)


# ----------------------------------------------------------------------------- mutating (last)


def test_inspect_unread_pending_and_dead_letters(finished, capsys):
    r = redis.Redis.from_url(finished.url)
    fk = RunKeys(finished.run).fragment(0)
    (src_id, fields), = r.xrange(fk.frags, count=1)
    pending_id = r.xadd(fk.frags, fields).decode()
    r.xreadgroup(GROUP, "probe", {fk.frags: ">"}, count=1)
    unread_id = r.xadd(fk.frags, fields).decode()
    bad = {**fields, b"payload": fields[b"payload"][:-3], b"dlq_reason": b"malformed entry: test",
           b"dlq_source_id": b"123-4"}
    dlq_id = r.xadd(fk.dlq, bad).decode()
    r.close()

    rep = cli_json(capsys, "inspect", "--redis-url", finished.url, "--run", finished.run,
                   "--fragment", "0")
    (f,) = rep["fragments"]
    by_id = {e["id"]: e for e in f["entries"] if not e["dead_letter"]}
    (d,) = [e for e in f["entries"] if e["dead_letter"]]  # ids are per stream: may repeat
    assert f["pending"] == 1 and f["dlq_length"] == 1
    p = by_id[pending_id]
    assert p["pending"] and p["state"] == "pending" and p["consumer"] == "probe"
    assert p["deliveries"] == 1 and p["idle_s"] >= 0
    assert by_id[unread_id]["state"] == "unread" and not by_id[unread_id]["pending"]
    assert d["id"] == dlq_id and d["state"] == "dead_letter" and d["source_id"] == "123-4"
    assert d["dlq_reason"] == "malformed entry: test" and f["entries"][-1]["id"] == dlq_id
    assert by_id[src_id.decode()]["state"] == "merged"

    base = ("inspect", "--redis-url", finished.url, "--run", finished.run, "--fragment", "0")
    for extra in (("--entry", dlq_id, "--dlq"), ("--entry", "123-4")):  # dlq id, original id
        st = cli_json(capsys, *base, *extra)
        assert st["dead_letter"] and st["tensors"] == [] and "nbytes" in st["decode_error"]
        assert st["dlq_reason"] == "malformed entry: test" and not st["total"]["finite"]
    st = cli_json(capsys, *base, "--entry", unread_id)  # the stream entry comes first
    assert not st["dead_letter"] and st["decode_error"] is None and st["tensors"]
    code, text, _ = cli(capsys, "inspect", "--redis-url", finished.url, "--run", finished.run)
    assert code == 0 and "DEAD LETTER (malformed entry: test)" in text and "on probe" in text
    limited = cli_json(capsys, "inspect", "--redis-url", finished.url, "--run", finished.run,
                       "--fragment", "0", "--limit", "1")
    ids = [e["id"] for e in limited["fragments"][0]["entries"]]
    assert ids == [unread_id, dlq_id]


# ----------------------------------------------------------------------------- status


def test_status_shows_finished_learners_as_done_with_their_last_step(finished, capsys):
    rep = cli_json(capsys, "status", "--redis-url", finished.url, "--run", finished.run)
    assert sorted(rep["learners"]) == ["L0", "L1"]
    for rec in rep["learners"].values():
        assert rec["finished"] and rec["step"] == finished.cfg.steps, rec
    code, text, _ = cli(capsys, "status", "--redis-url", finished.url, "--run", finished.run)
    assert code == 0
    rows = [ln for ln in text.splitlines() if ln.strip().startswith(("L0", "L1"))]
    assert len(rows) == 2 and all(" done " in ln and f"step {finished.cfg.steps} " in ln
                                  for ln in rows), text
