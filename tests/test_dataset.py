"""The RL prompt dataset (stages/dataset.py): verl's data.* keys, truncation, filtering, shuffling,
epochs and resumable positions."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.data_tools import make_arith_dataset, write_rows
from stages.dataset import DataPosition, RLDataset, truncate_ids
from stages.tiny_model import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def _arith(tmp_path, n=10, name="train.parquet", seed=0):
    return str(write_rows(make_arith_dataset(n, seed=seed, difficulty=2), tmp_path / name))


def _config(files, **overrides):
    config = {"train_files": files, "val_files": files, "prompt_key": "prompt",
              "reward_fn_key": "data_source", "max_prompt_length": 64, "truncation": "error",
              "filter_overlong_prompts": False, "shuffle": True, "seed": 1, "train_batch_size": 4}
    config.update(overrides)
    return config


def _templated(tokenizer, messages):
    encoding = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return encoding["input_ids"] if not isinstance(encoding, list) else encoding


def test_rows_carry_verl_fields_and_templated_ids(tmp_path, tokenizer):
    path = _arith(tmp_path, n=8)
    data = RLDataset(_config(path, shuffle=False), tokenizer)
    source = make_arith_dataset(8, seed=0, difficulty=2)
    batch = data.batch_for_step(0)
    assert [r.index for r in batch.rows] == [0, 1, 2, 3]
    for row, record in zip(batch.rows, source):
        assert row.messages == record["prompt"]
        assert row.prompt_ids == _templated(tokenizer, record["prompt"])
        assert row.data_source == "stagerl/arith"
        assert row.ground_truth == record["reward_model"]["ground_truth"]
        assert row.extra_info == record["extra_info"] and not row.truncated


def test_steps_per_epoch_and_drop_last(tmp_path, tokenizer):
    path = _arith(tmp_path, n=10)
    dropped = RLDataset(_config(path), tokenizer)
    assert dropped.steps_per_epoch == 2
    assert [len(dropped.batch_for_step(s).rows) for s in range(4)] == [4, 4, 4, 4]
    assert dropped.batch_for_step(2).epoch == 1
    kept = RLDataset(_config(path), tokenizer, drop_last=False)
    assert kept.steps_per_epoch == 3
    assert [len(kept.batch_for_step(s).rows) for s in range(4)] == [4, 4, 2, 4]
    with pytest.raises(ValueError, match="batch size 16"):
        RLDataset(_config(path, train_batch_size=16), tokenizer)


def test_truncation_modes(tmp_path, tokenizer):
    path = _arith(tmp_path, n=4)
    full = _templated(tokenizer, make_arith_dataset(4, seed=0, difficulty=2)[0]["prompt"])
    limit = 9
    assert len(full) > limit
    with pytest.raises(ValueError, match=rf"row 0: prompt length {len(full)} is longer than data.max_prompt_length=9"):
        RLDataset(_config(path, max_prompt_length=limit, shuffle=False), tokenizer)
    expected = {"left": full[-9:], "right": full[:9], "middle": full[:4] + full[-5:]}
    for mode, ids in expected.items():
        data = RLDataset(_config(path, max_prompt_length=limit, truncation=mode, shuffle=False), tokenizer)
        first = data.batch_for_step(0).rows[0]
        assert first.prompt_ids == ids and first.truncated, mode
        assert data.truncated_count == 4
    assert truncate_ids([1, 2, 3], 5, "error") == [1, 2, 3]
    with pytest.raises(ValueError, match="data.truncation"):
        RLDataset(_config(path, truncation="both"), tokenizer)


def test_filter_overlong_prompts(tmp_path, tokenizer):
    short = make_arith_dataset(6, seed=0, difficulty=1)
    long = make_arith_dataset(3, seed=0, difficulty=5)
    for row in long:
        row["prompt"][0]["content"] += " Please think about it step by step, then answer." * 3
    path = write_rows(short + long, tmp_path / "mixed.parquet")
    limit = max(len(_templated(tokenizer, r["prompt"])) for r in short)
    data = RLDataset(_config(str(path), max_prompt_length=limit, filter_overlong_prompts=True,
                             train_batch_size=2), tokenizer)
    assert len(data) == 6 and data.filtered_count == 3
    assert "filtered 3" in data.summary()
    assert all(len(r.prompt_ids) <= limit for r in data.rows)


def test_shuffle_is_deterministic_by_seed_and_epoch(tmp_path, tokenizer):
    path = _arith(tmp_path, n=12)

    def order(seed, steps=6):
        data = RLDataset(_config(path, seed=seed), tokenizer)
        return [[r.index for r in data.batch_for_step(s).rows] for s in range(steps)]

    first = order(1)
    assert first == order(1) and first != order(2)
    epoch0, epoch1 = sum(first[:3], []), sum(first[3:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12)) and epoch0 != epoch1
    unshuffled = RLDataset(_config(path, shuffle=False), tokenizer)
    assert [r.index for r in unshuffled.batch_for_step(4).rows] == [4, 5, 6, 7]
    # data.seed null falls back to the seed the caller passes (trainer.seed)
    fallback = RLDataset(_config(path, seed=None), tokenizer, fallback_seed=1)
    assert [r.index for r in fallback.batch_for_step(0).rows] == first[0]


def test_resume_from_saved_position_equals_uninterrupted_run(tmp_path, tokenizer):
    path = _arith(tmp_path, n=11)
    uninterrupted = RLDataset(_config(path, train_batch_size=3), tokenizer)
    expected = [[r.index for r in uninterrupted.batch_for_step(s).rows] for s in range(9)]

    position, seen = DataPosition(), []
    for step in range(4):  # run 4 steps, save the position as JSON, "crash"
        batch = RLDataset(_config(path, train_batch_size=3), tokenizer).batch_at(position)
        assert batch.position == uninterrupted.position_for_step(step)
        seen.append([r.index for r in batch.rows])
        position = batch.next_position
    saved = json.dumps(position.to_dict())

    resumed = RLDataset(_config(path, train_batch_size=3), tokenizer)
    position = DataPosition.from_dict(json.loads(saved))
    assert resumed.step_for_position(position) == 4
    for step in range(4, 9):
        batch = resumed.batch_at(position)
        assert batch.epoch == step // 3
        seen.append([r.index for r in batch.rows])
        position = batch.next_position
    assert seen == expected
    assert uninterrupted.batch_for_step(2).next_position == DataPosition(1, 0)


def test_several_files_and_val_split(tmp_path, tokenizer):
    a, b = _arith(tmp_path, n=5, name="a.parquet"), _arith(tmp_path, n=3, name="b.parquet", seed=9)
    data = RLDataset(_config([a, b], train_batch_size=2), tokenizer)
    assert len(data) == 8 and data.steps_per_epoch == 4
    val = RLDataset(_config(a), tokenizer, split="val")
    batch = val.batch_for_step(0)
    assert [r.index for r in batch.rows] == [0, 1, 2, 3, 4] and val.steps_per_epoch == 1


def test_bad_input_names_the_key_or_row(tmp_path, tokenizer):
    path = _arith(tmp_path, n=4)
    with pytest.raises(KeyError, match="'question'"):
        RLDataset(_config(path, prompt_key="question"), tokenizer)
    with pytest.raises(KeyError, match="row 0: no 'source'"):
        RLDataset(_config(path, reward_fn_key="source"), tokenizer)
    rows = make_arith_dataset(4, seed=0, difficulty=1)
    rows[2]["prompt"] = []
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="row 2: empty prompt"):
        RLDataset(_config(str(tmp_path / "empty.parquet")), tokenizer)
    with pytest.raises(FileNotFoundError, match="nowhere.parquet"):
        RLDataset(_config(str(tmp_path / "nowhere.parquet")), tokenizer)
