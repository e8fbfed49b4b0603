"""--async-save: what the background writer puts on disk is the state at the save's iteration.

One spawn of two gloo ranks. For every checkpoint format (plain DDP, the distributed
optimizer in its dp_reshardable and fully_reshardable forms, FSDP2) a run saves at
iterations 2 and 4 with --async-save while the writer of iteration 2 is held (faults.py's
hold) until iteration 4's backward: the optimizer step of iteration 3 has then changed
every parameter and its optimizer state before the writer reads a byte. Its checkpoints
must equal, tensor for tensor and bit for bit, those of the same run saving synchronously
(the reference); a run resumed from the async iteration-2 checkpoint must end with the
uninterrupted run's losses and iteration-4 checkpoint, bit for bit.

The race itself is also checked at the unit level, where a step is forced between the
fork of the writer and its read: host tensors in shared memory (which a fork does not
copy) must be cloned before the writer starts; megatron-core's plain preload, the
negative control, lets the later step into the file. On a GPU host the same check guards
the staging step: megatron-core copies device tensors to new host tensors, but hands host
tensors (CPU-resident optimizer state, shared-memory staging buffers) to the writer by
reference, and any of them changed by the next step would reach the file.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from harness import run_distributed
from harness.runs import tiny_gpt_args

FORMATS = {
    "plain": {},
    "dist-dp-reshardable": dict(use_distributed_optimizer=True),
    "dist-fully-reshardable": dict(use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True),
    "fsdp2": dict(use_torch_fsdp2=True, untie_embeddings_and_output_weights=True),
}
# Resumed from the async checkpoint: one format per writer (megatron-core's torch_dist writer;
# its torch.distributed.checkpoint writer for FSDP2). The others write through the first, and
# their async checkpoints equal the synchronous ones bitwise, which resume elsewhere
# (tests/test_checkpoint_resharding.py).
RESUMED = ("plain", "fsdp2")
SMALL = dict(num_layers=2, global_batch_size=4, train_iters=4, lr_decay_iters=4, save_interval=2)  # one schedule for every run


def _train(rank, world_size, argv, release=None, hold_at=None):
    """pretrain() on this rank; with ``release``, the async writer of iteration 2 is held until
    iteration ``hold_at``'s backward. Returns the losses and, from iteration 3's backward, what
    the tracker and the directory said while the save of iteration 2 was (or was not) in flight."""
    import pretrain_gpt
    from megatron.core import parallel_state

    from megatron_weipipe import faults
    from megatron_weipipe.arguments import parse_config
    from megatron_weipipe.model.gpt_step import forward_step
    from megatron_weipipe.training.checkpoint import directory
    from megatron_weipipe.training.pretrain import pretrain

    cfg = parse_config(argv, world_size=world_size)
    seen = {}

    def after_backward(iteration, schedule):
        if iteration == 3 and cfg.checkpoint.save:
            root = cfg.checkpoint.save
            seen.update(tracker=directory.read_tracker(root), listing=sorted(os.listdir(root)))
        if release is not None and iteration == hold_at and rank == 0:
            open(release, "w").close()

    os.environ.pop(faults.HOLD_WRITE_ENV, None)
    if release is not None:
        os.environ[faults.HOLD_WRITE_ENV] = f"{release}:2"
    try:
        state = pretrain(cfg, pretrain_gpt.model_provider, forward_step, after_backward=after_backward)
    finally:
        os.environ.pop(faults.HOLD_WRITE_ENV, None)
    parallel_state.destroy_model_parallel()
    return {"losses": state.losses, **seen}


def _host_snapshot(rank, world_size, root, shared, guard):
    """An async save of a live tensor, then a step on it before the held writer reads it.
    Returns what the checkpoint holds (the tensor was 0..n-1 at the save)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_weipipe import faults, mcore_versions
    from megatron_weipipe.platform import install_cpu_adapter
    from megatron_weipipe.training.checkpoint import async_saves

    install_cpu_adapter()
    path, release = os.path.join(root, f"w-{shared}-{guard}"), os.path.join(root, f"release-{shared}-{guard}")
    if rank == 0:
        os.makedirs(path)
    torch.distributed.barrier()
    live = torch.arange(64, dtype=torch.float32) + 64 * rank
    if shared:
        live.share_memory_()
    faults.configure({faults.HOLD_WRITE_ENV: release})
    saves, plain = async_saves.AsyncSaves(), async_saves._private_host_copies
    if not guard:
        async_saves._private_host_copies = lambda preload: preload()  # megatron-core's preload alone
    try:
        saves.prepare()
        sharded = {"w": ShardedTensor.from_rank_offsets("w", live, (0, rank, world_size), replica_id=0)}
        saves.schedule(dist_checkpointing.save(sharded, path, async_sharded_save=True,
                                               **mcore_versions.async_save_kwargs()), 1, path)
        live.mul_(-1.0)  # the next optimizer step, before the held writer has read anything
        torch.distributed.barrier()
        if rank == 0:
            open(release, "w").close()
        saves.close()
    finally:
        async_saves._private_host_copies = plain
        faults.configure({})
    out = torch.zeros(64)
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", out, (0, rank, world_size),
                                                                           replica_id=0)}, path)
    return loaded["w"].tolist()


def _counting_reads(rank, world_size, argv) -> dict:
    """_train, counting the tensor and byte items this rank reads from checkpoint files."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from harness.state import local_shards

    plain, reads = FileSystemReader.read_data, []

    def read_data(self, plan, planner):
        reads.extend(plan.items)
        return plain(self, plan, planner)

    FileSystemReader.read_data = read_data
    try:
        out = _train(rank, world_size, argv)
    finally:
        FileSystemReader.read_data = plain
    return {**out, "reads": len(reads)}


def _parallel_loads(rank, world_size, root):
    """--ckpt-fully-parallel-load: the same state from fewer reads per rank (plain DDP: the model
    and its optimizer state are replicated on both data-parallel ranks)."""
    d = os.path.join(root, "fully-parallel-load")
    _train(rank, world_size, tiny_gpt_args(**{**SMALL, "train_iters": 2}, save=d))
    load = dict(SMALL, train_iters=3, load=d, save_interval=None)
    return {"each": _counting_reads(rank, world_size, tiny_gpt_args(**load)),
            "parallel": _counting_reads(rank, world_size, tiny_gpt_args(**load, ckpt_fully_parallel_load=True))}


def _all_runs(rank, world_size, root):
    out = {"snapshot": {(shared, guard): _host_snapshot(rank, world_size, root, shared, guard)
                        for shared, guard in ((False, True), (True, True), (True, False))},
           "loads": _parallel_loads(rank, world_size, root)}
    for name, flags in FORMATS.items():
        d = os.path.join(root, name)
        release = os.path.join(d, "release")
        out[name] = {
            "async": _train(rank, world_size, tiny_gpt_args(**SMALL, **flags, save=f"{d}/async", async_save=True),
                            release=release, hold_at=4),
            "sync": _train(rank, world_size, tiny_gpt_args(**SMALL, **flags, save=f"{d}/sync")),
        }
        if name not in RESUMED:
            continue
        if rank == 0:  # resume from the async iteration-2 checkpoint alone
            os.makedirs(f"{d}/resumed")
            shutil.copytree(f"{d}/async/iter_0000002", f"{d}/resumed/iter_0000002")
            with open(f"{d}/resumed/latest_checkpointed_iteration.txt", "w") as f:
                f.write("2")
        torch.distributed.barrier()
        out[name]["resumed"] = _train(rank, world_size, tiny_gpt_args(
            **SMALL, **flags, save=f"{d}/resumed", load=f"{d}/resumed", async_save=True))
    return out


def checkpoint_tensors(path: str) -> dict:
    """Every tensor of a torch.distributed.checkpoint directory, whole, read in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
               if isinstance(m, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as root:
        yield root, run_distributed(_all_runs, 2, root, timeout=400)[0]


def test_a_step_before_the_writer_reads_does_not_reach_the_file(runs):
    _, out = runs
    saved = list(range(64))  # rank 0's half: 0..63 at the save, then negated
    assert out["snapshot"][(False, True)] == saved  # plain memory: the fork's copy-on-write snapshot
    assert out["snapshot"][(True, True)] == saved  # shared memory: cloned before the fork
    # Negative control: megatron-core's preload alone hands the shared tensor to the writer.
    assert out["snapshot"][(True, False)] == [-float(x) for x in saved]


def test_fully_parallel_load_reads_each_replicated_shard_once_and_loads_the_same_state(runs):
    _, out = runs
    each, parallel = out["loads"]["each"], out["loads"]["parallel"]
    assert parallel["losses"] == each["losses"]  # iteration 3 from the loaded state, bit for bit
    # Without the flag every rank reads everything it holds; with it the two replicas split the reads.
    assert each["reads"] > 0 and parallel["reads"] < 0.75 * each["reads"], (each["reads"], parallel["reads"])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_async_checkpoints_equal_synchronous_ones_bitwise_and_resume(runs, fmt):
    root, out = runs
    run, sync = out[fmt]["async"], out[fmt]["sync"]
    # The flag took effect: at iteration 3 the async save of iteration 2 was still unpublished
    # (its writer held), while the synchronous run had published it before going on.
    assert run["tracker"] is None and "iter_0000002.partial" in run["listing"], run
    assert sync["tracker"] == 2 and "iter_0000002" in sync["listing"], sync
    assert run["losses"] == sync["losses"]
    d = os.path.join(root, fmt)
    for it in (2, 4):
        a = checkpoint_tensors(f"{d}/async/iter_{it:07d}")
        s = checkpoint_tensors(f"{d}/sync/iter_{it:07d}")
        assert sorted(a) == sorted(s) and len(a) > 5
        differ = [k for k in a if not torch.equal(a[k], s[k])]
        assert not differ, f"{fmt} iteration {it}: {differ[:5]}"
    # Iterations 3 and 4 changed the saved tensors: a leaked step would show.
    two, four = checkpoint_tensors(f"{d}/sync/iter_0000002"), checkpoint_tensors(f"{d}/sync/iter_0000004")
    assert sum(not torch.equal(two[k], four[k]) for k in two) > len(two) // 2
    assert sorted(os.listdir(f"{d}/async")) == ["iter_0000002", "iter_0000004", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("fmt", RESUMED)
def test_a_run_resumed_from_an_async_checkpoint_ends_where_the_uninterrupted_one_does(runs, fmt):
    """Iterations 3-4 and the iteration-4 checkpoint (parameters, optimizer state), bit for bit."""
    root, out = runs
    assert out[fmt]["resumed"]["losses"] == out[fmt]["async"]["losses"][2:]
    again = checkpoint_tensors(f"{root}/{fmt}/resumed/iter_0000004")
    uninterrupted = checkpoint_tensors(f"{root}/{fmt}/async/iter_0000004")
    assert sorted(again) == sorted(uninterrupted)
    assert not [k for k in again if not torch.equal(again[k], uninterrupted[k])]
