"""User commands beside the trainer, run from the repository root as ``python -m tools.<name>``:

  dry_run              a rank's memory for a pretrain_gpt.py command line, on fake tensors
  simulate             project a pretrain_gpt.py command line onto a cluster (--calibrate: this host)
  check_schedules      every registered schedule proved deadlock-free under NCCL's rules
  schedule_timeline    a schedule's tick table or PNG; --from-trace: a run's measured timeline
  long_context_table   docs' long-context rows, each from a dry run
  flags_table          the table of flags in docs/reference/flags.md
  preprocess_data      JSON lines -> the trainer's indexed dataset
  make_sample_corpus   the small corpus the examples and tests train on
  gpu_acceptance       the GPU acceptance table (gpu_acceptance.sh runs it)
  simulator_report     the simulator's validation tables of docs/results/simulator.md

and the packages:

  acceptance/            the checks of gpu_acceptance
  checkpoint/            Hugging Face Llama <-> megatron-core checkpoints (python -m tools.checkpoint.convert)
  simulator_validation/  the simulator against real runs, the link testbed and the papers

The shell scripts (install_*.sh, docker_smoke.sh, gpu_acceptance.sh, test_newest_mcore.sh)
set up or drive a host.
"""
