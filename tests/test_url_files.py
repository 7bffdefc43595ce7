"""A host's URL file and the TLS files it names travel together: relative paths inside the file
are found beside it (else in the working folder), and a missing one is named in one line."""

from __future__ import annotations

import os

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
