"""Run a function on N local gloo ranks with a hard deadline.

Tests must never hang and must only kill what they started: each rank is a child of
this process, and on error or timeout every child is terminated, then killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable


class DistributedRunError(RuntimeError):
    """A rank raised, died, or the run passed its deadline."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, results, env, args, kwargs):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:  # report every failure to the parent, with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    ``fn`` must be importable (a module-level function). Returns the per-rank return
    values (which must be picklable), ordered by rank. Raises DistributedRunError with
    the first failing rank's traceback, or on timeout.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    child_env.update(env or {})
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world_size, port, results, child_env, args, kwargs),
            daemon=False,  # ranks may start children of their own (checkpoint writers)
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistributedRunError(
                    f"distributed run of {fn.__name__} timed out after {timeout:.0f}s; "
                    f"ranks done: {sorted(outputs)}"
                )
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise DistributedRunError(
                        f"rank {dead[0]} of {fn.__name__} died with exit code {procs[dead[0]].exitcode}"
                    )
                continue
            if status == "error":
                raise DistributedRunError(f"rank {rank} of {fn.__name__} failed:\n{payload}")
            outputs[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10 if len(outputs) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [outputs[r] for r in range(world_size)]
