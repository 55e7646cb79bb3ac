"""advantage stage over storage: GRPO and GAE against hand numbers, verl's data metrics, KL in
reward with the adaptive controller resumed from the store, and refused inputs."""
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stages import advantage as adv_stage
from storage.artifacts import read_manifest, read_table
from tests._stage_tables import at_step, make_ctx, write_logprob, write_reward, write_rollout

LENGTHS = [2, 4, 1, 3, 4, 2]  # rows 1 and 4 are cut at max_response_length=4
PROMPTS = [5, 5, 5, 3, 3, 3]
SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # prompt p1's group: all equal (std 0)
REPO = Path(__file__).resolve().parents[1]


def write_step(ctx, scores=SCORES, old_minus_ref=0.0, values=None):
    write_rollout(ctx, ["r"] * 6, ["7"] * 6, lengths=LENGTHS, prompt_lengths=PROMPTS)
    old = [[-1.0 - 0.1 * t for t in range(n)] for n in LENGTHS]
    ref = [[o - old_minus_ref for o in row] for row in old]
    write_logprob(ctx, old, ref, values=values)
    write_reward(ctx, scores)


def tokens(table, column):
    return table.column(column).to_pylist()


def test_grpo_hand_numbers_and_data_metrics(tmp_path):
    ctx = make_ctx(tmp_path / "store", ["algorithm.adv_estimator=grpo"])
    write_step(ctx)
    manifest = adv_stage.run(ctx)
    table = read_table(ctx.store, ctx.layout, 1, "advantage")
    s = math.sqrt(1 / 3) + 1e-6  # group p0 scores (1, 0, 0): mean 1/3, unbiased std sqrt(1/3)
    a, b = (2 / 3) / s, (-1 / 3) / s
    expected = [[a] * 2, [b] * 4, [b], [0.0] * 3, [0.0] * 4, [0.0] * 2]
    for got, want in zip(tokens(table, "advantages"), expected):
        assert got == pytest.approx(want, abs=1e-6)
    assert tokens(table, "returns") == tokens(table, "advantages")
    assert tokens(table, "token_level_rewards") == [[0, 1], [0, 0, 0, 0], [0], [0, 0, 1],
                                                    [0, 0, 0, 1], [0, 1]]
    assert tokens(table, "kl") == [[0.0] * n for n in LENGTHS]

    m = manifest["extra"]["metrics"]
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == \
        pytest.approx((4 / 6, 1.0, 0.0))
    assert m["critic/rewards/mean"] == pytest.approx(4 / 6)
    assert m["critic/advantages/mean"] == pytest.approx((2 * a + 5 * b) / 16, abs=1e-6)
    assert (m["critic/advantages/max"], m["critic/advantages/min"]) == pytest.approx((a, b), abs=1e-6)
    assert m["critic/returns/mean"] == pytest.approx((2 * a + 5 * b) / 16, abs=1e-6)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == \
        pytest.approx((16 / 6, 4.0, 1.0))
    assert m["response_length/clip_ratio"] == pytest.approx(2 / 6)
    assert (m["prompt_length/mean"], m["prompt_length/max"], m["prompt_length/min"]) == (4.0, 5.0, 3.0)
    assert m["prompt_length/clip_ratio"] == 0.0
    assert "critic/values/mean" not in m and "critic/vf_explained_var" not in m
    assert "actor/reward_kl_penalty" not in m and "kl_ctrl" not in manifest["extra"]
    assert manifest["row_count"] == 6 and set(manifest["inputs"]) == {"rollout", "logprob", "reward"}
    assert manifest["fingerprint"] == adv_stage.stage_fingerprint(ctx)


def test_dr_grpo_without_std(tmp_path):
    ctx = make_ctx(tmp_path / "store", ["algorithm.adv_estimator=grpo",
                                        "algorithm.norm_adv_by_std_in_grpo=false"])
    write_step(ctx)
    adv_stage.run(ctx)
    got = tokens(read_table(ctx.store, ctx.layout, 1, "advantage"), "advantages")
    assert [row[0] for row in got] == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0, 0])


def test_gae_with_values(tmp_path):
    # gamma = lam = 1 and one reward at the last token: A_t = score - V_t, returns = score on every
    # valid token; advantages are then whitened over the 16 valid tokens of the batch
    values = [[0.5 - 0.1 * t - 0.05 * i for t in range(n)] for i, n in enumerate(LENGTHS)]
    ctx = make_ctx(tmp_path / "store", ["algorithm.adv_estimator=gae"])
    write_step(ctx, values=values)
    manifest = adv_stage.run(ctx)
    table = read_table(ctx.store, ctx.layout, 1, "advantage")
    v = np.array([x for row in values for x in row], dtype=np.float32)
    r = np.array([SCORES[i] for i, n in enumerate(LENGTHS) for _ in range(n)], dtype=np.float32)
    raw = r - v
    whitened = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
    assert np.concatenate(tokens(table, "advantages")) == pytest.approx(whitened, abs=1e-5)
    assert np.concatenate(tokens(table, "returns")) == pytest.approx(r, abs=1e-6)
    m = manifest["extra"]["metrics"]
    assert m["critic/values/mean"] == pytest.approx(v.mean(), abs=1e-6)
    assert (m["critic/values/max"], m["critic/values/min"]) == pytest.approx((v.max(), v.min()))
    assert m["critic/vf_explained_var"] == pytest.approx(
        1 - np.var(r - v, ddof=1) / (np.var(r, ddof=1) + 1e-5), abs=1e-5)
    assert m["critic/returns/mean"] == pytest.approx(r.mean(), abs=1e-6)


def test_gae_needs_values(tmp_path):
    ctx = make_ctx(tmp_path / "store", ["algorithm.adv_estimator=gae"])
    write_step(ctx)
    with pytest.raises(adv_stage.AdvantageInputError, match="no 'values'.*gae"):
        adv_stage.run(ctx)


KL_ADAPTIVE = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=true",
               "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.type=adaptive",
               "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_ctrl.target_kl=0.1",
               "algorithm.kl_ctrl.horizon=10"]
STEP_KL = {1: 0.3, 2: 0.05}


def test_kl_in_reward_adaptive_over_two_steps(tmp_path):
    ctx = make_ctx(tmp_path / "store", KL_ADAPTIVE)
    manifests = {}
    for step in (1, 2):
        c = at_step(ctx, step)
        write_step(c, old_minus_ref=STEP_KL[step])
        manifests[step] = adv_stage.run(c)
        assert manifests[step]["fingerprint"] == adv_stage.stage_fingerprint(c)  # what a flow checks
    # step 1: beta 0.1, kl 0.3 -> error clip(2, +-0.2) = 0.2 -> beta 0.1 * (1 + 0.2 * 6 / 10)
    # step 2: beta 0.112, kl 0.05 -> error -0.5 -> -0.2 -> beta 0.112 * (1 - 0.2 * 6 / 10)
    betas = {1: 0.1, 2: 0.1 * 1.12}
    for step, manifest in manifests.items():
        state = manifest["extra"]["kl_ctrl"]
        assert state["before"]["value"] == pytest.approx(betas[step], rel=1e-12)
        m = manifest["extra"]["metrics"]
        assert m["actor/reward_kl_penalty_coeff"] == pytest.approx(betas[step], rel=1e-12)
        assert m["actor/reward_kl_penalty"] == pytest.approx(STEP_KL[step], abs=1e-6)
        table = read_table(ctx.store, ctx.layout, step, "advantage")
        for i, (kl, rewards) in enumerate(zip(tokens(table, "kl"), tokens(table, "token_level_rewards"))):
            assert kl == pytest.approx([STEP_KL[step]] * LENGTHS[i], abs=1e-6)
            want = [-betas[step] * STEP_KL[step]] * LENGTHS[i]
            want[-1] += SCORES[i]
            assert rewards == pytest.approx(want, abs=1e-6)
        assert m["critic/rewards/mean"] == pytest.approx(
            4 / 6 - betas[step] * STEP_KL[step] * 16 / 6, abs=1e-6)
    assert manifests[1]["extra"]["kl_ctrl"]["after"] == manifests[2]["extra"]["kl_ctrl"]["before"]
    assert manifests[2]["extra"]["kl_ctrl"]["after"]["value"] == pytest.approx(0.112 * 0.88, rel=1e-12)


def test_kl_controller_resumed_from_the_store_is_bit_identical(tmp_path):
    root = tmp_path / "store"
    straight = make_ctx(root, KL_ADAPTIVE, experiment="straight")
    resumed = make_ctx(root, KL_ADAPTIVE, experiment="resumed")
    for ctx in (straight, resumed):
        for step in (1, 2):
            write_step(at_step(ctx, step), old_minus_ref=STEP_KL[step])
    for step in (1, 2):
        adv_stage.run(at_step(straight, step))
    adv_stage.run(at_step(resumed, 1))
    # "interrupted" after step 1: step 2 runs in a fresh process that knows only the config
    code = ("import sys; from stages.context import StageContext; from stages import advantage; "
            "advantage.run(StageContext.from_json(sys.stdin.read()))")
    subprocess.run([sys.executable, "-c", code], input=at_step(resumed, 2).to_json(), text=True,
                   cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, timeout=300)
    a = read_manifest(straight.store, straight.layout, 2, "advantage")
    b = read_manifest(resumed.store, resumed.layout, 2, "advantage")
    assert a["files"]["advantage.parquet"]["sha256"] == b["files"]["advantage.parquet"]["sha256"]
    assert a["extra"]["kl_ctrl"] == b["extra"]["kl_ctrl"]
    assert a["extra"]["metrics"] == b["extra"]["metrics"]
    assert a["fingerprint"] == b["fingerprint"]
    assert b["extra"]["kl_ctrl"]["before"]["value"] != 0.1  # the coefficient really moved


def test_adaptive_step_without_previous_state_is_refused(tmp_path):
    ctx = at_step(make_ctx(tmp_path / "store", KL_ADAPTIVE), 2)
    write_step(ctx, old_minus_ref=0.1)
    with pytest.raises(adv_stage.AdvantageInputError,
                       match="needs the KL coefficient of step 1.*incomplete"):
        adv_stage.run(ctx)


def test_reward_rows_not_matching_the_rollout_are_refused(tmp_path):
    ctx = make_ctx(tmp_path / "store", ["algorithm.adv_estimator=grpo"])
    write_step(ctx)
    write_reward(ctx, SCORES[:5])
    with pytest.raises(adv_stage.AdvantageInputError,
                       match="reward.parquet has 5 rows but rollout.parquet has 6"):
        adv_stage.run(ctx)
    write_reward(ctx, SCORES, inputs={"rollout": "f" * 64})
    with pytest.raises(adv_stage.AdvantageInputError, match="reward.parquet was computed from another rollout"):
        adv_stage.run(ctx)
    assert read_manifest(ctx.store, ctx.layout, 1, "advantage") is None


def test_nan_score_is_refused_naming_the_rows(tmp_path):
    ctx = make_ctx(tmp_path / "store", ["algorithm.adv_estimator=grpo"])
    write_step(ctx, scores=[1.0, 0.0, float("nan"), 1.0, 1.0, float("nan")])
    with pytest.raises(adv_stage.AdvantageInputError, match="score is NaN/inf/missing in rows 2, 5$"):
        adv_stage.run(ctx)


def test_unknown_estimator_lists_the_known_ones(tmp_path):
    ctx = make_ctx(tmp_path / "store", ["algorithm.adv_estimator=grpo"])
    ctx.cfg["algorithm"]["adv_estimator"] = "ppo_magic"
    with pytest.raises(ValueError, match="'ppo_magic'.*gae, gpg, grpo, grpo_passk, grpo_vectorized, opo, "
                                         "optimal_token_baseline, reinforce_plus_plus, "
                                         "reinforce_plus_plus_baseline, remax, rloo, rloo_vectorized"):
        adv_stage.run(ctx)
