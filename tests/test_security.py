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
from helpers_broker import REPO, end_processes

from broker import registry
from broker.connection import URL_ENV, connect, has_secret, redact
from broker.keys import RunKeys
from ops.cluster import RedisServer
from ops.cluster.redis_server import TlsFiles
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
        cfg_path = write_config(tmp_path, learners=2, steps=16)
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


# -- ACL users per role ---------------------------------------------------------------------------


def _cli(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)


def test_a_hardened_run_tls_acl_curve_and_every_role_refused_the_rest(tmp_path):
    """A TLS-only redis-server requiring client certificates (generated here). `diloco acl
    --apply` creates the four users and `diloco keys` the CURVE keys; a syncer and three
    learners, each with only its role's ``rediss://`` URL and its CURVE keys, complete a run
    with identical final values — while, with the syncer's own credential (which may write the
    endpoint hash), two rogue PUB sockets are advertised and publish forged finite values of
    version 10⁶: the learners never take one (their pinned key fails the handshake). Each role
    is refused (NOPERM) what it must not touch; a plaintext client and a client without a
    certificate are refused by the server."""
    import redis
    from test_e2e import write_config

    tls = TlsFiles.generate(tmp_path / "tls")
    with RedisServer(workdir=tmp_path / "redis", password=SECRET, tls=tls) as server:
        assert server.url.startswith("rediss://")
        plain = redis.Redis(host="127.0.0.1", port=server.port, password=SECRET, socket_timeout=2)
        with pytest.raises(redis.ConnectionError):
            plain.ping()
        no_cert = redis.Redis(host="127.0.0.1", port=server.port, password=SECRET,
                              socket_timeout=2, ssl=True, ssl_ca_certs=str(tls.ca))
        with pytest.raises(redis.ConnectionError):
            no_cert.ping()
        admin = {**os.environ, URL_ENV: server.url}
        base = server.address_url()
        made = _cli("acl", "--run", "sec", "--url", base, "--out", str(tmp_path / "acl"),
                    "--apply", env=admin)
        assert made.returncode == 0, made.stderr[-2000:]
        url = {role: (tmp_path / "acl" / f"{role}.url").read_text().strip()
               for role in ("learner", "syncer", "reader", "operator")}
        for role, u in url.items():
            assert (tmp_path / "acl" / f"{role}.url").stat().st_mode & 0o077 == 0
            assert u.split("@")[0].rsplit(":", 1)[1] not in made.stdout + made.stderr
        # the operator stores the run; the syncer and two learners train with their own users
        cfg_path = write_config(tmp_path, learners=3, steps=30)
        init = _cli("run", "--init-only", "--config", cfg_path, "--run", "sec",
                    "--redis-url-file", str(tmp_path / "acl" / "operator.url"))
        assert init.returncode == 0, init.stderr[-2000:]
        kdir = tmp_path / "keys"
        made = _cli("keys", "--out", str(kdir), "--learners", "L0,L1,L2")
        assert made.returncode == 0, made.stderr[-2000:]
        logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("syncer", "L0", "L1", "L2")}
        files = {n: str(tmp_path / "acl" / f"{'syncer' if n == 'syncer' else 'learner'}.url")
                 for n in logs}
        cmds = {"syncer": [sys.executable, "-m", "workers.syncer", "--redis-url-file",
                           files["syncer"], "--run", "sec", "--curve-secret",
                           str(kdir / "syncer.key_secret"), "--curve-allow", str(kdir / "allow"),
                           "--sign-keys", str(kdir / "signers")],
                **{n: [sys.executable, "-m", "workers.learner", "--redis-url-file", files[n],
                       "--run", "sec", "--id", n, "--curve-secret",
                       str(kdir / "learners" / f"{n}.key_secret"), "--curve-server-key",
                       str(kdir / "syncer.key"), "--sign-key",
                       str(kdir / "learners" / f"{n}.sign")] for n in ("L0", "L1", "L2")}}
        # before the learners start, with the learner credential (allowed to XADD): an
        # unsigned entry, one signed with another key, one from an unknown learner, and L1's
        # own next keys pre-empted (unsigned) — a real push must not become a "duplicate"
        injected = _inject_forged_entries(url["learner"], url["reader"], kdir)
        # and an entry of the largest id, after which no XADD * goes in (the ACL cannot
        # restrict ids): the fragment's syncer undoes it, the learners' pushes go in again
        biggest = f"{2**64 - 1}-{2**64 - 1}"
        connect(url["learner"]).xadd(RunKeys("sec").fragment(1).frags, {"learner": "L1"},
                                     id=biggest)
        procs = {n: subprocess.Popen(c, cwd=REPO, stdout=logs[n], stderr=subprocess.STDOUT)
                 for n, c in cmds.items()}
        stop = threading.Event()
        rogue = threading.Thread(target=_rogue_syncers, daemon=True,
                                 args=(url["syncer"], url["reader"], tmp_path, kdir, stop))
        rogue.start()
        try:
            for n in ("L0", "L1", "L2", "syncer"):
                assert procs[n].wait(240) == 0, (tmp_path / f"{n}.log").read_text()[-3000:]
        finally:
            stop.set()
            rogue.join(10)
            end_processes(procs, logs)
        assert (tmp_path / "rogue-published").read_text() != "0"
        status = _cli("status", "--run", "sec", "--json", "--redis-url-file",
                      str(tmp_path / "acl" / "reader.url"))
        assert status.returncode == 0, status.stderr[-2000:]
        # the ghosts' heartbeats (written with the learner credential, no learner's key) are
        # live but not counted: the syncer verifies heartbeats and says whose it verified
        shown = json.loads(status.stdout.strip().splitlines()[-1])
        assert shown["unverified_learners"] == ["g1", "g2", "g3"], shown
        assert not set(shown["live_learners"]) & {"g1", "g2", "g3"}
        assert all(shown["learners"][n]["verified"] for n in ("L0", "L1", "L2"))
        assert "not signed" in (tmp_path / "syncer.log").read_text() or "does not sign" in (
            tmp_path / "syncer.log").read_text()
        plain = _cli("status", "--run", "sec", "--redis-url-file",
                     str(tmp_path / "acl" / "reader.url"))
        assert "3 more with a heartbeat their learner's key does not sign" in plain.stdout, \
            plain.stdout
        finals = registry.learner_final_reports(connect(url["reader"]), RunKeys("sec"))
        assert sorted(finals) == ["L0", "L1", "L2", "g1", "g2", "g3"]  # ghosts: ignored
        finals = {n: f for n, f in finals.items() if n.startswith("L")}
        assert all(f.sig for f in finals.values()) and all(f.steps == 30 for f in finals.values())
        assert len({json.dumps(f.hashes, sort_keys=True) for f in finals.values()}) == 1
        assert max(v for f in finals.values() for v in f.versions) < 1000  # no forged value
        # every injected entry is dead-lettered with its reason, no real push was refused
        admin_r = connect(url["reader"])
        dead = {}
        for p in range(2):
            for _, fields in admin_r.xrange(RunKeys("sec").fragment(p).dlq):
                dead[fields[b"dlq_source_id"].decode()] = fields[b"dlq_reason"].decode()
        assert set(injected) <= set(dead), (injected, dead)
        assert "largest stream id" in dead.pop(biggest)
        assert admin_r.xinfo_stream(RunKeys("sec").fragment(1).frags)[
            "last-generated-id"] != biggest.encode()
        for entry_id, why in injected.items():
            assert dead[entry_id].startswith(f"signature: {why}"), (entry_id, dead[entry_id])
        from broker.records import read_rounds
        refused = [(e, why) for p in range(2) for rec in read_rounds(
            admin_r, RunKeys("sec").fragment(p)) for e, why in rec.dropped]
        assert not refused, refused
        merged = {inc.learner for p in range(2) for rec in read_rounds(
            admin_r, RunKeys("sec").fragment(p)) for inc in rec.included}
        assert merged == {"L0", "L1", "L2"}

        keys, other = RunKeys("sec"), RunKeys("other")
        f0 = keys.fragment(0)
        learner, reader = connect(url["learner"]), connect(url["reader"])
        syncer = connect(url["syncer"])
        denied = {
            "learner SET state": lambda: learner.set(f0.state, b"x"),
            "learner SET lease": lambda: learner.set(f0.lease, b"me"),
            "learner XADD rounds": lambda: learner.xadd(f0.rounds, {"a": 1}),
            "learner HSET config": lambda: learner.hset(keys.config, "toml", "x"),
            "learner SET global": lambda: learner.set(f0.global_, b"x"),
            "learner HSET merged": lambda: learner.hset(f0.merged, "L0", "{}"),
            "learner DEL merged": lambda: learner.delete(f0.merged),
            "learner HSET syncers": lambda: learner.hset(keys.syncers, "s", "{}"),
            "learner GET state": lambda: learner.get(f0.state),
            "learner XADD other run": lambda: learner.xadd(other.fragment(0).frags, {"a": 1}),
            "learner FLUSHALL": lambda: learner.flushall(),
            "learner SET epoch": lambda: learner.set(keys.epoch("L0"), 1),
            "learner DEL epoch": lambda: learner.delete(keys.epoch("L0")),
            "learner HDEL epochsig": lambda: learner.hdel(keys.epoch_sig("L0"), "1"),
            "learner DEL epochsig": lambda: learner.delete(keys.epoch_sig("L0")),
            "learner XACK frags": lambda: learner.xack(f0.frags, "syncers", "0-1"),
            "learner XDEL frags": lambda: learner.xdel(f0.frags, "0-1"),
            "learner XTRIM frags": lambda: learner.xtrim(f0.frags, maxlen=0),
            "learner DEL frags": lambda: learner.delete(f0.frags),
            "learner XGROUP SETID": lambda: learner.xgroup_setid(f0.frags, "syncers", "$"),
            "learner XREADGROUP": lambda: learner.xreadgroup("syncers", "x",
                                                             {f0.frags: ">"}, count=1),
            "learner XCLAIM": lambda: learner.xclaim(f0.frags, "syncers", "x", 0, ["0-1"]),
            "syncer SCRIPT FLUSH": lambda: syncer.script_flush(),
            "syncer FUNCTION FLUSH": lambda: syncer.function_flush(),
            "learner KEYS": lambda: learner.keys("*"),
            "learner CONFIG": lambda: learner.config_get("requirepass"),
            "reader XADD frags": lambda: reader.xadd(f0.frags, {"a": 1}),
            "reader SET stop": lambda: reader.set(keys.stop, b"1"),
            "syncer HSET config": lambda: syncer.hset(keys.config, "toml", "x"),
            "syncer GET other run": lambda: syncer.get(other.fragment(0).state),
        }
        for what, call in denied.items():
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
                pytest.fail(f"{what} was allowed")
        # and what each role needs still works
        assert learner.xadd(f0.frags, {"probe": 1})
        assert learner.get(f0.global_) and reader.get(f0.state) and syncer.get(f0.state)
        # a learner reads its merge records (committed with each round by the syncer user)
        assert any(registry.merged(learner, keys, n, 0) for n in ("L0", "L1", "L2"))
        # the run's learners claimed their epochs through the selectors, signed
        assert int(learner.get(keys.epoch("L0"))) >= 1 and learner.incr(keys.epoch("L9")) == 1
        assert learner.hmget(keys.epoch_sig("L0"), ["1"])[0] is not None


def _inject_forged_entries(learner_url: str, reader_url: str, kdir: Path) -> dict[str, str]:
    """XADD hostile entries with a learner's credential; entry id → the expected reason."""
    import numpy as np
    from helpers_broker import contribution_fields

    from broker import signing
    from broker.streams import FragmentStreams
    from workers.common import open_run

    ctx = open_run(reader_url, "sec", wait_s=60)
    streams = FragmentStreams(connect(learner_url), ctx.keys)
    delta = {k: np.full(ctx.shapes[k], 1e-3, np.float32) for k in ctx.fragments[0]}
    other_key = signing.new_key()
    out = {}
    out[streams.push(0, contribution_fields("L0", 0, delta, step=999))] = "unsigned"
    out[streams.push(0, signing.signed(other_key, "sec", contribution_fields(
        "L0", 0, delta, step=998)))] = "bad signature"
    out[streams.push(0, signing.signed(other_key, "sec", contribution_fields(
        "L9", 0, delta, step=997)))] = "no signing key"
    # ghosts in the shared hashes the learner user may write: end-of-run reports that would
    # end the run at once, and live learners with a tiny step time
    from broker.records import FinalPushes, Heartbeat, LearnerFinal

    lr = connect(learner_url)
    for ghost in ("g1", "g2", "g3"):
        registry.mark_final_pushes(lr, ctx.keys, ghost, FinalPushes([], 1, 1))
        registry.mark_learner_final(lr, ctx.keys, ghost, LearnerFinal())
        registry.heartbeat(lr, ctx.keys, ghost, Heartbeat(step_s=1e-6), ttl_s=600)
    good = signing.read_key(kdir / "learners" / "L2.sign")
    forged = signing.signed(good, "sec", contribution_fields("L2", 0, delta, step=996))
    forged["tokens"] = 10**9  # a signed entry altered on the way
    out[streams.push(0, forged)] = "bad signature"
    for p, names in enumerate(ctx.fragments):  # L1's plausible next keys, unsigned
        d = {k: np.full(ctx.shapes[k], 1e-3, np.float32) for k in names}
        for step in range(1, 31):
            out[streams.push(p, contribution_fields("L1", p, d, base_version=0, step=step,
                                                    steps=step))] = "unsigned"
    return out


def _rogue_syncers(syncer_url: str, reader_url: str, tmp_path: Path, kdir: Path,
                   stop: threading.Event) -> None:
    """Advertise two rogue PUB sockets in the run's endpoint hash (with the syncer's own
    credential) and publish forged values on them until `stop`: one CURVE server with another
    key pair (it even has the allowlist), one plaintext."""
    import numpy as np
    import zmq

    from broker import codec
    from broker.pubsub import CurveServer, Publisher
    from broker.records import SyncerInfo
    from ops.cluster import write_keys as curve_keys
    from pipeline import quant
    from workers.common import open_run

    curve_keys(tmp_path / "rogue-keys", ["X"])
    ctx_a, ctx_b = zmq.Context(), zmq.Context()
    pubs = [Publisher(ctx_a, "tcp://127.0.0.1:0", curve=CurveServer(
        str(tmp_path / "rogue-keys" / "syncer.key_secret"), str(kdir / "allow"))),
        Publisher(ctx_b, "tcp://127.0.0.1:0")]
    r = connect(syncer_url)
    ctx = open_run(reader_url, "sec", wait_s=60)
    n = 0
    try:
        while not stop.is_set():
            for i, pub in enumerate(pubs):
                registry.register_syncer(r, ctx.keys, f"rogue-{i}", SyncerInfo(
                    t=time.time(), endpoint=pub.endpoint,
                    fragments=list(range(len(ctx.fragments)))))
                for p, names in enumerate(ctx.fragments):
                    pub.publish(codec.global_frames("sec", p, 10**6, {
                        k: quant.quantize(np.full(ctx.shapes[k], 0.5, np.float32), "fp32")
                        for k in names}))
                    n += 1
            time.sleep(0.2)
    finally:
        (tmp_path / "rogue-published").write_text(str(n))
        for pub in pubs:
            pub.close()
        ctx_a.term()
        ctx_b.term()


# -- ZeroMQ CURVE ---------------------------------------------------------------------------------


def test_curve_only_allowed_learners_read_and_only_the_pinned_syncer_is_heard(tmp_path, caplog):
    caplog.set_level("WARNING", logger="diloco.pubsub")
    import numpy as np
    import zmq

    from broker import codec
    from broker.pubsub import CurveClient, CurveServer, Publisher, Subscriber
    from ops.cluster import write_keys as curve_keys
    from pipeline import quant

    keys, rogue_keys = tmp_path / "keys", tmp_path / "rogue"
    curve_keys(keys, ["L0", "L1"])
    curve_keys(rogue_keys, ["X"])  # another run's keys: an intruder and a rogue syncer
    assert (keys / "syncer.key_secret").stat().st_mode & 0o077 == 0
    assert (keys / "learners" / "L0.key_secret").stat().st_mode & 0o077 == 0
    ctx, rogue_ctx = zmq.Context(), zmq.Context()  # one ZAP handler per context
    pub = Publisher(ctx, "tcp://127.0.0.1:0", curve=CurveServer(
        str(keys / "syncer.key_secret"), str(keys / "allow")))
    rogue = Publisher(rogue_ctx, "tcp://127.0.0.1:0", curve=CurveServer(
        str(rogue_keys / "syncer.key_secret"), str(keys / "allow")))
    plain_pub = Publisher(ctx, "tcp://127.0.0.1:0")

    def sub(secret, server):
        return Subscriber(ctx, [0], curve=None if secret is None else CurveClient(
            str(secret), str(server)))

    allowed = sub(keys / "learners" / "L0.key_secret", keys / "syncer.key")
    intruder = sub(rogue_keys / "learners" / "X.key_secret", keys / "syncer.key")
    plaintext = sub(None, None)
    pinned = sub(keys / "learners" / "L1.key_secret", keys / "syncer.key")
    for s in (allowed, intruder, plaintext):
        s.connect([pub.endpoint])
    pinned.connect([rogue.endpoint, plain_pub.endpoint])  # a redirected endpoint hash
    frames = codec.global_frames("r", 0, 1, {"w": quant.quantize(np.ones(8, np.float32),
                                                                   "fp32")})
    got = {name: 0 for name in ("allowed", "intruder", "plaintext", "pinned")}
    subs = {"allowed": allowed, "intruder": intruder, "plaintext": plaintext, "pinned": pinned}
    deadline = time.monotonic() + 3.0
    try:
        while time.monotonic() < deadline:
            for p in (pub, rogue, plain_pub):
                p.publish(frames)
            for name, s in subs.items():
                while s.recv(10) is not None:
                    got[name] += 1
    finally:
        for s in subs.values():
            s.close()
        for p in (pub, rogue, plain_pub):
            p.close()
        ctx.term()
        rogue_ctx.term()
    assert got["allowed"] > 0, got
    assert got["intruder"] == got["plaintext"] == got["pinned"] == 0, got
    # the syncer's side says so: the intruder's key refused, by its fingerprint, once (it
    # retried for seconds: rate-limited), and no allowed learner's key
    import zmq.auth

    from broker.pubsub import key_fingerprint

    refused = [r.getMessage() for r in caplog.records
               if r.name == "diloco.pubsub" and "refused a ZeroMQ client" in r.getMessage()]
    intruder_key = zmq.auth.load_certificate(str(rogue_keys / "learners" / "X.key"))[0]
    assert len(refused) == 1 and key_fingerprint(intruder_key) in refused[0], refused
    for name in ("L0", "L1"):
        allowed_key = zmq.auth.load_certificate(str(keys / "learners" / f"{name}.key"))[0]
        assert key_fingerprint(allowed_key) not in refused[0]


def test_a_joining_learner_refuses_a_snapshot_the_syncers_did_not_attest(tmp_path, redis_url):
    """With CURVE, a stolen Redis credential that may write the run's values (the syncer's, the
    operator's) cannot feed a joining learner a forged model: a real syncer attests each
    fragment's value over ZeroMQ (`broker.attest`), and the learner refuses the forged
    snapshot — a finite value of the right run, fragment, names and shapes, whose own hash
    checks — until the real one is back, then joins from that and trains to the end."""
    import numpy as np
    from test_e2e import write_config

    from broker import codec, pieces
    from pipeline import quant

    kdir, url_file = tmp_path / "keys", tmp_path / "redis.url"
    url_file.write_text(redis_url)
    assert _cli("keys", "--out", str(kdir), "--learners", "L0").returncode == 0
    cfg_path = write_config(tmp_path, learners=1, steps=30)
    init = _cli("run", "--init-only", "--config", cfg_path, "--run", "att",
                "--redis-url-file", str(url_file))
    assert init.returncode == 0, init.stderr[-2000:]
    r, fk = connect(redis_url), RunKeys("att").fragment(0)
    logs = {n: open(tmp_path / f"{n}.log", "wb") for n in ("syncer", "L0")}
    cmds = {"syncer": [sys.executable, "-m", "workers.syncer", "--redis-url-file", str(url_file),
                       "--run", "att", "--curve-secret", str(kdir / "syncer.key_secret"),
                       "--curve-allow", str(kdir / "allow")],
            "L0": [sys.executable, "-m", "workers.learner", "--redis-url-file", str(url_file),
                   "--run", "att", "--id", "L0", "--curve-secret",
                   str(kdir / "learners" / "L0.key_secret"), "--curve-server-key",
                   str(kdir / "syncer.key")]}
    procs = {"syncer": subprocess.Popen(cmds["syncer"], cwd=REPO, stdout=logs["syncer"],
                                        stderr=subprocess.STDOUT)}
    try:
        deadline = time.monotonic() + 120
        while (real := pieces.read(r, fk.global_, max_bytes=2**30)) is None:
            assert time.monotonic() < deadline and procs["syncer"].poll() is None, \
                (tmp_path / "syncer.log").read_text()[-3000:]
            time.sleep(0.1)
        header, tensors = codec.unpack_snapshot(real)
        forged = codec.pack_snapshot("att", 0, header.version, {
            k: quant.quantize(quant.dequantize(q) + np.float32(0.5), q.codec)
            for k, q in tensors.items()})
        codec.unpack_snapshot(forged)  # a snapshot every check but the syncers' word passes
        r.set(fk.global_, bytes(forged))
        procs["L0"] = subprocess.Popen(cmds["L0"], cwd=REPO, stdout=logs["L0"],
                                       stderr=subprocess.STDOUT)
        refused = "is not the value the syncers attested"
        while refused not in (tmp_path / "L0.log").read_text():
            assert time.monotonic() < deadline and procs["L0"].poll() is None, \
                (tmp_path / "L0.log").read_text()[-3000:]
            time.sleep(0.1)
        restored = time.time()
        r.set(fk.global_, bytes(real))  # the real value back: the learner joins from it
        for n in ("L0", "syncer"):
            assert procs[n].wait(180) == 0, (tmp_path / f"{n}.log").read_text()[-3000:]
    finally:
        end_processes(procs, logs)
    joins = [f for _, f in r.xrange(RunKeys("att").events) if f[b"kind"] == b"join"]
    assert len(joins) == 1 and float(joins[0][b"t"]) > restored, joins
    r.close()


def test_signatures_cover_every_field_and_survive_the_trip_through_redis(tmp_path):
    import numpy as np
    from helpers_broker import contribution_fields

    from broker import signing

    key = signing.new_key()
    signing.write_key(tmp_path / "L0.sign", key)
    assert (tmp_path / "L0.sign").stat().st_mode & 0o077 == 0
    assert signing.read_key(tmp_path / "L0.sign") == key
    fields = signing.signed(key, "run", contribution_fields(
        "L0", 1, {"w": np.ones(4, np.float32)}, base_version=3, step=40))
    # as XREADGROUP returns it: bytes keys and values
    wire = {k.encode(): v if isinstance(v, bytes) else str(v).encode()
            for k, v in fields.items()}
    v = signing.Verifier(tmp_path)
    assert v.verify("run", wire) == "L0"
    with pytest.raises(signing.SignatureError, match="bad signature"):
        v.verify("other-run", wire)  # a signature does not carry over to another run
    for name in wire:
        if name in (b"payload", b"sig"):
            continue
        tampered = dict(wire)
        tampered[name] = wire[name] + b"0"
        with pytest.raises(signing.SignatureError, match="bad signature|no signing key"):
            v.verify("run", tampered)
    with pytest.raises(signing.SignatureError, match="unsigned"):
        v.verify("run", {k: x for k, x in wire.items() if k != b"sig"})
    with pytest.raises(signing.SignatureError, match="no signing key"):
        v.verify("run", {**wire, b"learner": b"L7"})
    with pytest.raises(signing.SignatureError, match="bad signature"):
        v.verify("run", {**wire, b"sig": "ü".encode()})
    (tmp_path / "bad.sign").write_text("zz")  # a file being copied in: skipped, not fatal
    assert signing.Verifier(tmp_path).verify("run", wire) == "L0"
    (tmp_path / "L0.sign").unlink()
    with pytest.raises(ValueError, match="no learner signing keys"):
        signing.Verifier(tmp_path)
    # end-of-run reports are signed too; another learner's name or an edit breaks them
    from broker.records import FinalPushes

    signing.write_key(tmp_path / "L1.sign", key)
    v = signing.Verifier(tmp_path)
    rep = signing.sign_record(key, "run", "final-pushes", "L1", FinalPushes([0, 1], 10, 99))
    assert v.record_ok("run", "final-pushes", "L1", rep)
    assert not v.record_ok("run", "final-pushes", "L2", rep)
    assert not v.record_ok("run", "final", "L1", rep)
    assert not v.record_ok("run", "final-pushes", "L1", FinalPushes([0, 1], 10, 99))
    assert not v.record_ok("run", "final-pushes", "L1", FinalPushes([0], 10, 99, rep.sig))
    # a signed heartbeat counts while fresh: an old one written back (a learner credential
    # may write the learners' records) keeps nobody alive
    import time

    from broker.records import Heartbeat

    fresh = signing.sign_record(key, "run", "heartbeat", "L1", Heartbeat(t=time.time(), step=5))
    old = signing.sign_record(key, "run", "heartbeat", "L1",
                              Heartbeat(t=time.time() - 120, step=5))
    v = signing.Verifier(tmp_path, heartbeat_max_age_s=65.0)
    assert v.record_ok("run", "heartbeat", "L1", fresh)
    assert not v.record_ok("run", "heartbeat", "L1", old)
    assert signing.Verifier(tmp_path).record_ok("run", "heartbeat", "L1", old)  # no bound


# -- security on by default --------------------------------------------------------------------


@pytest.mark.parametrize(("url", "loopback"), [
    ("redis://127.0.0.1:6379/0", True), ("redis://localhost/0", True),
    ("redis://[::1]:6379/0", True), ("unix:///tmp/redis.sock", True),
    ("redis://127.8.9.10:1/0", True), ("redis://10.0.0.5:6379/0", False),
    ("rediss://redis.example.org:6380/0", False),
])
def test_what_counts_as_this_host(url, loopback):
    from workers.common import is_loopback, security_missing

    assert is_loopback(url) == loopback
    assert bool(security_missing(url, curve=False, signed=False)) == (not loopback)


def test_roles_refuse_a_remote_redis_without_security_unless_told(tmp_path):
    remote = "redis://10.255.255.1:6379/0"  # never contacted: refused before connecting
    for role in ("learner", "syncer"):
        out = subprocess.run([sys.executable, "-m", f"workers.{role}", "--redis-url", remote,
                              "--run", "r"], capture_output=True, text=True, timeout=60,
                             cwd=REPO)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "is on another host" in out.stderr and "--insecure" in out.stderr
        assert "Traceback" not in out.stderr
    ran = _cli("run", "--redis-url", remote, "--run", "r")
    assert ran.returncode == 2 and "is on another host" in ran.stderr
    from workers.common import security_missing

    ok = "rediss://diloco-r-learner:pw@10.0.0.5:6380/0"
    assert security_missing(ok, curve=True, signed=True) == []
    assert security_missing(ok.replace("diloco-r-learner", "default"), curve=True,
                            signed=True) == ["an ACL user in the URL (diloco acl)"]
