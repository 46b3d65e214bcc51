"""adapter_config.json is input: every field the merge uses is checked (type, finite, in range),
its patterns are matched as peft matches them and cannot hang the merge, and each module's update
is oriented as peft's layer for it orients it. On tiny synthetic adapters (tests/support/tiny_adapters.py):
no engine; the reference is peft's own ``merge_and_unload()`` of the same adapter."""

import json
import shutil
import types

import pytest
import torch

from helpers import assert_refused, tree_digest

peft = pytest.importorskip("peft")
tiny_adapters = pytest.importorskip("tiny_adapters")

from hf_ckpt_integrations.cli import main as cli_main  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    base, src, model = tiny_adapters.build(root, family="llama")
    return types.SimpleNamespace(base=base, src=src, ref=tiny_adapters.reference_merge(model))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2")
    base, src, model = tiny_adapters.build(root, family="gpt2", fan_in_fan_out=True)
    return types.SimpleNamespace(base=base, src=src, ref=tiny_adapters.reference_merge(model))


def _merge(case, tmp_path, capsys, edit=None, *extra, raw=None):
    """Merge a copy of ``case``'s adapter whose config ``edit`` changed (a dict of fields; raw text with
    ``raw``); returns (CompletedProcess-like result, dst)."""
    src = tmp_path / "src"
    shutil.copytree(case.src, src)
    cfg = {**tiny_adapters.adapter_config(src), **(edit or {})}
    tiny_adapters.write_adapter_config(src, cfg, raw=raw)
    dst = tmp_path / "merged"
    before = tree_digest(src)
    capsys.readouterr()
    rc = cli_main(["export", str(src), str(dst), "--merge-adapters", "--base", str(case.base), "--quiet", *extra])
    err = capsys.readouterr().err
    assert tree_digest(src) == before
    return types.SimpleNamespace(returncode=rc, stderr=err), dst


def _merged(dst):
    from safetensors.torch import load_file

    return load_file(str(dst / "model.safetensors"))


def _assert_equals_peft(dst, ref):
    got = _merged(dst)
    for name, t in got.items():
        assert torch.allclose(t, ref[name], atol=1e-6, rtol=0), name


# ---------------------------------------------------------------- numeric fields


@pytest.mark.parametrize("edit, field", [
    ({"lora_alpha": float("nan")}, "lora_alpha"),
    ({"lora_alpha": float("inf")}, "lora_alpha"),
    ({"lora_alpha": 1e300}, "lora_alpha"),  # finite in Python, inf once peft scales in float32
    ({"lora_alpha": True}, "lora_alpha"),  # a bool is not a number
    ({"lora_alpha": "8"}, "lora_alpha"),
    ({"r": 4.0}, "r"),
    ({"r": True}, "r"),
    ({"r": 0}, "r"),
    ({"r": 2**40}, "r"),
    ({"alpha_pattern": {"q_proj": float("-inf")}}, "alpha_pattern['q_proj']"),
    ({"rank_pattern": {"v_proj": False}}, "rank_pattern['v_proj']"),
    ({"rank_pattern": ["v_proj"]}, "rank_pattern"),
    ({"use_rslora": "yes"}, "use_rslora"),
    ({"target_modules": ["q_proj", 7]}, "target_modules"),
])
def test_bad_numbers_and_types_are_refused_naming_the_field(llama, tmp_path, capsys, edit, field):
    """Exit 2, one error line naming adapter_config.json and the field; nothing written. Before,
    NaN / inf / 1e300 merged into non-finite weights with exit 0."""
    r, dst = _merge(llama, tmp_path, capsys, edit)
    line = assert_refused(r, match=("adapter_config.json", field), dst=dst)
    assert "Traceback" not in line


def test_merged_values_out_of_the_output_dtype_are_refused(llama, tmp_path, capsys):
    """A finite, in-range alpha whose update overflows the output dtype (fp16 here) would write inf:
    the merged tensor is checked finite before the export commits."""
    r, dst = _merge(llama, tmp_path, capsys, {"lora_alpha": 1e7}, "--dtype", "fp16")
    assert_refused(r, match=("adapter_config.json", "lora_alpha", "non-finite"), dst=dst)
    r, dst2 = _merge(llama, tmp_path / "again", capsys, {"alpha_pattern": {"v_proj": 1e7}}, "--dtype", "fp16")
    assert_refused(r, match=("adapter_config.json", "alpha_pattern['v_proj']", "non-finite"), dst=dst2)


def test_valid_config_merges_as_peft(llama, tmp_path, capsys):
    r, dst = _merge(llama, tmp_path, capsys)
    assert r.returncode == 0, r.stderr
    _assert_equals_peft(dst, llama.ref)


# ---------------------------------------------------------------- fan_in_fan_out per layer


def test_fan_in_fan_out_true_on_linear_layers_is_ignored_as_peft_does(llama, tmp_path, capsys):
    """peft forces fan_in_fan_out off for nn.Linear (with a warning): a config saying true must not
    transpose the square q_proj/v_proj updates (it did: the merge applied the flag globally)."""
    r, dst = _merge(llama, tmp_path, capsys, {"fan_in_fan_out": True})
    assert r.returncode == 0, r.stderr
    _assert_equals_peft(dst, llama.ref)


@pytest.mark.parametrize("flag", [True, False])
def test_conv1d_layers_merge_transposed_whatever_the_flag(gpt2, tmp_path, capsys, flag):
    """GPT-2's Conv1D holds [in, out] weights; peft forces fan_in_fan_out on for it."""
    r, dst = _merge(gpt2, tmp_path, capsys, {"fan_in_fan_out": flag})
    assert r.returncode == 0, r.stderr
    _assert_equals_peft(dst, gpt2.ref)


def test_square_weight_without_a_buildable_config_is_refused(llama, tmp_path, capsys):
    """Without a model class (config.json transformers does not know) a square weight could be either
    orientation: refused rather than guessed."""
    base = tmp_path / "base"
    shutil.copytree(llama.base, base)
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "model_type": "not-a-known-model", "architectures": []}))
    r, dst = _merge(types.SimpleNamespace(src=llama.src, base=base), tmp_path, capsys)
    assert_refused(r, match=("config.json", "square"), dst=dst)


# ---------------------------------------------------------------- patterns


def test_pattern_keys_are_taken_in_order_as_peft_get_pattern_key(tmp_path):
    """peft takes the first key (in order) matching the end of the name, even when a later key is the
    exact module name."""
    from peft.utils.other import get_pattern_key

    from hf_ckpt_integrations.peft_merge import lora_scale

    module = "model.layers.0.self_attn.q_proj"
    cfg = {"r": 4, "lora_alpha": 8, "alpha_pattern": {"q_proj": 2, module: 3}, "rank_pattern": {r"layers\.0.*": 2}}
    want_alpha = cfg["alpha_pattern"][get_pattern_key(cfg["alpha_pattern"], module)]
    want_r = cfg["rank_pattern"][get_pattern_key(cfg["rank_pattern"], module)]
    assert lora_scale(cfg, module) == (want_r, want_alpha / want_r) == (2, 1.0)
    assert lora_scale(cfg, "model.layers.1.self_attn.v_proj") == (4, 2.0)


def test_invalid_regex_in_rank_pattern_is_bad_input_not_internal_error(llama, tmp_path, capsys):
    """Before: re.error escaped as exit 3 ("internal error")."""
    r, dst = _merge(llama, tmp_path, capsys, {"rank_pattern": {"v_proj(": 2}})
    assert_refused(r, match=("adapter_config.json", "rank_pattern", "not a regex"), dst=dst)


@pytest.mark.parametrize("edit", [
    {"rank_pattern": {r"((\w|\.)*)*X": 2}},
    {"alpha_pattern": {r"((.*)*(.*)*(.*)*(.*)*X)": 2}},
    {"target_modules": r"((\w|\.)*)*X"},
])
def test_catastrophic_patterns_do_not_hang_the_merge(llama, tmp_path, capsys, edit):
    """Patterns on which ``re`` backtracks for hours against a module name: the merge answers (the
    pattern matches nothing; an unselected LoRA module is then refused) instead of spinning."""
    r, dst = _merge(llama, tmp_path, capsys, edit)
    if "target_modules" in edit:
        assert_refused(r, match=("adapter_config.json", "target_modules does not select"), dst=dst)
    else:
        assert r.returncode == 0, r.stderr
        _assert_equals_peft(dst, llama.ref)


def test_a_match_that_does_not_finish_is_refused():
    """Where even the bounded matcher cannot decide, the pattern is refused naming its field."""
    from hf_ckpt_integrations.errors import CheckpointError
    from hf_ckpt_integrations.sources.peft import pattern_key

    pytest.importorskip("regex")
    with pytest.raises(CheckpointError, match="rank_pattern pattern .* did not finish matching"):
        pattern_key(["(a|aa)+c"], "a" * 40 + "b", "adapter_config.json", "rank_pattern")


def test_pattern_length_is_bounded():
    from hf_ckpt_integrations.errors import CheckpointError
    from hf_ckpt_integrations.sources.peft import PATTERN_LIMIT, check_lora_config

    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "rank_pattern": {"a" * PATTERN_LIMIT: 2}}
    with pytest.raises(CheckpointError, match="rank_pattern is .* characters"):
        check_lora_config(cfg, "adapter_config.json")


@pytest.mark.parametrize("edit, selected", [
    ({"target_modules": ["q_proj"]}, False),
    ({"target_modules": r".*\.(q_proj|v_proj)"}, True),
    ({"target_modules": r".*\.q_proj"}, False),
    ({"exclude_modules": ["v_proj"]}, False),
    ({"layers_to_transform": [0]}, False),
    ({"layers_to_transform": [0, 1], "layers_pattern": "layers"}, True),
])
def test_lora_modules_target_modules_does_not_select_are_refused(llama, tmp_path, capsys, edit, selected):
    """peft applies LoRA only to the modules target_modules selects (check_target_module_exists):
    weights for another module would be dropped by peft; merged here they made a model peft never
    gives. Refused, naming the module."""
    r, dst = _merge(llama, tmp_path, capsys, edit)
    if selected:
        assert r.returncode == 0, r.stderr
        _assert_equals_peft(dst, llama.ref)
    else:
        assert_refused(r, match=("adapter_config.json", "target_modules does not select"), dst=dst)


def test_target_selection_equals_peft_check_target_module_exists():
    """Our selection rule against peft's own on a grid of configs and module names."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    from hf_ckpt_integrations.sources.peft import is_targeted

    modules = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.up_proj",
               "lm_head", "model.embed_tokens", "h.0.attn.c_attn"]
    configs = [{"target_modules": ["q_proj", "v_proj"]}, {"target_modules": r".*\.(q|v)_proj"},
               {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": 1},
               {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0], "layers_pattern": ["layers", "h"]},
               {"target_modules": ["proj"], "exclude_modules": r".*v_proj"},
               {"target_modules": ["c_attn", "lm_head"], "modules_to_save": ["lm_head"]},
               {"target_modules": ["model.embed_tokens", "self_attn.q_proj"]}]
    for extra in configs:
        cfg = LoraConfig(r=4, lora_alpha=8, **extra)
        as_json = json.loads(json.dumps(cfg.to_dict(), default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
        for m in modules:
            theirs = check_target_module_exists(cfg, m)
            theirs = bool(theirs) and type(theirs).__name__ != "_ExcludedModule"
            assert is_targeted(as_json, m, "adapter_config.json") == theirs, (extra, m)


@pytest.mark.parametrize("targets", [None, "all-linear"])
def test_layer_filter_applies_to_targets_peft_resolves(targets):
    """target_modules null (peft fills it from the model type) or "all-linear" (peft expands it) become
    a list of suffixes, and layers_to_transform still filters them (the fuzz found the filter skipped)."""
    from hf_ckpt_integrations.sources.peft import is_targeted

    cfg = {"target_modules": targets, "layers_to_transform": 0}
    assert is_targeted(cfg, "model.layers.0.self_attn.q_proj", "adapter_config.json")
    assert not is_targeted(cfg, "model.layers.1.self_attn.q_proj", "adapter_config.json")
    assert is_targeted({"target_modules": targets}, "model.layers.1.self_attn.q_proj", "adapter_config.json")


def test_all_matches_of_a_merge_share_one_time_budget():
    """Many slow patterns (each under the per-match limit) must not add up to a hang: once a merge's
    budget is spent, a match that does not finish at once is refused."""
    from hf_ckpt_integrations.errors import CheckpointError
    from hf_ckpt_integrations.sources.peft import pattern_budget, pattern_key

    pytest.importorskip("regex")
    with pattern_budget(0.0):
        assert pattern_key(["q_proj"], "model.layers.0.self_attn.q_proj", "adapter_config.json", "rank_pattern")
        with pytest.raises(CheckpointError, match="did not finish matching .*the patterns' time limit"):
            pattern_key(["(a|aa)+c"], "a" * 40 + "b", "adapter_config.json", "rank_pattern")
