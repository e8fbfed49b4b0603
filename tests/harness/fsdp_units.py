"""Parameter counts grouped by FSDP2 unit (model/fsdp.py shards the embedding, each decoder
layer and the root separately), for the tests that check FSDP2's bytes per unit."""

from __future__ import annotations


def numels_per_unit(numels: dict[str, int]) -> dict[str, int]:
    """{unit: numel} from {parameter name: numel} of a two-layer GPT."""
    units: dict[str, int] = {}
    for name, n in numels.items():
        unit = "root"
        if name.startswith("embedding."):
            unit = "embedding"
        elif name.startswith("decoder.layers."):
            unit = "layer" + name.split(".")[2]
        units[unit] = units.get(unit, 0) + n
    assert set(units) == {"embedding", "layer0", "layer1", "root"}
    return units
