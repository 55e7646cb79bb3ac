"""Row balancing (verl's balance_batch), micro-batches (static and token budget), padding, load lines."""
import random

import pytest
import torch

from stages import batching
from stages.batching import (balance_partitions, collate, format_load_line, karmarkar_karp,
                             micro_batch_load, pack, pad_per_token, restore_order, static_micro_batches,
                             token_budget_micro_batches, unpad, workload)
from stages.launch import run_ranks


def test_workload_is_verls_formula():
    assert workload(0) == 0
    assert workload(1) == 24577
    assert workload(100) == 2_457_600 + 10_000


def test_karmarkar_karp_unequal_hand_checked():
    # singletons 8|7 -> spread 1; 6|5 -> spread 1; 4 joins (8|7): {4,7}=11 vs {8}=8, spread 3;
    # merged with (6|5): {4,7,5}=16 vs {8,6}=14
    assert karmarkar_karp([4, 5, 6, 7, 8], 2, equal_size=False) == [[0, 1, 3], [2, 4]]


def test_balance_partitions_hand_checked_example():
    # pairs (7,6) and (5,4) merge to {7,4} {6,5}; pairs (3,2) (1,0) to {3,0} {2,1}; then
    # {7,4}+{2,1} and {6,5}+{3,0}: both 180 tokens, equal workloads. Inside a partition: sorted
    # by workload, even positions then odd positions reversed.
    parts = balance_partitions([10, 20, 30, 40, 50, 60, 70, 80], 2)
    assert parts == [[1, 4, 7, 2], [0, 5, 6, 3]]
    loads = [sum(workload(10 * (i + 1)) for i in p) for p in parts]
    assert loads[0] == loads[1] == sum(workload(s) for s in (20, 50, 80, 30))


def test_balance_partitions_equal_sizes_and_cover_all_rows():
    rng = random.Random(3)
    for k in (1, 2, 3, 4):
        seqlens = [rng.choice([rng.randint(5, 40), rng.randint(200, 900)]) for _ in range(12 * k)]
        parts = balance_partitions(seqlens, k)
        assert [len(p) for p in parts] == [12] * k
        assert sorted(i for p in parts for i in p) == list(range(12 * k))
        loads = [sum(workload(seqlens[i]) for i in p) for p in parts]
        naive = [sum(workload(s) for s in seqlens[r * 12:(r + 1) * 12]) for r in range(k)]
        assert max(loads) - min(loads) <= max(naive) - min(naive)


def test_balance_partitions_refuses_uneven_rows():
    with pytest.raises(ValueError, match="7 rows are not divisible by 2 ranks"):
        balance_partitions([1] * 7, 2)


def test_static_micro_batches():
    assert static_micro_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert static_micro_batches(4, 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="positive"):
        static_micro_batches(4, 0)


def test_token_budget_reference_example():
    # reference §3.2: lengths [600, 600, 600], budget 1000 -> ceil(1800/1000) = 2 micro-batches,
    # 1200 and 600 tokens (the budget is a target, not a cap)
    mbs = token_budget_micro_batches([600, 600, 600], 1000)
    assert mbs == [[0, 1], [2]]
    assert [sum(600 for _ in mb) for mb in mbs] == [1200, 600]
    load = micro_batch_load([600, 600, 600], mbs)
    assert (load["micro_batches"], load["real_tokens"], load["max_tokens_per_micro_batch"]) == (2, 1800, 1200)


def test_token_budget_count_and_order():
    lens = [100, 900, 50, 400, 400, 300, 20, 830]  # total 3000, budget 1000 -> 3 micro-batches
    mbs = token_budget_micro_batches(lens, 1000)
    assert len(mbs) == 3 and sorted(i for mb in mbs for i in mb) == list(range(8))
    loads = [sum(workload(lens[i]) for i in mb) for mb in mbs]
    # heaviest first, then folded: even positions reversed + odd positions -> the heaviest
    # micro-batch sits in the middle... of [h0, h1, h2]: [h2, h0, h1]
    by_weight = sorted(loads, reverse=True)
    assert loads == [by_weight[2], by_weight[0], by_weight[1]]
    # never more micro-batches than rows
    assert len(token_budget_micro_batches([10, 10], 10)) == 2


def test_token_budget_below_longest_sequence_is_refused():
    with pytest.raises(ValueError, match=r"max_token_len_per_gpu=500 is below the longest sequence \(600 tokens, row 1\)"):
        token_budget_micro_batches([100, 600, 50], 500)


def test_token_budget_count_is_all_reduced_over_ranks():
    """Rank 0 needs 2 micro-batches, rank 1 only 1: with the group both run 2 (real gloo ranks)."""
    results = run_ranks("tests._batching_ranks", {"lens": [[600, 600, 600], [100, 100, 100]],
                                                  "budget": 1000}, world=2, timeout_s=600)
    assert [r["local"] for r in results] == [2, 1]
    assert [r["reduced"] for r in results] == [2, 2]
    assert sorted(len(mb) for mb in results[1]["micro_batches"]) == [1, 2]


def test_restore_order():
    mbs = [[2, 0], [1]]
    assert restore_order([["c", "a"], ["b"]], mbs) == ["a", "b", "c"]


def test_collate_layout_and_unpad_round_trip():
    rows = [{"prompt_ids": [11, 12, 13], "response_ids": [21, 22]},
            {"prompt_ids": [14], "response_ids": [23, 24, 25, 26]}]
    b = collate(rows, pad_id=0)
    assert (b["prompt_width"], b["response_width"]) == (3, 4)
    assert b["input_ids"].tolist() == [[11, 12, 13, 21, 22, 0, 0], [0, 0, 14, 23, 24, 25, 26]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    values = [[0.5, -1.0], [1.0, 2.0, 3.0, 4.0]]
    padded = pad_per_token(values, b["response_width"])
    assert padded.tolist() == [[0.5, -1.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]
    assert unpad(padded, [2, 4]) == values
    assert unpad(b["input_ids"][:, 3:], b["response_lengths"]) == [[21, 22], [23, 24, 25, 26]]


def test_collate_refuses_empty_prompt():
    with pytest.raises(ValueError, match="row 1 has an empty prompt_ids"):
        collate([{"prompt_ids": [1], "response_ids": [2]}, {"prompt_ids": [], "response_ids": [2]}], 0)


def test_load_line_numbers():
    seqlens = [40, 40, 30, 50]
    prompt_lengths = [20, 30, 10, 20]
    mbs = [[0, 1], [2, 3]]
    load = micro_batch_load(seqlens, mbs, prompt_lengths=prompt_lengths)
    # mb0: prompts 20/30 -> P 30, responses 20/10 -> R 20, 2 rows x 50 = 100 padded, 80 real
    # mb1: prompts 10/20 -> P 20, responses 20/30 -> R 30, 2 x 50 = 100 padded, 80 real
    assert (load["rows"], load["real_tokens"], load["padded_tokens"]) == (4, 160, 200)
    assert load["max_tokens_per_micro_batch"] == 100
    assert load["padding_fraction"] == pytest.approx(0.2)
    assert format_load_line(1, load) == "rank 1: 4 rows, 2 micro-batches, 160 tokens (max 100 per micro-batch, padding 20 %)"
    big = {"rows": 360, "micro_batches": 12, "real_tokens": 17280, "padded_tokens": 17800,
           "max_tokens_per_micro_batch": 1536, "padding_fraction": 0.03}
    assert format_load_line(1, big) == ("rank 1: 360 rows, 12 micro-batches, 17,280 tokens "
                                        "(max 1,536 per micro-batch, padding 3 %)")


def test_pad_per_token_refuses_too_long_rows():
    with pytest.raises(ValueError, match="row 0 has 3 values, more than the width 2"):
        pad_per_token([[1.0, 2.0, 3.0]], 2)
    assert pad_per_token([[1, 2]], 3, dtype=torch.long).dtype == torch.long
    assert batching.WORKLOAD_COEFF == 24576


def test_pack_layout():
    rows = [{"prompt_ids": [11, 12, 13], "response_ids": [21, 22]},
            {"prompt_ids": [14], "response_ids": [23, 24, 25, 26]}]
    b = pack(rows)
    assert b["input_ids"].tolist() == [[11, 12, 13, 21, 22, 14, 23, 24, 25, 26]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    # the logit at flat position t predicts token t+1: 13->21, 21->22, 14->23, ...
    assert b["pred_index"].tolist() == [2, 3, 5, 6, 7, 8]
    assert b["targets"].tolist() == [21, 22, 23, 24, 25, 26]
    assert (b["response_lengths"], b["response_width"]) == ([2, 4], 4)
    load = micro_batch_load([5, 5], [[0, 1]], packed=True)
    assert (load["real_tokens"], load["padded_tokens"], load["padding_fraction"]) == (10, 10, 0.0)


def test_bins_longest_first_and_micro_batches_within_budget():
    from stages.binning import binned_micro_batches

    # lengths (by index) 10, 60, 100, 30, 50, 10, 40; budget 250. By hand, longest first:
    # micro 1: width 100, 250 // 100 = 2 bins: 100 -> bin0 (full), 60 -> bin1 (40 left),
    #   50 does not fit (no third bin), 40 -> bin1 (full); 30, 10, 10 wait.
    # micro 2: width max(50, 100 // 2) = 50, 5 bins: 50 -> bin0 (full), 30 -> bin1, 10, 10 -> bin1.
    lengths = [10, 60, 100, 30, 50, 10, 40]
    micro = binned_micro_batches(lengths, 250, all_reduce=False)
    assert micro == [[[2], [1, 6]], [[4], [3, 0, 5]]]
    # 2 x 100 + 2 x 50 padded tokens hold all 300 real ones
    assert sum(max(sum(lengths[i] for i in b) for b in mb) * len(mb) for mb in micro) == 300
    # 200 // 100 = 2 bins of width 100 take everything: 100 | 60 + 20 + 20
    assert binned_micro_batches([100, 60, 20, 20], 200, all_reduce=False) == [[[0], [1, 2, 3]]]
    # widths never drop below half the longest: after 100, the rows are max(20, 100 // 2) = 50
    # wide, so 20 and 20 share one instead of each padding a row of their own
    assert binned_micro_batches([100, 20, 20], 100, all_reduce=False) == [[[0]], [[1, 2]]]
    with pytest.raises(ValueError, match="below the longest sequence"):
        binned_micro_batches(lengths, 99, all_reduce=False)


def test_bins_split_to_reach_another_ranks_count():
    from stages.binning import binned_micro_batches

    # lengths 5, 2, 2: bins [0] and [1, 2] (width 5), budget 10 -> one micro-batch of both bins.
    # Another rank needs 3: split the bins into two micro-batches, then the bin [1, 2] into two bins
    import stages.batching as b

    original = b._max_over_group
    try:
        b._max_over_group = lambda value, group, all_reduce: 3
        micro = binned_micro_batches([5, 2, 2], 10)
    finally:
        b._max_over_group = original
    assert micro == [[[0]], [[1]], [[2]]]

