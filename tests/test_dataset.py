"""The RL prompt dataset (stages/data/dataset.py): verl's data.* keys, truncation, filtering, shuffling,
epochs and resumable positions; and its rows prepared once per key (stages/data/cache.py:
equal to the uncached dataset, kept in memory, read back from disk by a new process, rebuilt
when the files, settings or tokenizer change or the cache file is damaged)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.data import cache as dataset_cache
from stages.data.tools import make_arith_dataset, write_rows
from stages.data.dataset import DataPosition, RLDataset, truncate_ids
from stages.data.cache import DatasetCacheWarning, load_rl_dataset
from stages.model.tiny import train_tokenizer

REPO = Path(__file__).resolve().parents[1]


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
    path, limit = _mixed_file(tmp_path, tokenizer)
    data = RLDataset(_config(path, max_prompt_length=limit, filter_overlong_prompts=True,
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
    # an epoch's order is drawn once per process, not per step (at 100k prompts a draw costs more
    # than the rest of picking a batch: bench/dataset.py)
    assert fallback._order(1) is fallback._order(1) is RLDataset(_config(path, seed=1), tokenizer)._order(1)


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
    with pytest.raises(KeyError, match="train.parquet row 0: no 'source'"):
        RLDataset(_config(path, reward_fn_key="source"), tokenizer)
    rows = make_arith_dataset(4, seed=0, difficulty=1)
    rows[2]["prompt"] = []
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="empty.parquet row 2: empty prompt"):
        RLDataset(_config(str(tmp_path / "empty.parquet")), tokenizer)
    with pytest.raises(FileNotFoundError, match="nowhere.parquet"):
        RLDataset(_config(str(tmp_path / "nowhere.parquet")), tokenizer)


def test_hostile_rows_are_refused_naming_file_row_and_column(tmp_path, tokenizer):
    """Prompt content stored as bytes, a data_source that is bytes or not valid UTF-8: refused
    at load with the file and the row within it (the second of two files here)."""
    first = _arith(tmp_path, n=3, name="a.parquet")
    rows = make_arith_dataset(4, seed=0, difficulty=1)
    for row in rows:  # a binary column: every row's content is bytes
        row["prompt"] = [{"role": "user", "content": row["prompt"][0]["content"].encode()}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bytes.parquet")
    with pytest.raises(ValueError, match=r"bytes\.parquet row 0: message 0's content is bytes, not text"):
        RLDataset(_config([first, str(tmp_path / "bytes.parquet")]), tokenizer)
    rows = make_arith_dataset(4, seed=0, difficulty=1)
    table = pa.Table.from_pylist(rows)
    sources = pa.array([b"arith", b"arith", b"arith", b"ar\xffith"], pa.binary())
    pq.write_table(table.set_column(table.column_names.index("data_source"), "data_source",
                                    sources), tmp_path / "binary.parquet")
    with pytest.raises(ValueError, match=r"binary\.parquet row 0: column 'data_source' .* is bytes, not text"):
        RLDataset(_config([first, str(tmp_path / "binary.parquet")]), tokenizer)
    pq.write_table(table.set_column(table.column_names.index("data_source"), "data_source",
                                    sources.view(pa.string())), tmp_path / "utf8.parquet")
    with pytest.raises(ValueError, match=r"utf8\.parquet row 3: column 'data_source' is not valid "
                                         r"UTF-8 \(invalid start byte at byte 2\)"):
        RLDataset(_config([first, str(tmp_path / "utf8.parquet")]), tokenizer)


def test_rows_without_ground_truth_are_named(tmp_path, tokenizer, tokenizer_dir):
    """A null reward_model or reward_model.ground_truth: rows_without_ground_truth names them
    as FILE row K, from freshly prepared rows and from the disk cache alike; the training flow
    refuses them under the built-in scorers and warns with a reward function of the user's."""
    from flows.train import check_ground_truth
    from stages.data.files import rows_without_ground_truth

    first = _arith(tmp_path, n=3, name="a.parquet")
    rows = make_arith_dataset(4, seed=0, difficulty=1)
    rows[0]["reward_model"] = None
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    config = _config([first, str(tmp_path / "b.parquet")])
    fresh = RLDataset(config, tokenizer)
    second = tmp_path / "b.parquet"
    assert rows_without_ground_truth(fresh.files, fresh.rows) == [f"{second} row 0", f"{second} row 2"]
    load_rl_dataset(config, tokenizer_dir, cache_dir=tmp_path / "cache")
    dataset_cache.clear_memory_cache()
    cached = load_rl_dataset(config, tokenizer_dir, cache_dir=tmp_path / "cache")
    assert cached.cache_info["source"] == "disk"
    assert rows_without_ground_truth(cached.files, cached.rows) == [f"{second} row 0", f"{second} row 2"]
    cfg = {"custom_reward_function": {"path": None}, "reward_model": {"enable": False}}
    with pytest.raises(ValueError, match=rf"2 of 7 train prompts have no reward_model.ground_truth: "
                                         rf"{second} row 0; {second} row 2\. The built-in scorers"):
        check_ground_truth(cfg, cached)
    check_ground_truth({**cfg, "custom_reward_function": {"path": "my_reward.py"}}, cached)  # a warning


# -- load_rl_dataset: rows prepared once per key (stages/data/cache.py) ------------------------


@pytest.fixture(autouse=True)
def _fresh_process_memory():
    """Every test starts as a new process would: nothing prepared in memory."""
    dataset_cache.clear_memory_cache()
    yield
    dataset_cache.clear_memory_cache()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


class CountingTokenizer:
    """A real tokenizer that counts the calls that template or tokenise."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.real.apply_chat_template(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _mixed_file(tmp_path, tokenizer):
    """6 short prompts then 3 long ones; returns (path, length of the longest short prompt)."""
    short = make_arith_dataset(6, seed=0, difficulty=1)
    long = make_arith_dataset(3, seed=0, difficulty=5)
    for row in long:
        row["prompt"][0]["content"] += " Please think about it step by step, then answer." * 3
    path = write_rows(short + long, tmp_path / "mixed.parquet")
    return str(path), max(len(_templated(tokenizer, r["prompt"])) for r in short)


def _assert_same_dataset(cached, plain, steps=7):
    assert cached.rows == plain.rows and len(cached) == len(plain)
    assert [r.prompt_ids for r in cached.rows] == [r.prompt_ids for r in plain.rows]
    assert (cached.filtered_count, cached.truncated_count) == (plain.filtered_count, plain.truncated_count)
    assert (cached.steps_per_epoch, cached.batch_size, cached.seed, cached.shuffle) == \
        (plain.steps_per_epoch, plain.batch_size, plain.seed, plain.shuffle)
    assert cached.epoch_order(1) == plain.epoch_order(1)
    for step in range(steps):
        ours, theirs = cached.batch_for_step(step), plain.batch_for_step(step)
        assert ours.rows == theirs.rows and ours.epoch == theirs.epoch
        assert (ours.position, ours.next_position) == (theirs.position, theirs.next_position)
        assert cached.position_for_step(step) == plain.position_for_step(step)
        assert cached.batch_at(ours.next_position).rows == plain.batch_at(theirs.next_position).rows


@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("setting", ["plain", "filter", "truncate"])
def test_cached_dataset_equals_uncached(tmp_path, tokenizer, tokenizer_dir, split, setting):
    path, short = _mixed_file(tmp_path, tokenizer)
    overrides = {"plain": {"max_prompt_length": 200},
                 "filter": {"max_prompt_length": short, "filter_overlong_prompts": True},
                 "truncate": {"max_prompt_length": short, "truncation": "middle"}}[setting]
    config = _config(path, train_batch_size=2, val_batch_size=4, validation_shuffle=True, **overrides)
    plain = RLDataset(config, tokenizer, split=split, fallback_seed=5)
    expected = {"plain": (9, 0, 0), "filter": (6, 3, 0), "truncate": (9, 0, 3)}[setting]
    assert (len(plain), plain.filtered_count, plain.truncated_count) == expected
    sources = []
    for _ in range(2):  # built, then read back from disk by a process that has nothing in memory
        cached = load_rl_dataset(config, tokenizer_dir, split, fallback_seed=5, cache_dir=tmp_path / "cache")
        sources.append(cached.cache_info["source"])
        _assert_same_dataset(cached, plain)
        assert cached.rows[-1] == plain.rows[-1] and cached.rows[1:3] == plain.rows[1:3]
        dataset_cache.clear_memory_cache()
    assert sources == ["built", "disk"]


def test_second_call_in_a_process_does_not_tokenise(tmp_path, tokenizer, tokenizer_dir):
    path = _arith(tmp_path, n=10)
    counting = CountingTokenizer(tokenizer)
    first = load_rl_dataset(_config(path), tokenizer_dir, cache_dir=tmp_path / "cache", tokenizer=counting)
    assert counting.calls == 11  # one chat template per row, then one batched tokenisation
    # batch-level keys choose among the same rows: same key, nothing tokenised again
    again = load_rl_dataset(_config(path, train_batch_size=5, shuffle=False, seed=7), tokenizer_dir,
                            cache_dir=tmp_path / "cache", tokenizer=counting)
    assert counting.calls == 11 and again.cache_info["source"] == "memory"
    assert again.cache_info["key"] == first.cache_info["key"]
    assert [r.index for r in again.batch_for_step(1).rows] == [5, 6, 7, 8, 9]
    # the next step's weights folder carries a copy of the same tokenizer: same key
    copy = shutil.copytree(tokenizer_dir, tmp_path / "weights_step_1")
    (copy / "model.safetensors").write_bytes(b"other weights")
    moved = load_rl_dataset(_config(path), copy, cache_dir=tmp_path / "cache", tokenizer=counting)
    assert counting.calls == 11 and moved.cache_info["key"] == first.cache_info["key"]
    # a touched data file (new mtime, same content) keeps its key
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    touched = load_rl_dataset(_config(path), tokenizer_dir, tokenizer=counting)
    assert counting.calls == 11 and touched.cache_info["key"] == first.cache_info["key"]


_CHILD = """
import json, sys
from stages.data.cache import load_rl_dataset
config, tokenizer_dir, cache_dir = json.loads(sys.argv[1])
data = load_rl_dataset(config, tokenizer_dir, "train", 0, cache_dir=cache_dir)
print(json.dumps({"source": data.cache_info["source"], "transformers": "transformers" in sys.modules,
                  "batches": [[r.prompt_ids for r in data.batch_for_step(s).rows] for s in range(4)]}))
"""


def test_new_process_reads_the_disk_cache_without_tokenising(tmp_path, tokenizer, tokenizer_dir):
    path = _arith(tmp_path, n=10)
    config = _config(path, train_batch_size=3)
    built = load_rl_dataset(config, tokenizer_dir, cache_dir=tmp_path / "cache")
    assert built.cache_info["source"] == "built"
    args = json.dumps([config, str(tokenizer_dir), str(tmp_path / "cache")])
    out = subprocess.run([sys.executable, "-c", _CHILD, args], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["source"] == "disk" and child["transformers"] is False  # no tokenizer was loaded
    plain = RLDataset(config, tokenizer)
    assert child["batches"] == [[r.prompt_ids for r in plain.batch_for_step(s).rows] for s in range(4)]


def test_edited_data_file_or_max_prompt_length_gives_new_rows(tmp_path, tokenizer, tokenizer_dir):
    path = _arith(tmp_path, n=10)
    cache = tmp_path / "cache"
    first = load_rl_dataset(_config(path), tokenizer_dir, cache_dir=cache)
    _arith(tmp_path, n=12, seed=3)  # the same file name, new content
    edited = load_rl_dataset(_config(path), tokenizer_dir, cache_dir=cache)
    assert edited.cache_info["source"] == "built" and edited.cache_info["key"] != first.cache_info["key"]
    assert len(edited) == 12 and edited.rows == RLDataset(_config(path), tokenizer).rows
    full = _templated(tokenizer, make_arith_dataset(12, seed=3, difficulty=2)[0]["prompt"])
    shorter = load_rl_dataset(_config(path, max_prompt_length=9, truncation="left", shuffle=False),
                              tokenizer_dir, cache_dir=cache)
    assert shorter.cache_info["source"] == "built"
    assert shorter.cache_info["key"] not in (first.cache_info["key"], edited.cache_info["key"])
    assert shorter.rows[0].prompt_ids == full[-9:] and shorter.truncated_count == 12
    assert len(list((cache / "datasets").glob("*.arrow"))) == 3


def test_tokenizer_saved_again_keeps_the_key(tmp_path, tokenizer, tokenizer_dir):
    """Every step's weights folder holds the tokenizer loaded from the model folder and saved again
    (stages.training.engine.export_hf), whose tokenizer_config.json gains the loader's is_local and
    local_files_only: the same rows, no second preparation at step 2. A key that changes how it
    tokenises still changes the key."""
    from transformers import AutoTokenizer

    dataset_cache.clear_memory_cache()
    path = _arith(tmp_path, n=6)
    counting = CountingTokenizer(tokenizer)
    first = load_rl_dataset(_config(path), tokenizer_dir, tokenizer=counting)
    assert first.cache_info["source"] == "built" and counting.calls == 7
    saved = tmp_path / "weights_step_1"
    AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(str(saved))
    written = json.loads((saved / "tokenizer_config.json").read_text())
    assert written.get("is_local") is True and "is_local" not in json.loads(
        (Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    again = load_rl_dataset(_config(path), saved, tokenizer=counting)
    assert again.cache_info["source"] == "memory" and again.cache_info["key"] == first.cache_info["key"]
    assert counting.calls == 7
    written["model_max_length"] = 7
    (saved / "tokenizer_config.json").write_text(json.dumps(written))
    changed = load_rl_dataset(_config(path), saved)
    assert changed.cache_info["source"] == "built" and changed.cache_info["key"] != first.cache_info["key"]


def test_changed_tokenizer_file_changes_the_key(tmp_path, tokenizer, tokenizer_dir):
    path = _arith(tmp_path, n=4)
    first = load_rl_dataset(_config(path, shuffle=False), tokenizer_dir, cache_dir=tmp_path / "cache")
    changed = shutil.copytree(tokenizer_dir, tmp_path / "changed")
    template = changed / "chat_template.jinja"
    template.write_text("{{- '<|im_start|>system\nBe brief.<|im_end|>\n' }}" + template.read_text())
    other = load_rl_dataset(_config(path, shuffle=False), changed, cache_dir=tmp_path / "cache")
    assert other.cache_info["source"] == "built" and other.cache_info["key"] != first.cache_info["key"]
    system = tokenizer("<|im_start|>system\nBe brief.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert other.rows[0].prompt_ids == system + first.rows[0].prompt_ids


@pytest.mark.parametrize("damage", ["flipped bytes", "truncated", "no data file", "bad manifest"])
def test_corrupt_cache_entry_is_rebuilt(tmp_path, tokenizer, tokenizer_dir, damage):
    path = _arith(tmp_path, n=10)
    cache = tmp_path / "cache"
    built = load_rl_dataset(_config(path), tokenizer_dir, cache_dir=cache)
    arrow = Path(built.cache_info["path"])
    manifest = cache / "datasets" / f"{built.cache_info['key']}.json"
    data = arrow.read_bytes()
    if damage == "flipped bytes":
        middle = len(data) // 2
        flipped = bytes(b ^ 0xFF for b in data[middle:middle + 8])
        arrow.write_bytes(data[:middle] + flipped + data[middle + 8:])
    elif damage == "truncated":
        arrow.write_bytes(data[:len(data) // 3])
    elif damage == "no data file":
        arrow.unlink()
    else:
        manifest.write_text('{"format": 1, "fi')
    dataset_cache.clear_memory_cache()
    with pytest.warns(DatasetCacheWarning, match="unusable, rebuilding"):
        rebuilt = load_rl_dataset(_config(path), tokenizer_dir, cache_dir=cache)
    assert rebuilt.cache_info["source"] == "built" and rebuilt.rows == built.rows
    assert arrow.read_bytes() == data  # the entry is whole again
    dataset_cache.clear_memory_cache()
    assert load_rl_dataset(_config(path), tokenizer_dir, cache_dir=cache).cache_info["source"] == "disk"


def test_rows_that_json_cannot_hold_stay_in_memory(tmp_path, tokenizer, tokenizer_dir):
    rows = make_arith_dataset(4, seed=0, difficulty=1)
    for row in rows:
        row["extra_info"]["raw"] = b"\x00\x01"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bytes.parquet")
    config = _config(str(tmp_path / "bytes.parquet"))
    with pytest.warns(DatasetCacheWarning, match="row 0: extra_info is not JSON"):
        data = load_rl_dataset(config, tokenizer_dir, cache_dir=tmp_path / "cache")
    assert data.cache_info["path"] is None and not (tmp_path / "cache" / "datasets").exists()
    assert data.rows == RLDataset(config, tokenizer).rows
    assert data.rows[2].extra_info["raw"] == b"\x00\x01"
    again = load_rl_dataset(config, tokenizer_dir, cache_dir=tmp_path / "cache")
    assert again.cache_info["source"] == "memory"


def test_cache_bad_input_names_the_file_or_folder(tmp_path, tokenizer_dir):
    path = _arith(tmp_path, n=4)
    with pytest.raises(FileNotFoundError, match="data file not found: .*nowhere.parquet"):
        load_rl_dataset(_config(str(tmp_path / "nowhere.parquet")), tokenizer_dir)
    with pytest.raises(FileNotFoundError, match="tokenizer folder not found: .*no_model"):
        load_rl_dataset(_config(path), tmp_path / "no_model")
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="no tokenizer files .* in .*weights_only"):
        load_rl_dataset(_config(path), tmp_path / "weights_only")
    with pytest.raises(ValueError, match="data.val_files is empty"):
        load_rl_dataset(_config(path, val_files=[]), tokenizer_dir, split="val")


def test_custom_chat_template_replaces_the_tokenizers(tmp_path, tokenizer, tokenizer_dir):
    """actor_rollout_ref.model.custom_chat_template (verl sets it as tokenizer.chat_template): the
    prompts are templated with it, in the plain and the cached dataset, and it is part of the
    cache key; the training flow's loader passes it from the config."""
    from configs.loader import load_config
    from flows.train import load_dataset
    from storage.store import Store

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    path = _arith(tmp_path, n=4)
    first = make_arith_dataset(4, seed=0, difficulty=2)[0]["prompt"][0]["content"]
    expected = tokenizer(f"[user] {first}\n[assistant] ", add_special_tokens=False)["input_ids"]
    plain = RLDataset(_config(path, shuffle=False), tokenizer, chat_template=template)
    assert plain.rows[0].prompt_ids == expected
    cached = load_rl_dataset(_config(path, shuffle=False), tokenizer_dir, chat_template=template)
    default = load_rl_dataset(_config(path, shuffle=False), tokenizer_dir)
    assert cached.rows[0].prompt_ids == expected != default.rows[0].prompt_ids
    assert cached.cache_info["key"] != default.cache_info["key"]
    cfg = load_config("tiny-cpu", [f"data.train_files={path}", f"actor_rollout_ref.model.path={tokenizer_dir}",
                                   "data.shuffle=false", f"storage.root={tmp_path / 'runs'}"])
    cfg["actor_rollout_ref"]["model"]["custom_chat_template"] = template
    cfg["data"]["train_batch_size"] = 2
    assert load_dataset(cfg, Store.from_config(cfg["storage"])).rows[0].prompt_ids == expected
