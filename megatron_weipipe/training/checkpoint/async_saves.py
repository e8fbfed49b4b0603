"""``--async-save``: checkpoints written in the background through megatron-core's AsyncCallsQueue.

A save is cut in two, as Megatron-LM does:

1. At the save's iteration, on every rank, before training goes on: the state format plans
   its shards and hands back megatron-core's ``AsyncRequest``; scheduling it copies device
   tensors to the host (the request's preload) and forks the writer process
   (megatron-core's ``TemporalAsyncCaller``), which writes ``iter_N.partial`` while the
   trainer runs the next iterations.
2. The finalize step, on every rank together, once every rank's writer has finished:
   megatron-core's write results and ``.metadata``, ``metadata.json``, then
   ``directory.publish`` (the rename to ``iter_N`` and the tracker). It runs without
   blocking at iteration boundaries when the writers are already done, and blocking before
   the next save and at every exit. Until it runs, ``--load`` picks the previous checkpoint;
   a crash before it leaves ``iter_N.partial``, which the next save removes.

What is written is the state at the save's iteration. Device tensors are copied to new
host tensors before the fork. Host tensors are read by the forked writer from its
copy-on-write image of the trainer's memory as it was at the fork, which no later step of
the trainer can change, except memory the trainer shares with other processes (torch
shared memory, which a fork does not copy): such tensors are cloned before the fork.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from megatron_weipipe import faults


@dataclass
class PendingSave:
    """A save whose writers were started and which is not published yet."""

    iteration: int
    path: str  # where it is published
    started: float  # time.time() when it was scheduled
    call_idx: int = -1


class AsyncSaves:
    """One run's background checkpoint writes, in megatron-core's AsyncCallsQueue; every
    method is called on all ranks together (finalizing is collective)."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._queue = AsyncCallsQueue(persistent=False)
        self._pending: deque[PendingSave] = deque()
        self._manager = None
        self._results = None

    @property
    def in_flight(self) -> Optional[PendingSave]:
        """The oldest save not yet published, or None."""
        return self._pending[0] if self._pending else None

    def prepare(self) -> None:
        """Call before a state format plans an async save: megatron-core's writer takes its
        results queue while planning."""
        self._use_cross_process_results()

    def schedule(self, request, iteration: int, path: str) -> None:
        """Start writing ``request`` (megatron-core's AsyncRequest, planned after ``prepare``) in the background."""
        if request.async_fn is not None:  # None: nothing to write on this rank, no process
            request = request._replace(async_fn=functools.partial(_write, request.async_fn, iteration))
        if request.preload_fn is not None:
            request = request._replace(preload_fn=functools.partial(_private_host_copies, request.preload_fn))
        pending = PendingSave(iteration, path, time.time())
        pending.call_idx = self._queue.schedule_async_request(request)
        self._pending.append(pending)

    def finalize_finished(self) -> list[PendingSave]:
        """Publish the saves whose writers have finished on every rank; never waits."""
        return self._finalize(blocking=False)

    def wait(self) -> list[PendingSave]:
        """Wait for every save in flight and publish it."""
        return self._finalize(blocking=True)

    def close(self) -> list[PendingSave]:
        """Wait for every save in flight, then stop the results server."""
        done = self.wait()
        if self._manager is not None:
            from megatron.core.dist_checkpointing.strategies import filesystem_async

            if filesystem_async._results_queue is self._results:
                filesystem_async._results_queue = None
            self._manager.shutdown()
            self._manager = self._results = None
        return done

    def _finalize(self, blocking: bool) -> list[PendingSave]:
        if not self._pending:  # the same on every rank: saves are scheduled together
            return []
        finalized = set(self._queue.maybe_finalize_async_calls(blocking=blocking))
        done = [p for p in self._pending if p.call_idx in finalized]
        self._pending = deque(p for p in self._pending if p.call_idx not in finalized)
        return done

    def _use_cross_process_results(self) -> None:
        """megatron-core's writer hands its write results back through a module-level queue;
        a writer in another process needs one served across processes. A forked server
        (no interpreter start-up) that dies with this rank (the fork guard of
        training/watchdog.py), shut down by ``close``."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if self._manager is None:
            from multiprocessing.managers import SyncManager

            self._manager = SyncManager(ctx=multiprocessing.get_context("fork"))
            self._manager.start()
            self._results = self._manager.Queue()
        filesystem_async._results_queue = self._results


def _write(write: Callable, iteration: int, *args, **kwargs) -> None:
    """The writer process's work: megatron-core's write of the shards (after the test hook)."""
    faults.hold_background_write(iteration)
    write(*args, **kwargs)


def _private_host_copies(preload: Callable):
    """megatron-core's preload (device tensors copied to the host), then a clone of every host
    tensor in shared memory: the forked writer's copy-on-write snapshot does not cover it."""
    buckets = preload()
    return [(file_name, key, (byte_items, [(item, t.clone() if t.is_shared() else t) for item, t in tensors]))
            for file_name, key, (byte_items, tensors) in buckets]
