"""optimal_token_baseline through the stages on the tiny CPU model: the plan keeps the logprob stage's
actor pass, which stores Σ_v π_v² per token beside old_log_probs; the advantage stage reads both."""
import pytest
import torch

from stages import advantage, logprob, reward, rollout
from storage.artifacts import read_table
from tests._rollout_setup import make_assets, make_ctx

# one mini-batch (4 prompts × n 2 = 8 rows, one rank): on-policy, so only the estimator's needs
# keep the separate old-log-prob pass
OTB = ["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.use_kl_loss=false"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def test_logprob_stores_sum_pi_squared_and_otb_uses_it(tmp_path, assets):
    fn = tmp_path / "reward_fn.py"  # score = characters / 10: non-zero, different between answers
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return len(solution_str) / 10\n")
    ctx = make_ctx(tmp_path / "store", assets, OTB + [f"custom_reward_function.path={fn}",
                                                      "custom_reward_function.name=compute_score"])
    assert ctx.plan["rollout"]["old_log_prob_pass"] and ctx.plan["rollout"]["sum_pi_squared"]
    rollout.run(ctx)
    logprob.run(ctx)
    reward.run(ctx)
    rows = read_table(ctx.store, ctx.layout, 1, "rollout")
    lp = read_table(ctx.store, ctx.layout, 1, "logprob")
    assert {"old_log_probs", "entropy", "sum_pi_squared"} <= set(lp.schema.names)

    # Σπ² of row 0 from a plain forward: softmax(logits / temperature), squared, summed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets[0], dtype=torch.float32).eval()
    temperature = float(ctx.get("actor_rollout_ref.rollout.temperature"))
    prompt, response = rows.column("prompt_ids")[0].as_py(), rows.column("response_ids")[0].as_py()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature
    pi = torch.softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(response)], dim=-1)
    assert lp.column("sum_pi_squared")[0].as_py() == pytest.approx((pi ** 2).sum(-1).tolist(), rel=1e-4)
    chosen = pi.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)
    assert lp.column("old_log_probs")[0].as_py() == pytest.approx(torch.log(chosen).tolist(), abs=1e-4)

    advantage.run(ctx)
    adv = read_table(ctx.store, ctx.layout, 1, "advantage").column("advantages").to_pylist()
    score = read_table(ctx.store, ctx.layout, 1, "reward").column("score").to_pylist()
    assert len(set(score)) > 1
    # verl's OTB from the stored columns: G_t = score (outcome at the last token); W_t = running sum
    # of 1 - 2 exp(old_t) + Σπ²_t; per group and position B_t = Σ G W / (Σ W + 1e-8) over the
    # answers still running at t; A_t = G_t - B_t
    uids, old, pi2 = (rows.column("uid").to_pylist(), lp.column("old_log_probs").to_pylist(),
                      lp.column("sum_pi_squared").to_pylist())
    w = [[sum(1 - 2 * pow(2.718281828459045, o) + p for o, p in zip(old[i][:t + 1], pi2[i][:t + 1]))
          for t in range(len(old[i]))] for i in range(len(uids))]
    for i, uid in enumerate(uids):
        group = [j for j, u in enumerate(uids) if u == uid]
        for t in range(len(old[i])):
            live = [j for j in group if t < len(old[j])]
            b = sum(score[j] * w[j][t] for j in live) / (sum(w[j][t] for j in live) + 1e-8)
            assert adv[i][t] == pytest.approx(score[i] - b, abs=1e-5), (i, t)


def test_otb_without_sum_pi_squared_is_refused(tmp_path, assets):
    """A logprob.parquet made without Σπ² (another estimator's) cannot feed optimal_token_baseline."""
    grpo = make_ctx(tmp_path / "store", assets, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ppo_epochs=2"])
    rollout.run(grpo)
    logprob.run(grpo)
    reward.run(grpo)
    otb = make_ctx(tmp_path / "store", assets, OTB)
    with pytest.raises(advantage.AdvantageInputError, match="no 'sum_pi_squared'.*optimal_token_baseline"):
        advantage.run(otb)
