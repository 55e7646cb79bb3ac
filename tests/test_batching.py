"""Row balancing (verl's balance_batch), micro-batches (binning.micro_batches: static and token
budget, padded and packed, worked by hand), their layout and load counts, padding, load lines."""
import random

import pytest
import torch

from stages.batches import batching
from stages.batches.batching import (balance_partitions, collate, format_load_line, karmarkar_karp, pad_per_token,
                             restore_order, unpad, unpad_arrow, workload)
from stages.batches.binning import collate_bins, micro_batch_load, micro_batches, rows_of
from stages.ranks.launch import run_ranks


def test_workload_is_verls_formula():
    assert workload(0) == 0
    assert workload(1) == 24577
    assert workload(100) == 2_457_600 + 10_000


def test_karmarkar_karp_equal_sizes_hand_checked():
    # sorted pairs (1,2) (3,4) (5,6) start as states {larger}|{smaller}, spread 1 each; ties pop
    # the larger top set first: (5,6) merges with (3,4), larger with smaller: {6,3}=9 | {5,4}=9,
    # spread 0. Then (1,2) (spread 1) pops before it: {2}+{5,4}=11 | {1}+{6,3}=10 (the tie
    # between the two 9s is broken on their items, {6,3} ranking first)
    assert karmarkar_karp([1, 2, 3, 4, 5, 6], 2) == [[1, 3, 4], [0, 2, 5]]
    with pytest.raises(ValueError, match="5 rows do not split into 2 equal partitions"):
        karmarkar_karp([1, 2, 3, 4, 5], 2)


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


LENGTHS = [10, 60, 100, 30, 50, 10, 40]  # prompt + response tokens of rows 0..6


def test_static_micro_batches_padded_one_sequence_per_row():
    # consecutive rows as verl, each its own tensor row (bin)
    micro = micro_batches(LENGTHS, rows_per_micro=3, dynamic=False, packed=False)
    assert micro == [[[0], [1], [2]], [[3], [4], [5]], [[6]]]
    # padded to the longest sequence of each micro-batch: 3 x 100, 3 x 50, 1 x 40
    load = micro_batch_load(LENGTHS, micro)
    assert (load["rows"], load["micro_batches"], load["real_tokens"], load["padded_tokens"]) == (7, 3, 300, 490)
    assert load["max_tokens_per_micro_batch"] == 300 and load["max_real_tokens_per_micro_batch"] == 170
    assert micro_batches(LENGTHS[:4], rows_per_micro=4, dynamic=False, packed=False) == [[[0], [1], [2], [3]]]
    with pytest.raises(ValueError, match="positive"):
        micro_batches(LENGTHS, rows_per_micro=0, dynamic=False, packed=False)


def test_static_micro_batches_packed_into_bins():
    # rows 0-3 (10, 60, 100, 30), bins 100 wide, longest first: 100 -> bin0 (full); 60 -> bin1
    # (40 left); 30 -> bin1 (10 left); 10 -> bin1 (full). Rows 4-6 (50, 10, 40), 50 wide:
    # 50 -> bin0; 40 -> bin1 (10 left); 10 -> bin1.
    micro = micro_batches(LENGTHS, rows_per_micro=4, dynamic=False, packed=True)
    assert micro == [[[2], [1, 3, 0]], [[4], [6, 5]]]
    assert [rows_of(mb) for mb in micro] == [[2, 1, 3, 0], [4, 6, 5]]
    load = micro_batch_load(LENGTHS, micro)  # 2 x 100 + 2 x 50 padded, no room left anywhere
    assert (load["real_tokens"], load["padded_tokens"], load["padding_fraction"]) == (300, 300, 0.0)


def test_token_budget_runs_of_sorted_lengths_least_padding():
    # budget 250, each micro-batch costs 250 // 16 = 15 tokens more. Sorted longest first: 100
    # (row 2), 60 (1), 50 (4), 40 (6), 30 (3), 10 (0), 10 (5). Cheapest cut, padded tokens + 15
    # per run (runs within 250 padded tokens), by hand: [100] 115; [60, 50] 2 x 60 + 15 = 135;
    # [40, 30] 2 x 40 + 15 = 95; [10, 10] 20 + 15 = 35: 380 in all. Other cuts cost more: one
    # greedy run [60, 50, 40, 30] (4 x 60 + 15 = 255) then [10, 10] gives 405; a run per row 405.
    for packed in (False, True):  # no later sequence fits beside an earlier one in these runs
        micro = micro_batches(LENGTHS, budget=250, dynamic=True, packed=packed, all_reduce=False)
        assert micro == [[[2]], [[1], [4]], [[6], [3]], [[0], [5]]]
    load = micro_batch_load(LENGTHS, micro)  # 100 + 120 + 80 + 20 padded tokens for 300 real ones
    assert (load["padded_tokens"], load["max_tokens_per_micro_batch"], load["real_tokens"]) == (320, 120, 300)
    # budget 200 (12 per run): [100] [60] [20, 20] costs 112 + 72 + 52 = 236; [100] [60, 20, 20]
    # 112 + 192 = 304; [100, 60] [20, 20] 212 + 52 = 264
    assert micro_batches([100, 60, 20, 20], budget=200, dynamic=True, packed=False) == [[[0]], [[1]], [[2], [3]]]
    # packed (use_remove_padding): later sequences share a row of the run's width where they fit.
    # Budget 1000 (62 per run): one run [20, 10, 10] (60 + 62) beats [20] [10, 10] (20 + 62 + 20
    # + 62); 20 wide, the two 10s share the second row: 40 padded tokens instead of 60
    assert micro_batches([10, 20, 10], budget=1000, dynamic=True, packed=False) == [[[1], [0], [2]]]
    assert micro_batches([10, 20, 10], budget=1000, dynamic=True, packed=True) == [[[1], [0, 2]]]


def test_token_budget_greedy_runs_when_the_exact_cut_would_take_long(monkeypatch):
    # above DP_WORK candidates the runs are greedy: as many rows as fit from the longest left.
    # LENGTHS, budget 250: 250 // 100 = 2 rows (100, 60), then 250 // 50 = 5 rows (50, 40, 30,
    # 10, 10): 450 padded tokens where the exact cut gives 320
    import stages.batches.binning as binning

    monkeypatch.setattr(binning, "DP_WORK", 1)
    micro = micro_batches(LENGTHS, budget=250, dynamic=True, packed=False, all_reduce=False)
    assert micro == [[[2], [1]], [[4], [6], [3], [0], [5]]]
    assert micro_batch_load(LENGTHS, micro)["padded_tokens"] == 450
    monkeypatch.undo()
    # 40,000 rows of 5-20 tokens under a 1M budget (40,000 x 40,000 candidates: greedy)
    rng = random.Random(0)
    lengths = [rng.randint(5, 20) for _ in range(40_000)]
    micro = micro_batches(lengths, budget=1_000_000, dynamic=True, packed=False, all_reduce=False)
    assert len(micro) == 1 and sorted(rows_of(micro[0])) == list(range(40_000))  # 800,000 padded


def test_token_budget_wide_bins_longest_first_within_budget():
    # the update's layout. Budget 250, longest first. micro 1: width 100, 250 // 100 = 2 bins: 100
    # -> bin0 (full), 60 -> bin1 (40 left), 50 does not fit and there is no third bin, 40 -> bin1
    # (full); 30, 10, 10 wait. micro 2: width max(50, 100 // 2) = 50, 5 bins: 50 -> bin0 (full),
    # 30 -> bin1, then 10 and 10 -> bin1 (full).
    micro = micro_batches(LENGTHS, budget=250, dynamic=True, packed=True, wide_bins=True, all_reduce=False)
    assert micro == [[[2], [1, 6]], [[4], [3, 0, 5]]]
    load = micro_batch_load(LENGTHS, micro)  # 2 x 100 + 2 x 50 padded tokens hold all 300 real ones
    assert (load["padded_tokens"], load["max_tokens_per_micro_batch"]) == (300, 200)
    assert micro_batches([100, 60, 20, 20], budget=200, dynamic=True, packed=True, wide_bins=True) == [[[0], [1, 2, 3]]]
    # widths never drop below half the longest: after 100, the rows are max(20, 100 // 2) = 50
    # wide, so 20 and 20 share one instead of each padding a row of their own
    assert micro_batches([100, 20, 20], budget=100, dynamic=True, packed=True, wide_bins=True) == [[[0]], [[1, 2]]]


def test_token_budget_below_longest_sequence_is_refused():
    with pytest.raises(ValueError, match=r"token budget critic.ppo_max_token_len_per_gpu=500 is below the "
                                         r"longest sequence \(600 tokens, row 1\)"):
        micro_batches([100, 600, 50], budget=500, dynamic=True, packed=True,
                      budget_key="critic.ppo_max_token_len_per_gpu")
    with pytest.raises(ValueError, match="=None is below the longest sequence"):
        micro_batches([100], dynamic=True, packed=False)


def rank_main(ctx, rank, world):
    """Each of 2 gloo ranks groups its own lengths (run by stages.ranks.launch.run_ranks)."""
    import torch.distributed as dist

    from stages.ranks.launch import init_distributed

    init_distributed("cpu")
    lens = ctx["lens"][rank]
    local = micro_batches(lens, budget=ctx["budget"], dynamic=True, packed=True, all_reduce=False)
    reduced = micro_batches(lens, budget=ctx["budget"], dynamic=True, packed=True, group=dist.group.WORLD)
    static = micro_batches(lens, rows_per_micro=2, dynamic=False, packed=True)
    return {"local": local, "reduced": reduced, "static": static}


def test_token_budget_count_is_all_reduced_over_ranks():
    """Rank 0 needs 3 micro-batches, rank 1 only 1: with the group both run 3 (real gloo ranks)."""
    results = run_ranks("tests.test_batching", {"lens": [[600, 600, 600], [100, 100, 100]],
                                                "budget": 1000}, world=2, timeout_s=600)
    # rank 0: 2 x 600 > 1000, a micro-batch per row -> 3; rank 1: all three rows in one run
    # (300 padded tokens + 62 against 3 x (100 + 62))
    assert [r["local"] for r in results] == [[[[0]], [[1]], [[2]]], [[[0], [1], [2]]]]
    # rank 1 splits its micro-batch with the most rows until it has 3: its 3 bins in halves
    # ([0] | [1], [2]), then [1], [2] in halves
    assert [r["reduced"] for r in results] == [[[[0]], [[1]], [[2]]], [[[0]], [[1]], [[2]]]]
    # static counts are not all-reduced: 2 rows per micro-batch on both ranks
    assert [len(r["static"]) for r in results] == [2, 2]


def test_split_reaches_another_ranks_count_by_halving_bins():
    # lengths 5, 2, 2, budget 10 (1 token per run): runs [5] (6) and [2, 2] (5), 2 micro-batches.
    # Another rank needs 3: the micro-batch with the most rows, [1] [2], goes into two.
    import stages.batches.binning as binning

    original = binning.max_over_ranks
    try:
        binning.max_over_ranks = lambda value, group=None, all_reduce=True: 3
        micro = micro_batches([5, 2, 2], budget=10, dynamic=True, packed=True)
        with pytest.raises(ValueError, match="another rank needs 3 micro-batches but this rank has only 2 rows"):
            micro_batches([5, 2], budget=10, dynamic=True, packed=True)
    finally:
        binning.max_over_ranks = original
    assert micro == [[[0]], [[1]], [[2]]]


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
    micro = [[[0], [1]], [[2, 3]]]  # one sequence per row, then two sequences in one row
    load = micro_batch_load(seqlens, micro)
    # mb0: 2 bins x 40 = 80 padded, 80 real; mb1: 1 bin x 80 = 80 padded, 80 real
    assert (load["rows"], load["real_tokens"], load["padded_tokens"]) == (4, 160, 160)
    load = micro_batch_load(seqlens, [[[0], [2]], [[1], [3]]])
    # mb0: 2 x 40 = 80 padded, 70 real; mb1: 2 x 50 = 100 padded, 90 real
    assert (load["rows"], load["real_tokens"], load["padded_tokens"]) == (4, 160, 180)
    assert load["max_tokens_per_micro_batch"] == 100 and load["max_real_tokens_per_micro_batch"] == 90
    assert load["padding_fraction"] == pytest.approx(20 / 180)
    assert format_load_line(1, load) == "rank 1: 4 rows, 2 micro-batches, 160 tokens (max 100 per micro-batch, padding 11 %)"
    big = {"rows": 360, "micro_batches": 12, "real_tokens": 17280, "padded_tokens": 17800,
           "max_tokens_per_micro_batch": 1536, "padding_fraction": 0.03}
    assert format_load_line(1, big) == ("rank 1: 360 rows, 12 micro-batches, 17,280 tokens "
                                        "(max 1,536 per micro-batch, padding 3 %)")


def test_pad_per_token_refuses_too_long_rows():
    with pytest.raises(ValueError, match="row 0 has 3 values, more than the width 2"):
        pad_per_token([[1.0, 2.0, 3.0]], 2)
    assert pad_per_token([[1, 2]], 3, dtype=torch.long).dtype == torch.long
    assert batching.WORKLOAD_COEFF == 24576


def test_collate_bins_layout():
    rows = [{"prompt_ids": [11, 12, 13], "response_ids": [21, 22]},
            {"prompt_ids": [14], "response_ids": [23, 24, 25, 26]},
            {"prompt_ids": [15, 16], "response_ids": [27]}]
    b = collate_bins([[rows[0], rows[2]], [rows[1]]], pad_id=0)
    # bin 0: rows 0 and 2 back to back (5 + 3 = 8 tokens, the width); bin 1: row 1 (5) + 3 pad
    assert b["input_ids"].tolist() == [[11, 12, 13, 21, 22, 15, 16, 27], [14, 23, 24, 25, 26, 0, 0, 0]]
    # positions restart per sequence; a tail continues the last sequence (no extra segment)
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]]
    # the hidden state at flat position t predicts token t+1: 13->21, 21->22, 16->27, 14->23, ...
    # rows in bin order: 0, 2, 1
    assert b["pred_index"].tolist() == [2, 3, 6, 8, 9, 10, 11]
    assert b["targets"].tolist() == [21, 22, 27, 23, 24, 25, 26]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert (b["response_lengths"], b["response_width"]) == ([2, 1, 4], 4)
    assert (b["real_tokens"], b["padded_tokens"]) == (13, 16)
    load = micro_batch_load([5, 5, 3], [[[0, 2], [1]]])  # the same count as the batch reports
    assert (load["real_tokens"], load["padded_tokens"]) == (13, 16)
    assert load["padding_fraction"] == pytest.approx(3 / 16)
    with pytest.raises(ValueError, match="row 1 has an empty prompt_ids"):
        collate_bins([[rows[0], {"prompt_ids": [], "response_ids": [2]}]], pad_id=0)


def test_collate_bins_matches_the_row_by_row_definition_on_random_bins():
    """The vectorised layout against its definition, written row by row: sequences back to back,
    positions restarting per sequence and continuing into a bin's tail, and each response token
    predicted by the flat position before it (lists or numpy rows, empty responses included)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for trial in range(100):
        bins = [[{"prompt_ids": rng.integers(1, 99, rng.integers(1, 9)).tolist(),
                  "response_ids": rng.integers(1, 99, rng.integers(0, 9)).tolist()}
                 for _ in range(rng.integers(1, 5))] for _ in range(rng.integers(1, 6))]
        if trial % 2:
            bins = [[{k: np.asarray(v, dtype=np.int32) for k, v in r.items()} for r in b] for b in bins]
        width = max(sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in b) for b in bins)
        ids, pos, pred, targets = [], [], [], []
        for b, members in enumerate(bins):
            row_ids, row_pos = [], []
            for r in members:
                p, resp = list(r["prompt_ids"]), list(r["response_ids"])
                pred += [b * width + len(row_ids) + len(p) - 1 + k for k in range(len(resp))]
                targets += resp
                row_ids += p + resp
                row_pos += list(range(len(p) + len(resp)))
            tail = width - len(row_ids)
            ids.append(row_ids + [7] * tail)
            pos.append(row_pos + list(range(row_pos[-1] + 1, row_pos[-1] + 1 + tail)))
        got = collate_bins(bins, pad_id=7)
        assert got["input_ids"].tolist() == ids and got["position_ids"].tolist() == pos
        assert got["pred_index"].tolist() == pred and got["targets"].tolist() == targets
        lengths = [len(r["response_ids"]) for b in bins for r in b]
        assert got["response_mask"].tolist() == [[int(j < n) for j in range(max(max(lengths), 1))] for n in lengths]
        assert got["input_ids"].dtype == got["pred_index"].dtype == torch.long


def test_unpad_arrow_equals_the_python_lists():
    """The advantage stage's columns: one Arrow list<float32> column equal to unpad's lists."""
    import pyarrow as pa
    import torch

    tensor = torch.tensor([[0.5, -1.25, 3.0, 9.0], [7.0, 8.0, 9.0, 10.0], [1e-8, 2.0, -0.0, 4.0]])
    lengths = [2, 0, 4]
    column = unpad_arrow(tensor, lengths)
    assert column.type == pa.list_(pa.float32())
    assert column.to_pylist() == unpad(tensor, lengths) == [[0.5, -1.25], [], [pytest.approx(1e-8), 2.0, -0.0, 4.0]]
    assert column.equals(pa.array(unpad(tensor, lengths), type=pa.list_(pa.float32())))
