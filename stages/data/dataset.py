"""The RL prompt dataset, with verl's `data.*` keys (verl: verl/utils/dataset/rl_dataset.py).

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

Preparing the rows (reading, templating, tokenising) is what costs, and it depends only on a
`RowSpec` and the tokenizer; `RLDataset.from_prepared` builds a dataset from rows prepared once
(stages/data/cache.py keeps them per process and on disk, so a step only pays for its batch).
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from stages.data.files import (GROUND_TRUTH_REFUSED, ground_truth_problem, read_parquet_records,
                                refuse_records)

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
    agent_name: str = ""  # verl's agent_name column (tool_agent, single_turn_agent); "" when absent


@dataclass
class Batch:
    step: int | None
    epoch: int
    position: DataPosition  # where this batch starts
    next_position: DataPosition  # where the following batch starts (save this after the step)
    rows: list[PromptRow]


@dataclass(frozen=True)
class RowSpec:
    """The data.* settings of one split that decide its prepared rows (not how they are batched:
    batch size, shuffle and seed only choose among the same rows)."""
    files: tuple[str, ...]
    prompt_key: str
    reward_fn_key: str
    max_prompt_length: int
    truncation: str
    filter_overlong: bool
    template_kwargs: dict
    max_samples: int  # train_max_samples or val_max_samples; -1: all rows
    trust_remote_code: bool  # how the tokenizer is loaded when one has to be
    chat_template: str | None = None  # actor_rollout_ref.model.custom_chat_template (None: the tokenizer's)
    # data.tool_config_path's tool schemas as JSON text (their order kept), given to the chat
    # template as `tools=` (verl: RLHFDataset and the agent loops); None: no tools
    tool_schemas: str | None = None

    @classmethod
    def from_config(cls, data_config: dict, split: str, chat_template: str | None = None) -> "RowSpec":
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        cfg = data_config
        truncation = cfg.get("truncation", "error")
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        files_key = "train_files" if split == "train" else "val_files"
        files = tuple(_as_list(cfg.get(files_key)))
        if not files:
            raise ValueError(f"data.{files_key} is empty")
        samples_key = "train_max_samples" if split == "train" else "val_max_samples"
        return cls(files=files, prompt_key=cfg.get("prompt_key", "prompt"),
                   reward_fn_key=cfg.get("reward_fn_key", "data_source"),
                   max_prompt_length=int(cfg.get("max_prompt_length", 512)), truncation=truncation,
                   filter_overlong=bool(cfg.get("filter_overlong_prompts", False)),
                   template_kwargs=dict(cfg.get("apply_chat_template_kwargs") or {}),
                   max_samples=int(cfg.get(samples_key, -1) or -1),
                   trust_remote_code=bool(cfg.get("trust_remote_code", False)), chat_template=chat_template,
                   tool_schemas=tool_schemas_json(cfg.get("tool_config_path")))

    def key_fields(self) -> dict:
        """Everything but the file names: a cache keys on the files' contents instead."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "files"}


@dataclass
class PreparedRows:
    """What preparing a split produces. `rows` is a list, or a read-only sequence decoding a
    cache file on demand; datasets built from it share it, so it must not be mutated."""
    rows: Sequence
    filtered_count: int
    truncated_count: int


def tool_schemas_json(path) -> str | None:
    """The OpenAI tool schemas of a verl tool config YAML as JSON text (None for no path): what the
    chat template's `tools=` gets. Each tool's class is built once to read its schema (a config
    naming no schema uses the tool's own), as verl's initialize_tools_from_config does."""
    if not path:
        return None
    import os

    path = os.path.abspath(os.path.expanduser(str(path)))
    try:
        st = os.stat(path)
    except OSError as err:
        raise FileNotFoundError(f"data.tool_config_path={path}: {err.strerror}") from None
    return _tool_schemas(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _tool_schemas(path: str, mtime_ns: int, size: int) -> str:
    from stages.tools.registry import build_tools, read_tool_config

    tools = build_tools(read_tool_config(path))
    return json.dumps([tool.tool_schema.model_dump() for tool in tools.values()], ensure_ascii=False)


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


def prepare_rows(spec: RowSpec, tokenizer) -> PreparedRows:
    """Read the spec's files, apply the chat template (add_generation_prompt=True), tokenise,
    then filter or truncate the overlong prompts. A row that cannot be used is refused naming its
    file and row."""
    records, where = read_parquet_records(list(spec.files))
    if 0 < spec.max_samples < len(records):
        records = records[:spec.max_samples]
    refuse_records(records, where, spec.prompt_key, spec.reward_fn_key, spec.files)
    texts = []
    tools = {"tools": json.loads(spec.tool_schemas)} if spec.tool_schemas else {}
    for record in records:
        texts.append(tokenizer.apply_chat_template(
            record[spec.prompt_key], add_generation_prompt=True, tokenize=False,
            **({"chat_template": spec.chat_template} if spec.chat_template else {}), **tools, **spec.template_kwargs))
    all_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

    rows, filtered, truncated = [], 0, 0
    for number, (record, ids) in enumerate(zip(records, all_ids)):
        if len(ids) > spec.max_prompt_length:
            if spec.filter_overlong:
                filtered += 1
                continue
            ids = truncate_ids(ids, spec.max_prompt_length, spec.truncation, row=number)
            truncated += 1
        extra = dict(record.get("extra_info") or {})
        reward_model = record.get("reward_model") or {}
        rows.append(PromptRow(
            index=int(extra.get("index", number)),
            row=number,
            messages=[dict(m) for m in record[spec.prompt_key]],
            prompt_ids=list(ids),
            data_source=record[spec.reward_fn_key],
            ground_truth=reward_model.get("ground_truth"),
            extra_info=extra,
            truncated=len(ids) != len(all_ids[number]),
            agent_name=str(record.get("agent_name") or ""),
        ))
    return PreparedRows(rows, filtered, truncated)


def check_dataset_rows(cfg: dict) -> None:
    """Refuse, before a run writes or starts anything, the first train (and, when the run
    validates, validation) row it could not use, naming its file, row and column: the checks
    prepare_rows makes, and under the built-in scorers a null reward_model.ground_truth (the
    training flow's check_ground_truth; with data.filter_overlong_prompts it is left to the flow,
    which counts the rows left after the filter). Reads each file's rows once (pyarrow), loads no
    tokenizer and writes nothing. Raises ValueError or KeyError."""
    trainer = cfg["trainer"]
    splits = ["train"] + (["val"] if trainer["val_before_train"] or trainer["test_freq"] > 0 else [])
    own_scorer = bool(cfg["custom_reward_function"].get("path") or cfg["reward_model"].get("enable"))
    for split in splits:
        spec = RowSpec.from_config(cfg["data"], split)
        records, where = read_parquet_records(list(spec.files))
        if 0 < spec.max_samples < len(records):
            records = records[:spec.max_samples]
        refuse_records(records, where, spec.prompt_key, spec.reward_fn_key, spec.files)
        if own_scorer or spec.filter_overlong:
            continue
        missing = [where(n) for n, r in enumerate(records) if (r.get("reward_model") or {}).get("ground_truth") is None]
        if missing:
            raise ValueError(f"{ground_truth_problem(missing, len(records), split)}. {GROUND_TRUTH_REFUSED}")


@functools.lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int):
    """An epoch's shuffled order, computed once per process: at 100k prompts drawing it costs
    more than everything else a step does to pick its batch."""
    import numpy as np

    order = np.random.default_rng([seed, epoch]).permutation(n)
    order.flags.writeable = False
    return order


class RLDataset:
    """Prompts for RL steps. `data_config` is the config's `data` section as a plain dict;
    split is "train" (train_files, train_batch_size, shuffle, drop_last) or "val" (val_files,
    one batch of everything unless val_batch_size, validation_shuffle). `fallback_seed` is used
    when data.seed is null (pass trainer.seed)."""

    def __init__(self, data_config: dict, tokenizer, split: str = "train", fallback_seed: int = 0,
                 drop_last: bool | None = None, chat_template: str | None = None):
        self._configure(data_config, split, fallback_seed, drop_last, chat_template)
        self._adopt(prepare_rows(self.spec, tokenizer))

    @classmethod
    def from_prepared(cls, data_config: dict, prepared: PreparedRows, split: str = "train",
                      fallback_seed: int = 0, drop_last: bool | None = None,
                      chat_template: str | None = None) -> "RLDataset":
        """The dataset `RLDataset(data_config, tokenizer, ...)` would be, from rows prepared
        earlier with the same RowSpec and tokenizer (the caller vouches for that)."""
        dataset = cls.__new__(cls)
        dataset._configure(data_config, split, fallback_seed, drop_last, chat_template)
        dataset._adopt(prepared)
        return dataset

    # -- loading -----------------------------------------------------------------------------

    def _configure(self, data_config: dict, split: str, fallback_seed: int, drop_last, chat_template=None):
        cfg = dict(data_config)
        self.spec = RowSpec.from_config(cfg, split, chat_template)
        self.split = split
        self.prompt_key = self.spec.prompt_key
        self.reward_fn_key = self.spec.reward_fn_key
        self.max_prompt_length = self.spec.max_prompt_length
        self.truncation = self.spec.truncation
        self.filter_overlong = self.spec.filter_overlong
        seed = cfg.get("seed")
        self.seed = int(fallback_seed if seed is None else seed)
        self.files = list(self.spec.files)
        if split == "train":
            self.shuffle = bool(cfg.get("shuffle", True))
            self.drop_last = True if drop_last is None else bool(drop_last)
            self._batch_setting = int(cfg.get("train_batch_size", 0))
        else:
            self.shuffle = bool(cfg.get("validation_shuffle", False))
            self.drop_last = False if drop_last is None else bool(drop_last)
            self._batch_setting = cfg.get("val_batch_size")
        self.cache_info = None  # set by stages.data.cache.load_rl_dataset

    def _adopt(self, prepared: PreparedRows):
        self.rows = prepared.rows
        self.filtered_count, self.truncated_count = prepared.filtered_count, prepared.truncated_count
        if not len(self.rows):
            raise ValueError(f"no prompts left in {self.files} (filtered {self.filtered_count} overlong)")
        if self.split == "train":
            self.batch_size = self._batch_setting
        else:
            self.batch_size = int(self._batch_setting or len(self.rows))
        if self.batch_size <= 0:
            raise ValueError(f"batch size must be > 0, got {self.batch_size}")
        if self.drop_last and len(self.rows) < self.batch_size:
            raise ValueError(
                f"{len(self.rows)} prompts < batch size {self.batch_size} with drop_last: an epoch "
                "would have no step"
            )

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
        order = self._order(epoch)
        return list(order) if isinstance(order, range) else order.tolist()

    def _order(self, epoch: int):
        if not self.shuffle:
            return range(len(self.rows))
        return _permutation(len(self.rows), self.seed, epoch)

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
        chosen = [int(i) for i in self._order(epoch)[start:start + self.batch_size]]
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
            rows=_pick(self.rows, chosen),
        )


def _pick(rows, indices: list[int]) -> list:
    """rows[i] for each index; a lazily decoded sequence decodes them in one go (`take`)."""
    take = getattr(rows, "take", None)
    return take(indices) if take is not None else [rows[i] for i in indices]
