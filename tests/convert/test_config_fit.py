"""config.json must describe exactly the checkpoint's model: the model it builds (on the meta
device, in the Hub-layout pass) holds the checkpoint's tensors and shapes, no more, no fewer; and a
config.json far larger than its checkpoint is refused before it is built. On tiny torch DCP
checkpoints written in this process (``dcp.save`` without a process group): no engine."""

import json
import shutil
import types

import pytest
import torch

from helpers import assert_refused, export, in_process

transformers = pytest.importorskip("transformers")
core = pytest.importorskip("transformers.core_model_loading")
if not hasattr(core, "revert_weight_conversion"):
    pytest.skip("transformers 4.x: no Hub-layout pass, config.json is not built", allow_module_level=True)


def _dcp_case(root, config, state=None):
    """A DCP checkpoint of ``config``'s model (its own state dict unless ``state``) and its config dir."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    dcp.save(dict(state if state is not None else model.state_dict()), checkpoint_id=str(root / "ckpt"))
    model.config.save_pretrained(root / "config")
    return types.SimpleNamespace(src=root / "ckpt", config=root / "config", model=model)


@pytest.fixture(scope="module")
def llama_dcp(tmp_path_factory):
    from tiny_adapters import tiny_config

    return _dcp_case(tmp_path_factory.mktemp("dcp"), tiny_config("llama"))


def _edited_config(case, directory, edit=None):
    """A copy of ``case``'s config dir in ``directory/config`` with the fields of ``edit`` replaced."""
    config = directory / "config"
    shutil.copytree(case.config, config)
    cfg = json.loads((config / "config.json").read_text())
    (config / "config.json").write_text(json.dumps({**cfg, **(edit or {})}))
    return config


def _export_with(case, tmp_path, capsys, edit=None):
    """Export ``case`` with its config edited by ``edit``: (result, destination)."""
    dst = tmp_path / "out"
    return export(case.src, dst, "--quiet", config=_edited_config(case, tmp_path, edit), ok=False,
                  run=in_process(capsys)), dst


def test_the_matching_config_exports(llama_dcp, tmp_path, capsys):
    r, dst = _export_with(llama_dcp, tmp_path, capsys)
    assert r.returncode == 0, r.stderr
    assert (dst / "model.safetensors").exists()


@pytest.mark.parametrize("edit, first", [
    # from_pretrained would build one layer and drop layer 1 (exit 0 before)
    ({"num_hidden_layers": 1}, "the checkpoint holds model.layers.1."),
    # the model would have 4 layers, two of them initialised at random
    ({"num_hidden_layers": 4}, "the model has model.layers.2."),
    # exported, then from_pretrained failed on the shapes
    ({"vocab_size": 100}, "model.embed_tokens.weight is [96, 32] in the checkpoint but [100, 32] in the model"),
    ({"intermediate_size": 64}, "mlp.gate_proj.weight is [48, 32] in the checkpoint but [64, 32]"),
])
def test_a_config_that_does_not_fit_the_checkpoint_is_refused(llama_dcp, tmp_path, capsys, edit, first):
    r, dst = _export_with(llama_dcp, tmp_path, capsys, edit)
    assert_refused(r, match=("config.json", "does not have exactly the checkpoint's tensors", first), dst=dst)


def test_tied_embeddings_fit_as_save_pretrained_writes_them(tmp_path, capsys):
    """A tied lm_head (written once by save_pretrained) is not a missing tensor."""
    from tiny_adapters import tiny_config

    cfg = tiny_config("llama")
    cfg.tie_word_embeddings = True
    case = _dcp_case(tmp_path / "tied", cfg)
    (tmp_path / "tied" / "run").mkdir()
    r, dst = _export_with(case, tmp_path / "tied" / "run", capsys)
    assert r.returncode == 0, r.stderr


def test_a_huge_layer_count_is_refused_before_the_build(llama_dcp, tmp_path, capsys):
    """A 700-byte config with num_hidden_layers=100000 spun for minutes in the meta-model build."""
    r, dst = _export_with(llama_dcp, tmp_path, capsys, {"num_hidden_layers": 100000})
    assert_refused(r, match=("config.json", "num_hidden_layers=100000 is more than the checkpoint holds"), dst=dst)
    r, dst = _export_with(llama_dcp, tmp_path / "nested", capsys, {"text_config": {"num_hidden_layers": 10**9}})
    assert_refused(r, match=("config.json", "text_config.num_hidden_layers=1000000000"), dst=dst)


def test_the_build_itself_is_bounded_by_the_checkpoint(llama_dcp, tmp_path):
    """Whatever field makes the model large (here layers, with a checkpoint whose names claim many):
    the build is aborted once it registers more parameters than the checkpoint's tensors account for."""
    from hf_ckpt_integrations.errors import CheckpointError
    from hf_ckpt_integrations.convert.config_fit import bounded_build
    from hf_ckpt_integrations.convert.hub_layout import meta_model

    config = _edited_config(llama_dcp, tmp_path, {"num_hidden_layers": 500})
    shapes = {"model.layers.999.self_attn.q_proj.weight": (32, 32), "model.norm.weight": (32,)}
    registered = []
    hook = torch.nn.modules.module.register_module_parameter_registration_hook(
        lambda m, n, p: registered.append(n))
    try:
        with pytest.raises(CheckpointError, match="describes a model with more than .* parameters .* holds 2 tensors"):
            with bounded_build(config, shapes):
                meta_model(config)
    finally:
        hook.remove()
    assert len(registered) < 500 * 9  # aborted long before the 500 layers were built


def test_a_swallowed_abort_still_refuses(llama_dcp, tmp_path):
    """The builder (transformers, _model_for) may catch the abort and go on or raise something else:
    the bound still refuses on exit."""
    from hf_ckpt_integrations.errors import CheckpointError
    from hf_ckpt_integrations.convert.config_fit import bounded_build

    with pytest.raises(CheckpointError, match="describes a model with more than"):
        with bounded_build(llama_dcp.config, {"model.layers.1.w": (1,)}):
            for _ in range(1000):
                try:
                    torch.nn.Linear(1, 1, device="meta")
                except Exception:
                    pass
            raise ValueError("the builder's own error, after it swallowed the abort")


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5", "bert", "mixtral", "qwen2_moe", "llava"])
@pytest.mark.parametrize("holds", ["parameters", "state_dict"])
def test_every_family_fits_its_own_config(family, holds, tmp_path):
    """Nothing legitimate is refused: each family of the Hub-layout matrix (tied three ways in T5, a
    tied bias in BERT, Conv1D in GPT-2, fused experts, a nested text_config) fits its config.json,
    whether the checkpoint holds only the parameters (DeepSpeed: tied ones once, as aliases) or the
    whole state dict (persistent buffers too)."""
    import families

    from hf_ckpt_integrations.convert.hub_layout import _derive

    model = families.build(family)
    model.config.save_pretrained(tmp_path)
    params = dict(model.named_parameters())
    aliases = {n: next(k for k, q in params.items() if q is p)
               for n, p in model.named_parameters(remove_duplicate=False) if n not in params}
    tensors = params if holds == "parameters" else model.state_dict()
    shapes = {n: tuple(t.shape) for n, t in tensors.items() if n not in aliases}
    _derive(str(tmp_path), model.config.model_type, shapes, aliases)  # raises when refused
    with pytest.raises(Exception, match="does not have exactly the checkpoint's tensors"):
        _derive(str(tmp_path), model.config.model_type, {**shapes, "extra.weight": (2,)}, aliases)
