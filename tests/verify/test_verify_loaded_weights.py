"""``verify`` checks the weights ``from_pretrained(dst)`` would load, following transformers' own file
precedence (``model.safetensors`` before the index, safetensors before ``.bin``, config.json's
``transformers_weights`` before both), and reports a destination holding several weight entry points
(exit 1: the directory is not what ``export`` wrote). The writer's commits never leave a stale single
file beside a sharded export. Synthetic DCP sources of a tiny Llama (tests/support/dcp_build.py)."""

import json
import shutil
from pathlib import Path

import pytest

from dcp_build import write_dcp  # noqa: E402

from hf_ckpt_integrations.cli import main as cli_main  # noqa: E402
from hf_ckpt_integrations.verify import loaded_weights  # noqa: E402
from helpers import export, in_process  # noqa: E402

NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


@pytest.fixture(scope="module")
def exported(tiny_llama_sd, tmp_path_factory):
    """(source, config, a sharded export, a single-file export of ANOTHER model)."""
    config, sd = tiny_llama_sd
    root = tmp_path_factory.mktemp("loaded-weights")
    src = write_dcp(root / "src", sd)
    other = write_dcp(root / "other", {k: v + 1 for k, v in sd.items()})
    export(src, root / "sharded", "--quiet", "--max-shard-size", "4KB", config=config, run=in_process())
    export(other, root / "single", "--quiet", config=config, run=in_process())
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    assert (root / "single" / "model.safetensors").is_file()
    return src, config, root / "sharded", root / "single"


def _verify(capsys, dst, src, config):
    capsys.readouterr()
    rc = cli_main(["verify", str(dst), "--against", str(src), "--config", str(config)])
    return rc, capsys.readouterr().out


def test_a_stray_single_file_beside_a_sharded_export_fails_verify(exported, tmp_path, capsys):
    """from_pretrained loads model.safetensors first, whatever the index says: verify must check that
    file (here another model's weights) and say the directory holds both."""
    src, config, sharded, single = exported
    dst = tmp_path / "dst"
    shutil.copytree(sharded, dst)
    shutil.copy(single / "model.safetensors", dst / "model.safetensors")
    assert loaded_weights(dst)[0] == "model.safetensors"
    rc, out = _verify(capsys, dst, src, config)
    assert rc == 1, out
    assert "holds model.safetensors and model.safetensors.index.json; from_pretrained loads model.safetensors" in out
    assert "values differ from the source" in out  # the file that loads was compared, not the index's shards


def test_the_sharded_export_alone_passes(exported, capsys):
    src, config, sharded, _ = exported
    rc, out = _verify(capsys, sharded, src, config)
    assert rc == 0 and "ok:" in out, out


def test_config_transformers_weights_is_followed(exported, tmp_path, capsys):
    """config.json's ``transformers_weights`` overrides the default order: pointing it at a file that
    is not there makes the directory unloadable, which verify reports."""
    src, config, sharded, _ = exported
    dst = tmp_path / "dst"
    shutil.copytree(sharded, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "transformers_weights": "model.safetensors"}))
    rc, out = _verify(capsys, dst, src, config)
    assert rc == 1 and "transformers_weights = 'model.safetensors' names no safetensors file" in out, out
    (dst / "config.json").write_text(json.dumps({**cfg, "transformers_weights": "model.safetensors.index.json"}))
    rc, out = _verify(capsys, dst, src, config)
    assert rc == 0, out


def test_a_stray_bin_beside_the_export_is_reported(exported, tmp_path, capsys):
    src, config, sharded, _ = exported
    dst = tmp_path / "dst"
    shutil.copytree(sharded, dst)
    (dst / "pytorch_model.bin").write_bytes(b"not read")
    rc, out = _verify(capsys, dst, src, config)
    assert rc == 1 and "holds model.safetensors.index.json and pytorch_model.bin" in out, out


@pytest.mark.parametrize("present", [("model.safetensors",), ("model.safetensors.index.json",),
                                     ("model.safetensors", "model.safetensors.index.json"),
                                     ("model.safetensors.index.json", "pytorch_model.bin"),
                                     ("pytorch_model.bin", "pytorch_model.bin.index.json"),
                                     ("model.safetensors", "pytorch_model.bin.index.json")])
def test_precedence_is_transformers_own(tmp_path, present):
    """loaded_weights picks the file transformers' own resolver picks, for each combination."""
    mu = pytest.importorskip("transformers.modeling_utils")
    resolve = getattr(mu, "_get_resolved_checkpoint_files", None)
    if resolve is None:
        pytest.skip("this transformers has no _get_resolved_checkpoint_files")
    shard = {"model.safetensors.index.json": "model-00001-of-00001.safetensors",
             "pytorch_model.bin.index.json": "pytorch_model-00001-of-00001.bin"}
    for n in present:
        if n in shard:
            (tmp_path / n).write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard[n]}}))
            (tmp_path / shard[n]).write_text("x")
        else:
            (tmp_path / n).write_text("x")
    files, _ = resolve(str(tmp_path), None, None, None, None, False)
    theirs = Path(files[0]).name
    theirs = {v: k for k, v in shard.items()}.get(theirs, theirs)  # an index's shard: the index loaded
    chosen, problems = loaded_weights(tmp_path)
    expected = theirs if theirs.endswith((".safetensors", ".safetensors.index.json")) else None
    assert chosen == expected, (present, theirs, chosen, problems)
    assert bool(problems) == (len(present) > 1 or expected is None), problems


def test_the_merge_commit_leaves_no_stale_single_file(tmp_path):
    """A save-time commit of sharded weights into a directory that held model.safetensors removes it
    (it would be what from_pretrained loads)."""
    from hf_ckpt_integrations.commit import MergeIntoCheckpoint

    dst = tmp_path / "checkpoint-2"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"stale")
    (dst / "optimizer.pt").write_bytes(b"kept")
    strategy = MergeIntoCheckpoint(dst)
    staging = Path(strategy.begin())
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    for n in names:
        (staging / n).write_bytes(b"new")
    strategy.commit(names)
    assert sorted(p.name for p in dst.iterdir()) == sorted(names + ["optimizer.pt"])


def test_overwriting_a_single_file_export_with_a_sharded_one_leaves_one_set(exported, tmp_path, capsys):
    src, config, _, single = exported
    dst = tmp_path / "dst"
    shutil.copytree(single, dst)
    capsys.readouterr()
    assert cli_main(["export", str(src), str(dst), "--config", str(config), "--quiet", "--overwrite",
                     "--max-shard-size", "4KB"]) == 0
    assert not (dst / "model.safetensors").exists() and (dst / "model.safetensors.index.json").is_file()
    assert _verify(capsys, dst, src, config)[0] == 0
