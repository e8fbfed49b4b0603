"""Several "hosts" on one machine: network namespaces joined by veth pairs, for tests and benchmarks.

    with Testbed(2) as tb:                       # hosts tb.names[0], tb.names[1]
        tb.shape(1, delay_ms=5, rate="1gbit")    # optional tc netem/tbf on host 1's link
        tb.quick_ack(1)                          # optional: no delayed ACKs from host 1
        p = tb.popen(0, ["python", "server.py"]) # runs inside host 0 (own hostname too)
        tb.run(1, ["ping", "-c1", tb.addr(0)])
        tb.cut(1)                                # host 1's link goes down (packets dropped)
    # everything removed: processes started here (by pid), namespaces, /etc/netns files

Each host is a namespace with loopback and one interface ``eth0`` at ``10.213.<net>.<i+1>/24``,
whose veth peer sits on a bridge in a hub namespace of the testbed; nothing is added to
the machine's own network namespace, so traffic can only reach addresses assigned here.
Host names (``<name>``) resolve inside every host through ``/etc/netns/<ns>/hosts``,
bound over /etc/hosts for the commands run there.
Names carry the creating process's pid: ``remove_stale()`` deletes testbeds whose
creator is gone (after a SIGKILL), by name. Needs root and iproute2 (``ip``, ``tc``);
``unshare`` gives each command its host's name (``socket.gethostname()``).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Optional, Sequence

PREFIX = "mwtb"
_live: list["Testbed"] = []


def available() -> Optional[str]:
    """None when testbeds can be made here, else the reason why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces of testbeds whose creating process no longer exists."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{prefix}(\d+)(hub|h)\d+(n\d+)?", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            removed.append(name)
    return removed


class Testbed:
    """``n`` hosts on a private /24; see the module docstring."""

    def __init__(self, n: int, net: int = 0, host_names: Optional[Sequence[str]] = None, prefix: str = PREFIX):
        if not 1 <= n <= 200 or not 0 <= net <= 255:
            raise ValueError("1..200 hosts on 10.213.<net>.0/24, net in 0..255")
        tag = f"{prefix}{os.getpid()}"
        self.n = n
        self.hub = f"{tag}hub{len(_live)}"
        self.ns = [f"{tag}h{len(_live)}n{i}" for i in range(n)]
        self.names = list(host_names) if host_names else [f"node{i}" for i in range(n)]
        self._net = net
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def addr(self, i: int) -> str:
        return f"10.213.{self._net}.{i + 1}"

    # --- lifecycle ----------------------------------------------------------------------
    def create(self) -> "Testbed":
        _live.append(self)
        try:
            self._add_ns(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            hosts = "127.0.0.1 localhost\n" + "".join(f"{self.addr(i)} {h}\n" for i, h in enumerate(self.names))
            for i, ns in enumerate(self.ns):
                self._add_ns(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.hub)
                _ip("-n", self.hub, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", self.hub, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
                with open(f"/etc/netns/{ns}/hosts", "w") as f:
                    f.write(hosts)
        except BaseException:
            self.destroy()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def destroy(self) -> None:
        """Kill what ``popen`` started (process groups, by pid), then delete the namespaces."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self._made.clear()
        if self in _live:
            _live.remove(self)

    def __enter__(self) -> "Testbed":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()

    # --- running things -----------------------------------------------------------------
    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run on host ``i``: its network namespace, its own hostname and
        /etc/hosts. (Not ``ip netns exec``: that remounts /sys, hiding /sys/fs/cgroup, which
        slurmd needs.) The wrappers exec, so the returned process is ``argv`` itself."""
        return ["nsenter", f"--net=/run/netns/{self.ns[i]}", "unshare", "--uts", "--mount", "sh", "-c",
                'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"',
                self.names[i], f"/etc/netns/{self.ns[i]}/hosts", *argv]

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` on host ``i`` in a session of its own; ``destroy`` kills its group."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.command(i, argv), **kw)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: Sequence[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(i, argv), timeout=timeout, **kw)

    # --- the links ----------------------------------------------------------------------
    def shape(self, i: int, rate: Optional[str] = None, delay_ms: float = 0, loss_pct: float = 0,
              burst: str = "64kb", queue_ms: float = 50) -> None:
        """Shape host ``i``'s link, both directions: a rate alone is a tc tbf (queueing at most
        ``queue_ms`` of traffic before dropping); delay or loss need tc netem (a kernel
        module some kernels lack: then RuntimeError says so)."""
        if delay_ms or loss_pct:
            spec = ["netem"] + (["delay", f"{delay_ms}ms"] if delay_ms else []) \
                + (["loss", f"{loss_pct}%"] if loss_pct else []) + (["rate", rate] if rate else [])
        elif rate:
            spec = ["tbf", "rate", rate, "burst", burst, "latency", f"{queue_ms:g}ms"]
        else:
            spec = ["pfifo"]
        for ns, dev in ((self.ns[i], "eth0"), (self.hub, f"p{i}")):
            r = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *spec],
                               capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"tc qdisc {' '.join(spec)} on {dev}: {r.stderr.strip()}")

    def quick_ack(self, i: int) -> None:
        """Host ``i``'s TCP acknowledges every segment at once (the route's ``quickack``).
        An emulated interconnect wants this: a delayed ACK holds a sender that waits for
        it by 40 ms, a stall RDMA and NVLink do not have (on the link testbed it slowed
        some runs' iterations by a third)."""
        _ip("-n", self.ns[i], "route", "change", f"10.213.{self._net}.0/24", "dev", "eth0", "proto", "kernel",
            "scope", "link", "src", self.addr(i), "quickack", "1")

    def cut(self, i: int) -> float:
        """Host ``i`` loses its link (the switch port goes down: its packets vanish, no reset).
        Returns time.monotonic() at the cut."""
        _ip("-n", self.hub, "link", "set", f"p{i}", "down")
        return time.monotonic()

    def restore(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"p{i}", "up")


@atexit.register
def _destroy_all() -> None:
    for tb in list(_live):
        tb.destroy()
