"""LoRA (stages/model/lora.py): merged exports equal the adapted model, only adapters (and a critic's
value head) train, the optimizer holds the adapters' states only, resume through train_state is
bit-identical, and the plan's memory estimate counts adapter parameters."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from _update_inputs import make_ctx, write_inputs
from stages import update
from stages.model.lora import add_adapters, adapter_scalings, merge_adapters
from stages.model.models import load_policy
from stages.model.tiny import save_tiny_model
from storage.artifacts import read_file

LORA = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def adapter_count(model_dir, rank: int) -> int:
    """r x layers x (q: h+h, k: h+kv, v: h+kv, o: h+h, gate/up: h+i each, down: i+h)."""
    c = json.loads((model_dir / "config.json").read_text())
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    return rank * c["num_hidden_layers"] * (2 * h + 2 * (h + kv) + 2 * h + 3 * (h + i))


def test_merged_weights_compute_what_the_adapted_model_computes(model_dir):
    torch.manual_seed(0)
    adapted = add_adapters(load_policy(model_dir), {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(p.numel() for n, p in adapted.named_parameters() if n in trainable) == adapter_count(model_dir, 4)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    base_logits = load_policy(model_dir)(ids).logits
    assert torch.equal(adapted(ids).logits, base_logits)  # lora_B starts at zero: the identity
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    scalings = adapter_scalings(adapted)
    assert set(scalings.values()) == {8 / 4}
    merged = merge_adapters({n: p.detach().clone() for n, p in adapted.named_parameters()}, scalings)
    plain = load_policy(model_dir)
    assert set(merged) == {n for n, _ in plain.named_parameters()}
    plain.load_state_dict(merged, strict=False)
    expected = adapted(ids).logits
    assert not torch.allclose(expected, base_logits, atol=1e-4)
    assert torch.allclose(plain(ids).logits, expected, atol=1e-5)


def run_update(root, model_dir, overrides, step=1):
    ctx = make_ctx(root, model_dir, step, overrides)
    write_inputs(ctx)
    update.run(ctx)
    metrics = read_file(ctx.store, ctx.layout, step, "update", "update/metrics.json")
    weights = load_file(os.path.join(ctx.store.path(ctx.layout.weights(step)), "model.safetensors"))
    return ctx, metrics, weights


def test_only_adapters_train_and_the_optimizer_holds_only_theirs(tmp_path, model_dir):
    from stages.ranks.launch import init_distributed
    from stages.training.worker import UpdateJob

    _, metrics, weights = run_update(tmp_path / "run", model_dir, LORA)
    init = load_file(str(model_dir / "model.safetensors"))
    assert weights.keys() == init.keys()  # merged: the base model's names, no lora_* tensors
    adapted = {k for k in init if any(f".{m}." in k for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj")) and k.endswith(".weight")}
    assert adapted and all(not torch.equal(init[k], weights[k]) for k in adapted)
    assert all(torch.equal(init[k], weights[k]) for k in init if k not in adapted)  # embeddings, norms, biases
    assert metrics["actor/grad_norm"] > 0
    ctx = make_ctx(tmp_path / "probe", model_dir, 1, LORA)
    init_distributed("cpu")
    job = UpdateJob(ctx, 0, 1)
    master = sum(p.numel() for p in job.actor.engine.optimizer.single_partition_of_fp32_groups)
    assert master == adapter_count(model_dir, 4)  # fp32 master + AdamW moments for adapters only
    full = UpdateJob(make_ctx(tmp_path / "full", model_dir, 1, LORA[:1]), 0, 1)
    assert sum(p.numel() for p in full.actor.engine.optimizer.single_partition_of_fp32_groups) == \
        sum(p.numel() for p in load_policy(model_dir).parameters())  # without LoRA: every parameter


def test_resume_through_train_state_equals_one_process(tmp_path, model_dir):
    from stages.ranks.launch import init_distributed
    from stages.training.worker import UpdateJob

    run_update(tmp_path / "jobs", model_dir, LORA, step=1)
    _, m2, two_jobs = run_update(tmp_path / "jobs", model_dir, LORA, step=2)
    c1, c2 = make_ctx(tmp_path / "one", model_dir, 1, LORA), make_ctx(tmp_path / "one", model_dir, 2, LORA)
    write_inputs(c1)
    write_inputs(c2)
    init_distributed("cpu")
    job = UpdateJob(c1, 0, 1)
    job.train_step(c1)
    second = job.train_step(c2)["metrics"]
    job.export(tmp_path / "one" / "export")
    one = load_file(str(tmp_path / "one" / "export" / "actor_hf" / "model.safetensors"))
    assert second["actor/grad_norm"] == m2["actor/grad_norm"]
    assert one.keys() == two_jobs.keys() and all(torch.equal(one[k], two_jobs[k]) for k in one)
    # the reference policy is the base model with the adapters off: after two trained steps the
    # frozen base weights are still the initial folder's, which is what the ref pass reads
    init = load_file(str(model_dir / "model.safetensors"))
    base = {n.replace(".base_layer.", "."): p for n, p in job.actor.engine.module.named_parameters() if ".lora_" not in n}
    assert base.keys() == init.keys() and all(torch.equal(base[k].float(), init[k]) for k in init)
    assert c2.reference_weights() == model_dir


def test_critic_with_lora_trains_adapters_and_its_value_head(tmp_path, model_dir):
    ov = LORA + ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4", "critic.model.lora_rank=4"]
    ctx = make_ctx(tmp_path, model_dir, 1, ov)
    write_inputs(ctx, critic=True)
    update.run(ctx)
    critic = load_file(os.path.join(ctx.store.path(ctx.layout.critic_weights(1)), "model.safetensors"))
    assert not any("lora_" in k or "base_layer" in k for k in critic)
    from stages.model.models import load_critic

    start = load_critic(model_dir, seed=ctx.get("trainer.seed")).state_dict()
    assert not torch.equal(start["score.weight"], critic["score.weight"])  # the value head trains in full
    assert torch.equal(start["model.embed_tokens.weight"], critic["model.embed_tokens.weight"])


def test_memory_estimate_counts_adapter_parameters(tmp_path):
    from configs.loader import load_config
    from configs.memory import GIB, estimate_memory
    from configs.suggest import make_plan
    from stages.model.shapes import shaped_config

    shaped_config("qwen2.5-0.5b").save_pretrained(tmp_path)
    cfg = load_config("gsm8k-qwen2.5-0.5b", [f"actor_rollout_ref.model.path={tmp_path}", f"critic.model.path={tmp_path}",
                                              "actor_rollout_ref.model.lora_rank=16"])
    actor = estimate_memory(cfg, make_plan(cfg))["update_actor"]
    lora = 16 * 24 * (9 * 896 + 2 * 128 + 3 * 4864)  # r x layers x (9h + 2kv + 3i), all-linear
    assert lora == 8_798_208 and actor["trainable_params"] == lora
    assert actor["parts_gib"]["optimizer"] == round(12 * lora / GIB, 3)
    assert actor["parts_gib"]["weights"] == round(2 * 494_032_768 / GIB, 3)  # the frozen base stays
