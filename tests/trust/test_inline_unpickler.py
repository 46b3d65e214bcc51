"""The unpickler's inline loop (a whole pickle in memory: the common opcodes run on the bytes) against
its standard loop (``pickle._Unpickler``'s dispatch, which a stream or a framed pickle uses): on real
torch pickles and on mutated bytes, both return equal values or both refuse with the same error class.
Milliseconds per case; ``HFCKPT_FUZZ_EXAMPLES=N`` runs N cases (``make fuzz``)."""

import io
import os
import pickle
import zipfile
from collections import OrderedDict

import pytest
import torch

from hf_ckpt_integrations.errors import CheckpointError
from hf_ckpt_integrations.formats import torch_files, unpickler

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("HFCKPT_FUZZ_EXAMPLES", "0")) or 300


class _Standard(unpickler._Unpickler):
    """The same unpickler with the inline loop off."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._memfile = None


def _run(cls, data, allowed, persistent_load):
    try:
        with unpickler.gc_paused():
            obj = cls(io.BytesIO(data), "x.pkl", allowed, persistent_load).load()
            unpickler._check_tree(obj, "x.pkl", unpickler.MAX_NODES)
        return "ok", obj
    except CheckpointError as e:  # UnsafeCheckpointError included: the class is compared
        return type(e).__name__, None
    except Exception:  # load_stream turns these into "corrupt pickle"
        return "corrupt", None


def _torch_pickle(tmp_path):
    """data.pkl of a torch.save of a state dict with every opcode torch writes: tensors, views, a
    nested dict, strings (one not ASCII), ints of each width, None/bools, shared objects."""
    shared = torch.arange(12.0).reshape(3, 4)
    sd = OrderedDict(w=shared, v=shared[1:], b=torch.zeros(300, dtype=torch.bfloat16),
                     meta={"step": 7, "big": 2**40, "neg": -5, "mid": 40000, "name": "gewicht-ä",
                           "flags": (None, True, False), "empty": ((), [], {})})
    path = tmp_path / "sd.pt"
    torch.save(sd, path)
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        data = zf.read(name)
    with open(path, "rb") as fh, zipfile.ZipFile(path) as zf:
        storages = torch_files._stored_entries(zf, fh, path.stat().st_size, str(path), os.path.dirname(name))
    return data, torch_files._storages_loader(str(path), storages)


@pytest.fixture(scope="module")
def torch_pickle(tmp_path_factory):
    return _torch_pickle(tmp_path_factory.mktemp("inline"))


def _same(data, allowed=torch_files.TORCH_ALLOWED, persistent_load=None):
    fast, slow = _run(unpickler._Unpickler, data, allowed, persistent_load), \
        _run(_Standard, data, allowed, persistent_load)
    assert fast[0] == slow[0], (fast[0], slow[0])
    if fast[0] == "ok":
        assert repr(fast[1]) == repr(slow[1])
    return fast


def test_torch_pickle_reads_the_same(torch_pickle):
    data, loader = torch_pickle
    kind, obj = _same(data, persistent_load=loader)
    assert kind == "ok" and obj["meta"]["name"] == "gewicht-ä" and obj["v"].storage_offset == 4


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_plain_pickles_read_the_same(protocol):
    value = {"a": [1, 2, (3, 4, 5)], "b": ("x" * 300, -1, 2**31, 2**64, 1.5), "c": ((), [], {}),
             "d": [(i, str(i)) for i in range(300)]}  # 300 entries: memo indexes past 255 (LONG_BINPUT)
    if protocol >= 3:  # (protocol 2 pickles bytes through a global)
        value["e"] = b"raw"
    kind, obj = _same(pickle.dumps(value, protocol=protocol), allowed=unpickler.CONTAINERS)
    assert kind == "ok" and obj == value


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_torch_pickles_read_the_same(torch_pickle, data):
    raw, loader = torch_pickle
    buf = bytearray(raw)
    how = data.draw(st.sampled_from(["flip", "truncate", "splice"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    elif how == "truncate":
        del buf[data.draw(st.integers(0, len(buf) - 1)):]
    else:  # a run of the pickle's own bytes repeated elsewhere: opcodes in new places
        a = data.draw(st.integers(0, len(buf) - 1))
        b = data.draw(st.integers(a, min(len(buf), a + 40)))
        at = data.draw(st.integers(0, len(buf)))
        buf[at:at] = buf[a:b]
    _same(bytes(buf), persistent_load=loader)
