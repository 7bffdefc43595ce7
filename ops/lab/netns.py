"""Sites on one machine: network namespaces, shaped veth links, CPU quotas, interface counters.

Layout (one lab; every name carries the controller's pid, so labs never collide and a crashed
lab's leftovers are recognisable)::

    hub ns (Redis, syncers) --eth0-- [hub]  router ns  [s0] --eth0-- site ns 0 (learner L0)
                                          (bridge)     [s1] --eth0-- site ns 1 (learner L1)
    root ns (the controller) --mgmt-- hub ns                          ...

* The router namespace joins the ports: a kernel bridge when no site has a round-trip time,
  else :mod:`ops.lab.forwarder`, a user-space bridge that delays every frame (the kernel here
  has no ``netem``).
* A site's link rate is ``tbf`` on both directions: the site's ``eth0`` egress (upload) and the
  router's port egress (download). Segmentation offloads are off on every lab interface, so
  the interface counters (and ``tbf``) see frames as they would cross a real link, Ethernet,
  IP and TCP headers included.
* A site's CPU share is a CPU cgroup quota (v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``): the
  shares are relative and together get the whole machine (or `cpu_total` cores).
* The controller reaches the hub over a management veth that is not a site link (evaluation
  and supervision never cross a shaped link or count as a site's bytes).

Everything is removed by `Lab.down` (processes in the namespaces first). If the controller
dies without running it (SIGKILL, a crash of the interpreter), a reaper process it started
(``python -m ops.lab.netns reap <pid>``) notices and removes the lab; the next lab also sweeps
whatever a dead controller left (`sweep`).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("diloco.lab")

PREFIX = "dlab"  # namespaces: dlab<pid>-hub, dlab<pid>-r, dlab<pid>-s<i>
SUBNET = "10.201.0"  # sites' network (in the namespaces only)
HUB_IP = f"{SUBNET}.1"
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000
NETNS_DIR = Path("/run/netns")

SIOCETHTOOL = 0x8946
ETHTOOL_STSO = 0x1F
ETHTOOL_SGSO = 0x24
ETHTOOL_SGRO = 0x2C


class LabUnavailable(RuntimeError):
    """This machine cannot host a lab (not root, no network namespaces, no tc)."""


@dataclass(frozen=True)
class SiteSpec:
    """One site: its link rate (Mbit/s each way; 0: unshaped), round-trip time to the hub
    (ms) and relative CPU share (1.0: an equal share; 0: no quota)."""

    link_mbps: float = 0.0
    rtt_ms: float = 0.0
    cpu: float = 1.0


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)}: {p.stderr.strip() or p.returncode}")
    return p


def check_capability() -> str | None:
    """None if a lab can be built here, else the reason (one line)."""
    if os.geteuid() != 0:
        return "diloco lab needs root (network namespaces, tc and cgroups need CAP_NET_ADMIN " \
               "and CAP_SYS_ADMIN); run it as root or in a privileged container"
    for tool in ("ip", "tc"):
        if not any((Path(d) / tool).exists() for d in os.environ.get(
                "PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(":") + ["/usr/sbin", "/sbin"]):
            return f"diloco lab needs the {tool!r} command (iproute2)"
    name = f"{PREFIX}{os.getpid()}-probe"
    p = _run("ip", "netns", "add", name, check=False)
    if p.returncode != 0:
        return f"diloco lab cannot create a network namespace: {p.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


def _ethtool_off(ifname: str) -> None:
    """Segmentation and receive offloads off on `ifname` (in this namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for cmd in (ETHTOOL_STSO, ETHTOOL_SGSO, ETHTOOL_SGRO):
            val = ctypes.create_string_buffer(struct.pack("II", cmd, 0))
            ifr = struct.pack("16sP", ifname.encode(), ctypes.addressof(val))
            ifr += b"\0" * (40 - len(ifr))
            try:
                fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifr)
            except OSError as e:  # a kernel without the knob: counters then see TSO frames
                log.warning("cannot turn offload %#x off on %s: %s", cmd, ifname, e)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _ns_pids(ns: str) -> list[int]:
    p = _run("ip", "netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _cgroup_root() -> tuple[Path, str] | None:
    """(folder that gets the lab's cgroups, "v1" | "v2"), or None without a CPU controller."""
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        return CGROUP_V1, "v1"
    ctl = CGROUP_V2 / "cgroup.controllers"
    if ctl.exists() and "cpu" in ctl.read_text().split():
        sub = CGROUP_V2 / "cgroup.subtree_control"
        if "cpu" not in sub.read_text().split():
            try:
                sub.write_text("+cpu")
            except OSError:
                return None
        return CGROUP_V2, "v2"
    return None


def _remove_cgroup(path: Path) -> None:
    if not path.exists():
        return
    for child in sorted((p for p in path.iterdir() if p.is_dir()), reverse=True):
        _remove_cgroup(child)
    for _ in range(50):
        try:
            path.rmdir()
            return
        except OSError:  # a process still leaving
            procs = path / "cgroup.procs"
            for pid in (procs.read_text().split() if procs.exists() else []):
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
    log.warning("could not remove cgroup %s", path)


def _owner(name: str) -> int | None:
    """The controller pid in a lab's name (``dlab<pid>…``)."""
    m = re.match(rf"{PREFIX}(\d+)", name)
    return int(m.group(1)) if m else None


def sweep(owner_alive=_alive, only: int | None = None) -> list[str]:
    """Remove what labs of dead controllers left (namespaces, cgroups); return what went.
    With `only`, just the labs of controller `only` (dead or not)."""
    if only is not None:
        owner_alive = lambda pid: pid != only  # noqa: E731 (a zombie still answers kill(0))
    gone = []
    names = [p.name for p in NETNS_DIR.iterdir()] if NETNS_DIR.exists() else []
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = _owner(name)
        if pid is not None and not owner_alive(pid):
            for p in _ns_pids(name):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run("ip", "netns", "del", name, check=False)
            gone.append(name)
    root = _cgroup_root()
    if root is not None:
        for d in root[0].glob(f"{PREFIX}*"):
            pid = _owner(d.name)
            if pid is not None and not owner_alive(pid):
                _remove_cgroup(d)
                gone.append(str(d))
    return gone


@dataclass
class Lab:
    """A hub and `sites` on this machine. `up()` builds it, `down()` removes it (idempotent).

    Args:
        sites: One spec per site.
        cpu_total: Cores the sites' quotas add up to (default: the cores this process may
            run on).
    """

    sites: list[SiteSpec]
    cpu_total: float | None = None
    name: str = field(init=False)
    forwarder: subprocess.Popen | None = field(init=False, default=None)
    cgroup: Path | None = field(init=False, default=None)
    cgroup_kind: str = field(init=False, default="")
    mgmt_ip: str = field(init=False)
    built: bool = field(init=False, default=False)
    quotas: list[float] = field(init=False, default_factory=list)

    def __post_init__(self):
        self.name = f"{PREFIX}{os.getpid()}"  # one lab per controller at a time
        self.mgmt_ip = self._mgmt_host = ""
        self._partitioned: set[int] = set()

    # -- names ---------------------------------------------------------------------------------

    @property
    def hub(self) -> str:
        return f"{self.name}-hub"

    @property
    def router(self) -> str:
        return f"{self.name}-r"

    def site(self, i: int) -> str:
        return f"{self.name}-s{i}"

    def site_ip(self, i: int) -> str:
        return f"{SUBNET}.{11 + i}"

    @property
    def namespaces(self) -> list[str]:
        return [self.hub, self.router, *(self.site(i) for i in range(len(self.sites)))]

    # -- building ------------------------------------------------------------------------------

    def up(self) -> Lab:
        reason = check_capability()
        if reason:
            raise LabUnavailable(reason)
        sweep()
        self._start_reaper()
        self.built = True
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _start_reaper(self) -> None:
        # run by its path: this file imports only the standard library, so the reaper starts
        # in milliseconds and cannot fail on the package's imports
        self.reaper = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "reap", str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def _veth(self, a_ns: str | None, a: str, b_ns: str, b: str) -> None:
        """A veth pair with offloads off: `a` in `a_ns` (None: this namespace), `b` in `b_ns`."""
        tmp_a, tmp_b = f"dla{os.getpid():x}", f"dlb{os.getpid():x}"
        _run("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        try:
            _ethtool_off(tmp_a)
            _ethtool_off(tmp_b)
            for tmp, ns, name in ((tmp_a, a_ns, a), (tmp_b, b_ns, b)):
                if ns is None:
                    _run("ip", "link", "set", "dev", tmp, "name", name)
                else:
                    _run("ip", "link", "set", "dev", tmp, "netns", ns)
                    _run("ip", "-n", ns, "link", "set", "dev", tmp, "name", name)
        except BaseException:
            _run("ip", "link", "del", tmp_a, check=False)
            raise

    def _build(self) -> None:
        for ns in self.namespaces:
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        ports = {"hub": 0.0}
        self._veth(self.router, "hub", self.hub, "eth0")
        _run("ip", "-n", self.hub, "addr", "add", f"{HUB_IP}/24", "dev", "eth0")
        for i, s in enumerate(self.sites):
            ns = self.site(i)
            self._veth(self.router, f"s{i}", ns, "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{self.site_ip(i)}/24", "dev", "eth0")
            ports[f"s{i}"] = s.rtt_ms / 2
        for ns in (self.hub, *(self.site(i) for i in range(len(self.sites)))):
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
        for p in ports:
            _run("ip", "-n", self.router, "link", "set", p, "up")
        # the controller's management link to the hub (never shaped, never counted), on a
        # /30 no other interface here uses
        used = {a.get("local", "") for link in json.loads(
            _run("ip", "-j", "addr", "show").stdout or "[]") for a in link.get("addr_info", [])}
        k = next((k for k in range(1, 255) if f"10.202.{k}.1" not in used), None)
        if k is None:
            raise LabUnavailable("no free 10.202.k.0/30 for the lab's management link")
        self.mgmt_ip, self._mgmt_host = f"10.202.{k}.2", f"10.202.{k}.1"
        mg = f"dlm{os.getpid():x}"
        self._veth(None, mg, self.hub, "mgmt")
        _run("ip", "addr", "add", f"{self._mgmt_host}/30", "dev", mg)
        _run("ip", "link", "set", mg, "up")
        _run("ip", "-n", self.hub, "addr", "add", f"{self.mgmt_ip}/30", "dev", "mgmt")
        _run("ip", "-n", self.hub, "link", "set", "mgmt", "up")
        self._mgmt_if = mg
        for i, s in enumerate(self.sites):
            if s.link_mbps > 0:
                self._shape(self.site(i), "eth0", s.link_mbps)
                self._shape(self.router, f"s{i}", s.link_mbps)
        if any(s.rtt_ms > 0 for s in self.sites):
            self._start_forwarder(ports)
        else:
            _run("ip", "-n", self.router, "link", "add", "br0", "type", "bridge")
            for p in ports:
                _run("ip", "-n", self.router, "link", "set", p, "master", "br0")
            _run("ip", "-n", self.router, "link", "set", "br0", "up")
        self._cgroups()

    @staticmethod
    def _shape(ns: str, dev: str, mbps: float) -> None:
        # burst: 10 ms of the rate, at least 2 full frames; queue: 1 s of the rate (a WAN
        # router's buffer; TCP keeps it from filling)
        rate_bps = mbps * 1e6
        burst = max(3100, int(rate_bps / 8 * 0.01))
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
             f"{int(rate_bps)}bit", "burst", str(burst), "latency", "1000ms")

    def _start_forwarder(self, ports: dict[str, float]) -> None:
        cmd = self.wrap(self.router, [sys.executable,
                                      str(Path(__file__).resolve().with_name("forwarder.py")),
                                      *(f"{p}:{ms}" for p, ms in ports.items())])
        self.forwarder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)
        line = self.forwarder.stdout.readline().strip()
        if line != "ready":
            err = self.forwarder.stderr.read()[-2000:] if self.forwarder.poll() is not None \
                else ""
            raise RuntimeError(f"the lab's forwarder did not start: {line!r} {err}")

    def _cgroups(self) -> None:
        found = _cgroup_root()
        quota_sites = [s.cpu for s in self.sites]
        if found is None:
            if any(c > 0 for c in quota_sites) and len(set(quota_sites)) > 1:
                raise LabUnavailable("unequal --site-cpu needs a CPU cgroup controller "
                                     "(cgroup v1 cpu or v2 cpu.max); none is mounted here")
            return
        root, self.cgroup_kind = found
        total = self.cpu_total or float(len(os.sched_getaffinity(0)))
        weights = sum(c for c in quota_sites if c > 0)
        self.cgroup = root / self.name
        self.cgroup.mkdir()
        if self.cgroup_kind == "v2":
            (self.cgroup / "cgroup.subtree_control").write_text("+cpu")
        self.quotas = []
        for i, c in enumerate(quota_sites):
            d = self.cgroup / f"s{i}"
            d.mkdir()
            cores = total * c / weights if c > 0 else 0.0
            self.quotas.append(cores)
            if cores <= 0:
                continue
            quota = max(1000, int(cores * PERIOD_US))
            if self.cgroup_kind == "v1":
                (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (d / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")

    # -- using it ------------------------------------------------------------------------------

    def wrap(self, ns: str, cmd: list[str]) -> list[str]:
        """`cmd` run in namespace `ns` (and, for a site, in the site's CPU cgroup)."""
        inner = ["ip", "netns", "exec", ns, *cmd]
        site = next((i for i in range(len(self.sites)) if self.site(i) == ns), None)
        if site is None or self.cgroup is None:
            return inner
        procs = self.cgroup / f"s{site}" / "cgroup.procs"
        return ["sh", "-c", 'echo $$ > "$1" && shift && exec "$@"', "sh", str(procs), *inner]

    def check(self) -> None:
        """Raise if a process the lab's links depend on (the forwarder) died."""
        if self.forwarder is not None and self.forwarder.poll() is not None:
            raise RuntimeError(f"the lab's forwarder exited ({self.forwarder.returncode}): "
                               f"every site is cut off")

    def set_link(self, i: int, up: bool) -> None:
        """Partition site `i` (its router port down) or heal it."""
        _run("ip", "-n", self.router, "link", "set", f"s{i}", "up" if up else "down")
        (self._partitioned.discard if up else self._partitioned.add)(i)

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes and packets on each router port, as the port sees them: ``tx`` is what went
        to the site (its download), ``rx`` what came from it (its upload); keys ``s<i>``, hub."""
        p = _run("ip", "-n", self.router, "-s", "-j", "link", "show")
        out = {}
        for link in json.loads(p.stdout):
            name = link.get("ifname", "")
            if name == "hub" or (name.startswith("s") and name[1:].isdigit()):
                st = link.get("stats64", link.get("stats", {}))
                out[name] = {"rx_bytes": st["rx"]["bytes"], "rx_packets": st["rx"]["packets"],
                             "tx_bytes": st["tx"]["bytes"], "tx_packets": st["tx"]["packets"]}
        return out

    # -- removal -------------------------------------------------------------------------------

    def down(self) -> None:
        """Remove everything the lab created: processes, namespaces, links, cgroups."""
        if not self.built:
            return
        if self.forwarder is not None and self.forwarder.poll() is None:
            self.forwarder.terminate()
            try:
                self.forwarder.wait(5)
            except subprocess.TimeoutExpired:
                self.forwarder.kill()
                self.forwarder.wait()
        if self.forwarder is not None:
            for pipe in (self.forwarder.stdout, self.forwarder.stderr):
                pipe.close()
        for ns in self.namespaces:
            for pid in _ns_pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in self.namespaces:
            if (NETNS_DIR / ns).exists():
                _run("ip", "netns", "del", ns, check=False)
        mg = getattr(self, "_mgmt_if", None)
        if mg:
            _run("ip", "link", "del", mg, check=False)
        if self.cgroup is not None:
            _remove_cgroup(self.cgroup)
        self.built = False
        reaper = getattr(self, "reaper", None)
        if reaper is not None and reaper.poll() is None:
            reaper.terminate()
            reaper.wait()

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def leftovers(pid: int | None = None) -> list[str]:
    """What labs of controller `pid` (default: any) left on this machine: namespaces, cgroups,
    interfaces in this namespace, processes in the namespaces."""
    def ours(name: str) -> bool:
        owner = _owner(name)
        return owner is not None and (pid is None or owner == pid)

    out = [n.name for n in NETNS_DIR.iterdir() if ours(n.name)] if NETNS_DIR.exists() else []
    out += [f"pid {p} in {ns}" for ns in list(out) for p in _ns_pids(ns)]
    root = _cgroup_root()
    if root is not None:
        out += [str(d) for d in root[0].glob(f"{PREFIX}*") if ours(d.name)]
    links = _run("ip", "-j", "link", "show", check=False).stdout or "[]"
    tags = tuple(t if pid is None else f"{t}{pid:x}" for t in ("dla", "dlb", "dlm"))
    out += [ln["ifname"] for ln in json.loads(links)
            if ln.get("ifname", "").split("@")[0] in tags
            or (pid is None and ln.get("ifname", "").startswith(tags))]
    return out


def _reap(pid: int) -> int:
    """Wait for controller `pid` to die, then remove its labs (the reaper's whole job)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the controller, not here
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # the lab came down cleanly
    while not stop:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "X"
        if state in ("Z", "X"):
            sweep(only=pid)
            return 0
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "reap":
        raise SystemExit(_reap(int(sys.argv[2])))
    sys.stderr.write("usage: python -m ops.lab.netns reap PID\n")
    raise SystemExit(2)
