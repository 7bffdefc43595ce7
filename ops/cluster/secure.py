"""Key material and users for a hardened run (docs/SECURITY.md): the CURVE and signing keys
of `diloco keys`, the role URL files of `diloco acl`, and `SecureSetup` — a TLS-only,
password-protected redis-server with a run's ACL users and keys, for tests and the security
benchmark."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import zmq.auth

from broker import acl, signing
from broker.connection import connect
from broker.pubsub import CurveClient
from ops.cluster.redis_server import RedisServer, TlsFiles


def write_role_urls(out: Path, users: list[acl.RoleUser], base_url: str) -> None:
    """Each role's URL (with its password) to ``out/<role>.url``, mode 600."""
    out.mkdir(parents=True, exist_ok=True)
    for u in users:
        signing.write_private(out / f"{u.role}.url", u.url(base_url) + "\n")


def write_keys(out: Path, ids: list[str], syncer: bool = True) -> list[str]:
    """Write a run's CURVE key pairs (the syncers', one per learner, the allowlist) and the
    learners' signing keys under `out` (`diloco keys`); return what went where, one line
    each."""
    out.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # secret files are never readable by others, not even briefly
    try:
        return _write_keys(out, ids, syncer)
    finally:
        os.umask(old_umask)


def _write_keys(out: Path, ids: list[str], syncer: bool) -> list[str]:
    lines = []
    if syncer:
        if (out / "syncer.key_secret").exists():
            raise ValueError("syncer.key_secret exists (use --add to add learners)")
        public, secret = zmq.auth.create_certificates(str(out), "syncer")
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        lines += [f"{out}/syncer.key_secret   every syncer host (--curve-secret), mode 600",
                  f"{out}/syncer.key          every learner host (--curve-server-key)"]
    elif not (out / "syncer.key").exists():
        raise ValueError("no syncer.key there to add learners to")
    for d in ("learners", "allow", "signers"):
        (out / d).mkdir(exist_ok=True)
    for lid in ids:
        if (out / "learners" / f"{lid}.key_secret").exists():
            raise ValueError(f"learners/{lid}.key_secret exists")
        public, secret = zmq.auth.create_certificates(str(out / "learners"), lid)
        os.chmod(secret, 0o600)
        key = signing.new_key()
        signing.write_key(out / "learners" / f"{lid}.sign", key)
        signing.write_key(out / "signers" / f"{lid}.sign", key)
        shutil.copy(public, out / "allow" / f"{lid}.key")
        os.chmod(out / "allow" / f"{lid}.key", 0o644)
        os.chmod(public, 0o644)
        lines.append(f"{out}/learners/{lid}.key_secret   learner {lid}'s host (--curve-secret)")
        lines.append(f"{out}/learners/{lid}.sign   learner {lid}'s host (--sign-key)")
    lines.append(f"{out}/allow/                 every syncer host (--curve-allow)")
    lines.append(f"{out}/signers/               every syncer host (--sign-keys), mode 600; a "
                 f"learner is revoked by deleting its files in allow/ and signers/ there and "
                 f"restarting the syncers")
    return lines


@dataclass
class SecureSetup:
    """A TLS-only redis-server (client certificates, an admin password) with the ACL users of
    `run` and the CURVE and signing keys of `learners`, all under `folder`. `start()`, then
    the role URL files and flags; `stop()` when done."""

    folder: Path
    run: str
    learners: list[str]
    server: RedisServer | None = None
    urls: dict[str, str] = field(default_factory=dict)

    def start(self) -> SecureSetup:
        self.folder.mkdir(parents=True, exist_ok=True)
        tls = TlsFiles.generate(self.folder / "tls")
        self.server = RedisServer(workdir=self.folder / "redis", appendonly=False,
                                  password=signing.new_key().hex(), tls=tls).start()
        users = acl.new_users(self.run)
        base = self.server.address_url()
        r = connect(self.server.url)
        for u in users:
            r.execute_command(*u.setuser(self.run))
        r.close()
        write_role_urls(self.folder / "acl", users, base)
        self.urls = {u.role: u.url(base) for u in users}
        write_keys(self.keys, self.learners)
        return self

    @property
    def admin_url(self) -> str:
        return self.server.url

    @property
    def keys(self) -> Path:
        return self.folder / "keys"

    def url_file(self, role: str) -> str:
        return str(self.folder / "acl" / f"{role}.url")

    def syncer_args(self) -> list[str]:
        return ["--redis-url-file", self.url_file("syncer"),
                "--curve-secret", str(self.keys / "syncer.key_secret"),
                "--curve-allow", str(self.keys / "allow"),
                "--sign-keys", str(self.keys / "signers")]

    def learner_args(self, learner: str) -> list[str]:
        return ["--redis-url-file", self.url_file("learner"),
                "--curve-secret", str(self.keys / "learners" / f"{learner}.key_secret"),
                "--curve-server-key", str(self.keys / "syncer.key"),
                "--sign-key", str(self.keys / "learners" / f"{learner}.sign")]

    def curve_client(self, learner: str) -> CurveClient:
        return CurveClient(str(self.keys / "learners" / f"{learner}.key_secret"),
                           str(self.keys / "syncer.key"))

    def sign_key(self, learner: str) -> bytes:
        return signing.read_key(self.keys / "learners" / f"{learner}.sign")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
