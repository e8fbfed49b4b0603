"""Read checkpoints as data: nothing in a checkpoint directory can run code on load.

megatron-core's torch_dist format stores three pickled things, and the stock readers
would execute whatever a tampered file asks for:

- ``.metadata``: torch.distributed.checkpoint reads it with plain ``pickle.load``. We
  unpickle it first with an allow-list of the checkpoint metadata classes (dataclasses
  and enums of torch.distributed.checkpoint, torch.Size, dtypes and layouts); anything
  else is refused before the stock reader sees the file.
- the common state: ``common.pt`` (megatron-core 0.16) or the ``common_state`` object
  inside the ``.distcp`` files (0.17+, whose own reader unpickles it in full): loaded here
  with ``torch.load(weights_only=True)`` whatever the torch version's default or
  TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD say.
- byte objects inside ``.distcp`` files (our RNG state): torch's planner loads them with
  ``weights_only=False``; our planner uses ``weights_only=True``. The RNG state is
  saved as tensors and Python scalars; numpy arrays of numbers (how earlier versions
  saved it) and references to the optimizer classes the hybrid-device optimizer names in
  its parameter groups (``--optimizer-cpu-offload``) are the only other things admitted.

The same pass checks every shard file against the sizes the metadata promises, so a
truncated shard fails with one line naming the file instead of deep inside a reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import json
import os
import pickle
import re
import warnings
from collections import OrderedDict

import torch

_METADATA = ".metadata"
_COMMON = "common.pt"
_COMMON_OBJECT = "common_state/"  # key prefix of the common state inside .distcp (0.17+)
# What torch.distributed.checkpoint.load says on every ``no_dist=True`` read, though that
# argument already states the intent: each rank reads the files on its own.
SINGLE_PROCESS_NOTICE = ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
                         "load in a single process.")
_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
)


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to import something that is not plain data."""


def _enum_member(cls, name):
    """``getattr(cls, name)`` for an enum member of the allowed modules: how some Python 3.11
    releases (Debian bookworm's 3.11.2 among them) pickle enums. Anything else is refused."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ in _MODULES \
            and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise UnsafeCheckpointError(f"refuses getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r})")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module in _MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch" and name == "Size":
            return torch.Size
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)
        elif (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath"):  # torch's writer records its path
            return super().find_class(module, name)
        elif module == "builtins" and name in ("set", "frozenset", "slice", "complex"):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"refuses to import {module}.{name}")


def read_metadata(checkpoint_dir: str):
    """The torch.distributed.checkpoint Metadata of ``checkpoint_dir``, read without running code."""
    path = os.path.join(checkpoint_dir, _METADATA)
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()


def check_checkpoint_files(checkpoint_dir: str) -> None:
    """Raise ValueError naming the first missing, truncated or unsafe file of a torch_dist checkpoint."""
    info = os.path.join(checkpoint_dir, "metadata.json")
    try:
        with open(info) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError) as e:
        raise ValueError(f"{info} is unreadable ({type(e).__name__}: {e})") from None
    if backend not in ("torch_dist", "torch_dcp_fsdp2"):
        raise ValueError(f"{info} names sharded backend {backend!r}; only torch_dist and torch_dcp_fsdp2 "
                         f"(--use-torch-fsdp2) checkpoints are read")
    path = os.path.join(checkpoint_dir, _METADATA)
    try:
        metadata = read_metadata(checkpoint_dir)
    except UnsafeCheckpointError as e:
        raise ValueError(f"{path} is not plain checkpoint metadata: the unpickler {e}") from None
    except FileNotFoundError:
        raise ValueError(f"{path} is missing") from None
    except Exception as e:  # truncated or garbled pickle
        raise ValueError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    needed: dict[str, int] = {}
    for storage in (getattr(metadata, "storage_data", None) or {}).values():
        name = storage.relative_path
        needed[name] = max(needed.get(name, 0), storage.offset + storage.length)
    for name, size in sorted(needed.items()):
        shard = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(shard):
            raise ValueError(f"checkpoint shard {shard} is missing")
        have = os.path.getsize(shard)
        if have < size:
            raise ValueError(f"checkpoint shard {shard} is truncated: {have} bytes, its metadata needs {size}")
    common = os.path.join(checkpoint_dir, _COMMON)
    if not os.path.isfile(common) and _common_object_key(metadata) is None:
        raise ValueError(f"{common} is missing (and the shards hold no common state)")


def _common_object_key(metadata) -> str | None:
    """Key of the common-state object inside the shards (megatron-core 0.17+), or None."""
    keys = getattr(metadata, "state_dict_metadata", None) or {}
    return next((k for k in keys if k.startswith(_COMMON_OBJECT)), None)


def load_common(checkpoint_dir: str) -> dict:
    """The common state as plain data (tensors, numbers, strings, containers).

    From ``common.pt`` where there is one, else from the ``common_state`` object in the shards.
    """
    checkpoint_dir = str(checkpoint_dir)
    path = os.path.join(checkpoint_dir, _COMMON)
    if not os.path.isfile(path):
        try:
            key = _common_object_key(read_metadata(checkpoint_dir))
        except Exception:  # no or unsafe metadata: report the missing common.pt below
            key = None
        if key is not None:
            return _load_common_object(checkpoint_dir, key)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is unreadable, truncated or not plain data ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})") from None


def _load_common_object(checkpoint_dir: str, key: str) -> dict:
    """megatron-core 0.17+'s common state: its pickled bytes, unpickled with weights_only=True."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _MetadataAsData(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return read_metadata(checkpoint_dir)

    raw: dict[str, bytes] = {}

    class _RawBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            raw[read_item.dest_index.fqn] = value.getvalue()

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape(SINGLE_PROCESS_NOTICE) + "$", category=UserWarning)
            load({key: io.BytesIO()}, storage_reader=_MetadataAsData(checkpoint_dir),
                 planner=_RawBytes(flatten_state_dict=False), no_dist=True)
        with torch.serialization.safe_globals([io.BytesIO]):  # dcp pickles the object's BytesIO
            loaded = torch.load(io.BytesIO(raw[key]), map_location="cpu", weights_only=True)
        if isinstance(loaded, io.BytesIO):  # inside it, megatron-core's torch.save of the state
            with torch.serialization.safe_globals(_numpy_array_globals()):
                loaded = torch.load(loaded, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{checkpoint_dir}: the common state ({key}) is unreadable, truncated or not plain data "
                         f"({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})"
                         ) from None
    return loaded[0] if isinstance(loaded, (list, tuple)) else loaded


def common_strategy():
    """megatron-core's torch common-state reader, loading with weights_only=True."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class _SafeCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return load_common(str(checkpoint_dir))

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise NotImplementedError("torch_dist keeps sharded objects inside its .distcp files")

    return _SafeCommonLoad()


def _safe_planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class _SafeMCoreLoadPlanner(MCoreLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            with torch.serialization.safe_globals(_numpy_array_globals() + _optimizer_classes()):
                obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _SafeMCoreLoadPlanner


def _optimizer_classes() -> list:
    """The optimizer classes megatron-core's hybrid-device optimizer (--optimizer-cpu-offload)
    names in its parameter groups: referenced, never instantiated, by the unpickler."""
    from megatron.core.optimizer import CPUAdam, CPUSGD, Adam, SGD

    return list({CPUAdam, CPUSGD, Adam, SGD})


def _numpy_array_globals() -> list:
    """What a pickled numpy array of numbers needs (RNG states saved by earlier versions).

    Its elements still go through the same restricted unpickler, so this admits arrays,
    not arbitrary objects.
    """
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    out = [_reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [getattr(dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType") if hasattr(dtypes, n)]
    return out


@contextlib.contextmanager
def safe_byte_objects():
    """While loading, megatron-core's torch_dist reader builds our planner instead of its own
    and reads the common state through ``load_common``."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    from megatron_weipipe import mcore_versions

    patches = [(mcore_torch, "MCoreLoadPlanner", _safe_planner_class())]
    owner = mcore_versions.common_state_loader_owner()
    if owner is not None:
        patches.append((owner, "load_common_state_dict", load_common))
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in originals:
            setattr(module, name, value)
