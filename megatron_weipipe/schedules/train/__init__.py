"""The GPT training adapter pretrain() uses: `TrainSchedule` (base.py), Megatron's
schedules on megatron-core (megatron_schedules.py) and the WeiPipe schedule (weipipe/).
Classes are found by name through schedules/registry.py."""
