"""tools/simulator_validation/netns.py: hosts that reach each other by name, a link that can be cut, nothing left behind."""

import os
import subprocess
import sys

import pytest

from tools.simulator_validation import netns

_reason = netns.available()
pytestmark = [pytest.mark.two_nodes, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5555)); s.listen(); print("listening", flush=True)
while True:
    c, addr = s.accept(); c.sendall(f"{socket.gethostname()} sees {addr[0]}".encode()); c.close()
"""
CLIENT = """
import socket
s = socket.create_connection(("node0", 5555), timeout=5)
print(socket.gethostname(), "got:", s.recv(100).decode())
"""


@pytest.mark.timeout(120)
def test_hosts_talk_by_name_until_the_link_is_cut_and_leave_nothing_behind():
    netns.remove_stale()
    tb = netns.Testbed(2).create()
    try:
        server = tb.popen(0, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"
        r = tb.run(1, [sys.executable, "-c", CLIENT], timeout=30)
        assert r.stdout.strip() == f"node1 got: node0 sees {tb.addr(1)}", r.stderr
        tb.shape(1, rate="100mbit")  # a tbf; connections still work
        tb.quick_ack(1)  # and without delayed ACKs, on host 1 only
        routes = [subprocess.run(["ip", "-n", ns, "route"], capture_output=True, text=True).stdout for ns in tb.ns]
        assert "quickack 1" in routes[1] and "quickack" not in routes[0], routes
        assert tb.run(1, [sys.executable, "-c", CLIENT], timeout=30).returncode == 0
        tb.cut(1)
        r = tb.run(1, [sys.executable, "-c", CLIENT], timeout=30)
        assert r.returncode != 0 and ("No route to host" in r.stderr or "timed out" in r.stderr), r.stderr
        tb.restore(1)
        # the machine's own network namespace got nothing: no route to the testbed's subnet
        assert "10.213." not in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    finally:
        tb.destroy()
    assert server.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for ns in [tb.hub, *tb.ns]:
        assert ns not in listed and not os.path.exists(f"/etc/netns/{ns}")
