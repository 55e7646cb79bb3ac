"""The RL prompt dataset, with verl's `data.*` keys (reference §2 setup, §5.1).

Reads parquet file(s) in verl's RL schema, applies the tokenizer's chat template
(add_generation_prompt=True), then:
- data.filter_overlong_prompts: drop rows whose templated length > max_prompt_length (counted in
  `filtered_count`; happens first, as verl filters at load time);
- data.truncation for the rows still too long: error (raise naming the row and its length) |
  left (keep the last max tokens) | right (keep the first max) | middle (keep max//2 from the start
  and the rest from the end) — on token ids, as verl.
Batches: data.train_batch_size prompts; drop_last (default True, as verl's dataloader). With
data.shuffle, epoch e uses the permutation of numpy.random.default_rng([seed, e]); otherwise file
order. Steps are numbered from 0 here: `batch_for_step(k)` is the (k+1)-th batch drawn.
A `DataPosition(epoch, index)` (index = prompts consumed in that epoch) is what to save for
resume; `batch_at(position)` continues from it exactly. Pure: no storage or Prefect imports.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

TRUNCATION_MODES = ("error", "left", "right", "middle")


@dataclass(frozen=True, order=True)
class DataPosition:
    epoch: int = 0
    index: int = 0  # prompts already consumed in this epoch

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DataPosition":
        return cls(epoch=int(data["epoch"]), index=int(data["index"]))


@dataclass
class PromptRow:
    index: int  # extra_info.index when present, else the row's number in the files
    row: int  # the row's number in the concatenated files (before filtering)
    messages: list[dict]
    prompt_ids: list[int]  # templated, truncated
    data_source: str
    ground_truth: str | None
    extra_info: dict = field(default_factory=dict)
    truncated: bool = False


@dataclass
class Batch:
    step: int | None
    epoch: int
    position: DataPosition  # where this batch starts
    next_position: DataPosition  # where the following batch starts (save this after the step)
    rows: list[PromptRow]


def _as_list(files) -> list[str]:
    if files is None:
        return []
    if isinstance(files, str):
        return [files]
    return [str(f) for f in files]


def truncate_ids(ids: list[int], max_length: int, mode: str, row: int | None = None) -> list[int]:
    """verl's data.truncation on token ids; `row` names the row in the error."""
    if len(ids) <= max_length:
        return list(ids)
    if mode == "left":
        return list(ids[-max_length:])
    if mode == "right":
        return list(ids[:max_length])
    if mode == "middle":
        left = max_length // 2
        right = max_length - left
        return list(ids[:left]) + (list(ids[-right:]) if right else [])
    if mode == "error":
        where = f"row {row}: " if row is not None else ""
        raise ValueError(
            f"{where}prompt length {len(ids)} is longer than data.max_prompt_length={max_length} "
            "(set data.truncation to left|right|middle or data.filter_overlong_prompts=true)"
        )
    raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {mode!r}")


def read_parquet_rows(files: list[str]) -> list[dict]:
    import os

    import pyarrow.parquet as pq

    rows = []
    for path in files:
        local = os.path.expanduser(path)
        if not os.path.exists(local):
            raise FileNotFoundError(f"data file not found: {path}")
        rows.extend(pq.read_table(local).to_pylist())
    return rows


class RLDataset:
    """Prompts for RL steps. `data_config` is the config's `data` section as a plain dict;
    split is "train" (train_files, train_batch_size, shuffle, drop_last) or "val" (val_files,
    one batch of everything unless val_batch_size, validation_shuffle). `fallback_seed` is used
    when data.seed is null (pass trainer.seed)."""

    def __init__(self, data_config: dict, tokenizer, split: str = "train", fallback_seed: int = 0,
                 drop_last: bool | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        cfg = dict(data_config)
        self.split = split
        self.prompt_key = cfg.get("prompt_key", "prompt")
        self.reward_fn_key = cfg.get("reward_fn_key", "data_source")
        self.max_prompt_length = int(cfg.get("max_prompt_length", 512))
        self.truncation = cfg.get("truncation", "error")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {self.truncation!r}")
        self.filter_overlong = bool(cfg.get("filter_overlong_prompts", False))
        seed = cfg.get("seed")
        self.seed = int(fallback_seed if seed is None else seed)
        files_key = "train_files" if split == "train" else "val_files"
        self.files = _as_list(cfg.get(files_key))
        if not self.files:
            raise ValueError(f"data.{files_key} is empty")
        if split == "train":
            self.shuffle = bool(cfg.get("shuffle", True))
            self.drop_last = True if drop_last is None else bool(drop_last)
            max_samples = int(cfg.get("train_max_samples", -1) or -1)
        else:
            self.shuffle = bool(cfg.get("validation_shuffle", False))
            self.drop_last = False if drop_last is None else bool(drop_last)
            max_samples = int(cfg.get("val_max_samples", -1) or -1)
        template_kwargs = dict(cfg.get("apply_chat_template_kwargs") or {})

        records = read_parquet_rows(self.files)
        if 0 < max_samples < len(records):
            records = records[:max_samples]
        self.rows, self.filtered_count, self.truncated_count = self._prepare(
            records, tokenizer, template_kwargs)
        if not self.rows:
            raise ValueError(f"no prompts left in {self.files} (filtered {self.filtered_count} overlong)")

        if split == "train":
            self.batch_size = int(cfg.get("train_batch_size", 0))
        else:
            self.batch_size = int(cfg.get("val_batch_size") or len(self.rows))
        if self.batch_size <= 0:
            raise ValueError(f"batch size must be > 0, got {self.batch_size}")
        if self.drop_last and len(self.rows) < self.batch_size:
            raise ValueError(
                f"{len(self.rows)} prompts < batch size {self.batch_size} with drop_last: an epoch "
                "would have no step"
            )

    # -- loading -----------------------------------------------------------------------------

    def _prepare(self, records, tokenizer, template_kwargs):
        if records and self.prompt_key not in records[0]:
            raise KeyError(
                f"prompt column {self.prompt_key!r} (data.prompt_key) not in {self.files}; "
                f"columns: {sorted(records[0])}"
            )
        texts = []
        for number, record in enumerate(records):
            messages = record.get(self.prompt_key)
            if not messages or not all(isinstance(m, dict) and m.get("content") for m in messages):
                raise ValueError(f"row {number}: empty prompt (column {self.prompt_key!r}): {messages!r}")
            if self.reward_fn_key not in record:
                raise KeyError(f"row {number}: no {self.reward_fn_key!r} column (data.reward_fn_key)")
            texts.append(tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **template_kwargs))
        all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

        rows, filtered, truncated = [], 0, 0
        for number, (record, ids) in enumerate(zip(records, all_ids)):
            if len(ids) > self.max_prompt_length:
                if self.filter_overlong:
                    filtered += 1
                    continue
                ids = truncate_ids(ids, self.max_prompt_length, self.truncation, row=number)
                truncated += 1
            extra = dict(record.get("extra_info") or {})
            reward_model = record.get("reward_model") or {}
            rows.append(PromptRow(
                index=int(extra.get("index", number)),
                row=number,
                messages=[dict(m) for m in record[self.prompt_key]],
                prompt_ids=list(ids),
                data_source=str(record[self.reward_fn_key]),
                ground_truth=reward_model.get("ground_truth"),
                extra_info=extra,
                truncated=len(ids) != len(all_ids[number]),
            ))
        return rows, filtered, truncated

    def summary(self) -> str:
        return (
            f"{self.split} dataset: {len(self.rows)} prompts from {len(self.files)} file(s); "
            f"filtered {self.filtered_count} over max_prompt_length={self.max_prompt_length}, "
            f"truncated {self.truncated_count} ({self.truncation}); {self.steps_per_epoch} steps "
            f"per epoch of {self.batch_size}"
        )

    # -- batches -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return len(self.rows) // self.batch_size
        return math.ceil(len(self.rows) / self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """Row order of one epoch: a permutation seeded by (seed, epoch), or file order."""
        if not self.shuffle:
            return list(range(len(self.rows)))
        import numpy as np

        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows)).tolist()

    def position_for_step(self, global_step: int) -> DataPosition:
        if global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {global_step}")
        epoch, within = divmod(global_step, self.steps_per_epoch)
        return DataPosition(epoch, within * self.batch_size)

    def step_for_position(self, position: DataPosition) -> int:
        """The global step whose batch starts at `position` (a batch-aligned position)."""
        return position.epoch * self.steps_per_epoch + position.index // self.batch_size

    def batch_for_step(self, global_step: int) -> Batch:
        """The batch of step `global_step` (0 = first batch), as if read from the start."""
        batch = self.batch_at(self.position_for_step(global_step))
        batch.step = global_step
        return batch

    def batch_at(self, position: DataPosition | dict) -> Batch:
        """The batch starting at a saved position (a position at or past an epoch's usable end
        moves to the next epoch's start)."""
        if isinstance(position, dict):
            position = DataPosition.from_dict(position)
        epoch, start = position.epoch, position.index
        if start < 0 or epoch < 0:
            raise ValueError(f"invalid data position {position}")
        remaining = len(self.rows) - start
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            epoch, start = epoch + 1, 0
        order = self.epoch_order(epoch)
        chosen = order[start:start + self.batch_size]
        end = start + len(chosen)
        next_position = DataPosition(epoch, end)
        left = len(self.rows) - end
        if left <= 0 or (self.drop_last and left < self.batch_size):
            next_position = DataPosition(epoch + 1, 0)
        return Batch(
            step=None,
            epoch=epoch,
            position=DataPosition(epoch, start),
            next_position=next_position,
            rows=[self.rows[i] for i in chosen],
        )
