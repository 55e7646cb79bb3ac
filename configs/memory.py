"""Peak memory per stage and rank, estimated from the config, the batch plan and the model's
config.json (no weights are loaded): what `stagerl plan` prints, and what `stagerl train` checks
against a device's memory before anything starts.

Model: W parameters (embeddings, per layer q/k/v/o and gate/up/down projections with q/k/v
biases, norms; the LM head only when untied), hidden h, KV width kv = kv_heads x head_dim, MLP width
i, vocabulary V, L layers. b = bytes per element of the stage's dtype. P = the parameters the
update trains: W, or with LoRA (lora_rank r) r × (in + out) per adapted projection
(trainable_params), the frozen base still counted in the weights.

- update (per rank, ZeRO over the dp ranks, DeepSpeed's layout): weights b·W (÷ dp with ZeRO-3);
  gradients b·P (÷ dp with ZeRO-2/3); master gradients: the fp32 gradient of the rank's master
  partition 4·P/dp;
  optimizer 12·P/dp: the fp32 master partition (DeepSpeed clones one even when training in fp32,
  deepspeed/runtime/zero/stage_1_and_2.py single_partition_of_fp32_groups) and AdamW's two moments.
  Optimizer offload moves the master, its gradient and the moments to host memory, param offload
  (ZeRO-3) the weights: not counted on the device.
  activations per micro-batch of T tokens (T = micro rows × max_seq_len, or the token budget):
  what a layer keeps for backward is ~(8h + 2kv + 4i) values per token (norm inputs/outputs, q,
  k, v, attention output, the MLP's gate, up, activation and product), so L·T·(8h+2kv+4i)·b;
  with gradient checkpointing each layer keeps only its input, L·T·h·b, plus one layer's full
  set while it is recomputed. Logits: the vocab projection runs over at most LOGIT_CHUNK
  positions at a time (recomputed in backward), so min(T, LOGIT_CHUNK)·V fp32 values three times
  (logits, log-softmax, their gradient) for the actor; a critic's value head has one output.
  The export after training gathers an fp32 copy of every parameter on each rank (4·W; with
  LoRA a merged copy too) while weights and optimizer states are still held: the stage's peak
  is the larger of training and export. With a critic (GAE) both roles' engines live in the
  update's one process per rank: the stage (`update`) holds both roles' weights and states, plus
  the largest transient of either (activations + logits while it trains, its export's copies).
- logprob (per rank): weights b·W and one micro-batch's forward without gradients: one layer's
  activations and the same chunked logits.
- rollout (per replica): vLLM takes gpu_memory_utilization of the device (weights, KV cache and
  activations inside it); without a known device size, and for the hf engine: weights ÷ TP plus a
  KV cache of 2·L·kv values per token for every sequence it holds at once (vLLM: max_num_seqs,
  hf: hf_generate_batch_size) at max_seq_len.
- logprob on the CPU (trainer.device=cpu, where host memory is the device's) in a dtype other than
  fp32: loading casts the fp32 checkpoint (the update's exports are fp32), whose file pages are
  read in full while the cast copy is built: 4·W beside the weights until the load ends (on a GPU
  that read is host memory, not counted). The stage's peak is the larger of load and forward.
- every process: RUNTIME_GIB for the framework (a CUDA context and its libraries); a CPU process
  (trainer.device=cpu) holds CPU_RUNTIME_GIB (torch, transformers, DeepSpeed: measured 0.3-0.5
  GiB above the weights by bench/scale.py).

An estimate, not a measurement: bench/checkpointing.py prints measured peaks beside it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from configs.loader import get_path
from configs.schema import ConfigError

GIB = 2 ** 30
RUNTIME_GIB = 1.0
CPU_RUNTIME_GIB = 0.5
LOGIT_CHUNK = 1024  # positions per vocab projection in stages/model/models.py (DEFAULT_CHUNK; a test ties them)
ACTOR, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "float16": 2, "fp16": 2, "auto": 2}


class DoesNotFit(ConfigError):
    """A stage's estimated peak does not fit the device memory; carries suggestions."""

    def __init__(self, message: str, stage: str, suggestions: list[str]):
        super().__init__(message)
        self.stage, self.suggestions = stage, suggestions


def read_architecture(model_dir) -> dict | None:
    """The shape of the model in an HF folder (its config.json), or None when there is none."""
    path = Path(os.path.expanduser(str(model_dir))) / "config.json"
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not all(k in c for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")):
        return None
    h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or h // heads
    kv = (c.get("num_key_value_heads") or heads) * head_dim
    i, vocab, tied = c.get("intermediate_size") or 4 * h, c["vocab_size"], bool(c.get("tie_word_embeddings"))
    bias = (h + 2 * kv) if c.get("model_type") == "qwen2" or c.get("attention_bias") else 0
    per_layer = h * h + 2 * h * kv + h * h + bias + 3 * h * i + 2 * h
    return {"hidden": h, "layers": layers, "kv": kv, "intermediate": i, "vocab": vocab, "tied": tied,
            "params": vocab * h * (1 if tied else 2) + layers * per_layer + h}


# (token-budget key, micro-batch rows key) of the plan's entries for each kind of pass
PASSES = {"train": ("max_token_len_per_micro_batch", "ppo_micro_batch_size_per_gpu"),
          "log_prob": ("log_prob_max_token_len_per_gpu", "log_prob_micro_batch_size_per_gpu"),
          "values": ("forward_max_token_len_per_gpu", "forward_micro_batch_size_per_gpu")}


def _tokens(role: dict, kind: str, seq_len: int) -> int:
    """Tokens of one micro-batch: the token budget, or micro rows × max_seq_len."""
    budget_key, rows_key = PASSES[kind]
    if role.get(budget_key):
        return int(role[budget_key])
    return int(role.get(rows_key) or 1) * seq_len


def _layer_values(a: dict) -> int:
    return 8 * a["hidden"] + 2 * a["kv"] + 4 * a["intermediate"]


LORA_MODULES = {"q_proj": ("h", "h"), "k_proj": ("h", "kv"), "v_proj": ("h", "kv"), "o_proj": ("h", "h"),
                "gate_proj": ("h", "i"), "up_proj": ("h", "i"), "down_proj": ("i", "h")}


def adapter_params(a: dict, rank: int, targets="all-linear") -> int:
    """LoRA parameters: r × (in + out) per adapted linear layer (all-linear: the seven projections
    of each layer, not the LM head)."""
    names = list(LORA_MODULES) if targets == "all-linear" else [t for t in ([targets] if isinstance(targets, str)
                                                                         else targets) if t in LORA_MODULES]
    width = {"h": a["hidden"], "kv": a["kv"], "i": a["intermediate"]}
    return rank * a["layers"] * sum(width[LORA_MODULES[n][0]] + width[LORA_MODULES[n][1]] for n in names)


def trainable_params(cfg, a: dict, model_key: str, value_head: bool) -> int:
    """Every parameter, or with lora_rank the adapters plus a critic's value head."""
    rank = int(get_path(cfg, f"{model_key}.lora_rank") or 0)
    if not rank:
        return a["params"]
    targets = get_path(cfg, f"{model_key}.target_modules") or "all-linear"
    return adapter_params(a, rank, targets) + ((a["hidden"] + 1) if value_head else 0)


def runtime_gib(cfg) -> float:
    """The framework's own memory in every process: CUDA context and libraries, or a CPU process's."""
    return CPU_RUNTIME_GIB if get_path(cfg, "trainer.device") == "cpu" else RUNTIME_GIB


def _update(cfg, role: dict, a: dict, model_key: str, offload_key: str, vocab_out: int, seq_len: int) -> dict:
    zero = get_path(cfg, f"{ACTOR}.deepspeed.zero_stage")
    mixed = get_path(cfg, f"{ACTOR}.deepspeed.dtype") == "bf16"
    b, W, dp = (2 if mixed else 4), a["params"], role["dp_size"]
    P = trainable_params(cfg, a, model_key, value_head=vocab_out == 1)
    offload = get_path(cfg, offload_key) or {}
    checkpointing = bool(get_path(cfg, f"{model_key}.enable_gradient_checkpointing"))
    T = _tokens(role, "train", seq_len)
    layer = _layer_values(a)
    parts = {
        "weights": 0 if offload.get("param_offload") and zero == 3 else b * W / (dp if zero == 3 else 1),
        "gradients": b * P / (dp if zero >= 2 else 1),
        "master_gradients": 0 if offload.get("optimizer_offload") else 4 * P / dp,
        "optimizer": 0 if offload.get("optimizer_offload") else 12 * P / dp,
        "activations": T * b * (a["layers"] * a["hidden"] + layer if checkpointing else a["layers"] * layer),
        "logits": 3 * 4 * min(T, LOGIT_CHUNK) * vocab_out,
        "runtime": runtime_gib(cfg) * GIB,
    }
    states = parts["gradients"] + parts["master_gradients"] + parts["optimizer"]
    # after training, the export gathers every parameter as an fp32 copy on each rank (and with
    # LoRA a merged copy beside it) while the weights and optimizer states are still allocated
    export_copy = 4 * W * (2 if P != W else 1)
    export = parts["weights"] + states + export_copy + parts["runtime"]
    train = sum(parts.values())
    lora16 = adapter_params(a, 16)
    return {"tokens_per_micro_batch": T, "gradient_checkpointing": checkpointing, "zero_stage": zero, "dp": dp,
            "trainable_params": P, "lora": P != W, "model_key": model_key,
            "lora16_saves_gib": round(states * (1 - lora16 / P) / GIB, 3) if P == W else 0.0,
            "parts_gib": {k: round(v / GIB, 3) for k, v in parts.items()},
            "train_gib": round(train / GIB, 3), "export_gib": round(export / GIB, 3),
            "total_gib": round(max(train, export) / GIB, 3),
            "held_gib": round((parts["weights"] + states) / GIB, 3),
            "transient_gib": round(max(parts["activations"] + parts["logits"], export_copy) / GIB, 3)}


def update_stage(roles: dict) -> dict:
    """The update stage of a config with a critic: both roles' engines live in one process per rank
    (stages/training/worker.py), each holding its weights and states for the whole stage, while
    one role at a time trains (activations, logits) or exports (its gathered fp32 copy): the peak
    is both roles' held memory plus the largest transient, plus one runtime."""
    held = {f"{name} held": est["held_gib"] for name, est in roles.items()}
    parts = {**held, "largest transient": max(est["transient_gib"] for est in roles.values()), "runtime": next(iter(roles.values()))["parts_gib"]["runtime"]}
    return {"roles": list(roles), "parts_gib": parts, "total_gib": round(sum(parts.values()), 3)}


def _logprob(cfg, lp: dict, kind: str, a: dict, b: int, vocab_out: int, seq_len: int) -> dict:
    T = _tokens(lp, kind, seq_len)
    cpu = get_path(cfg, "trainer.device") == "cpu"
    parts = {"weights": b * a["params"], "activations": T * b * _layer_values(a),
             "logits": 3 * 4 * min(T, LOGIT_CHUNK) * vocab_out,
             "fp32 checkpoint read": 4 * a["params"] if cpu and b != 4 else 0,
             "runtime": runtime_gib(cfg) * GIB}
    load = parts["weights"] + parts["fp32 checkpoint read"] + parts["runtime"]
    forward = sum(parts.values()) - parts["fp32 checkpoint read"]
    return {"tokens_per_micro_batch": T, "parts_gib": {k: round(v / GIB, 3) for k, v in parts.items()},
            "load_gib": round(load / GIB, 3), "total_gib": round(max(load, forward) / GIB, 3)}


def _rollout(cfg, a: dict, seq_len: int, device_gib: float | None) -> dict:
    name = get_path(cfg, f"{ROLLOUT}.name")
    if name == "vllm" and device_gib:
        share = get_path(cfg, f"{ROLLOUT}.gpu_memory_utilization")
        return {"engine": name, "parts_gib": {"gpu_memory_utilization share": round(share * device_gib, 3)},
                "total_gib": round(share * device_gib + runtime_gib(cfg), 3)}
    b = DTYPE_BYTES.get(str(get_path(cfg, f"{ROLLOUT}.dtype")), 2) if name == "vllm" else 4
    seqs = get_path(cfg, f"{ROLLOUT}.max_num_seqs") if name == "vllm" else get_path(cfg, f"{ROLLOUT}.hf_generate_batch_size")
    tp = get_path(cfg, f"{ROLLOUT}.tensor_model_parallel_size") or 1
    parts = {"weights": b * a["params"] / tp, "kv_cache": 2 * a["layers"] * a["kv"] * seq_len * int(seqs or 1) * b / tp,
             "runtime": runtime_gib(cfg) * GIB}
    return {"engine": name, "sequences_at_once": seqs, "parts_gib": {k: round(v / GIB, 3) for k, v in parts.items()},
            "total_gib": round(sum(parts.values()) / GIB, 3)}


def device_memory_gib(cfg) -> float | None:
    """trainer.device_memory_gib, else a CUDA device's total memory, else None (no fit check)."""
    declared = get_path(cfg, "trainer.device_memory_gib")
    if declared:
        return float(declared)
    if get_path(cfg, "trainer.device") == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_properties(0).total_memory / GIB
        except Exception:  # noqa: BLE001 - no CUDA here: nothing to read
            return None
    return None


def estimate_memory(cfg, plan: dict) -> dict | None:
    """{stage: estimate} per rank (rollout: per replica), or None when the actor's model folder
    has no readable config.json."""
    actor_arch = read_architecture(get_path(cfg, "actor_rollout_ref.model.path"))
    if actor_arch is None:
        return None
    seq_len, device = plan["max_seq_len"], device_memory_gib(cfg)
    b = 2 if get_path(cfg, f"{ACTOR}.deepspeed.dtype") == "bf16" else 4
    out = {"device_memory_gib": device, "model_params": actor_arch["params"],
           "rollout": _rollout(cfg, actor_arch, seq_len, device),
           "update_actor": _update(cfg, plan["actor"], actor_arch, "actor_rollout_ref.model",
                                   f"{ACTOR}.fsdp_config", actor_arch["vocab"], seq_len)}
    if plan["rollout"].get("old_log_prob_pass", True):
        out["logprob_actor"] = _logprob(cfg, plan["rollout"], "log_prob", actor_arch, b, actor_arch["vocab"], seq_len)
    if plan["ref"]:
        out["logprob_ref"] = _logprob(cfg, plan["ref"], "log_prob", actor_arch, b, actor_arch["vocab"], seq_len)
    if plan["critic"]:
        critic_arch = read_architecture(get_path(cfg, "critic.model.path")) or actor_arch
        critic_arch = {**critic_arch, "params": critic_arch["params"] - critic_arch["vocab"] * critic_arch["hidden"]
                       * (0 if critic_arch["tied"] else 1) + critic_arch["hidden"] + 1}  # value head, no LM head
        out["update_critic"] = _update(cfg, plan["critic"], critic_arch, "critic.model", "critic.model.fsdp_config",
                                       1, seq_len)
        out["logprob_critic"] = _logprob(cfg, plan["critic"], "values", critic_arch, b, 1, seq_len)
        out["update"] = update_stage({"actor": out["update_actor"], "critic": out["update_critic"]})
    return out


def _update_tips(est: dict, device: float) -> list[tuple]:
    """(GiB saved, change, whether it changes what is trained) for one role's update."""
    parts, tips = est["parts_gib"], []
    prefix, offload = (("critic", "critic.model.fsdp_config") if est["model_key"] == "critic.model"
                       else (ACTOR, f"{ACTOR}.fsdp_config"))
    if not est["gradient_checkpointing"] and parts["activations"] > 0.1 * device:
        tips.append((parts["activations"], f"{est['model_key']}.enable_gradient_checkpointing=true", False))
    T = est["tokens_per_micro_batch"]  # halving it halves activations; logits only below the chunk
    logits_left = parts["logits"] * min(T // 2, LOGIT_CHUNK) / max(1, min(T, LOGIT_CHUNK))
    tips.append((parts["activations"] / 2 + parts["logits"] - logits_left,
                 f"halve {prefix}.ppo_micro_batch_size_per_gpu (or ppo_max_token_len_per_gpu)", False))
    if parts["optimizer"] > 0:
        tips.append((parts["optimizer"] + parts["master_gradients"], f"{offload}.optimizer_offload=true", False))
    if est["zero_stage"] < 3 and est["dp"] > 1:
        tips.append((parts["weights"] * (1 - 1 / est["dp"]), f"{ACTOR}.deepspeed.zero_stage=3", False))
    if est["lora16_saves_gib"] > 0:
        tips.append((est["lora16_saves_gib"], f"{est['model_key']}.lora_rank=16", True))
    return tips


def check_fits(cfg, estimate: dict | None) -> None:
    """Refuse (DoesNotFit) a stage whose estimate exceeds the device memory, naming the stage and
    the cheapest changes first: those that leave the results unchanged (checkpointing, smaller
    micro-batches, offload, ZeRO-3) before LoRA (which trains something else), and among them the
    ones that are enough on their own, largest saving first."""
    if not estimate or not estimate.get("device_memory_gib"):
        return
    device = estimate["device_memory_gib"]
    for stage, est in estimate.items():
        if not isinstance(est, dict) or est["total_gib"] <= device:
            continue
        parts, tips = est["parts_gib"], []  # (GiB saved, change, changes what is trained)
        if stage == "update":  # actor and critic in one process: either's changes help
            tips = [t for role in est["roles"] for t in _update_tips(estimate[f"update_{role}"], device)]
        elif stage.startswith("update"):
            tips = _update_tips(est, device)
        elif stage.startswith("logprob"):
            tips.append((parts["logits"] / 2, "halve the stage's log_prob/forward micro-batch size", False))
        else:
            tips.append((est["total_gib"] - device, f"{ROLLOUT}.gpu_memory_utilization lower, or "
                                                   f"{ROLLOUT}.tensor_model_parallel_size higher", False))
        excess = est["total_gib"] - device
        tips.sort(key=lambda t: (t[2], t[0] < excess, -t[0]))
        raise DoesNotFit(f"the {stage.replace('_', ' ')} stage needs ~{est['total_gib']:.1f} GiB per rank, "
                         f"more than the device's {device:.1f} GiB ({', '.join(f'{k} {v:.1f}' for k, v in parts.items())}"
                         f" GiB); try: " + "; ".join(f"{t} (saves ~{s:.1f} GiB{', enough alone' if s >= excess else ''}"
                                                     f"{', trains adapters only' if lora else ''})" for s, t, lora in tips),
                         stage, [t for _, t, _ in tips])


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def check_host_fits(cfg, plan: dict, estimate: dict | None, host_gib: float | None = None) -> None:
    """On the CPU (trainer.device=cpu, every stage on this host) the resident rollout engines (one
    process per replica and tensor-parallel worker, kept alive through the update) and the update's
    ranks share the host's memory: refuse (DoesNotFit) when their estimates alone exceed it, before
    anything starts (the kernel's OOM killer would otherwise stop an engine mid-rollout)."""
    if not estimate or get_path(cfg, "trainer.device") != "cpu" or get_path(cfg, "orchestration.mode") != "local":
        return
    host = host_gib or host_memory_gib()
    rollout = plan["rollout"]
    workers = rollout["num_replicas"] * rollout["tensor_model_parallel_size"]
    engine_gib = estimate["rollout"]["total_gib"]
    rank_gib = (estimate.get("update") or estimate["update_actor"])["total_gib"]
    need = workers * engine_gib + plan["n_gpus"] * rank_gib
    if need > host:
        tips = ["fewer ranks (trainer.n_gpus_per_node: on the CPU each is a process, not a device)",
                f"fewer rollout replicas ({ROLLOUT}.tensor_model_parallel_size × data_parallel_size "
                f"closer to the world size)"]
        raise DoesNotFit(f"on the CPU the rollout engines and the update's ranks share this host's {host:.1f} GiB: "
                         f"{rollout['num_replicas']} replica(s) × TP {rollout['tensor_model_parallel_size']} engine "
                         f"processes × ~{engine_gib:.1f} GiB + {plan['n_gpus']} ranks × ~{rank_gib:.1f} GiB ≈ "
                         f"{need:.1f} GiB; try: " + "; ".join(tips), "host", tips)
