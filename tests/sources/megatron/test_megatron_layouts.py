"""Where a Megatron-Core save is (issue 37): verl's and NeMo 2's layouts of the same dist_checkpointing files.

The engine case ``megatron`` (tp2, torch_dist) is rearranged as verl's MegatronCheckpointManager lays it out
(``actor/dist_ckpt/`` without Megatron-LM's args beside ``actor/huggingface/``) and as NeMo 2 does
(``weights/`` with every key under ``module.`` beside ``context/``; rewritten with torch DCP's own
FileSystemWriter). Each exports to the bytes of the plain Megatron-LM export; a mixed prefix is refused.
"""

import importlib.util
import shutil

import pytest
import torch

from helpers import export_refused, hf_ckpt, in_process

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core (requirements/main.txt) builds the engine case")

ITER = "iter_0000001"
NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine_state", "opt_param_scheduler")


@pytest.fixture(scope="module")
def case(engine_ckpt):
    return engine_ckpt("megatron")


@pytest.fixture(scope="module")
def plain(case, tmp_path_factory):
    """The Megatron-LM layout's export (config derived from the saved args)."""
    out = tmp_path_factory.mktemp("plain") / "out"
    r = hf_ckpt("export", case / "tp2" / "torch_dist", out)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _rewrite(src, dst, rename):
    """The model tensors of the dist_checkpointing directory ``src``, renamed, saved again by torch DCP
    (one process, no process group) into ``dst`` beside a copy of its metadata.json."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(src)).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata) and not k.startswith(NOT_MODEL)}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(src)), no_dist=True)
    dst.mkdir(parents=True)
    dcp.save({rename(k): v for k, v in sd.items()}, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    shutil.copy(src / "metadata.json", dst / "metadata.json")


def _same(out, plain):
    assert (out / "model.safetensors").read_bytes() == (plain / "model.safetensors").read_bytes()


def test_verl_actor_dir_exports_with_its_huggingface_config(case, plain, tmp_path):
    actor = tmp_path / "global_step_1" / "actor"
    shutil.copytree(case / "tp2" / "torch_dist" / ITER, actor / "dist_ckpt")
    (actor / "dist_ckpt" / "common.pt").unlink()  # verl's common.pt holds no Megatron-LM args
    shutil.copytree(plain, actor / "huggingface")
    (actor / "huggingface" / "model.safetensors").unlink()
    for i, src in enumerate((actor, actor / "dist_ckpt")):
        r = in_process()("export", src, tmp_path / f"out{i}")
        assert r.returncode == 0, r.stderr[-2000:]
        _same(tmp_path / f"out{i}", plain)


def test_verl_without_huggingface_dir_asks_for_config(case, tmp_path):
    actor = tmp_path / "actor"
    shutil.copytree(case / "tp2" / "torch_dist" / ITER, actor / "dist_ckpt")
    (actor / "dist_ckpt" / "common.pt").unlink()
    export_refused(actor, tmp_path / "out", match=("verl save", "--config"))


@pytest.fixture(scope="module")
def nemo(case, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("nemo") / "step=1-last"
    _rewrite(case / "tp2" / "torch_dist" / ITER, ckpt / "weights", lambda k: "module." + k)
    (ckpt / "context").mkdir()
    (ckpt / "context" / "model.yaml").write_text("_target_: nemo.collections.llm.gpt.model.llama.LlamaModel\n")
    return ckpt


def test_nemo2_dir_exports_with_config_stripping_module_prefix(nemo, plain, tmp_path):
    export_refused(nemo, tmp_path / "refused", match=("NeMo 2", "model.yaml", "--config"))
    for i, src in enumerate((nemo, nemo / "weights")):
        r = in_process()("export", src, tmp_path / f"out{i}", "--config", plain)
        assert r.returncode == 0, r.stderr[-2000:]
        _same(tmp_path / f"out{i}", plain)


def test_nemo2_mixed_module_prefix_is_refused_by_name(case, plain, tmp_path):
    ckpt = tmp_path / "ckpt"
    _rewrite(case / "tp2" / "torch_dist" / ITER, ckpt / "weights",
             lambda k: k if k.startswith("embedding.") else "module." + k)
    (ckpt / "context").mkdir()
    export_refused(ckpt, tmp_path / "out", "--config", plain,
                   match=("'module.' prefix", "embedding.word_embeddings.weight"))
