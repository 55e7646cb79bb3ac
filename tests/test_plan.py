"""The batch plan against numbers worked out by hand from verl's rules (verl/workers/fsdp_workers.py, ray_trainer.py), for the
reference's worked examples, verl's own example scripts, and the user command lines (seeds A-C)."""
import json

import pytest

from configs.loader import load_config
from configs.plan import PlanError, compute_plan
from configs.suggest import make_plan
from flows.cli import main

A = "actor_rollout_ref.actor."
R = "actor_rollout_ref.rollout."
REF = "actor_rollout_ref.ref."

# Reference §1.6 worked example A (issue 2's command).
EXAMPLE_A = ["data.train_batch_size=60", f"{R}n=12", "trainer.n_gpus_per_node=6", f"{A}ppo_mini_batch_size=60",
             f"{A}ppo_micro_batch_size_per_gpu=4", f"{R}log_prob_micro_batch_size_per_gpu=8",
             f"{R}tensor_model_parallel_size=2"]

# Seed 002 / reference/verl-command-lines.md A: verl's PPO quick start on one GPU (verl defaults).
SEED_A = """data.train_files=/home/u/data/gsm8k/fmt_rl/train.parquet data.val_files=/home/u/data/gsm8k/fmt_rl/test.parquet
data.train_batch_size=1 data.max_prompt_length=256 data.max_response_length=256
actor_rollout_ref.model.path=/home/u/models/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=1 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1
actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.3
actor_rollout_ref.rollout.max_num_batched_tokens=512 actor_rollout_ref.rollout.enable_chunked_prefill=false
actor_rollout_ref.fsdp_config.cpu_offload=true actor_rollout_ref.fsdp_config.offload_params=true
actor_rollout_ref.rollout.max_num_seqs=1 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1
critic.optim.lr=1e-5 critic.model.path=/home/u/models/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=1
algorithm.kl_ctrl.kl_coef=0.001 trainer.logger=console trainer.val_before_train=False trainer.n_gpus_per_node=1
trainer.nnodes=1 trainer.save_freq=10 trainer.test_freq=10 trainer.total_epochs=2""".split()

# Seed 000 / C: GRPO with a token budget, on top of B's batch levels.
SEED_C = EXAMPLE_A[:-3] + [f"{R}tensor_model_parallel_size=2", f"{REF}log_prob_micro_batch_size_per_gpu=8",
                           "algorithm.adv_estimator=grpo", f"{A}use_dynamic_bsz=True",
                           f"{A}ppo_max_token_len_per_gpu=16384", f"{A}ppo_micro_batch_size_per_gpu=null",
                           f"{R}gpu_memory_utilization=0.85", f"{R}max_num_batched_tokens=16384", "data.num_workers=8"]

GSM8K_COMMON = ["data.train_batch_size=1024", "data.max_prompt_length=512", "trainer.n_gpus_per_node=8",
                "trainer.nnodes=1", f"{A}ppo_mini_batch_size=256", f"{R}name=vllm"]

# examples/grpo_trainer/run_deepseek7b_llm.sh: deprecated global micro sizes.
GRPO_DEEPSEEK = GSM8K_COMMON + ["algorithm.adv_estimator=grpo", "data.max_response_length=1024",
                                f"{A}ppo_micro_batch_size=128", f"{A}use_kl_loss=True",
                                f"{R}log_prob_micro_batch_size=256", f"{R}tensor_model_parallel_size=2", f"{R}n=5",
                                f"{REF}log_prob_micro_batch_size=256", f"{A}fsdp_config.grad_offload=False"]
# examples/grpo_trainer/run_qwen2-7b_seq_balance.sh: token budget.
GRPO_SEQ_BALANCE = GSM8K_COMMON + ["algorithm.adv_estimator=grpo", "data.max_response_length=1024",
                                   "actor_rollout_ref.model.use_remove_padding=True", f"{A}use_dynamic_bsz=True",
                                   f"{A}ppo_max_token_len_per_gpu=24000", f"{A}use_kl_loss=True",
                                   f"{R}tensor_model_parallel_size=2", f"{R}n=5", f"{R}mode=async",
                                   f"{R}multi_turn.format=hermes", "data.filter_overlong_prompts=True"]
# examples/ppo_trainer/run_deepseek7b_llm.sh: PPO with a critic.
PPO_DEEPSEEK = GSM8K_COMMON + ["algorithm.adv_estimator=gae", "data.max_response_length=512",
                               f"{A}ppo_micro_batch_size_per_gpu=16", f"{R}log_prob_micro_batch_size_per_gpu=32",
                               f"{R}tensor_model_parallel_size=4", "critic.ppo_micro_batch_size_per_gpu=32",
                               "trainer.use_legacy_worker_impl=False"]
# examples/ppo_trainer/run_deepseek7b_llm_sp2.sh: Ulysses sp=2 for actor and critic.
PPO_SP2 = GSM8K_COMMON + ["data.max_response_length=512", "actor_rollout_ref.model.use_remove_padding=True",
                          f"{A}ppo_micro_batch_size_per_gpu=32", f"{A}ulysses_sequence_parallel_size=2",
                          f"{R}log_prob_micro_batch_size_per_gpu=64", f"{R}tensor_model_parallel_size=4",
                          f"{REF}log_prob_micro_batch_size_per_gpu=64", "critic.ulysses_sequence_parallel_size=2",
                          "critic.model.use_remove_padding=True", "critic.ppo_micro_batch_size_per_gpu=64"]


def plan_of(overrides, config="tiny-cpu"):
    return make_plan(load_config(config, overrides))


def refusal(overrides, config="tiny-cpu") -> PlanError:
    with pytest.raises(PlanError) as info:
        plan_of(overrides, config)
    return info.value


# (name, config, overrides, expected actor numbers, expected rollout numbers, ref passes or None, critic or None)
CASES = [
    ("worked example A", "tiny-cpu", EXAMPLE_A,
     dict(dp_size=6, samples_per_dp_rank=120, ppo_mini_batch_size_per_gpu=120, ppo_micro_batch_size_per_gpu=4,
          grad_accum_steps=30, num_mini_batches=1, optimizer_steps_per_step=1, on_policy=True),
     dict(num_replicas=3, prompts_per_replica=20, rows_per_replica=240, log_prob_micro_batch_size_per_gpu=8,
          log_prob_micro_batches_per_rank=15), 2, None),
    # verl checks the unnormalised mini (60 prompts) % global micro, so 24 is refused; 12 -> 2
    ("A with deprecated globals (12 -> 2, 8 -> 1)", "tiny-cpu",
     EXAMPLE_A[:4] + [f"{A}ppo_micro_batch_size=12", f"{R}log_prob_micro_batch_size=8",
                      f"{R}log_prob_micro_batch_size_per_gpu=null", f"{A}ppo_micro_batch_size_per_gpu=null",
                      f"{R}tensor_model_parallel_size=2"],
     dict(ppo_micro_batch_size_per_gpu=2, grad_accum_steps=60),
     dict(log_prob_micro_batch_size_per_gpu=1, log_prob_micro_batches_per_rank=120), 2, None),
    ("worked example B: one GPU, one prompt, n=1", "base",
     ["data.train_batch_size=1", f"{A}ppo_mini_batch_size=1", f"{A}ppo_micro_batch_size_per_gpu=1",
      f"{R}log_prob_micro_batch_size_per_gpu=1", f"{R}tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1",
      "algorithm.adv_estimator=grpo"],
     dict(dp_size=1, samples_per_dp_rank=1, ppo_mini_batch_size_per_gpu=1, grad_accum_steps=1, num_mini_batches=1),
     dict(num_replicas=1, prompts_per_replica=1, rows_per_replica=1, log_prob_micro_batches_per_rank=1), None, None),
    ("worked example B with n=12", "base",
     ["data.train_batch_size=1", f"{R}n=12", f"{A}ppo_mini_batch_size=1", f"{A}ppo_micro_batch_size_per_gpu=1",
      f"{R}log_prob_micro_batch_size_per_gpu=1", f"{R}tensor_model_parallel_size=1", "trainer.n_gpus_per_node=1",
      "algorithm.adv_estimator=grpo"],
     dict(samples_per_dp_rank=12, ppo_mini_batch_size_per_gpu=12, grad_accum_steps=12, optimizer_steps_per_step=1),
     dict(rows_per_replica=12, log_prob_micro_batches_per_rank=12), None, None),
    ("seed A: verl PPO quick start, one GPU", "base", SEED_A,
     dict(dp_size=1, samples_per_dp_rank=1, ppo_mini_batch_size_per_gpu=1, grad_accum_steps=1),
     dict(num_replicas=1, log_prob_micro_batches_per_rank=1), None,
     dict(ppo_mini_batch_size_per_gpu=1, grad_accum_steps=1, value_forward_passes_per_rank=1)),
    ("seed C: token budget 16384", "tiny-cpu", SEED_C,
     dict(samples_per_dp_rank=120, ppo_mini_batch_size_per_gpu=120, ppo_micro_batch_size_per_gpu=None,
          grad_accum_steps=None, use_dynamic_bsz=True, max_token_len_per_micro_batch=16384),
     dict(num_replicas=3, log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=16384,
          log_prob_micro_batches_per_rank=None), None, None),
    ("grpo_trainer/run_deepseek7b_llm.sh (deprecated globals)", "base", GRPO_DEEPSEEK,
     dict(dp_size=8, samples_per_dp_rank=640, ppo_mini_batch_size_per_gpu=160, ppo_micro_batch_size_per_gpu=16,
          grad_accum_steps=10, num_mini_batches=4, optimizer_steps_per_step=4, on_policy=False),
     dict(num_replicas=4, prompts_per_replica=256, rows_per_replica=1280, log_prob_micro_batch_size_per_gpu=32,
          log_prob_micro_batches_per_rank=20), 20, None),
    ("grpo_trainer/run_qwen2-7b_seq_balance.sh (token budget 24000)", "base", GRPO_SEQ_BALANCE,
     dict(samples_per_dp_rank=640, ppo_mini_batch_size_per_gpu=160, num_mini_batches=4,
          max_token_len_per_micro_batch=24000, grad_accum_steps=None),
     dict(num_replicas=4, log_prob_max_token_len_per_gpu=24000), None, None),
    ("ppo_trainer/run_deepseek7b_llm.sh (critic)", "base", PPO_DEEPSEEK,
     dict(samples_per_dp_rank=128, ppo_mini_batch_size_per_gpu=32, grad_accum_steps=2, num_mini_batches=4),
     dict(num_replicas=2, prompts_per_replica=512, log_prob_micro_batches_per_rank=4), None,
     dict(dp_size=8, ppo_mini_batch_size_per_gpu=32, ppo_micro_batch_size_per_gpu=32, grad_accum_steps=1,
          num_mini_batches=4, value_forward_passes_per_rank=4)),
    ("ppo_trainer/run_deepseek7b_llm_sp2.sh (Ulysses sp=2)", "base", PPO_SP2,
     dict(dp_size=4, sp_size=2, samples_per_dp_rank=256, ppo_mini_batch_size_per_gpu=64, grad_accum_steps=2,
          num_mini_batches=4),
     dict(num_replicas=2, log_prob_micro_batches_per_rank=4), None,
     dict(dp_size=4, sp_size=2, ppo_mini_batch_size_per_gpu=64, grad_accum_steps=1, value_forward_passes_per_rank=4)),
    ("gsm8k-qwen2.5-0.5b config", "gsm8k-qwen2.5-0.5b", [],
     dict(dp_size=1, samples_per_dp_rank=256, ppo_mini_batch_size_per_gpu=64, grad_accum_steps=16,
          num_mini_batches=4, optimizer_steps_per_step=4),
     dict(num_replicas=1, log_prob_micro_batches_per_rank=32), None,
     dict(ppo_mini_batch_size_per_gpu=64, grad_accum_steps=16, value_forward_passes_per_rank=64)),
    ("tiny-cpu default", "tiny-cpu", [],
     dict(dp_size=2, samples_per_dp_rank=360, ppo_mini_batch_size_per_gpu=90, ppo_micro_batch_size_per_gpu=30,
          grad_accum_steps=3, num_mini_batches=4, optimizer_steps_per_step=4, on_policy=False),
     dict(num_replicas=2, prompts_per_replica=30, rows_per_replica=360, log_prob_micro_batches_per_rank=6), 6, None),
    ("two epochs, two mini-batches", "tiny-cpu", EXAMPLE_A[:3] + [f"{A}ppo_mini_batch_size=30", f"{A}ppo_epochs=2",
                                                          f"{A}ppo_micro_batch_size_per_gpu=6"],
     dict(samples_per_dp_rank=120, ppo_mini_batch_size_per_gpu=60, grad_accum_steps=10, num_mini_batches=2,
          ppo_epochs=2, optimizer_steps_per_step=4, on_policy=False),
     dict(num_replicas=6, prompts_per_replica=10), 2, None),
    ("two nodes of 8", "base", ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "data.train_batch_size=256",
                                f"{R}n=8", f"{A}ppo_mini_batch_size=64", f"{A}ppo_micro_batch_size_per_gpu=8",
                                f"{R}log_prob_micro_batch_size_per_gpu=16", "algorithm.adv_estimator=rloo"],
     dict(dp_size=16, samples_per_dp_rank=128, ppo_mini_batch_size_per_gpu=32, grad_accum_steps=4,
          num_mini_batches=4),
     dict(num_replicas=8, prompts_per_replica=32, rows_per_replica=256, log_prob_micro_batches_per_rank=8), None, None),
    ("dynamic with a per-GPU micro still set (verl checks mini % micro)", "base",
     GRPO_SEQ_BALANCE + [f"{A}ppo_micro_batch_size_per_gpu=16"],
     dict(ppo_micro_batch_size_per_gpu=16, grad_accum_steps=None, use_dynamic_bsz=True), dict(num_replicas=4),
     None, None),
    ("critic with its own mini-batch", "base", PPO_DEEPSEEK + ["critic.ppo_mini_batch_size=128",
                                                               "critic.ppo_micro_batch_size_per_gpu=8"],
     dict(ppo_mini_batch_size_per_gpu=32, num_mini_batches=4), dict(num_replicas=2), None,
     dict(ppo_mini_batch_size_per_gpu=16, num_mini_batches=8, grad_accum_steps=2, value_forward_passes_per_rank=16)),
    ("rollout data parallel inside a replica", "base", PPO_DEEPSEEK + [f"{R}tensor_model_parallel_size=2",
                                                                       f"{R}data_parallel_size=2"],
     dict(samples_per_dp_rank=128), dict(num_replicas=2, prompts_per_replica=512), None,
     dict(ppo_mini_batch_size_per_gpu=32)),
    ("RLOO with KL in reward needs the reference", "base",
     GRPO_DEEPSEEK + ["algorithm.adv_estimator=rloo", "algorithm.use_kl_in_reward=True", f"{A}use_kl_loss=False"],
     dict(samples_per_dp_rank=640), dict(log_prob_micro_batches_per_rank=20), 20, None),
    ("uneven prompts per replica", "tiny-cpu", ["trainer.n_gpus_per_node=8", f"{A}ppo_mini_batch_size=60",
                                          f"{A}ppo_micro_batch_size_per_gpu=5",
                                          f"{R}log_prob_micro_batch_size_per_gpu=9", f"{REF}log_prob_micro_batch_size_per_gpu=9"],
     dict(samples_per_dp_rank=90, ppo_mini_batch_size_per_gpu=90, grad_accum_steps=18),
     dict(num_replicas=8, prompts_per_replica=8, rows_per_replica=96, log_prob_micro_batches_per_rank=10), 10, None),
    ("ppo_trainer-style critic with deprecated global micro", "base",
     PPO_DEEPSEEK[:-2] + ["critic.ppo_micro_batch_size=256", "critic.ppo_micro_batch_size_per_gpu=null"],
     dict(samples_per_dp_rank=128), dict(num_replicas=2), None,
     dict(ppo_micro_batch_size_per_gpu=32, grad_accum_steps=1, forward_micro_batch_size_per_gpu=32,
          value_forward_passes_per_rank=4)),
]


@pytest.mark.parametrize("name,config,overrides,actor,rollout,ref_passes,critic", CASES, ids=[c[0] for c in CASES])
def test_plan_matches_hand_computed_numbers(name, config, overrides, actor, rollout, ref_passes, critic):
    plan = plan_of(overrides, config)
    for key, value in actor.items():
        assert plan["actor"][key] == value, (name, "actor", key)
    for key, value in rollout.items():
        assert plan["rollout"][key] == value, (name, "rollout", key)
    if ref_passes is None:
        assert plan["ref"] is None or plan["ref"]["log_prob_micro_batches_per_rank"] is None
    else:
        assert plan["ref"]["log_prob_micro_batches_per_rank"] == ref_passes
    if critic is None:
        assert plan["critic"] is None
    else:
        for key, value in critic.items():
            assert plan["critic"][key] == value, (name, "critic", key)


def test_example_a_totals_and_no_ref_without_kl():
    plan = plan_of(EXAMPLE_A + [f"{A}use_kl_loss=False"])
    assert (plan["n_gpus"], plan["prompts_per_step"], plan["rows_per_step"]) == (6, 60, 720)
    assert plan["ref"] is None and plan["critic"] is None


def test_seed_a_warns_about_verls_agent_chunking():
    plan = plan_of(SEED_A, "base")
    assert any("agent.num_workers=8" in w for w in plan["warnings"])
    assert any("fsdp_config.cpu_offload" in w and "param_offload" in w for w in plan["warnings"])


def test_reward_model_micro_is_divided_by_world_not_dp():
    plan = plan_of(PPO_SP2 + ["reward_model.enable=True", "reward_model.micro_batch_size=64"], "base")
    assert plan["reward_model"]["micro_batch_size_per_gpu"] == 8  # 64 // 8 ranks, not // dp 4
    assert plan["reward_model"]["forward_passes_per_rank"] == 16  # 1024 rows / 8 ranks / 8


# ---- refusals: every one names keys and numbers and, where one key can fix it, values that work ----

def test_seven_gpus_refused_with_working_gpu_counts():
    err = refusal(EXAMPLE_A + ["trainer.n_gpus_per_node=7"])
    assert "720" in str(err) and "(7 " in str(err)
    assert err.suggestions["trainer.n_gpus_per_node"] == [6, 4, 10]


def test_eight_gpus_refused_90_rows_not_divisible_by_4():
    err = refusal(EXAMPLE_A + ["trainer.n_gpus_per_node=8"])
    assert "normalized ppo_mini_batch_size 90 should be divisible by ppo_micro_batch_size_per_gpu 4" in str(err)
    assert err.suggestions[f"{A}ppo_micro_batch_size_per_gpu"] == [3, 5, 2]
    assert err.suggestions["trainer.n_gpus_per_node"] == [6, 10, 4]
    for value in err.suggestions[f"{A}ppo_micro_batch_size_per_gpu"]:  # every suggestion really works
        plan_of(EXAMPLE_A + ["trainer.n_gpus_per_node=8", f"{A}ppo_micro_batch_size_per_gpu={value}"])


REFUSALS = [
    ("world of 0", ["trainer.n_gpus_per_node=0"], "world size 0"),
    ("sp does not divide world", EXAMPLE_A + [f"{A}ulysses_sequence_parallel_size=4"], "must divide the world size (6)"),
    ("sp without remove padding", EXAMPLE_A + [f"{A}ulysses_sequence_parallel_size=2"], "use_remove_padding"),
    ("critic sp without remove padding", ["critic.ulysses_sequence_parallel_size=2", "critic.enable=True",
                                          "critic.ppo_micro_batch_size_per_gpu=4"], "sequence parallelism for critic"),
    ("dynamic: rows not divisible by dp", SEED_C + ["trainer.n_gpus_per_node=7", f"{R}tensor_model_parallel_size=1"],
     "not divisible by the data-parallel size 7"),
    ("actor micro unset", [f"{A}ppo_micro_batch_size_per_gpu=null"], "Please set at least one of"),
    ("actor micro set twice", [f"{A}ppo_micro_batch_size=60"], "You have set both"),
    ("rollout log-prob micro unset", [f"{R}log_prob_micro_batch_size_per_gpu=null"], "[actor_rollout_ref.rollout]"),
    ("ref micro unset while KL loss is on", [f"{REF}log_prob_micro_batch_size_per_gpu=null"], "[actor_rollout_ref.ref]"),
    ("critic micro unset", ["algorithm.adv_estimator=gae"], "[critic] Please set at least one of"),
    ("reward model micro unset", ["reward_model.enable=True"], "[reward_model]"),
    ("reward model token budget unset", ["reward_model.enable=True", "reward_model.use_dynamic_bsz=True",
                                         "reward_model.forward_max_token_len_per_gpu=0"],
     "use_dynamic_bsz needs reward_model.forward_max_token_len_per_gpu"),
    ("train batch below mini", [f"{A}ppo_mini_batch_size=120"], "train_batch_size (60) must be >= actor.ppo_mini_batch_size (120)"),
    ("train batch not a multiple of mini", [f"{A}ppo_mini_batch_size=40", f"{A}ppo_micro_batch_size_per_gpu=4"],
     "not a multiple of"),
    ("deprecated mini not divisible by global micro", [f"{A}ppo_micro_batch_size=7", f"{A}ppo_micro_batch_size_per_gpu=null"],
     "must be divisible by ppo_micro_batch_size (7)"),
    ("deprecated global micro below world", ["trainer.n_gpus_per_node=4", f"{A}ppo_micro_batch_size=2",
                                             f"{A}ppo_mini_batch_size=60",
                                             f"{A}ppo_micro_batch_size_per_gpu=null"], "must be >= n_gpus (4)"),
    ("mini rows not divisible by dp", ["data.train_batch_size=6", f"{R}n=2", f"{A}ppo_mini_batch_size=3",
                                       "trainer.n_gpus_per_node=4", f"{A}ppo_micro_batch_size_per_gpu=1"],
     "6 rows is not divisible by the data-parallel size 4"),
    ("deprecated log-prob size normalises to 0", [f"{R}log_prob_micro_batch_size=1",
                                                  f"{R}log_prob_micro_batch_size_per_gpu=null"], "= 0 rows per rank"),
    ("mini not divisible by micro", [f"{A}ppo_micro_batch_size_per_gpu=7"], "should be divisible by ppo_micro_batch_size_per_gpu 7"),
    ("zero epochs", [f"{A}ppo_epochs=0"], "at least one pass"),
    ("token budget below sequence", SEED_C + [f"{A}ppo_max_token_len_per_gpu=50"], "below max_prompt_length + max_response_length = 96"),
    ("log-prob budget below sequence", SEED_C + [f"{R}log_prob_max_token_len_per_gpu=64"], "log_prob_max_token_len_per_gpu=64"),
    ("critic forward budget", ["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=True",
                               "critic.forward_max_token_len_per_gpu=10"], "critic.forward_max_token_len_per_gpu=10"),
    ("critic forward micro null", ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=6",
                                   "critic.forward_micro_batch_size_per_gpu=null"], "forward_micro_batch_size_per_gpu is null"),
    ("TP does not divide world", [f"{R}tensor_model_parallel_size=4"], "rollout world_size: 2 is not divisible by infer_world_size: 4"),
    ("TP group larger than a node spans part of one (verl: RolloutReplica)",
     ["trainer.nnodes=3", "trainer.n_gpus_per_node=8", f"{R}tensor_model_parallel_size=12", "data.train_batch_size=48",
      f"{A}ppo_mini_batch_size=24", f"{A}ppo_micro_batch_size_per_gpu=2", f"{R}log_prob_micro_batch_size_per_gpu=2"],
     "rollout replica world_size 12 (actor_rollout_ref.rollout.tensor_model_parallel_size 12 × data_parallel_size 1) "
     "must be divisible by gpus_per_node 8"),
    ("vLLM context below sequence", [f"{R}name=vllm", f"{R}max_model_len=90"], "max_model_len=90"),
    ("vLLM token budget without chunked prefill", [f"{R}name=vllm", f"{R}enable_chunked_prefill=false",
                                                   f"{R}max_num_batched_tokens=64"], "max_num_batched_tokens=64"),
    ("non-positive batch", ["data.train_batch_size=0"], "must be positive"),
]


@pytest.mark.parametrize("name,overrides,needle", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_name_keys_and_numbers(name, overrides, needle):
    err = refusal(overrides)
    assert needle in str(err), str(err)
    for key, values in err.suggestions.items():  # whatever is suggested must pass
        assert 1 <= len(values) <= 3
        plan_of(overrides + [f"{key}={'null' if values[0] is None else values[0]}"])


def test_refusal_suggests_removing_a_deprecated_key():
    err = refusal([f"{A}ppo_micro_batch_size=60"])
    assert err.suggestions == {f"{A}ppo_micro_batch_size": [None]}


# ---- the command line ----

def test_cli_plan_text_shows_the_derivation(capsys):
    assert main(["plan", "--config", "tiny-cpu", *EXAMPLE_A]) == 0
    out = capsys.readouterr().out
    for needle in ["720   = 60 prompts × rollout.n 12", "120   = 720 ÷ dp 6", "30   = 120 ÷ 4",
                   "Old log-prob: no separate pass (one mini-batch, one epoch", "3   = world 6 ÷ (TP 2", "20   = ceil(60 ÷ 3)", "240   = 20 × n 12"]:
        assert needle in out, needle


def test_cli_plan_json_keys(capsys):
    assert main(["plan", "--config", "tiny-cpu", "--json", *EXAMPLE_A]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ["n_gpus", "prompts_per_step", "rows_per_step", "actor", "critic", "rollout", "ref", "warnings"]:
        assert key in plan
    for key in ["dp_size", "sp_size", "ppo_mini_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu", "grad_accum_steps",
                "samples_per_dp_rank", "num_mini_batches", "ppo_epochs", "optimizer_steps_per_step", "use_dynamic_bsz",
                "max_token_len_per_micro_batch"]:
        assert key in plan["actor"]
    for key in ["tensor_model_parallel_size", "num_replicas", "prompts_per_replica", "rows_per_replica",
                "log_prob_micro_batch_size_per_gpu", "log_prob_micro_batches_per_rank", "log_prob_use_dynamic_bsz"]:
        assert key in plan["rollout"]
    assert plan["rollout"]["log_prob_micro_batches_per_rank"] == 15
    assert plan["update_engine"]["engine"] == "DeepSpeed ZeRO-2, fp32, torch AdamW, 6 ranks"
    assert "shards the optimizer state and gradients over the 6 ranks" in plan["update_engine"]["why"]
    assert main(["plan", "--config", "tiny-cpu", "trainer.n_gpus_per_node=1"]) == 0
    out = capsys.readouterr().out
    assert "update engine: DeepSpeed ZeRO-2, fp32, torch AdamW, 1 rank: at one rank ZeRO shards nothing" in out
    assert out.count("ranks: one rank in the flow's process") == 1  # tiny-cpu samples with vLLM: no fork server at one rank
    # an hf engine in a forked worker (trainer.staleness=1): the one rank is forked beside it
    assert main(["plan", "--config", "tiny-cpu", "--json", "trainer.n_gpus_per_node=1",
                 "actor_rollout_ref.rollout.name=hf", "trainer.staleness=1"]) == 0
    assert json.loads(capsys.readouterr().out)["update_engine"]["ranks"].startswith("one rank forked from the run's fork server")
    assert plan["update_engine"]["ranks"] == "a pool of 6 ranks forked once from the run's fork server"


def test_cli_refusal_exits_2_with_json_error(capsys):
    assert main(["plan", "--config", "tiny-cpu", "--json", *EXAMPLE_A, "trainer.n_gpus_per_node=7"]) == 2
    captured = capsys.readouterr()
    assert "must be divisible by minimal possible batch size (7" in captured.err
    assert json.loads(captured.out)["suggestions"]["trainer.n_gpus_per_node"] == [6, 4, 10]


def test_cli_plan_accepts_the_seed_command_lines(capsys):
    """A verl command line with only the entry point changed: without --config, verl's defaults
    fill what it leaves out (seed A: rollout.n 1, GAE with a critic), and the plan says so."""
    assert main(["plan", *SEED_A]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Batch plan (config: base, verl's defaults + ")
    assert "1   = 1 prompts × rollout.n 1" in out and "Critic (value model): starts from" in out
    plan = make_plan(load_config(None, SEED_A))
    assert plan["rollout_n"] == 1 and plan["critic"] and load_config(None, SEED_A)["algorithm"]["adv_estimator"] == "gae"
    assert main(["plan", "--config", "tiny-cpu", *SEED_C]) == 0
    assert "token budget per micro-batch" in capsys.readouterr().out


def test_compute_plan_is_pure():
    cfg = load_config("tiny-cpu", EXAMPLE_A)
    assert compute_plan(cfg) == compute_plan(cfg)


def test_resume_replay_follows_save_freq():
    """What a resume replays (stagerl plan prints it): at most save_freq - 1 updates; with
    save_freq=-1 the state is stored at the last step only, so up to every update before it."""
    from configs.loader import load_config
    from configs.plan import resume_replay

    cfg = lambda *o: load_config("tiny-cpu", ["trainer.total_training_steps=40", *o])
    assert resume_replay(cfg("trainer.save_freq=5"))["replays_at_most"] == 4
    assert resume_replay(cfg("trainer.save_freq=1"))["replays_at_most"] == 0
    assert resume_replay(cfg("trainer.save_freq=-1")) == {"save_freq": -1, "train_state_every": None,
                                                         "total_training_steps": 40, "replays_at_most": 39}
