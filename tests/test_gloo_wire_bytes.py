"""What gloo's collectives put on the wire between two ranks, read off a veth pair's
interface counters: the simulator's CPU-host model of FSDP (simulator/baselines.py)
assumes gloo all-gathers as a ring (each rank sends its shard) and reduce-scatters by
all-reducing the whole tensor (each rank sends the whole tensor at two ranks). Skipped
only where network namespaces cannot be made (not root, no iproute2)."""

import os
import subprocess
import sys
import textwrap

import pytest

from tools.simulator_validation import netns

_reason = netns.available()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"network namespaces not permitted: {_reason}")

_RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)

    def sent():  # bytes this namespace's eth0 has sent (/proc/net/dev is per network namespace)
        for line in open("/proc/net/dev"):
            if line.strip().startswith("eth0:"):
                return int(line.split(":")[1].split()[8])

    n = 1 << 20  # a 4 MiB shard of float32, 8 MiB whole
    out = {}
    for name, run in (("all_gather", lambda: dist.all_gather_into_tensor(torch.zeros(2 * n), torch.ones(n))),
                      ("reduce_scatter", lambda: dist.reduce_scatter_tensor(torch.zeros(n), torch.ones(2 * n)))):
        dist.barrier()
        before = sent()
        run()
        dist.barrier()
        out[name] = (sent() - before) / (4 * n)  # in shards
    print(json.dumps(out))
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_gloo_reduce_scatter_sends_the_whole_tensor(tmp_path):
    import json

    netns.remove_stale()
    with netns.Testbed(2, net=7) as tb:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs = [tb.popen(i, [sys.executable, "-c", _RANK, str(i), str(tmp_path / "store")], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
        outs = [p.communicate(timeout=100) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-2000:] + outs[1][1][-2000:]
    shards = json.loads(outs[0][0].strip().splitlines()[-1])
    # headers and acknowledgements add a few percent to the payload
    assert 1.0 <= shards["all_gather"] < 1.1, shards
    assert 2.0 <= shards["reduce_scatter"] < 2.2, shards
