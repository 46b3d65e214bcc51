"""A tied ``lm_head.weight`` held beside the embedding (FSDP / torch DCP state dicts hold both) is
written once, as the embedding, only when it is bitwise equal to it, in every chunk layout: rows
(FSDP2), 2-D blocks (FSDP x TP), or each in another layout. A head that differs is refused (exit 2),
never dropped. Synthetic DCP checkpoints of a tiny Llama (tests/support/dcp_build.py)."""

import pytest
from dcp_build import grid, write_dcp

from helpers import assert_refused, export, in_process, read_export

HEAD, EMB = "lm_head.weight", "model.embed_tokens.weight"
LAYOUTS = {"rows": (2,), "blocks": (2, 2), "blocks 4x1 vs 1x4": None}


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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_head_that_differs_from_the_tied_embedding_is_refused(tiny_llama_sd, tmp_path, capsys, layout):
    config, sd = tiny_llama_sd
    src = _source(tmp_path, sd, layout, head_delta=1.0)
    r = export(src, tmp_path / "out", "--quiet", config=config, ok=False, run=in_process(capsys))
    assert_refused(r, match=f"{HEAD} differs from {EMB}, which config.json ties it to", dst=tmp_path / "out")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_head_equal_to_the_tied_embedding_is_written_once(tiny_llama_sd, tmp_path, capsys, layout):
    config, sd = tiny_llama_sd
    src = _source(tmp_path, sd, layout, head_delta=0.0)
    run = in_process(capsys)
    export(src, tmp_path / "out", "--quiet", config=config, run=run)
    got = read_export(tmp_path / "out")
    assert HEAD not in got and got[EMB].equal(sd[EMB])
    v = run("verify", tmp_path / "out", "--against", src, "--config", config)
    assert v.returncode == 0, v.stdout[-2000:]
