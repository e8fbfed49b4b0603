"""Make every rank exit soon after any rank fails, with a message naming that rank.

A gloo (or NCCL) collective with a dead or failed peer blocks until its timeout, and
ranks not talking to the dead one directly may never notice on their own. Each rank
therefore runs a small thread that talks to the rendezvous store (torchrun's agent
store, or rank 0's TCPStore) over its own connection:

- it publishes this rank's host, pid, phase and a heartbeat counter;
- it exits the process (``os._exit``, after killing this rank's child processes) as
  soon as any rank has published a failure;
- it watches one neighbour (rank + 1): a neighbour on the same host whose pid is gone
  is dead at once; a heartbeat that stops for ``heartbeat_timeout`` seconds outside
  start-up means the process died, its host is gone or its interpreter is wedged (a
  wedged neighbour on the same host is SIGKILLed). Either way the watcher publishes the
  failure on the neighbour's behalf, naming the phase of its last heartbeat;
- it exits if the launcher that started this rank is gone, or the store is.
  A store call over a cut link never returns, so a second thread ends the rank when
  one has gone unanswered for twice the store timeout.

A rank that raises publishes first (``report_failure``), so its peers leave within
one poll interval instead of waiting for a collective timeout. Settings come from
the environment (see docs/guide/cluster.md): MEGATRON_WEIPIPE_WATCHDOG=0 turns it off,
MEGATRON_WEIPIPE_WATCHDOG_INTERVAL (seconds, default 1) and
MEGATRON_WEIPIPE_HEARTBEAT_TIMEOUT (seconds, default 30).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

import torch.distributed as dist

from megatron_weipipe import faults

EXIT_PEER_FAILED = 1
_PREFIX = "megatron_weipipe/watchdog"
# A rank still setting up may hold the GIL for long stretches (dataset index builders):
# no heartbeat verdicts then; collective timeouts cover those phases.
_NO_HEARTBEAT_VERDICT = ("start-up", "loading checkpoint", "building datasets")
_generation = 0


def _one_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0][:500] if lines else ""


def is_communication_error(exc: BaseException) -> bool:
    """A collective failed because of a peer (closed connection, timeout), not this rank."""
    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(exc, backend_error):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(s in text for s in ("gloo", "Connection closed by peer", "Connection reset", "NCCL", "Timed out"))


def kill_children() -> None:
    """SIGKILL every process this rank started (checkpoint writers, loader workers)."""
    try:
        import psutil
    except ImportError:
        return
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


def _set_parent_death_signal() -> None:
    """In a forked child: die with the parent instead of outliving it as an orphan."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _ForkGuard:
    """Holder for the after-fork hook (multiprocessing keeps it only while this lives)."""


_fork_guard = _ForkGuard()
_fork_guard_installed = False


def install_child_process_guards() -> None:
    """Processes forked by multiprocessing (checkpoint writers, data workers) die with this rank."""
    global _fork_guard_installed
    if _fork_guard_installed:
        return
    import multiprocessing.util

    multiprocessing.util.register_after_fork(_fork_guard, lambda _: _set_parent_death_signal())
    _fork_guard_installed = True


class Watchdog:
    """One rank's failure detector; see the module docstring."""

    def __init__(self, store, rank: int, world_size: int, store_owner: str,
                 interval: float = 1.0, heartbeat_timeout: float = 30.0, hosts_store: bool = False):
        self.store = store
        self.hosts_store = hosts_store  # this process serves the store: linger so peers read the failure
        self.rank = rank
        self.world_size = world_size
        self.store_owner = store_owner
        self.interval = interval
        self.heartbeat_timeout = heartbeat_timeout
        self.neighbour = (rank + 1) % world_size
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ppid = os.getppid()
        self._host = socket.gethostname()
        self._published_phase: Optional[str] = None
        self._neighbour_info: Optional[tuple[str, int]] = None
        self._neighbour_beats = -1
        self._neighbour_seen = time.monotonic()
        self._store_errors = 0
        self._tick_started: Optional[float] = None
        # A store call on a connection whose packets vanish (a cut link) never returns:
        # TCPStore's timeout does not cover it. The overseer thread ends the rank then.
        self.store_answer_timeout = max(10.0, 3 * interval)

    # --- store access (the main thread uses it too, while reporting a failure) ------------
    def _add(self, key: str, n: int) -> int:
        with self._lock:
            return self.store.add(key, n)

    def _get_if_set(self, key: str) -> Optional[str]:
        with self._lock:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode(errors="replace")

    def _set(self, key: str, value: str) -> None:
        with self._lock:
            self.store.set(key, value)

    def _first_failure(self) -> Optional[tuple[int, str]]:
        text = self._get_if_set("failure")
        if text is None:
            return None
        rank, _, message = text.partition("|")
        return int(rank), message

    def _publish(self, rank: int, message: str) -> tuple[int, str]:
        """Record a failure unless one is already recorded; returns the one that stands."""
        with self._lock:
            current = self.store.compare_set("failure", "", f"{rank}|{message}").decode(errors="replace")
        first_rank, _, first_message = current.partition("|")
        return int(first_rank), first_message

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self._set(f"who/{self.rank}", f"{self._host}|{os.getpid()}")
        self._publish_phase()
        self._thread = threading.Thread(target=self._run, name="megatron-weipipe-watchdog", daemon=True)
        self._thread.start()
        threading.Thread(target=self._oversee, name="megatron-weipipe-watchdog-overseer", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 10)
        self._thread = None

    # --- reporting ------------------------------------------------------------------------
    def report_failure(self, exc: BaseException) -> str:
        """Called by a rank that raised: publish (or defer to a peer's diagnosis); returns the line to print.

        A communication error usually means a peer died: wait for the watchdogs to name
        it, in which case this thread exits the process itself with that message.
        """
        if is_communication_error(exc):
            # A peer on another host is named only after heartbeat_timeout of silence,
            # counted from its last beat (before this error): leave room for late polls.
            deadline = time.monotonic() + self.heartbeat_timeout + max(2.0, 5 * self.interval)
            while time.monotonic() < deadline:
                found = self._safe(self._first_failure)
                if found is not None:
                    break
                time.sleep(min(self.interval, 0.5))
            detail = self._phase_summary()
            message = f"{type(exc).__name__} during {faults.describe_phase()}: {_one_line(exc)}"
            if detail:
                message += f" ({detail})"
        else:
            message = f"{type(exc).__name__} during {faults.describe_phase()}: {_one_line(exc)}"
        faults.mark_failing()
        first = self._safe(lambda: self._publish(self.rank, message))
        self.stop()
        self._linger()
        if first is None or first[0] == self.rank:
            return f"rank {self.rank} failed: {message}"
        return f"stopping: rank {first[0]} failed: {first[1]}"

    def leave(self) -> None:
        """This rank stops on an error every rank raises together (a NaN, a bad checkpoint).

        Nothing is published, so no peer is cut short before printing its own copy of the
        error; the marker keeps the neighbour's watcher from reporting this exit as a death.
        """
        faults.mark_failing()
        self._safe(lambda: self._set(f"left/{self.rank}", faults.describe_phase()))
        self.stop()
        self._linger()

    def _safe(self, fn):
        try:
            return fn()
        except Exception:
            return None

    def _phase_summary(self) -> str:
        """Which ranks are somewhere else than most (a hung rank lags behind)."""
        if self.world_size > 4096:
            return ""
        try:
            keys = [f"phase/{r}" for r in range(self.world_size)]
            with self._lock:
                if not self.store.check(keys):
                    return ""
                values = [v.decode(errors="replace") for v in self.store.multi_get(keys)]
        except Exception:
            return ""
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        if len(groups) < 2:
            return ""
        common = max(groups, key=lambda k: len(groups[k]))
        parts = [f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)} in {phase}"
                 for phase, rs in groups.items() if phase != common]
        return "; ".join(parts) + f"; the others in {common}"

    # --- the thread ---------------------------------------------------------------------
    def _linger(self) -> None:
        if self.hosts_store:
            time.sleep(2 * self.interval + 0.5)

    def _terminate(self, message: str) -> None:
        print(f"error: [rank {self.rank}] {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        kill_children()
        self._linger()
        os._exit(EXIT_PEER_FAILED)

    def _publish_phase(self) -> None:
        phase = faults.describe_phase()
        if phase != self._published_phase:
            self._set(f"phase/{self.rank}", phase)
            self._published_phase = phase

    def _oversee(self) -> None:
        while not self._stop.wait(self.interval):
            started = self._tick_started
            if started is not None and time.monotonic() - started > 2 * self.store_answer_timeout:
                if not self._stop.is_set():
                    self._terminate(f"lost the rendezvous store hosted by {self.store_owner}: no answer for "
                                    f"{time.monotonic() - started:.0f}s; its host is unreachable or hangs")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick_started = time.monotonic()
                self._tick()
                self._tick_started = None
                self._store_errors = 0
            except Exception as e:  # the store (rank 0 or the launcher) is unreachable
                self._tick_started = None
                self._store_errors += 1
                if self._store_errors >= 2 and not self._stop.is_set():
                    self._terminate(f"lost the rendezvous store hosted by {self.store_owner} "
                                    f"({type(e).__name__}: {_one_line(e)}); it has exited or hangs")

    def _tick(self) -> None:
        if os.getppid() != self._ppid:
            self._terminate(f"the launcher that started this rank (pid {self._ppid}) has exited")
        self._add(f"beat/{self.rank}", 1)
        self._publish_phase()
        failure = self._first_failure()
        if failure is not None:
            if failure[0] != self.rank and not faults.is_failing() and not self._stop.is_set():
                self._terminate(f"stopping: rank {failure[0]} failed: {failure[1]}")
            return
        if self.world_size > 1:
            verdict = self._check_neighbour()
            if verdict is not None and not self._stop.is_set():
                first = self._publish(self.neighbour, verdict)
                self._terminate(f"stopping: rank {first[0]} failed: {first[1]}")

    def _check_neighbour(self) -> Optional[str]:
        nb = self.neighbour
        if self._neighbour_info is None:
            who = self._get_if_set(f"who/{nb}")
            if who is None:
                return None  # not started yet
            host, _, pid = who.partition("|")
            self._neighbour_info = (host, int(pid))
            self._neighbour_seen = time.monotonic()
        host, pid = self._neighbour_info
        if host == self._host and not _alive(pid):
            if self._get_if_set(f"left/{nb}") is not None:
                return None  # it stopped on an error this rank is about to raise as well
            return f"process {pid} on {host} died (its last heartbeat: {self._phase_of(nb)}; found by rank {self.rank})"
        beats = self._add(f"beat/{nb}", 0)
        now = time.monotonic()
        if beats != self._neighbour_beats:
            self._neighbour_beats, self._neighbour_seen = beats, now
            return None
        silent = now - self._neighbour_seen
        if silent <= self.heartbeat_timeout:
            return None
        phase = self._phase_of(nb)
        if phase.startswith(_NO_HEARTBEAT_VERDICT) or self._get_if_set(f"left/{nb}") is not None:
            return None
        verdict = (f"process {pid} on {host} stopped responding: no heartbeat for {silent:.0f}s "
                   f"(its last heartbeat: {phase}; found by rank {self.rank})")
        if host == self._host:  # declared dead: make it so, rather than leave it holding its devices
            try:
                os.kill(pid, signal.SIGKILL)
                verdict += "; killed"
            except OSError:
                pass
        return verdict

    def _phase_of(self, rank: int) -> str:
        return self._get_if_set(f"phase/{rank}") or "an unknown phase"


def _alive(pid: int) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except ImportError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    except Exception:  # psutil.NoSuchProcess
        return False


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _store_client(timeout_s: float):
    """A connection of our own to the rendezvous store, under a key prefix for this run."""
    global _generation
    _generation += 1
    run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"{_PREFIX}/{run}/{restart}/{_generation}"
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    owner = "the torchrun agent" if agent_store else "rank 0"
    if addr and port:
        base = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
        owner += f" at {addr}:{port}"
    else:
        base = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(prefix, base), owner, not agent_store and dist.get_rank() == 0


def start_watchdog(distributed_timeout_minutes: float) -> Optional[Watchdog]:
    """A running watchdog for this rank, or None (single process, or turned off)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if os.environ.get("MEGATRON_WEIPIPE_WATCHDOG", "1") == "0":
        return None
    interval = float(os.environ.get("MEGATRON_WEIPIPE_WATCHDOG_INTERVAL", "1"))
    timeout = float(os.environ.get("MEGATRON_WEIPIPE_HEARTBEAT_TIMEOUT", "30"))
    timeout = min(timeout, distributed_timeout_minutes * 60)
    store, owner, hosts_store = _store_client(timeout_s=max(10.0, 3 * interval))
    return Watchdog(store, dist.get_rank(), dist.get_world_size(), owner, interval, timeout, hosts_store).start()
