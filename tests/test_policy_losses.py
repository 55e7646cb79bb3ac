"""verl's policy-loss modes (stages/algos/policy_losses.py; verl/trainer/ppo/core_algos.py): hand-computed
numbers on one 2x3 batch under every loss_agg_mode, a row with no valid token, micro-batch and rank
splits with the global normalisers, the config keys and their checks, verl's example command lines
through the plan, and the update stage training the tiny model with every mode."""
import math

import pytest
import torch

from configs.loader import load_config
from configs.schema import ConfigError
from configs.suggest import make_plan
from stages.algos.policy_losses import AGG_MODES, POLICY_LOSSES, get_policy_loss

T = torch.tensor
LN2 = math.log(2.0)


def sig(x):
    return 1 / (1 + math.exp(-x))


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=tol)


# ------------------------------------------------------------------ the batch
# row 0: a response cut at max length (all 3 tokens valid, no EOS), sequence-level advantages not
#        constant (as GAE gives): A = 0.5, 1, 1.5; ratios r = 1, 2, 2.
# row 1: one valid token (A = -1, r = 2), then padding holding garbage (A = -5, r = 10) that every
#        loss must ignore.
# eps_low = 0.2, eps_high = 0.28: clip(r) is clamp(r, 0.8, 1.28); dual-clip c = 3.
LOGP = T([[-1.0, -2.0, -0.5], [-1.0, -3.0, -3.0]])
RATIO = T([[1.0, 2.0, 2.0], [2.0, 10.0, 10.0]])
OLD = LOGP - torch.log(RATIO)
ADV = T([[0.5, 1.0, 1.5], [-1.0, -5.0, -5.0]])
MASK = T([[1, 1, 1], [1, 0, 0]])
CONFIG = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
          "tau_pos": 1.0, "tau_neg": 1.05,
          "policy_loss": {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                          "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}}
PPO_KL = -(0 + LN2 + LN2 + LN2) / 4          # mean of -log r over the 4 valid tokens


def with_keys(**policy_loss):
    return {**CONFIG, "policy_loss": {**CONFIG["policy_loss"], **policy_loss}}


def by_hand(row0, row1, mode):
    """The four loss_agg_modes on this batch from its valid per-token losses: row 0 has 3 valid
    tokens, row 1 has 1, the padded width is 3."""
    s0 = sum(row0)
    return {"token-mean": (s0 + row1) / 4,                   # 4 valid tokens
            "seq-mean-token-sum": (s0 + row1) / 2,           # 2 rows with tokens
            "seq-mean-token-mean": (s0 / 3 + row1 / 1) / 2,
            "seq-mean-token-sum-norm": (s0 + row1) / 3}[mode]  # / padded width 3


# Per loss: config, the valid per-token losses of row 0 and row 1, the aggregation verl forces
# (None: loss_agg_mode's), the metrics.
CASES = {
    # PPO clip: r=1, A=.5 -> -0.5 | r=2, A=1: max(-2, -1.28) = -1.28 | r=2, A=1.5: max(-3, -1.92) = -1.92
    # row 1: r=2, A=-1: max(2, 1.28) = 2, dual clip min(2, -A c = 3) = 2
    "vanilla": (CONFIG, [-0.5, -1.28, -1.92], 2.0, None,
                {"pg_clipfrac": 2 / 4, "ppo_kl": PPO_KL, "pg_clipfrac_lower": 0.0}),
    # sequence ratio s0 = exp((0 + ln2 + ln2) / 3) = 4^(1/3) = 1.587 > 1.28, so every token of row 0
    # is clipped: max(-A s0, -1.28 A) = -1.28 A = -0.64, -1.28, -1.92; s1 = 2, A = -1: max(2, 1.28) = 2.
    # always seq-mean-token-mean: ((-0.64 - 1.28 - 1.92) / 3 + 2) / 2 = 0.36
    "gspo": (CONFIG, [-0.64, -1.28, -1.92], 2.0, "seq-mean-token-mean",
             {"pg_clipfrac": 3 / 4, "ppo_kl": PPO_KL, "pg_clipfrac_lower": 0.0}),
    # gate f(r) = sigmoid(tau (r - 1)) 4 / tau, loss -f A; row 0 (A > 0): tau_pos = 1:
    # f(1) = 4 sigmoid(0) = 2 -> -0.5 * 2 = -1; f(2) = 4 sigmoid(1) -> -4 sig(1), -6 sig(1)
    # row 1 (A <= 0): tau_neg = 1.05: f(2) = 4 sigmoid(1.05) / 1.05 -> +f. always seq-mean-token-mean
    "sapo": (CONFIG, [-1.0, -4 * sig(1.0), -6 * sig(1.0)], 4 * sig(1.05) / 1.05, "seq-mean-token-mean",
             {"pg_clipfrac": 0.0, "ppo_kl": PPO_KL, "pg_clipfrac_lower": 0.0}),
    # -logp A: 1 * 0.5, 2 * 1, 0.5 * 1.5 | -(-1)(-1) = -1 (ratio unused)
    "gpg": (CONFIG, [0.5, 2.0, 0.75], -1.0, None, {}),
    # -sg[clip(r)] A logp: -1 * .5 * -1 = .5 | -1.28 * 1 * -2 = 2.56 | -1.28 * 1.5 * -.5 = .96
    # row 1: -1.28 * -1 * -1 = -1.28; r != clip(r) at 3 of 4 tokens
    "cispo": (CONFIG, [0.5, 2.56, 0.96], -1.28, None,
              {"pg_clipfrac": 3 / 4, "ppo_kl": PPO_KL, "pg_clipfrac_lower": 0.0}),
    # covariances (A - mean A)(logp - mean logp), mean A = 0.5, mean logp = -1.125:
    #   row 0: 0 * .125 = 0, .5 * -.875 = -.4375, 1 * .625 = .625 (PPO-clipped: excluded); row 1: -1.5 * .125 = -.1875
    # defaults lb=1, ub=5: no candidate, so the loss is PPO clip without dual clip = vanilla's here
    "clip_cov": (CONFIG, [-0.5, -1.28, -1.92], 2.0, None, {"pg_clipfrac": 0.0, "ppo_kl": PPO_KL}),
    # lb=-1, ub=1, ratio .5: max(1, int(.5 * 4)) = 2 tokens from the candidates {(0,0): 0, (1,0): -.1875}
    # (tokens (0,1), (0,2) are PPO-clipped): both get loss 0
    "clip_cov lb=-1 ub=1 ratio=.5": (with_keys(clip_cov_lb=-1.0, clip_cov_ub=1.0, clip_cov_ratio=0.5),
                                     [0.0, -1.28, -1.92], 0.0, None, {"pg_clipfrac": 2 / 4, "ppo_kl": PPO_KL}),
    # -A r, no clip: -.5, -2, -3 | 2; the max(1, int(4 * .0002)) = 1 largest covariance, (0,2) = .625,
    # gets + 0.1 |log r| = 0.1 ln2. ppo_kl is verl's mean |log r| = 3 ln2 / 4
    "kl_cov": (CONFIG, [-0.5, -2.0, -3.0 + 0.1 * LN2], 2.0, None, {"ppo_kl": 3 * LN2 / 4}),
    # ratio .75: int(4 * .75) = 3 largest: .625 (0,2), 0 (0,0) (|log r| = 0: unchanged), -.1875 (1,0); coef 1
    "kl_cov ratio=.75 coef=1": (with_keys(kl_cov_ratio=0.75, ppo_kl_coef=1.0),
                                [-0.5, -2.0, -3.0 + LN2], 2.0 + LN2, None, {"ppo_kl": 3 * LN2 / 4}),
}


def run(name, mode, old=OLD, logp=LOGP, adv=ADV, mask=MASK, config=None, **kw):
    loss_mode = name.split()[0]
    return POLICY_LOSSES[loss_mode](old, logp, adv, mask, loss_agg_mode=mode,
                                    config=CASES[name][0] if config is None else config, **kw)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_hand_computed_loss_and_metrics(name, mode):
    _, row0, row1, forced, metrics = CASES[name]
    loss, got = run(name, mode)
    close(loss, by_hand(row0, row1, forced or mode))
    assert got.keys() == metrics.keys()
    for key, value in metrics.items():
        close(got[key], value)


# GMPO per row: log r clipped on the advantage's side only, to <= 0.28 where A > 0 and >= -0.2
# where A < 0: row 0 [0, ln2, ln2] -> [0, .28, .28], ratio exp(.56 / 3), mean A = (0.5 + 1 + 1.5) / 3 = 1;
# row 1 ln2 stays (A < 0 is not clipped above), ratio 2, A = -1. Loss: mean over rows of -A ratio,
# whatever loss_agg_mode. Tokens with log r outside [-0.2, 0.28]: (0,1), (0,2) with A > 0, (1,0) with A < 0.
GEO_MEAN = (-1 * math.exp(0.56 / 3) + 2.0) / 2


@pytest.mark.parametrize("mode", AGG_MODES)
def test_geo_mean_hand_computed(mode):
    loss, metrics = POLICY_LOSSES["geo_mean"](OLD, LOGP, ADV, MASK, loss_agg_mode=mode, config=CONFIG)
    close(loss, GEO_MEAN)
    assert metrics.keys() == {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}
    close(metrics["pg_clipfrac"], 2 / 4)
    close(metrics["pg_clipfrac_lower"], 1 / 4)
    close(metrics["ppo_kl"], PPO_KL)


def test_gradients_follow_each_modes_definition():
    def grad(name, mode="token-mean"):
        logp = LOGP.clone().requires_grad_(True)
        run(name, mode, logp=logp)[0].backward()
        return logp.grad
    # gspo: row 0 clipped (no gradient); row 1's token d(-A s)/dlogp = -A s = 2, weighted 1/1 token x 1/2 rows
    close(grad("gspo"), [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # cispo: every token keeps -sg[clip(r)] A / 4 tokens, clipped or not
    close(grad("cispo"), [[-1 * 0.5 / 4, -1.28 / 4, -1.28 * 1.5 / 4], [1.28 / 4, 0.0, 0.0]])
    close(grad("gpg"), [[-0.5 / 4, -1 / 4, -1.5 / 4], [1 / 4, 0.0, 0.0]])
    # geo_mean: only unclipped log-ratios carry a gradient: row 0 token 0: -A0 ratio0 / 3 tokens / 2 rows;
    # row 1: -A1 * 2 / 1 / 2 = 1
    logp = LOGP.clone().requires_grad_(True)
    POLICY_LOSSES["geo_mean"](OLD, logp, ADV, MASK, config=CONFIG)[0].backward()
    close(logp.grad, [[-math.exp(0.56 / 3) / 6, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # clip_cov: the zeroed tokens lose their gradient; vanilla's unclipped token (0,0) -A/4 and row 1's -A r/4 = 0.5
    close(grad("clip_cov"), [[-0.5 / 4, 0.0, 0.0], [2.0 / 4, 0.0, 0.0]])
    close(grad("clip_cov lb=-1 ub=1 ratio=.5"), torch.zeros(2, 3))


def test_rollout_is_weights():
    w = T([[2.0, 1.0, 1.0], [0.5, 9.0, 9.0]])
    # gpg, token-mean: (0.5 * 2 + 2 + 0.75 + (-1) * 0.5) / 4
    close(run("gpg", "token-mean", rollout_is_weights=w)[0], (1.0 + 2.0 + 0.75 - 0.5) / 4)
    # geo_mean: a row's weight is the geometric mean of its valid tokens' weights: 2^(1/3) and 0.5
    loss, _ = POLICY_LOSSES["geo_mean"](OLD, LOGP, ADV, MASK, config=CONFIG, rollout_is_weights=w)
    close(loss, (-math.exp(0.56 / 3) * 2 ** (1 / 3) + 2.0 * 0.5) / 2)


# ------------------------------------------------------------------ a row with no valid token
EMPTY = dict(old=torch.cat([OLD, T([[-2.0, -2.0, -2.0]])]), logp=torch.cat([LOGP, T([[-1.0, -1.0, -1.0]])]),
             adv=torch.cat([ADV, T([[7.0, 7.0, 7.0]])]), mask=torch.cat([MASK, T([[0, 0, 0]])]))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_a_row_without_valid_tokens_changes_nothing(name, mode):
    """Its garbage (A = 7, r = e) is masked, it is no row of the seq-mean modes, the covariance
    selection ignores it, and the -norm mode divides by the same width."""
    close(run(name, mode, **EMPTY)[0], run(name, mode)[0])


def test_geo_mean_counts_a_row_without_tokens_as_verl_does():
    # verl: torch.mean over the call's rows, the empty row adds 0 to the sum and 1 to the count
    loss, _ = POLICY_LOSSES["geo_mean"](EMPTY["old"], EMPTY["logp"], EMPTY["adv"], EMPTY["mask"], config=CONFIG)
    close(loss, GEO_MEAN * 2 / 3)
    # with the update's normaliser (rows with >= 1 valid token) it is the same as without the row
    loss, _ = POLICY_LOSSES["geo_mean"](EMPTY["old"], EMPTY["logp"], EMPTY["adv"], EMPTY["mask"], config=CONFIG,
                                        global_rows=2)
    close(loss, GEO_MEAN)


# ------------------------------------------------------------------ splits and global normalisers
SUM_MODES = ["vanilla", "gspo", "sapo", "gpg", "geo_mean", "cispo"]
GLOBAL = {"global_tokens": 4.0, "global_rows": 2.0, "loss_scale_factor": 3}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", SUM_MODES)
def test_micro_batches_and_ranks_add_up_to_the_single_call(name, mode):
    """Rows 0 and 1 in two micro-batches (dp 1), or on two ranks (dp 2, gradients averaged):
    the same loss and gradient as one call, for every loss that sums per-token or per-row terms."""
    fn = POLICY_LOSSES[name]
    logp = LOGP.clone().requires_grad_(True)
    single = fn(OLD, logp, ADV, MASK, loss_agg_mode=mode, config=CONFIG)[0]
    (g_single,) = torch.autograd.grad(single, logp)
    for dp in (1, 2):
        parts = [fn(OLD[r], logp[r], ADV[r], MASK[r], loss_agg_mode=mode, config=CONFIG, dp_size=dp, **GLOBAL)[0]
                 for r in (slice(0, 1), slice(1, 2))]
        total = sum(parts) / dp
        (g_split,) = torch.autograd.grad(total, logp)
        close(total, single)
        close(g_split, g_single)


def test_clip_cov_and_kl_cov_select_per_micro_batch_as_verl():
    """verl calls the loss once per micro-batch (dp_actor.py, losses.py ppo_loss): the covariance's
    means and the number of tokens selected are the micro-batch's, so a split changes the loss."""
    def split(name, config):
        return sum(POLICY_LOSSES[name](OLD[r], LOGP[r], ADV[r], MASK[r], loss_agg_mode="token-mean",
                                       config=config, **GLOBAL)[0] for r in (slice(0, 1), slice(1, 2)))
    # kl_cov, defaults: alone, row 0 has means A = 1, logp = -7/6 and covariances -1/12, 0, 1/3: its top
    # token is (0,2) as in the single call; row 1 alone has one valid token, selected (at least 1 per
    # call): its loss becomes 2 + 0.1 ln2
    single = run("kl_cov", "token-mean")[0]
    close(single, (-0.5 - 2.0 - 3.0 + 0.1 * LN2 + 2.0) / 4)
    close(split("kl_cov", CONFIG), single + 0.1 * LN2 / 4)
    # clip_cov, lb = -0.1, ub = 1, ratio 0.5: one call has one candidate, (0,0) (cov 0; (1,0) has -0.1875);
    # split, row 0's (0,0) has cov -1/12 > -0.1 and row 1's token cov 0: both zeroed (1 per call)
    config = with_keys(clip_cov_lb=-0.1, clip_cov_ub=1.0, clip_cov_ratio=0.5)
    single = POLICY_LOSSES["clip_cov"](OLD, LOGP, ADV, MASK, config=config)[0]
    close(single, (0.0 - 1.28 - 1.92 + 2.0) / 4)
    close(split("clip_cov", config), single - 2.0 / 4)


def test_clip_cov_draws_at_random_among_more_candidates_than_it_keeps():
    # lb=-1, ub=1 and the default ratio: 2 candidates, max(1, int(.0002 * 4)) = 1 drawn by torch.randperm
    zeroed = set()
    for seed in range(20):
        torch.manual_seed(seed)
        loss = POLICY_LOSSES["clip_cov"](OLD, LOGP, ADV, MASK, config=with_keys(clip_cov_lb=-1.0, clip_cov_ub=1.0))[0]
        zeroed.add(round(float(loss) * 4, 4))
    assert zeroed == {round(-1.28 - 1.92 + 2.0, 4), round(-0.5 - 1.28 - 1.92, 4)}  # (0,0) or (1,0) zeroed


def test_ratio_keys_must_be_positive_when_used():
    with pytest.raises(AssertionError, match="clip_ratio should be larger than 0"):
        run("clip_cov", "token-mean", config=with_keys(clip_cov_ratio=0.0))
    with pytest.raises(AssertionError, match="kl_cov_ratio should be larger than 0"):
        run("kl_cov", "token-mean", config=with_keys(kl_cov_ratio=0.0))


def test_defaults_when_the_config_lacks_the_keys():
    # verl's dataclass defaults: clip_ratio 0.2 both sides, tau 1 / 1.05, ppo_kl_coef 0.1
    # (null: 1.0, as verl's `if ... is not None else 1.0`)
    for name in POLICY_LOSSES:
        POLICY_LOSSES[name](OLD, LOGP, ADV, MASK)
    null_coef = {"policy_loss": {"ppo_kl_coef": None}}
    close(POLICY_LOSSES["kl_cov"](OLD, LOGP, ADV, MASK, config=null_coef)[0], (-0.5 - 2 - 3 + LN2 + 2) / 4)


# ------------------------------------------------------------------ config, plan, verl's examples
A = "actor_rollout_ref.actor."


def test_registry_and_yaml_keys():
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo"}
    with pytest.raises(NotImplementedError, match="bypass_mode"):
        get_policy_loss("bypass_mode")
    actor = load_config("base")["actor_rollout_ref"]["actor"]
    assert (actor["tau_pos"], actor["tau_neg"]) == (1.0, 1.05)
    assert actor["policy_loss"] == {"loss_mode": "vanilla", "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
                                    "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}


@pytest.mark.parametrize("overrides, needle", [
    ([f"{A}policy_loss.loss_mode=clip_cov", f"{A}policy_loss.clip_cov_ratio=0"],
     "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.0: must be > 0 with loss_mode=clip_cov"),
    ([f"{A}policy_loss.loss_mode=kl_cov", f"{A}policy_loss.kl_cov_ratio=-1"],
     "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=-1.0: must be > 0 with loss_mode=kl_cov"),
    ([f"{A}policy_loss.loss_mode=bypass_mode"], "'bypass_mode' is not one of"),
    ([f"{A}policy_loss.ppo_kl_coef=high"], "policy_loss.ppo_kl_coef: expected float"),
    ([f"{A}clip_ratio_c=1.0"], "clip_ratio_c: the lower bound"),  # vanilla reads it
])
def test_bad_values_are_refused_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config("tiny-cpu", overrides)
    assert needle in str(info.value)


def test_checks_apply_only_to_the_mode_that_reads_the_key():
    # as verl: the ratio asserts live in clip_cov / kl_cov, the dual-clip assert in vanilla
    load_config("tiny-cpu", [f"{A}policy_loss.clip_cov_ratio=0", f"{A}policy_loss.kl_cov_ratio=0"])
    load_config("tiny-cpu", [f"{A}policy_loss.loss_mode=gspo", f"{A}clip_ratio_c=1.0"])


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES))
def test_stagerl_plan_accepts_every_mode(mode, capsys):
    from flows.cli import main

    assert main(["plan", "--config", "tiny-cpu", f"{A}policy_loss.loss_mode={mode}"]) in (0, None)
    assert "Batch plan" in capsys.readouterr().out


# verl's example scripts that set a loss mode (examples/*_trainer/*.sh at verl b178a3c, shell
# variables expanded, SLURM/cluster sizes set to one node of 8 GPUs where the script reads them from
# the environment): their loss keys and the keys the batch plan reads. Their other keys lie outside
# this feature: unknown to stagerl (model.torch_dtype, actor.entropy_checkpointing, optim.clip_grad,
# fsdp_config.strategy, the Megatron scripts' actor.megatron.*, the DAPO scripts'
# reward_model.reward_kwargs.overlong_buffer_cfg.*) or <fixed> (model.override_config).
R, REF = "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."
VERL_EXAMPLES = {
    "cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh": [
        "algorithm.adv_estimator=grpo", f"{A}policy_loss.loss_mode=cispo", f"{A}clip_ratio_low=10",
        f"{A}clip_ratio_high=0.2", "data.train_batch_size=256", "data.max_prompt_length=1024",
        "data.max_response_length=1024", "actor_rollout_ref.model.use_remove_padding=True",
        f"{A}ppo_mini_batch_size=128", f"{A}ppo_micro_batch_size_per_gpu=16", f"{A}use_kl_loss=True",
        f"{R}log_prob_micro_batch_size_per_gpu=16", f"{R}tensor_model_parallel_size=1", f"{R}n=5",
        f"{REF}log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=1", "trainer.nnodes=1"],
    "gmpo_trainer/run_qwen2_5-7b_math.sh": [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "data.max_prompt_length=1024",
        "data.max_response_length=1024", "actor_rollout_ref.model.use_remove_padding=True",
        f"{A}ppo_mini_batch_size=256", f"{A}ppo_micro_batch_size_per_gpu=16", f"{A}use_kl_loss=False",
        f"{A}policy_loss.loss_mode=geo_mean", f"{A}clip_ratio_low=0.4", f"{A}clip_ratio_high=0.4",
        f"{R}log_prob_micro_batch_size_per_gpu=16", f"{R}tensor_model_parallel_size=2", f"{R}n=5",
        f"{REF}log_prob_micro_batch_size_per_gpu=16", "trainer.n_gpus_per_node=8", "trainer.nnodes=1"],
    "gmpo_trainer/test_dapo_qwen3_30b_math.sh": [
        "data.max_prompt_length=2048", "data.max_response_length=8192", "data.train_batch_size=512", f"{R}n=16",
        "algorithm.adv_estimator=grpo", f"{A}use_kl_loss=False", f"{A}policy_loss.loss_mode=geo_mean",
        f"{A}clip_ratio_low=0.4", f"{A}clip_ratio_high=0.4", "actor_rollout_ref.model.use_remove_padding=True",
        f"{A}use_dynamic_bsz=True", f"{REF}log_prob_use_dynamic_bsz=True", f"{R}log_prob_use_dynamic_bsz=True",
        f"{A}ppo_max_token_len_per_gpu=20480", f"{REF}log_prob_max_token_len_per_gpu=30720",
        f"{R}log_prob_max_token_len_per_gpu=30720", f"{A}ppo_mini_batch_size=32",
        f"{A}loss_agg_mode=token-mean", f"{A}ulysses_sequence_parallel_size=4",
        f"{R}tensor_model_parallel_size=4", f"{REF}ulysses_sequence_parallel_size=4",
        "trainer.n_gpus_per_node=8", "trainer.nnodes=8"],
    "gpg_trainer/run_qwen2-7b_math.sh": [
        "algorithm.adv_estimator=gpg", "data.train_batch_size=1024", "data.max_prompt_length=1024",
        "data.max_response_length=1024", "actor_rollout_ref.model.use_remove_padding=True",
        f"{A}ppo_mini_batch_size=256", f"{A}ppo_micro_batch_size_per_gpu=16", f"{A}use_kl_loss=False",
        f"{A}policy_loss.loss_mode=gpg", f"{R}log_prob_micro_batch_size_per_gpu=16",
        f"{R}tensor_model_parallel_size=2", f"{R}n=5", f"{REF}log_prob_micro_batch_size_per_gpu=16",
        "trainer.n_gpus_per_node=8", "trainer.nnodes=1"],
    "gspo_trainer/run_qwen30b_gspo.sh": [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=2048",
        "data.max_response_length=8192", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
        "actor_rollout_ref.model.use_remove_padding=True", f"{A}use_kl_loss=False", f"{A}clip_ratio_low=3e-4",
        f"{A}clip_ratio_high=4e-4", f"{A}clip_ratio_c=10.0", f"{A}policy_loss.loss_mode=gspo",
        f"{A}use_dynamic_bsz=True", f"{A}ppo_mini_batch_size=32", f"{A}ppo_max_token_len_per_gpu=30720",
        f"{R}tensor_model_parallel_size=4", f"{R}data_parallel_size=1", f"{R}n=16"],
    "gspo_trainer/test_gspo_3b_math.sh": [
        "algorithm.adv_estimator=grpo", f"{A}policy_loss.loss_mode=gspo", "data.train_batch_size=512",
        "data.max_prompt_length=2048", "data.max_response_length=8192", f"{R}n=16", f"{A}use_kl_loss=false",
        f"{A}clip_ratio_low=0.0003", f"{A}clip_ratio_high=0.0004",
        "actor_rollout_ref.model.use_remove_padding=true", f"{A}use_dynamic_bsz=true",
        f"{REF}log_prob_use_dynamic_bsz=true", f"{R}log_prob_use_dynamic_bsz=true",
        f"{A}ppo_max_token_len_per_gpu=20480", f"{REF}log_prob_max_token_len_per_gpu=30720",
        f"{R}log_prob_max_token_len_per_gpu=30720", f"{A}ppo_mini_batch_size=128",
        f"{A}ppo_micro_batch_size_per_gpu=8", f"{A}loss_agg_mode=seq-mean-token-mean",
        f"{A}ulysses_sequence_parallel_size=1", f"{R}tensor_model_parallel_size=1",
        f"{REF}ulysses_sequence_parallel_size=1", "trainer.n_gpus_per_node=8", "trainer.nnodes=1"],
    "gspo_trainer/test_gspo_qwen30b_a3b_ep.sh": [
        "data.max_prompt_length=2048", "data.max_response_length=8192", "data.train_batch_size=256", f"{R}n=16",
        f"{A}policy_loss.loss_mode=gspo", "algorithm.adv_estimator=grpo", f"{A}use_kl_loss=False",
        f"{A}clip_ratio_low=3e-4", f"{A}clip_ratio_high=4e-4", f"{A}clip_ratio_c=10.0",
        f"{A}use_dynamic_bsz=True", f"{REF}log_prob_use_dynamic_bsz=True", f"{R}log_prob_use_dynamic_bsz=True",
        f"{A}ppo_max_token_len_per_gpu=10240", f"{REF}log_prob_max_token_len_per_gpu=30720",
        f"{R}log_prob_max_token_len_per_gpu=30720", f"{A}ppo_mini_batch_size=32",
        f"{A}loss_agg_mode=token-mean", f"{R}tensor_model_parallel_size=1", f"{R}data_parallel_size=4",
        "trainer.n_gpus_per_node=8", "trainer.nnodes=2"],
    "sapo_trainer/run_qwen30b_sapo.sh": [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=256", "data.max_prompt_length=2048",
        "data.max_response_length=8192", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
        "actor_rollout_ref.model.use_remove_padding=True", f"{A}use_kl_loss=False", f"{A}tau_pos=1.0",
        f"{A}tau_neg=1.05", f"{A}policy_loss.loss_mode=sapo", f"{A}use_dynamic_bsz=True",
        f"{A}ppo_mini_batch_size=32", f"{A}ppo_max_token_len_per_gpu=30720",
        f"{A}ulysses_sequence_parallel_size=4", f"{R}tensor_model_parallel_size=4", f"{R}data_parallel_size=1",
        f"{R}n=16"],
}


GSPO_TINY_CLIP = ((-0.5 - 1.0 - 1.5) * 1.0004 / 3 + 2.0) / 2  # s0 = 4^(1/3) clipped at 1 + 4e-4; s1 = 2, A = -1
GEO_MEAN_04 = (-math.exp(0.8 / 3) + 2.0) / 2  # row 0: log r = 0, ln2, ln2 clipped at 0.4; row 1: A < 0, unclipped
# The loss of each example's mode and actor keys on this file's 2x3 batch, by hand:
VERL_EXAMPLE_LOSSES = {
    # cispo, clip range [1 - 10, 1.2]: -1 * .5 * -1, -1.2 * 1 * -2, -1.2 * 1.5 * -.5 | -1.2 * -1 * -1; token-mean
    "cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh": (0.5 + 2.4 + 0.9 - 1.2) / 4,
    "gmpo_trainer/run_qwen2_5-7b_math.sh": GEO_MEAN_04,
    "gmpo_trainer/test_dapo_qwen3_30b_math.sh": GEO_MEAN_04,
    "gpg_trainer/run_qwen2-7b_math.sh": (0.5 + 2.0 + 0.75 - 1.0) / 4,  # -logp A, token-mean
    "gspo_trainer/run_qwen30b_gspo.sh": GSPO_TINY_CLIP,
    "gspo_trainer/test_gspo_3b_math.sh": GSPO_TINY_CLIP,
    "gspo_trainer/test_gspo_qwen30b_a3b_ep.sh": GSPO_TINY_CLIP,  # token-mean asked, gspo's own aggregation used
    "sapo_trainer/run_qwen30b_sapo.sh": ((-1.0 - 4 * sig(1.0) - 6 * sig(1.0)) / 3 + 4 * sig(1.05) / 1.05) / 2,
}


@pytest.mark.parametrize("script", list(VERL_EXAMPLES))
def test_verl_example_loss_keys_plan(script):
    """verl's example command line plans, and its loss mode with its actor keys (clip ratios, taus,
    loss_agg_mode, as the update passes them) gives the hand-computed loss on this file's batch."""
    cfg = load_config("base", VERL_EXAMPLES[script])
    make_plan(cfg)
    actor = cfg["actor_rollout_ref"]["actor"]
    mode = next(o.split("=")[1] for o in VERL_EXAMPLES[script] if "loss_mode=" in o)
    assert actor["policy_loss"]["loss_mode"] == mode
    loss, _ = get_policy_loss(mode)(OLD, LOGP, ADV, MASK, loss_agg_mode=actor["loss_agg_mode"], config=actor)
    close(loss, VERL_EXAMPLE_LOSSES[script])


# ------------------------------------------------------------------ the update stage, every mode
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from stages.model.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def train(tmp_path, model_dir, mode, micro=2):
    """The update stage on hand-built inputs (tests/_update_inputs.py): two mini-batches, so the old
    log-probs come from the logprob table and the ratios are not 1."""
    from safetensors.torch import load_file

    from _update_inputs import make_ctx, write_inputs
    from stages import update
    from storage.artifacts import read_file

    ctx = make_ctx(tmp_path, model_dir, 1, [f"{A}policy_loss.loss_mode={mode}", f"{A}ppo_mini_batch_size=2",
                                            f"{A}ppo_micro_batch_size_per_gpu={micro}",
                                            f"{A}policy_loss.clip_cov_lb=-10", f"{A}policy_loss.kl_cov_ratio=0.2"])
    assert not ctx.plan["actor"]["on_policy"]
    write_inputs(ctx)
    update.run(ctx)
    metrics = read_file(ctx.store, ctx.layout, 1, "update", "update/metrics.json")
    return metrics, load_file(f"{ctx.store.path(ctx.layout.weights(1))}/model.safetensors")


@pytest.mark.parametrize("mode", sorted(set(POLICY_LOSSES) - {"vanilla"}))
def test_update_stage_trains_with_every_mode(mode, tmp_path, model_dir):
    """Micro-batches of 2 rows: every parameter with a gradient moves, the loss metric is finite."""
    from safetensors.torch import load_file

    metrics, trained = train(tmp_path, model_dir, mode)
    init = load_file(str(model_dir / "model.safetensors"))
    moved = [k for k in init if not torch.equal(init[k], trained[k])]
    assert len(moved) >= len(init) - 1, sorted(set(init) - set(moved))  # the key bias may have no gradient
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/optimizer_steps"] == 2
    if mode != "gpg":  # verl's gpg reports no metric
        assert math.isfinite(metrics["actor/ppo_kl"]) and metrics["actor/ppo_kl"] != 0.0


@pytest.mark.parametrize("mode", ["gspo", "geo_mean", "sapo"])
def test_update_stage_split_invariance_of_the_modes_own_aggregation(mode, tmp_path, model_dir):
    """gspo / sapo (always seq-mean-token-mean) and geo_mean (row mean) get the update's global row
    count: one micro-batch per mini-batch or one row per micro-batch train the same."""
    one, w_one = train(tmp_path / "one", model_dir, mode, micro=4)
    rows, w_rows = train(tmp_path / "rows", model_dir, mode, micro=1)
    assert math.isclose(one["actor/pg_loss"], rows["actor/pg_loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(one["actor/grad_norm"], rows["actor/grad_norm"], rel_tol=1e-5)
    # all weights together (Adam's first step turns float noise on a zero gradient into +-lr: tests/test_update.py)
    flat_one, flat_rows = (torch.cat([w[k].flatten() for k in sorted(w_one)]) for w in (w_one, w_rows))
    assert float((flat_rows - flat_one).norm() / flat_one.norm()) <= 1e-5
