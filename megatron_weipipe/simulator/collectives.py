"""Standard ring cost formulas for collectives (NCCL's ring algorithms).

For n ranks and a payload of S bytes per rank, a ring all-reduce moves 2(n-1)/n x S
bytes through every rank's outgoing link in 2(n-1) steps; all-gather, reduce-scatter
and all-to-all move (n-1)/n x S in n-1 steps. A ring is paced by its slowest hop.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import LinkSpec


@dataclass(frozen=True)
class CollectiveCost:
    seconds: float
    wire_bytes: float  # bytes each rank sends
    payload_bytes: int  # the tensor handed to the collective (what the byte counter records)


def all_reduce(nbytes: int, n: int, link: LinkSpec) -> CollectiveCost:
    if n <= 1:
        return CollectiveCost(0.0, 0.0, nbytes)
    wire = 2.0 * (n - 1) / n * nbytes
    return CollectiveCost(wire / (link.bandwidth_gbs * 1e9) + 2 * (n - 1) * link.latency_us * 1e-6, wire, nbytes)


def all_gather(nbytes: int, n: int, link: LinkSpec) -> CollectiveCost:
    """nbytes: the gathered (full) size."""
    if n <= 1:
        return CollectiveCost(0.0, 0.0, nbytes)
    wire = (n - 1) / n * nbytes
    return CollectiveCost(wire / (link.bandwidth_gbs * 1e9) + (n - 1) * link.latency_us * 1e-6, wire, nbytes)


reduce_scatter = all_gather


def all_to_all(nbytes: int, n: int, link: LinkSpec) -> CollectiveCost:
    """nbytes: what one rank holds before the exchange; it keeps 1/n and sends the rest."""
    return all_gather(nbytes, n, link)


def broadcast(nbytes: int, n: int, link: LinkSpec) -> CollectiveCost:
    """A pipelined ring broadcast from one root: every rank but the last forwards the whole
    payload in chunks, so the time is one payload's transfer plus n-1 hops' latency (NCCL's
    ring broadcast); ``wire_bytes``: what a forwarding rank sends."""
    if n <= 1:
        return CollectiveCost(0.0, 0.0, nbytes)
    return CollectiveCost(nbytes / (link.bandwidth_gbs * 1e9) + (n - 1) * link.latency_us * 1e-6, float(nbytes), nbytes)


reduce = broadcast  # the same ring, the other way: each rank adds its part and forwards
