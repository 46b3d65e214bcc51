"""The source protocol: what the registry accepts as a source, the options a source declares and
receives (CLI and API, with no change to the registry, the API or the CLI), the one config read of
an export, and which engine a directory holds (synthetic directories, milliseconds; one export of a
small DeepSpeed fixture for the config-read count)."""

import json
import shutil
import types
from pathlib import Path

import pytest

from hf_ckpt_integrations import export_checkpoint, guards, inspect_checkpoint
from hf_ckpt_integrations.cli import main
from hf_ckpt_integrations.errors import OptionError
from hf_ckpt_integrations.plan import ExportPlan, Piece, TensorPlan
from hf_ckpt_integrations.sources import build_plan, deepspeed, registry
from hf_ckpt_integrations.sources.protocol import SourceOption, SourceProtocolError, tie_word_embeddings
from helpers import REPO

FIXTURE = REPO / "tests" / "fixtures" / "deepspeed" / "0.19.8" / "zero2-palign"


# -- a toy source: one module that declares an option ---------------------------------------------

def _name_map(text):
    """``old:new,old2:new2`` -> dict (what the toy's ``name_map`` option takes)."""
    pairs = [p.split(":") for p in text.split(",")]
    if any(len(p) != 2 or not all(p) for p in pairs):
        raise ValueError(f"{text!r} is not OLD:NEW[,OLD:NEW...]")
    return dict(pairs)


def _toy(tmp_path, **overrides):
    data = tmp_path / "toy" / "weights.raw"
    data.parent.mkdir(exist_ok=True)
    data.write_bytes(b"\0" * 24)
    seen = {}

    def plan(ctx):
        seen["options"] = dict(ctx.options)
        names = ctx.option("name_map") or {}
        t = TensorPlan(names.get("w", "w"), (2, 3), "F32", [[Piece(str(data), 0, 6, "F32")]])
        return ExportPlan("toy", ctx.path, None, [t], dtypes={"master": "F32"}, files=[str(data)])

    members = dict(NAME="toy", LOOKS_FOR="a toy weights.raw", MEMORY_NAMES=False,
                   OPTIONS=(SourceOption("name_map", "OLD:NEW,... renames", parse=_name_map),),
                   detect=lambda path, tag=None: Path(path, "weights.raw").exists(),
                   config_candidates=lambda path, tag=None: [path], plan=plan)
    members.update(overrides)
    module = types.ModuleType("toy_source")
    module.__dict__.update(members)
    return module, seen


@pytest.fixture
def toy(tmp_path, monkeypatch):
    module, seen = _toy(tmp_path)
    monkeypatch.setattr(registry, "SOURCES", registry.register(module, *registry.SOURCES))
    return tmp_path / "toy", seen


# -- the registry checks the protocol at registration ------------------------------------------

def _broken(tmp_path, **overrides):
    return _toy(tmp_path, **overrides)[0]


@pytest.mark.parametrize("change, reason", [
    ({"plan": None}, "plan() is missing"),
    ({"OPTIONS": None}, "OPTIONS must be a tuple of SourceOption"),
    ({"OPTIONS": ("name_map",)}, "OPTIONS must be a tuple of SourceOption"),
    ({"NAME": ""}, "NAME must be a non-empty string"),
    ({"MEMORY_NAMES": "yes"}, "MEMORY_NAMES must be True or False"),
    ({"detect": lambda path: True}, "detect() must be callable as detect(path, tag)"),
    # the signature plan() had before the context: options must come through ctx.options
    ({"plan": lambda path, *, tag=None, dtype=None, config_dir=None, tp_rules=None: None},
     "plan() takes the PlanContext only"),
    ({"YIELDS_TO": ("nobody",)}, "YIELDS_TO must be a tuple of names of other registered sources"),
    ({"ALLOWED": {"os": "system"}}, "ALLOWED, when given, must map module names to {global name: stand-in}"),
    ({"NAME": "deepspeed"}, "NAME 'deepspeed' is already registered"),
])
def test_registry_rejects_a_source_that_breaks_the_protocol(tmp_path, change, reason):
    module = _broken(tmp_path, **change)
    if "plan" in change and change["plan"] is None:
        del module.plan
    with pytest.raises(SourceProtocolError) as e:
        registry.register(*registry.SOURCES, module)
    assert reason in str(e.value) and "toy_source" in str(e.value)


def test_the_package_sources_follow_the_protocol(tmp_path):
    assert registry.register(*registry.SOURCES) == registry.SOURCES
    assert registry.register(_toy(tmp_path)[0], *registry.SOURCES)[0].NAME == "toy"


# -- a declared option reaches the source from the API and the CLI ------------------------------

def test_a_declared_option_reaches_the_source_from_the_api(toy, tmp_path):
    src, seen = toy
    info = inspect_checkpoint(src, source_options={"name_map": "w:model.embed_tokens.weight"})
    assert seen["options"] == {"name_map": {"w": "model.embed_tokens.weight"}}
    assert [t["name"] for t in info["tensors"]] == ["model.embed_tokens.weight"]
    inspect_checkpoint(src)
    assert seen["options"] == {"name_map": None}  # not given: the declared default
    export_checkpoint(src, tmp_path / "out", source_options={"name_map": "w:v"}, weights_only=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        assert list(f.keys()) == ["v"]


def test_a_declared_option_reaches_the_source_from_the_cli(toy, capsys):
    src, seen = toy
    assert main(["inspect", str(src), "--json", "--source-option", "name_map=w:lm_head.weight"]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr().out)["tensors"]] == ["lm_head.weight"]
    assert seen["options"] == {"name_map": {"w": "lm_head.weight"}}


@pytest.mark.parametrize("args, reason", [
    (["--source-option", "no_such=1"], "no_such: no source takes this option"),
    (["--source-option", "name_map=garbage"], "name_map: 'garbage' is not OLD:NEW"),
    (["--source-option", "name_map=a:b", "--source-option", "name_map=c:d"], "name_map: given 2 times"),
])
def test_a_bad_source_option_is_refused_before_reading(toy, capsys, args, reason):
    src, seen = toy
    assert main(["inspect", str(src)] + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and reason in err
    assert seen == {}  # refused before the source planned anything


def test_an_option_for_another_source_is_ignored_with_a_note(toy):
    src, seen = toy
    plan = build_plan(src, tp_rules=["*.weight=0"])  # DeepSpeed's tp_rules option
    assert seen["options"] == {"name_map": None}
    assert any("tp_rules do not apply to a toy checkpoint" in n for n in plan.notes)


def test_an_unknown_option_is_an_option_error_from_the_api(toy):
    with pytest.raises(OptionError, match="no source takes this option"):
        build_plan(toy[0], source_options={"name_mapp": "w:v"})


# -- tie_word_embeddings: one reading, transformers' own ------------------------------------------

@pytest.mark.parametrize("cfg, tied", [
    ({}, True),  # PretrainedConfig's default
    ({"tie_word_embeddings": False}, False),
    ({"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}}, True),  # top level wins
    ({"text_config": {"tie_word_embeddings": False}}, False),  # a composite model saved before transformers 5
    ({"decoder": {"tie_word_embeddings": False}}, False),  # get_text_config(decoder=True) also reads `decoder`
    ({"text_config": {}}, True),
    ({"text_config": {"tie_word_embeddings": False}, "decoder": {"tie_word_embeddings": False}}, True),  # ambiguous
])
def test_tie_word_embeddings_follows_get_text_config(cfg, tied):
    assert tie_word_embeddings(cfg) is tied


def test_text_config_untied_writes_the_tied_alias_as_a_copy(tmp_path, monkeypatch):
    """Both tied-weight passes read tie_word_embeddings one way: a text_config saying False counts."""
    module, _ = _toy(tmp_path, MEMORY_NAMES=True)
    plan_fn = module.plan

    def plan(ctx):
        p = plan_fn(ctx)
        p.tensors[0].name = "model.embed_tokens.weight"
        p.aliases = {"lm_head.weight": "model.embed_tokens.weight"}
        return p

    module.plan = plan
    monkeypatch.setattr(registry, "SOURCES", registry.register(module, *registry.SOURCES))
    (tmp_path / "toy" / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": False}}))
    plan = build_plan(tmp_path / "toy")
    assert sorted(t.name for t in plan.tensors) == ["lm_head.weight", "model.embed_tokens.weight"]


# -- the config is read once per export ----------------------------------------------------------

@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_an_export_reads_the_config_once(tmp_path, monkeypatch, dtype):
    """A DeepSpeed export with tied weights and a Hub-layout derivation (an empty layout cache):
    the tied-alias pass, the Hub layout and its meta model all use the one read; in bf16 the
    fp32-kept modules of the config's class are read from it too."""
    monkeypatch.setenv("HF_CKPT_CACHE", str(tmp_path / "layout-cache"))
    shutil.copytree(FIXTURE / "ckpt", tmp_path / "ckpt")
    shutil.copy(FIXTURE / "config.json", tmp_path / "ckpt" / "config.json")
    reads = []
    real = guards.read_config
    monkeypatch.setattr(guards, "read_config", lambda d: reads.append(d) or real(d))
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out", dtype=dtype)
    assert len(reads) == 1, reads


# -- which engine wrote this directory: the registry answers -------------------------------------

def test_the_registry_says_which_engine_holds_a_directory(tmp_path):
    from safetensors.numpy import save_file
    import numpy as np

    assert registry.engine_checkpoint(str(tmp_path)) is None
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    assert registry.engine_checkpoint(str(tmp_path)) is None  # HF weights only (a plain Trainer checkpoint-N)
    (tmp_path / "global_step1").mkdir()
    (tmp_path / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert deepspeed.holds_checkpoint(str(tmp_path))
    assert registry.engine_checkpoint(str(tmp_path)) == "deepspeed"  # the HF directory yields (YIELDS_TO)
    fsdp = tmp_path / "fsdp"
    (fsdp / "pytorch_model_fsdp_0").mkdir(parents=True)
    (fsdp / "pytorch_model_fsdp_0" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"")
    assert registry.engine_checkpoint(str(fsdp)) == "torch-dcp"


def test_a_repeated_option_collects_every_value_and_tp_rule_is_its_own_spelling(tmp_path, monkeypatch):
    module, seen = _toy(tmp_path, OPTIONS=(SourceOption("tp_rules", "rules", repeated=True, default=[]),))
    monkeypatch.setattr(registry, "SOURCES", registry.register(module, *registry.SOURCES))
    build_plan(tmp_path / "toy", tp_rules=["b=1"], source_options={"tp_rules": "a=0"})
    assert seen["options"] == {"tp_rules": ["a=0", "b=1"]}
    assert main(["inspect", str(tmp_path / "toy"), "--source-option", "tp_rules=c=0", "--source-option",
                 "tp_rules=d=1"]) == 0
    assert seen["options"] == {"tp_rules": ["c=0", "d=1"]}
    build_plan(tmp_path / "toy")
    assert seen["options"] == {"tp_rules": []}  # the default, a fresh list per export


def test_an_unknown_dtype_is_refused_by_the_context_before_any_source_reads():
    """PlanContext is the one place that refuses an unknown --dtype (no source re-checks it)."""
    from hf_ckpt_integrations.sources.protocol import PlanContext

    with pytest.raises(OptionError, match="unknown dtype 'fp8'; use one of fp32, bf16, fp16"):
        PlanContext("/nonexistent", dtype="fp8")
    assert PlanContext("/nonexistent", dtype="BF16").dtype == "BF16"  # kept as given; decide_dtypes maps it
