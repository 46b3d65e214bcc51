"""Megatron-Core 0.17+ torch_dist saves: the common state inside the .distcp files, no common.pt (issue 37).

0.17+ needs Python >= 3.12 and the test venvs are Python 3.11 with megatron-core 0.16.1, so the 0.17 form
is made from the engine case ``megatron``'s real 0.16.1 saves the way 0.17's ``dist_checkpointing.save``
writes it: the tensors re-saved by torch DCP's own ``FileSystemWriter`` beside the entry
``common_state/shard_0_1`` holding ``torch.save([common.pt's dict])`` as a bytes entry (``BytesIO`` ->
``BytesStorageMetadata``), ``metadata.json`` kept, ``common.pt`` gone. Such a save exports without
``--config`` to the same bytes as the 0.16.1 save; a common state that pickles a forbidden global, or is
not Megatron's ``[dict]``, is refused by name.
"""
import argparse
import importlib.util
import io
import os
import shutil

import pytest
import torch

from helpers import export_refused, hf_ckpt

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core (requirements/main.txt) builds the engine case")

ITER = "iter_0000001"
KEY = "common_state/shard_0_1"  # ShardedObject("common_state", ..., (1,), (0,)).unique_key


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _common(src_iter):
    """common.pt's dict (the test's own trusted file: torch's weights_only load, Namespace allowed)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(src_iter / "common.pt", weights_only=True)


def _mcore_planner():
    """torch's default save planner with Megatron-Core's ``MCoreSavePlanner.transform_object``: a bytes entry
    is stored as it is (Megatron's ShardedObjects are already ``torch.save``d into their BytesIO; the
    default planner would ``torch.save`` the BytesIO object itself)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class MCoreLikeSavePlanner(DefaultSavePlanner):
        def transform_object(self, write_item, object):  # noqa: A002  (torch's parameter name)
            return object

    return MCoreLikeSavePlanner()


def _write_dcp(dst, sd):
    import torch.distributed.checkpoint as dcp

    dst.mkdir(parents=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(dst)), planner=_mcore_planner(), no_dist=True)


def _bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf


def to_017(src_root, dst_root, common_obj=None):
    """``src_root`` (a 0.16.1 torch_dist save dir) rewritten in 0.17's form at ``dst_root``: the tensors and
    the common state (``common_obj``, by default ``[common.pt's dict]``, as 0.17 wraps it) saved by DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    src, dst = src_root / ITER, dst_root / ITER
    reader = dcp.FileSystemReader(str(src))
    meta = reader.read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    sd[KEY] = _bytes([_common(src)] if common_obj is None else common_obj)
    _write_dcp(dst, sd)
    shutil.copy(src / "metadata.json", dst / "metadata.json")
    shutil.copy(src_root / "latest_checkpointed_iteration.txt", dst_root / "latest_checkpointed_iteration.txt")
    return dst_root


# ---------------------------------------------------------------- fast: a tiny DCP save in the 0.17 form


def test_common_state_is_read_inertly_from_the_distcp_bytes_entry(tmp_path):
    from hf_ckpt_integrations.formats.unpickler import Opaque
    from hf_ckpt_integrations.sources.megatron import common_state, layout

    args = argparse.Namespace(num_layers=2, vocab_size=11, params_dtype=torch.bfloat16)
    _write_dcp(tmp_path / ITER, {"decoder.final_layernorm.weight": torch.ones(4),
                                 KEY: _bytes([{"args": args, "iteration": 7, "checkpoint_version": 3.0}])})
    (tmp_path / ITER / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    common = common_state.read_common_state(str(tmp_path / ITER))
    assert common["iteration"] == 7 and isinstance(common["args"], Opaque)
    got = layout.read_args(str(tmp_path / ITER))
    assert (got["num_layers"], got["vocab_size"]) == (2, 11)
    assert common_state.read_common_state(str(tmp_path)) is None  # no .metadata there


def test_common_state_with_a_forbidden_global_is_refused_naming_entry_and_global(tmp_path):
    from hf_ckpt_integrations.errors import UnsafeCheckpointError
    from hf_ckpt_integrations.sources.megatron import common_state, layout

    _write_dcp(tmp_path / ITER, {"w": torch.ones(4), KEY: _bytes([{"evil": _Evil()}])})
    with pytest.raises(UnsafeCheckpointError, match=r"__0_0\.distcp \(common_state/shard_0_1\).*posix\.system"):
        common_state.read_common_state(str(tmp_path / ITER))


def test_without_the_entry_there_is_no_common_state(tmp_path):
    from hf_ckpt_integrations.sources.megatron import common_state, layout

    _write_dcp(tmp_path / ITER, {"w": torch.ones(4), "rng_state/shard_0_1": _bytes([{"x": 1}])})
    assert common_state.read_common_state(str(tmp_path / ITER)) is None


# ---------------------------------------------------------------- engine: real 0.16.1 saves rewritten


@pytest.fixture(scope="module")
def case(engine_ckpt):
    return engine_ckpt("megatron")


@pytest.mark.parametrize("lay", ["tp2", "tp2pp2"])
@needs_megatron
def test_017_common_state_exports_without_config_to_the_same_bytes(case, tmp_path, lay):
    save = to_017(case / lay / "torch_dist", tmp_path / "s017")
    assert not (save / ITER / "common.pt").exists()
    with open(save / ITER / ".metadata", "rb") as fh:
        import pickle

        md = pickle.load(fh)  # the test's own trusted file: real torch classes
    assert type(md.state_dict_metadata[KEY]).__name__ == "BytesStorageMetadata"
    r = hf_ckpt("export", save, tmp_path / "new")
    assert r.returncode == 0, r.stderr[-2000:]
    r = hf_ckpt("export", case / lay / "torch_dist", tmp_path / "old")
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("model.safetensors", "config.json"):  # config.json derived from the args, as with common.pt
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name
    r = hf_ckpt("inspect", save, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"iteration": 1' in r.stdout and '"format": "torch_dist"' in r.stdout


@needs_megatron
def test_017_common_state_pickling_a_forbidden_global_is_refused_by_name(case, tmp_path):
    common = _common(case / "tp2" / "torch_dist" / ITER)
    common["evil"] = _Evil()
    save = to_017(case / "tp2" / "torch_dist", tmp_path / "s017", common_obj=[common])
    export_refused(save, tmp_path / "out", match=("__0_0.distcp", KEY, "posix.system", "not on the allowlist"))


@needs_megatron
def test_017_common_state_that_is_not_a_list_of_one_dict_is_refused(case, tmp_path):
    common = _common(case / "tp2" / "torch_dist" / ITER)
    save = to_017(case / "tp2" / "torch_dist", tmp_path / "s017", common_obj=common)  # the dict, unwrapped
    export_refused(save, tmp_path / "out", match=(KEY, "not Megatron's [state dict]", ".distcp"))
