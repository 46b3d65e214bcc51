"""``--merge-adapters`` equals PEFT's own ``merge_and_unload`` on a tiny LoRA model built here (plain and
rsLoRA scaling): a checkpoint directory holding the PEFT model's state dict beside its
adapter_config.json, merged into the base model saved beside it. In this process: no engine run
(the engine runs of tests/peft/test_peft.py check the same on real ZeRO-2/3 saves)."""

import shutil

import pytest
import torch

from helpers import load_safetensors

from hf_ckpt_integrations import export_checkpoint


@pytest.mark.parametrize("rslora", [False, True])
def test_merge_equals_peft_merge_and_unload(tmp_path, rslora):
    import common
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(common.tiny_llama_config())
    base.save_pretrained(tmp_path / "base")
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    # init_lora_weights=False: B is random, not zero, so the update is not a no-op; r=4, alpha=8: the
    # two scalings differ (2 vs 4)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False, use_rslora=rslora))
    model.save_pretrained(tmp_path / "adapter")
    src = tmp_path / "src"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copy(tmp_path / "adapter" / "adapter_config.json", src)
    shutil.copy(tmp_path / "base" / "config.json", src)

    report = export_checkpoint(src, tmp_path / "merged", merge_adapters=True, base=str(tmp_path / "base"))
    ref = model.merge_and_unload().state_dict()
    got = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert sorted(got) == sorted(ref)
    assert sorted(report["merged"]) == [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qv"]
    for k in ref:
        if k in report["merged"]:
            assert (got[k] - ref[k]).abs().max() <= 1e-6, k
            assert (got[k] - base_sd[k]).abs().max() > 1e-3, k  # the update was applied
        else:
            assert torch.equal(got[k], ref[k]), k
