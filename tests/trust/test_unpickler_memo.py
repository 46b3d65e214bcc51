"""The unpickler's list memo (issue 39: DCP metadata memoizes ~20 objects per chunk) against what the
dict memo did: sparse hand-made indices still read, a GET of an index no PUT stored (a hole, a
negative protocol-0 index) refused, an index past the budget refused before anything is allocated;
and the memory it is for, measured by tracemalloc (deterministic, not a timing): a torch DCP
``Metadata`` pickle of 2,000 chunks peaks under 2.6 KB per chunk (3.3 KB with the dict memo and
records with a ``__dict__``; 2.0 KB now)."""

import pickle
import struct
import tracemalloc

import pytest

from hf_ckpt_integrations.errors import CheckpointError
from hf_ckpt_integrations.formats import unpickler
from hf_ckpt_integrations.sources import dcp

from test_inline_unpickler import _same  # (tests/trust: on sys.path, as helpers is)


def _load(data):
    return unpickler.loads(data, path="m.pkl", allowed=unpickler.CONTAINERS)


def _long_binput(i):
    return b"r" + struct.pack("<I", i)


def _long_binget(i):
    return b"j" + struct.pack("<I", i)


def test_sparse_memo_indices_still_read():
    """A hand-made pickle may number its memo with gaps (no pickler does): the entries it stored read back,
    in the inline loop and the standard one alike."""
    data = b"\x80\x02]" + _long_binput(1000) + b"K\x07a0" + _long_binget(1000) + b"q\x05h\x05\x86."
    assert _load(data) == ([7], [7])
    assert _same(data, allowed=unpickler.CONTAINERS) == ("ok", ([7], [7]))


@pytest.mark.parametrize("data", [
    b"\x80\x02]" + _long_binput(5) + b"0" + _long_binget(3) + b".",  # a hole below a stored index
    b"\x80\x02]h\x00.",  # nothing stored at all
    b"]p0\n0g-1\n.",  # protocol 0: a negative index would be the list's last entry
], ids=["hole", "empty", "negative"])
def test_get_of_an_unstored_index_refused(data):
    with pytest.raises(CheckpointError, match="Memo value not found"):
        _load(data)
    assert _same(data, allowed=unpickler.CONTAINERS)[0] == "corrupt"


def test_memo_index_past_the_budget_refused_before_allocating():
    """LONG_BINPUT 2^32-1 would make a 32 GB list of holes: refused, naming the budget, in kilobytes."""
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="memo entry 4294967295, past the 4000000 objects"):
            _load(b"\x80\x02]" + _long_binput(2**32 - 1) + b".")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_dcp_metadata_unpickles_in_under_2_6_kb_per_chunk():
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    ranks, tensors = 4, 500
    sd, storage = {}, {}
    for r in range(ranks):
        for i in range(tensors):
            fqn, offsets = f"model.layers.{i}.mlp.weight", torch.Size([r, 0])
            storage[MetadataIndex(fqn, offsets)] = _StorageInfo(f"__{r}_0.distcp", i * 1000, 1000)
            sd.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                     torch.Size([ranks, 2]), []))
            sd[fqn].chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([1, 2])))
    data = pickle.dumps(Metadata(state_dict_metadata=sd, planner_data={f: (f,) for f in sd}, storage_data=storage))
    tracemalloc.start()
    try:
        md = unpickler.loads(data, path=".metadata", allowed=dcp.ALLOWED)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    chunks = ranks * tensors
    assert len(md.field("storage_data")) == chunks
    assert peak / chunks < 2600, f"{peak / chunks:.0f} bytes per chunk"
