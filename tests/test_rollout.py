"""rollout stage with the transformers engine on the tiny model: reproducibility, columns, the
dataset position, left padding, engine log-probs, validation, and bad input."""
import json

import pytest
import torch

from stages import rollout
from stages.engines import replica_shares
from stages.model.models import load_policy
from storage.artifacts import is_complete, read_manifest, read_table
from tests._rollout_setup import make_assets, make_ctx, rollout_bytes, write_dataset

EOS = {0, 2}  # <|endoftext|>, <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("rollout-assets"))


def test_same_seed_gives_identical_bytes_and_another_seed_differs(tmp_path, assets):
    first = make_ctx(tmp_path / "a", assets, ["trainer.seed=7"])
    second = make_ctx(tmp_path / "b", assets, ["trainer.seed=7"])
    other = make_ctx(tmp_path / "c", assets, ["trainer.seed=8"])
    for ctx in (first, second, other):
        rollout.run(ctx)
    assert rollout_bytes(first) == rollout_bytes(second)
    a, c = (read_table(x.store, x.layout, 1, "rollout").to_pydict() for x in (first, other))
    assert a["prompt_ids"] == c["prompt_ids"]  # data.seed fixes the batch, trainer.seed the sampling
    assert a["response_ids"] != c["response_ids"]


def test_prompts_are_keyed_by_the_initial_models_tokenizer(tmp_path, assets):
    """Every step's weights folder holds a saved copy of the initial model's tokenizer: the
    prompts (and the tokenizer) are keyed by the initial folder's files, which are hashed once,
    not by each step's new folder's (stages.rollout.tokenizer_folder)."""
    from stages.data import cache

    ctx = make_ctx(tmp_path, assets, step=2)
    first = rollout._dataset(ctx, "train")
    hashed = []
    real = cache._sha256_file
    cache._sha256_file = lambda path: hashed.append(path) or real(path)
    try:
        again = rollout._dataset(ctx, "train")
    finally:
        cache._sha256_file = real
    assert rollout.tokenizer_folder(ctx) == assets[0]
    assert again.cache_info["key"] == first.cache_info["key"] and again.cache_info["source"] == "memory"
    assert hashed == []  # no tokenizer file read again


def test_rows_columns_uids_and_data_position(tmp_path, assets):
    ctx = make_ctx(tmp_path, assets)
    manifest = rollout.run(ctx)
    table = read_table(ctx.store, ctx.layout, 1, "rollout")
    cols = table.to_pydict()
    assert table.num_rows == 4 * 2 == manifest["row_count"]
    for name in ("uid", "sample_index", "prompt", "prompt_ids", "response", "response_ids",
                 "response_length", "finish_reason", "data_source", "ground_truth", "extra_info"):
        assert name in table.column_names
    assert "rollout_log_probs" not in table.column_names  # calculate_log_probs is off
    assert cols["sample_index"] == [0, 1] * 4
    uids = cols["uid"]
    assert [uids[i] == uids[i + 1] for i in range(0, 8, 2)] == [True] * 4 and len(set(uids)) == 4
    assert uids[0].startswith("s1-p0-")
    for i in range(8):
        ids = cols["response_ids"][i]
        assert cols["response_length"][i] == len(ids) and 1 <= len(ids) <= 12
        if cols["finish_reason"][i] == "stop":
            assert ids[-1] in EOS and not EOS & set(ids[:-1])
        else:
            assert cols["finish_reason"][i] == "length" and len(ids) == 12 and not EOS & set(ids)
        assert cols["prompt"][i].startswith("<|im_start|>user\nWhat is ")
        assert cols["prompt"][i].endswith("<|im_start|>assistant\n")
        assert cols["data_source"][i] == "stagerl/arith"
        question = json.loads(cols["extra_info"][i])["question"]
        assert question in cols["prompt"][i]
        assert str(eval(question[len("What is "):question.index("?")])) == cols["ground_truth"][i]
    extra = manifest["extra"]
    assert extra["data_position"] == {"epoch": 0, "index": 4}
    assert extra["rows"] == 8 and extra["response_tokens"] == sum(cols["response_length"])
    generate_s = manifest["timings"]["generate_s"]
    assert generate_s > 0 and extra["tokens_per_s"] == pytest.approx(extra["response_tokens"] / generate_s, rel=0.01)

    step2 = make_ctx(tmp_path, assets, step=2)
    # step 2 samples from weights/step_1; point it at the initial model through the cache-free path
    step2.actor_weights = lambda: assets[0]
    m2 = rollout.run(step2)
    assert m2["extra"]["data_position"] == {"epoch": 0, "index": 8}
    cols2 = read_table(step2.store, step2.layout, 2, "rollout").to_pydict()
    assert cols2["uid"][0].startswith("s2-p0-")
    assert not set(cols2["extra_info"]) & set(cols["extra_info"])  # the next 4 prompts


def test_greedy_output_does_not_depend_on_generation_batch_size(tmp_path, assets):
    """Left padding is invisible: one prompt per generate call == 4 per call (greedy)."""
    greedy = ["actor_rollout_ref.rollout.do_sample=false"]
    one = make_ctx(tmp_path / "one", assets, [*greedy, "actor_rollout_ref.rollout.hf_generate_batch_size=1"])
    four = make_ctx(tmp_path / "four", assets, [*greedy, "actor_rollout_ref.rollout.hf_generate_batch_size=4"])
    for ctx in (one, four):
        rollout.run(ctx)
    a, b = (read_table(x.store, x.layout, 1, "rollout").to_pydict() for x in (one, four))
    assert {len(p) for p in a["prompt_ids"]} != {len(a["prompt_ids"][0])}  # prompts of unequal length
    assert a["response_ids"] == b["response_ids"]
    assert a["response_ids"][0] == a["response_ids"][1]  # greedy: the n samples agree
    assert len(set(map(tuple, a["response_ids"]))) > 1  # init_std 0.3: prompts give different output


def test_engine_log_probs_equal_a_forward_pass(tmp_path, assets):
    ctx = make_ctx(tmp_path, assets, ["actor_rollout_ref.rollout.calculate_log_probs=true",
                                      "actor_rollout_ref.rollout.temperature=0.7"])
    rollout.run(ctx)
    cols = read_table(ctx.store, ctx.layout, 1, "rollout").to_pydict()
    model = load_policy(assets[0])
    for i in (0, 5):
        prompt, response = cols["prompt_ids"][i], cols["response_ids"][i]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].float() / 0.7
        expected = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(
            -1, torch.tensor(response)[:, None])[:, 0]
        assert len(cols["rollout_log_probs"][i]) == len(response)
        assert torch.allclose(torch.tensor(cols["rollout_log_probs"][i]), expected, atol=1e-4)


def test_replicas_split_whole_prompts_as_the_plan_says(tmp_path, assets):
    assert replica_shares(12, 2, 2, 3) == [range(0, 6), range(6, 12)]
    assert replica_shares(10, 2, 2, 3) == [range(0, 6), range(6, 10)]
    assert replica_shares(6, 3, 1, None) == [range(0, 6)]
    ctx = make_ctx(tmp_path, assets, ["trainer.n_gpus_per_node=2"])
    assert ctx.plan["rollout"]["num_replicas"] == 2 and ctx.plan["rollout"]["prompts_per_replica"] == 2
    assert rollout.run(ctx)["row_count"] == 8


def test_generate_validation_uses_val_kwargs(tmp_path, assets):
    ctx = make_ctx(tmp_path, assets, ["actor_rollout_ref.rollout.val_kwargs.n=2"])
    rows = rollout.generate_validation(ctx)
    assert len(rows) == 6 * 2
    assert {r["sample_index"] for r in rows} == {0, 1}
    assert json.loads(rows[0]["extra_info"])["split"] == "test"
    # greedy by default (val_kwargs.do_sample=false): both samples of a prompt agree
    assert all(rows[i]["response_ids"] == rows[i + 1]["response_ids"] for i in range(0, 12, 2))
    assert rollout.generate_validation(ctx) == rows


# ---- bad input -----------------------------------------------------------------------------
def _fails(ctx, error, *needles):
    with pytest.raises(error) as info:
        rollout.run(ctx)
    for needle in needles:
        assert needle in str(info.value)
    assert not is_complete(ctx.store, ctx.layout, 1, "rollout")
    assert read_manifest(ctx.store, ctx.layout, 1, "rollout") is None


def test_missing_prompt_column(tmp_path, assets):
    _fails(make_ctx(tmp_path, assets, ["data.prompt_key=question"]), KeyError, "'question'", "data.prompt_key")


def test_empty_prompt_names_the_row(tmp_path, assets):
    from stages.data.tools import make_arith_dataset

    rows = make_arith_dataset(8, seed=0)
    rows[3]["prompt"] = [{"role": "user", "content": ""}]
    bad = write_dataset(tmp_path / "bad.parquet", rows)
    _fails(make_ctx(tmp_path, assets, [f"data.train_files={bad}"]), ValueError, "row 3", "empty prompt")


def test_prompt_over_max_prompt_length_names_the_row(tmp_path, assets):
    _fails(make_ctx(tmp_path, assets, ["data.max_prompt_length=10", "data.truncation=error"]),
           ValueError, "row 0", "data.max_prompt_length=10")


def test_missing_model_folder(tmp_path, assets):
    _fails(make_ctx(tmp_path, assets, [f"actor_rollout_ref.model.path={tmp_path / 'nope'}"]),
           FileNotFoundError, "actor_rollout_ref.model.path", str(tmp_path / "nope"))


def test_bad_sampling_key_is_named(tmp_path, assets):
    _fails(make_ctx(tmp_path, assets, ["actor_rollout_ref.rollout.top_p=0"]), ValueError,
           "actor_rollout_ref.rollout.top_p")


def test_progress_bar_on_stderr_when_forced(tmp_path, assets, capsys, monkeypatch):
    monkeypatch.setenv("STAGERL_PROGRESS", "1")  # stderr is not a terminal under pytest
    rollout.run(make_ctx(tmp_path, assets))
    err = capsys.readouterr().err
    # tqdm's bar over 4 prompts x n=2 rows (later redraws are rate-limited, so only the first is sure)
    assert "\rgenerate:   0%|" in err and "| 0/8 [00:00<?, ?seq/s]" in err
    monkeypatch.setenv("STAGERL_PROGRESS", "0")
    rollout.run(make_ctx(tmp_path / "off", assets))
    assert "generate:" not in capsys.readouterr().err
