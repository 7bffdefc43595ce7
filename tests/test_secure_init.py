"""`diloco secure init`: the files of a hardened evaluation Redis, from nothing, that a
redis-server starts with and that every diloco command then reaches (before, the recipe needed
openssl commands, an admin password hashed by hand and outside knowledge)."""

from __future__ import annotations

import shutil
import stat
import subprocess
import time

import pytest
import redis

from ops.cli import main
from ops.cluster import free_port


@pytest.fixture
def hardened(tmp_path, capfd):
    port = free_port()
    out = tmp_path / "redis-files"
    assert main(["secure", "init", "--out", str(out), "--redis-host", "127.0.0.1,localhost",
                 "--port", str(port)]) == 0
    said = capfd.readouterr().out
    assert "redis-server ./redis.conf" in said and "admin.url" in said
    proc = subprocess.Popen(["redis-server", "./redis.conf"], cwd=out,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield out, port
    finally:
        proc.terminate()
        proc.wait(20)


def _wait_answering(url: str) -> redis.Redis:
    from broker.connection import connect

    deadline = time.monotonic() + 15
    while True:
        try:
            r = connect(url, retries=0)
            r.ping()
            return r
        except (redis.ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_secure_init_makes_a_redis_only_the_admin_reaches(hardened, capfd, tmp_path,
                                                          monkeypatch):
    out, port = hardened
    for name in ("ca.key", "server.key", "client.key", "users.acl", "admin.url"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    admin_url = (out / "admin.url").read_text().strip()
    assert "ssl_ca_certs=ca.crt" in admin_url  # relative: found beside the file
    from broker.connection import resolve_tls_files

    r = _wait_answering(resolve_tls_files(admin_url, out))
    assert r.execute_command("ACL", "WHOAMI") == b"admin"
    r.close()
    # the default user is off, and a client without a certificate is refused
    base = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={out}/ca.crt"
    with pytest.raises(redis.RedisError):
        redis.Redis.from_url(f"{base}&ssl_certfile={out}/client.crt"
                             f"&ssl_keyfile={out}/client.key").ping()
    with pytest.raises((redis.ConnectionError, OSError)):
        redis.Redis.from_url(base, socket_timeout=5).ping()
    # the next steps of the recipe, as README writes them: the roles' users (TLS files named
    # relative to the URL files, copied beside them), the keys, one bundle per host
    capfd.readouterr()
    acl_dir, keys_dir, hosts = tmp_path / "acl", tmp_path / "keys", tmp_path / "hosts"
    url = (f"rediss://127.0.0.1:{port}/0?ssl_ca_certs=ca.crt&ssl_certfile=client.crt"
           f"&ssl_keyfile=client.key")
    assert main(["acl", "--run", "exp1", "--url", url, "--out", str(acl_dir), "--apply",
                 "--redis-url-file", str(out / "admin.url")]) == 0
    for name in ("ca.crt", "client.crt", "client.key"):
        shutil.copy(out / name, acl_dir / name)
    assert main(["keys", "--out", str(keys_dir), "--learners", "L0,L1"]) == 0
    assert main(["bundle", "--acl", str(acl_dir), "--keys", str(keys_dir), "--learners",
                 "L0,L1", "--out", str(hosts)]) == 0
    said = capfd.readouterr().out
    assert "diloco learner --redis-url-file learner.url" in said, said
    tls = {"ca.crt", "client.crt", "client.key"}
    assert {p.name for p in (hosts / "L0").iterdir()} == {"learner.url", "syncer.key",
                                                          "L0.key_secret", "L0.sign", *tls}
    assert {p.name for p in (hosts / "syncer").iterdir()} == {
        "syncer.url", "syncer.key_secret", "allow", "signers", *tls}
    assert {p.name for p in (hosts / "reader").iterdir()} == {"reader.url", *tls}
    # a host's folder works from wherever a process is started
    monkeypatch.chdir(tmp_path)
    assert main(["redis-cli", "--redis-url-file", str(hosts / "reader" / "reader.url"), "--",
                 "XLEN", "ddl:{exp1/f0001}:frags"]) == 0
    assert capfd.readouterr().out.strip() == "0"
    assert main(["redis-cli", "--redis-url-file", str(out / "admin.url"), "--",
                 "ACL", "WHOAMI"]) == 0
    assert capfd.readouterr().out.strip().endswith("admin")
    learner = _wait_answering(resolve_tls_files(
        (hosts / "L1" / "learner.url").read_text().strip(), hosts / "L1"))
    learner.close()
    # never over an existing CA
    assert main(["secure", "init", "--out", str(out), "--redis-host", "127.0.0.1"]) == 2
