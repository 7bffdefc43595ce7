"""A host's URL file and the TLS files it names travel together: relative paths inside the file
are found beside it (else in the working folder), and a missing one is named in one line."""

from __future__ import annotations

import os
import urllib.parse

import pytest

from broker.connection import resolve_tls_files


def test_relative_tls_files_resolve_beside_the_url_file(tmp_path, monkeypatch):
    host = tmp_path / "bundle"
    host.mkdir()
    for name in ("ca.crt", "client.crt", "client.key"):
        (host / name).write_text("x")
    url = ("rediss://learner:s%3Acret@redis-host:6380/0?ssl_ca_certs=ca.crt"
           "&ssl_certfile=client.crt&ssl_keyfile=client.key&ssl_cert_reqs=required")
    monkeypatch.chdir(tmp_path)  # another folder: the files are not here
    got = resolve_tls_files(url, host)
    assert got.startswith("rediss://learner:s%3Acret@redis-host:6380/0?")
    assert f"ssl_ca_certs={host}/ca.crt" in got and f"ssl_keyfile={host}/client.key" in got
    assert "ssl_cert_reqs=required" in got
    # without a URL file: the working folder, as before
    monkeypatch.chdir(host)
    assert f"ssl_certfile={host}/client.crt" in resolve_tls_files(url)
    assert resolve_tls_files("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_missing_tls_file_is_named_without_the_password(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = "rediss://op:hunter2@h:6380/0?ssl_ca_certs=ca.crt"
    with pytest.raises(FileNotFoundError) as err:
        resolve_tls_files(url, tmp_path / "b")
    said = str(err.value)
    assert "ssl_ca_certs names ca.crt" in said and os.fspath(tmp_path / "b" / "ca.crt") in said
    assert "hunter2" not in said


def test_the_cli_names_the_missing_file_in_one_line(tmp_path, capsys):
    from ops.cli import main

    (tmp_path / "syncer.url").write_text(
        "rediss://syncer:pw@127.0.0.1:1/0?ssl_ca_certs=ca.crt&ssl_certfile=c.crt\n")
    with pytest.raises(SystemExit) as done:
        main(["status", "--redis-url-file", str(tmp_path / "syncer.url"), "--run", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and err[0].startswith("usage:"), err  # argparse's refusal
    assert "error: --redis-url-file" in err[-1] and "ssl_ca_certs names ca.crt" in err[-1], err
    assert ":pw@" not in "\n".join(err)


def test_redis_cli_command_keeps_the_password_off_argv(tmp_path):
    from ops.cli.tools import redis_cli_command

    for name in ("ca.crt", "c.crt", "c.key"):
        (tmp_path / name).write_text("x")
    url = (f"rediss://reader:s%40cret@redis-host:6380/3?ssl_ca_certs={tmp_path}/ca.crt"
           f"&ssl_certfile={tmp_path}/c.crt&ssl_keyfile={tmp_path}/c.key")
    argv, env = redis_cli_command(url, ["--", "XLEN", "k"])
    assert argv == ["redis-cli", "-h", "redis-host", "-p", "6380", "-n", "3", "--user", "reader",
                    "--tls", "--cacert", f"{tmp_path}/ca.crt", "--cert", f"{tmp_path}/c.crt",
                    "--key", f"{tmp_path}/c.key", "XLEN", "k"]
    assert env == {"REDISCLI_AUTH": "s@cret"}
    assert redis_cli_command("redis://127.0.0.1:7000", ["PING"]) == (
        ["redis-cli", "-h", "127.0.0.1", "-p", "7000", "PING"], {})


def test_redis_cli_reaches_the_hardened_redis(tmp_path, capfd):
    """Against a TLS-only Redis with client certificates and ACL users (what the docs set up),
    as the run's reader: redis-cli alone fails there (it ignores the URL's TLS parameters)."""
    from ops.cli import main
    from ops.cli.tools import redis_cli_command
    from ops.cluster.secure import SecureSetup

    sec = SecureSetup(tmp_path / "sec", "exp1", ["L0"]).start()
    try:
        # authenticated as the reader: it may read the run's keys, nothing else
        assert main(["redis-cli", "--redis-url-file", sec.url_file("reader"), "--",
                     "ACL", "WHOAMI"]) == 0
        out = capfd.readouterr().out.strip()
        assert out.startswith("NOPERM"), out
        password = urllib.parse.unquote(urllib.parse.urlsplit(sec.urls["reader"]).password)
        assert main(["redis-cli", "--redis-url-file", sec.url_file("reader"), "--",
                     "XLEN", "ddl:{exp1/f0001}:frags"]) == 0
        assert capfd.readouterr().out.strip() == "0"
        assert password not in " ".join(redis_cli_command(sec.urls["reader"], [])[0])
    finally:
        sec.stop()
