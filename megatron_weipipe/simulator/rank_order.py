"""Parallel layout and Megatron's rank order.

megatron-core numbers ranks in the order tp-cp-dp-pp (tensor parallel fastest), so a
pipeline (or WeiPipe ring) spans nodes once TP x CP x DP fills a node, while TP groups
stay inside one. The simulator needs this to know which hops cross the network.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_weipipe.errors import require_simulable


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1

    def validate(self) -> "Layout":
        for name in ("tp", "pp", "cp", "dp"):
            require_simulable(getattr(self, name) >= 1, f"{_FLAG[name]} must be at least 1")
        return self

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def rank(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def pipeline_ranks(self, tp: int = 0, cp: int = 0, dp: int = 0) -> list[int]:
        """Global ranks of one pipeline / WeiPipe ring, in stage order."""
        return [self.rank(tp=tp, cp=cp, dp=dp, pp=p) for p in range(self.pp)]

    def data_parallel_ranks(self, pp: int = 0, tp: int = 0, cp: int = 0) -> list[int]:
        return [self.rank(tp=tp, cp=cp, dp=d, pp=pp) for d in range(self.dp)]

    def data_cp_ranks(self, pp: int = 0, tp: int = 0) -> list[int]:
        """The group gradients are reduced over (Megatron reduces over DP x CP)."""
        return [self.rank(tp=tp, cp=c, dp=d, pp=pp) for d in range(self.dp) for c in range(self.cp)]

    def tensor_ranks(self, pp: int = 0, cp: int = 0, dp: int = 0) -> list[int]:
        return [self.rank(tp=t, cp=cp, dp=dp, pp=pp) for t in range(self.tp)]

    def context_ranks(self, pp: int = 0, tp: int = 0, dp: int = 0) -> list[int]:
        return [self.rank(tp=tp, cp=c, dp=dp, pp=pp) for c in range(self.cp)]


_FLAG = {
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "cp": "--context-parallel-size",
    "dp": "data-parallel size",
}
