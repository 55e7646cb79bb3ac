"""Advantage estimators, KL in reward, KL controllers and data metrics against hand-computed numbers.

Expected values are written as literal arithmetic (verl formulas, verl/trainer/ppo/core_algos.py), never
by calling the function under test.
"""
import json
import math

import numpy as np
import pytest
import torch

from stages.algos.advantages import (ADV_ESTIMATORS, compute_advantage, get_adv_estimator, masked_mean,
                               masked_var, masked_whiten)
from stages.algos.kl import (AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty,
                       make_kl_controller)
from stages.metrics import compute_data_metrics, reduce_metrics

T = torch.tensor
EPS = 1e-6


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=tol)


def whiten(xs):
    """Reference whitening of a python list: (x - mean)/sqrt(unbiased var + 1e-8)."""
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


# ------------------------------------------------------------------ masked statistics
def test_masked_stats_ignore_padding_and_use_bessel():
    x = T([[1.0, 2.0, 1000.0], [3.0, -500.0, 7.0]])
    m = T([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    close(masked_mean(x, m), 2.0)                        # (1+2+3)/3
    close(masked_var(x, m), 1.0)                         # ((1)+(0)+(1))/3 * 3/2
    close(masked_whiten(x, m)[m.bool()], [-1.0, 0.0, 1.0], tol=1e-4)


@pytest.mark.parametrize("mask, msg", [([[0, 0]], "no element"), ([[1, 0]], "exactly one")])
def test_masked_whiten_refuses_mask_sum_zero_or_one(mask, msg):
    with pytest.raises(ValueError, match=msg):
        masked_whiten(T([[1.0, 2.0]]), T(mask, dtype=torch.float32))


# ------------------------------------------------------------------ GRPO / Dr.GRPO
# rows: a,a,a (scores 1,0,0) | b alone (0.5) | c,c equal (1,1) | d,d with a row cut at max length
REWARDS = T([[0.0, 1.0, 0.0],     # a, reward at last valid token (index 1)
             [0.0, 0.0, 0.0],     # a
             [0.0, 0.0, 0.0],     # a
             [0.5, 0.0, 0.0],     # b, one valid token
             [0.0, 0.0, 1.0],     # c, no EOS: mask all ones
             [1.0, 0.0, 0.0],     # c
             [0.0, 0.0, 2.0],     # d, cut at max length
             [0.0, 0.0, 0.0]])    # d
MASK = T([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
UIDS = ["a", "a", "a", "b", "c", "c", "d", "d"]


def test_grpo_hand_numbers():
    adv, ret = get_adv_estimator("grpo")(REWARDS, MASK, np.array(UIDS, dtype=object))
    std_a = math.sqrt(((1 - 1 / 3) ** 2 + 2 * (0 - 1 / 3) ** 2) / 2)   # unbiased
    std_d = math.sqrt((1.0 ** 2 + 1.0 ** 2) / 1)                      # scores 2, 0 -> mean 1
    per_row = [(2 / 3) / (std_a + EPS), (-1 / 3) / (std_a + EPS), (-1 / 3) / (std_a + EPS),
               0.5 / (1.0 + EPS),                 # group of 1: mean 0, std 1
               0.0, 0.0,                          # equal rewards: std 0 -> 0/(0+eps) = 0
               1.0 / (std_d + EPS), -1.0 / (std_d + EPS)]
    expected = T(per_row).unsqueeze(-1) * MASK
    close(adv, expected)
    close(ret, expected)
    assert adv[0, 2] == 0 and adv[3, 1] == 0          # padding positions are exactly 0
    close(adv[6], [1.0 / (std_d + EPS)] * 3)          # cut response: every position carries A


def test_dr_grpo_no_std():
    adv, _ = compute_advantage("grpo", REWARDS, MASK, index=UIDS, norm_adv_by_std_in_grpo=False,
                               values=None, gamma=0.5)   # unused kwargs are not passed on
    per_row = [2 / 3, -1 / 3, -1 / 3, 0.5, 0.0, 0.0, 1.0, -1.0]
    close(adv, T(per_row).unsqueeze(-1) * MASK)


def test_grpo_index_length_checked():
    with pytest.raises(ValueError, match="index has 2 entries"):
        get_adv_estimator("grpo")(REWARDS, MASK, ["a", "b"])


# ------------------------------------------------------------------ RLOO
def test_rloo_hand_numbers():
    rewards = T([[1.0, 0.0], [0.0, 0.0], [0.25, 0.25], [3.0, 0.0]])
    mask = T([[1, 0], [1, 1], [1, 1], [1, 0]])
    adv, ret = get_adv_estimator("rloo")(rewards, mask, ["g", "g", "g", "solo"])
    # group g: scores 1, 0, 0.5 -> each minus the mean of the other two; solo: A = s
    per_row = [1 - (0 + 0.5) / 2, 0 - (1 + 0.5) / 2, 0.5 - (1 + 0) / 2, 3.0]
    close(adv, T(per_row).unsqueeze(-1) * mask)
    close(ret, adv)


# ------------------------------------------------------------------ REINFORCE++
def test_reinforce_plus_plus_return_reset_past_mask():
    rewards = T([[1.0, 0.0, 2.0], [0.0, 3.0, 5.0]])   # 5.0 sits past the mask: must not leak
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = get_adv_estimator("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    g_row0 = [1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2.0]
    g_row1 = [0 + 0.5 * 3, 3.0, 0.0]                 # 3 + 0.5*5 would mean no reset
    close(ret, [g_row0, g_row1])
    w = whiten(g_row0 + g_row1[:2])                  # over the 5 valid tokens
    close(adv, [w[:3], w[3:] + [0.0]], tol=1e-4)


def test_reinforce_plus_plus_baseline_hand_numbers():
    rewards = T([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [2.0, 0.0, 0.0]])
    mask = T([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    adv, ret = get_adv_estimator("reinforce_plus_plus_baseline")(rewards, mask, ["a", "a", "b"])
    # a: 1 - 2 = -1, 3 - 2 = +1; b alone: mean 0 -> 2; broadcast, whitened over 6 valid tokens
    w = whiten([-1.0, -1.0, 1.0, 1.0, 1.0, 2.0])
    close(adv, [[w[0], w[1], 0.0], w[2:5], [w[5], 0.0, 0.0]], tol=1e-4)
    close(ret, adv)


# ------------------------------------------------------------------ GAE
def test_gae_three_tokens_gamma_lam_below_one():
    gamma, lam = 0.9, 0.8
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    values = T([[0.5, 0.6, 0.7], [0.2, 0.4, 99.0]])   # 7.0 / 99.0 are padding: ignored
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, ret = get_adv_estimator("gae")(rewards, mask, values=values, gamma=gamma, lam=lam)
    a02 = 1.0 - 0.7
    a01 = (0 + 0.9 * 0.7 - 0.6) + 0.72 * a02
    a00 = (0 + 0.9 * 0.6 - 0.5) + 0.72 * a01
    a11 = 2.0 - 0.4                                   # next valid value is 0 (end of response)
    a10 = (0 + 0.9 * 0.4 - 0.2) + 0.72 * a11
    close(ret, [[a00 + 0.5, a01 + 0.6, a02 + 0.7], [a10 + 0.2, a11 + 0.4, 0.0]])
    w = whiten([a00, a01, a02, a10, a11])
    close(adv, [w[:3], w[3:] + [0.0]], tol=1e-4)


def test_gae_needs_values():
    with pytest.raises(TypeError):
        compute_advantage("gae", REWARDS, MASK)


def test_unknown_estimator_lists_registered_names():
    with pytest.raises(ValueError) as err:
        get_adv_estimator("ppo2")
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        assert name in str(err.value)
    assert set(ADV_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                   # verl's others (stages/algos/advantages.py, tests/test_advantages_verl.py)
                                   "remax", "opo", "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized",
                                   "optimal_token_baseline"}


# ------------------------------------------------------------------ KL estimators
LOGP, REF = T([-1.0, -2.0]), T([-1.5, -1.0])          # d = logp - ref = [0.5, -1.0]


@pytest.mark.parametrize("kinds, expected", [
    (("kl", "k1"), [0.5, -1.0]),
    (("abs",), [0.5, 1.0]),
    (("mse", "k2"), [0.5 * 0.25, 0.5 * 1.0]),
    (("low_var_kl", "k3"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
])
def test_kl_estimators(kinds, expected):
    for kind in kinds:
        close(kl_penalty(LOGP, REF, kind), expected)


def test_low_var_kl_clamps():
    # d = -30 -> x clamped to 20 -> e^20 - 21 -> 10; d = +30 -> x = -20 -> 19.0000... -> 10
    close(kl_penalty(T([-30.0, 30.0]), T([0.0, 0.0]), "low_var_kl"), [10.0, 10.0])


@pytest.mark.parametrize("kind", ["k1+", "abs+", "low_var_kl+", "k3+"])
def test_plus_suffix_is_straight_through(kind):
    logp = LOGP.clone().requires_grad_(True)
    value = kl_penalty(logp, REF, kind)
    close(value.detach(), kl_penalty(LOGP, REF, kind[:-1]))    # forward of the base estimator
    value.sum().backward()
    close(logp.grad, [0.5, -1.0])                              # d/dlogp of d^2/2 = d


def test_kl_full_and_unknown_refused():
    with pytest.raises(NotImplementedError):
        kl_penalty(LOGP, REF, "full")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "k4")


# ------------------------------------------------------------------ KL in reward, controllers
def test_apply_kl_penalty_fixed():
    scores = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    old, ref = T([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]), T([[-1.2, -0.9, -1.0], [-2.5, -2.0, 0.0]])
    ctrl = FixedKLController(0.1)
    rewards, kl, current_kl, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    kl_expected = [[0.2, -0.1, 0.0], [0.5, 0.0, 0.0]]          # padding: -2 - 0 masked to 0
    close(kl, kl_expected)
    close(rewards, [[-0.02, 0.01, 1.0], [-0.05, 1.0, 0.0]])
    expected_kl = ((0.2 - 0.1 + 0.0) / 3 + (0.5 + 0.0) / 2) / 2
    assert current_kl == pytest.approx(expected_kl, abs=1e-6)
    assert metrics == {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": 0.1}
    assert ctrl.value == 0.1


def test_adaptive_kl_controller_update_and_state_round_trip():
    ctrl = make_kl_controller("adaptive", kl_coef=0.2, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.15, n_steps=2)        # error clip(0.5) = 0.2
    assert ctrl.value == pytest.approx(0.2 * (1 + 0.2 * 2 / 100), rel=1e-12)
    ctrl.update(current_kl=0.09, n_steps=2)        # error -0.1
    assert ctrl.value == pytest.approx(0.2 * 1.004 * (1 - 0.1 * 2 / 100), rel=1e-12)
    ctrl.update(current_kl=0.0, n_steps=10)        # error clip(-1) = -0.2
    assert ctrl.value == pytest.approx(0.2 * 1.004 * 0.998 * (1 - 0.2 * 10 / 100), rel=1e-12)

    resumed = AdaptiveKLController(1.0, 1.0, 1)
    resumed.load_state_dict(json.loads(json.dumps(ctrl.state_dict())))
    for kl in (0.3, 0.05, 0.11):
        ctrl.update(kl, 8)
        resumed.update(kl, 8)
        assert resumed.value == ctrl.value         # bit-identical after JSON round trip
    with pytest.raises(ValueError, match="fixed"):
        resumed.load_state_dict(FixedKLController(0.1).state_dict())


def test_apply_kl_penalty_uses_pre_update_coefficient():
    ctrl = AdaptiveKLController(0.5, target_kl=0.1, horizon=10)
    scores, mask = T([[1.0, 0.0]]), T([[1, 1]])
    rewards, _, current_kl, metrics = apply_kl_penalty(scores, T([[0.0, 0.0]]), T([[-1.0, -1.0]]),
                                                       mask, ctrl, "kl")
    close(rewards, [[1.0 - 0.5, -0.5]])
    assert current_kl == pytest.approx(1.0)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 1 / 10))


# ------------------------------------------------------------------ data metrics
def test_compute_data_metrics_names_and_values():
    scores = T([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    rewards = T([[0.0, 0.9, 0.0], [0.0, 0.0, -0.1]])
    adv = T([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]])
    ret = T([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0]])
    values = T([[1.5, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mask = T([[1, 1, 0], [1, 1, 1]])
    attn = T([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])   # prompt width 2, response width 3
    m = compute_data_metrics(scores, rewards, adv, ret, mask, attn, values=values)
    assert (m["critic/score/mean"], m["critic/score/max"], m["critic/score/min"]) == (0.5, 1.0, 0.0)
    assert m["critic/rewards/mean"] == pytest.approx(0.4)
    assert m["critic/advantages/mean"] == pytest.approx(-1 / 5)
    assert m["critic/returns/max"] == 3.0
    # valid returns 2,1,0,1,3: unbiased var 5.2/4; returns - values = .5,0,-1,0,2: var 4.8/4
    assert m["critic/vf_explained_var"] == pytest.approx(1 - 1.2 / (1.3 + 1e-5), abs=1e-6)
    assert m["critic/values/mean"] == pytest.approx(5.5 / 5)
    assert (m["response_length/mean"], m["response_length/clip_ratio"]) == (2.5, 0.5)
    assert (m["prompt_length/min"], m["prompt_length/clip_ratio"]) == (1.0, 0.5)
    no_critic = compute_data_metrics(scores, rewards, adv, ret, mask, attn)
    assert "critic/values/mean" not in no_critic and "critic/vf_explained_var" not in no_critic


def test_reduce_metrics():
    out = reduce_metrics({"a/max_x": [1, 5, 2], "b/min": [3, -1], "actor/pg_loss": [1.0, 2.0, 6.0]})
    assert out == {"a/max_x": 5.0, "b/min": -1.0, "actor/pg_loss": 3.0}
