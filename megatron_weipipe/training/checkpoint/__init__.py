"""Checkpoints: one directory protocol, one state format per data-parallel mode.

- checkpointing.py: save, resume and the checks before a load; picks the run's format.
- directory.py: ``iter_N.partial`` published as ``iter_N``, then the tracker (crash-safe).
- async_saves.py: ``--async-save``: shards written in the background, published by the finalize step.
- state_format.py: the ``StateFormat`` interface every format implements.
- torch_dist_format.py: DDP with the plain or the distributed optimizer (megatron-core torch_dist).
- optimizer_resharding.py: the optimizer state's saved forms and which layouts they load into.
- fsdp2_format.py: ``--use-torch-fsdp2`` (torch.distributed.checkpoint of the DTensors).
- safe_load.py: reading every checkpoint file as data only.
"""
