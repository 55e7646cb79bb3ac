"""verl's further advantage estimators (stages/algos/advantages.py) against hand-computed numbers.

Each expected value is literal arithmetic from verl's formula (verl/trainer/ppo/core_algos.py, the
function named in each estimator's docstring), never a call of the function under test. Cases:
groups of 1, all-equal rewards, masked (padding) tokens, responses cut at max length (every
position valid). Plus: the vectorized estimators against their plain versions on random groups,
and what each estimator declares it needs.
"""
import math
import random

import pytest
import torch

from stages.algos.advantages import ADV_ESTIMATORS, compute_advantage, estimator_needs

T = torch.tensor
EPS = 1e-6


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=tol)


def outcome(scores, lengths, width):
    """(token_level_rewards, response_mask): row i has `lengths[i]` valid tokens (right padding)
    and its score at its last valid token, as the advantage stage lays them out."""
    rewards, mask = torch.zeros(len(scores), width), torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1.0
        if n:
            rewards[i, n - 1] = s
    return rewards, mask


def per_token(values, lengths, width):
    """Row i: values[i] on its valid tokens, 0 on padding."""
    return [[v if t < n else 0.0 for t in range(width)] for v, n in zip(values, lengths)]


# A batch of three prompts, width 4: group a = [1, 0, 0, 1] (lengths 2, 3, 1, 4 — the last one cut
# at max length: all 4 positions valid), group b = [0.5] (a group of 1), group c = [2, 2] (all equal).
UIDS = ["a", "a", "a", "a", "b", "c", "c"]
SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 2.0]
LENGTHS = [2, 3, 1, 4, 3, 1, 4]
W = 4


def batch():
    return outcome(SCORES, LENGTHS, W)


# ------------------------------------------------------------------ grpo_vectorized
def test_grpo_vectorized_by_hand():
    rewards, mask = batch()
    adv, ret = compute_advantage("grpo_vectorized", rewards, mask, index=UIDS)
    # a: mean = S1/c = 2/4 = 0.5; var = (S2 - S1^2/c)/(c-1) = (2 - 4/4)/3 = 1/3 (> eps, no floor)
    #    A = ±0.5/(sqrt(1/3) + 1e-6) = ±0.866024
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    # b: a group of 1: mean 0, std 1: A = 0.5/(1 + 1e-6)
    # c: var = (8 - 16/2)/1 = 0 -> floored at eps: std = sqrt(1e-6) = 1e-3; A = 0/(1e-3 + 1e-6) = 0
    expected = [a, -a, -a, a, 0.5 / (1 + EPS), 0.0, 0.0]
    close(adv, per_token(expected, LENGTHS, W))
    close(ret, adv)
    # Dr.GRPO (norm_adv_by_std_in_grpo false): s - mean: a: ±0.5, b: 0.5 - 0, c: 0
    adv, _ = compute_advantage("grpo_vectorized", rewards, mask, index=UIDS, norm_adv_by_std_in_grpo=False)
    close(adv, per_token([0.5, -0.5, -0.5, 0.5, 0.5, 0.0, 0.0], LENGTHS, W))


def test_grpo_vectorized_floors_a_tiny_variance_at_epsilon():
    """verl's group_mean_std: std = sqrt(max(var, eps)); plain grpo divides by the true std."""
    rewards, mask = outcome([0.0, 1e-4], [1, 1], 1)
    adv, _ = compute_advantage("grpo_vectorized", rewards, mask, index=["g", "g"])
    # mean 5e-5, var = (1e-8 - 1e-8/2)/1 = 5e-9 < 1e-6 -> std = sqrt(1e-6) = 1e-3
    # A = ∓5e-5/(1e-3 + 1e-6) = ∓0.04995
    close(adv, [[-5e-5 / (1e-3 + EPS)], [5e-5 / (1e-3 + EPS)]], tol=1e-3)
    plain, _ = compute_advantage("grpo", rewards, mask, index=["g", "g"])
    # grpo: std = sqrt(5e-9) = 7.07e-5: A = ∓5e-5/(7.07e-5 + 1e-6) = ∓0.6969
    close(plain, [[-5e-5 / (math.sqrt(5e-9) + EPS)], [5e-5 / (math.sqrt(5e-9) + EPS)]], tol=1e-3)


# ------------------------------------------------------------------ rloo_vectorized
def test_rloo_vectorized_by_hand():
    rewards, mask = batch()
    adv, ret = compute_advantage("rloo_vectorized", rewards, mask, index=UIDS)
    # a: c = 4, S = 2: A = (4*s - 2)/3: s=1 -> 2/3, s=0 -> -2/3 (s minus the mean of the other 3)
    # b: c = 1: A = (0.5 - 0.5)/1 * [1 > 1] = 0 (plain rloo would give 0.5)
    # c: c = 2, S = 4: A = (2*2 - 4)/1 = 0
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0]
    close(adv, per_token(expected, LENGTHS, W))
    close(ret, adv)
    plain, _ = compute_advantage("rloo", rewards, mask, index=UIDS)
    close(plain[4], per_token([0.5], [3], W)[0])  # rloo: a group of 1 keeps its score


# ------------------------------------------------------------------ vectorized == plain
def random_batch(seed: int, width: int = 6):
    """Random groups of 1..5 rows (0/1 and continuous scores), random lengths 1..width."""
    rng = random.Random(seed)
    uids, scores, lengths = [], [], []
    for g in range(12):
        size = rng.randint(1, 5)
        binary = rng.random() < 0.5
        for _ in range(size):
            uids.append(f"g{g}")
            scores.append(float(rng.randint(0, 1)) if binary else rng.gauss(0.0, 1.0))
            lengths.append(rng.randint(1, width))
    order = list(range(len(uids)))
    rng.shuffle(order)  # a group's rows need not be adjacent
    uids, scores, lengths = ([x[i] for i in order] for x in (uids, scores, lengths))
    rewards, mask = outcome(scores, lengths, width)
    return uids, rewards, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized_equals_grpo_on_random_groups(seed, norm):
    uids, rewards, mask = random_batch(seed)
    plain, plain_ret = compute_advantage("grpo", rewards, mask, index=uids, norm_adv_by_std_in_grpo=norm)
    vec, vec_ret = compute_advantage("grpo_vectorized", rewards, mask, index=uids, norm_adv_by_std_in_grpo=norm)
    close(vec, plain, tol=1e-4)  # groups of 1 included: both s/(1 + eps)
    close(vec_ret, plain_ret, tol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_vectorized_equals_rloo_except_groups_of_one(seed):
    uids, rewards, mask = random_batch(seed)
    plain, _ = compute_advantage("rloo", rewards, mask, index=uids)
    vec, _ = compute_advantage("rloo_vectorized", rewards, mask, index=uids)
    single = [uids.count(u) == 1 for u in uids]
    assert any(single) and not all(single)
    for i, alone in enumerate(single):
        if alone:  # verl: rloo keeps s_i, rloo_vectorized gives 0
            close(vec[i], torch.zeros_like(vec[i]))
            close(plain[i], rewards[i].sum() * mask[i])
        else:
            close(vec[i], plain[i], tol=1e-5)


# ------------------------------------------------------------------ opo
def test_opo_by_hand():
    rewards, mask = batch()
    adv, ret = compute_advantage("opo", rewards, mask, index=UIDS)
    # a: b = sum L*s / sum L = (2*1 + 3*0 + 1*0 + 4*1)/(2+3+1+4) = 6/10 = 0.6 -> [0.4, -0.6, -0.6, 0.4]
    #    (row 3 is cut at max length: all 4 positions get 0.4)
    # b: a group of 1: b = 0 -> 0.5;  c: b = (1*2 + 4*2)/5 = 2 -> 0
    expected = [0.4, -0.6, -0.6, 0.4, 0.5, 0.0, 0.0]
    close(adv, per_token(expected, LENGTHS, W))
    close(ret, adv)


def test_opo_refuses_a_group_without_valid_tokens():
    rewards, mask = outcome([1.0, 0.0], [0, 0], 2)  # verl: 0/0 = NaN
    with pytest.raises(ValueError, match="no valid token"):
        compute_advantage("opo", rewards, mask, index=["g", "g"])


# ------------------------------------------------------------------ grpo_passk
def test_grpo_passk_by_hand():
    scores, lengths = [1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 1.0, 0.0, 0.0, 1.0], [2, 3, 4, 1, 1, 4, 2, 2, 2, 2]
    uids = ["a"] * 4 + ["c"] * 2 + ["d"] * 4
    rewards, mask = outcome(scores, lengths, 4)
    adv, ret = compute_advantage("grpo_passk", rewards, mask, index=uids)
    # a = [1, 0, 0.5, 0.25]: only the best (row 0) gets r_max - r_second = 1 - 0.5 = 0.5, divided by
    #   (std + eps): mean 0.4375, deviations .5625 -.4375 .0625 -.1875, squares sum 0.546875,
    #   unbiased var 0.546875/3 = 0.18229167, std 0.42695628 -> 0.5/(0.42695628 + 1e-6) = 1.1710773
    # c = [2, 2] (all equal): 2 - 2 = 0;  d = [1, 0, 0, 1]: the top two tie, 1 - 1 = 0
    expected = [0.5 / (0.42695628 + EPS), 0, 0, 0, 0, 0, 0, 0, 0, 0]
    close(adv, per_token(expected, lengths, 4))
    close(ret, adv)
    adv, _ = compute_advantage("grpo_passk", rewards, mask, index=uids, norm_adv_by_std_in_grpo=False)
    close(adv, per_token([0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0], lengths, 4))  # no std: 1 - 0.5


def test_grpo_passk_refuses_a_group_of_one():
    rewards, mask = batch()
    with pytest.raises(ValueError, match="at least 2 samples per group.*group 'b' has 1"):
        compute_advantage("grpo_passk", rewards, mask, index=UIDS)


# ------------------------------------------------------------------ gpg
def test_gpg_by_hand():
    rewards, mask = batch()
    adv, ret = compute_advantage("gpg", rewards, mask, index=UIDS)
    # alpha = bs / (rows with a non-zero score) = 7 / 5 (1, 1, 0.5, 2, 2) = 1.4
    # a: mean 0.5: 1.4*(±0.5) = ±0.7;  b: a group of 1, mean 0: 1.4*0.5 = 0.7;  c: 1.4*(2-2) = 0
    expected = [0.7, -0.7, -0.7, 0.7, 0.7, 0.0, 0.0]
    close(adv, per_token(expected, LENGTHS, W))
    close(ret, adv)


def test_gpg_all_zero_scores():
    rewards, mask = outcome([0.0, 0.0, 0.0], [1, 2, 3], 3)
    adv, _ = compute_advantage("gpg", rewards, mask, index=["g"] * 3)
    close(adv, torch.zeros(3, 3))  # alpha = 3/max(0, 1) = 3; 3*(0 - 0) = 0


# ------------------------------------------------------------------ remax
def test_remax_by_hand():
    rewards, mask = outcome([1.0, 0.0, 1.0, 1.0], [2, 3, 1, 3], 3)
    baselines = [0.5, 0.5, 1.0, 0.0]  # the greedy answer's score of each row's prompt
    adv, ret = compute_advantage("remax", rewards, mask, index=["p", "p", "q", "r"], reward_baselines=baselines)
    # G_t = reward-to-go = s on every valid token (outcome reward at the last), 0 on padding
    close(ret, [[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]])
    # A_t = G_t - b*m_t: row 0: 1 - 0.5; row 1: 0 - 0.5 (all 3 valid); row 2: 1 - 1 (a greedy
    # answer as good as the sample); row 3 (cut at max length, baseline 0): 1 everywhere
    close(adv, [[0.5, 0.5, 0], [-0.5, -0.5, -0.5], [0, 0, 0], [1, 1, 1]])


def test_remax_with_token_rewards():
    """With KL in reward the token rewards vary: G_t is the reward-to-go, A_t = G_t - b."""
    rewards, mask = T([[0.1, -0.2, 1.0, 0.0]]), T([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = compute_advantage("remax", rewards, mask, reward_baselines=T([0.5]))
    close(ret, [[0.9, 0.8, 1.0, 0.0]])  # 0.1-0.2+1.0, -0.2+1.0, 1.0, padding 0
    close(adv, [[0.4, 0.3, 0.5, 0.0]])


def test_remax_needs_one_baseline_per_row():
    rewards, mask = outcome([1.0, 0.0], [1, 1], 1)
    with pytest.raises(ValueError, match="one per row"):
        compute_advantage("remax", rewards, mask, reward_baselines=[0.5])
    with pytest.raises(TypeError):
        compute_advantage("remax", rewards, mask)  # no reward_baselines at all


# ------------------------------------------------------------------ optimal_token_baseline
# One group of 2, width 2. Row 0: 2 valid tokens (cut at max length), score 1 at t=1, pi = (0.5, 0.25),
# sum pi^2 = (0.5, 0.3). Row 1: 1 valid token, score 0, pi = 0.8, sum pi^2 = 0.7 (padding: any value).
OTB_REWARDS = T([[0.0, 1.0], [0.0, 0.0]])
OTB_MASK = T([[1.0, 1.0], [1.0, 0.0]])
OTB_OLD = torch.log(T([[0.5, 0.25], [0.8, 0.3]]))
OTB_PI2 = T([[0.5, 0.3], [0.7, 0.9]])


def test_optimal_token_baseline_by_hand():
    adv, ret = compute_advantage("optimal_token_baseline", OTB_REWARDS, OTB_MASK, index=["g", "g"],
                                 old_log_probs=OTB_OLD, sum_pi_squared=OTB_PI2)
    # G (reward-to-go of masked rewards): row 0 [1, 1], row 1 [0, 0]
    close(ret, [[1, 1], [0, 0]])
    # w = 1 - 2 pi + sum pi^2: row 0: 1 - 1 + 0.5 = 0.5, 1 - 0.5 + 0.3 = 0.8 -> W = cumsum(w m) = [0.5, 1.3]
    #                          row 1: 1 - 1.6 + 0.7 = 0.1, padding masked -> W = [0.1, 0.1]
    # B_0 = (1*0.5 + 0*0.1)/(0.5 + 0.1 + 1e-8) = 0.8333333;  B_1 = (1*1.3*1 + 0)/(1.3*1 + 0.1*0) = 1
    # A = (G - B) m: row 0 [1 - 0.8333333, 1 - 1] = [0.1666667, 0]; row 1 [0 - 0.8333333, 0 (padding)]
    close(adv, [[1 - 0.5 / 0.6, 0.0], [-0.5 / 0.6, 0.0]])


def test_optimal_token_baseline_rollout_is_weights_and_zero_tail():
    fn = ADV_ESTIMATORS["optimal_token_baseline"]
    # IS weights rho = row 0 (2, 1), row 1 (1, 1): w * rho^2: row 0 [0.5*4, 0.8] -> W = [2.0, 2.8]; row 1 W = [0.1, .]
    # B_0 = 2.0/(2.0 + 0.1) = 0.952381; B_1 = 2.8/2.8 = 1 -> A row 0 [1 - 0.952381, 0], row 1 [-0.952381, 0]
    adv, _ = fn(OTB_REWARDS, OTB_MASK, ["g", "g"], OTB_OLD, OTB_PI2, rollout_is_weights=T([[2.0, 1.0], [1.0, 1.0]]))
    close(adv, [[1 - 2.0 / 2.1, 0.0], [-2.0 / 2.1, 0.0]])
    # handle_zero_tail: row 0 is the single longest (2 > 1): its baseline from position 1 on is 0,
    # so A row 0 = [1 - 0.8333333, 1 - 0] = [0.1666667, 1]
    adv, _ = fn(OTB_REWARDS, OTB_MASK, ["g", "g"], OTB_OLD, OTB_PI2, handle_zero_tail=True)
    close(adv, [[1 - 0.5 / 0.6, 1.0], [-0.5 / 0.6, 0.0]])


def test_optimal_token_baseline_group_of_one_and_all_equal():
    # separate groups of 1: no baseline, A = G
    adv, ret = compute_advantage("optimal_token_baseline", OTB_REWARDS, OTB_MASK, index=["x", "y"],
                                 old_log_probs=OTB_OLD, sum_pi_squared=OTB_PI2)
    close(adv, [[1, 1], [0, 0]])
    close(ret, adv)
    # all-equal rewards (1 and 1, both at their last token): B_t = weighted mean of equal returns = 1
    # (up to the 1e-8 in the denominator), A = 0
    rewards = T([[0.0, 1.0], [1.0, 0.0]])
    adv, _ = compute_advantage("optimal_token_baseline", rewards, OTB_MASK, index=["g", "g"],
                               old_log_probs=OTB_OLD, sum_pi_squared=OTB_PI2)
    close(adv, torch.zeros(2, 2), tol=1e-6)


def test_optimal_token_baseline_needs_its_inputs():
    with pytest.raises(ValueError, match="sum_pi_squared"):
        compute_advantage("optimal_token_baseline", OTB_REWARDS, OTB_MASK, index=["g", "g"],
                          old_log_probs=OTB_OLD, sum_pi_squared=None)


# ------------------------------------------------------------------ declarations
def test_needs_declarations():
    assert estimator_needs("remax") == {"baseline"}
    assert estimator_needs("optimal_token_baseline") == {"old_log_probs", "sum_pi_squared"}
    for name in ("opo", "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized"):
        assert estimator_needs(name) == set()


def test_a_name_registers_once():
    from stages.algos.advantages import register_adv_estimator

    with pytest.raises(ValueError, match="already registered"):
        register_adv_estimator("opo")(lambda token_level_rewards, response_mask: None)


# ------------------------------------------------------------------ stagerl plan: verl's example scripts
# Every verl example that uses one of these estimators (examples/ of volcengine/verl b178a3c: ReMax,
# GPG, OTB; no example uses opo, grpo_passk or the vectorized ones), its command line as written
# (shell variables for data paths as /data/x), run through `stagerl plan` without --config (verl's
# defaults fill the rest, as in verl).
VERL_EXAMPLE_LINES = {
    "gpg_trainer/run_qwen2-7b_math.sh": """
        algorithm.adv_estimator=gpg data.train_files=/data/x data.val_files=/data/x
        data.train_batch_size=1024 data.max_prompt_length=1024 data.max_response_length=1024
        data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.actor.policy_loss.loss_mode=gpg actor_rollout_ref.actor.kl_loss_coef=0.001
        actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
        actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False
        trainer.critic_warmup=0 trainer.logger=["console","wandb"]
        trainer.project_name=verl_gpg_example_gsm8k_math trainer.experiment_name=qwen2_7b_function_rm
        trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5
        trainer.total_epochs=15""".split(),
    "gpg_trainer/run_qwen2-7b_math_megatron.sh": """
        algorithm.adv_estimator=gpg data.train_files=/data/x data.val_files=/data/x
        data.train_batch_size=1024 data.max_prompt_length=1024 data.max_response_length=1024
        data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.actor.ppo_mini_batch_size=256
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
        actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
        actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2
        actor_rollout_ref.actor.policy_loss.loss_mode=gpg actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
        actor_rollout_ref.actor.entropy_coeff=0
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
        actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2
        actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2 algorithm.use_kl_in_reward=False
        trainer.critic_warmup=0 trainer.logger=["console","wandb"]
        trainer.project_name=verl_gpg_example_gsm8k_math trainer.experiment_name=qwen2_7b_megatron
        trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5
        trainer.total_epochs=15""".split(),
    "remax_trainer/run_qwen2.5-3b_seq_balance.sh": """
        algorithm.adv_estimator=remax data.train_files=/data/x/data/gsm8k/train.parquet
        data.val_files=/data/x/data/gsm8k/test.parquet data.train_batch_size=512 data.max_prompt_length=512
        data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=128
        actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30000
        actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.8 actor_rollout_ref.rollout.n=4
        actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=True
        algorithm.kl_penalty=kl algorithm.kl_ctrl.kl_coef=0.001 trainer.critic_warmup=0
        trainer.logger=["console","wandb"] trainer.project_name=verl_remax_example_gsm8k
        trainer.experiment_name=qwen2.5_3b_function_rm_kl1e-3 trainer.val_before_train=False
        trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=5
        trainer.total_epochs=5""".split(),
    "remax_trainer/run_qwen2.5-7b_seq_balance.sh": """
        algorithm.adv_estimator=remax data.train_files=/data/x/data/gsm8k/train.parquet
        data.val_files=/data/x/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
        data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
        actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000
        actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.8 actor_rollout_ref.rollout.n=4
        actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=True
        algorithm.kl_penalty=kl algorithm.kl_ctrl.kl_coef=0.001 trainer.critic_warmup=0
        trainer.logger=["console","wandb"] trainer.project_name=verl_remax_example_gsm8k
        trainer.experiment_name=qwen2.5_7b_function_rm_kl1e-3 trainer.val_before_train=False
        trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=5
        trainer.total_epochs=10""".split(),
    "otb_trainer/run_qwen2_5-7b.sh": """
        algorithm.adv_estimator=optimal_token_baseline data.train_files=/data/x data.val_files=/data/x
        data.train_batch_size=128 data.max_prompt_length=1024 data.max_response_length=2048
        data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path=Qwen/Qwen2.5-7B
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.model.use_fused_kernels=False
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.use_dynamic_bsz=False actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.actor.ppo_mini_batch_size=128
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.calculate_sum_pi_squared=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.75 actor_rollout_ref.rollout.n=8
        trainer.logger=["console","wandb"] trainer.project_name=verl_grpo_example_gsm8k
        trainer.experiment_name=qwen2_5-7b-otb trainer.n_gpus_per_node=8 trainer.nnodes=1
        trainer.save_freq=-1 trainer.test_freq=5 trainer.total_epochs=15""".split(),
}


def test_plan_accepts_every_new_estimator(capsys):
    from flows.cli import main

    for name in ("remax", "opo", "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline"):
        assert main(["plan", "--config", "tiny-cpu", f"algorithm.adv_estimator={name}"]) == 0, name
        out = capsys.readouterr().out
        assert ("greedy baseline answers                60   = 60 prompts × 1" in out) == (name == "remax")
        assert ("old log-prob (rollout.log_prob_*) + Σπ² per token" in out) == (name == "optimal_token_baseline")


def test_plan_refuses_grpo_passk_with_one_answer_per_prompt(capsys):
    from flows.cli import main

    assert main(["plan", "--config", "tiny-cpu", "algorithm.adv_estimator=grpo_passk",
                 "actor_rollout_ref.rollout.n=1"]) == 2
    assert "grpo_passk needs at least 2 answers per prompt (actor_rollout_ref.rollout.n is 1)" in capsys.readouterr().err


def test_otb_forces_the_old_log_prob_pass():
    """On-policy GRPO needs no separate old-log-prob pass; optimal_token_baseline reads old log-probs
    and Σπ² at advantage time, so the logprob stage's actor pass runs and computes Σπ²."""
    from configs.loader import load_config
    from configs.suggest import make_plan

    one_mini = ["actor_rollout_ref.actor.ppo_mini_batch_size=60"]
    grpo = make_plan(load_config("tiny-cpu", one_mini + ["algorithm.adv_estimator=grpo"]))
    assert grpo["rollout"]["old_log_prob_pass"] is False and "sum_pi_squared" not in grpo["rollout"]
    otb = make_plan(load_config("tiny-cpu", one_mini + ["algorithm.adv_estimator=optimal_token_baseline"]))
    assert otb["rollout"]["old_log_prob_pass"] is True and otb["rollout"]["sum_pi_squared"] is True


@pytest.mark.parametrize("script", sorted(VERL_EXAMPLE_LINES))
def test_verl_example_plans(script, capsys):
    from flows.cli import main

    overrides = VERL_EXAMPLE_LINES[script]
    if "megatron" in script:
        # verl's Megatron trainer config: stagerl trains with DeepSpeed, so actor/ref.megatron.* are
        # unknown keys (refused, named); without them the plan is the FSDP script's
        assert main(["plan", *overrides]) == 2
        assert "unknown config key 'actor_rollout_ref.actor.megatron.pipeline_model_parallel_size'" in capsys.readouterr().err
        overrides = [o for o in overrides if ".megatron." not in o]
    assert main(["plan", *overrides]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Batch plan (config: base, verl's defaults + ")
    if "remax" in script:
        prompts = int(next(o for o in overrides if o.startswith("data.train_batch_size=")).split("=")[1])
        assert f"{prompts} prompts × 1 (algorithm.adv_estimator=remax needs a baseline" in out
    if "otb" in script:
        assert "+ Σπ² per token" in out
