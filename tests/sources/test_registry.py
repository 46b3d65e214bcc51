"""The source registry and the package's layering, on synthetic directories (milliseconds, no engine)."""

import ast
import json
import types
from pathlib import Path

import pytest

from hf_ckpt_integrations.errors import CheckpointError
from hf_ckpt_integrations.plan import ExportPlan, Piece, TensorPlan
from hf_ckpt_integrations.sources import build_plan, registry
from helpers import REPO

PKG = REPO / "hf_ckpt_integrations"


def test_every_source_has_the_protocol():
    for source in registry.SOURCES:
        for attr in ("NAME", "LOOKS_FOR", "MEMORY_NAMES", "OPTIONS", "detect", "config_candidates", "plan"):
            assert hasattr(source, attr), (source.__name__, attr)


def test_nothing_claims_a_directory_says_what_was_looked_for(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointError) as e:
        build_plan(tmp_path)
    for source in registry.SOURCES:
        assert source.LOOKS_FOR in str(e.value)


def test_order_hf_dir_yields_to_a_deepspeed_checkpoint(tmp_path):
    """An HF directory is read as one — unless a DeepSpeed checkpoint also resolves there."""
    from safetensors.numpy import save_file
    import numpy as np

    save_file({"w": np.arange(4, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    assert registry.find_source(str(tmp_path)).NAME == "hf-directory"
    tag = tmp_path / "global_step1"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert registry.find_source(str(tmp_path)).NAME == "deepspeed"
    assert registry.find_source(str(tmp_path), "global_step1").NAME == "deepspeed"  # a tag: never an HF dir


def _toy_source(tmp_path, memory_names):
    """A new source in a few lines: what "adding a source" asks for (docs/architecture.md)."""
    data = tmp_path / "toy" / "weights.raw"
    data.parent.mkdir()
    data.write_bytes(b"\0" * 24)

    def plan(ctx):
        t = TensorPlan("model.embed_tokens.weight", (2, 3), "F32", [[Piece(str(data), 0, 6, "F32")]])
        return ExportPlan("toy", ctx.path, None, [t], aliases={"lm_head.weight": t.name},
                          dtypes={"master": "F32"}, files=[str(data)])

    return types.SimpleNamespace(NAME="toy", LOOKS_FOR="a toy", MEMORY_NAMES=memory_names, OPTIONS=(),
                                 detect=lambda path, tag=None: Path(path, "weights.raw").exists(),
                                 config_candidates=lambda path, tag=None: [path], plan=plan)


def test_a_new_source_is_one_registry_line_and_gets_every_pass(tmp_path, monkeypatch):
    toy = _toy_source(tmp_path, memory_names=True)
    monkeypatch.setattr(registry, "SOURCES", (toy,) + registry.SOURCES)
    (tmp_path / "toy" / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    plan = build_plan(tmp_path / "toy", dtype="bf16")
    assert plan.engine == "toy" and plan.config_dir == str(tmp_path / "toy")  # config discovery
    assert sorted(t.name for t in plan.tensors) == ["lm_head.weight", "model.embed_tokens.weight"]  # tied pass
    assert plan.out_dtype == "BF16" and {t.out_dtype for t in plan.tensors} == {"BF16"}  # decided once
    with pytest.raises(CheckpointError, match="no config.json there"):
        build_plan(tmp_path / "toy", config=str(tmp_path))
    (tmp_path / "toy" / "config.json").unlink()
    plan = build_plan(tmp_path / "toy")
    assert plan.config_dir is None and any("no config.json found" in n for n in plan.notes)
    assert plan.out_dtype == "F32" and plan.aliases == {"lm_head.weight": "model.embed_tokens.weight"}


_LATER = {"writer", "verify", "lean", "parallel", "integrations", "cli", "api"}


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            yield node, (node.module or ""), [a.name for a in node.names]


def test_sources_import_no_later_stage_and_nothing_imports_a_private_helper():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        for node, module, names in _imports(path):
            top = module.split(".")[0] if node.level == (2 if rel.startswith(("sources/", "formats/",
                                                                                   "integrations/")) else 1) else ""
            if rel.startswith("sources/") and node.level == 2 and (top in _LATER or set(names) & _LATER):
                bad.append(f"{rel}: imports {module or names} (a later stage)")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                bad.append(f"{rel}: imports private {private} from {module}")
    assert not bad, bad
