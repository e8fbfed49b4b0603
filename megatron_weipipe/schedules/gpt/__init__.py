"""The GPT model adapters pretrain() runs: `TrainSchedule` (base.py), Megatron's
schedules on megatron-core (megatron_schedules.py) and the WeiPipe schedule (weipipe/).
Classes are found by name through schedules/registry.py."""
