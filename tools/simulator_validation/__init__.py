"""Checks of the simulator (megatron_weipipe/simulator) against reality and the papers,
run by ``python -m tools.simulator_report`` to regenerate the tables of docs/results/simulator.md:

  realruns.py           real pretrain_gpt.py runs under torchrun, through probe_run.py
  probe_run.py          torchrun entry: pretrain_gpt.py plus per-rank byte and CPU-time records
  cpu_host.py           predicted vs measured on this CPU host, calibrations and runs alternating
  doc_tables.py         the tables: CPU-host validation, WeiPipe's and FPDT's paper settings
  dry_run_vs_estimator.py  tools/dry_run.py's bytes against the memory estimator

and the link testbed (docs/results/link-testbed.md), real runs over emulated links:

  link_testbed.py       the sweep: two ranks in network namespaces, per preset and schedule
  testbed_rank.py       one rank of it: the trainer's pretrain(), once per job
  testbed_presets.py    the emulated links (rate, latency) and the host's FLOP/s
  netns.py              hosts on one machine: network namespaces on a bridge, a link that can be cut
  message_delay.py      what a gloo message waits beyond its bytes (a probe the comparison adds)
  fsdp2_overhead.py     FSDP2's fixed cost per unit, and the loop's per iteration (the same)
  testbed_compare.py    the testbed's rows against the simulator's predictions

Run from the repository root: ``python -m tools.simulator_validation.link_testbed``.
"""
