"""Which classes a pickle may name is declared by the reader of each format: the unpickler has no
list of its own, torch's list holds torch's types only, and an engine's classes are accepted only
by the source that reads that engine's files (milliseconds, synthetic pickles)."""

import zipfile

import pytest

from hf_ckpt_integrations.errors import UnsafeCheckpointError
from hf_ckpt_integrations.formats import torch_files, unpickler
from hf_ckpt_integrations.sources import dcp
from hf_ckpt_integrations.sources.deepspeed import allowlist as deepspeed_allowlist


def _torch_zip(path, pkl: bytes):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
    return path


def _str(s: str) -> bytes:
    return b"X" + len(s).to_bytes(4, "little") + s.encode()


# What a DeepSpeed optimizer file pickles (protocol 2): a LossScaler (GLOBAL, NEWOBJ, BUILD) and a
# fragment_address with its fields.
LOSS_SCALER = b"\x80\x02cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n)\x81}b."
FRAGMENT = (b"\x80\x02cdeepspeed.utils.tensor_fragment\nfragment_address\n)\x81}(" + _str("numel") + b"K\x03"
            + _str("start") + b"K\x01ub.")


def test_deepspeed_types_load_with_the_deepspeed_sources_list(tmp_path):
    assert isinstance(deepspeed_allowlist.load(_torch_zip(tmp_path / "a.pt", LOSS_SCALER)), unpickler.Opaque)
    frag = deepspeed_allowlist.load(_torch_zip(tmp_path / "b.pt", FRAGMENT))
    assert (frag.numel, frag.start) == (3, 1)


@pytest.mark.parametrize("pkl", [LOSS_SCALER, FRAGMENT], ids=["LossScaler", "fragment_address"])
@pytest.mark.parametrize("allowed", [None, torch_files.TORCH_TENSOR_ALLOWED, dcp.ALLOWED],
                         ids=["torch-default", "torch-tensors", "dcp"])
def test_deepspeed_types_are_refused_by_every_other_list(pkl, allowed, tmp_path):
    with pytest.raises(UnsafeCheckpointError, match="refused for safety: its pickle asks for `deepspeed"):
        torch_files.load(_torch_zip(tmp_path / "c.pt", pkl), allowed=allowed)


def test_readers_lists_hold_only_their_own_modules():
    assert set(unpickler.CONTAINERS) == {"collections", "builtins"}
    # client state (tests/formats/test_client_state.py): inert records any torch.save file may hold beside tensors
    assert set(unpickler.CLIENT_STATE) == {
        "numpy", "numpy.core.multiarray", "numpy._core.multiarray", "_codecs", "argparse", "types", "pathlib",
        "pathlib._local", "megatron.model.enums", "megatron.core.enums", "megatron.core.transformer.enums"}
    assert {m for m in torch_files.TORCH_ALLOWED if m not in unpickler.CONTAINERS and m not in unpickler.CLIENT_STATE} \
        == {"torch", "torch._utils", "torch._tensor", "torch.nn.parameter", "torch.storage"}
    engine = {m for m in deepspeed_allowlist.ALLOWED if m not in torch_files.TORCH_ALLOWED}
    assert engine == {"deepspeed.runtime.fp16.loss_scaler", "deepspeed.runtime.zero.config",
                      "deepspeed.utils.tensor_fragment"}
