"""Delay every offload copy on its side stream: the check that the copies are ordered.

On a GPU the offload copies (FPDT chunks, layer inputs) run on side streams ordered by
events (fpdt/copy_streams.py). A missing wait lets compute read a chunk before its
prefetch lands, and a missing ``record_stream`` lets the allocator reuse a tensor a
queued copy still reads: both show only when a copy runs late. While ``delaying_copies``
is open, every copy service that ``copy_streams.for_device`` makes sleeps on the side
stream (``torch.cuda._sleep``, about 1 ms) right before each copy (its ``before_copy``
hook), so the results must stay bitwise equal to a run without the sleeps. A CPU host's
copies are synchronous: there they are only counted (the count proves the runs' copies
went through the service).
"""

from __future__ import annotations

import contextlib

SLEEP_CYCLES = 2_000_000  # ~1 ms at 2 GHz


def delay(service, counter: list):
    """``service`` (a copy service) with each copy delayed (CUDA) or counted (CPU) in ``counter[0]``."""
    import torch

    if getattr(service, "cuda", False):
        def before_copy(stream):
            counter[0] += 1
            torch.cuda._sleep(SLEEP_CYCLES)
        service.before_copy = before_copy
        return service
    for name in ("to_host", "to_device"):
        def counted(*args, _fn=getattr(service, name), **kwargs):
            counter[0] += 1
            return _fn(*args, **kwargs)
        setattr(service, name, counted)
    return service


@contextlib.contextmanager
def delaying_copies(counter: list):
    """Every copy service made meanwhile (a model's pools make theirs at first use) is delayed."""
    from megatron_weipipe.fpdt import copy_streams

    plain = copy_streams.for_device
    copy_streams.for_device = lambda device: delay(plain(device), counter)
    try:
        yield
    finally:
        copy_streams.for_device = plain
