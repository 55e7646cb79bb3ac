"""ReMax through the stages on the tiny CPU model: the rollout adds one greedy answer per prompt
(rollout/baseline.parquet, not training rows), the reward stage scores it (reward/baseline.parquet),
the advantage stage subtracts each prompt's baseline score; inspect and show display them."""
import argparse

import pytest
import torch

from stages import advantage, logprob, reward, rollout
from stages.data.baseline_answers import ANSWERS, SCORES
from storage.artifacts import read_file, read_table
from tests._rollout_setup import make_assets, make_ctx

# score = (number of characters of the answer) / 10: deterministic, different between answers
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 10
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def remax_ctx(tmp_path, assets, *overrides, root="store"):
    fn = tmp_path / "reward_fn.py"
    fn.write_text(REWARD)
    return make_ctx(tmp_path / root, assets, ["algorithm.adv_estimator=remax", f"custom_reward_function.path={fn}",
                                              "custom_reward_function.name=compute_score", *overrides])


def is_greedy(model, prompt_ids, response_ids) -> bool:
    """Every response token is the argmax of the model's next-token logits (EOS included)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    p = len(prompt_ids)
    return logits[p - 1:p - 1 + len(response_ids)].argmax(-1).tolist() == list(response_ids)


def test_remax_rollout_reward_advantage(tmp_path, assets):
    ctx = remax_ctx(tmp_path, assets)
    manifest = rollout.run(ctx)
    rows = read_table(ctx.store, ctx.layout, 1, "rollout")
    # train-batch rows unchanged: train_batch_size 4 × n 2; the baseline is a file of its own
    assert rows.num_rows == 8 and manifest["row_count"] == 8
    assert set(manifest["files"]) == {"rollout.parquet", ANSWERS}
    base = read_file(ctx.store, ctx.layout, 1, "rollout", ANSWERS)
    uids = rows.column("uid").to_pylist()
    assert base.column("uid").to_pylist() == list(dict.fromkeys(uids))  # one per prompt, in order
    assert base.column("sample_index").to_pylist() == [0] * 4
    for name in ("prompt_ids", "prompt", "ground_truth", "data_source"):
        first = {u: v for u, v in zip(uids, rows.column(name).to_pylist())}
        assert base.column(name).to_pylist() == [first[u] for u in base.column("uid").to_pylist()]
    assert manifest["extra"]["baseline"]["prompts"] == 4
    assert len(set(map(tuple, base.column("response_ids").to_pylist()))) > 1  # not one trivial answer

    # greedy: each baseline token is the model's argmax (the samples, at temperature 2.0, are not)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets[0], dtype=torch.float32).eval()
    for p, r in zip(base.column("prompt_ids").to_pylist(), base.column("response_ids").to_pylist()):
        assert is_greedy(model, p, r)
    assert not all(is_greedy(model, p, r) for p, r in zip(rows.column("prompt_ids").to_pylist(),
                                                         rows.column("response_ids").to_pylist()))

    logprob.run(ctx)
    scored = reward.run(ctx)
    assert set(scored["files"]) == {"reward.parquet", SCORES} and scored["row_count"] == 8
    b_scores = read_file(ctx.store, ctx.layout, 1, "reward", SCORES)
    assert b_scores.column("uid").to_pylist() == base.column("uid").to_pylist()
    expected_b = [len(t) / 10 for t in base.column("response").to_pylist()]
    assert b_scores.column("score").to_pylist() == pytest.approx(expected_b)
    assert scored["extra"]["metrics"]["reward/baseline/score/mean"] == pytest.approx(sum(expected_b) / 4)

    result = advantage.run(ctx)
    assert result["row_count"] == 8
    adv = read_table(ctx.store, ctx.layout, 1, "advantage").column("advantages").to_pylist()
    score = read_table(ctx.store, ctx.layout, 1, "reward").column("score").to_pylist()
    baseline_of = dict(zip(b_scores.column("uid").to_pylist(), expected_b))
    for row, (uid, s, a) in enumerate(zip(uids, score, adv)):
        # tiny-cpu has no KL in reward: G_t = s on every valid token, A_t = s - b(prompt)
        assert a == pytest.approx([s - baseline_of[uid]] * len(a), abs=1e-6), row

    # stagerl inspect / show display them
    from flows.read.inspect_lib import open_view, sample_view, step_summary

    args = argparse.Namespace(root=str(ctx.store.root), project=None, config="tiny-cpu", experiment="t")
    view = open_view(args, ctx.cfg)
    # (per stage: without the update, inspect's logprob section has no old log-probs to show yet)
    assert step_summary(view, 1, "rollout")["stages"]["rollout"]["baseline"]["prompts"] == 4
    assert step_summary(view, 1, "reward")["stages"]["reward"]["baseline_score"]["mean"] == \
        pytest.approx(sum(expected_b) / 4)
    from storage.query import run_query

    _, got = run_query(view, "SELECT uid, response, score FROM baseline ORDER BY row")  # stagerl query
    assert [(u, r) for u, r, _ in got] == list(zip(base.column("uid").to_pylist(), base.column("response").to_pylist()))
    assert [sc for _, _, sc in got] == pytest.approx(expected_b)
    shown = sample_view(view, 1, uids[0], 0)
    assert shown["baseline"]["response"] == base.column("response").to_pylist()[0]
    assert shown["baseline"]["score"] == pytest.approx(expected_b[0])


def test_baseline_is_seed_independent_and_refused_when_missing(tmp_path, assets):
    a = remax_ctx(tmp_path, assets, "actor_rollout_ref.rollout.seed=1", root="a")
    b = remax_ctx(tmp_path, assets, "actor_rollout_ref.rollout.seed=2", root="b")
    rollout.run(a)
    rollout.run(b)
    answers = [read_file(c.store, c.layout, 1, "rollout", ANSWERS).column("response_ids").to_pylist() for c in (a, b)]
    samples = [read_table(c.store, c.layout, 1, "rollout").column("response_ids").to_pylist() for c in (a, b)]
    assert answers[0] == answers[1] and samples[0] != samples[1]

    # a rollout made for grpo (no baseline answers) cannot feed remax's advantage
    grpo = make_ctx(tmp_path / "c", assets, ["algorithm.adv_estimator=grpo"])
    assert ANSWERS not in rollout.run(grpo)["files"]
    logprob.run(grpo)
    reward.run(grpo)
    remax = make_ctx(tmp_path / "c", assets, ["algorithm.adv_estimator=remax"])
    assert rollout.stage_fingerprint(remax) != rollout.stage_fingerprint(grpo)  # a resume reruns the rollout
    with pytest.raises(advantage.AdvantageInputError, match="stored no reward/baseline.parquet"):
        advantage.run(remax)
