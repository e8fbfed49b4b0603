"""The on-disk protocol that makes a save all-or-nothing, whatever the state format.

Layout, as in Megatron-LM: ``<dir>/iter_0000025/`` per checkpoint plus the tracker file
``<dir>/latest_checkpointed_iteration.txt``. Every rank writes into
``iter_0000025.partial/``; once all agree, rank 0 renames it to ``iter_0000025`` and only
then replaces the tracker atomically. A crash at any point (SIGKILL included) leaves the
tracker on the previous checkpoint, which stays what ``--load`` picks; the ``.partial``
directory left behind is removed by the next save.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Optional

import torch.distributed as dist

from megatron_weipipe.config import PretrainConfig

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the path and the reason."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} is corrupt: expected an iteration number, found {text[:40]!r}")


def fsync_dir(path: str) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_tracker_atomically(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))
    fsync_dir(root)


def write_release_tracker(root: str) -> None:
    """Point the tracker at a weights-only checkpoint (``release``: step 0, fresh optimizer)."""
    fsync_dir(root)
    tmp = os.path.join(root, f".{TRACKER}.tmp")
    with open(tmp, "w") as f:
        f.write("release")
    os.replace(tmp, os.path.join(root, TRACKER))


def is_published(root: str, iteration: int) -> bool:
    """The tracker already names ``iter_<iteration>`` (a resumed run told to exit at once)."""
    return read_tracker(root) == iteration and os.path.isdir(checkpoint_dir(root, iteration))


def start_partial(root: str, iteration: int) -> str:
    """An empty ``iter_<N>.partial`` (rank 0 clears what crashed saves left); every rank waits for it."""
    path = checkpoint_dir(root, iteration)
    partial = path + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for stale in [partial, *glob.glob(os.path.join(root, "iter_*.partial"))]:
            if os.path.isdir(stale):  # left by a save that crashed before it was published
                shutil.rmtree(stale)
        if os.path.isdir(path):  # unpublished: newer than the tracker, from a crashed run
            shutil.rmtree(path)
        os.makedirs(partial)
    dist.barrier()
    return partial


def publish(root: str, iteration: int) -> str:
    """Once every rank has written ``iter_<N>.partial``: rename it, then move the tracker."""
    path = checkpoint_dir(root, iteration)
    dist.barrier()
    if dist.get_rank() == 0:
        os.replace(path + ".partial", path)
        fsync_dir(root)
        write_tracker_atomically(root, iteration)
    dist.barrier()
    return path


def find_checkpoint(cfg: PretrainConfig) -> Optional[str]:
    """Path of the checkpoint ``--load`` names, None to start fresh; CheckpointError if unusable."""
    root = cfg.checkpoint.load
    if root is None:
        return None
    same_as_save = cfg.checkpoint.save is not None and os.path.abspath(root) == os.path.abspath(cfg.checkpoint.save)
    if not os.path.isdir(root):
        if same_as_save:  # first run of a requeued job: nothing saved yet
            return None
        raise CheckpointError(f"--load {root}: directory does not exist")
    iteration = read_tracker(root)
    if iteration is None:
        if same_as_save:
            return None
        raise CheckpointError(
            f"--load {root}: no complete checkpoint ({TRACKER} is missing; a save may have been interrupted)"
        )
    path = checkpoint_dir(root, iteration)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"--load {path}: checkpoint {path} is incomplete (no metadata.json)")
    return path
