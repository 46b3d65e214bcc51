"""`hf-ckpt universal` output resumes under DeepSpeed's own ``load_universal`` at another layout:
the states the engine holds after loading are bitwise those it holds after loading the original
save at the original layout, and training continues with the same losses.

Each pair of engine cases (tests/engines/ds_uc_resume.py) loads one save twice: ``-own`` at its
own layout with DeepSpeed's ordinary loader, ``-toN`` through ``write_universal_checkpoint`` on N
plain data-parallel ranks. Both record what the engine holds (DeepSpeed's ``safe_get_full_*``).
"""

import json

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.engine

PAIRS = [("replica-z2", "to1"), ("tp-z1", "to1")]


def _run(case):
    return json.loads((case / "run.json").read_text()), load_file(str(case / "loaded.safetensors"))


@pytest.mark.parametrize("src,to", PAIRS)
def test_universal_resume_continues_the_run(src, to, engine_ckpt):
    own, own_states = _run(engine_ckpt(f"ucw-{src}-own"))
    uni, uni_states = _run(engine_ckpt(f"ucw-{src}-{to}"))
    assert sorted(uni_states) == sorted(own_states)
    differ = [k for k in own_states if own_states[k].shape != uni_states[k].shape
              or not own_states[k].view(-1).view(dtype=__import__("torch").int32).equal(
                  uni_states[k].view(-1).view(dtype=__import__("torch").int32))]
    assert not differ, f"states loaded from the universal checkpoint differ: {differ[:5]}"
    assert uni["steps"] == own["steps"] and own["steps"], "optimizer step not carried"
    assert uni["global_steps"] == own["global_steps"]
    assert uni["losses"] == pytest.approx(own["losses"], rel=1e-5, abs=1e-6)
