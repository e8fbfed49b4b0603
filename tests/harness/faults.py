"""Launch pretrain_gpt.py as real processes (torchrun, or one process per rank) and break them.

Every process a test starts is recorded (launcher, ranks and the ranks' children,
sampled while the job runs) so the test can check that none outlives the job and can
kill, by pid, whatever is still there at the end. No test fixtures live here.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
DATA = os.path.join(ROOT, "data", "sample_text_document")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_args(train_iters: int, **flags) -> list[str]:
    """A 2-layer float32 GPT on the sample corpus, one log line per iteration, dropout off."""
    base = {
        "num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 32,
        "micro-batch-size": 2, "global-batch-size": 4, "train-iters": train_iters, "lr": 1e-3,
        "hidden-dropout": 0.0, "attention-dropout": 0.0, "data-path": DATA,
        "tokenizer-type": "ByteLevelTokenizer", "log-interval": 1, "eval-iters": 0, "seed": 1234,
    }
    switches = []
    for k, v in flags.items():
        k = k.replace("_", "-")
        if v is True:
            switches.append(f"--{k}")
        elif v is None:
            base.pop(k, None)
        else:
            base[k] = v
    out = []
    for k, v in base.items():
        out += [f"--{k}", str(v)]
    return out + switches


class Job:
    """One run of pretrain_gpt.py; output lines are collected with arrival times."""

    def __init__(self, nproc: int, args: list[str], env: Optional[dict] = None, torchrun: bool = True,
                 cwd: Optional[str] = None, launcher: str = "torch.distributed.run"):
        self.nproc = nproc
        self.torchrun = torchrun
        self.lines: list[tuple[float, str]] = []
        self.seen: dict[int, float] = {}  # pid -> create_time of every process of the job
        self.cmdlines: dict[int, str] = {}
        # The sampler thread and the test's own thread both add to ``seen``; readers take a
        # snapshot under this lock, since iterating a dict another thread grows raises.
        self._seen_lock = threading.Lock()
        self._cond = threading.Condition()
        base_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
        base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        base_env.update(env or {})
        port = free_port()
        self.procs: list[subprocess.Popen] = []
        if torchrun:
            cmd = [sys.executable, "-m", launcher, f"--nproc-per-node={nproc}",
                   "--master-addr=127.0.0.1", f"--master-port={port}", "--monitor-interval=0.1",
                   PRETRAIN, *args]
            self.procs.append(self._spawn(cmd, base_env, cwd))
        else:
            for r in range(nproc):
                env_r = dict(base_env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                             LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                self.procs.append(self._spawn([sys.executable, PRETRAIN, *args], env_r, cwd))
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _spawn(self, cmd, env, cwd) -> subprocess.Popen:
        p = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, text=True, bufsize=1)
        threading.Thread(target=self._read, args=(p,), daemon=True).start()
        return p

    def _read(self, p: subprocess.Popen) -> None:
        for line in p.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._cond.notify_all()

    def _sample(self) -> None:
        while not self._done.is_set():
            self.sample()
            time.sleep(0.05)

    def sample(self) -> None:
        for p in self.procs:
            try:
                top = psutil.Process(p.pid)
                for q in [top, *top.children(recursive=True)]:
                    with self._seen_lock:
                        if q.pid not in self.seen:
                            self.seen[q.pid] = q.create_time()
                            try:
                                self.cmdlines[q.pid] = " ".join(q.cmdline())
                            except psutil.Error:
                                pass
            except psutil.Error:
                pass

    def seen_pids(self) -> dict[int, float]:
        """A snapshot of ``seen`` (pid -> create_time), safe while the sampler runs."""
        with self._seen_lock:
            return dict(self.seen)

    # --- observing ----------------------------------------------------------------------
    def output(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first output line matching ``pattern`` (waits for it)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for _, line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} within {timeout}s; output:\n"
                                         + "\n".join(l for _, l in self.lines[-40:]))
                self._cond.wait(min(left, 0.2))

    def rank_pids(self) -> dict[int, int]:
        """Global rank -> pid of each worker process."""
        launched = {q.pid for q in self.procs}
        out = {}
        for pid in self.seen_pids():
            try:
                p = psutil.Process(pid)
                is_worker = (p.ppid() in launched) if self.torchrun else (pid in launched)
                if PRETRAIN in p.cmdline() and is_worker:
                    rank = p.environ().get("RANK")
                    if rank is not None:
                        out[int(rank)] = pid
            except psutil.Error:
                pass
        return out

    def wait_ranks(self, timeout: float = 60) -> dict[int, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sample()
            pids = self.rank_pids()
            if len(pids) == self.nproc:
                return pids
            time.sleep(0.1)
        raise AssertionError(f"ranks did not all start: {self.rank_pids()}")

    def wait(self, timeout: float) -> list[int]:
        """Exit codes of the launched processes; kills everything and fails on timeout."""
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job still running after {timeout}s; output:\n{self.output()[-4000:]}")
        time.sleep(0.2)  # let the readers drain
        return [p.returncode for p in self.procs]

    def alive(self) -> list[int]:
        """Pids of this job's processes (any ever seen) that still exist."""
        out = []
        for pid, created in self.seen_pids().items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.Error:
                pass
        return out

    def wait_all_gone(self, timeout: float) -> float:
        """Seconds until no process of the job exists (including orphans); fails after timeout."""
        t0 = time.monotonic()
        while self.alive():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"processes still alive after {timeout}s: {self.alive()}")
            time.sleep(0.05)
        return time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL every process this job started that still exists."""
        self._done.set()
        self._sampler.join(timeout=5)  # after this, ``seen`` and ``cmdlines`` no longer change
        for pid in self.alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        self._done.set()
        self.kill()


def losses(output: str) -> dict[int, str]:
    """iteration -> the logged lm loss text (printed to 7 significant digits)."""
    out = {}
    for m in re.finditer(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|", output):
        out[int(m.group(1))] = m.group(2)
    return out


def tracker(ckpt: str) -> Optional[int]:
    path = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    return int(open(path).read().strip()) if os.path.exists(path) else None
