"""The plan's memory estimate (configs/memory.py), checked against hand-computed numbers for seed
example A's model (Qwen2.5-0.5B's shape: its config.json only, no weights), and the fit check."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from configs.loader import load_config
from configs.memory import CPU_RUNTIME_GIB, GIB, LOGIT_CHUNK, DoesNotFit, check_fits, estimate_memory
from configs.suggest import make_plan
from stages.model.shapes import shaped_config

REPO = Path(__file__).resolve().parent.parent
P = 494_032_768  # Qwen2.5-0.5B's parameters (tests/test_model_shapes.py)
H, LAYERS, KV, INTER, VOCAB = 896, 24, 128, 4864, 151936


@pytest.fixture(scope="module")
def qwen_config_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen05")
    shaped_config("qwen2.5-0.5b").save_pretrained(folder)  # config.json only
    return folder


def config(folder, *extra):
    return load_config("gsm8k-qwen2.5-0.5b", [f"actor_rollout_ref.model.path={folder}",
                                              f"critic.model.path={folder}", *extra])


def test_update_and_logprob_by_hand(qwen_config_dir):
    cfg = config(qwen_config_dir)
    est = estimate_memory(cfg, make_plan(cfg))
    assert est["model_params"] == P
    actor = est["update_actor"]
    tokens = 4 * (512 + 256)  # ppo_micro_batch_size_per_gpu 4 x (max prompt + max response)
    layer = 8 * H + 2 * KV + 4 * INTER  # values a layer keeps per token for backward
    # bf16 weights and gradients; the fp32 master partition's gradient, the master and AdamW's moments (dp 1)
    by_hand = {"weights": 2 * P, "gradients": 2 * P, "master_gradients": 4 * P, "optimizer": 12 * P,
               "activations": tokens * 2 * (LAYERS * H + layer),  # checkpointing: layer inputs + one layer
               "logits": 3 * 4 * LOGIT_CHUNK * VOCAB, "runtime": GIB}
    assert actor["tokens_per_micro_batch"] == tokens == 3072 and actor["gradient_checkpointing"] is True
    assert actor["parts_gib"] == {k: round(v / GIB, 3) for k, v in by_hand.items()}
    assert actor["total_gib"] == round(sum(by_hand.values()) / GIB, 3) == 12.218
    old = est["logprob_actor"]  # 4 mini-batches: the old-log-prob pass runs, rollout.log_prob micro 8 rows
    assert old["parts_gib"]["weights"] == round(2 * P / GIB, 3) and old["tokens_per_micro_batch"] == 8 * 768
    assert "logprob_ref" not in est  # no KL loss, no KL in reward: no reference model
    assert est["logprob_critic"]["parts_gib"]["logits"] == round(3 * 4 * 1024 / GIB, 3)  # one value per token
    off = config(qwen_config_dir, "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                 "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true")
    actor_off = estimate_memory(off, make_plan(off))["update_actor"]
    assert actor_off["parts_gib"]["activations"] == round(tokens * 2 * LAYERS * layer / GIB, 3) == 3.691
    assert actor_off["parts_gib"]["optimizer"] == actor_off["parts_gib"]["master_gradients"] == 0


def test_a_config_that_does_not_fit_is_refused_with_the_cheapest_changes(qwen_config_dir):
    cfg = config(qwen_config_dir, "trainer.device_memory_gib=8")
    est = estimate_memory(cfg, make_plan(cfg))
    with pytest.raises(DoesNotFit) as err:
        check_fits(cfg, est)
    assert err.value.stage == "update_actor"
    assert "the update actor stage needs ~12.2 GiB per rank, more than the device's 8.0 GiB" in str(err.value)
    # results unchanged and enough alone first; LoRA (it trains something else) last
    assert err.value.suggestions[0] == "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"
    assert err.value.suggestions[-1] == "actor_rollout_ref.model.lora_rank=16"
    check_fits(config(qwen_config_dir, "trainer.device_memory_gib=80"), est | {"device_memory_gib": 80.0})
    run = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "--config", "gsm8k-qwen2.5-0.5b",
                          f"actor_rollout_ref.model.path={qwen_config_dir}", f"critic.model.path={qwen_config_dir}",
                          "trainer.device_memory_gib=8", "--json"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2 and "optimizer_offload=true (saves ~7.4 GiB, enough alone)" in run.stderr  # 16P bytes
    assert "lora_rank=16 (saves ~8.1 GiB, enough alone, trains adapters only)" in run.stderr  # listed last
    fits = subprocess.run([sys.executable, "-m", "flows.cli", "plan", "--config", "gsm8k-qwen2.5-0.5b",
                           f"actor_rollout_ref.model.path={qwen_config_dir}", f"critic.model.path={qwen_config_dir}",
                           "trainer.device_memory_gib=8", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                           "critic.model.fsdp_config.optimizer_offload=true", "--json"],
                          cwd=REPO, capture_output=True, text=True)
    assert fits.returncode == 0, fits.stderr
    memory = json.loads(fits.stdout)["memory"]
    assert memory["update_actor"]["total_gib"] < 8 and memory["device_memory_gib"] == 8.0


def test_no_model_config_no_estimate(tmp_path):
    cfg = load_config("gsm8k-qwen2.5-0.5b", [f"actor_rollout_ref.model.path={tmp_path / 'absent'}"])
    assert estimate_memory(cfg, make_plan(cfg)) is None


def test_logit_chunk_is_the_models():
    from stages.model.models import DEFAULT_CHUNK

    assert LOGIT_CHUNK == DEFAULT_CHUNK


def test_actor_and_critic_share_the_update_process(qwen_config_dir):
    """GAE: both roles' engines live in the update's one process per rank (stages/training/worker.py),
    each holding its weights and states for the whole stage while one at a time trains or exports."""
    lora = ["algorithm.adv_estimator=gae", "actor_rollout_ref.model.lora_rank=16", "critic.model.lora_rank=16"]
    cfg = config(qwen_config_dir, *lora)
    est = estimate_memory(cfg, make_plan(cfg))
    adapters = 16 * LAYERS * (2 * (H + H) + 2 * (H + KV) + 3 * (H + INTER))  # r (in + out), 7 projections
    critic_w, critic_p = P + H + 1, adapters + H + 1  # value head (tied LM head: no weights dropped)
    assert est["update_actor"]["trainable_params"] == adapters == 8_798_208
    assert est["update_critic"]["trainable_params"] == critic_p
    held = lambda w, p: (2 * w + 2 * p + 4 * p + 12 * p) / GIB  # noqa: E731  bf16 weights + gradients, fp32 master grads + master + AdamW
    transient = 4 * critic_w * 2 / GIB  # the larger role's export: gathered fp32 copy + merged copy
    update = est["update"]
    assert update["roles"] == ["actor", "critic"]
    assert update["parts_gib"]["actor held"] == round(held(P, adapters), 3)
    assert update["parts_gib"]["critic held"] == round(held(critic_w, critic_p), 3)
    assert update["parts_gib"]["largest transient"] == round(transient, 3)
    by_hand = held(P, adapters) + held(critic_w, critic_p) + transient + 1
    assert abs(update["total_gib"] - by_hand) < 0.002 and update["total_gib"] == 6.817
    # either role alone fits 6.5 GiB, both in one process do not: refused as the update stage,
    # with changes for either role
    cfg = config(qwen_config_dir, *lora, "trainer.device_memory_gib=6.5")
    est = estimate_memory(cfg, make_plan(cfg))
    assert est["update_actor"]["total_gib"] < 6.5 and est["update_critic"]["total_gib"] < 6.5
    with pytest.raises(DoesNotFit) as err:
        check_fits(cfg, est)
    assert err.value.stage == "update" and "the update stage needs ~6.8 GiB" in str(err.value)
    assert any(s.startswith("halve critic.") for s in err.value.suggestions)
    assert any(s.startswith("halve actor_rollout_ref.actor.") for s in err.value.suggestions)
    grpo = config(qwen_config_dir, "algorithm.adv_estimator=grpo")
    assert "update" not in estimate_memory(grpo, make_plan(grpo))  # one role: update_actor is the stage


def test_on_the_cpu_a_bf16_forward_reads_the_fp32_checkpoint(qwen_config_dir):
    """trainer.device=cpu: host memory is the device's, so loading the update's fp32 export into a
    bf16 model holds the checkpoint's pages (4 bytes a parameter) beside the cast copy; a CPU
    process's own runtime is CPU_RUNTIME_GIB (bench/scale.py measured both)."""
    gae = ["algorithm.adv_estimator=gae", "trainer.device=cpu"]
    critic_w = P + H + 1
    bf16 = estimate_memory(cfg := config(qwen_config_dir, *gae), make_plan(cfg))["logprob_critic"]
    forward_bf16 = 2 * critic_w + bf16["tokens_per_micro_batch"] * 2 * (8 * H + 2 * KV + 4 * INTER) + 12 * 1024
    assert bf16["parts_gib"]["fp32 checkpoint read"] == round(4 * critic_w / GIB, 3)
    assert bf16["parts_gib"]["runtime"] == CPU_RUNTIME_GIB == 0.5
    assert bf16["total_gib"] == bf16["load_gib"] == round((2 * critic_w + 4 * critic_w) / GIB + 0.5, 3)
    assert forward_bf16 < 4 * critic_w  # the load, not the forward, is the peak here
    fp32 = estimate_memory(cfg := config(qwen_config_dir, *gae, "actor_rollout_ref.actor.deepspeed.dtype=fp32"),
                           make_plan(cfg))["logprob_critic"]
    assert fp32["parts_gib"]["fp32 checkpoint read"] == 0  # the folder's own dtype: no cast, no second copy
    cuda = estimate_memory(cfg := config(qwen_config_dir, "algorithm.adv_estimator=gae"), make_plan(cfg))
    assert cuda["logprob_critic"]["parts_gib"]["fp32 checkpoint read"] == 0  # on a GPU the read is host memory
    assert cuda["logprob_critic"]["parts_gib"]["runtime"] == 1.0
