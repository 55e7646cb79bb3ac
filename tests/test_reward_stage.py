"""reward stage over storage: built-in scorers, custom functions that raise or hang, strict mode,
NaN refusal, and a tiny reward model whose batched score is added."""
import json
import textwrap

import pytest

from stages import reward as reward_stage
from stages.scoring.reward_fns import RewardScoringError
from storage.artifacts import read_manifest, read_table
from tests._stage_tables import make_ctx, write_rollout

CUSTOM = textwrap.dedent('''
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        if ground_truth == "boom":
            raise ValueError(f"cannot score row {extra_info['index']}")
        if ground_truth == "hang":
            time.sleep(120)
        correct = solution_str.strip() == ground_truth
        return {"score": 2.0 if correct else 0.5, "acc": correct, "length": len(solution_str)}
''')


@pytest.fixture
def custom_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return str(path)


def test_builtin_scorers_by_data_source(tmp_path):
    ctx = make_ctx(tmp_path / "store")
    responses = ["3 + 4 = 7", "the answer is 8", "", "so #### 72", "#### 72.", "#### 7 then #### 72"]
    sources = ["stagerl/arith"] * 3 + ["openai/gsm8k"] * 3
    write_rollout(ctx, responses, ["7", "7", "7", "72", "72", "72"], data_source=sources)
    manifest = reward_stage.run(ctx)
    table = read_table(ctx.store, ctx.layout, 1, "reward")
    assert table.column("score").to_pylist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert table.column("acc").to_pylist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert table.column("error").to_pylist() == [None] * 6
    metrics = manifest["extra"]["metrics"]
    assert metrics["reward/score/mean"] == pytest.approx(0.5)
    assert (metrics["reward/errors"], metrics["reward/timeouts"], metrics["reward/rows"]) == (0, 0, 6)
    assert manifest["row_count"] == 6
    assert manifest["inputs"]["rollout"] == read_manifest(ctx.store, ctx.layout, 1, "rollout")["fingerprint"]


def test_unknown_data_source_is_an_error_row_and_unknown_key_is_refused(tmp_path):
    ctx = make_ctx(tmp_path / "store")
    write_rollout(ctx, ["7"] * 6, ["7"] * 6, data_source=["stagerl/arith"] * 5 + ["my/task"])
    reward_stage.run(ctx)
    table = read_table(ctx.store, ctx.layout, 1, "reward")
    assert "no reward scorer for data_source='my/task'" in table.column("error")[5].as_py()
    assert table.column("score").to_pylist() == [1.0] * 5 + [0.0]

    ctx.cfg["data"]["reward_fn_key"] = "task_name"
    with pytest.raises(reward_stage.RewardInputError, match="data.reward_fn_key='task_name'"):
        reward_stage.run(ctx)


def test_custom_function_that_raises_or_hangs(tmp_path, custom_file):
    ctx = make_ctx(tmp_path / "store", [f"custom_reward_function.path={custom_file}",
                                        "reward.timeout_s=3"])
    truths = ["7", "boom", "8", "hang", "9", "boom"]
    write_rollout(ctx, ["7", "x", "0", "x", "9", "x"], truths)
    manifest = reward_stage.run(ctx)
    table = read_table(ctx.store, ctx.layout, 1, "reward")
    assert table.num_rows == 6
    assert table.column("score").to_pylist() == [2.0, 0.0, 0.5, 0.0, 2.0, 0.0]
    assert table.column("acc").to_pylist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    errors = table.column("error").to_pylist()
    assert errors[0] is None and errors[2] is None and errors[4] is None
    assert errors[1].startswith("ValueError: cannot score row 1") and "my_reward.py" in errors[1]
    assert errors[5].startswith("ValueError: cannot score row 5")
    assert errors[3].startswith("timeout: scoring took longer than 3.0s")
    metrics = manifest["extra"]["metrics"]
    assert (metrics["reward/errors"], metrics["reward/timeouts"]) == (2.0, 1.0)
    assert metrics["reward/score/mean"] == pytest.approx(4.5 / 6)
    # the function's other keys: an extras JSON column and a column of their own
    assert json.loads(table.column("extras")[2].as_py()) == {"length": 1}
    assert table.column("length").to_pylist() == [1, None, 1, None, 1, None]
    # the fingerprint covers the reward file's content: editing it makes the stage stale
    assert manifest["fingerprint"] == reward_stage.stage_fingerprint(ctx)
    with open(custom_file, "a") as f:
        f.write("\n# edited\n")
    assert manifest["fingerprint"] != reward_stage.stage_fingerprint(ctx)


def test_strict_mode_fails_the_stage_without_a_manifest(tmp_path, custom_file):
    ctx = make_ctx(tmp_path / "store", [f"custom_reward_function.path={custom_file}",
                                        "reward.strict=true"])
    write_rollout(ctx, ["7"] * 6, ["7", "7", "boom", "7", "7", "7"])
    with pytest.raises(RewardScoringError, match="row 2"):
        reward_stage.run(ctx)
    assert read_manifest(ctx.store, ctx.layout, 1, "reward") is None


def test_missing_custom_function_is_refused(tmp_path, custom_file):
    ctx = make_ctx(tmp_path / "store", [f"custom_reward_function.path={custom_file}",
                                        "custom_reward_function.name=score_it"])
    write_rollout(ctx, ["7"] * 6, ["7"] * 6)
    with pytest.raises(LookupError, match="'score_it' not found.*compute_score"):
        reward_stage.run(ctx)


# ---- reward model ---------------------------------------------------------------------------
def save_tiny_reward_model(folder, nan_token=None):
    """A Qwen2ForSequenceClassification (num_labels=1) with the tiny BPE tokenizer; with
    nan_token, that token's embedding is NaN so every text containing it scores NaN."""
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from stages.model.tiny import ENDOFTEXT, train_tokenizer

    tokenizer = train_tokenizer(512)
    pad = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, num_labels=1, pad_token_id=pad, initializer_range=0.3,
                         use_sliding_window=False)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    if nan_token is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(nan_token)] = float("nan")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def test_reward_model_score_is_added_and_batched_like_single_rows(tmp_path):
    import torch

    folder = tmp_path / "rm"
    model, tokenizer = save_tiny_reward_model(folder)
    ctx = make_ctx(tmp_path / "store", ["reward_model.enable=true", f"reward_model.model.path={folder}",
                                        "reward_model.micro_batch_size_per_gpu=4"])
    responses = ["7", "the answer is 8", "3 + 4 = 7 so 7", "no", "9", "1 2 3 4 5 6 7"]
    write_rollout(ctx, responses, ["7", "7", "7", "9", "9", "7"])
    manifest = reward_stage.run(ctx)
    table = read_table(ctx.store, ctx.layout, 1, "reward")
    rule = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    prompt = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    with torch.no_grad():  # each row alone, no padding: what batching with padding must equal
        expected_rm = [model(input_ids=torch.tensor([tokenizer(prompt + r, add_special_tokens=False)
                                                     ["input_ids"]])).logits[0, 0].item()
                       for r in responses]
    assert len(set(round(v, 4) for v in expected_rm)) == 6  # the texts really score differently
    assert table.column("rm_score").to_pylist() == pytest.approx(expected_rm, abs=1e-5)
    assert table.column("score").to_pylist() == pytest.approx(
        [r + m for r, m in zip(rule, expected_rm)], abs=1e-5)
    assert manifest["extra"]["metrics"]["reward/rm_score/mean"] == pytest.approx(
        sum(expected_rm) / 6, abs=1e-5)
    assert "reward_model_s" in manifest["timings"]


def test_nan_score_is_refused_naming_the_rows(tmp_path):
    folder = tmp_path / "rm"
    save_tiny_reward_model(folder, nan_token="9")
    ctx = make_ctx(tmp_path / "store", ["reward_model.enable=true", f"reward_model.model.path={folder}",
                                        "reward_model.micro_batch_size_per_gpu=6"])
    write_rollout(ctx, ["7", "9", "8", "8", "answer 9", "7"], ["7"] * 6)
    with pytest.raises(reward_stage.NonFiniteScoreError, match=r"2 row\(s\): rows 1, 4$"):
        reward_stage.run(ctx)
    assert read_manifest(ctx.store, ctx.layout, 1, "reward") is None


def test_scoring_rows_parse_each_extra_info_text_once_and_give_every_row_its_own_dict():
    """The n samples of a prompt share its extra_info text: a flat dict is parsed once and each
    row gets a copy (a reward function that changes its dict changes no other row's); a nested
    one, whose inner objects a copy would share, is parsed for every row."""
    import pyarrow as pa

    flat, nested = json.dumps({"index": 3, "split": "train"}), json.dumps({"index": 4, "tools": {"a": [1]}})
    texts = [flat, flat, flat, nested, nested, None, ""]
    rollout = pa.table({"data_source": ["s"] * 7, "response": ["r"] * 7, "ground_truth": ["1"] * 7,
                        "extra_info": texts})
    rows = reward_stage.scoring_rows(rollout, "data_source")
    infos = [r["extra_info"] for r in rows]
    assert infos == [{"index": 3, "split": "train"}] * 3 + [{"index": 4, "tools": {"a": [1]}}] * 2 + [None, None]
    infos[0]["index"] = 99  # what a function changing its extra_info does
    infos[3]["tools"]["a"].append(2)
    assert infos[1] == infos[2] == {"index": 3, "split": "train"}
    assert infos[4] == {"index": 4, "tools": {"a": [1]}}
    with pytest.raises(reward_stage.RewardInputError, match="row 1: extra_info is not valid JSON"):
        reward_stage.scoring_rows(pa.table({"data_source": ["s"] * 2, "response": ["r"] * 2,
                                            "ground_truth": ["1"] * 2, "extra_info": [flat, "{bad"]}), "data_source")


def test_a_stage_runs_context_reads_each_input_manifest_once(tmp_path):
    """StageContext.memo (flows.step.execute_stage sets it for one stage run): an input's manifest
    is read once and the stage's fingerprint computed once; an incomplete input is not remembered."""
    import dataclasses

    from storage.artifacts import write_table

    ctx = make_ctx(tmp_path / "store")
    ctx.memo = {}
    assert ctx.input_manifest("rollout") is None
    missing = ctx.fingerprint("reward", reward_stage.CONFIG_KEYS, reward_stage.INPUTS)
    write_rollout(ctx, ["7", "8"], ["7", "7"], n=2)
    first = ctx.input_manifest("rollout")
    assert first["fingerprint"] == "rollout-1"
    fp = ctx.fingerprint("reward", reward_stage.CONFIG_KEYS, reward_stage.INPUTS)
    assert fp != missing
    # the rollout committed again under another fingerprint (which never happens while a stage runs)
    write_table(ctx.store, ctx.layout, 1, "rollout", ctx.read_input("rollout"), fingerprint="rollout-1-again")
    assert ctx.input_manifest("rollout") is first
    assert ctx.fingerprint("reward", reward_stage.CONFIG_KEYS, reward_stage.INPUTS) == fp
    step2 = dataclasses.replace(ctx, step=2)  # the update's replay of earlier steps: a copy, the memo shared
    write_rollout(step2, ["9", "9"], ["9", "9"], n=2)
    assert step2.input_manifest("rollout")["fingerprint"] == "rollout-2"
    assert step2.read_input("rollout").column("response").to_pylist() == ["9", "9"]
    assert ctx.input_manifest("rollout") is first
    ctx.memo = None  # outside a stage run: read every time
    assert ctx.input_manifest("rollout")["fingerprint"] == "rollout-1-again"
    assert ctx.fingerprint("reward", reward_stage.CONFIG_KEYS, reward_stage.INPUTS) != fp
