"""A throw-away SLURM cluster on this machine, for tests: slurmctld plus one slurmd per node.

Everything lives in one temporary directory (configuration, state, spool, logs), the
daemons listen on ports of their own, and authentication is off (``auth/none``), so it
touches nothing of a real installation. Nodes are either this host (``127.0.0.1``) or
hosts of a ``tools/simulator_validation/netns.py`` testbed (``Node(wrap=testbed.command-for-that-host)``: one
slurmd inside each, the controller and client commands inside the first). Each daemon runs under a small supervisor process (this file with
``--supervise``) that adopts everything the daemon forks (slurmstepd, the job's
processes), so that stopping the cluster kills exactly what it started, by PID.

    with LocalSlurm(tmp) as cluster:
        job = cluster.sbatch(["--time=2", "job.sh"])
        cluster.wait_state(job, {"COMPLETED"}, timeout=60)

Nodes advertise the resources given (``config_overrides``), GPUs included as a counted
GRES without devices, so batch scripts written for GPU nodes are accepted unchanged.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "srun")
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    name: str
    addr: str = "127.0.0.1"
    wrap: Optional[Callable[[list], list]] = None  # argv -> argv run on this host (tools/simulator_validation/netns.py)


class LocalSlurm:
    """Start with ``start()`` (or ``with``); ``stop()`` cancels every job and kills every daemon."""

    def __init__(self, workdir: str, nodes: Sequence[Node] = (Node("localhost"),), cpus: int = 64,
                 gpus: int = 0, memory_mb: int = 16000):
        self.dir = os.path.abspath(workdir)
        self.nodes = list(nodes)
        self.cpus, self.gpus, self.memory_mb = cpus, gpus, memory_mb
        self.wrap = self.nodes[0].wrap  # the controller and client commands run on the first node
        self.conf = os.path.join(self.dir, "slurm.conf")
        self._daemons: list[subprocess.Popen] = []
        self._logs: list = []

    # --- configuration ------------------------------------------------------------------
    def _write_config(self) -> None:
        for sub in ("state", "spool", "log"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        ctl_addr = self.nodes[0].addr if self.wrap else "127.0.0.1"
        ctl_host = self.nodes[0].name if self.wrap else socket.gethostname()
        d = self.dir
        lines = [
            "ClusterName=localtest",
            f"SlurmctldHost={ctl_host}({ctl_addr})", "MailProg=/bin/true",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "AuthType=auth/none", "CredType=cred/none", "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/spool/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides", "ReturnToService=2", "JobRequeue=1",
            "GresTypes=gpu", "MinJobAge=300", "KillWait=10", "InactiveLimit=0", "MessageTimeout=10",
            "SlurmdTimeout=30", "SlurmctldTimeout=30", "HealthCheckInterval=0",
        ]
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        for n in self.nodes:
            lines.append(f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={n.name} CPUs={self.cpus} "
                         f"RealMemory={self.memory_mb}{gres} State=UNKNOWN")
        lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(d, "gres.conf"), "w") as f:
            f.write(f"AutoDetect=off\nName=gpu Count={self.gpus}\n" if self.gpus else "")
        for n in self.nodes:
            os.makedirs(os.path.join(d, "spool", n.name), exist_ok=True)

    @property
    def env(self) -> dict:
        """The environment for SLURM commands (and jobs) to use this cluster."""
        return dict(os.environ, SLURM_CONF=self.conf)

    # --- daemons ------------------------------------------------------------------------
    def _spawn(self, argv: list[str], wrap, log_name: str) -> subprocess.Popen:
        cmd = [sys.executable, os.path.abspath(__file__), "--supervise", *argv]
        if wrap:
            cmd = wrap(cmd)
        log = open(os.path.join(self.dir, "log", log_name), "ab")
        self._logs.append(log)
        p = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._daemons.append(p)
        return p

    def start(self, timeout: float = 60) -> "LocalSlurm":
        self._write_config()
        try:
            self._spawn(["slurmctld", "-D", "-c", "-i", "-f", self.conf], self.wrap, "slurmctld.out")
            for n in self.nodes:
                self._spawn(["slurmd", "-D", "-f", self.conf, "-N", n.name], n.wrap, f"slurmd-{n.name}.out")
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            for p in self._daemons:
                if p.poll() is not None:
                    raise RuntimeError(f"a SLURM daemon exited with {p.returncode} at start-up:\n{self.logs()}")
            r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False, timeout=10)
            out = r.stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == len(self.nodes) and all(s in ("idle", "mix", "alloc") for s in states.values()):
                return
            if any(s.startswith(("inval", "drain")) for s in states.values()):
                break
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes not idle (within {timeout}s) (sinfo: {out!r}):\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for name in sorted(os.listdir(os.path.join(self.dir, "log"))):
            with open(os.path.join(self.dir, "log", name), errors="replace") as f:
                parts.append(f"--- {name}\n{f.read()[-tail:]}")
        return "\n".join(parts)

    def stop(self, timeout: float = 30) -> None:
        """Cancel every job of this cluster, then stop the daemons and everything under them."""
        if self._daemons and all(p.poll() is None for p in self._daemons[:1]):
            self.run(["scancel", "--full", "--quiet", "--user=root"], check=False, timeout=15)
            deadline = time.monotonic() + timeout / 2
            while time.monotonic() < deadline:
                r = self.run(["squeue", "-h", "-t", "RUNNING,COMPLETING,CONFIGURING"], check=False, timeout=10)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.5)
        for p in reversed(self._daemons):  # the slurmds first, the controller last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the supervisor kills its daemon's whole tree
        for p in reversed(self._daemons):
            try:
                p.wait(timeout=timeout / 2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self._daemons.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def pids(self) -> list[int]:
        """The supervisors, the daemons and everything they started that still runs."""
        import psutil

        out = []
        for p in self._daemons:
            try:
                top = psutil.Process(p.pid)
                out += [top.pid] + [c.pid for c in top.children(recursive=True)]
            except psutil.Error:
                pass
        return out

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- commands -----------------------------------------------------------------------
    def run(self, argv: list[str], check: bool = True, timeout: float = 30,
            env: Optional[dict] = None) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster (on the controller's host)."""
        cmd = self.wrap(list(argv)) if self.wrap else list(argv)
        r = subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def sbatch(self, argv: list[str], env: Optional[dict] = None, cwd: Optional[str] = None) -> int:
        cmd = ["sbatch", "--parsable", *argv]
        if cwd:
            cmd.insert(2, f"--chdir={cwd}")
        out = self.run(cmd, env=env).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict:
        """``scontrol show job`` as a dict (JobState, RestartCnt, ExitCode, Reason, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_state(self, job_id: int, states: Iterable[str], timeout: float, release: bool = True) -> dict:
        """Wait for the job to be in one of ``states``; a requeued job held back by SLURM's
        begin-time delay is released at once when ``release``."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        info: dict = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in wanted:
                return info
            if release and info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
                self.release(job_id)
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} not in {sorted(wanted)} within {timeout}s: {info}\n{self.logs()}")

    def release(self, job_id: int) -> None:
        """Start a requeued job now instead of after SLURM's hold (about 2 minutes in 22.05).

        Not within the second of the requeue: slurmd revokes the old run's credential with a
        one-second resolution and refuses ("Job credential revoked") a new run allocated in
        the same second, which fails the job. SLURM's hold exists to avoid exactly that."""
        time.sleep(2)
        self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)


# --- the supervisor -----------------------------------------------------------------------
def _supervise(argv: list[str]) -> int:
    """Run ``argv``; adopt its orphans; on SIGTERM (or the parent's death) kill the whole tree."""
    import psutil

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    class Stop(Exception):
        pass

    def on_term(*_):
        raise Stop

    signal.signal(signal.SIGTERM, on_term)
    child = subprocess.Popen(argv)
    status = None
    try:
        while True:
            pid, st = os.waitpid(-1, 0)  # reap the daemon and any adopted orphan
            if pid == child.pid:
                status = os.waitstatus_to_exitcode(st)
                child.returncode = status
                break
    except (Stop, ChildProcessError):
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    me = psutil.Process()
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            pass
    for p in me.children(recursive=True):
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(me.children(recursive=True), timeout=5)
    return status if status is not None else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--supervise":
        sys.exit(_supervise(sys.argv[2:]))
    sys.exit("usage: local_slurm.py --supervise CMD ...  (as a library: LocalSlurm)")
