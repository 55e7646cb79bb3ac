"""Micro-batches: how every forward of stagerl (logprob: actor, ref, critic values; the update;
the reward model) groups one rank's rows, and the one collate that lays them out.

A micro-batch is a list of bins; a bin is one tensor row holding whole sequences (prompt +
response) back to back, with position_ids restarting at 0 for each sequence, so transformers
attends block-diagonally inside a bin (transformers.masking_utils.find_packed_sequence_indices:
the attention_mask is left None for that). A bin's tail padding comes after all its real tokens,
so causal attention never lets a real token see it, and its positions only feed ignored outputs.

    micro = micro_batches(lengths, rows_per_micro=60, budget=None, dynamic=False, packed=False)
    batch = collate_bins([[rows[i] for i in b] for b in micro[0]], pad_id)

Modes (`micro_batches`):
- static (`dynamic=False`): consecutive `rows_per_micro` rows, as verl. Not packed: one sequence
  per tensor row, right-padded to the micro-batch's longest sequence. Packed: the micro-batch's
  sequences, longest first, go into bins as wide as its longest sequence.
- token budget (`dynamic=True`), at most `budget` padded tokens per micro-batch, whole sequences
  sorted longest first, in one of two layouts:
  - runs (the default: log-prob, value and reward-model forwards): the sorted sequences cut into
    runs of similar length, one run per micro-batch, one sequence per tensor row (rows x its
    longest <= budget); the cut is the one with the fewest padded tokens plus budget // 16 per
    micro-batch (`_segments`, exact). Packed: later sequences of a run share a tensor row where
    they fit in its width. Without a varlen attention kernel (the CPU) a tensor row's attention
    is computed over its whole width, masked, so rows of many short sequences cost quadratically:
    runs pad 4.6 % and run at 1.6-2.0x static, wide bins 1.34-1.65x at 3.3 % (bench/logprob.py).
  - `wide_bins` (the update): bins as wide as the longest sequence left (at least half the
    longest of all), budget // width bins per micro-batch, shorter sequences filling the room
    left in bins. A backward's fixed cost per micro-batch outweighs the masked attention there:
    8 micro-batches at 3.5 % padding ran 1.6-2.0x static, runs (12 at 6.7 %) 1.4-1.7x, and more,
    less padded runs slower still (bench/update.py).
  The count is all-reduced MAX over ranks. Not verl's rearrange_micro_batches (Karmarkar-Karp
  groups of padded rows): those mix long and short rows, and the padded log-prob forward then
  padded 77 % and ran at 0.33x static. `packed=False` always keeps one sequence per tensor row
  (the reward model, whose head reads each row's last token).
The logprob stage packs with use_remove_padding; the update packs with it and with a token budget.
Padding is only what is left at the ends of rows; the loss and the per-token values are exact for
any grouping, only the speed depends on it."""
from __future__ import annotations


def check_budget(lengths: list[int], budget: int | None, key: str) -> int:
    """The longest sequence, if it fits the token budget (a sequence is never split)."""
    longest = max(lengths)
    if budget is None or budget < max(longest, 1):
        raise ValueError(f"token budget {key}={budget} is below the longest sequence ({longest} "
                         f"tokens, row {lengths.index(longest)}): a sequence is never split")
    return longest


def micro_batches(lengths: list[int], *, rows_per_micro: int | None = None, budget: int | None = None,
                  dynamic: bool, packed: bool, wide_bins: bool = False, all_reduce: bool = True,
                  group=None, budget_key: str = "max_token_len_per_gpu") -> list[list[list[int]]]:
    """One rank's micro-batches (lists of bins, a bin a list of row indices into `lengths`, the
    prompt + response length of each row), in execution order; see the module docstring for the
    modes. With `dynamic` and a torch.distributed `group` (or all_reduce and an initialised
    default group) every rank runs as many micro-batches (all-reduce MAX: ZeRO-2/3 reduce
    gradients inside each backward); a rank that needs fewer splits its micro-batch with the most
    rows. Static counts are equal on ranks with equal rows."""
    if not lengths:
        return []
    if not dynamic:
        if rows_per_micro is None or rows_per_micro <= 0:
            raise ValueError(f"micro-batch size must be a positive number of rows, got {rows_per_micro!r}")
        chunks = [list(range(s, min(s + rows_per_micro, len(lengths))))
                  for s in range(0, len(lengths), rows_per_micro)]
        if not packed:
            return [[[i] for i in chunk] for chunk in chunks]
        return [_fill_bins(lengths, sorted(chunk, key=lambda i: (-lengths[i], i)),
                           max(lengths[i] for i in chunk), len(chunk))[0] for chunk in chunks]
    longest = check_budget(lengths, budget, budget_key)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if wide_bins:  # the update: few, full micro-batches, always packed
        micro = []
        while order:
            width = max(lengths[order[0]], longest // 2, 1)
            bins, order = _fill_bins(lengths, order, width, budget // width)
            micro.append(bins)
    else:
        micro = [[[i] for i in order[s:e]] for s, e in _segments([lengths[i] for i in order], budget)]
        if packed:  # within a micro-batch as wide as its longest sequence, shorter ones share rows
            micro = [_fill_bins(lengths, rows_of(mb), lengths[mb[0][0]], len(mb))[0] for mb in micro]
    target = max_over_ranks(len(micro), group, all_reduce)
    if target > len(lengths):
        raise ValueError(f"another rank needs {target} micro-batches but this rank has only "
                         f"{len(lengths)} rows (ranks must hold similar row counts)")
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


DP_WORK = 2_000_000  # run ends x candidate starts the exact cut may examine (~1 s of Python)


def _segments(desc: list[int], budget: int) -> list[tuple[int, int]]:
    """Cut lengths sorted longest first into runs [s, e), each padded to its first length within
    the budget ((e - s) * desc[s] <= budget), minimising padded tokens + budget // 16 per run (a
    forward's fixed cost, so that fewer, fuller micro-batches win over shaving a few pads). Exact
    (dynamic programming over run ends; a run holds at most budget // desc[s] rows); when that
    would examine more than DP_WORK candidates (tens of thousands of short rows under a large
    budget), greedy runs instead: each as many rows as fit from the longest left."""
    overhead, n = max(budget // 16, 1), len(desc)
    if n * min(n, budget // max(desc[-1], 1)) > DP_WORK:
        runs, s = [], 0
        while s < n:
            e = min(n, s + max(budget // max(desc[s], 1), 1))
            runs.append((s, e))
            s = e
        return runs
    best, start = [0] + [float("inf")] * n, [0] * (n + 1)
    for e in range(1, n + 1):
        for s in range(e - 1, -1, -1):
            if (e - s) * desc[s] > budget:
                break
            cost = best[s] + (e - s) * desc[s] + overhead
            if cost < best[e]:
                best[e], start[e] = cost, s
    runs, e = [], n
    while e > 0:
        runs.append((start[e], e))
        e = start[e]
    return runs[::-1]


def _fill_bins(lengths, order, width: int, max_bins: int):
    """First fit in `order`: each sequence goes to the first bin with room, else a new bin while
    there are fewer than max_bins. Returns (bins, the sequences that found no place)."""
    bins, free, rest = [], [], []
    for i in order:
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            if len(bins) < max_bins:
                bins.append([i])
                free.append(width - lengths[i])
            else:
                rest.append(i)
    return bins, rest


def max_over_ranks(value: int, group=None, all_reduce: bool = True) -> int:
    """`value` all-reduced MAX over `group` (or the default group when all_reduce and one is
    initialised); `value` itself without torch.distributed."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return value
    if not (dist.is_available() and dist.is_initialized()):
        return value
    if group is None and not all_reduce:
        return value
    import torch

    backend = dist.get_backend(group)
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def rows_of(micro_batch: list[list[int]]) -> list[int]:
    """The row indices of a micro-batch in bin order (the order collate_bins lays rows out)."""
    return [i for b in micro_batch for i in b]


def micro_batch_load(lengths: list[int], micro: list[list[list[int]]]) -> dict:
    """Rows, micro-batches, real and padded tokens of one rank's micro-batches, counted as
    collate_bins lays them out: a micro-batch is (bins x its fullest bin) padded tokens."""
    real = [sum(lengths[i] for i in rows_of(mb)) for mb in micro]
    padded = [len(mb) * max(sum(lengths[i] for i in b) for b in mb) for mb in micro]
    return {"rows": sum(len(rows_of(mb)) for mb in micro), "micro_batches": len(micro),
            "real_tokens": sum(real), "padded_tokens": sum(padded),
            "max_tokens_per_micro_batch": max(padded, default=0),
            "max_real_tokens_per_micro_batch": max(real, default=0),
            "padding_fraction": 1 - sum(real) / sum(padded) if padded else 0.0}


def collate_bins(bins: list[list[dict]], pad_id: int, device="cpu") -> dict:
    """A (bins x width) batch of rows ({"prompt_ids", "response_ids"}) grouped in bins; width is the
    fullest bin. The "flat" layout stages.model.models reads: input_ids,
    position_ids, pred_index (flat positions whose hidden states predict each response token, rows
    in bin order), targets, response_mask (rows x R), response_lengths, response_width, plus
    real_tokens / padded_tokens (what the load records report). No attention_mask: positions that
    restart mark the sequences."""
    import numpy as np
    import torch

    if not bins or not all(bins):
        raise ValueError("collate_bins needs at least one row in every bin")
    rows = [r for b in bins for r in b]
    prompts = [len(r["prompt_ids"]) for r in rows]
    lengths = [len(r["response_ids"]) for r in rows]
    if 0 in prompts:
        raise ValueError(f"row {prompts.index(0)} has an empty prompt_ids")
    # every array op below is over the whole micro-batch (a per-row loop of tensor writes took
    # 9 ms per 120-row micro-batch, 5 % of a warm update step on the tiny model)
    seq = np.add(prompts, lengths)
    sizes = [len(b) for b in bins]
    first_row = np.cumsum([0] + sizes[:-1])
    fills = np.add.reduceat(seq, first_row)
    width = int(fills.max())
    R = max(max(lengths), 1)
    bin_of = np.repeat(np.arange(len(bins)), sizes)
    starts = np.cumsum(seq) - seq  # each sequence's first column in its bin ...
    starts -= np.repeat(starts[first_row], sizes)  # ... counted from the bin's start
    input_ids = np.full((len(bins), width), int(pad_id), dtype=np.int64)
    column = np.arange(width)
    for b, members in enumerate(bins):
        input_ids[b, :fills[b]] = np.fromiter(
            (t for r in members for part in (r["prompt_ids"], r["response_ids"]) for t in part),
            dtype=np.int64, count=int(fills[b]))
    # a column's position counts from the start of its sequence; a bin's tail continues its last
    # sequence's positions (no extra segment, never attended to)
    last = first_row + np.asarray(sizes) - 1
    span = seq.copy()
    span[last] += width - fills
    position_ids = column[None, :] - starts[np.arange(len(rows)).repeat(span)].reshape(len(bins), width)
    response_mask = (np.arange(R)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    first = bin_of * width + starts + np.asarray(prompts) - 1  # flat position predicting a row's first token
    offset = np.arange(sum(lengths)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    pred = np.repeat(first, lengths) + offset
    targets = np.fromiter((t for r in rows for t in r["response_ids"]), dtype=np.int64, count=sum(lengths))
    fills = fills.tolist()
    input_ids, position_ids, response_mask = (torch.from_numpy(a) for a in (input_ids, position_ids, response_mask))
    batch = {"input_ids": input_ids, "position_ids": position_ids, "response_mask": response_mask,
             "pred_index": torch.from_numpy(pred), "targets": torch.from_numpy(targets)}
    batch = {k: v.to(device) for k, v in batch.items()}
    batch.update(flat=True, response_lengths=lengths, response_width=R, sequence_width=width,
                 real_tokens=sum(fills), padded_tokens=width * len(bins))
    return batch
