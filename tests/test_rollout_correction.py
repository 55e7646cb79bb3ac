"""Truncated importance sampling and verl's off-policy metrics (stages/algos/rollout_correction.py),
checked against numbers worked by hand."""
import math

import pytest
import torch

from configs.loader import load_config
from configs.schema import ConfigError
from stages.algos.rollout_correction import offpolicy_metrics, pad_rows, rollout_is_weights

# row 0: 2 valid tokens of 3 (a response cut short), row 1: 3 tokens where engine and trainer agree
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
ENGINE = torch.tensor([[-1.5, -1.0, 9.0], [-0.5, -0.5, -0.5]])  # 9.0 sits on padding: must not count
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_token_weights_are_truncated_ratios_zero_on_padding():
    # row 0 log-ratios old - engine: 0.5, -1.0 -> e^0.5 = 1.6487 truncated to 1.5, e^-1 = 0.3679
    w = rollout_is_weights(OLD, ENGINE, MASK, "token", 1.5)
    assert w.tolist()[0] == pytest.approx([1.5, math.exp(-1.0), 0.0])
    assert w.tolist()[1] == pytest.approx([1.0, 1.0, 1.0])
    assert not w.requires_grad


def test_sequence_weights_are_one_per_row():
    # row 0: exp(0.5 - 1.0) = e^-0.5 = 0.6065 on both valid tokens; row 1: e^0 = 1
    w = rollout_is_weights(OLD, ENGINE, MASK, "sequence", 2.0)
    assert w.tolist()[0] == pytest.approx([math.exp(-0.5), math.exp(-0.5), 0.0])
    assert w.tolist()[1] == pytest.approx([1.0, 1.0, 1.0])
    # a large ratio (3 tokens of log-ratio 2.9: e^8.7) is truncated at the threshold
    big = rollout_is_weights(torch.full((1, 3), -0.1), torch.full((1, 3), -3.0), torch.ones(1, 3), "sequence", 2.0)
    assert big.tolist() == [[2.0, 2.0, 2.0]]


def test_bad_level_and_threshold_are_named():
    with pytest.raises(ValueError, match="rollout_is='tok'"):
        rollout_is_weights(OLD, ENGINE, MASK, "tok")
    with pytest.raises(ValueError, match="rollout_is_threshold must be positive"):
        rollout_is_weights(OLD, ENGINE, MASK, "token", 0.0)


def test_offpolicy_metrics_by_hand():
    m = offpolicy_metrics(OLD, ENGINE, MASK)
    # 5 valid tokens; engine - old: -0.5, +1.0, 0, 0, 0
    assert m["rollout_corr/kl"] == pytest.approx(0.5 / 5)
    # k3 = E[e^x - x - 1], x = old - engine: (e^0.5 - 1.5) + (e^-1 + 1 - 1) = 0.148721 + 0.367879
    assert m["rollout_corr/k3_kl"] == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-1.0)) / 5)
    # per-sequence mean log p: trainer -1.5, -0.5; engine -1.25, -0.5
    assert m["rollout_corr/training_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.5)) / 2)
    assert m["rollout_corr/training_log_ppl"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx((math.exp(1.25) + math.exp(0.5)) / 2)
    assert m["rollout_corr/rollout_log_ppl"] == pytest.approx(0.875)
    # log_ppl_diff per row = engine mean - trainer mean: 0.25, 0
    assert (m["rollout_corr/log_ppl_diff"], m["rollout_corr/log_ppl_abs_diff"]) == pytest.approx((0.125, 0.125))
    assert (m["rollout_corr/log_ppl_diff_max"], m["rollout_corr/log_ppl_diff_min"]) == pytest.approx((0.25, 0.0))
    assert m["rollout_corr/ppl_ratio"] == pytest.approx((math.exp(0.25) + 1) / 2)
    # chi2_token = E[rho^2] - 1 = (e^1 + e^-2 + 1 + 1 + 1)/5 - 1; chi2_seq = mean(e^{2*(-0.5)}, e^0) - 1
    assert m["rollout_corr/chi2_token"] == pytest.approx((math.e + math.exp(-2) + 3) / 5 - 1)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((math.exp(-1.0) + 1) / 2 - 1)


def test_identical_policies_have_no_mismatch():
    m = offpolicy_metrics(OLD, OLD, MASK)
    assert m["rollout_corr/kl"] == 0 and m["rollout_corr/k3_kl"] == 0
    assert m["rollout_corr/chi2_token"] == pytest.approx(0.0, abs=1e-6)
    assert m["rollout_corr/training_ppl"] == m["rollout_corr/rollout_ppl"]


def test_pad_rows_keeps_each_rows_length():
    values, mask = pad_rows([[1.0, 2.0], [3.0]])
    assert values.tolist() == [[1.0, 2.0], [3.0, 0.0]] and mask.tolist() == [[1, 1], [1, 0]]


def test_config_requires_engine_log_probs():
    with pytest.raises(ConfigError, match="calculate_log_probs"):
        load_config("tiny-cpu", ["algorithm.rollout_correction.rollout_is=token"])
    with pytest.raises(ConfigError, match="rollout_is"):
        load_config("tiny-cpu", ["algorithm.rollout_correction.rollout_is=tokens",
                                 "actor_rollout_ref.rollout.calculate_log_probs=true"])
    cfg = load_config("tiny-cpu", ["algorithm.rollout_correction.rollout_is=sequence",
                                   "actor_rollout_ref.rollout.calculate_log_probs=true"])
    assert cfg["algorithm"]["rollout_correction"] == {"rollout_is": "sequence", "rollout_is_threshold": 2.0}


# ---- the update stage records the mismatch --------------------------------------------------------
def test_update_records_engine_mismatch_against_either_source_of_old_log_probs(tmp_path):
    """Engine log-probs stored as old + 0.25: with the logprob stage's pass (ppo_epochs=2) the
    trainer's old log-probs are the logprob table's, so rollout_corr/kl = 0.25 exactly; with the
    on-policy shortcut they come from the update's own forward (update/log_probs.parquet)."""
    from _update_inputs import make_ctx, write_inputs
    from stages import update
    from stages.model.tiny import save_tiny_model
    from storage.artifacts import read_file

    model_dir = save_tiny_model(tmp_path / "model")
    for name, overrides in (("pass", ["actor_rollout_ref.actor.ppo_epochs=2"]), ("shortcut", [])):
        ctx = make_ctx(tmp_path / name, model_dir, 1, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                                                       *overrides])
        assert ctx.plan["rollout"]["old_log_prob_pass"] is (name == "pass")
        write_inputs(ctx, engine_shift=0.25)
        update.run(ctx)
        metrics = read_file(ctx.store, ctx.layout, 1, "update", "update/metrics.json")
        engine = read_file(ctx.store, ctx.layout, 1, "rollout").column("rollout_log_probs").to_pylist()
        if name == "pass":
            assert metrics["rollout_corr/kl"] == pytest.approx(0.25, abs=1e-6)
            assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx(0.25, abs=1e-6)
            # k3 = e^-0.25 + 0.25 - 1 for every token
            assert metrics["rollout_corr/k3_kl"] == pytest.approx(math.exp(-0.25) - 0.75, abs=1e-6)
        else:
            old = read_file(ctx.store, ctx.layout, 1, "update", "update/log_probs.parquet").column("old_log_probs").to_pylist()
            diffs = [e - o for er, orow in zip(engine, old) for e, o in zip(er, orow)]
            assert metrics["rollout_corr/kl"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-5)


def test_update_applies_truncated_importance_weights(tmp_path):
    """Engine log-probs = old + ln 2, so every token's weight π_old/π_rollout is exactly 0.5: the
    first epoch's policy loss (same parameters) is half the uncorrected one, and the recorded mean
    weight is 0.5. (ppo_epochs=2: old log-probs come from the logprob table, as written.)"""
    from _update_inputs import make_ctx, write_inputs
    from stages import update
    from stages.model.tiny import save_tiny_model
    from storage.artifacts import read_file

    model_dir = save_tiny_model(tmp_path / "model")
    base = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.ppo_epochs=2",
            "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.actor.optim.lr=0"]
    runs = {}
    for name, extra in (("off", []), ("token", ["algorithm.rollout_correction.rollout_is=token"])):
        ctx = make_ctx(tmp_path / name, model_dir, 1, base + extra)
        write_inputs(ctx, engine_shift=math.log(2.0))
        update.run(ctx)
        runs[name] = read_file(ctx.store, ctx.layout, 1, "update", "update/metrics.json")
    assert runs["token"]["actor/rollout_is_weight"] == pytest.approx(0.5, abs=1e-6)
    assert "actor/rollout_is_weight" not in runs["off"]
    # lr 0: both epochs see the initial parameters, so the loss halves exactly (up to float rounding)
    assert runs["token"]["actor/pg_loss"] == pytest.approx(0.5 * runs["off"]["actor/pg_loss"], rel=1e-5)
