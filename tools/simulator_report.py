#!/usr/bin/env python
"""Regenerate the tables of docs/results/simulator.md.

    python -m tools.simulator_report cpu --rounds 3 --records /tmp/simulator_cpu.jsonl   # ~1 h, real runs
    python -m tools.simulator_report cpu-table --records /tmp/simulator_cpu.jsonl        # table again, from
                                                                    # the runs' saved calibrations
    python -m tools.simulator_report weipipe-paper                                       # seconds
    python -m tools.simulator_report fpdt-paper                                          # seconds
    python -m tools.simulator_report weipipe-baselines                                   # a minute
    python -m tools.simulator_report tawpipe-paper                                       # two minutes
"""

from __future__ import annotations

import argparse
import sys



def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_weipipe.errors import SimulatorError
    from tools.simulator_validation import cpu_host, doc_tables

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    cpu = sub.add_parser("cpu", help="alternate calibrations and real runs on this host, then print the table")
    cpu.add_argument("--rounds", type=int, default=3)
    cpu.add_argument("--records", default="/tmp/simulator_cpu.jsonl")
    cpu.add_argument("--workdir", default="/tmp", help="where the calibrations are kept")
    table = sub.add_parser("cpu-table", help="the table from recorded runs, predicted again from their calibrations")
    table.add_argument("--records", default="/tmp/simulator_cpu.jsonl")
    table.add_argument("--workdir", default="/tmp", help="where the calibrations are kept")
    sub.add_parser("weipipe-paper", help="WeiPipe's scaling setting, NVLink and PCIe+IB clusters")
    sub.add_parser("weipipe-baselines", help="WeiPipe's setting against 1F1B, ZB-H1, FSDP and the floor")
    sub.add_parser("tawpipe-paper", help="TawPipe's 24-GPU setting (3 nodes x 8, 25 GbE) against WeiPipe, FSDP, HSDP")
    sub.add_parser("fpdt-paper", help="FPDT's 8B Llama at 2M tokens on 4 GPUs and 4M on 8")
    args = p.parse_args(argv)
    try:
        if args.what == "cpu":
            cpu_host.run_validation(args.records, rounds=args.rounds, workdir=args.workdir)
            print(doc_tables.cpu_table(cpu_host.summarise(cpu_host.load_records(args.records))))
        elif args.what == "cpu-table":
            records = cpu_host.repredict(cpu_host.load_records(args.records), args.workdir)
            print(doc_tables.cpu_table(cpu_host.summarise(records)))
        elif args.what == "weipipe-paper":
            print(doc_tables.weipipe_table())
        elif args.what == "weipipe-baselines":
            print(doc_tables.baselines_table())
        elif args.what == "tawpipe-paper":
            print(doc_tables.tawpipe_table())
        elif args.what == "fpdt-paper":
            print(doc_tables.fpdt_table())
    except SimulatorError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
