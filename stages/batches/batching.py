"""Rows over ranks (verl's balance_batch), per-row outputs put back in order, verl's padded
layout (the reference forward), per-token padding and load lines.

- `balance_partitions`: verl's balance_batch (verl/utils/seqlen_balancing.py) — Karmarkar-Karp
  (largest differencing) with equal-size partitions on workloads 24576·s + s², then inside each
  partition sort by (workload, idx) and lay out even positions followed by odd positions reversed.
- Micro-batches are stages.batches.binning's (`micro_batches` and `collate_bins`, shared by every stage);
  `collate` here is verl's padded layout (prompts left-padded, responses right-padded), kept as
  the reference forward of tests and bench/gpu_check.py.
Pure Python except `collate`/`pad_per_token`/`unpad`/`unpad_arrow` (torch tensors)."""
from __future__ import annotations

import functools
import heapq

WORKLOAD_COEFF = 24576


def workload(seqlen: int) -> int:
    """verl's calculate_workload: a linear (MLP) term plus a quadratic (attention) term."""
    return WORKLOAD_COEFF * int(seqlen) + int(seqlen) * int(seqlen)


# ---- Karmarkar-Karp (largest differencing) -------------------------------------------------
class _Set:
    __slots__ = ("sum", "items")

    def __init__(self):
        self.sum = 0
        self.items: list[tuple[int, int]] = []  # (idx, value)

    def add(self, idx: int, value: int) -> None:
        self.items.append((idx, value))
        self.sum += value

    def merge(self, other: "_Set") -> None:
        for idx, value in other.items:
            self.add(idx, value)

    def key(self):
        return (self.sum, len(self.items), self.items)

    def __lt__(self, other: "_Set") -> bool:  # key() < other.key(), without building tuples
        if self.sum != other.sum:
            return self.sum < other.sum
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:
    """k sets, kept sorted largest first; the heap pops the state with the largest spread."""

    def __init__(self, items: list[tuple[int, int]], k: int):
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        for i, (idx, value) in enumerate(items):
            self.sets[i].add(idx, value)
        self.sets.sort(reverse=True)
        self.spread = self.sets[0].sum - self.sets[-1].sum

    def merge(self, other: "_State") -> None:
        for i in range(self.k):  # largest set of one with the smallest of the other
            self.sets[i].merge(other.sets[self.k - 1 - i])
        self.sets.sort(reverse=True)
        self.spread = self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: "_State") -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return other.sets[0] < self.sets[0]


def karmarkar_karp(values: list[int], k: int) -> list[list[int]]:
    """Partition indices of `values` into k equal-size sets with close sums (each index list
    sorted): verl's karmarkar_karp with equal_size=True."""
    if k <= 0:
        raise ValueError(f"number of partitions must be >= 1, got {k}")
    if len(values) < k:
        raise ValueError(f"cannot split {len(values)} rows into {k} non-empty partitions")
    if len(values) % k:
        raise ValueError(f"{len(values)} rows do not split into {k} equal partitions")
    ordered = sorted((v, i) for i, v in enumerate(values))
    heap: list[_State] = []
    for off in range(0, len(ordered), k):
        heapq.heappush(heap, _State([(i, v) for v, i in ordered[off:off + k]], k))
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    parts = [sorted(idx for idx, _ in s.items) for s in heap[0].sets]
    if any(not p for p in parts):
        raise ValueError(f"Karmarkar-Karp left an empty partition ({len(values)} rows, k={k})")
    return parts


def balance_partitions(seqlens: list[int], k: int) -> list[list[int]]:
    """verl's balance_batch: rank r gets row indices partitions[r] (equal counts). The logprob
    stage, the update and every rank of them ask for the same step's partition: it is computed
    once per process (a new list each call, so callers may change theirs)."""
    if k <= 0:
        raise ValueError(f"number of ranks must be >= 1, got {k}")
    if len(seqlens) % k:
        raise ValueError(f"{len(seqlens)} rows are not divisible by {k} ranks: balance_batch needs "
                         f"equal rows per rank")
    return [list(part) for part in _balanced(tuple(int(s) for s in seqlens), k)]


@functools.lru_cache(maxsize=8)
def _balanced(seqlens: tuple, k: int) -> tuple:
    loads = [workload(s) for s in seqlens]
    parts = karmarkar_karp(loads, k) if k > 1 else [list(range(len(loads)))]  # one rank: all rows
    out = []
    for part in parts:
        part = sorted(part, key=lambda i: (loads[i], i))
        out.append(tuple(part[::2] + part[1::2][::-1]))
    return tuple(out)


# ---- per-row outputs ------------------------------------------------------------------------
def restore_order(chunks: list, micro_batches: list[list[int]]) -> list:
    """Flatten per-micro-batch outputs (lists in micro-batch row order, e.g. binning.rows_of)
    back to index order."""
    n = sum(len(mb) for mb in micro_batches)
    out = [None] * n
    for mb, values in zip(micro_batches, chunks):
        if len(values) != len(mb):
            raise ValueError(f"micro-batch output has {len(values)} rows, expected {len(mb)}")
        for i, v in zip(mb, values):
            out[i] = v
    return out


# ---- padding ---------------------------------------------------------------------------------
def collate(rows: list[dict], pad_id: int, device="cpu") -> dict:
    """Tensors for a forward pass: prompts left-padded to the longest prompt in `rows`, responses
    right-padded to the longest response (verl's layout: prompt_width P, response_width R)."""
    import torch

    if not rows:
        raise ValueError("collate needs at least one row")
    for n, r in enumerate(rows):
        if len(r["prompt_ids"]) == 0:
            raise ValueError(f"row {n} has an empty prompt_ids")
    P = max(len(r["prompt_ids"]) for r in rows)
    R = max(max(len(r["response_ids"]) for r in rows), 1)
    bs = len(rows)
    input_ids = torch.full((bs, P + R), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((bs, P + R), dtype=torch.long)
    for n, r in enumerate(rows):
        p, resp = list(r["prompt_ids"]), list(r["response_ids"])
        input_ids[n, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        attention_mask[n, P - len(p):P] = 1
        if resp:
            input_ids[n, P:P + len(resp)] = torch.tensor(resp, dtype=torch.long)
            attention_mask[n, P:P + len(resp)] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
             "response_mask": attention_mask[:, P:].clone()}
    batch = {k: v.to(device) for k, v in batch.items()}
    batch.update(prompt_width=P, response_width=R,
                 response_lengths=[len(r["response_ids"]) for r in rows])
    return batch


def pad_per_token(values: list[list[float]], width: int, dtype=None, pad_value=0.0, device="cpu"):
    """(bs, width) tensor from per-row lists, right-padded with `pad_value`."""
    import torch

    dtype = dtype or torch.float32
    lengths = torch.tensor([len(v) for v in values], dtype=torch.long)
    too_long = (lengths > width).nonzero()
    if len(too_long):
        n = int(too_long[0])
        raise ValueError(f"row {n} has {len(values[n])} values, more than the width {width}")
    out = torch.full((len(values), width), pad_value, dtype=dtype)
    # one conversion and one masked write for the whole batch (row-major order: each row's
    # values land in its first cells), not a tensor per row
    out[torch.arange(width)[None, :] < lengths[:, None]] = torch.tensor(
        [x for v in values for x in v], dtype=dtype)
    return out.to(device)


def unpad(tensor, lengths) -> list[list]:
    """Per-row Python lists of the first lengths[i] entries of a (bs, R) tensor."""
    data = tensor.detach().cpu().tolist()
    return [row[:int(n)] for row, n in zip(data, lengths)]


def unpad_arrow(tensor, lengths):
    """unpad's rows of a float tensor as one Arrow list column (list<float32>), built from flat
    values and offsets without per-row Python lists (the advantage stage's columns)."""
    import numpy as np
    import pyarrow as pa
    import torch

    lengths = torch.as_tensor(lengths, dtype=torch.long).numpy()
    values = tensor.detach().cpu().to(torch.float32).numpy()  # numpy's mask: no OpenMP region
    values = values[np.arange(values.shape[1])[None, :] < lengths[:, None]]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.float32()))


# ---- load lines ------------------------------------------------------------------------------
def format_load_line(rank: int, load: dict) -> str:
    """`rank 1: 360 rows, 12 micro-batches, 17,280 tokens (max 1,536 per micro-batch, padding 3 %)`."""
    return (f"rank {rank}: {load['rows']:,} rows, {load['micro_batches']:,} micro-batches, "
            f"{load['real_tokens']:,} tokens (max {load['max_tokens_per_micro_batch']:,} per "
            f"micro-batch, padding {round(100 * load['padding_fraction'])} %)")
