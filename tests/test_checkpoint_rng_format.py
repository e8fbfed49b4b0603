"""A resumed run's log is as clean as a fresh one's, and the RNG state is stored as megatron-core keeps it.

Each rank's RNG state is a megatron-core ShardedObject (a pickled object under
``rng_state/shard_<pp>.<tp>_<PP>.<TP>``), not a tensor. Loading goes through megatron-core's
torch_dist reader, which raises torch notices from its own code; the resumed run shows none
of them: no FutureWarning, and nothing from the checkpoint readers that the fresh run does not show.
"""

import warnings

from harness import run_distributed
from harness.runs import tiny_gpt_args, train_and_collect

# Where a warning of the checkpoint readers is raised from.
_CHECKPOINT_CODE = ("torch/distributed/checkpoint", "megatron/core/dist_checkpointing", "training/checkpoint")


def _fresh_then_resumed(rank, world_size, ckpt_dir):
    common = dict(pipeline_model_parallel_size=world_size, hidden_dropout=0.1, save=ckpt_dir, save_interval=2,
                  lr_decay_iters=4)  # one schedule for the fresh and the resumed run
    notices = []
    for argv in (tiny_gpt_args(**common, train_iters=2), tiny_gpt_args(**common, train_iters=4, load=ckpt_dir)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = train_and_collect(rank, world_size, argv, collect_grads=False)
        notices.append({(w.category.__name__, str(w.message)) for w in caught
                        if issubclass(w.category, FutureWarning) or any(c in w.filename for c in _CHECKPOINT_CODE)})
    return notices, out["iteration"]


def _stored_kinds(path: str) -> dict:
    """Storage kind ("bytes" or "tensor") of every entry of the torch_dist checkpoint ``path``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = FileSystemReader(path).read_metadata()
    return {k: "bytes" if isinstance(m, BytesStorageMetadata) else "tensor"
            for k, m in metadata.state_dict_metadata.items()}


def test_resumed_run_shows_no_future_warning_and_rng_is_a_sharded_object(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    per_rank = run_distributed(_fresh_then_resumed, 2, ckpt, timeout=400)
    for (fresh, resumed), iteration in per_rank:
        assert iteration == 4
        assert resumed <= fresh, resumed - fresh
        assert not {n for n in fresh | resumed if n[0] == "FutureWarning"}, fresh | resumed
    kinds = _stored_kinds(str(tmp_path / "ckpt" / "iter_0000002"))
    rng = {k: v for k, v in kinds.items() if k.startswith("rng_state")}
    # PP=2 x TP=1: one object per pipeline stage.
    assert rng == {"rng_state/shard_0.0_2.1": "bytes", "rng_state/shard_1.0_2.1": "bytes"}, rng
