"""Token-budget micro-batches for the update's forward, with several sequences in one tensor row.

A micro-batch is a (bins x width) tensor. Each bin (tensor row) holds whole sequences (prompt +
response) back to back, with position_ids restarting at 0 for each sequence, so transformers
attends block-diagonally inside a bin (transformers.masking_utils.find_packed_sequence_indices:
the attention_mask is left None for that). A bin's tail padding comes after all its real tokens,
so causal attention never lets a real token see it, and its positions only feed ignored outputs.

    micro = binned_micro_batches(lengths, budget)   # [[bin, bin, ...], ...]; a bin = row indices
    batch = collate_bins([[rows[i] for i in b] for b in micro[0]], pad_id)

Micro-batches are built longest sequence first (binned_micro_batches): the width of a
micro-batch is its longest sequence (at least half the longest of all), it holds budget // width
bins, and shorter sequences fill the room left in bins. Padding is only what is left at the ends of bins, micro-batches are as
full as the budget allows (the same bins-x-width peak as `ppo_max_token_len_per_gpu`), and short
sequences end up in narrow micro-batches, where attention over a row is cheap. The loss is
exact for any grouping (stages.update_worker): only the speed depends on it."""
from __future__ import annotations


def binned_micro_batches(lengths: list[int], budget: int, group=None,
                         all_reduce: bool = True) -> list[list[list[int]]]:
    """Micro-batches (lists of bins, a bin a list of row indices) of at most `budget` padded
    tokens. Greedy, longest first: a micro-batch's width is the longest sequence left, but at
    least half the longest of all; it has budget // width bins, and the sequences left (longest
    first) go to the first bin with room. Short sequences fill the gaps beside long ones; rows
    stay about as wide as their sequences (attention over a row costs its width), yet wide enough
    for two or more short sequences, which is what keeps padding low (bench/update.py: ~1-4 %;
    one sequence per row at its own width padded 6-8 %, one width for all rows cost ~15 % more
    time in attention). The count is all-reduced MAX over `group`
    (every rank runs as many backward passes, as ZeRO-2/3 need) and reached by splitting the
    micro-batch with the most rows (its bins in two halves, or a single bin's sequences in two)."""
    from stages.batching import _max_over_group, check_budget

    if not lengths:
        return []
    longest = check_budget(lengths, budget, "max_token_len_per_gpu")
    left, micro = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), []
    while left:
        width = max(lengths[left[0]], longest // 2)
        bins, free, rest = [], [], []
        for i in left:
            for b, room in enumerate(free):
                if lengths[i] <= room:
                    bins[b].append(i)
                    free[b] -= lengths[i]
                    break
            else:
                if len(bins) < budget // width:
                    bins.append([i])
                    free.append(width - lengths[i])
                else:
                    rest.append(i)
        micro.append(bins)
        left = rest
    target = _max_over_group(len(micro), group, all_reduce)
    if target > len(lengths):
        raise ValueError(f"another rank needs {target} micro-batches but this rank has only "
                         f"{len(lengths)} rows")
    while len(micro) < target:
        k = max(range(len(micro)), key=lambda j: sum(len(b) for b in micro[j]))
        big = micro.pop(k)
        if len(big) > 1:
            halves = [big[:len(big) // 2], big[len(big) // 2:]]
        else:
            rows = big[0]
            halves = [[rows[:len(rows) // 2]], [rows[len(rows) // 2:]]]
        micro[k:k] = halves
    return micro


def rows_of(micro_batch: list[list[int]]) -> list[int]:
    """The row indices of a micro-batch in bin order (the order collate_bins lays rows out)."""
    return [i for b in micro_batch for i in b]


def collate_bins(bins: list[list[dict]], pad_id: int, device="cpu") -> dict:
    """A (bins x width) batch of rows ({"prompt_ids", "response_ids"}) grouped in bins; width is the
    fullest bin. The "flat" layout stages.models reads: input_ids,
    position_ids, pred_index (flat positions whose hidden states predict each response token, rows
    in bin order), targets, response_mask (rows x R), response_lengths, response_width, plus
    real_tokens / padded_tokens (what the load records report). No attention_mask: positions that
    restart mark the sequences."""
    import torch

    if not bins or not all(bins):
        raise ValueError("collate_bins needs at least one row in every bin")
    fills = [sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in b) for b in bins]
    width = max(fills)
    rows = [r for b in bins for r in b]
    lengths = [len(r["response_ids"]) for r in rows]
    R = max(max(lengths), 1)
    input_ids = torch.full((len(bins), width), int(pad_id), dtype=torch.long)
    position_ids = torch.zeros((len(bins), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), R), dtype=torch.long)
    pred, targets, n = [], [], 0
    for b, members in enumerate(bins):
        start = 0
        for r in members:
            p, resp = list(r["prompt_ids"]), list(r["response_ids"])
            if not p:
                raise ValueError(f"row {n} has an empty prompt_ids")
            seq = p + resp
            input_ids[b, start:start + len(seq)] = torch.tensor(seq, dtype=torch.long)
            position_ids[b, start:start + len(seq)] = torch.arange(len(seq))
            response_mask[n, :len(resp)] = 1
            first = b * width + start + len(p) - 1
            pred += range(first, first + len(resp))
            targets += resp
            start += len(seq)
            n += 1
        # the tail continues the last sequence's positions: no extra segment, never attended to
        position_ids[b, start:] = torch.arange(position_ids[b, start - 1] + 1,
                                               position_ids[b, start - 1] + 1 + width - start)
    batch = {"input_ids": input_ids, "position_ids": position_ids, "response_mask": response_mask,
             "pred_index": torch.tensor(pred, dtype=torch.long),
             "targets": torch.tensor(targets, dtype=torch.long)}
    batch = {k: v.to(device) for k, v in batch.items()}
    batch.update(flat=True, response_lengths=lengths, response_width=R, sequence_width=width,
                 real_tokens=sum(fills), padded_tokens=width * len(bins))
    return batch
