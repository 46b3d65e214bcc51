"""Every registered source runs this by being registered (parametrized over registry.SOURCES): its
hooks exist (its own or SourceBase's defaults), and on a path holding no checkpoint — a missing path,
an empty directory, a file instead of a directory — each hook answers without a traceback and claims
nothing. A refusal, where a hook refuses, is a CheckpointError (one sentence, exit 2)."""

import pytest

from hf_ckpt_integrations.errors import CheckpointError
from hf_ckpt_integrations.sources import registry
from hf_ckpt_integrations.sources.protocol import SourceBase, hook

SOURCES = {s.NAME: s for s in registry.SOURCES}
HOOKS = ("holds_checkpoint", "needs_config", "check_integrity")


@pytest.fixture(params=["missing", "empty dir", "a file"])
def nothing(request, tmp_path):
    if request.param == "missing":
        return str(tmp_path / "nope")
    if request.param == "empty dir":
        (tmp_path / "empty").mkdir()
        return str(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    return str(tmp_path / "weights.bin")


def _answer(fn, *args):
    """``fn(*args)``, or the CheckpointError it refuses with; any other exception fails the test."""
    try:
        return fn(*args)
    except CheckpointError as e:
        return e


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_hook_is_there(name):
    source = SOURCES[name]
    for attr in ("detect", "config_candidates", "plan", *HOOKS):
        assert callable(getattr(source, attr, None) or hook(source, attr)), f"{name}: {attr}"
    assert isinstance(hook(source, "YIELDS_TO"), tuple) and isinstance(hook(source, "UNIVERSAL"), bool)
    if hook(source, "UNIVERSAL"):
        assert callable(getattr(source, "universal_plan", None)) and callable(getattr(source, "universal_files", None))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_path_without_a_checkpoint_is_claimed_by_no_source(name, nothing):
    source = SOURCES[name]
    assert _answer(source.detect, nothing, None) is False
    candidates = _answer(source.config_candidates, nothing, None)
    assert isinstance(candidates, CheckpointError) or (
        isinstance(candidates, list) and all(isinstance(c, str) for c in candidates)), candidates
    assert _answer(hook(source, "holds_checkpoint"), nothing) is False
    assert _answer(hook(source, "needs_config"), nothing, None) in (False, True) or \
        isinstance(_answer(hook(source, "needs_config"), nothing, None), CheckpointError)
    problems = _answer(hook(source, "check_integrity"), {nothing: [(0, 8)]})
    assert problems == {} or set(problems) <= {nothing}, problems  # never a problem in a file it was not given


def test_find_source_refuses_a_path_without_a_checkpoint(nothing):
    with pytest.raises(CheckpointError, match="no checkpoint found there"):
        registry.find_source(nothing)


def test_the_defaults_claim_nothing():
    assert SourceBase.holds_checkpoint("/") is False and SourceBase.needs_config("/", None) is False
    assert SourceBase.check_integrity({"/x": [(0, 1)]}) == {} and SourceBase.UNIVERSAL is False
    with pytest.raises(AttributeError, match="not an optional source hook"):
        hook(SOURCES["deepspeed"], "plan")
