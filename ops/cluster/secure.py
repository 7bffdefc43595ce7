"""Key material and users for a hardened run (docs/SECURITY.md): the CURVE and signing keys
of `diloco keys`, the role URL files of `diloco acl`, and `SecureSetup` — a TLS-only,
password-protected redis-server with a run's ACL users and keys, for tests and the security
benchmark."""

from __future__ import annotations

import os
import shutil
import urllib.parse
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


SECURE_EXTRA = ("diloco secure init needs its extra: pip install 'decoupled-diloco[secure]' "
                "(the certificates are made with the cryptography package)")


def _x509():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:
        raise ValueError(SECURE_EXTRA) from e
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _san(x509, host: str):
    import ipaddress

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def secure_init(out: Path, hosts: list[str], port: int = 6380, days: int = 365) -> list[str]:
    """An evaluation Redis for the hardened setup under `out`: a new CA, a server certificate
    for `hosts` (DNS names or IP addresses), a client certificate (ECDSA P-256, made with the
    `cryptography` package), a TLS-only `redis.conf` that requires client certificates, an
    ACL file whose `default` user is off and whose `admin` user has a new password (stored as
    its SHA-256, as Redis reads it), and `admin.url` (mode 600) naming the TLS files by paths
    relative to itself. Returns what went where, one line each.

    Raises:
        ValueError: `out` already holds a CA (nothing is overwritten), or the extra is missing.
    """
    import datetime
    import hashlib

    x509, hashes, serialization, ec, eku, oid = _x509()
    out = Path(out)
    if (out / "ca.key").exists():
        raise ValueError(f"{out}/ca.key exists: secure init never overwrites a CA")
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM,
                                 serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def cert(subject: str, key, issuer, issuer_key, *, ca: bool = False, usage=None,
             sans: list[str] = ()):
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(oid.COMMON_NAME, subject)]))
             .issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=days))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None),
                            critical=True))
        if ca:
            b = b.add_extension(x509.KeyUsage(True, False, False, False, False, True, True,
                                              False, False), critical=True)
        else:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName([_san(x509, h) for h in sans]),
                                critical=False)
        return b.sign(issuer_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(oid.COMMON_NAME, "diloco evaluation CA")])
    files: dict[str, bytes] = {"ca.key": key_pem(ca_key)}
    files["ca.crt"] = cert("diloco evaluation CA", ca_key, ca_name, ca_key, ca=True)
    for name, usage, sans in (("server", eku.SERVER_AUTH, hosts),
                              ("client", eku.CLIENT_AUTH, [])):
        k = ec.generate_private_key(ec.SECP256R1())
        files[f"{name}.key"] = key_pem(k)
        files[f"{name}.crt"] = cert(f"diloco {name}", k, ca_name, ca_key, usage=usage,
                                    sans=list(sans))
    password = signing.new_key().hex()
    files["users.acl"] = (
        "user default off\n"
        f"user admin on #{hashlib.sha256(password.encode()).hexdigest()} ~* &* +@all\n"
    ).encode()
    files["redis.conf"] = (
        "# written by diloco secure init: TLS only, client certificates required, ACL users\n"
        "# from users.acl. Start it in this folder (the paths are relative to it):\n"
        "#   cd <this folder> && redis-server ./redis.conf\n"
        "# and merge the persistence and memory settings of ops/redis.conf.\n"
        "port 0\n"
        f"tls-port {port}\n"
        "bind 0.0.0.0\n"
        "protected-mode yes\n"
        "tls-cert-file server.crt\ntls-key-file server.key\ntls-ca-cert-file ca.crt\n"
        "tls-auth-clients yes\n"
        "aclfile users.acl\n"
        "appendonly yes\nappendfsync everysec\nmaxmemory-policy noeviction\n").encode()
    host = hosts[0]
    files["admin.url"] = (f"rediss://admin:{password}@{host}:{port}/0?ssl_ca_certs=ca.crt"
                          "&ssl_certfile=client.crt&ssl_keyfile=client.key\n").encode()
    secret = {"ca.key", "server.key", "client.key", "users.acl", "admin.url"}
    old_umask = os.umask(0o077)
    try:
        for name, data in files.items():
            path = out / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(path, 0o600 if name in secret else 0o644)
    finally:
        os.umask(old_umask)
    return [f"{out}/ca.crt, client.crt, client.key   every host that reaches Redis (beside its "
            f"URL file); ca.key stays with you (it signs new certificates)",
            f"{out}/server.crt, server.key, redis.conf, users.acl   the Redis host: "
            f"cd {out} && redis-server ./redis.conf",
            f"{out}/admin.url   the operator (mode 600): diloco acl --apply --redis-url-file "
            f"{out}/admin.url …"]


def _bundle_url(url_file: Path, dest: Path) -> list[Path]:
    """Copy a role's URL file into the bundle folder `dest`, with the TLS files it names
    copied beside it and named by their file names only (found beside the URL file wherever
    the folder goes: `broker.connection.resolve_tls_files`); returns the files copied."""
    from broker.connection import TLS_FILES, resolve_tls_files

    text = url_file.read_text(encoding="utf-8").strip().splitlines()[0].strip()
    parts = urllib.parse.urlsplit(resolve_tls_files(text, url_file.resolve().parent))
    query, copied = [], []
    for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        if key in TLS_FILES and value:
            src = Path(value)
            target = dest / src.name
            if src.is_dir():
                shutil.copytree(src, target, dirs_exist_ok=True)
            else:
                shutil.copy(src, target)
                os.chmod(target, 0o600 if src.suffix == ".key" else 0o644)
            copied.append(target)
            value = src.name
        query.append((key, value))
    url = urllib.parse.urlunsplit(parts._replace(
        query=urllib.parse.urlencode(query, quote_via=urllib.parse.quote, safe="/")))
    signing.write_private(dest / url_file.name, url + "\n")
    return [dest / url_file.name, *copied]


def write_bundles(acl_dir: Path, keys_dir: Path, out: Path, learners: list[str]) -> list[str]:
    """One folder per host role under `out` holding exactly the files that host needs — its
    role's URL file with the TLS files it names (paths relative to the file), and its keys —
    and the command it runs there; returns one line per folder.

    Raises:
        FileNotFoundError: a file the bundles need is missing (named).
        ValueError: `out` exists already (bundles are never merged into old ones).
    """
    if out.exists():
        raise ValueError(f"{out} exists: bundles are written into a new folder")
    need = [acl_dir / f"{r}.url" for r in acl.ROLES] + [keys_dir / "syncer.key",
                                                       keys_dir / "syncer.key_secret"]
    need += [keys_dir / "learners" / f"{lid}.{ext}" for lid in learners
             for ext in ("key_secret", "sign")]
    for path in need:
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing (diloco acl and diloco keys write it)")
    lines = []
    old_umask = os.umask(0o077)
    try:
        for role in ("syncer", "operator", "reader"):
            dest = out / role
            dest.mkdir(parents=True)
            _bundle_url(acl_dir / f"{role}.url", dest)
            cmd = {"syncer": "diloco syncer --redis-url-file syncer.url --run RUN --id syncer-0 "
                             "--bind tcp://0.0.0.0:5555 --advertise-host HOST --curve-secret "
                             "syncer.key_secret --curve-allow allow --sign-keys signers",
                   "operator": "diloco init --redis-url-file operator.url --run RUN "
                               "--config my.toml",
                   "reader": "diloco status --redis-url-file reader.url --run RUN"}[role]
            if role == "syncer":
                shutil.copy(keys_dir / "syncer.key_secret", dest)
                shutil.copytree(keys_dir / "allow", dest / "allow")
                shutil.copytree(keys_dir / "signers", dest / "signers")
            lines.append(f"{dest}/   the {role}'s host; there: {cmd}")
        for lid in learners:
            dest = out / lid
            dest.mkdir(parents=True)
            _bundle_url(acl_dir / "learner.url", dest)
            shutil.copy(keys_dir / "syncer.key", dest)
            for ext in ("key_secret", "sign"):
                shutil.copy(keys_dir / "learners" / f"{lid}.{ext}", dest)
            lines.append(f"{dest}/   learner {lid}'s host; there: diloco learner "
                         f"--redis-url-file learner.url --run RUN --id {lid} --state-dir state "
                         f"--curve-secret {lid}.key_secret --curve-server-key syncer.key "
                         f"--sign-key {lid}.sign")
    finally:
        os.umask(old_umask)
    return lines
