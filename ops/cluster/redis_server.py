"""An embedded redis-server: a free port, a temporary folder, AOF persistence, clean shutdown."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import redis

from broker.signing import write_private

INSTALL_HINT = ("redis-server was not found on PATH. Install it (Debian/Ubuntu: "
                "`sudo apt-get install -y redis-server`; macOS: `brew install redis`) or pass "
                "--redis-url redis://HOST:PORT/0 to use a running server.")


_HANDED_OUT: set[int] = set()
_HANDED_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, and never one this process handed out before.

    The kernel may give the port it just gave again once the probing socket is closed, and
    the ports are taken only later, when the servers start: a cluster node's client and bus
    ports, or two nodes, would then collide ("Address already in use")."""
    with _HANDED_LOCK:
        for _ in range(1000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError("no TCP port free on 127.0.0.1 that this process has not handed out")


@dataclass(frozen=True)
class TlsFiles:
    """Certificates for a TLS redis-server and its clients (PEM files)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_params(self) -> dict[str, str]:
        """redis-py connection arguments (also as ``rediss://`` URL query parameters)."""
        return {"ssl_ca_certs": str(self.ca), "ssl_certfile": str(self.client_cert),
                "ssl_keyfile": str(self.client_key)}

    @classmethod
    def generate(cls, folder: Path, host: str = "127.0.0.1") -> TlsFiles:
        """A new CA, a server certificate for `host` and a client certificate, with openssl
        (tests and local experiments; production certificates come from your own CA)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        f = cls(*(folder / n for n in ("ca.crt", "server.crt", "server.key", "client.crt",
                                         "client.key")))

        def ssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)

        ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=diloco-test-ca", "-keyout", "ca.key", "-out", "ca.crt")
        ext = folder / "san.ext"
        ext.write_text(f"subjectAltName=IP:{host}\n" if host.replace(".", "").isdigit()
                       else f"subjectAltName=DNS:{host}\n")
        for name, cn in (("server", host), ("client", "diloco-client")):
            ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout",
                f"{name}.key", "-out", f"{name}.csr")
            ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-out", f"{name}.crt",
                *(["-extfile", "san.ext"] if name == "server" else []))
        for key in folder.glob("*.key"):
            key.chmod(0o600)
        return f


class RedisServer:
    """Start with `start()`, stop with `stop()` (or use as a context manager).

    Args:
        workdir: folder for the AOF and logs (default: a new temporary folder, removed on stop).
        appendonly: AOF with appendfsync everysec (survives a restart with at most ~1 s lost).
        port: TCP port (default: a free one).
        password: require this password (``requirepass``, written to a mode-600 file in the
            work folder, not onto redis-server's command line); `url` then carries it.
        tls: serve TLS only (no plaintext port), requiring client certificates: a `TlsFiles`
            of the server's certificate and key and the CA that signed the clients'; `url` is
            then ``rediss://…`` with the client certificate, key and CA as query parameters.
        host: The address the server binds, and `url` names (default: loopback).
        also_bind: More addresses it binds (`address_url` names them with ``host=``).
        prefix: Start the server through this command prefix (``ip netns exec <ns>``: the
            lab's hub namespace).
        extra: More redis-server arguments (a cluster node's, `ClusterServers`).
    """

    def __init__(self, workdir: str | Path | None = None, appendonly: bool = True,
                 port: int | None = None, password: str | None = None,
                 tls: TlsFiles | None = None, host: str = "127.0.0.1",
                 also_bind: tuple[str, ...] = (), prefix: list[str] | None = None,
                 extra: tuple[str, ...] = ()):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError(INSTALL_HINT)
        self._tmp = None if workdir else tempfile.mkdtemp(prefix="diloco-redis-")
        self.workdir = Path(workdir or self._tmp).resolve()  # redis-server chdirs into it
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.password = password
        self.tls = tls
        self.host = host
        self.also_bind = tuple(also_bind)
        self.prefix = list(prefix or [])
        self.extra = tuple(extra)

    @property
    def url(self) -> str:
        """The URL of the server's admin (the ``default`` user with the password, if any)."""
        auth = f"default:{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return self.address_url(auth)

    def address_url(self, auth: str = "", host: str | None = None) -> str:
        """The server's URL (with TLS settings) for the user and password in `auth`
        (``user:password@``; empty: none), at `host` (default: the one it was given)."""
        host = host or self.host
        if self.tls is None:
            return f"redis://{auth}{host}:{self.port}/0"
        return f"rediss://{auth}{host}:{self.port}/0?" + urllib.parse.urlencode(
            self.tls.client_params(), safe="/")

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        conf = []
        if self.password is not None:
            path = self.workdir / "auth.conf"
            write_private(path, f'requirepass "{self.password}"\n')
            conf = [str(path)]
        ports = ["--port", str(self.port)]
        if self.tls is not None:
            t = self.tls
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file",
                     str(t.server_cert), "--tls-key-file", str(t.server_key),
                     "--tls-ca-cert-file", str(t.ca), "--tls-auth-clients", "yes"]
        args = [*self.prefix, self.binary, *conf, *ports, "--bind", self.host, *self.also_bind,
                "--dir", str(self.workdir), "--save", "", "--daemonize", "no",
                "--protected-mode", "yes", "--logfile", str(self.workdir / "redis.log"),
                "--maxmemory-policy", "noeviction"]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        args += list(self.extra)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=1.0,
                             password=self.password,
                             **({"ssl": True, **self.tls.client_params()} if self.tls else {}))
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.workdir / "redis.log")
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}: "
                                       f"{tail}") from e
                time.sleep(0.02)
        client.close()
        return self

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests); the folder and its AOF stay."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ClusterServers:
    """A local Redis Cluster: `masters` primaries with `replicas` replicas each, every node a
    `RedisServer` (AOF everysec, its own folder) started with ``--cluster-enabled yes`` and
    joined with ``redis-cli --cluster create``. `url` names the first node: a plain
    ``redis://`` URL, as an operator would give any node's.

    Args:
        workdir: folder of the nodes' folders (default: a new temporary folder, removed on
            stop).
        masters, replicas: the topology (3 and 1: six nodes).
        node_timeout_ms: ``cluster-node-timeout``: how long a master may be unreachable
            before its replica is promoted.
    """

    def __init__(self, workdir: str | Path | None = None, masters: int = 3, replicas: int = 1,
                 node_timeout_ms: int = 1000, appendonly: bool = True):
        if shutil.which("redis-cli") is None:
            raise FileNotFoundError("redis-cli was not found on PATH (it comes with "
                                    "redis-server: " + INSTALL_HINT + ")")
        self._tmp = None if workdir else tempfile.mkdtemp(prefix="diloco-cluster-")
        self.workdir = Path(workdir or self._tmp).resolve()
        self.n = masters * (1 + replicas)
        self.masters_n, self.replicas = masters, replicas
        self.nodes = [RedisServer(workdir=self.workdir / f"node{i}", appendonly=appendonly,
                                  extra=("--cluster-enabled", "yes", "--cluster-config-file",
                                         "nodes.conf", "--cluster-node-timeout",
                                         str(node_timeout_ms),
                                         # the bus port (default: port + 10000, which may not
                                         # exist or be free)
                                         "--cluster-port", str(free_port())))
                      for i in range(self.n)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 60.0) -> ClusterServers:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(["redis-cli", "--cluster", "create",
                            *(f"{n.host}:{n.port}" for n in self.nodes),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout_s)
            self.wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _client(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(host=node.host, port=node.port, socket_timeout=2.0)

    def state(self) -> dict[int, dict]:
        """Each live node's ``CLUSTER INFO`` and ``ROLE`` (node index → {"ok", "role"})."""
        out = {}
        for i, node in enumerate(self.nodes):
            if node.proc is None or node.proc.poll() is not None:
                continue
            c = self._client(node)
            try:
                info = c.execute_command("CLUSTER", "INFO").decode()
                role = c.execute_command("ROLE")
                out[i] = {"ok": "cluster_state:ok" in info,
                          "role": role[0].decode(),
                          "link_up": role[0] != b"slave" or role[3] == b"connected"}
            except redis.RedisError:
                continue
            finally:
                c.close()
        return out

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Until every live node says the cluster is ok, every master has its replicas and
        every replica's link to its master is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.state()
            masters = [i for i, x in st.items() if x["role"] == "master"]
            if (st and all(x["ok"] and x["link_up"] for x in st.values())
                    and len(masters) == self.masters_n):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not become ok: {st}")
            time.sleep(0.1)

    def master_indexes(self) -> list[int]:
        return sorted(i for i, x in self.state().items() if x["role"] == "master")

    def kill(self, i: int) -> None:
        """SIGKILL node i (its replica is promoted after the node timeout)."""
        self.nodes[i].kill()

    def restart(self, i: int) -> None:
        """Start node i again (same port and folder: it rejoins, as a replica if it was
        failed over)."""
        self.nodes[i].start()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> ClusterServers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
