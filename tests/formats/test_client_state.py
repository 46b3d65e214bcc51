"""Client state is data, never code, never a reason to refuse the weights.

Training loops save non-tensor state beside the weights: GPT-NeoX's ``save_ds_checkpoint`` passes
``random.getstate()``, ``np.random.get_state()`` (a numpy uint32 array), torch RNG ByteTensors and a
dict of args as DeepSpeed ``client_state``; Megatron-(DeepSpeed)'s ``save_checkpoint`` stores ``args``
as an ``argparse.Namespace`` (torch dtypes, paths, Megatron enums inside), ``checkpoint_version`` floats
and ``rng_state`` lists. The restricted unpickler rebuilds each as an inert record (nothing imported,
nothing called: hf_ckpt_integrations/formats/unpickler.py ``CLIENT_STATE``), while tensors beside them
are still read exactly; hostile variants of the same globals are still refused.

Every pickle here is made by the real objects and ``torch.save``, in the zip and the legacy format,
and with numpy 2's spelling (``numpy._core``, what the installed numpy writes) and numpy 1's
(``numpy.core``, the same bytes renamed). Milliseconds each.
"""

import argparse
import collections
import enum
import pathlib
import pickle
import random
import shutil
import sys
import types
import zipfile

import numpy as np
import pytest
import torch

from helpers import REPO, assert_bitwise_equal, export, load_safetensors
from hf_ckpt_integrations.errors import CheckpointError, UnsafeCheckpointError
from hf_ckpt_integrations.formats import torch_files, unpickler
from hf_ckpt_integrations.sources.deepspeed import allowlist as deepspeed_allowlist

FIXTURES = REPO / "tests" / "fixtures" / "deepspeed"


def _megatron_enums():
    """Megatron's enums (args.model_type, args.attention_backend), defined here under Megatron's module
    names so that pickle writes them as Megatron's own saves do (:func:`_save` lends pickle the modules)."""
    out = {}
    for module, name, members in (("megatron.core.transformer.enums", "AttnBackend", {"flash": 1, "auto": 5}),
                                  ("megatron.core.enums", "ModelType", {"encoder_or_decoder": 1}),
                                  ("megatron.model.enums", "ModelType", {"encoder_or_decoder": 1})):
        out[f"{module}.{name}"] = enum.Enum(name, members, module=module)
    return out


ENUMS = _megatron_enums()


def _rng_states():
    np.random.seed(1234)
    random.seed(1234)
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}


def _megatron_args():
    return argparse.Namespace(num_layers=2, hidden_size=64, lr=1e-4, params_dtype=torch.bfloat16,
                              save=pathlib.PosixPath("/ckpt/run"), data_path=["1.0", "/data/x"],
                              model_type=ENUMS["megatron.core.enums.ModelType"].encoder_or_decoder,
                              attention_backend=ENUMS["megatron.core.transformer.enums.AttnBackend"].auto,
                              legacy_model_type=ENUMS["megatron.model.enums.ModelType"].encoder_or_decoder,
                              deepspeed_config_dict={"train_batch_size": 8}, seed=1234)


# What each engine saves (and the single types on their own): name -> object beside a tensor.
CLIENT_STATES = {
    # GPT-NeoX megatron/checkpointing.py save_ds_checkpoint
    "gpt-neox": {"iteration": 2, "args": {"num_layers": 2, "hidden_size": 64, "tokenizer_type": "HFTokenizer",
                                          "model_parallel_size": 2}, **_rng_states()},
    # Megatron-DeepSpeed megatron/checkpointing.py save_checkpoint (rng_state: one dict per DP rank)
    "megatron-deepspeed": {"args": _megatron_args(), "checkpoint_version": 3.0, "iteration": 2,
                           "rng_state": [_rng_states()], "tokens": 4096,
                           "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 16, "decay_style": "cosine"}},
    "numpy-array": np.arange(12, dtype=np.float64).reshape(3, 4),
    "numpy-fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    "numpy-scalars": [np.float32(1.5), np.float64(-2.25), np.int64(7), np.uint32(3), np.bool_(True)],
    "numpy-dtypes": [np.dtype("float32"), np.dtype(">i8"), np.dtype([("a", "<i4"), ("b", "f8")])],
    "namespace": argparse.Namespace(a=1, nested=argparse.Namespace(b="x")),
    "simple-namespace": types.SimpleNamespace(a=1, b=[1, 2]),
    "paths": [pathlib.PosixPath("/a/b"), pathlib.PurePosixPath("rel/c"), pathlib.Path(".")],
    "enums": list(m for e in ENUMS.values() for m in e),
    "torch-size": torch.Size([3, 4]),
    "ordered-dict": collections.OrderedDict(a=1, b=2.5),
}


# the states that pickle numpy.(_)core.multiarray (arrays, scalars)
SPELLED_BY_NUMPY_VERSION = {"gpt-neox", "megatron-deepspeed", "numpy-array", "numpy-fortran", "numpy-scalars"}


def _save(obj, path, fmt):
    fake = {}
    for qualname, cls in ENUMS.items():  # pickle imports an enum's module to check it: lend it Megatron's
        parts = qualname.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            fake.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        setattr(fake[".".join(parts)], cls.__name__, cls)
    assert not set(fake) & set(sys.modules)
    sys.modules.update(fake)
    try:
        torch.save(obj, path, _use_new_zipfile_serialization=fmt == "zip")
    finally:
        for name in fake:
            del sys.modules[name]
    return path


def _numpy1(path, fmt):
    """``path`` as numpy 1 pickles it: ``numpy.core.multiarray`` where numpy 2 writes ``numpy._core``."""
    old, new = b"numpy._core.multiarray", b"numpy.core.multiarray"
    if fmt == "legacy":  # the legacy reader finds each pickle's end by parsing: lengths may change
        assert old in path.read_bytes()
        path.write_bytes(path.read_bytes().replace(old, new))
        return path
    with zipfile.ZipFile(path) as zf:
        entries = [(i, zf.read(i)) for i in zf.infolist()]
    assert any(old in data for info, data in entries if info.filename.endswith("data.pkl"))
    path.unlink()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for info, data in entries:
            zf.writestr(info.filename, data.replace(old, new) if info.filename.endswith("data.pkl") else data)
    return path


def _tensor_bytes(ref, path):
    offset, nbytes = ref.byte_range()
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(nbytes)


def _inert(value):
    """Every node of a loaded tree: plain data, a TensorRef, or one of the unpickler's stand-ins."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, (dict,)):
            todo += list(v.keys()) + list(v.values())
        elif isinstance(v, (list, tuple)):
            todo += list(v)
        elif isinstance(v, unpickler.StandIn):
            todo += list(vars(v).values())
        else:
            assert v is None or isinstance(v, (bool, int, float, str, bytes, torch_files.TensorRef)), type(v)
    return True


@pytest.mark.parametrize("name,fmt,spelling", [
    (name, fmt, spelling) for name in CLIENT_STATES for fmt in ("zip", "legacy")
    for spelling in (("numpy2", "numpy1") if name in SPELLED_BY_NUMPY_VERSION else ("numpy2",))])
def test_client_state_reads_as_inert_data_and_the_weights_exactly(name, fmt, spelling, tmp_path):
    weight = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    path = _save({"module": {"w": weight}, "client": CLIENT_STATES[name]}, tmp_path / "s.pt", fmt)
    if spelling == "numpy1":
        _numpy1(path, fmt)
    for read in (torch_files.load, deepspeed_allowlist.load):  # torch's list, and a source's on top of it
        got = read(path)
        assert _tensor_bytes(got["module"]["w"], path) == weight.numpy().tobytes()
        assert _inert(got["client"])


def test_numpy_rng_state_keeps_its_numbers(tmp_path):
    """np.random.get_state(): ('MT19937', uint32[624], pos, has_gauss, cached) - the array's raw bytes,
    shape and dtype are kept as the pickle says (nothing reads them, but nothing is invented)."""
    np.random.seed(7)
    state = np.random.get_state()
    for fmt in ("zip", "legacy"):
        got = torch_files.load(_save({"np_rng_state": state}, tmp_path / f"{fmt}.pt", fmt))["np_rng_state"]
        assert got[0] == "MT19937" and got[2:] == state[2:]
        arr = got[1]
        assert isinstance(arr, unpickler.NumpyArray) and arr.shape == (624,) and arr.dtype.descr == "u4"
        assert arr.data == state[1].tobytes()


def test_megatron_args_fields(tmp_path):
    args = torch_files.load(_save({"args": _megatron_args()}, tmp_path / "a.pt", "legacy"))["args"]
    fields = args.state
    assert fields["lr"] == 1e-4 and fields["save"] == "/ckpt/run" and fields["params_dtype"] == "BF16"
    assert fields["attention_backend"].value == 5 and fields["model_type"].value == 1


def test_a_deepspeed_save_with_client_state_exports_bitwise(tmp_path):
    """A real DeepSpeed ZeRO-2 save (committed fixture) whose model states carry GPT-NeoX's and
    Megatron-DeepSpeed's client state exports the same bytes as without it."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "0.18.9" / "zero2", src)
    states = src / "ckpt" / "global_step2" / "mp_rank_00_model_states.pt"
    model = torch.load(states, weights_only=False)
    model.update(CLIENT_STATES["gpt-neox"])
    model["args"] = _megatron_args()
    states.unlink()
    _save(model, states, "zip")
    r = export(str(src / "ckpt"), str(tmp_path / "out"), "--config", str(src), "--quiet")
    assert_bitwise_equal(load_safetensors(tmp_path / "out" / "model.safetensors"),
                         load_safetensors(src / "reference.safetensors"))


def _pickle_zip(path, pkl: bytes):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
    return path


def _g(module, name):
    return f"c{module}\n{name}\n".encode()


def _s(text: str) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text.encode()


# Hostile variants of the accepted globals: (id, pickle, what the refusal says)
RECON = _g("numpy._core.multiarray", "_reconstruct")
HOSTILE = [
    ("numpy-load", b"\x80\x02" + _g("numpy", "load") + _s("/etc/passwd") + b"\x85R.", "asks for `numpy.load`"),
    ("numpy-randomstate-ctor", b"\x80\x02" + _g("numpy.random._pickle", "__randomstate_ctor") + b")R.",
     "asks for `numpy.random._pickle.__randomstate_ctor`"),
    ("numpy-core-other", b"\x80\x02" + _g("numpy.core.multiarray", "fromstring") + b")R.", "asks for `numpy.core"),
    ("reconstruct-callable", b"\x80\x02" + RECON + _g("argparse", "Namespace") + b"K\x00\x85C\x01b\x87R.",
     "_reconstruct called with"),
    ("reconstruct-codecs", b"\x80\x02" + RECON + _g("_codecs", "encode") + b"K\x00\x85C\x01b\x87R.",
     "_reconstruct called with"),
    ("reconstruct-shape", b"\x80\x02" + RECON + _g("numpy", "ndarray") + b"K\x05\x85C\x01b\x87R.",
     "_reconstruct called with"),
    ("ndarray-called", b"\x80\x02" + _g("numpy", "ndarray") + b")R.", "corrupt pickle"),
    ("ndarray-newobj", b"\x80\x02" + _g("numpy", "ndarray") + b")\x81.", "by NEWOBJ"),
    ("codecs-other-encoding", b"\x80\x02" + _g("_codecs", "encode") + _s("eJw=") + _s("base64") + b"\x86R.",
     "_codecs.encode"),
    ("dtype-of-object", b"\x80\x02" + _g("numpy", "dtype") + _g("argparse", "Namespace") + b"\x89\x88\x87R.",
     "is not a dtype"),
    ("array-state", b"\x80\x02" + RECON + _g("numpy", "ndarray") + b"K\x00\x85C\x01b\x87R" + _s("x") + b"b.",
     "numpy array with the state"),
    ("enum-of-object", b"\x80\x02" + _g("megatron.core.enums", "ModelType") + b"]\x85R.", "enum member"),
]


@pytest.mark.parametrize("pkl,match", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_variants_are_refused(pkl, match, tmp_path):
    with pytest.raises(CheckpointError, match=match):
        torch_files.load(_pickle_zip(tmp_path / "h.pt", pkl))


def test_a_refused_global_is_unsafe_not_corrupt(tmp_path):
    with pytest.raises(UnsafeCheckpointError, match="refused for safety"):
        torch_files.load(_pickle_zip(tmp_path / "h.pt", HOSTILE[0][1]))
    with pytest.raises(UnsafeCheckpointError, match="refused for safety"):
        torch_files.load(_pickle_zip(tmp_path / "r.pt", HOSTILE[3][1]))


def test_nothing_is_imported_or_called(tmp_path):
    """Reading numpy's and Megatron's globals imports neither (the stand-ins are ours), in a fresh
    interpreter."""
    import subprocess

    path = _save({"np": np.random.get_state(), "args": _megatron_args()}, tmp_path / "s.pt", "zip")
    code = ("import sys; from hf_ckpt_integrations.formats import torch_files; torch_files.load(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'megatron', 'torch')))")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_universal_carries_plain_client_state_and_names_what_it_leaves(tmp_path):
    """``universal`` of a save with GPT-NeoX's client state: what ``load_checkpoint`` hands back to the
    loop (iteration, python/torch RNG states, the args dict) is in the universal model-states files as
    saved; numpy's RNG state and a Namespace (read as inert stand-ins, never rebuilt) are left out by
    name, never written as something else."""
    from hf_ckpt_integrations.universal_writer import MODEL_STATES, write_universal_checkpoint

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "0.18.9" / "zero2", src)
    states = src / "ckpt" / "global_step2" / "mp_rank_00_model_states.pt"
    model = torch.load(states, weights_only=False)
    client = {**CLIENT_STATES["gpt-neox"], "megatron_args": _megatron_args()}
    model.update(client)
    states.unlink()
    _save(model, states, "zip")
    report = write_universal_checkpoint(str(src / "ckpt"), str(tmp_path / "uc" / "global_step2"), config=str(src))
    left = [n for n in report["notes"] if n.startswith("client state not carried")]
    assert len(left) == 1 and "np_rng_state" in left[0] and "megatron_args" in left[0], report["notes"]
    for name in MODEL_STATES:
        out = torch.load(tmp_path / "uc" / "global_step2" / name, weights_only=True)
        assert "np_rng_state" not in out and "megatron_args" not in out
        assert out["iteration"] == 2 and out["args"] == client["args"]
        assert out["random_rng_state"] == client["random_rng_state"]
        for key in ("torch_rng_state", "cuda_rng_state"):
            assert torch.equal(out[key], client[key])
        assert torch.equal(out["rng_tracker_states"]["model-parallel-rng"],
                           client["rng_tracker_states"]["model-parallel-rng"])
