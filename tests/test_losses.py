"""PPO policy loss, value loss, agg_loss modes and global normalisers, entropy: hand-computed numbers
(verl/trainer/ppo/core_algos.py, verl/workers/actor/dp_actor.py)."""
import math

import pytest
import torch

from stages.algos.policy_losses import (AGG_MODES, POLICY_LOSSES, agg_loss, compute_policy_loss_vanilla,
                           compute_value_loss, entropy_from_logits, get_policy_loss)

T = torch.tensor


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=tol)


# ------------------------------------------------------------------ policy loss
# row 0: (A=+1, r=1.5) upper clip | (A=-1, r=0.5) lower clip | (A=-1, r=4) dual clip at c=3
# row 1: (A=+2, r=1) unclipped    | padding with garbage (A=-5, r=10) twice
RATIOS = [[1.5, 0.5, 4.0], [1.0, 10.0, 10.0]]
ADV = T([[1.0, -1.0, -1.0], [2.0, -5.0, -5.0]])
MASK = T([[1, 1, 1], [1, 0, 0]])
OLD = T([[-1.0, -2.0, -3.0], [-0.5, -1.0, -1.0]])
LOGP = OLD + torch.log(T(RATIOS))
# per-token losses: max(-A r, -A clip(r, 0.8, 1.28)), then min with -A*3 where A < 0
TOKEN_LOSS = [[-1.28, 0.8, 3.0], [-2.0, 0.0, 0.0]]


CONFIG = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}


def policy_loss(mode="token-mean", **kw):
    return compute_policy_loss_vanilla(OLD, LOGP, ADV, MASK, loss_agg_mode=mode, config=CONFIG, **kw)


def test_policy_loss_clip_fractions_and_kl():
    pg_loss, metrics = policy_loss()
    close(pg_loss, (-1.28 + 0.8 + 3.0 - 2.0) / 4)
    close(metrics["pg_clipfrac"], 2 / 4)        # upper clip (token 1) and lower clip (token 2)
    close(metrics["pg_clipfrac_lower"], 1 / 4)  # dual clip (token 3) only
    close(metrics["ppo_kl"], -(math.log(1.5) + math.log(0.5) + math.log(4.0) + 0.0) / 4)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (-1.28 + 0.8 + 3.0 - 2.0) / 4),
    ("seq-mean-token-sum", ((-1.28 + 0.8 + 3.0) + (-2.0)) / 2),
    ("seq-mean-token-mean", ((-1.28 + 0.8 + 3.0) / 3 + (-2.0) / 1) / 2),
    ("seq-mean-token-sum-norm", ((-1.28 + 0.8 + 3.0) + (-2.0)) / 3),   # / padded width T = 3
])
def test_policy_loss_agg_modes(mode, expected):
    close(policy_loss(mode)[0], expected)


def test_policy_loss_gradient_and_is_weights():
    logp = LOGP.clone().requires_grad_(True)
    loss = compute_policy_loss_vanilla(OLD, logp, ADV, MASK, loss_agg_mode="token-mean", config=CONFIG)[0]
    loss.backward()
    # only the unclipped valid token (A=+2, r=1) has a gradient: d(-A r)/dlogp = -A r / 4 tokens
    close(logp.grad, [[0.0, 0.0, 0.0], [-2.0 / 4, 0.0, 0.0]])
    weights = T([[2.0, 1.0, 1.0], [0.5, 1.0, 1.0]])
    close(policy_loss(rollout_is_weights=weights)[0], (-1.28 * 2 + 0.8 + 3.0 - 2.0 * 0.5) / 4)


def test_policy_loss_log_ratio_clamped_at_20():
    old, logp = T([[0.0]]), T([[25.0]])
    _, metrics = compute_policy_loss_vanilla(old, logp, T([[-1.0]]), T([[1]]), config={"clip_ratio_c": 3.0})
    close(metrics["ppo_kl"], -20.0)


def test_dual_clip_c_must_exceed_one():
    with pytest.raises(AssertionError, match="should be greater than 1.0, but get the value: 1.0"):
        compute_policy_loss_vanilla(OLD, LOGP, ADV, MASK, config={"clip_ratio_c": 1.0})


def test_policy_loss_registry():
    assert get_policy_loss("vanilla") is compute_policy_loss_vanilla
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"}
    with pytest.raises(NotImplementedError, match="bypass_mode.*available: vanilla, gspo"):
        get_policy_loss("bypass_mode")
    with pytest.raises(ValueError, match="Unknown policy loss_mode 'ppo'"):
        get_policy_loss("ppo")


# ------------------------------------------------------------------ value loss
def test_value_loss_clipping():
    vpreds = T([[2.0, 2.0, 0.2], [50.0, 0.0, 0.0]])
    values = T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])   # old values; clip range 0.5
    returns = T([[1.2, 3.0, 0.0], [-50.0, 0.0, 0.0]])
    mask = T([[1, 1, 1], [0, 0, 0]])                 # row 1 entirely padding
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # clipped preds 1.5, 1.5, 0.2: (0.64 vs 0.09), (1.0 vs 2.25 -> clipped wins), (0.04 vs 0.04)
    close(vf_loss, 0.5 * (0.64 + 2.25 + 0.04) / 3)
    close(vf_clipfrac, 1 / 3)
    vf_sum, _ = compute_value_loss(vpreds, returns, values, mask, 0.5, "seq-mean-token-sum")
    close(vf_sum, 0.5 * (0.64 + 2.25 + 0.04) / 1)   # the all-padding row is not counted


# ------------------------------------------------------------------ agg_loss and global normalisers
L = T([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 6.0, 9.0], [7.0, 7.0, 7.0]])
M = T([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])   # 3, 1, 2, 0 valid tokens


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 3 + 4 + 5 + 6) / 6),
    ("seq-mean-token-sum", (6 + 4 + 11) / 3),                      # row with no token excluded
    ("seq-mean-token-mean", (6 / 3 + 4 / 1 + 11 / 2) / 3),
    ("seq-mean-token-sum-norm", (6 + 4 + 11) / 3),                 # / padded width 3
])
def test_agg_loss_single_call(mode, expected):
    close(agg_loss(L, M, mode), expected)


def test_agg_loss_sum_norm_scale_factor_and_unknown_mode():
    close(agg_loss(L, M, "seq-mean-token-sum-norm", loss_scale_factor=7), 21 / 7)
    with pytest.raises(ValueError, match="Invalid loss_agg_mode: mean"):
        agg_loss(L, M, "mean")
    assert set(AGG_MODES) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                              "seq-mean-token-sum-norm"}


def test_token_mean_global_normaliser_exact_over_unequal_micro_batches():
    single = (1 + 2 + 3 + 4 + 5 + 6) / 6                          # 3.5
    micro1, mask1, micro2, mask2 = L[:1], M[:1], L[1:], M[1:]      # 3 tokens vs 3 tokens in 3 rows
    parts = [agg_loss(x, m, "token-mean", global_tokens=6) for x, m in ((micro1, mask1), (micro2, mask2))]
    close(sum(parts), single)
    # verl legacy: local token mean of each micro, scaled by rows_in_micro / rows_in_mini
    legacy = 1 / 4 * ((1 + 2 + 3) / 3) + 3 / 4 * ((4 + 5 + 6) / 3)
    close(legacy, 0.5 + 3.75)
    local = [agg_loss(x, m, "token-mean") for x, m in ((micro1, mask1), (micro2, mask2))]
    close(local[0] * 1 / 4 + local[1] * 3 / 4, legacy)
    assert abs(legacy - single) > 0.5                              # not the global token mean


def test_token_mean_global_normaliser_two_ranks_and_gradients():
    # rank 0 holds rows 0-1 (4 tokens), rank 1 rows 2-3 (2 tokens); gradients are averaged over ranks
    x = L.clone().requires_grad_(True)
    single = agg_loss(x, M, "token-mean")
    (g_single,) = torch.autograd.grad(single, x)
    per_rank = [agg_loss(x[r], M[r], "token-mean", global_tokens=6, dp_size=2) for r in (slice(0, 2), slice(2, 4))]
    averaged = (per_rank[0] + per_rank[1]) / 2
    close(averaged, 3.5)
    (g_split,) = torch.autograd.grad(averaged, x)
    close(g_split, g_single)
    close(g_single, M / 6)


@pytest.mark.parametrize("mode, expected", [
    ("seq-mean-token-sum", (6 + 4 + 11) / 3),
    ("seq-mean-token-mean", (6 / 3 + 4 / 1 + 11 / 2) / 3),
])
def test_seq_mean_global_rows_over_micro_batches(mode, expected):
    parts = [agg_loss(L[r], M[r], mode, global_rows=3) for r in (slice(0, 1), slice(1, 4))]
    close(sum(parts), expected)


# ------------------------------------------------------------------ entropy
def test_entropy_from_logits():
    v = 7
    close(entropy_from_logits(torch.zeros(2, 3, v)), torch.full((2, 3), math.log(v)))
    close(entropy_from_logits(torch.full((1, v), 5.0)), [math.log(v)])        # shift invariant
    probs = T([0.5, 0.25, 0.25])
    close(entropy_from_logits(torch.log(probs) + 3.0), 0.5 * math.log(2) + 2 * 0.25 * math.log(4))
    close(entropy_from_logits(T([[100.0, 0.0, 0.0]])), [0.0], tol=1e-4)        # one-hot -> 0
