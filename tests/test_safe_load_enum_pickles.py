"""Checkpoint metadata written by a Python that pickles enums as ``getattr(cls, name)``
(Debian bookworm's 3.11.2, the CPU image's Python) reads back; other getattr calls do not."""

import io
import os
import pickle
from collections import OrderedDict

import pytest
from torch.distributed.checkpoint import metadata as dcp_metadata

from megatron_weipipe.training.checkpoint.safe_load import UnsafeCheckpointError, read_metadata


class _ByName:
    """Pickles as ``getattr(target, name)``, the way enum members are pickled there."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


def _write(tmp_path, obj):
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(obj, f)
    return str(tmp_path)


def test_enum_member_pickled_by_name_reads_as_the_stock_unpickler_reads_it(tmp_path):
    enum_cls = dcp_metadata._MEM_FORMAT_ENCODING
    members = list(enum_cls)
    path = _write(tmp_path, {"members": [_ByName(enum_cls, m.name) for m in members],
                             "props": dcp_metadata.TensorProperties()})
    ours = read_metadata(path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        stock = pickle.load(f)
    assert ours == stock
    assert ours["members"] == members and all(a is b for a, b in zip(ours["members"], members))


@pytest.mark.parametrize("target,name", [(OrderedDict, "fromkeys"), (dcp_metadata._MEM_FORMAT_ENCODING, "__class__"),
                                         (dcp_metadata.TensorProperties, "create_from_tensor")])
def test_other_getattr_calls_are_refused(tmp_path, target, name):
    buf = io.BytesIO()
    pickle.dump(_ByName(target, name), buf)
    (tmp_path / ".metadata").write_bytes(buf.getvalue())
    with pytest.raises(UnsafeCheckpointError, match="refuses getattr"):
        read_metadata(str(tmp_path))
