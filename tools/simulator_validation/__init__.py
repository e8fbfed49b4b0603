"""Checks of the simulator (megatron_weipipe/simulator) against reality and the papers,
run by tools/simulator_report.py to regenerate the tables of docs/simulator.md:

  realruns.py    real pretrain_gpt.py runs under torchrun, through probe_run.py
  probe_run.py   torchrun entry: pretrain_gpt.py plus per-rank byte and CPU-time records
  cpu_host.py    predicted vs measured on this CPU host, calibrations and runs alternating
  doc_tables.py  the tables: CPU-host validation, WeiPipe's and FPDT's paper settings

Imported as ``simulator_validation`` with tools/ on sys.path (as when running
``python tools/simulator_report.py``) and the repository root on sys.path.
"""
