"""Document boundaries of packed samples, and which attention blocks they leave.

A packed sample holds several documents; with ``--reset-attention-mask`` a token attends
only to earlier tokens of its own document. Megatron's dense path builds that as an
[s, s] mask from the end-of-document (EOD) tokens (the EOD closes its document, so the
next token starts a new one). Here the same boundaries are kept as cumulative offsets
per sample, ``offsets [b, n+1]`` (0 = o_0 < o_1 < ... < o_k = S, padded with S), O(docs)
in size, and every (query range, key range) block is classified from them:

  skip    no query of the block sees any key of it in any sample: not computed at all
  full    every query sees every key (one document spans the block): unmasked kernel
  causal  a diagonal block inside one document: the causal kernel
  masked  anything else: one varlen call over every document rectangle of the block
          (``varlen``, ``fpdt.varlen``: flash varlen on a GPU, a padded-batch reference
          elsewhere), or, when padding the documents would cost more than the block, the
          math kernel with a boolean [b, sq, sk] block mask (one block's size, never S x S)

The offsets live on the CPU, so the classification costs no device synchronisation.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, OrderedDict

import torch

SKIP, FULL, CAUSAL, MASKED = "skip", "full", "causal", "masked"


def document_offsets(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Cumulative document offsets [b, n+1] (int64, CPU) of a [b, S] token batch.

    A document ends right after each EOD token, as in megatron-core's
    ``_get_ltor_masks_and_position_ids``; rows with fewer documents are padded with S.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, S], got shape {tuple(tokens.shape)}")
    tokens = tokens.detach().cpu()
    b, S = tokens.shape
    rows = []
    for r in range(b):
        ends = (tokens[r] == eod).nonzero().flatten() + 1
        ends = ends[ends < S]
        rows.append(torch.cat([torch.zeros(1, dtype=torch.long), ends.long(), torch.full((1,), S)]))
    width = max(len(x) for x in rows)
    return torch.stack([torch.cat([x, torch.full((width - len(x),), S)]) for x in rows])


class Documents:
    """Document boundaries of one micro-batch, with block classification and counts.

    ``counts`` tallies forward block decisions (skip/full/causal/masked) for benchmarks.
    """

    def __init__(self, offsets: torch.Tensor):
        offsets = torch.as_tensor(offsets).detach().to("cpu", torch.long)
        if offsets.dim() != 2 or offsets.shape[1] < 2:
            raise ValueError(f"document offsets must be [b, n+1] with n >= 1, got shape {tuple(offsets.shape)}")
        if (offsets[:, 0] != 0).any() or (offsets[:, 1:] < offsets[:, :-1]).any():
            raise ValueError("document offsets must start at 0 and never decrease")
        self.offsets = offsets
        self.seq_len = int(offsets[0, -1])
        if (offsets[:, -1] != self.seq_len).any():
            raise ValueError("document offsets of every sample must end at the same sequence length")
        self.counts: Counter = Counter()
        self._rows = offsets.tolist()
        self._layouts: dict = {}

    @property
    def batch(self) -> int:
        return self.offsets.shape[0]

    def ids(self, start: int, stop: int, device=None) -> torch.Tensor:
        """Document index of positions [start, stop) per sample: [b, stop - start]."""
        pos = torch.arange(start, stop).expand(self.batch, -1).contiguous()
        ids = torch.searchsorted(self.offsets, pos, right=True) - 1
        return ids if device is None else ids.to(device)

    def _same(self, a: int, b: int) -> list[bool]:
        """Per sample: do positions a and b lie in the same document?"""
        return [bisect_right(row, a) == bisect_right(row, b) for row in self._rows]

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> str:
        """Kind of the block queries [q0, q1) x keys [k0, k1): diagonal (k == q) or fully
        earlier keys (k1 <= q0), as FPDT's chunk pairs and the tiled Ulysses path are."""
        if (q0, q1) == (k0, k1):
            return CAUSAL if all(self._same(q0, q1 - 1)) else MASKED
        if k1 > q0:
            raise ValueError(f"block keys [{k0}, {k1}) must precede queries [{q0}, {q1}) or equal them")
        if not any(self._same(k1 - 1, q0)):  # no first query shares the last key's document
            return SKIP
        return FULL if all(self._same(k0, q1 - 1)) else MASKED

    def visible(self, q0: int, q1: int, k0: int, k1: int, device=None) -> torch.Tensor:
        """Boolean block mask [b, q1-q0, k1-k0], True where the query sees the key."""
        dq, dk = self.ids(q0, q1, device), self.ids(k0, k1, device)
        vis = dq[:, :, None] == dk[:, None, :]
        if (q0, q1) == (k0, k1):
            vis &= torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=vis.device).tril()
        return vis

    def segments(self, q0: int, q1: int, k0: int, k1: int) -> list[list[tuple[int, int, int, int]]]:
        """Per sample, the (query, key) rectangles of each document inside the block, as
        block-relative (qa, qe, ka, ke): causal squares on the diagonal, full rectangles
        off it. Each query and each key lies in at most one of them."""
        out = []
        for row in self._rows:
            segs = []
            for d in range(bisect_right(row, q0) - 1, bisect_right(row, q1 - 1)):
                s, e = row[d], row[d + 1]
                qa, qe, ka, ke = max(s, q0), min(e, q1), max(s, k0), min(e, k1)
                if qa < qe and ka < ke:
                    segs.append((qa - q0, qe - q0, ka - k0, ke - k0))
            out.append(segs)
        return out

    def varlen(self, q0: int, q1: int, k0: int, k1: int, device=None, padded: bool = True):
        """The block's document rectangles packed for one varlen call (``fpdt.varlen``),
        built from the CPU offsets once per block and kept with this micro-batch's
        boundaries (the backward and every layer reuse it); on ``device``, with the padded
        reference's fields only when ``padded``."""
        from megatron_weipipe.fpdt.varlen import build_layout

        dev = torch.device(device or "cpu")
        cpu_key = (q0, q1, k0, k1, "cpu", True)
        if cpu_key not in self._layouts:
            self._layouts[cpu_key] = build_layout(self.offsets, q0, q1, k0, k1)
        key = (q0, q1, k0, k1, str(dev), padded or dev.type == "cpu")
        if key not in self._layouts:
            self._layouts[key] = self._layouts[cpu_key].to(dev, padded)
        return self._layouts[key]

    def lengths(self) -> list[list[int]]:
        """Document lengths per sample (for logs and tests)."""
        return [[int(x) for x in row.diff() if x > 0] for row in self.offsets]


_RECENT: OrderedDict = OrderedDict()  # id(offsets tensor) -> (tensor, Documents), newest last
_RECENT_SIZE = 8


def as_documents(attention_mask) -> Documents | None:
    """The document boundaries a long-context attention layer received as its
    ``attention_mask`` argument (None: plain causal). Dense masks are refused.

    Every layer of a micro-batch receives the same offsets tensor: its ``Documents`` (and
    the varlen layouts cached on it) are made once and reused, for the last few tensors
    seen (WeiPipe interleaves micro-batches)."""
    if attention_mask is None or isinstance(attention_mask, Documents):
        return attention_mask
    if attention_mask.dtype == torch.bool or attention_mask.dim() != 2:
        raise ValueError("Ulysses/FPDT attention takes document offsets [b, n+1], not a dense attention mask")
    hit = _RECENT.get(id(attention_mask))
    if hit is not None and hit[0] is attention_mask:
        _RECENT.move_to_end(id(attention_mask))
        return hit[1]
    docs = Documents(attention_mask)
    _RECENT[id(attention_mask)] = (attention_mask, docs)
    while len(_RECENT) > _RECENT_SIZE:
        _RECENT.popitem(last=False)
    return docs
