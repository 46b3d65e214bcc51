"""A tied ``lm_head.weight`` held beside the embedding (FSDP / torch DCP state dicts hold both) is
written once, as the embedding, only when it is bitwise equal to it, in every chunk layout: rows
(FSDP2), 2-D blocks (FSDP x TP), or each in another layout. A head that differs is refused (exit 2),
never dropped. Synthetic DCP checkpoints of a tiny Llama (tests/support/dcp_build.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from dcp_build import grid, tiny_llama, write_dcp  # noqa: E402

from hf_ckpt_integrations.cli import main as cli_main  # noqa: E402
from helpers import load_safetensors  # noqa: E402

HEAD, EMB = "lm_head.weight", "model.embed_tokens.weight"
LAYOUTS = {"rows": (2,), "blocks": (2, 2), "blocks 4x1 vs 1x4": None}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied-head")
    return root / "config", tiny_llama(root / "config", tied=True)


def _source(tmp_path, sd, layout, head_delta):
    tensors = {}
    for k, v in sd.items():
        if layout == "blocks 4x1 vs 1x4":  # the head tiled otherwise than the embedding
            splits = (1, 4) if k == HEAD else (4, 1)
        else:
            splits = LAYOUTS[layout]
        if k == HEAD:
            v = v.clone()
            v[-1, -1] += head_delta  # the last element: in the last block of every layout
        tensors[k] = (v, grid(v.shape, splits))
    return write_dcp(tmp_path / "src", tensors)


def _export(capsys, src, dst, config):
    capsys.readouterr()
    rc = cli_main(["export", str(src), str(dst), "--config", str(config), "--quiet"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_head_that_differs_from_the_tied_embedding_is_refused(llama, tmp_path, capsys, layout):
    config, sd = llama
    src = _source(tmp_path, sd, layout, head_delta=1.0)
    rc, err = _export(capsys, src, tmp_path / "out", config)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"{HEAD} differs from {EMB}, which config.json ties it to" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_head_equal_to_the_tied_embedding_is_written_once(llama, tmp_path, capsys, layout):
    config, sd = llama
    src = _source(tmp_path, sd, layout, head_delta=0.0)
    rc, err = _export(capsys, src, tmp_path / "out", config)
    assert rc == 0, err
    got = {k: v for f in sorted((tmp_path / "out").glob("*.safetensors")) for k, v in load_safetensors(f).items()}
    assert HEAD not in got and got[EMB].equal(sd[EMB])
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path / "out"), "--against", str(src), "--config", str(config)]) == 0
