"""What reading a checkpoint refuses, and which check refuses it: a damaged, truncated, mixed or
inconsistent checkpoint, rank files out of place (the ZeRO-1/2 placement proof), DCP chunks that
are not what ``.metadata`` records, a ``latest`` or ``config.json`` that is not what the engine wrote.
Each refusal is one ``error:`` line naming the file and the reason (exit 2), nothing written, the
source unchanged. Hostile files (budgets, code in pickles) are in tests/trust/test_hostile_files.py, where an
export may write in tests/writer/test_output_safety.py.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers import assert_refused, export, export_refused, hf_ckpt, tree_digest

from conftest import SECRET


from hf_ckpt_integrations import api
from hf_ckpt_integrations.errors import CheckpointError, LayoutError
from hf_ckpt_integrations.sources.deepspeed.allowlist import load as load_rank_file

def _reason(err, path) -> str:
    text = str(err)
    assert text.startswith(f"{path}: "), text
    return text[len(f"{path}: "):]


# ---------------------------------------------------------------- ZeRO-1/2 placement proof

def _partition(src, rank):
    """(file, byte offset, nbytes) of the fp32 flat partition of rank ``rank`` (its whole storage)."""
    f = src / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    ref = load_rank_file(f)["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    return f, ref.storage.offset, ref.storage.numel * ref.itemsize


@pytest.mark.parametrize("damage", ["rolled by one element", "swapped with rank 1's"])
def test_partition_out_of_place_is_refused_by_the_placement_proof(committed_zero2, tmp_path, damage):
    """The recorded ``param_slice_mappings`` stay right (they are in the pickle), only the partition
    bytes move: nothing but the comparison with the module weights can tell."""
    src = committed_zero2 / "ckpt"
    f0, off0, n0 = _partition(src, 0)
    data0 = f0.read_bytes()
    if damage == "rolled by one element":
        part = data0[off0:off0 + n0]
        f0.write_bytes(data0[:off0] + part[-4:] + part[:-4] + data0[off0 + n0:])
    else:
        f1, off1, n1 = _partition(src, 1)
        assert n0 == n1
        data1 = f1.read_bytes()
        f0.write_bytes(data0[:off0] + data1[off1:off1 + n1] + data0[off0 + n0:])
        f1.write_bytes(data1[:off1] + data0[off0:off0 + n0] + data1[off1 + n1:])
    with pytest.raises(LayoutError) as e:
        api.export_checkpoint(src, tmp_path / "out")
    assert _reason(e.value, f0).startswith(
        "its fp32 partition of parameter group 0 does not match the model's own weights "
        "(mp_rank_00_model_states.pt) at its place as data-parallel rank 0"), str(e.value)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- DCP chunks

@pytest.mark.parametrize("stored", ["transposed", "transposed in place"])
def test_dcp_chunk_stored_transposed_is_refused(tmp_path, stored):
    """A (4, 2) chunk saved as its (2, 4) transpose holds the same number of elements: only the
    shape check tells; saved as a column-major view of the right shape, only the layout does."""
    from dcp_build import write_dcp

    w = torch.arange(16.0).view(4, 4)
    blocks = [((0, 0), (4, 2)), ((0, 2), (4, 2))]

    def store(fqn, j, piece):
        if j != 1:
            return piece
        return piece.t().contiguous() if stored == "transposed" else piece.t().contiguous().t()
    src = write_dcp(tmp_path / "dcp", {"w": (w, blocks)}, nest=None, stored=store)
    with pytest.raises(CheckpointError) as e:
        api.export_checkpoint(src, tmp_path / "out")
    reason = _reason(e.value, src / "__1_0.distcp")  # chunk 1 of the first tensor
    if stored == "transposed":
        assert reason.startswith("bytes ") and reason.split(" hold ", 1)[1].startswith(
            "F32 [2, 4], but .metadata records the chunk of w as F32 [4, 2]"), str(e.value)
    else:
        assert reason.startswith("tensor in storage 0 is not contiguous"), str(e.value)
    assert not (tmp_path / "out").exists()


def _tag(src):
    return src / "global_step2"


def _export_refused(src, tmp_path, *extra, match):
    return export_refused(src, tmp_path / "out", *extra, match=match)


def _optim(src, rank=0):
    return _tag(src) / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def test_zero_byte_file(z2, tmp_path):
    src, config = z2
    _optim(src).write_bytes(b"")
    line = _export_refused(src, tmp_path, "--config", config, match="empty file")
    assert str(_optim(src)) in line


def test_truncated_zip(z2, tmp_path):
    src, config = z2
    data = _optim(src, 1).read_bytes()
    _optim(src, 1).write_bytes(data[: len(data) // 2])
    _export_refused(src, tmp_path, "--config", config, match=str(_optim(src, 1)))


def test_not_a_torch_checkpoint(z2, tmp_path):
    src, config = z2
    _optim(src).write_text("hello, I am a text file\n")
    _export_refused(src, tmp_path, "--config", config, match="not a torch zip checkpoint")


def test_missing_rank_file(z2, tmp_path):
    src, config = z2
    _optim(src, 1).unlink()
    _export_refused(src, tmp_path, "--config", config, match="partition_count")


def test_latest_names_a_missing_tag(z2, tmp_path):
    src, config = z2
    (src / "latest").write_text("global_step999")
    _export_refused(src, tmp_path, "--config", config, match="global_step999")


def test_tag_that_does_not_exist(z2, tmp_path):
    src, config = z2
    _export_refused(src, tmp_path, "--config", config, "--tag", "nope", match="tag 'nope' does not exist")


def test_swapped_rank_files_refused_by_recorded_offsets(z2, tmp_path):
    src, config = z2
    a, b = _optim(src, 0), _optim(src, 1)
    tmp = a.with_suffix(".tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    _export_refused(src, tmp_path, "--config", config, match="param_slice_mappings")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["os.system", "builtins.eval", "unknown class"])
def test_malicious_pickle_refused_and_never_run(z2, tmp_path, kind):
    src, config = z2
    marker = tmp_path / "pwned"
    if kind == "os.system":
        payload = _Payload(marker)
    elif kind == "builtins.eval":
        payload = _EvalPayload(marker)
    else:
        payload = _Unknown()
    # A real optimizer file with one extra entry that runs code when unpickled by torch.load.
    obj = {"optimizer_state_dict": {"zero_stage": 2, "x": payload}}
    torch.save(obj, _optim(src))
    line = _export_refused(src, tmp_path, "--config", config, match="refused for safety")
    assert "corrupt" not in line
    assert not marker.exists(), "the payload ran"
    r = hf_ckpt("inspect", src)
    assert r.returncode == 2 and "refused for safety" in r.stderr
    assert not marker.exists()


class _EvalPayload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import builtins

        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",))


class _Unknown:
    pass


TAG = "global_step2"


def _model_states(src):
    return Path(src) / TAG / "mp_rank_00_model_states.pt"


def _refused(src, tmp_path, config, *extra, match):
    return export_refused(src, tmp_path / "out", "--config", config, *extra, match=match)


def _resave(path, edit):
    """Rewrite a checkpoint file with ``edit(obj)`` applied (our own files: torch.load is fine)."""
    obj = torch.load(path, map_location="cpu", weights_only=False)
    edit(obj)
    torch.save(obj, path)


# ---------------------------------------------------------------- files from another save

def test_extra_rank_file_from_a_bigger_world(z2, engine_ckpt, tmp_path):
    """A 12-rank save's rank 2 copied into a 2-rank tag: rank count and partition_count disagree."""
    src, config = z2
    shutil.copy(_optim(engine_ckpt("z2-dp12") / "ckpt", 2), _optim(src, 2))
    line = _refused(src, tmp_path, config, match="partition_count")
    assert "different saves are mixed" in line


def test_rank_file_replaced_from_a_bigger_world(z2, engine_ckpt, tmp_path):
    """Same file names, same count, but rank 1 comes from the 12-rank save."""
    src, config = z2
    shutil.copy(_optim(engine_ckpt("z2-dp12") / "ckpt", 1), _optim(src, 1))
    line = _refused(src, tmp_path, config, match="partition_count=")
    assert str(_optim(src, 1)) in line


def test_rank_file_from_a_zero3_save(z2, engine_ckpt, tmp_path):
    src, config = z2
    shutil.copy(_optim(engine_ckpt("z3-fp32") / "ckpt", 1), _optim(src, 1))
    _refused(src, tmp_path, config, match="zero_stage=3")


@pytest.mark.parametrize("value", [[3], [1], 3, ["two"], None, [None]])
def test_partition_counts_disagree(z2, tmp_path, value):
    src, config = z2
    _resave(_optim(src, 1), lambda o: o["optimizer_state_dict"].__setitem__("partition_count", value))
    line = _refused(src, tmp_path, config, match="partition_count")
    assert str(_optim(src, 1)) in line


def test_zero_stage_not_a_number(z2, tmp_path):
    src, config = z2
    _resave(_optim(src, 1), lambda o: o["optimizer_state_dict"].__setitem__("zero_stage", "two"))
    _refused(src, tmp_path, config, match="zero_stage")


def test_recorded_shape_does_not_match_partitions_zero2(z2, tmp_path):
    src, config = z2

    def grow(obj):
        group = obj["param_shapes"][0]
        name = next(iter(group))
        group[name] = torch.Size([group[name][0] + 1, *group[name][1:]])

    _resave(_model_states(src), grow)
    line = _refused(src, tmp_path, config, match="recorded shapes hold")
    assert "different saves or are corrupt" in line


def test_recorded_shape_does_not_match_partitions_zero3(engine_ckpt, tmp_path):
    case = engine_ckpt("z3-fp32")
    src = tmp_path / "src"
    shutil.copytree(case / "ckpt", src)
    path = src / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"

    def shrink(obj):
        group = obj["param_shapes"][0]
        name = next(iter(group))
        group[name] = torch.Size([group[name][0] - 1, *group[name][1:]])

    _resave(path, shrink)
    _refused(src, tmp_path, case / "config", match="recorded shapes need")


def test_partition_shorter_than_recorded(z2, tmp_path):
    """Rank 1's fp32 partition replaced by a shorter tensor: element counts no longer add up."""
    src, config = z2

    def cut(obj):
        groups = obj["optimizer_state_dict"]["single_partition_of_fp32_groups"]
        groups[0] = groups[0][:-7].clone()

    _resave(_optim(src, 1), cut)
    _refused(src, tmp_path, config, match="partitions")


@pytest.mark.parametrize("content, match", [(b"\0" * 16, "16 NUL bytes"), (b"", "holds nothing"),
                                            (b"glob\nal\x1b[2J", "not a tag name"),
                                            (b"../../etc", "not a tag name"), (b"\xff\xfe", "not UTF-8")])
def test_broken_latest_file(z2_trainer, tmp_path, content, match):
    """What a crash leaves (NULs, nothing), terminal escapes and paths: one line, content escaped."""
    (z2_trainer / "latest").write_bytes(content)
    dst = tmp_path / "out"
    line = assert_refused(hf_ckpt("export", z2_trainer, dst), match=match, dst=dst)
    assert "\x1b" not in line and "\0" not in line


@pytest.mark.parametrize("name", ["latest", "config.json"])
def test_latest_or_config_linked_to_a_secret_is_never_echoed(z2_trainer, tmp_path, secret, name):
    """Today a ``latest`` linked to a private key printed the key in the error message."""
    (z2_trainer / name).unlink()
    (z2_trainer / name).symlink_to(secret)
    dst = tmp_path / "out"
    r = hf_ckpt("export", z2_trainer, dst) if name == "latest" else hf_ckpt("export", z2_trainer, dst, "--config", z2_trainer)
    line = assert_refused(r, match="symbolic link" if name == "latest" else "outside", dst=dst)
    assert SECRET not in r.stderr + r.stdout, line


@pytest.mark.parametrize("content, match", [("[]", "JSON list"), ("null", "JSON null"), ("not json", "unreadable"),
                                            ('{"tie_word_embeddings": ', "unreadable")])
def test_config_json_that_is_not_an_object(z2_trainer, tmp_path, content, match):
    (z2_trainer / "config.json").write_text(content)
    dst = tmp_path / "out"
    assert_refused(hf_ckpt("export", z2_trainer, dst), match=match, dst=dst)


def _set(path, mutate):
    sd = torch.load(path, weights_only=False)
    mutate(sd)
    torch.save(sd, path)


_WRONG_TYPES = {
    "param_shapes of strings": ("mp_rank_00_model_states.pt", lambda sd: sd.__setitem__("param_shapes", ["x"])),
    "buffer_names an int": ("mp_rank_00_model_states.pt", lambda sd: sd.__setitem__("buffer_names", 5)),
    "shared_params an int": ("mp_rank_00_model_states.pt", lambda sd: sd.__setitem__("shared_params", 3)),
    "frozen_param_shapes a str": ("mp_rank_00_model_states.pt",
                                  lambda sd: sd.__setitem__("frozen_param_shapes", "abc")),
    "group_paddings a str": ("zero_pp_rank_0_mp_rank_00_optim_states.pt",
                             lambda sd: sd["optimizer_state_dict"].__setitem__("group_paddings", "ab")),
}


@pytest.mark.parametrize("case", sorted(_WRONG_TYPES))
def test_wrong_typed_metadata_fields(z2_trainer, tmp_path, case):
    """Each of these raised TypeError/AttributeError/ValueError from the planner (a traceback)."""
    fname, mutate = _WRONG_TYPES[case]
    _set(z2_trainer / TAG / fname, mutate)
    dst = tmp_path / "out"
    digest = tree_digest(z2_trainer)
    assert_refused(hf_ckpt("export", z2_trainer, dst), dst=dst, src=z2_trainer, digest=digest)
    assert_refused(hf_ckpt("inspect", z2_trainer))


def test_unknown_model_type_and_auto_map_never_import_code(engine_ckpt, tmp_path):
    """A tensor-parallel checkpoint whose config names remote code: transformers used to prompt on
    stdin (a traceback without a terminal). Now no code is imported; the user is asked for --tp-rule."""
    case = engine_ckpt("tp-z2")
    config = tmp_path / "config"
    shutil.copytree(case / "config", config)
    marker = tmp_path / "PWNED"
    (config / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    cfg = json.loads((config / "config.json").read_text())
    cfg.update(model_type="evil-nonesuch", auto_map={"AutoConfig": "evil.EvilConfig",
                                                     "AutoModelForCausalLM": "evil.EvilModel"})
    (config / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "out"
    assert_refused(hf_ckpt("export", case / "ckpt", dst, "--config", config), match="--tp-rule", dst=dst)
    assert not marker.exists()


@pytest.fixture
def hf_export(z2_trainer, tmp_path):
    """An HF directory (three shards and an index) exported from the ZeRO-2 case."""
    export(z2_trainer, tmp_path / "hf", "--quiet", "--max-shard-size", "300KB")
    return tmp_path / "hf"


def _header_file(path, header, data=b""):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def test_hf_dir_inputs_that_crashed(hf_export, tmp_path):
    """F8 dtypes, a list as weight_map, a weight_map naming ../ paths, and .safetensors files that are
    not: one error line each (all were tracebacks)."""
    index = hf_export / "model.safetensors.index.json"
    shard = hf_export / "model-00002-of-00003.safetensors"
    pristine = tmp_path / "pristine"
    shutil.copytree(hf_export, pristine)

    def case(mutate, match):
        shutil.rmtree(hf_export)
        shutil.copytree(pristine, hf_export)
        mutate()
        dst = tmp_path / "out"
        assert_refused(hf_ckpt("export", hf_export, dst), match=match, dst=dst)

    def weight_map(value):
        d = json.loads(index.read_text())
        d["weight_map"] = value(d["weight_map"])
        index.write_text(json.dumps(d))

    case(lambda: weight_map(list), "'weight_map' is not a mapping")
    weight_map(list)  # verify reads the export side the same way
    assert_refused(hf_ckpt("verify", hf_export, "--against", hf_export.parent / "work" / "src"),
                   match=str(hf_export))
    case(lambda: weight_map(lambda m: {k: "../../" + v for k, v in m.items()}), "not a file name")
    case(lambda: _header_file(shard, [1, 2]), str(hf_export))
    case(lambda: _header_file(shard, {"a": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}}, b"1234"),
         str(hf_export))
    case(lambda: shard.write_bytes((2**40).to_bytes(8, "little") + b"x" * 64), str(shard))

    def f8():
        from safetensors.torch import save_file

        for p in hf_export.glob("model*"):
            p.unlink()
        save_file({"w": torch.zeros(4, dtype=torch.float8_e4m3fn)}, str(hf_export / "model.safetensors"))
    case(f8, str(hf_export))


def test_pipeline_parallel_checkpoint_is_named(tmp_path):
    """``PipelineModule`` saves (layer files beside per-stage rank files) go to the pipeline source, not
    the ZeRO reader (which would report a mix of saves); a damaged one is refused naming the file."""
    from hf_ckpt_integrations.sources import registry

    tag = tmp_path / "pp" / TAG
    tag.mkdir(parents=True)
    (tmp_path / "pp" / "latest").write_text(TAG)
    names = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
             "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt",
             *(f"layer_{i:02d}-model_00-model_states.pt" for i in range(4))]
    for n in names:
        (tag / n).write_bytes(b"")
    assert registry.find_source(str(tmp_path / "pp")).NAME == "deepspeed-pipeline"
    dst = tmp_path / "out"
    assert_refused(hf_ckpt("export", tmp_path / "pp", dst), match="mp_rank_00_model_states.pt: empty file", dst=dst)


def test_zero2_model_states_in_a_zero3_tag(engine_ckpt, tmp_path):
    """A ZeRO-2 ``mp_rank_00_model_states.pt`` copied into a ZeRO-3 tag: named as two saves mixed
    (it was a TypeError traceback)."""
    src = tmp_path / "src"
    shutil.copytree(engine_ckpt("z3-fp32") / "ckpt", src)
    shutil.copy(engine_ckpt("z2-fp32") / "ckpt" / TAG / "mp_rank_00_model_states.pt", src / TAG)
    dst = tmp_path / "out"
    digest = tree_digest(src)
    assert_refused(hf_ckpt("export", src, dst, "--config", engine_ckpt("z3-fp32") / "config"),
                   match="files from different saves are mixed", dst=dst, src=src, digest=digest)
