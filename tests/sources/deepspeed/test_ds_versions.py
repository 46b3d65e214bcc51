"""Checkpoints written by older DeepSpeed releases (0.10 -> 0.18): committed fixtures, made by the
real engines (tests/fixtures/deepspeed/generate.py; no old release is installed here), export
bitwise equal to the fp32 masters each engine reported at save time.

Also: protocol-2 pickle names (``__builtin__.set``, what ``torch.save`` writes) are mapped the
way the standard unpickler maps them, and only then checked against the allowlist, which
therefore is no wider than before.
"""

import _compat_pickle
import importlib.util
import json
import pickle
import shutil
import zipfile

import pytest

from helpers import REPO, export, hf_ckpt, load_safetensors, tree_digest

from hf_ckpt_integrations import cli
from hf_ckpt_integrations.formats import unpickler
from hf_ckpt_integrations.sources.deepspeed.allowlist import ALLOWED, load as load_rank_file
from hf_ckpt_integrations.errors import UnsafeCheckpointError

FIXTURES = REPO / "tests" / "fixtures" / "deepspeed"
_spec = importlib.util.spec_from_file_location("ds_fixture_generate", FIXTURES / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)

MATRIX = [(v, c) for v, cases in generate.VERSIONS.items() for c in cases]


@pytest.mark.parametrize("version,case", MATRIX, ids=[f"{v}-{c}" for v, c in MATRIX])
def test_old_release_exports_bitwise(version, case, tmp_path, capsys):
    fixture = FIXTURES / version / case
    run = json.loads((fixture / "run.json").read_text())
    assert run["deepspeed"] == version
    work = tmp_path / case
    shutil.copytree(fixture, work)  # never export next to committed files
    src, out = work / "ckpt", tmp_path / "hf"
    before = tree_digest(work)

    r = hf_ckpt("inspect", src, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["engine_version"] == version
    assert info["zero_stage"] == run["zero_stage"]
    mp = run["replica_mp"] or 1
    assert (info["dp_size"], info["mp_size"]) == (run["world_size"] // mp, mp)
    assert info["mp_axis"] == ("replica" if run["replica_mp"] else "none")
    assert cli.main(["inspect", str(src)]) == 0  # the text form, in-process
    assert f"written by {version}" in capsys.readouterr().out

    r = export(src, out, "--quiet")  # config.json one level above ckpt/ is found
    r = hf_ckpt("verify", out, "--against", src)
    assert r.returncode == 0, r.stdout + r.stderr

    import torch

    exported = {}
    for f in sorted(out.glob("*.safetensors")):
        exported.update(load_safetensors(f))
    reference = load_safetensors(fixture / "reference.safetensors")
    assert set(exported) == set(reference)
    for name, want in reference.items():
        assert exported[name].dtype == want.dtype and torch.equal(exported[name], want), name
    assert tree_digest(work) == before


def test_palign_fixture_records_nonzero_gaps():
    # Otherwise 0.19.8-zero2-palign would test nothing that the back-to-back cases do not.
    osd = load_rank_file(FIXTURES / "0.19.8" / "zero2-palign" / "ckpt" / "global_step2" /
                         "zero_pp_rank_0_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert any(osd["param_alignment_paddings"][0])


def _torch_zip(path, pkl: bytes):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
    return path


def _call(module, name, proto=2):
    """A pickle that calls ``module.name("x")`` (GLOBAL, MARK, str, TUPLE, REDUCE, STOP)."""
    return (b"\x80" + bytes([proto]) + f"c{module}\n{name}\n".encode() + b"(X\x01\x00\x00\x00xtR.")


def test_protocol2_builtin_names_load(tmp_path):
    # What torch.save (protocol 2) writes for the set DeepSpeed 0.10-0.18 keep in model states.
    data = pickle.dumps({"sparse_tensor_module_names": {"a"}, "r": slice(1, 2)}, protocol=2)
    assert b"c__builtin__\nset" in data
    got = load_rank_file(_torch_zip(tmp_path / "p2.pt", data))
    assert got == {"sparse_tensor_module_names": {"a"}, "r": slice(1, 2)}


@pytest.mark.parametrize("module,name", [("__builtin__", "eval"), ("__builtin__", "getattr"),
                                         ("__builtin__", "exec"), ("__builtin__", "__import__"),
                                         ("copy_reg", "_reconstructor"), ("__builtin__", "reduce")])
def test_protocol2_mapping_does_not_widen_allowlist(module, name, tmp_path):
    with pytest.raises(UnsafeCheckpointError, match="refused for safety"):
        load_rank_file(_torch_zip(tmp_path / "evil.pt", _call(module, name)))


def test_every_python2_name_maps_onto_the_same_decision(tmp_path):
    """Each Python 2 spelling is accepted exactly when its Python 3 name is on the allowlist."""
    pairs = [(k, v) for k, v in _compat_pickle.NAME_MAPPING.items()]
    pairs += [((m, n), (_compat_pickle.IMPORT_MAPPING[m], n)) for m in ("__builtin__", "copy_reg")
              for n in ("set", "frozenset", "slice", "eval", "getattr", "object", "_reconstructor")]
    for (m2, n2), (m3, n3) in pairs:
        allowed = n3 in ALLOWED.get(m3, {})
        data = b"\x80\x02" + f"c{m2}\n{n2}\n".encode() + b"."  # just the global
        try:
            unpickler.loads(data, path="x.pt", allowed=ALLOWED)
            accepted = True
        except UnsafeCheckpointError:
            accepted = False
        assert accepted == allowed, (m2, n2, m3, n3)


def test_protocol3_pickles_are_not_mapped(tmp_path):
    # pickle maps Python 2 names only below protocol 3; a newer pickle naming __builtin__ is refused.
    with pytest.raises(UnsafeCheckpointError, match="__builtin__.set"):
        load_rank_file(_torch_zip(tmp_path / "p4.pt", _call("__builtin__", "set", proto=4)))
    assert load_rank_file(_torch_zip(tmp_path / "ok.pt", pickle.dumps({1}, protocol=4))) == {1}


def test_docs_table_matches_fixtures():
    page = (REPO / "docs" / "deepspeed-versions.md").read_text()
    assert generate.table() in page, "regenerate: python tests/fixtures/deepspeed/generate.py --table"


def test_fixtures_are_small():
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert total < 8 * 2**20, total
