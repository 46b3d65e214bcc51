"""The ZeRO partition arithmetic (`sources.deepspeed.partitions`): where each parameter's elements lie
in which rank's flat partition, on synthetic metadata — milliseconds, no files."""

import pytest

from hf_ckpt_integrations.sources.deepspeed import partitions


def test_zero12_params_straddle_partitions():
    # 3 params (5, 3, 4) = 12 elements over 3 ranks of 4: the first straddles ranks 0 and 1
    frags = partitions.zero12_fragments([5, 3, 4], [4, 4, 4], [0, 0, 0])
    assert frags == [[(0, 0, 4), (1, 0, 1)], [(1, 1, 3)], [(2, 0, 4)]]


def test_zero12_last_rank_padding_removed_by_deepspeed():
    # 10 elements padded to 12 over 3 ranks: DeepSpeed saves rank 2 with 2 elements + padding 2.
    frags = partitions.zero12_fragments([7, 3], [4, 4, 2], [0, 0, 2])
    assert frags == [[(0, 0, 4), (1, 0, 3)], [(1, 3, 1), (2, 0, 2)]]


def test_zero12_refuses_counts_that_do_not_match():
    with pytest.raises(ValueError, match="recorded shapes hold 11 elements"):
        partitions.zero12_fragments([7, 4], [4, 4, 2], [0, 0, 2])
    with pytest.raises(ValueError, match="unequal padded size"):
        partitions.zero12_fragments([10], [4, 4, 2], [0, 0, 0])


def test_zero12_recorded_param_alignment_paddings():
    # 0.19 with parameter_alignment: 2 zeros after the 5-element param (offset 7), none after the
    # last. Files before 0.19 record no such list (None): back to back, as above.
    frags = partitions.zero12_fragments([5, 3], [5, 5], [0, 0], [2, 0])
    assert frags == [[(0, 0, 5)], [(1, 2, 3)]]
    assert partitions.zero12_fragments([5, 3], [4, 4], [0, 0], None) == [[(0, 0, 4), (1, 0, 1)], [(1, 1, 3)]]
    with pytest.raises(ValueError, match="do not fit"):
        partitions.zero12_fragments([5, 3], [5, 5], [0, 0], [2])
    with pytest.raises(ValueError, match="recorded shapes hold 8 elements"):
        partitions.zero12_fragments([5, 3], [5, 5], [0, 0], [0, 0])


def test_zero3_each_param_partitioned_on_its_own():
    # numel 5 over 2 ranks: chunks of 3, last rank holds 2 + 1 padding.
    frags = partitions.zero3_fragments([5, 2], 2, 3 + 1)
    assert frags == [[(0, 0, 3), (1, 0, 2)], [(0, 3, 1), (1, 3, 1)]]


def test_zero3_refuses_flat_length_mismatch():
    with pytest.raises(ValueError, match="need 4 elements per rank"):
        partitions.zero3_fragments([5, 2], 2, 5)


def test_many_ranks_placed_by_rank_number_not_file_name_order():
    # 12 ranks: lexicographic file order is 0,1,10,11,2,...; placement must follow the rank number.
    dp = 12
    numels = [37, 100, 7, 16]
    parts = [14] * 11 + [160 - 14 * 11]
    frags = partitions.zero12_fragments(numels, parts, [0] * 11 + [14 - parts[-1]])
    names = sorted(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp))
    assert names[1].startswith("zero_pp_rank_10_")  # lexicographic order differs from rank order
    # Reassemble a known flat vector from per-rank partitions and check every parameter.
    flat = list(range(160))
    by_rank = {r: flat[r * 14:(r + 1) * 14] for r in range(dp)}
    offset = 0
    for n, fr in zip(numels, frags):
        got = [x for r, local, count in fr for x in by_rank[r][local:local + count]]
        assert got == flat[offset:offset + n]
        offset += n


def test_slice_mappings_prove_or_refute_the_placement():
    names = ["a", "b"]
    frags = partitions.zero12_fragments([5, 3], [4, 4], [0, 0])
    assert partitions.check_slice_mappings(names, frags, 1, {"a": (1, 0), "b": (3, 1)}) == []
    # The file of rank 0 placed as rank 1 (renamed): its recorded offsets disagree.
    assert partitions.check_slice_mappings(names, frags, 1, {"a": (4, 0)}) == ["a", "b"]


def test_zero3_fragments_match_the_definition_for_small_and_empty_params():
    """Rank r holds elements [r*ceil(n/dp), (r+1)*ceil(n/dp)) of each parameter: parameters smaller than
    dp (a layernorm at 1,024 ranks) live on the first ranks only, empty ones nowhere."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        dp = rng.randint(1, 70)
        numels = [rng.choice([0, 1, 2, dp - 1, dp, dp + 1, 2 * dp - 1, rng.randint(0, 500)]) for _ in range(6)]
        numels = [max(0, n) for n in numels]
        want, local = [], 0
        for n in numels:
            chunk = partitions.ceil_div(n, dp)
            want.append([(r, local, min(chunk, n - r * chunk)) for r in range(dp) if n - r * chunk > 0])
            local += chunk
        assert partitions.zero3_fragments(numels, dp, local) == want, (numels, dp)
