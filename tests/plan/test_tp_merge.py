"""The rule that merges one parameter's model-parallel slices, chosen from synthetic slices
(milliseconds, no files read): a user rule, then the full shape from config.json."""

import pytest

from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.plan import Piece, TensorPlan
from hf_ckpt_integrations.convert.tp_rules import resolve_rule
from hf_ckpt_integrations.convert.tp_rules import parse_user_rule


def _slices(*shapes):
    return [TensorPlan("w", s, "F32", [[Piece(f"/rank{i}", 0, s[0] * s[1], "F32")]]) for i, s in enumerate(shapes)]


def test_a_user_rule_is_the_rule():
    rule = resolve_rule("w", _slices((2, 3), (2, 3)), None, {}, [], [parse_user_rule("w=0")], {})
    assert (rule.dim, rule.source) == (0, "user rule w=0")


def test_slices_at_the_configs_full_shape_are_replicas():
    rule = resolve_rule("w", _slices((2, 3), (2, 3)), None, {}, [], [], {"w": (2, 3)})
    assert rule.replicated and "full shape" in rule.source


def test_no_rule_for_differing_slices_is_refused_with_a_hint():
    with pytest.raises(LayoutError, match=r"suggests dim 1"):
        resolve_rule("w", _slices((2, 3), (2, 5)), None, {}, [], [], {"w": (2, 8)})
