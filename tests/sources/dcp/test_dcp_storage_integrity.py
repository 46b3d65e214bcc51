"""What a torch DCP checkpoint's storage must satisfy, and what ``verify`` proves of its bytes.

A ``.distcp`` file is several ``torch.save`` archives laid end to end (one per chunk, at the
offsets ``.metadata`` records): ``verify`` checks the CRC-32 of every chunk's entries within its
own archive (``zipfile`` on the whole file sees only the last one), and ``export`` refuses two
storage entries sharing bytes (one chunk would be exported as the other). Synthetic checkpoints of
a tiny Llama, built in-process (tests/support/dcp_build.py).
"""

import pytest
from dcp_build import grid, read_metadata, write_dcp, write_metadata

from hf_ckpt_integrations.formats import torch_files
from helpers import export, export_refused, in_process


def _early_archive_data(src):
    """(data file, absolute byte offset of its tensor's data, archive start) of an early archive of
    ``__0_0.distcp`` (not the file's last one, which zipfile alone reads), of a tensor that is not
    the tied embedding (whose copy under lm_head would be compared first)."""
    md = read_metadata(src)
    infos = sorted((info.offset, info.length) for i, info in md.storage_data.items()
                   if info.relative_path == "__0_0.distcp" and "embed" not in i.fqn and "lm_head" not in i.fqn)
    assert len(infos) > 2
    start, length = infos[0]
    path = src / "__0_0.distcp"
    ref = torch_files.load(path, offset=start, length=length, allowed=torch_files.TORCH_TENSOR_ALLOWED)
    return path, ref.byte_range()[0], start


@pytest.mark.parametrize("layout", ["rows", "blocks"])
def test_verify_checks_the_crc_of_every_chunk_of_a_distcp_file(tiny_llama_sd, tmp_path, capsys, layout):
    """A flipped bit in the data of the FIRST archive of a .distcp file: export copies it faithfully,
    and verify, which must prove the source too, reports that chunk failing its CRC-32."""
    config, sd = tiny_llama_sd
    splits = (2,) if layout == "rows" else (2, 2)
    src = write_dcp(tmp_path / "src", {k: (v, grid(v.shape, splits)) for k, v in sd.items()}, files=1)
    path, at, start = _early_archive_data(src)
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    run = in_process(capsys)
    export(src, tmp_path / "out", "--quiet", config=config, run=run)
    r = run("verify", tmp_path / "out", "--against", src, "--config", config)
    out = r.stdout
    assert r.returncode == 1, out
    assert "fails its CRC-32 check" in out and f"bytes {start}+" in out and "__0_0.distcp" in out, out


def test_verify_passes_an_undamaged_multi_archive_source(tiny_llama_sd, tmp_path, capsys):
    config, sd = tiny_llama_sd
    src = write_dcp(tmp_path / "src", {k: (v, grid(v.shape, (2, 2))) for k, v in sd.items()}, files=1)
    run = in_process(capsys)
    export(src, tmp_path / "out", "--quiet", config=config, run=run)
    r = run("verify", tmp_path / "out", "--against", src, "--config", config)
    assert r.returncode == 0 and "ok:" in r.stdout, r.stdout


@pytest.mark.parametrize("how", ["same bytes", "overlapping"])
def test_storage_entries_sharing_bytes_are_refused(tiny_llama_sd, tmp_path, capsys, how):
    """Two chunks' storage entries pointing at the same (or overlapping) bytes of one file would
    export one tensor as a copy of the other: exit 2 naming the file and both tensors."""
    config, sd = tiny_llama_sd
    src = write_dcp(tmp_path / "src", sd, files=1)
    md = read_metadata(src)
    by_fqn = {i.fqn: (i, info) for i, info in md.storage_data.items()}
    q_idx, q_info = by_fqn["model.model.layers.0.self_attn.q_proj.weight"]
    _, k_info = by_fqn["model.model.layers.0.self_attn.k_proj.weight"]
    if how == "same bytes":
        q_info.offset, q_info.length = k_info.offset, k_info.length
    else:  # q's archive claims to run on into k's
        q_info.length = k_info.offset - q_info.offset + 1 if k_info.offset > q_info.offset else q_info.length
        if k_info.offset < q_info.offset:
            k_info.length = q_info.offset - k_info.offset + 1
    write_metadata(src, md)
    export_refused(src, tmp_path / "out", "--config", config, "--quiet", run=in_process(capsys),
                   match=("never share bytes", "__0_0.distcp", "q_proj", "k_proj"))
