"""Timeline picture: one panel per schedule, a row per rank; compute bars by kind and,
under each row, the transfers that rank sends (so exposed communication is visible)."""

from __future__ import annotations

from typing import Sequence

from megatron_weipipe.schedules.ir.actions import COMPUTE_KINDS, Kind

COLORS = {
    Kind.FORWARD: "#4C72B0",
    Kind.BACKWARD: "#DD8452",
    Kind.BACKWARD_INPUT: "#C44E52",
    Kind.BACKWARD_WEIGHT: "#55A868",
    Kind.LOSS: "#8172B3",
}


def draw(results: Sequence, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(results)
    P = max(len(r.trace.per_rank) for r in results)
    fig, axes = plt.subplots(n, 1, figsize=(14, (0.55 * P + 1.2) * n), squeeze=False)
    horizon = max(r.pipeline_s for r in results) * 1e3
    for ax, r in zip(axes[:, 0], results):
        tr = r.trace
        rows = len(tr.per_rank)
        for rank, timed in enumerate(tr.per_rank):
            y = rows - 1 - rank
            bars: dict = {}
            for t in timed:
                if t.action.kind in COMPUTE_KINDS and t.end > t.start:
                    bars.setdefault(t.action.kind, []).append((t.start * 1e3, (t.end - t.start) * 1e3))
            for kind, spans in bars.items():
                ax.broken_barh(spans, (y - 0.05, 0.55), facecolors=COLORS.get(kind, "grey"), edgecolor="none")
            sent = [(t.start * 1e3, max((t.end - t.start) * 1e3, horizon * 1e-4))
                    for t in tr.transfers if t.src == rank]
            if sent:
                ax.broken_barh(sent, (y - 0.35, 0.2), facecolors="#937860", edgecolor="none", alpha=0.6)
        ax.set_yticks(range(rows))
        ax.set_yticklabels([f"r{rows - 1 - i}" for i in range(rows)])
        ax.set_xlim(0, horizon * 1.02)
        ax.set_title(f"{r.spec.schedule}: pipeline {r.pipeline_s * 1e3:.1f} ms, iteration {r.iteration_s * 1e3:.1f} ms, "
                     f"bubble {r.bubble:.1%}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms")
    handles = [Patch(color=c, label=k.value) for k, c in COLORS.items()]
    handles.append(Patch(color="#937860", alpha=0.6, label="transfer (sender row)"))
    fig.legend(handles=handles, loc="upper right", fontsize=8, ncol=len(handles))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
