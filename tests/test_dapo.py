"""DAPO: the overlong reward buffer (verl's DAPORewardManager) and dynamic sampling
(algorithm.filter_groups: generate until train_batch_size groups have a varied metric), on the tiny
model with a reward that is constant for some prompts and varies for others."""
import pytest

from _rollout_setup import make_assets, make_ctx
from configs.loader import load_config
from configs.schema import ConfigError
from stages import reward as reward_stage
from stages import rollout
from stages.algos.dynamic_sampling import DynamicSamplingError, metric_values, varied_groups
from storage.artifacts import read_file, read_manifest

# answers divisible by 3: the score is the response length's parity (varies within most groups); others:
# always 0 (the whole group is equal: filtered)
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2) if int(ground_truth) % 3 == 0 else 0.0
'''
ZERO = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("dapo"))


def test_overlong_penalty_by_hand():
    # max_response_length 12, buffer 4: the penalty starts after 8 tokens, -1/4 per token, -1 at 12
    assert reward_stage.overlong_penalties([5, 8, 9, 12], 12, 4, 1.0) == [0.0, 0.0, -0.25, -1.0]
    assert reward_stage.overlong_penalties([10], 12, 4, 0.5) == [-0.25]  # (10 - 8) / 4 × 0.5


def test_group_std_and_metrics():
    assert varied_groups(["a", "a", "b", "b", "c"], [1.0, 0.0, 1.0, 1.0, 0.0]) == {"a": 0.5, "b": 0.0, "c": 0.0}
    results = [{"score": 0.5, "acc": True, "error": None}, {"score": 0.5, "acc": None, "error": "boom"}]
    assert metric_values("acc", results, [0.25, -1.0]) == [1.0, 0.0]  # a scorer error counts 0
    assert metric_values("score", results, [0.25, -1.0]) == [0.5, 0.5]  # the raw score
    assert metric_values("seq_reward", results, [0.25, -1.0]) == [0.25, -1.0]  # with the overlong penalty


def test_config_checks_name_the_keys():
    with pytest.raises(ConfigError, match="filter_groups.metric"):
        load_config("tiny-cpu", ["algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match="reward_manager=dapo"):
        load_config("tiny-cpu", ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4"])
    with pytest.raises(ConfigError, match="overlong_buffer.len=40"):
        load_config("tiny-cpu", ["reward_model.overlong_buffer.enable=true", "reward_model.reward_manager=dapo",
                                 "reward_model.overlong_buffer.len=40", "data.max_response_length=32"])
    with pytest.raises(ConfigError, match="seq_final_reward"):
        load_config("tiny-cpu", ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
                                 "algorithm.use_kl_in_reward=true"])


def dapo_ctx(tmp_path, assets, reward_text=REWARD, step=1, extra=()):
    path = tmp_path / "reward.py"
    path.write_text(reward_text)
    return make_ctx(tmp_path / "store", assets, [
        "actor_rollout_ref.rollout.n=4", "data.train_batch_size=2", "data.gen_batch_size=3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=seq_reward", "algorithm.filter_groups.max_num_gen_batches=6",
        f"custom_reward_function.path={path}", "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
        "reward_model.overlong_buffer.penalty_factor=0.1", *extra], step=step)


def test_dynamic_sampling_keeps_varied_groups_and_stores_every_answer(tmp_path, assets):
    ctx = dapo_ctx(tmp_path, assets)
    rollout.run(ctx)
    kept = read_file(ctx.store, ctx.layout, 1, "rollout").to_pydict()
    cand = read_file(ctx.store, ctx.layout, 1, "rollout", "rollout/candidates.parquet").to_pydict()
    extra = read_manifest(ctx.store, ctx.layout, 1, "rollout")["extra"]
    fg = extra["filter_groups"]
    # the step trains train_batch_size × n rows, from 2 groups with a varied score
    assert len(kept["uid"]) == 2 * 4 and len(set(kept["uid"])) == 2
    # every generated answer is stored: gen_batches × gen_batch_size prompts × n
    assert len(cand["uid"]) == fg["gen_batches"] * 3 * 4 == fg["generated_rows"]
    assert len(set(cand["uid"])) == fg["gen_batches"] * 3  # uids unique across generation batches
    by_uid = {}
    for uid, metric, std, is_kept, reason in zip(cand["uid"], cand["metric"], cand["group_std"], cand["kept"],
                                                 cand["reason"]):
        by_uid.setdefault(uid, []).append((metric, std, is_kept, reason))
    for uid, rows in by_uid.items():
        metrics = [r[0] for r in rows]
        if rows[0][3].startswith("filtered"):
            assert len(set(metrics)) == 1 and rows[0][1] == 0 and not rows[0][2]
        else:
            assert len(set(metrics)) > 1 and rows[0][1] > 0
        assert rows[0][2] == (uid in kept["uid"])
    assert fg["gen_batches"] >= 2 and fg["filtered_prompts"] >= 1  # this seed exercises the filter
    assert fg["kept_prompts"] == 2 and fg["filtered_prompts"] == sum(
        r[0][3].startswith("filtered") for r in by_uid.values())
    # the reward stage scores the kept rows as dynamic sampling did (same reward, same overlong penalty)
    reward_stage.run(ctx)
    table = read_file(ctx.store, ctx.layout, 1, "reward").to_pydict()
    scores = table["score"]
    # DAPO's overlong buffer: -(length - (12 - 4)) / 4 × 0.1 per answer, in its own column
    assert table["overlong_reward"] == pytest.approx([min(0.0, -(n - 8) / 4 * 0.1) for n in kept["response_length"]])
    assert table["overlong"] == [n > 8 for n in kept["response_length"]]
    cand_metric = {(u, s): m for u, s, m in zip(cand["uid"], cand["sample_index"], cand["metric"])}
    assert scores == pytest.approx([cand_metric[(u, s)] for u, s in zip(kept["uid"], kept["sample_index"])])
    # the prompts consumed: the data position moved gen_batches × 3 prompts
    assert extra["data_position"]["index"] == fg["gen_batches"] * 3
    # step 2 continues where step 1 stopped (its manifest), not at the fixed position of batch 2
    from stages.algos.dynamic_sampling import start_position

    assert start_position(dapo_ctx(tmp_path, assets, step=2), None) == extra["data_position"]


def test_too_few_varied_groups_fails_with_the_counts(tmp_path, assets):
    # every score 0 and no overlong penalty (it varies with the sampled lengths): no group varies
    ctx = dapo_ctx(tmp_path, assets, reward_text=ZERO, extra=["algorithm.filter_groups.max_num_gen_batches=2",
                                                              "reward_model.overlong_buffer.enable=false"])
    with pytest.raises(DynamicSamplingError, match=r"0 of data.train_batch_size=2 groups .* after 2 generation "
                                                   r"batches .*max_num_gen_batches=2"):
        rollout.run(ctx)
    assert read_manifest(ctx.store, ctx.layout, 1, "rollout") is None  # nothing committed


# verl's DAPO end-to-end recipe (tests/special_e2e/run_dapo.sh, NUM_GPUS=8, shell variables expanded)
VERL_DAPO = ("reward_model.reward_manager=dapo algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False "
             "algorithm.kl_ctrl.kl_coef=0.0 actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0 "
             "actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28 "
             "data.max_prompt_length=1024 data.max_response_length=2048 reward_model.overlong_buffer.enable=True "
             "reward_model.overlong_buffer.len=128 reward_model.overlong_buffer.penalty_factor=1.0 "
             "actor_rollout_ref.actor.loss_agg_mode=token-mean data.train_batch_size=256 data.gen_batch_size=1024 "
             "algorithm.filter_groups.enable=True algorithm.filter_groups.metric=seq_reward "
             "algorithm.filter_groups.max_num_gen_batches=10 actor_rollout_ref.actor.optim.lr=1e-6 "
             "actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.model.use_fused_kernels=True "
             "actor_rollout_ref.rollout.n=4 actor_rollout_ref.actor.ppo_mini_batch_size=128 "
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 actor_rollout_ref.actor.fsdp_config.param_offload=False "
             "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False "
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 "
             "actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm "
             "actor_rollout_ref.rollout.gpu_memory_utilization=0.8 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2 "
             "actor_rollout_ref.ref.fsdp_config.param_offload=True trainer.logger=console trainer.n_gpus_per_node=8 "
             "trainer.nnodes=1 trainer.save_freq=-1 trainer.total_epochs=2 trainer.resume_mode=disable "
             "trainer.val_before_train=False trainer.total_training_steps=1").split()


def test_verl_dapo_recipe_plans_with_its_numbers():
    from configs.suggest import make_plan

    cfg = load_config(None, VERL_DAPO)
    plan = make_plan(cfg)
    assert (plan["prompts_per_step"], plan["rows_per_step"]) == (256, 1024)  # 256 prompts × n 4
    # mini-batch 128 prompts × 4 ÷ dp 8 = 64 rows per rank; 1024 ÷ 8 = 128 rows per rank: 2 optimizer steps
    assert plan["actor"]["ppo_mini_batch_size_per_gpu"] == 64 and plan["ref"] is None
    assert plan["rollout"]["num_replicas"] == 4  # 8 GPUs ÷ TP 2
    assert cfg["data"]["gen_batch_size"] == 1024 and cfg["algorithm"]["filter_groups"]["metric"] == "seq_reward"
