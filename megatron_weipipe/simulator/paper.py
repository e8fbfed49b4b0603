"""Tables for docs/simulator.md: CPU-host validation, WeiPipe's and FPDT's settings."""

from __future__ import annotations


def cpu_table(rows: list[dict]) -> str:
    lines = ["| P | seq | schedule | rounds | measured (median) | predicted (median) | error | measured spread | "
             "bytes = counter | logged sent/rank/iter (rank 0) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['seq_length']} | {r['schedule']} | {r['rounds']} | {r['measured_ms']:.0f} ms | "
            f"{r['predicted_ms']:.0f} ms | {r['error']:+.1%} | {r['spread']:.0%} | "
            f"{'exact' if r['bytes_exact'] else 'DIFFERS'} | {r['log_sent']} |")
    return "\n".join(lines)


def weipipe_table() -> str:
    raise NotImplementedError


def fpdt_table() -> str:
    raise NotImplementedError
