"""Megatron-Core 0.17+'s common state (``args``, ``iteration``...), kept inside the ``.distcp`` files instead
of ``common.pt``, read as inert data (split from layout.py by job)."""
import os
from typing import Any, Dict, Optional, Tuple

from ...errors import CheckpointError, LayoutError, UnsafeCheckpointError, short_repr
from ...formats import torch_files, unpickler
from .. import dcp

# What Megatron's pickles (common.pt, model_optim_rng.pt, the 0.17+ common state) may name: torch's tensor
# records plus inert client state (argparse.Namespace, Megatron's enums as markers).
LEGACY_ALLOWED = {**torch_files.TORCH_ALLOWED, **unpickler.CLIENT_STATE}


# ---------------------------------------------------------------- Megatron-Core 0.17+: the common state in .distcp
# 0.17+ writes no common.pt (dist_checkpointing/serialization.py ``save``): the common, non-sharded state dict
# (``args``, ``iteration``, ``checkpoint_version``...) is added to the sharded one as
# ``ShardedObject(key="common_state", data=state_dict, global_shape=(1,), global_offset=(0,), replica_id=rank)``,
# which the torch_dist strategy serialises like every sharded object, ``torch.save([obj.data], BytesIO())``
# (strategies/torch.py ``_mcore_to_torch_sharded_object``), and torch DCP stores as a bytes entry
# (``BytesStorageMetadata`` in ``.metadata``; the bytes, a torch zip archive, in rank 0's ``__0_N.distcp``) under
# the object's unique key. Megatron reads it back with ``torch.load(..., weights_only=True)[0]``
# (``load_common_state_dict``); here the same bytes go through the restricted unpickler instead.
COMMON_STATE_KEY = "common_state/shard_0_1"  # ShardedObject("common_state", None, (1,), (0,)).unique_key
_COMMON_STATE_MEMO: Dict[Tuple[str, int, int], Optional[Dict[str, Any]]] = {}


def read_common_state(ckpt_dir: str) -> Optional[Dict[str, Any]]:
    """The common state dict a Megatron-Core 0.17+ ``torch_dist`` save keeps inside its ``.distcp`` files, read
    as inert data (:data:`LEGACY_ALLOWED`: ``args`` an ``argparse.Namespace`` record, Megatron's enums as
    markers; any other global is refused by name); None when ``.metadata`` has no ``common_state`` entry (a
    save of 0.16 or older, whose common state is ``common.pt``). Memoised per ``.metadata`` (path, mtime, size)."""
    where = os.path.join(ckpt_dir, dcp.METADATA)
    try:
        st = os.stat(where)
    except OSError:
        return None
    key = (os.path.abspath(where), st.st_mtime_ns, st.st_size)
    if key not in _COMMON_STATE_MEMO:
        _COMMON_STATE_MEMO[key] = _read_common_state(ckpt_dir, where)
    return _COMMON_STATE_MEMO[key]


def _read_common_state(ckpt_dir: str, where: str) -> Optional[Dict[str, Any]]:
    md = dcp._record(unpickler.load_pickle(where, allowed=dcp.ALLOWED), "Metadata", where, "the file")
    sd_meta = md.field("state_dict_metadata")
    if type(sd_meta) is not dict or COMMON_STATE_KEY not in sd_meta:
        return None
    dcp._record(sd_meta[COMMON_STATE_KEY], "BytesStorageMetadata", where, f"entry {COMMON_STATE_KEY}")
    sdata = md.field("storage_data")
    infos = [dcp._record(info, "_StorageInfo", where, "a storage entry")
             for index, info in (sdata.items() if type(sdata) is dict else ())
             if isinstance(index, unpickler.Record) and index.field("fqn") == COMMON_STATE_KEY]
    if len(infos) != 1:
        raise LayoutError(f"{where}: {len(infos)} storage entries for {COMMON_STATE_KEY} (Megatron-Core writes "
                          "one, from rank 0); the checkpoint is corrupt or crafted: copy it again from the training run")
    rel, off, length = (infos[0].field(n) for n in ("relative_path", "offset", "length"))
    if type(rel) is not str or not rel.endswith(".distcp") or any(c in rel for c in "/\\\0") \
            or type(off) is not int or type(length) is not int or off < 0 or length <= 0:
        raise LayoutError(f"{where}: the storage entry of {COMMON_STATE_KEY} is {short_repr(infos[0].state)}, not "
                          "a byte range of a .distcp file here; the checkpoint is corrupt or crafted: copy it again")
    if infos[0].field("transform_descriptors"):
        raise LayoutError(f"{where}: {COMMON_STATE_KEY} is stored through storage-writer extensions "
                          f"{short_repr(infos[0].field('transform_descriptors'))}; hf-ckpt reads what "
                          "FileSystemWriter stores plainly: save without _extensions")
    path = os.path.join(ckpt_dir, rel)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (it holds the save's common state, {COMMON_STATE_KEY}); copy every "
                              ".distcp file of the iteration directory")
    try:
        obj = torch_files.load(path, offset=off, length=length, allowed=LEGACY_ALLOWED)
    except UnsafeCheckpointError as e:  # name the entry too: a .distcp file holds tensors and this one pickle
        raise UnsafeCheckpointError(str(e).replace(f"{path}: ", f"{path} ({COMMON_STATE_KEY}): ", 1)) from None
    if type(obj) is not list or len(obj) != 1 or type(obj[0]) is not dict:
        raise LayoutError(f"{path} (bytes {off}+{length}): the common state {COMMON_STATE_KEY} holds "
                          f"{short_repr(obj)}, not Megatron's [state dict]; the checkpoint is corrupt or crafted: "
                          "copy it again from the training run")
    return obj[0]
