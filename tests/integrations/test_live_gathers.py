"""A tensor gathered whole for its reads (FSDP2 DTensor, AutoTP) is gathered once for all the output
tensors cut from it (transformers 5's fused MoE experts: one per expert), and dropped after the last."""

from hf_ckpt_integrations.sources.live import _Reads


def test_a_fused_tensor_is_gathered_once_for_all_its_slices():
    reads, calls = _Reads(), []
    reads.left = {"experts": 4, "other": 1}

    def gather(name):
        return lambda: calls.append(name) or f"full {name}"

    got = [reads.gathered("experts", gather("experts")) for _ in range(4)]
    assert got == ["full experts"] * 4 and calls == ["experts"]
    assert reads.held is None  # dropped after its last slice: one full tensor held at most
    assert reads.gathered("other", gather("other")) == "full other" and calls == ["experts", "other"]
