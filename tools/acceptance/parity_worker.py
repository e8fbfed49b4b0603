"""Runs of one parity batch, one after another in one torchrun: what each trained and measured.

    torchrun --standalone --nproc-per-node 2 -m tools.acceptance.parity_worker \
        --spec batch.json --out runs.jsonl NAME ...

``--spec`` holds the batch's runs (tools/acceptance/parity_runs.py: name, pretrain flags,
options); the positional names say which to run, in order. Every rank appends JSON lines
to ``--out``: rank 0 a ``start`` line before each run (the caller's clock for its
timeout), every rank a ``result`` line (losses and gradient norms per iteration, the
last log line's stats, peak device memory, host syncs counted in forward/backward) or an
``error`` line (the one line the training loop reports, and the traceback's tail). Peak
device memory is ``torch.cuda.max_memory_allocated`` less what was allocated when the
run began (what earlier runs of the process left).

A run that raises ends this worker (exit 1) after its error line: its peers may be stuck
in a collective or already gone (the training loop's watchdog ends them), so the caller
(tools/acceptance/parity.py) starts a new torchrun for the runs left. Options per run:

- ``sync_debug`` (CUDA): ``torch.cuda.set_sync_debug_mode`` over the schedule's
  ``forward_backward``, in "warn" mode with the warnings recorded, so one run yields both
  its parity result and where it synchronized the host (a host sync there stalls the
  posting of the next sends and prefetches);
- ``delay_copies``: every offload copy of the run is delayed on its side stream
  (tools/acceptance/copy_delay.py); on a CPU host the copies are only counted;
- ``deterministic``: ``torch.use_deterministic_algorithms`` for the run (bitwise rows).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")


def _append(path: str, record: dict) -> None:
    """One line, one write(): lines of concurrent ranks never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


@contextlib.contextmanager
def counting_host_syncs(schedule_class, found: list):
    """Record each host sync inside ``schedule_class.forward_backward`` as 'file:line'."""
    import torch

    plain = schedule_class.forward_backward

    def forward_backward(self, *args, **kwargs):
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return plain(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                found.extend(f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in caught
                             if "synchroniz" in str(w.message))

    own = "forward_backward" in vars(schedule_class)  # else it is inherited: leave the class as it was
    schedule_class.forward_backward = forward_backward
    try:
        yield
    finally:
        if own:
            schedule_class.forward_backward = plain
        else:
            del schedule_class.forward_backward


@contextlib.contextmanager
def deterministic(on: bool):
    import torch

    previous = torch.are_deterministic_algorithms_enabled()
    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def run(spec: dict) -> dict:
    import torch

    import pretrain_gpt
    from tools.acceptance.copy_delay import delaying_copies
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.initialize import destroy_model_parallel_groups
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.platform import detect_platform
    from megatron_weipipe.schedules import registry
    from megatron_weipipe.training.pretrain import pretrain

    t0 = time.perf_counter()
    cfg = parse_config(spec["flags"], world_size=int(os.environ["WORLD_SIZE"]))
    cuda = detect_platform().is_cuda
    baseline = 0
    if cuda:  # what earlier runs of this process left allocated is not this run's
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    logged, syncs, copies = {}, [], [0]
    with contextlib.ExitStack() as stack:
        if spec.get("sync_debug") and cuda:
            stack.enter_context(counting_host_syncs(registry.train_class(cfg.schedule_name), syncs))
        if spec.get("delay_copies"):
            stack.enter_context(delaying_copies(copies))
        stack.enter_context(deterministic(bool(spec.get("deterministic"))))
        state = pretrain(cfg, pretrain_gpt.model_provider, forward_step, on_log=logged.update)
    destroy_model_parallel_groups()  # the default group stays for the next run
    stats = {k: logged[k] for k in ("elapsed_ms", "tokens_per_second", "tflops_per_device", "mem_gb") if k in logged}
    return dict(losses=[float(x) for x in state.losses], grad_norms=[float(x) for x in state.grad_norms],
                seconds=round(time.perf_counter() - t0, 2), stats=stats,
                peak_bytes=torch.cuda.max_memory_allocated() - baseline if cuda else None, baseline_bytes=baseline,
                host_syncs=syncs if spec.get("sync_debug") and cuda else None,
                delayed_copies=copies[0] if spec.get("delay_copies") else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="JSON: {runs: [{name, flags, options...}]}")
    ap.add_argument("--out", required=True, help="JSON lines appended by every rank")
    ap.add_argument("names", nargs="+", help="runs of the spec, in order")
    args = ap.parse_args(argv)
    specs = {r["name"]: r for r in json.load(open(args.spec))["runs"]}
    rank = int(os.environ.get("RANK", "0"))
    import pretrain_gpt  # noqa: F401 - the imports before the first start line: a run's timeout is its own
    import megatron_weipipe.training.pretrain  # noqa: F401
    for name in args.names:
        if rank == 0:
            _append(args.out, dict(event="start", name=name, rank=rank, time=time.time()))
        try:
            result = run(specs[name])
        except BaseException as e:  # its peers may hang or be gone: this torchrun ends here
            line = getattr(e, "report", None) or f"{type(e).__name__}: {e}"
            first = f"rank {rank}: " + (str(line).strip().splitlines() or [type(e).__name__])[0][:300]
            _append(args.out, dict(event="error", name=name, rank=rank, error=first,
                                   traceback=traceback.format_exc(limit=4)[-1500:]))
            return 1
        _append(args.out, dict(event="result", name=name, rank=rank, **result))
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
