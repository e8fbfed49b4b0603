"""The copies of offloaded state and the stream/event protocol that orders them.

A ``ChunkStore`` (fpdt/offload.py) asks this service for every copy between a device
tensor and a host buffer of its ``HostBufferPool``; the pool holds one service, so all
layers sharing the pool share its streams. ``CopyStreams`` is the CPU host's: plain
copies, already in program order. ``CudaCopyStreams`` puts device->host copies on one
side stream and host->device copies on another, so PCIe carries both directions at once
(with one stream for both, the backward's chunk loop, which sends dq back while it
fetches the next chunk, runs the link half-duplex). Its protocol:

- ``to_host``: the d2h stream waits for the compute stream (the source is made there) and
  for the buffer's last h2d read (a buffer taken again from the pool may still be read by
  an earlier prefetch); the source is ``record_stream``'ed on the d2h stream, so the
  caller may drop it at once; the buffer's fence records the write.
- ``to_device``: the h2d stream waits for the buffer's last d2h write (a prefetch never
  reads a half-written chunk); the fence records the read; the device copy is made on
  the h2d stream.
- ``ready``: the compute stream waits for that prefetch before the first use and
  ``record_stream``'s the device copy (it was allocated on the h2d stream).
- ``drain``: the compute stream waits for both side streams (a store's ``close``): no
  copy of the store is left unordered with what follows.

No call synchronizes the host. ``before_copy(stream)`` runs on the side stream right
before each copy is queued: a hook for checks that delay the side streams (torch.cuda._sleep)
and require bitwise-equal results. tests/test_offload_protocol.py runs this class on a
CPU host with logging fakes of torch.cuda's streams and events and checks the protocol
over the whole log. Unverified on GPU: the overlap itself.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


class CopyStreams:
    """CPU host: plain copies in program order (nothing to wait for)."""

    cuda = False

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, fence) -> None:
        dst.copy_(src)

    def to_device(self, src: torch.Tensor, device: torch.device, fence) -> tuple[torch.Tensor, Any]:
        """A device copy of host buffer ``src`` and what ``ready`` needs (None here)."""
        return src.to(device, copy=True), None

    def ready(self, tensors: Iterable[torch.Tensor], marker: Any) -> None:
        """The compute stream may use ``tensors`` (from ``to_device``) from here on."""

    def drain(self) -> None:
        """Order every copy issued so far before the compute stream's next work."""


class CudaCopyStreams(CopyStreams):
    """One d2h and one h2d side stream on ``device`` (module docstring: the protocol)."""

    cuda = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.d2h = torch.cuda.Stream(device=self.device)
        self.h2d = torch.cuda.Stream(device=self.device)

    def before_copy(self, stream) -> None:
        """Hook: runs with ``stream`` (a side stream) current, right before each copy."""

    def _event(self, stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, fence) -> None:
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        if fence.read is not None:
            self.d2h.wait_event(fence.read)
        with torch.cuda.stream(self.d2h):
            self.before_copy(self.d2h)
            dst.copy_(src, non_blocking=True)
            fence.written = self._event(self.d2h)
        src.record_stream(self.d2h)

    def to_device(self, src: torch.Tensor, device: torch.device, fence) -> tuple[torch.Tensor, Any]:
        if fence.written is not None:
            self.h2d.wait_event(fence.written)
        with torch.cuda.stream(self.h2d):
            self.before_copy(self.h2d)
            dev = src.to(device, non_blocking=True)
            fence.read = self._event(self.h2d)
        return dev, fence.read

    def ready(self, tensors: Iterable[torch.Tensor], marker: Any) -> None:
        if marker is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(marker)
        for t in tensors:
            t.record_stream(compute)

    def drain(self) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.d2h)
        compute.wait_stream(self.h2d)


def for_device(device: torch.device) -> CopyStreams:
    """The copy service for ``device``: side streams on CUDA, plain copies elsewhere."""
    device = torch.device(device)
    return CudaCopyStreams(device) if device.type == "cuda" else CopyStreams()
